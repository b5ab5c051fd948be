"""The GLUE tasks the NeoBERT paper fine-tunes on (Appendix C; WNLI excluded, following BERT), their metrics,
and their data: the hub's ``nyu-mll/glue`` or a local folder in the same layout.

A task describes itself: the hub config, the text columns, the label count (1 = regression), the validation
splits, the metrics and the one the official fine-tuning code selects checkpoints on (``TASK_TO_METRIC`` in
chandar-lab/NeoBERT ``src/neobert/glue/train.py``). Its score is the mean of its metrics, MNLI's the mean of
matched and mismatched accuracy, as the paper reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

HUB_DATASET = "nyu-mll/glue"


@dataclass(frozen=True)
class GlueTask:
    name: str  # the hub config: cola, sst2, ...
    display: str  # as the paper writes it: CoLA, SST-2, ...
    text: tuple[str, ...]  # one or two text columns
    num_labels: int  # 1: regression
    metrics: tuple[str, ...]
    selection: str  # the metric checkpoints are selected on (the official code's)
    validation: tuple[str, ...] = ("validation",)
    transfer_from: str | None = None  # the paper starts this task from the best checkpoint of that task

    @property
    def is_regression(self) -> bool:
        return self.num_labels == 1


TASKS = {
    t.name: t
    for t in (
        GlueTask("cola", "CoLA", ("sentence",), 2, ("matthews",), "matthews"),
        GlueTask("sst2", "SST-2", ("sentence",), 2, ("accuracy",), "accuracy"),
        GlueTask(
            "mrpc",
            "MRPC",
            ("sentence1", "sentence2"),
            2,
            ("f1", "accuracy"),
            "accuracy",
            transfer_from="mnli",
        ),
        GlueTask("qqp", "QQP", ("question1", "question2"), 2, ("f1", "accuracy"), "f1"),
        GlueTask(
            "stsb",
            "STS-B",
            ("sentence1", "sentence2"),
            1,
            ("pearson", "spearman"),
            "pearson",
            transfer_from="mnli",
        ),
        GlueTask(
            "mnli",
            "MNLI",
            ("premise", "hypothesis"),
            3,
            ("accuracy",),
            "accuracy",
            validation=("validation_matched", "validation_mismatched"),
        ),
        GlueTask(
            "qnli", "QNLI", ("question", "sentence"), 2, ("accuracy",), "accuracy", transfer_from="mnli"
        ),
        GlueTask(
            "rte", "RTE", ("sentence1", "sentence2"), 2, ("accuracy",), "accuracy", transfer_from="mnli"
        ),
    )
}


def get_task(name: str) -> GlueTask:
    """A task by any common spelling (``MRPC``, ``sts-b``, ``SST2``); WNLI and unknown names fail with the valid
    ones."""
    key = name.lower().replace("-", "").replace("_", "")
    if key == "wnli":
        raise ValueError(
            "WNLI is excluded from the protocol, following BERT and the NeoBERT paper (Appendix C; GLUE FAQ 12: "
            f"its dev set is adversarial to training-set models); choose one of {[t.display for t in TASKS.values()]}"
        )
    if key not in TASKS:
        raise ValueError(f"unknown GLUE task {name!r}; valid: {[t.display for t in TASKS.values()]}")
    return TASKS[key]


# ------------------------------------------------------------------------------------------------ metrics
def compute_metrics(task: GlueTask, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The task's metrics from logits (N, num_labels) or regression outputs, as the GLUE metric of
    ``evaluate`` computes them (scikit-learn's F1 and Matthews, SciPy's Pearson and Spearman)."""
    import numpy as np
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import f1_score, matthews_corrcoef

    if task.is_regression:
        scores = np.asarray(predictions, dtype=np.float64).reshape(-1)
        return {
            "pearson": float(pearsonr(scores, labels)[0]),
            "spearman": float(spearmanr(scores, labels)[0]),
        }
    predicted = np.asarray(predictions).argmax(axis=-1)
    known = {
        "accuracy": lambda: float((predicted == labels).mean()),
        "f1": lambda: float(f1_score(labels, predicted)),
        "matthews": lambda: float(matthews_corrcoef(labels, predicted)),
    }
    return {name: known[name]() for name in task.metrics}


