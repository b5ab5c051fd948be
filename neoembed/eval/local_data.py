"""Serve an mteb task's data from a local folder instead of the Hugging Face hub.

mteb loads every task through ``datasets`` (``load_dataset(path, config, split=...)``,
``get_dataset_config_names``, ``get_dataset_split_names``). A folder in the raw layout of the task's hub
dataset is turned into a local dataset repository that ``datasets`` reads the same way, and the task's
metadata is pointed at it; mteb's own loaders, transforms and evaluators then run unchanged. Accepted layouts:

* a snapshot of the hub repository (a ``README.md`` whose YAML has ``configs:``): used as is;
* split files at the top level (``test.jsonl.gz``, ``train.parquet``, ``dev.tsv``, …) -> config ``default``;
* a sub-folder per config (``corpus/``, ``queries/``, ``qrels/`` -> ``default``, ``top_ranked/``, …) holding
  split files, or top-level files named after a config (``corpus.jsonl.gz``, ``queries.jsonl``).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

import yaml

__all__ = ["LocalDataError", "data_fingerprint", "is_data_file", "local_dataset_repo", "point_task_at"]

SPLIT_NAMES = ("train", "dev", "validation", "test")
FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".jsonl.gz": "json",
    ".json.gz": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".csv.gz": "csv",
    ".tsv": "csv",
    ".tsv.gz": "csv",
}
IGNORED = {"card.yaml", "task.yaml", "README.md"}


class LocalDataError(FileNotFoundError):
    """A local task folder that does not hold what the task needs; the message lists what was expected."""


class NotAnEvaluationTask(LocalDataError):
    """A folder whose dataset card describes other data (training pairs, a corpus): ``task_type`` says which."""

    def __init__(self, message: str, task_type: str):
        super().__init__(message)
        self.task_type = task_type


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    for ext in sorted(FORMATS, key=len, reverse=True):
        if name.endswith(ext):
            return ext
    return None


def is_data_file(path: Path) -> bool:
    """Whether ``path`` is a split or config file this module serves (by its extension)."""
    return path.name not in IGNORED and _suffix(path) is not None


def _data_files(folder: Path) -> dict[str, Path]:
    """name without extension -> file, for the data files directly inside ``folder``."""
    out = {}
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.name not in IGNORED and (ext := _suffix(f)):
            out[f.name[: -len(ext)]] = f
    return out


def _has_hub_configs(folder: Path) -> bool:
    readme = folder / "README.md"
    if not readme.is_file():
        return False
    m = re.match(r"^---\n(.*?)\n---", readme.read_text(encoding="utf8"), flags=re.S)
    return bool(m) and "configs" in (yaml.safe_load(m.group(1)) or {})


def _config_entry(name: str, files: dict[str, Path], link_dir: Path) -> dict:
    exts = {_suffix(p) for p in files.values()}
    formats = {FORMATS[e] for e in exts}
    if len(formats) != 1:
        raise LocalDataError(f"config {name!r} mixes file formats {sorted(exts)}; use one format per config")
    entry: dict = {"config_name": name, "data_files": []}
    for split, path in files.items():
        target = link_dir / name / f"{split}{_suffix(path)}"
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            os.symlink(path.resolve(), target)
        entry["data_files"].append({"split": split, "path": str(target.relative_to(link_dir))})
    if any(e.startswith(".tsv") for e in exts):
        entry["sep"] = "\t"
    return entry


def local_dataset_repo(
    folder: str | Path, cache_dir: str | Path | None = None, aliases: tuple[str, ...] = ()
) -> Path:
    """A folder that ``datasets.load_dataset`` reads like the task's hub repository (see module doc).

    ``aliases``: config names the task will ask for (for instance the ``en`` subset of a multilingual task);
    when the folder has no such config, its ``default`` files serve under that name too.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise LocalDataError(f"{folder} does not exist (expected a folder with the task's data files)")
    if _has_hub_configs(folder):
        return folder
    configs: dict[str, dict[str, Path]] = {}
    top = _data_files(folder)
    split_files = {k: v for k, v in top.items() if k in SPLIT_NAMES}
    if split_files:
        configs["default"] = split_files
    for stem, path in top.items():
        if stem not in SPLIT_NAMES:
            configs.setdefault(stem, {})[stem] = path  # corpus.jsonl -> config "corpus", split "corpus"
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        files = _data_files(sub)
        if not files:
            continue
        name = "default" if sub.name == "qrels" and "default" not in configs else sub.name
        configs.setdefault(name, {}).update(files)
    if not configs:
        raise LocalDataError(
            f"{folder} holds no data files. Expected split files ({', '.join(SPLIT_NAMES)}) with one of the "
            f"extensions {', '.join(sorted(FORMATS))}, or config sub-folders (corpus/, queries/, qrels/), "
            "or a hub snapshot with a README.md listing its configs"
        )
    for alias in aliases:
        if alias and alias not in configs and "default" in configs:
            configs[alias] = configs["default"]
    # the files' stamps in the key (small files by content, as a same-time copy keeps the time): datasets caches
    # what it built from the links by their paths, so a file edited in place would otherwise be scored as it was
    from neoembed.record import file_stamp

    files = {p.resolve() for f in configs.values() for p in f.values()}  # an alias shares default's files
    stamps = sorted((str(p), sorted(file_stamp(p).items())) for p in files)
    key = hashlib.sha256(f"{folder.resolve()}|{sorted(aliases)}|{stamps}".encode()).hexdigest()[:16]
    root = Path(cache_dir or Path(tempfile.gettempdir()) / "neoembed-local-data") / key
    root.mkdir(parents=True, exist_ok=True)
    entries = [_config_entry(name, files, root) for name, files in configs.items()]
    readme = "---\n" + yaml.safe_dump({"configs": entries}, sort_keys=False) + "---\n"
    (root / "README.md").write_text(readme, encoding="utf8")
    return root


