"""Checkpoints survive any kill: a checkpoint is written to ``.checkpoint-N.partial``, every file's size and
SHA-256 go into a completion marker written last, then the folder is renamed to ``checkpoint-N``; a resume takes
the newest checkpoint whose marker and files agree and says which it skipped and why."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neoembed.record import atomic_write_text, file_sha256, readable_weights
from neoembed.runs.errors import CheckpointWriteError, OutputDirError

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


CHECKPOINT_MARKER = "checkpoint_complete.json"


def run_identity(settings: dict[str, Any] | None) -> dict[str, Any]:
    """What run records and checkpoint markers say of the run: its :func:`resume_settings` and their short hash
    (same hash, same run)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"resume_settings": settings, "recipe_hash": digest if settings is not None else None}


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
    readable_weights(staged)
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
    then = (
        f"The previous checkpoint {previous[-1]} is intact: free some space, then --resume"
        if previous
        else "No checkpoint was written before it: free some space, then start again with --overwrite"
    )
    return CheckpointWriteError(
        f"could not write checkpoint-{step} in {staged.parent}: {type(error).__name__}: {error}. Is the disk "
        f"full? {then}"
    )


def prune_checkpoints(output: Path, keep: int | None, protect: int | None = None) -> None:
    """Delete all but the ``keep`` newest checkpoints (``None`` or 0 keeps all) and the one of step ``protect``
    (the best so far, ``keep_best``)."""
    if keep:
        for old in list_checkpoints(output)[:-keep]:
            if old.name != f"checkpoint-{protect}":
                shutil.rmtree(old, ignore_errors=True)
