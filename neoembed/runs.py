"""Run-folder plumbing shared by neoembed's training loops (pre-training, CDE, and the unified trainer through
its callbacks) and by every command that writes an output folder.

What it guarantees:

- **an output folder is never silently reused** (:func:`prepare_output_dir`): a non-empty folder is an error unless
  the caller says ``resume`` (the folder's run must be this run: same recipe, up to the settings that do not change
  the trajectory) or ``overwrite`` (the folder is cleared);
- **checkpoints survive any kill** (:func:`stage_checkpoint`, :func:`commit_checkpoint`,
  :func:`find_resume_checkpoint`): a checkpoint is written to ``.checkpoint-N.partial``, every file's size and
  SHA-256 go into a completion marker written last, then the folder is renamed to ``checkpoint-N``; a resume
  takes the newest checkpoint whose marker and files agree and says which it skipped and why;
- **exit codes tell the truth**: :class:`TrainingInterrupted` (SIGINT 130, SIGTERM 143) after the checkpoint,
  :class:`TrainingStopped` (1) for a run that cannot go on, ``ValueError`` / ``OSError`` (2) for bad input;
- **one writer per output folder** (:func:`output_lock`): every command that writes a folder holds an OS lock
  (``flock``) on ``.<folder>.neoembed-lock`` beside it for its whole run; a second writer is refused (exit 2)
  naming the holder, before it touches the folder;
- **metrics** (``metrics.jsonl``, ``training_curves.png``, TensorBoard) are trimmed to the resumed step, and a run
  whose loss and gradient stay at zero is reported (:class:`MetricsLog`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neoembed.record import RUN_RECORD, atomic_write_text, file_sha256

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "CHECKPOINT_MARKER",
    "TRACKERS",
    "TRACKER_PROJECT",
    "check_mlflow_store",
    "check_trackers",
    "MissingTracker",
    "recipe_hyperparameters",
    "tensorboard_hparams",
    "progress_line",
    "CheckpointWriteError",
    "FinalSaveInterrupted",
    "MetricsLog",
    "OutputDirError",
    "OutputLockedError",
    "StopSignal",
    "TrainingInterrupted",
    "TrainingStopped",
    "check_device",
    "check_pair_counts",
    "check_pairs",
    "check_weight_files",
    "claim_results_dir",
    "default_results_dir",
    "commit_checkpoint",
    "find_resume_checkpoint",
    "list_checkpoints",
    "lock_path",
    "model_identity",
    "output_lock",
    "param_groups",
    "prepare_output_dir",
    "prune_checkpoints",
    "resume_defaults",
    "resume_settings",
    "run_identity",
    "save_final_model",
    "stage_checkpoint",
    "trim_metrics",
    "verify_checkpoint",
    "write_failed",
]

logger = logging.getLogger(__name__)

CHECKPOINT_MARKER = "checkpoint_complete.json"
RECORD = RUN_RECORD
# Recipe keys that say where and how often a run writes, not what it computes: a resume may change them. ``eval``
# (evaluation during training) restores every random stream after scoring, so it does not move the training either.
NON_TRAJECTORY_KEYS = frozenset(
    {
        "output_dir",
        "save_steps",
        "save_total_limit",
        "logging_steps",
        "report_to",
        "clustering.cache_dir",
        "eval",
    }
)
# Exit statuses of a run stopped by a signal, as a shell reports a process killed by it (128 + number).
SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}


class TrainingStopped(RuntimeError):
    """A run stopped before its end (NaN/inf loss, out of memory, a checkpoint that could not be written); the
    message says why and what to do. The command line exits with status 1, printing ``label: message``."""

    exit_code = 1
    label = "training stopped"


class TrainingInterrupted(TrainingStopped):
    """SIGINT / SIGTERM: the run wrote a checkpoint and stopped; ``--resume`` continues it. Exit 130 / 143."""

    def __init__(self, signal_name: str, checkpoint: Path | None):
        self.signal_name, self.checkpoint = signal_name, checkpoint
        self.exit_code = SIGNAL_EXIT.get(signal_name, 1)
        super().__init__(
            f"stopped by {signal_name}; checkpoint {checkpoint} written: continue with --resume"
            if checkpoint is not None
            else f"stopped by {signal_name} before the first step; nothing to resume"
        )


class CheckpointWriteError(TrainingStopped):
    """A checkpoint could not be written (a full disk, say); the previous checkpoint is intact."""


class OutputDirError(ValueError):
    """An output folder that cannot be used as asked (exit 2); the message names the fix."""


class OutputLockedError(OutputDirError):
    """Another process is writing the output folder (exit 2); the message names the folder and the holder."""


# ------------------------------------------------------------------------------------------- output lock
# Locks this process holds: {lock file: [fd, depth]}. A command and the library function it calls may both take
# the lock of one folder; flock locks belong to an open file, so a second open here would refuse ourselves.
_HELD: dict[str, list[int]] = {}


def lock_path(folder: str | Path) -> Path:
    """The lock file of an output folder: ``.<name>.neoembed-lock`` beside it, so that taking the lock (or being
    refused it) leaves the folder itself untouched."""
    folder = Path(os.path.abspath(folder))
    return folder.parent / f".{folder.name}.neoembed-lock"


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
        main_process = int(os.environ.get("RANK", "0") or 0) == 0
    if not main_process:
        yield
        return
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


def check_device(device: str | None, flag: str = "--device") -> None:
    """Refuse, before any model loads, a device torch does not know or this machine does not have (exit 2)."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{flag} {device!r} is not a device: use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda" and (
        not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()
    ):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(
            f"{flag} {device}: this machine has {have} CUDA device(s); use --device cpu or another GPU"
        )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{flag} {device}: MPS is not available on this machine; use --device cpu")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{flag} {device!r}: neoembed runs on cpu, cuda or mps")


