"""Checks of a run's inputs before any work: the device, an optional module, weight files, training pairs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from neoembed.runs.errors import OutputDirError

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


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
            f"{flag} {device}: this machine has {have} CUDA device(s); use {flag} cpu or another GPU"
        )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{flag} {device}: MPS is not available on this machine; use {flag} cpu")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{flag} {device!r}: neoembed runs on cpu, cuda or mps")


def require_module(module: str, extra: str, what: str) -> None:
    """Refuse, before any model loads, a job whose optional package is missing: the message names the extra
    that installs it (exit 2), instead of an ImportError after minutes of work."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{what} needs {module}, which is not installed: pip install -e '.[{extra}]'")


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


def check_pairs(name: str, queries: list[str], positives: list[str], as_query=lambda text: text) -> list[str]:
    """Warnings for a training set that cannot teach much: over half of its pairs have the query equal to the
    positive (``as_query`` formats a positive the way queries were, instruction included), or over half are
    repeats of another pair (masked as false negatives, they leave their queries fewer negatives; all one pair,
    none: the loss is 0). Each warning is logged and returned."""
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
        effect = (
            "one pair: nothing to contrast, the loss is 0"
            if distinct <= 1
            else f"each {n / distinct:.1f} times on average: a repeat in a batch is masked as a false negative of "
            "its twin, leaving its query fewer negatives, and the run sees the same few pairs again and again"
        )
        found.append(
            f"dataset {name}: {n - distinct} of {n} pairs repeat another pair ({distinct} distinct, {effect}). "
            "Deduplicate the data"
        )
    for w in found:
        logger.warning("degenerate data: %s", w)
    return found