def task_score(task: GlueTask, results: dict[str, dict[str, float]]) -> float:
    """The number the paper reports for the task: the mean of its metrics over its validation splits
    (MNLI: of matched and mismatched accuracy), in percent."""
    values = [results[split][m] for split in task.validation for m in task.metrics]
    return 100.0 * float(sum(values)) / len(values)


# --------------------------------------------------------------------------------------------------- data
_SUFFIXES = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".csv": "csv"}


def _split_files(folder: Path, split: str) -> tuple[str, list[str]] | None:
    """(loader, files) of one split in a folder: ``split-*.parquet`` (the hub's layout) or ``split.<ext>``."""
    shards = sorted(folder.glob(f"{split}-*.parquet"))
    if shards:
        return "parquet", [str(p) for p in shards]
    for suffix, loader in _SUFFIXES.items():
        path = folder / f"{split}{suffix}"
        if path.is_file():
            return loader, [str(path)]
    return None


def local_splits(
    data_dir: str | Path, task: GlueTask, splits: tuple[str, ...], carve: bool = False
) -> dict[str, tuple[str, list[str]]]:
    """The files of each wanted split in ``data_dir`` (or its ``<task>/`` subfolder, as in a hub snapshot);
    a missing split is an error naming the files looked for and the ones present (``carve``: the split was
    named by ``--carve``)."""
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"--data-dir {root} is not a folder")
    folder = root / task.name if (root / task.name).is_dir() else root
    found = {split: _split_files(folder, split) for split in splits}
    missing = [s for s, f in found.items() if f is None]
    if missing:
        present = sorted(p.name for p in folder.iterdir())
        fix = (
            "--carve names the split to divide: give one the folder holds (such as --carve test)"
            if carve
            else "A folder with a single labelled split (such as a test set) can be divided with --carve SPLIT"
        )
        raise FileNotFoundError(
            f"{folder} has no {' / '.join(missing)} split for {task.display}: expected files named like "
            f"'{missing[0]}-00000-of-00001.parquet' (the {HUB_DATASET} layout) or '{missing[0]}.jsonl[.gz]' / "
            f"'.csv' / '.parquet'; found {present}. {fix}."
        )
    return found


def data_key(task: GlueTask, data_dir: str | Path | None, carve: str | None) -> dict[str, str]:
    """What a resume compares of the local data, ``splits.<split>``: each split's files by content (a copy of the
    folder elsewhere matches, a split edited between a kill and ``--resume`` does not). Hub data: nothing here
    (the run record names the dataset)."""
    import hashlib

    from neoembed.record import content_stamp

    if data_dir is None:
        return {}
    splits = (carve,) if carve is not None else ("train", *task.validation)
    keys = {}
    for split, (_, files) in local_splits(data_dir, task, splits, carve=carve is not None).items():
        h = hashlib.sha256()
        for f in files:
            h.update(f"{Path(f).name}\0{content_stamp(f)}\n".encode())
        keys[f"splits.{split}"] = h.hexdigest()[:16]
    return keys