def require_module(module: str, extra: str, what: str) -> None:
    """Refuse, before any model loads, a job whose optional package is missing: the message names the extra
    that installs it (exit 2), instead of an ImportError after minutes of work."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{what} needs {module}, which is not installed: pip install -e '.[{extra}]'")


# ------------------------------------------------------------------------------------------- output folder
def resume_settings(recipe: Any) -> dict[str, Any]:
    """The recipe's settings that decide a run's trajectory, flattened to ``a.b`` keys (compared on resume)."""
    data = recipe.model_dump(mode="json") if hasattr(recipe, "model_dump") else dict(recipe)
    flat: dict[str, Any] = {}

    def walk(node, prefix):
        for key, value in node.items():
            name = f"{prefix}{key}"
            if name == "eval" and isinstance(value, dict) and value.get("holdout") is not None:
                flat["eval.holdout"] = value["holdout"]  # the held-out rows are taken out of training
            if name in NON_TRAJECTORY_KEYS:
                continue
            if isinstance(value, dict) and value:
                walk(value, name + ".")
            else:
                flat[name] = value

    walk(data, "")
    return flat


def resume_defaults(recipe: Any) -> dict[str, Any]:
    """The defaults of the recipe's fields, flattened as :func:`resume_settings` flattens its values. A run
    recorded before a field existed ran with that field's default behaviour (fields are added with defaults that
    keep it), so on resume a key missing from the folder's run and at its default now is not a difference."""
    from pydantic import BaseModel
    from pydantic_core import to_jsonable_python

    flat: dict[str, Any] = {}

    def walk(model: BaseModel, prefix: str) -> None:
        for name, field in type(model).model_fields.items():
            value = getattr(model, name)
            if isinstance(value, BaseModel):
                walk(value, f"{prefix}{name}.")
            elif not field.is_required():
                flat[f"{prefix}{name}"] = to_jsonable_python(field.get_default(call_default_factory=True))

    if isinstance(recipe, BaseModel):
        walk(recipe, "")
    return flat