def point_task_at(task, folder: str | Path, cache_dir: str | Path | None = None):
    """Make an mteb task load its data from ``folder``; checks that the task's evaluation splits exist."""
    aliases = tuple(getattr(task, "hf_subsets", None) or ()) + (task.metadata.dataset.get("name") or "",)
    repo = local_dataset_repo(folder, cache_dir, aliases=tuple(a for a in aliases if a and a != "default"))
    _check_splits(task, folder, repo)
    dataset = {**task.metadata.dataset, "path": str(repo), "revision": "local"}
    task.metadata = task.metadata.model_copy(update={"dataset": dataset})
    task.neoembed_folder = str(folder)  # the user's folder, as errors name it (the dataset path is the repo's)
    return task


def _check_splits(task, folder: str | Path, repo: Path) -> None:
    """The task's evaluation splits must be among the folder's splits (any config), else mteb fails only after
    the model has loaded, with a datasets error that names neither the folder nor the file to add."""
    m = re.match(r"^---\n(.*?)\n---", (repo / "README.md").read_text(encoding="utf8"), flags=re.S)
    entries = (yaml.safe_load(m.group(1)) or {}).get("configs", []) if m else []
    files = [f for e in entries for f in (e.get("data_files") or [])]
    if not files or not all(isinstance(f, dict) and "split" in f for f in files):
        return  # a hub snapshot with glob patterns: left to mteb
    have = sorted({f["split"] for f in files})
    missing = [s for s in task.metadata.eval_splits if s not in have]
    if missing:
        raise LocalDataError(
            f"{folder}: task {task.metadata.name} is evaluated on split(s) {missing}, the folder has {have}: add "
            f"{missing[0]}.jsonl.gz (or a {missing[0]} file in each config sub-folder)"
        )


def data_fingerprint(task) -> str | None:
    """A hash of the local files ``task`` reads its data from (the folder its metadata points at: a task folder's
    dataset repository, or a task card's data): each file's path in the folder with its SHA-256, or for a large
    file its size and modification time (:func:`neoembed.record.content_stamp`). None for a task whose data come
    from the hub. A result records it, so a result scored on other data is not reused (:mod:`neoembed.eval.reuse`)."""
    from neoembed.record import content_stamp

    path = (getattr(task.metadata, "dataset", None) or {}).get("path")
    root = Path(path) if path else None
    if root is None or not root.is_dir():
        return None
    h = hashlib.sha256(getattr(task, "card_fields", "").encode())  # a task card's columns, main score, ...
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root)
        if not f.is_file() or any(part.startswith(".") for part in rel.parts):  # .cache/ of a hub snapshot
            continue
        # a dataset repository's files are links to the folder's: their targets count
        h.update(f"{rel.as_posix()}\0{content_stamp(f)}\n".encode())
    return h.hexdigest()[:16]