def load_splits(task: GlueTask, data_dir: str | Path | None, carve: str | None, seed: int = 0):
    """``DatasetDict`` with ``train`` and the task's validation splits: from the hub, or from ``data_dir``.

    ``carve`` names the one labelled split of a folder that holds no train split (MSRP's ``test``): it is
    divided, with a fixed seed, into train (80%) and validation (20%); scores on it are not GLUE dev scores."""
    from datasets import DatasetDict, load_dataset

    from neoembed.data.cards import local_files_cache_dir  # datasets keys local files by path and time alone

    if carve is not None:
        if len(task.validation) != 1:
            raise ValueError(
                f"--carve needs a task with one validation split; {task.display} has {task.validation}"
            )
        if data_dir is None:
            raise ValueError("--carve divides a local split: pass --data-dir too")
        loader, files = local_splits(data_dir, task, (carve,), carve=True)[carve]
        _refuse_shadowed_splits(Path(files[0]).parent, task, carve)
        whole = load_dataset(loader, data_files=files, split="train", cache_dir=local_files_cache_dir(files))
        check_columns(task, {carve: whole})  # rows named as the file numbers them, before the split shuffles
        parts = whole.train_test_split(test_size=0.2, seed=seed)
        return DatasetDict(train=parts["train"], validation=parts["test"])
    wanted = ("train", *task.validation)
    if data_dir is None:
        from neoembed.data.check import hub_unreachable_reason
        from neoembed.data.errors import HubUnreachable, hub_offline_mode, is_unreachable

        offline = (
            f"the GLUE data could not be downloaded. Offline, pass --data-dir DIR with the task's splits in the "
            f"{HUB_DATASET} layout (DIR/{task.name}/train-*.parquet, ...) or as DIR/train.jsonl, ... (docs/glue.md)"
        )
        # one probe first: offline, the dataset client retries for half a minute or more before it gives up
        if not hub_offline_mode() and (down := hub_unreachable_reason()) is not None:
            raise HubUnreachable(f"the Hugging Face hub cannot be reached ({down}): {offline}")
        try:
            hub = load_dataset(HUB_DATASET, task.name)
        except Exception as e:
            if not is_unreachable(e):
                raise
            raise HubUnreachable(f"{e}: {offline}") from None
        return DatasetDict({split: hub[split] for split in wanted})
    found = local_splits(data_dir, task, wanted)
    return DatasetDict(
        {
            split: load_dataset(loader, data_files=files, split="train", cache_dir=local_files_cache_dir(files))
            for split, (loader, files) in found.items()
        }
    )


def _refuse_shadowed_splits(folder: Path, task: GlueTask, carve: str) -> None:
    """--carve makes the train and validation splits; a folder that already holds one of them would have it
    silently unused, and the score reported on 20% of the carved split instead of the folder's own split."""
    there = {s: f for s in ("train", *task.validation) if s != carve and (f := _split_files(folder, s))}
    if not there:
        return
    named = "; ".join(f"{s}: {', '.join(Path(p).name for p in f[1])}" for s, f in there.items())
    raise ValueError(
        f"--carve {carve} divides {carve!r} into train 80% / validation 20%, but {folder} already holds the "
        f"split(s) that would replace ({named}), which carving would leave unused. To train and score on the "
        f"folder's own splits, drop --carve; to carve {carve!r} anyway, move those files out of the folder"
    )


def check_columns(task: GlueTask, splits) -> None:
    """Every split has the task's text columns and a label the task scores; the error names what is there."""
    for split, data in splits.items():
        missing = [c for c in (*task.text, "label") if c not in data.column_names]
        if missing:
            raise ValueError(
                f"{task.display} split {split!r} lacks column(s) {missing}; it has {data.column_names} "
                f"(GLUE's {task.display} columns: {[*task.text, 'label']})"
            )
        _check_labels(task, split, data["label"])


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _check_labels(task: GlueTask, split: str, column) -> None:
    """A class index (or, for STS-B, a finite score) in every row: GLUE marks its unlabelled test rows -1, and
    a validation split of those scored 0.00 "successfully"."""
    import numpy as np

    try:
        labels = np.asarray(column, dtype=float)
    except (TypeError, ValueError):
        row, value = next((i, v) for i, v in enumerate(column) if not _is_number(v))
        raise ValueError(
            f"{task.display} split {split!r}: row {row + 1}'s label {value!r} is not a number (GLUE's labels are "
            "class indices, STS-B's scores)"
        ) from None
    valid = list(range(task.num_labels))
    bad = ~np.isfinite(labels) if task.is_regression else ~np.isin(labels, valid)
    if not bad.any():
        return
    if (labels == -1).all():
        raise ValueError(
            f"{task.display} split {split!r} has no labels: every one is -1, GLUE's mark of an unlabelled (test) "
            "split. Train and score on labelled splits (GLUE's test labels are not public)"
        )
    row = int(np.flatnonzero(bad)[0])
    expected = "a finite score" if task.is_regression else f"one of {valid}"
    raise ValueError(
        f"{task.display} split {split!r}: {int(bad.sum())} of {len(labels)} labels are not {expected} (the "
        f"first: row {row + 1}, label {labels[row]:g}); fix or drop those rows"
    )