def run_identity(settings: dict[str, Any] | None) -> dict[str, Any]:
    """What run records and checkpoint markers say of the run: its :func:`resume_settings` and their short hash
    (same hash, same run)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"resume_settings": settings, "recipe_hash": digest if settings is not None else None}


def _describe(folder: Path, limit: int = 5) -> str:
    names = sorted(p.name for p in folder.iterdir())
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _saved_settings(output: Path) -> dict[str, Any] | None:
    """The trajectory settings of the run that wrote ``output``: its run record, else its newest marker."""
    record = output / RECORD
    if record.is_file():
        with contextlib.suppress(ValueError, OSError):
            saved = json.loads(record.read_text()).get("resume_settings")
            if saved is not None:
                return saved
    for ckpt in reversed(list_checkpoints(output)):
        with contextlib.suppress(ValueError, OSError):
            saved = json.loads((ckpt / CHECKPOINT_MARKER).read_text()).get("resume_settings")
            if saved is not None:
                return saved
    return None


def _differences(saved: dict[str, Any], now: dict[str, Any], defaults: dict[str, Any]) -> list[str]:
    missing = "(not set)"
    # a key the folder's run predates is no difference while it is at its default now
    keys = sorted(k for k in set(saved) | set(now) if k in saved or now[k] != defaults.get(k, missing))
    return [
        f"{k}: {json.dumps(saved.get(k, missing), default=str)} in the folder's run, "
        f"{json.dumps(now.get(k, missing), default=str)} now"
        for k in keys
        if saved.get(k, missing) != now.get(k, missing)
    ]


def _check_steps(ckpt: Path, saved: dict | None, settings: dict | None) -> None:
    """``steps`` may change on resume (to extend a run: the schedule follows the new value from there), but a
    checkpoint past the new end cannot be resumed (at the end exactly, the resume only saves the final model: a
    run killed between its last checkpoint and its final save)."""
    if not settings or "steps" not in settings:
        return
    step = int(json.loads((ckpt / CHECKPOINT_MARKER).read_text())["step"])
    if step > settings["steps"]:
        raise OutputDirError(
            f"--resume: {ckpt} is at step {step}, past this run's steps={settings['steps']}: resume with "
            f"steps >= {step}, or start a new run in another output_dir"
        )
    if saved and saved.get("steps") not in (None, settings["steps"]):
        logger.warning(
            "--resume: steps %s in the folder's run, %s now: the learning-rate schedule follows the new value",
            saved["steps"],
            settings["steps"],
        )


def _clear(path: Path) -> None:
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def prepare_output_dir(
    path: str | Path,
    *,
    overwrite: bool,
    resume: bool,
    settings: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
    checkpoints: bool = True,
    what: str = "output_dir",
    main_process: bool = True,
    clearable: tuple[str, ...] = (RECORD,),
) -> Path | None:
    """Check (and with ``overwrite``, clear) an output folder before anything is loaded or written.

    - a missing or empty folder: a fresh run (``resume`` is then an error: there is nothing to continue);
    - a non-empty folder: an error unless ``resume`` or ``overwrite``. ``overwrite`` clears a folder that a
      neoembed command wrote (it holds one of the ``clearable`` files: a run record by default) and refuses any
      other;
    - ``resume``: the folder's run must have the same ``settings`` (see :func:`resume_settings`; differences are
      named; a key the folder's run predates passes at its value in ``defaults``, see :func:`resume_defaults`);
      with ``checkpoints``, returns the newest complete checkpoint (an error if there is none).

    Returns the checkpoint to resume from, or ``None``. Raises :class:`OutputDirError` (exit 2). Only the main
    process checks a fresh folder and clears; with ``resume`` every process reads the checkpoint to load."""
    out = Path(path)
    if resume and overwrite:
        raise OutputDirError("--resume and --overwrite exclude each other: continue the run, or replace it")
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{what} {out} is a file, not a folder: choose a folder path")
    if out.is_dir() and not os.access(out, os.W_OK | os.X_OK):
        raise OutputDirError(f"{what} {out} is not writable: choose another {what}, or make it writable")
    used = out.is_dir() and any(out.iterdir())
    if resume:
        if not used:
            raise OutputDirError(
                f"--resume: {what} {out} {'is empty' if out.is_dir() else 'does not exist'}, there is no run to "
                "continue: start without --resume"
            )
        saved = _saved_settings(out)
        if settings is not None and saved is not None:
            diff = _differences(
                {k: v for k, v in saved.items() if k != "steps"},
                {k: v for k, v in settings.items() if k != "steps"},
                defaults or {},
            )
            if diff:
                raise OutputDirError(
                    f"--resume: {out} holds a different run; the settings that change the trajectory differ:\n  - "
                    + "\n  - ".join(diff)
                    + "\nresume with the folder's settings, or start a new run in another output_dir "
                    "(or --overwrite to replace this one)"
                )
        if not checkpoints:
            return None
        ckpt = find_resume_checkpoint(out)
        _check_steps(ckpt, saved, settings)
        return ckpt
    if (
        not main_process
    ):  # the main process checks and clears; here its first writes could look like a used folder
        return None
    if used and not overwrite:
        raise OutputDirError(
            f"{what} {out} is not empty (it holds {_describe(out)}): pass --resume to continue the run it holds, "
            f"--overwrite to replace it, or choose a new {what}"
        )
    if used and overwrite:
        if not any((out / name).is_file() for name in clearable):
            raise OutputDirError(
                f"--overwrite: {out} holds {_describe(out)} but no {' or '.join(clearable)}, so no neoembed "
                "command wrote it; "
                f"neoembed clears only its own folders: choose a new {what}, or empty this one yourself"
            )
        logger.warning("--overwrite: clearing %s (%s)", out, _describe(out))
        _clear(out)
    return None


# ----------------------------------------------------------------------------------------------- checkpoints
def list_checkpoints(output: Path) -> list[Path]:
    """The ``checkpoint-N`` folders of a run, oldest first (complete or not: see :func:`verify_checkpoint`)."""
    found = [
        p for p in Path(output).glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name) and p.is_dir()
    ]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def _files(folder: Path) -> Iterator[Path]:
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != CHECKPOINT_MARKER:
            yield p


def verify_checkpoint(folder: Path) -> str | None:
    """``None`` if ``folder`` is a complete checkpoint (its marker lists every file with the right size and
    SHA-256), else the reason it is not."""
    marker = folder / CHECKPOINT_MARKER
    if not marker.is_file():
        return f"no {CHECKPOINT_MARKER} (its write was interrupted, or an older neoembed wrote it)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, OSError) as e:
        return f"unreadable {CHECKPOINT_MARKER} ({e})"
    for rel, info in files.items():
        p = folder / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != info["size"]:
            return f"{rel} has {p.stat().st_size} bytes, {info['size']} were written (truncated)"
        if file_sha256(p) != info["sha256"]:
            return f"{rel} does not match its checksum (corrupted)"
    return None


def find_resume_checkpoint(output: Path) -> Path:
    """The newest complete checkpoint of ``output``; the ones skipped are logged with the reason. An error that
    lists them if there is none."""
    skipped = [
        f"{p.name}: an unfinished write (interrupted)" for p in Path(output).glob(".checkpoint-*.partial")
    ]
    for ckpt in reversed(list_checkpoints(output)):
        why = verify_checkpoint(ckpt)
        if why is None:
            for s in skipped:
                logger.warning("resume: skipped %s", s)
            if skipped:
                print(f"resume: skipped {'; '.join(skipped)}; resuming from {ckpt.name}")
            return ckpt
        skipped.append(f"{ckpt.name}: {why}")
    raise OutputDirError(
        f"--resume: {output} holds no complete checkpoint"
        + (f" (skipped {'; '.join(skipped)})" if skipped else "")
        + ": start the run again without --resume (with --overwrite to replace this folder)"
    )


def stage_checkpoint(output: Path, step: int) -> Path:
    """An empty staging folder ``.checkpoint-N.partial`` (a leftover of an interrupted write is removed)."""
    staged = Path(output) / f".checkpoint-{step}.partial"
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    return staged


def commit_checkpoint(
    staged: Path,
    step: int,
    keep: int | None,
    settings: dict[str, Any] | None = None,
    output: Path | None = None,
    protect: int | None = None,
) -> Path:
    """Seal a fully written staging folder: the completion marker (every file's size and SHA-256) written last,
    then renamed to ``checkpoint-N`` (replacing an older one of that step); the ``keep`` newest complete
    checkpoints are kept, and the one of step ``protect``. A kill at any point leaves either the previous
    checkpoints or the new one complete. ``output``: the run folder (default: the staging folder's parent)."""
    output = Path(output) if output is not None else staged.parent
    files = {
        p.relative_to(staged).as_posix(): {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in _files(staged)
    }
    marker = {"step": step, "files": files, **run_identity(settings)}
    atomic_write_text(staged / CHECKPOINT_MARKER, json.dumps(marker, indent=1) + "\n")
    target = output / f"checkpoint-{step}"
    if target.exists():  # an older checkpoint of this step: moved aside first, so one of the two stays whole
        aside = output / f".checkpoint-{step}.old"
        shutil.rmtree(aside, ignore_errors=True)
        target.rename(aside)
        staged.rename(target)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        staged.rename(target)
    for stale in output.glob(".checkpoint-*.partial"):  # left by a killed run: no write is under way now
        shutil.rmtree(stale, ignore_errors=True)
    prune_checkpoints(output, keep, protect)
    return target


def write_failed(staged: Path, step: int, error: BaseException) -> CheckpointWriteError:
    """Remove a checkpoint whose write failed (``staged`` sits in the run folder); the error to raise names the
    intact previous checkpoint."""
    shutil.rmtree(staged, ignore_errors=True)
    previous = [c for c in list_checkpoints(staged.parent) if verify_checkpoint(c) is None]
    return CheckpointWriteError(
        f"could not write checkpoint-{step} in {staged.parent}: {type(error).__name__}: {error}. Is the disk "
        f"full? The previous checkpoint {previous[-1] if previous else '(none)'} is intact: free some space, then "
        "--resume"
    )


def prune_checkpoints(output: Path, keep: int | None, protect: int | None = None) -> None:
    """Delete all but the ``keep`` newest checkpoints (``None`` or 0 keeps all) and the one of step ``protect``
    (the best so far, ``keep_best``)."""
    if keep:
        for old in list_checkpoints(output)[:-keep]:
            if old.name != f"checkpoint-{protect}":
                shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ weights
def check_weight_files(folder: str | Path) -> None:
    """Read the header of every ``*.safetensors`` file of a model folder and check that the file holds every byte
    the header promises, so that a truncated file fails here, by name, before anything loads (safetensors' own
    error names neither the file nor the fix). Hub ids and non-folders are left to the loader."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for f in sorted(folder.rglob("*.safetensors")):
        size = f.stat().st_size
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if n <= 0 or 8 + n > size:
                    raise ValueError(f"its header claims {n} bytes")
                header = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise OutputDirError(
                f"weights file {f} is not a valid safetensors file ({e}): it is truncated or corrupt; copy or "
                "convert the model again"
            ) from None
        if 8 + n + end != size:
            raise OutputDirError(
                f"weights file {f} has {size} bytes, its header describes {8 + n + end}: it is truncated (an "
                "interrupted copy or download?); copy or convert the model again"
            )


# ---------------------------------------------------------------------------------------------- optimizer
def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices and embeddings, not on norms and biases."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ------------------------------------------------------------------------------------------------- signals
class StopSignal:
    """SIGTERM / Ctrl-C set a flag; the loop checkpoints after the current step. A second Ctrl-C aborts."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread
                self._previous[sig] = signal.signal(sig, self.handle)
        return self

    def handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        logger.warning("%s received: checkpointing after this step, then stopping", self.received)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class FinalSaveInterrupted(TrainingInterrupted):
    """SIGINT / SIGTERM while the final model was being written: none of it was kept (exit 130 / 143)."""

    def __init__(self, signal_name: str, output: Path, checkpoint: Path | None):
        super().__init__(signal_name, checkpoint)
        again = (
            f"--resume continues from {checkpoint} and saves it"
            if checkpoint is not None
            else "run the command again (with --overwrite)"
        )
        self.args = (
            f"stopped by {signal_name} while the final model was being saved: no final model was written to "
            f"{output} (nothing half-written); {again}",
        )


class _Signalled(BaseException):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class _FinalSaveSignals:
    """SIGINT / SIGTERM raise :class:`_Signalled` while the model is written, and wait while it is moved in."""

    def __init__(self):
        self.deferring, self.received, self._previous = False, None, {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread
                self._previous[sig] = signal.signal(sig, self.handle)
        return self

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if not self.deferring:
            raise _Signalled(name)
        self.received = name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def save_final_model(output: str | Path, save: Callable[[Path], None]) -> None:
    """Write a run's final model all or nothing: ``save(folder)`` writes it into ``output/.final.partial``,
    whose entries are then moved into ``output`` (renames, with SIGINT / SIGTERM held until they are done).

    A signal while ``save`` runs removes the partial folder and raises :class:`FinalSaveInterrupted` (exit 130 /
    143) naming the checkpoint that ``--resume`` continues from; so does any error (re-raised as it is)."""
    output = Path(output)
    staged = output / ".final.partial"
    shutil.rmtree(staged, ignore_errors=True)
    with _FinalSaveSignals() as signals:
        try:
            save(staged)
        except _Signalled as e:
            shutil.rmtree(staged, ignore_errors=True)
            ckpts = list_checkpoints(output)
            raise FinalSaveInterrupted(e.name, output, ckpts[-1] if ckpts else None) from None
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        signals.deferring = True
        for entry in sorted(staged.iterdir()):
            target = output / entry.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(entry, target)
        staged.rmdir()
    if signals.received is not None:
        logger.warning(
            "%s received while the final model was moved in: it is complete in %s", signals.received, output
        )


# ------------------------------------------------------------------------------------------------- metrics
DEGENERATE_ROWS = 20


# report_to name -> (the module it needs, the neoembed extra that installs it)
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}


# the W&B / Trackio project of every neoembed run (WANDB_PROJECT / TRACKIO_PROJECT choose another); a run is named
# after its output folder
TRACKER_PROJECT = "neoembed"


def recipe_hyperparameters(recipe) -> dict[str, Any]:
    """The whole validated recipe as ``recipe.a.b`` keys (lists as JSON text), as trackers take hyperparameters;
    every trainer sends these same keys. The prefix keeps them apart from what transformers' integrations log
    under bare names (TrainingArguments, the model config: its ``max_length`` is not the recipe's)."""
    flat: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = (
                    value if isinstance(value, int | float | str | bool) else json.dumps(value)
                )

    walk(recipe.model_dump(mode="json"), "recipe.")
    return flat


def tensorboard_hparams(writer, values: dict) -> None:
    """``values`` in TensorBoard's HPARAMS tab, in the writer's own event file (``add_hparams`` would open a
    sub-run beside it)."""
    from torch.utils.tensorboard.summary import hparams

    for summary in hparams(values, {}):
        writer._get_file_writer().add_summary(summary)


class MissingTracker(ImportError, ValueError):
    """A tracker named in ``report_to`` whose package is not installed: bad input (exit 2, the install command),
    not a fault of neoembed's; still an ImportError for code that catches that."""


def check_trackers(report_to) -> None:
    """Every tracker named in ``report_to`` is known and installed, and MLflow can write where it is pointed:
    checked before any data or model loads, so a missing package or store costs seconds, not a run."""
    import importlib.util

    for name in report_to:
        if name not in TRACKERS:
            raise ValueError(f"report_to: unknown tracker {name!r}; valid: {', '.join(TRACKERS)}")
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise MissingTracker(
                f"report_to: [{name}] needs the {module} package, which is not installed: install neoembed's "
                f"[{extra}] extra (pip install -e '.[{extra}]' in the neoembed repository), or remove {name} from "
                "report_to"
            )
    if "mlflow" in report_to:  # once every package is known to be there
        check_mlflow_store()


_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def check_mlflow_store() -> None:
    """The store MLflow will write to is one the installed client can open. mlflow 3.x defaults to a sqlite
    database, which the ``[mlflow]`` extra's client (mlflow-skinny: no sqlalchemy) cannot open, and from 3.10 a
    local folder store needs ``MLFLOW_ALLOW_FILE_STORE=true``; either used to fail only once the model had
    loaded, with mlflow's own message."""
    import importlib.util
    from urllib.parse import urlparse

    import mlflow

    uri = mlflow.get_tracking_uri()
    scheme = urlparse(uri).scheme.split("+")[0]
    given = "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "mlflow's default"
    server = "MLFLOW_TRACKING_URI=http://HOST:5000 (your tracking server)"
    if scheme in _DATABASE_SCHEMES and importlib.util.find_spec("sqlalchemy") is None:
        raise ValueError(
            f"report_to: [mlflow]: the tracking URI {uri} ({given}) is a database store, which this mlflow "
            f"client cannot open (mlflow-skinny, the neoembed[mlflow] extra, has no sqlalchemy): set {server}, "
            "or MLFLOW_TRACKING_URI=file:./mlruns with MLFLOW_ALLOW_FILE_STORE=true (a local folder), or "
            "pip install mlflow (the full package) to keep the database"
        )
    allow = getattr(mlflow.environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)  # mlflow >= 3.10
    if scheme in ("", "file") and allow is not None and not allow.get():
        raise ValueError(
            f"report_to: [mlflow]: the tracking URI {uri} ({given}) is a local folder store, which mlflow "
            f"{mlflow.__version__} writes only with MLFLOW_ALLOW_FILE_STORE=true: set it, or set {server}"
        )


def progress_line(step: int, total: int, values: dict, steps_per_s: float) -> str:
    """The plain progress line a run prints per logging step where output is not a terminal (CI, a scheduler's
    log): step of total, the logged values, the rate and the time left."""
    import math
    import time

    left = (total - step) / steps_per_s if steps_per_s > 0 else float("nan")
    eta = time.strftime("%H:%M:%S", time.gmtime(left)) if math.isfinite(left) else "?"
    shown = "  ".join(f"{k} {v:.4g}" for k, v in values.items() if isinstance(v, int | float))
    return f"step {step}/{total} ({100 * step / max(total, 1):.0f}%)  {shown}  {steps_per_s:.2f} steps/s  left {eta}"


class MetricsLog:
    """``metrics.jsonl`` (one JSON row per logging step) and, with ``report_to: [tensorboard]``, the numeric
    values of each row as TensorBoard scalars under ``train/``. Only the main process writes.

    It also watches the run: :data:`DEGENERATE_ROWS` logged rows in a row with loss 0 and gradient norm 0 mean the
    model learns nothing (duplicate rows, a query equal to its positive), and say so once."""

    def __init__(self, output: Path, report_to, main_process: bool):
        self.path = Path(output) / "metrics.jsonl"
        self.main = main_process
        self.writer = None
        self._tensorboard = None
        self._purge_step: int | None = None
        self.zero_rows, self.degenerate_warned = 0, False
        if "tensorboard" in report_to and main_process:
            try:  # checked now, opened at the first row (the run may still fail its checks)
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "report_to: [tensorboard] needs the tensorboard package: pip install tensorboard"
                ) from e
            self._tensorboard = SummaryWriter

    def truncate(self, step: int) -> None:
        """On resume: drop the rows logged after the checkpoint being resumed from (TensorBoard hides its events
        from that step on, the curves are redrawn from the trimmed rows)."""
        trim_metrics(self.path, step) if self.main else None
        self._purge_step = step + 1

    def write(self, row: dict) -> None:
        self.watch(row)
        if not self.main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self._open()
        if self.writer is not None:
            for key, value in row.items():
                if isinstance(value, int | float) and key != "step":
                    self.writer.add_scalar(f"train/{key}", value, row["step"])

    def _open(self) -> None:
        if self._tensorboard is not None and self.writer is None and self.main:
            self.writer = self._tensorboard(
                str(self.path.parent / "tensorboard"), purge_step=self._purge_step
            )

    def hyperparameters(self, values: dict) -> None:
        """TensorBoard's HPARAMS tab for this run: ``values`` (flat ``a.b`` keys; a new run, not a resume)."""
        self._open()
        if self.writer is not None:
            tensorboard_hparams(self.writer, values)

    def watch(self, row: dict) -> None:
        zero = row.get("loss") == 0 and not row.get("grad_norm")
        self.zero_rows = self.zero_rows + 1 if zero else 0
        if self.zero_rows >= DEGENERATE_ROWS and not self.degenerate_warned:
            self.degenerate_warned = True
            logger.warning(
                "degenerate training: the loss and the gradient norm have been 0 for %d logged steps (up to step "
                "%s): the model learns nothing. Usual causes: duplicate rows (masked as false negatives, leaving "
                "no negative), or queries equal to their positives; check the data",
                self.zero_rows,
                row.get("step"),
            )

    def close(self, title: str | None = None) -> None:
        """Flush TensorBoard and draw ``training_curves.png`` beside the metrics."""
        from neoembed.plots import plot_training_curves

        if self.writer is not None:
            self.writer.close()
        if self.main and self.path.exists():
            plot_training_curves(self.path, self.path.parent / "training_curves.png", title=title)


def trim_metrics(path: Path, step: int) -> None:
    """Keep the rows of ``metrics.jsonl`` up to ``step`` (a resume continues after them); a torn last line (a
    kill during the write) is dropped."""
    path = Path(path)
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if line and json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError):
            continue
    atomic_write_text(path, "".join(r + "\n" for r in kept))


def check_pairs(name: str, queries: list[str], positives: list[str], as_query=lambda text: text) -> list[str]:
    """Warnings for a training set that cannot teach much: over half of its pairs have the query equal to the
    positive (``as_query`` formats a positive the way queries were, instruction included), or over half are
    repeats of another pair (masked as false negatives, they leave no negative: the loss is 0). Each warning is
    logged and returned."""
    same = sum(q == as_query(p) for q, p in zip(queries, positives, strict=True))
    distinct = len(set(zip(queries, positives, strict=True)))
    return check_pair_counts(name, len(queries), same, distinct)


def check_pair_counts(name: str, pairs: int, same: int, distinct: int) -> list[str]:
    """:func:`check_pairs` on counts made elsewhere (a data card's build counts them in its batched map):
    ``pairs`` pairs, ``same`` of them with the query equal to its positive, ``distinct`` different ones."""
    n = max(pairs, 1)
    found = []
    if same > n / 2:
        found.append(
            f"dataset {name}: {same} of {n} pairs have the query equal to its positive: the model learns to match "
            "a text with itself. Check the card's columns (query and positive may name the same column)"
        )
    if n - distinct > n / 2:
        found.append(
            f"dataset {name}: {n - distinct} of {n} pairs repeat another pair ({distinct} distinct): in a batch "
            "they are masked as false negatives and the loss is 0. Deduplicate the data"
        )
    for w in found:
        logger.warning("degenerate data: %s", w)
    return found


# ------------------------------------------------------------------------------------ results of one model
MODEL_RECORD = "scored_model.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def model_identity(model: str) -> dict[str, Any]:
    """What a results folder records about the model it scores: the path (resolved) and a SHA-256 over its weight
    files (checkpoint folders inside a run folder left out); a hub id is recorded by name."""
    path = Path(model)
    if not path.is_dir():
        return {"model": str(model), "weights_sha256": None}
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        rel = f.relative_to(path)
        if f.is_file() and f.suffix in WEIGHT_SUFFIXES and not rel.parts[0].startswith(("checkpoint-", ".")):
            h.update(rel.as_posix().encode() + b"\0" + file_sha256(f).encode())
    return {"model": str(path.resolve()), "weights_sha256": h.hexdigest()}


def default_results_dir(model: str, root: str | Path = "results") -> Path:
    """``results/<name>-<8 hex digits of the model's resolved path>``: two models never share a default folder,
    even when both are called ``checkpoint-8``."""
    key = str(Path(model).resolve()) if Path(model).exists() else str(model)
    return Path(root) / f"{Path(str(model).rstrip('/')).name}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def claim_results_dir(output: str | Path, model: str, overwrite: bool, write: bool = True) -> None:
    """A results folder holds the scores of one model: the first run records it (:data:`MODEL_RECORD`); a run
    of another model (another path, or the same path with other weights) is refused (exit 2), or with
    ``overwrite`` clears the folder first. A non-empty folder that records no model is refused likewise.
    ``write=False`` only checks (nothing is cleared or written)."""
    out = Path(output)
    identity = model_identity(model)
    record = out / MODEL_RECORD
    if out.is_dir() and any(out.iterdir()):
        try:
            saved = json.loads(record.read_text()) if record.is_file() else None
        except ValueError:
            saved = None
        if saved != identity:
            held = (
                f"the scores of {saved['model']} (weights {str(saved.get('weights_sha256'))[:12]})"
                if saved
                else f"{_describe(out)}, with no record of the model scored"
            )
            if not overwrite:
                raise OutputDirError(
                    f"results folder {out} holds {held}; this run scores {identity['model']} (weights "
                    f"{str(identity['weights_sha256'])[:12]}): choose another --output (the default is unique per "
                    "model), or --overwrite to replace those results"
                )
            if not (record.is_file() or (out / RECORD).is_file()):
                raise OutputDirError(
                    f"--overwrite: {out} holds {_describe(out)}, which no neoembed command wrote: choose another "
                    "--output"
                )
            if write:
                logger.warning("--overwrite: clearing %s (%s)", out, held)
                _clear(out)
    if write:
        atomic_write_text(record, json.dumps(identity, indent=2) + "\n")
