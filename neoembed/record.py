"""Run records: every command that produces results writes one ``run_record.json`` beside them.

A record holds the resolved recipe, the seed, the git SHA of the code, the versions of the packages
that matter, the hardware, the command line, and a hash of every data file the run read.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "RUN_RECORD",
    "add_to_run_record",
    "atomic_write_text",
    "collect_run_record",
    "file_sha256",
    "git_sha",
    "write_run_record",
]

#: the file every command that produces results writes beside them
RUN_RECORD = "run_record.json"
#: the run record's key for a finished run: the step its final model was saved at and the entries that model put
#: in the output folder (absent: the run has not finished)
FINISHED = "finished"

PACKAGES = (
    "neoembed",
    "torch",
    "transformers",
    "sentence-transformers",
    "datasets",
    "accelerate",
    "mteb",
    "safetensors",
    "faiss-cpu",
    "faiss-gpu-cu12",
    "flash-attn",
    "numpy",
)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:  # an interrupted write leaves no file that no later run (another pid) would remove
        tmp.unlink(missing_ok=True)
        raise


def readable_weights(folder: str | Path) -> None:
    """Give the ``*.safetensors`` files under ``folder`` that only their owner can read the mode any other file
    written there gets (0666 less the umask). safetensors 0.8 writes through a temporary file created 0600 and
    renames it (its issue #782; sentence-transformers #4010): a saved model's weights were unreadable to a
    service account or a container's user while its config was not."""
    mask = _umask()
    for path in Path(folder).rglob("*.safetensors"):
        if path.stat().st_mode & 0o777 == 0o600 and 0o666 & ~mask != 0o600:
            path.chmod(0o666 & ~mask)


def _umask() -> int:
    """The process's umask, read where Linux shows it: setting it to read it back (the portable way) would give
    files another thread creates meanwhile a umask of 0."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """The file's SHA-256, read once per process while its inode, size and modification time stay the same (a
    run start hashes its data for the resume check and again for the run record)."""
    st = os.stat(path)
    return _sha256(os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, chunk)


#: files smaller than this are known by their content too; larger ones by size and modification time alone
#: (hashing gigabytes at every start would cost more than a same-size edit risks)
HASHED_BELOW = 32 * 2**20


def file_stamp(path: str | Path) -> dict:
    """What identifies a file's contents for a cache key or a reuse check: its size and modification time, and
    below :data:`HASHED_BELOW` its SHA-256 (mtime ticks are coarse, and a copy keeps the content, not the time)."""
    st = os.stat(path)
    out = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if st.st_size < HASHED_BELOW:
        out["sha256"] = file_sha256(path)
    return out


def content_stamp(path: str | Path) -> str:
    """:func:`file_stamp` as one string that leaves the time out where the content is known (a copy of a small
    file elsewhere, or touched, has the same stamp; an edit does not)."""
    st = file_stamp(path)
    return st.get("sha256") or f"{st['size']}:{st['mtime_ns']}"


@functools.lru_cache(maxsize=256)
def _sha256(path: str, inode: int, size: int, mtime_ns: int, chunk: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def git_sha(start: str | Path | None = None) -> str | None:
    """SHA of the git checkout holding the neoembed code (or ``start``), with ``-dirty`` if it has changes.

    Changes under ``benchmarks/results/`` do not count: a benchmark rewrites its own record as it goes (a run cut
    short keeps its first rows), and its later writes would otherwise call the tree that produced them dirty.

    ``NEOEMBED_COMMIT``, when set, is the answer: a copy of the tree whose ``.git`` is not its own (the GPU machine
    receives the working tree with a stale ``.git`` beside it, which named the wrong commit) says what it is."""
    if os.environ.get("NEOEMBED_COMMIT"):
        return os.environ["NEOEMBED_COMMIT"]
    where = Path(start) if start else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ":(top)",
                ":(top,exclude)benchmarks/results",
            ],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["cuda"] = torch.version.cuda
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return info


def collect_run_record(
    command: str,
    recipe: Any = None,
    seed: int | None = None,
    data_files: Iterable[str | Path] = (),
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    if recipe is not None and hasattr(recipe, "model_dump"):
        recipe = recipe.model_dump(mode="json")
    if seed is None and isinstance(recipe, dict):
        seed = recipe.get("seed")
    data = {}
    for f in data_files:
        p = Path(f)
        if p.is_file():
            data[str(p)] = file_sha256(p)
    return {
        "command": command,
        "argv": sys.argv,
        "time_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "seed": seed,
        "recipe": recipe,
        "git_sha": git_sha(),
        "packages": package_versions(),
        "hardware": hardware(),
        "data": data,
        **(extra or {}),
    }


def write_run_record(out_dir: str | Path, command: str, **kwargs: Any) -> Path:
    """Collect a run record (see :func:`collect_run_record`) and write ``out_dir/run_record.json``."""
    return _write_record(Path(out_dir), collect_run_record(command, **kwargs))


def add_to_run_record(out_dir: str | Path, entries: dict[str, Any]) -> None:
    """Add ``entries`` to ``out_dir/run_record.json`` (written at the start) once the run has them; no record
    there (a process that did not write one): nothing to add to."""
    path = Path(out_dir) / RUN_RECORD
    if path.is_file():
        _write_record(Path(out_dir), {**json.loads(path.read_text()), **entries})


def _write_record(out_dir: Path, record: dict[str, Any]) -> Path:
    """The one writer of ``run_record.json`` (tests/test_recipe_record.py checks that no other code does)."""
    path = out_dir / RUN_RECORD
    atomic_write_text(path, json.dumps(record, indent=2, default=str) + "\n")
    return path
