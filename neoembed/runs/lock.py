"""One writer per output folder: an OS lock (``flock``) on ``.<folder>.neoembed-lock`` beside it, held for the
whole run; a second writer is refused (exit 2) naming the holder, before it touches the folder."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from neoembed.runs.errors import OutputDirError, OutputLockedError

if TYPE_CHECKING:
    pass



# Locks this process holds: {lock file: [fd, depth]}. A command and the library function it calls may both take
# the lock of one folder; flock locks belong to an open file, so a second open here would refuse ourselves.
_HELD: dict[str, list[int]] = {}


def lock_path(folder: str | Path) -> Path:
    """The lock file of an output folder: ``.<name>.neoembed-lock`` beside it, so that taking the lock (or being
    refused it) leaves the folder itself untouched. Beside the folder a path names after its links are followed
    (a link to a run's folder is that run, and takes its lock), unless that folder's parent cannot be written to
    (``~/runs/x -> /scratch/$USER`` under a read-only ``/scratch``): then beside the path as given."""
    given = Path(os.path.abspath(folder))
    real = Path(os.path.realpath(folder))
    beside = real if _writable(real.parent) else given
    return beside.parent / f".{beside.name}.neoembed-lock"


def _writable(folder: Path) -> bool:
    """Whether a file can be made in ``folder``, or in the nearest existing folder above it (made on the way)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return os.access(folder, os.W_OK | os.X_OK)


def _holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        info = json.loads(os.read(fd, 4096) or b"{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']} ({info['command']})"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet"


def _open_locked(path: Path, folder: Path, what: str) -> int:
    """Open and ``flock`` the lock file, or raise :class:`OutputLockedError` naming the holder. A file left by a
    killed process holds no lock (the OS drops a flock with its process, even on kill -9) and is taken over."""
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise OutputLockedError(
                f"{what} {folder} is in use by another neoembed command ({holder}; lock {path}): wait for it to "
                f"finish or stop it, or choose another {what}"
            ) from None
        # the holder removes the file on release: a lock taken on a removed file is no lock, open again
        if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
            return fd
        os.close(fd)


def launched_main() -> bool:
    """Whether this process is the main one of its launch (``RANK`` 0 or unset): it alone locks, checks and
    clears an output folder, before the processes have joined."""
    return int(os.environ.get("RANK", "0") or 0) == 0


@contextlib.contextmanager
def output_lock(
    folder: str | Path, what: str = "output_dir", main_process: bool | None = None
) -> Iterator[None]:
    """Hold the output folder ``folder`` for the ``with`` block: one writer per folder, released on any exit
    (an exception, SIGINT, SIGTERM: the OS drops the lock of a killed process, so no stale lock survives it).

    A second writer, in this process's stead another one, is refused at once with :class:`OutputLockedError`
    (exit 2) naming the folder and the holding pid, before the folder is touched. Reentrant within a process
    (a command and the function it calls). Only the main process of a distributed run locks
    (``main_process``, default: ``RANK`` 0 or unset). Every command that writes a folder uses it (``neoembed
    export`` included)."""
    if main_process is None:
        main_process = launched_main()
    if not main_process:
        yield
        return
    if Path(folder).exists() and not Path(folder).is_dir():  # else mkdir's bare "[Errno 17] File exists"
        raise OutputDirError(f"{what} {folder} is a file, not a folder: choose a folder path")
    if Path(folder).is_symlink() and not Path(folder).exists():  # the same mkdir error, after the run
        raise OutputDirError(
            f"{what} {folder} is a link to {os.readlink(folder)}, which does not exist: make that folder, or "
            "choose another path"
        )
    path = lock_path(folder)
    key = str(path)
    if key in _HELD:
        _HELD[key][1] += 1
        try:
            yield
        finally:
            _HELD[key][1] -= 1
        return
    created = _make_parents(path.parent)
    try:
        fd = _open_locked(path, Path(folder), what)
    except BaseException:
        _remove_dirs(created)
        raise
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    info["command"] = " ".join(["neoembed", *sys.argv[1:3]])
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    _HELD[key] = [fd, 1]
    try:
        yield
    finally:
        del _HELD[key]
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)
        _remove_dirs(created)


def _make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; returns the ones created, deepest first."""
    created = []
    p = folder
    while not p.exists():
        created.append(p)
        p = p.parent
    if created:
        try:
            folder.mkdir(parents=True)
        except OSError as e:
            raise OutputDirError(
                f"cannot create {folder} ({e.strerror}): choose a writable location"
            ) from None
    elif not os.access(folder, os.W_OK | os.X_OK):
        raise OutputDirError(f"{folder} is not writable: choose an output folder in a writable location")
    return created


def _remove_dirs(created: list[Path]) -> None:
    """Remove the folders :func:`_make_parents` created if they are still empty (a refused command leaves
    nothing behind)."""
    for p in created:
        with contextlib.suppress(OSError):
            p.rmdir()
