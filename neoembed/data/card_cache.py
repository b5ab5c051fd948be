"""Prepared cards kept on disk: a card's pairs (Arrow), its drop report and its texts' hashes, filed under a key
made of the card (every validated field, so an instruction override counts), each data file's path, size and
modification time (small files also by content), and the settings of the build (rows, negatives, template,
instruction, seed). A second run, and every DDP rank after the first, memory-maps the pairs instead of reading
the data again; a changed file, card or setting gives another key, so a stale entry is never read.

``NEOEMBED_CARD_CACHE``: the folder (default: ``card-pairs`` in the datasets cache); ``off`` turns the cache off.
One build per key at a time (a file lock): ranks that wait read what the first one wrote. An entry is written in
a folder of its own and renamed into place only once complete, so a killed build leaves nothing to read back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

__all__ = ["building", "cache_root", "data_files", "entry_key", "locked_entry", "read_entry", "seal_entry"]

VERSION = 6  # of the entry layout and of the build: a change here makes every older entry a miss
# 2: the build refuses NaN and infinite teacher scores, which version 1 entries may hold
# 3: a CSV whose first row is wider than its header is refused; older entries may hold it read shifted
# 4: the report counts what a smaller max_negatives keeps (kept_below_k), which older reports lack
# 5: a report's first dropped rows count from 1 (file lines where it can), older ones' from 0
# 6: a report names the first row dropped with fewer than k hard negatives, which older reports lack
REPORT = "report.json"


def cache_root() -> Path | None:
    """Where prepared cards are kept, or None when ``NEOEMBED_CARD_CACHE=off``."""
    value = os.environ.get("NEOEMBED_CARD_CACHE", "")
    if value.lower() in ("off", "0", "false", "no"):
        return None
    if value:
        return Path(value)
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "card-pairs"


def data_files(path: Path) -> list[Path]:
    """The files a local source reads: the file, or every file under the folder."""
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def _file_identity(path: Path) -> dict:
    from neoembed.record import file_stamp

    return {"path": str(path.resolve()), **file_stamp(path)}


def entry_key(card_json: str, files: list[Path], settings: dict) -> str:
    """The key of one prepared card (see the module docstring)."""
    import datasets

    identity = {
        "version": VERSION,
        "datasets": datasets.__version__,
        "card": card_json,
        "files": [_file_identity(f) for f in files],
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


@contextlib.contextmanager
def locked_entry(root: Path, key: str):
    """Hold the build lock of ``key``; yields the entry's folder (which exists only once sealed)."""
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{key}.lock")):
        yield root / key


def read_entry(entry: Path, pairs_name: str):
    """``(pairs, report dict)`` of a sealed entry, the pairs memory-mapped; None when there is none."""
    if not (entry / REPORT).is_file():
        return None
    import datasets

    report = json.loads((entry / REPORT).read_text())
    pairs = datasets.Dataset.from_file(str(entry / pairs_name))
    hidden = [c for c in pairs.column_names if c.startswith("_")]
    return (pairs.remove_columns(hidden) if hidden else pairs), report


@contextlib.contextmanager
def building(entry: Path):
    """A fresh folder to build ``entry`` in (a leftover of a killed build is cleared first); removed when the
    build fails."""
    work = entry.with_name(f".{entry.name}.partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        yield work
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def seal_entry(work: Path, entry: Path, report: dict, keep: list[str]) -> None:
    """Move a finished build into place: the files in ``keep`` and the report, written last."""
    for f in work.iterdir():
        if f.name not in keep:
            f.unlink()
    (work / REPORT).write_text(json.dumps(report, indent=1))
    shutil.rmtree(entry, ignore_errors=True)
    work.rename(entry)
