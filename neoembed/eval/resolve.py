"""Which tasks a ``neoembed mteb`` run scores: mteb names and benchmarks, task cards, and task folders (a local copy
of an mteb task's data, or a task described by its dataset card), each with the instruction its card gives."""

from __future__ import annotations

import logging
from pathlib import Path

from neoembed.eval.config import EvalConfig
from neoembed.eval.local_data import LocalDataError, NotAnEvaluationTask, is_data_file, point_task_at
from neoembed.eval.task_cards import (
    CARD_FILE,
    DATASET_CARD_FILE,
    build_card_task,
    dataset_card_task,
    load_task_card,
    read_dataset_card,
)

__all__ = ["Unresolvable", "is_registered", "resolve_tasks", "task_folders"]

logger = logging.getLogger(__name__)


class Unresolvable:
    """Stands in for a task folder that could not be turned into a task; fails when run."""

    def __init__(self, name: str, error: Exception):
        from types import SimpleNamespace

        self.metadata = SimpleNamespace(name=name, type="?", main_score=None)
        self.error = error


def _local_task(name: str, folder: Path):
    """:func:`_task_from_dir`, with what the folder's dataset card says of its data against the mteb task's
    (``neoembed_differs``: why its scores do not compare with published ones; recorded with each result)."""
    task, instruction = _task_from_dir(name, folder)
    if (folder / DATASET_CARD_FILE).is_file() and not (folder / CARD_FILE).is_file():  # the card read the task
        card = read_dataset_card(folder)
        rows = _test_rows(folder) if card.mteb_task and card.mteb_test_rows else None
        if rows is not None:  # the file as it is: a test split cut without its card's count said nothing
            card = card.model_copy(update={"splits": {**card.splits, "test": rows}})
        if card.mteb_task and (why := card.differs_from_mteb()):
            logger.warning(
                "%s: its data is not the mteb task %s's (%s): its score does not compare with published ones",
                folder, card.mteb_task, why,
            )  # fmt: skip
            task.neoembed_differs = why
    return task, instruction


def _test_rows(folder: Path) -> int | None:
    """The rows of a folder's one-file test split (``test.jsonl[.gz]``, ``test.parquet``, ``test.csv``: the pair
    tasks), or None for other layouts."""
    import gzip

    for path, opener in ((folder / "test.jsonl.gz", gzip.open), (folder / "test.jsonl", open)):
        if path.is_file():
            with opener(path, "rt", encoding="utf8") as f:
                return sum(1 for line in f if line.strip())
    if (folder / "test.parquet").is_file():
        import pyarrow.parquet as pq

        return pq.ParquetFile(folder / "test.parquet").metadata.num_rows
    if (folder / "test.csv").is_file():
        import pandas as pd

        return len(pd.read_csv(folder / "test.csv"))
    return None


def _task_from_dir(name: str, folder: Path):
    """A task folder: its task card, else its dataset card (an mteb task's data or a task of its type), else
    the data of the mteb task the folder is named after."""
    import mteb

    if (folder / CARD_FILE).is_file():
        card, data = load_task_card(folder)
        return build_card_task(card, data), card.instruction
    card = None
    if (folder / DATASET_CARD_FILE).is_file():
        mteb_name, card = dataset_card_task(folder)
        if mteb_name is None:
            return build_card_task(card, folder.resolve()), card.instruction
        name = mteb_name
    try:
        task = mteb.get_task(name)
    except Exception as e:  # mteb raises KeyError/ValueError for unknown names
        raise LocalDataError(
            f"{folder}: {name!r} is not an mteb task name, and the folder has no {CARD_FILE} task card "
            f"(or {DATASET_CARD_FILE} dataset card) saying what task it holds ({e})"
        ) from None
    task = point_task_at(task, folder)
    if card is None or task.metadata.type != card.type:
        return task, None
    try:  # mteb's loader expects the hub dataset's own columns; the folder may hold its card's layout
        task.load_data()
    except Exception as e:
        logger.warning(
            "%s: mteb's loader for %s does not read this folder (%s: %s); reading it as a %s task in the "
            "layout of its %s, with the task's splits and main score",
            folder,
            name,
            type(e).__name__,
            e,
            card.type,
            DATASET_CARD_FILE,
        )
        update = {"eval_splits": list(task.metadata.eval_splits), "main_score": task.metadata.main_score}
        if card.type == "STS":
            update["score_range"] = (getattr(task, "min_score", 0.0), getattr(task, "max_score", 5.0))
        return build_card_task(card.model_copy(update=update), folder.resolve()), card.instruction
    return task, None


def _is_group(folder: Path) -> bool:
    """Whether ``folder`` holds task folders (each with its own card) rather than one task's files."""
    if any((folder / f).is_file() for f in (CARD_FILE, DATASET_CARD_FILE, "README.md")):
        return False
    if any(p.is_file() and is_data_file(p) for p in folder.iterdir()):
        return False
    subfolders = [p for p in folder.iterdir() if p.is_dir()]
    return any(
        (p / CARD_FILE).is_file() or (p / DATASET_CARD_FILE).is_file() or _is_group(p) for p in subfolders
    )


def _find_task_folders(data_dir: Path, skip: bool):
    for folder in sorted(p for p in data_dir.iterdir() if p.is_dir()):
        if _is_group(folder):
            yield from _find_task_folders(folder, skip)
            continue
        if skip and (folder / DATASET_CARD_FILE).is_file() and not (folder / CARD_FILE).is_file():
            try:
                dataset_card_task(folder)
            except NotAnEvaluationTask as e:  # training pairs, say: not a task, and nothing wrong with them
                logger.info("skipped %s: not an evaluation task (its card's task_type is %s)", folder, e.task_type)
                continue
            except LocalDataError as e:  # a card that cannot be read as a task
                logger.warning("skipped %s: %s", folder, e)
                continue
        yield folder


def task_folders(data_dir: str | Path, skip_non_tasks: bool = True) -> dict[str, Path]:
    """Task name -> folder under ``data_dir``: its sub-folders that hold a task, and those of sub-folders that only
    group tasks (``data/mteb/STS13``, ``data/eval/MSRP``). Folders whose dataset card describes something other
    than an evaluation task (training pairs) are skipped with a warning, unless ``skip_non_tasks`` is False."""
    found: dict[str, Path] = {}
    for folder in _find_task_folders(Path(data_dir), skip_non_tasks):
        if folder.name in found:
            raise LocalDataError(
                f"two task folders are named {folder.name}: {found[folder.name]} and {folder}"
            )
        found[folder.name] = folder
    return found


def resolve_tasks(cfg: EvalConfig) -> list[tuple[object, str | None]]:
    """(mteb task, card instruction or None) for the run; with a data dir, tasks come from its folders."""
    import mteb

    out = []
    if cfg.benchmark is not None and (cfg.data_dir is not None or cfg.tasks):
        raise ValueError(  # the benchmark was ignored: the run said it scored one and scored other tasks
            f"--benchmark {cfg.benchmark!r} selects the benchmark's tasks; --data-dir or --tasks select others: "
            "give one of them"
        )
    if cfg.data_dir is not None:
        data_dir = Path(cfg.data_dir)
        if not data_dir.is_dir():
            what = "is a file, not a folder" if data_dir.exists() else "does not exist"
            raise LocalDataError(f"--data-dir {data_dir} {what}")
        found = task_folders(
            data_dir, skip_non_tasks=not cfg.tasks
        )  # a task asked for by name is never skipped
        names = cfg.tasks or list(found)
        if not names:
            raise LocalDataError(
                f"--data-dir {data_dir} has no task folders (one folder per task, named after it)"
            )
        for name in names:
            folder = found.get(name, data_dir / name)
            if not folder.is_dir():
                same = [f for f in found if f.lower() == name.lower()]  # names are case-sensitive, as mteb's
                hint = f" (did you mean {same[0]}?)" if same else ""
                raise LocalDataError(
                    f"task {name}{hint}: expected its data in {folder} (split files such as test.jsonl.gz, config "
                    f"folders such as corpus/ queries/ qrels/, or a {CARD_FILE} task card)"
                )
            try:
                out.append(_local_task(name, folder))
            except (LocalDataError, ValueError) as e:  # unusable folder: a failed task, not a failed run
                out.append((Unresolvable(name, e), None))
    else:
        for spec in cfg.tasks or []:
            p = Path(spec)
            if p.suffix in (".yaml", ".yml") and p.name != DATASET_CARD_FILE:
                card, data = load_task_card(p)
                out.append((build_card_task(card, data), card.instruction))
            elif p.is_dir() or p.name == DATASET_CARD_FILE:
                folder = p if p.is_dir() else p.parent
                out.append(_local_task(folder.name, folder))
        names = [
            t for t in cfg.tasks or [] if Path(t).suffix not in (".yaml", ".yml") and not Path(t).is_dir()
        ]
        if names or not cfg.tasks:
            bench = _benchmark(cfg.benchmark or "MTEB(eng, v1)") if not names else None
            selected = mteb.get_tasks(tasks=names) if names else list(bench.tasks)
            out.extend((t, None) for t in selected)
    if cfg.task_types:
        wanted = set(cfg.task_types)
        kept = [(t, i) for t, i in out if t.metadata.type in wanted or isinstance(t, Unresolvable)]
        if out and not kept:
            types = sorted({t.metadata.type for t, _ in out})
            raise ValueError(
                f"--task-types {','.join(cfg.task_types)} leaves none of the {len(out)} selected task(s) (their "
                f"types: {', '.join(types)}): widen --task-types or select other tasks"
            )
        out = kept
    _refuse_repeated_names(out)
    return out


def _refuse_repeated_names(tasks) -> None:
    """Results are kept by task name: a second task of one name would be reported as the first one's result
    ("skipped (results exist)") and never scored. Refused, naming where each comes from."""
    seen: dict[str, str] = {}
    for task, _ in tasks:
        name = task.metadata.name
        where = getattr(task, "neoembed_folder", None) or (getattr(task.metadata, "dataset", None) or {}).get("path")
        where = str(where or "mteb")
        if name in seen and seen[name] != where:
            raise ValueError(
                f"two tasks are named {name} ({seen[name]} and {where}): results are kept by task name, so one "
                "would never be scored; give each task card its own name"
            )
        seen[name] = where


def _benchmark(name: str):
    """mteb's benchmark ``name``; an unknown one is an error listing mteb's (mteb raises a bare KeyError)."""
    import mteb

    try:
        return mteb.get_benchmark(name)
    except KeyError:
        names = sorted(b.name for b in mteb.get_benchmarks())
        raise ValueError(f"--benchmark {name!r} is not one of mteb's benchmarks: {names}") from None


def is_registered(name: str) -> bool:
    import mteb

    try:
        mteb.get_task(name)
    except Exception:  # unknown to mteb: a local task card
        return False
    return True
