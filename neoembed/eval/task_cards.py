"""Task cards: a local dataset described in a few lines of YAML runs as an mteb task of its type.

A task card (``task.yaml`` in the data folder, or any ``*.yaml`` passed to ``--tasks``)::

    name: MSRP                          # task name used in results and prompts
    type: PairClassification            # STS | PairClassification | Reranking | Retrieval | Classification | Clustering
    data: ../shared/data/eval/MSRP      # folder with the split files; relative to the card (default: its folder)
    eval_splits: [test]
    columns: {sentence1: sentence1, sentence2: sentence2, labels: label}   # mteb column <- file column
    main_score: max_ap                  # optional: the type's usual main score otherwise
    instruction: "Retrieve text that is semantically similar to the given text."   # optional
    description: Microsoft Research Paraphrase Corpus, test split.
    score_range: [0, 5]                 # STS only: min and max gold score

Column names mteb expects, per type: STS ``sentence1, sentence2, score``; PairClassification ``sentence1,
sentence2, labels`` (0/1); Reranking ``query, positive, negative`` (lists of texts); Classification ``text, label``
(a ``train_split`` to fit the classifier on, default ``train``); Clustering ``sentences, labels``; Retrieval uses
mteb's own files (``corpus`` with ``_id, title, text``; ``queries`` with ``_id, text``; ``qrels/<split>`` with
``query-id, corpus-id, score``) and no column mapping. A column the card does not map is also found under its
usual other name (``label`` for ``labels``, ``positives`` for ``positive``, ``sentence`` for ``text``, ...).

A data folder described by a dataset card instead (``card.yaml``: ``name``, ``task_type`` such as ``sts``,
``pair_classification``, ``reranking``; ``mteb_task`` when it is an mteb task's data; ``splits``) runs without a
task card: as that mteb task, or as a card task of its type (see :func:`dataset_card_task`).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import yaml
from pydantic import ValidationError, field_validator

from neoembed.card_schema import DatasetCard
from neoembed.eval.local_data import LocalDataError, NotAnEvaluationTask, is_data_file, local_dataset_repo
from neoembed.eval.task_types import card_type_names, task_type
from neoembed.recipe import RecipeError, StrictModel, format_validation_error

__all__ = [
    "CARD_FILE",
    "DATASET_CARD_FILE",
    "TaskCard",
    "build_card_task",
    "dataset_card_task",
    "load_task_card",
    "read_dataset_card",
]

logger = logging.getLogger(__name__)

CARD_FILE = "task.yaml"
DATASET_CARD_FILE = "card.yaml"
# the other names a column goes by in data files; used where a card maps nothing for it
COLUMN_ALIASES = {
    "labels": ("label",),
    "label": ("labels",),
    "score": ("similarity", "gold_score"),
    "positive": ("positives", "pos"),
    "negative": ("negatives", "neg"),
    "text": ("sentence", "sentences"),
    "sentences": ("sentence", "text"),
}


class TaskCard(StrictModel):
    name: str
    type: str  # a name in neoembed.eval.task_types.TASK_TYPES that local cards can hold
    data: str = "."
    eval_splits: list[str] = ["test"]
    columns: dict[str, str] = {}
    main_score: str | None = None
    instruction: str | None = None
    description: str = "A local task described by a neoembed task card."
    score_range: tuple[float, float] = (0.0, 5.0)
    license: str | None = None
    train_split: str = "train"

    @field_validator("type")
    @classmethod
    def _registered_type(cls, v):
        return task_type(v).name


def load_task_card(path: str | Path) -> tuple[TaskCard, Path]:
    """Validate a task card; returns it with its data folder resolved against the card's own folder."""
    path = Path(path)
    if path.is_dir():
        path = path / CARD_FILE
    if not path.is_file():
        raise LocalDataError(f"no task card at {path}")
    raw = yaml.safe_load(path.read_text(encoding="utf8")) or {}
    try:
        card = TaskCard.model_validate(raw)
    except ValidationError as e:
        raise RecipeError(format_validation_error(e, TaskCard, str(path))) from None
    data = (path.parent / card.data).resolve()
    if not data.is_dir():
        what = "is a file, not a folder" if data.exists() else "does not exist"
        raise LocalDataError(f"task card {path}: data folder {data} {what}")
    return card, data


def read_dataset_card(folder: str | Path) -> DatasetCard:
    """The folder's dataset card (``card.yaml``), validated; a :class:`LocalDataError` naming the file if not."""
    path = Path(folder) / DATASET_CARD_FILE
    raw = yaml.safe_load(path.read_text(encoding="utf8")) or {}
    if not isinstance(raw, dict):
        raise LocalDataError(f"{path} is not a mapping")
    try:  # the dataset card schema is shared with training and corpus cards (neoembed.card_schema)
        return DatasetCard.model_validate(raw)
    except ValidationError as e:
        raise LocalDataError(format_validation_error(e, DatasetCard, str(path))) from None


def dataset_card_task(folder: str | Path) -> tuple[str | None, TaskCard | None]:
    """What a folder described by a dataset card (``card.yaml``) holds: ``(mteb task name, card task)``.

    The name is the card's ``mteb_task`` (``None`` if it has none); the card task reads the folder as a task of
    the card's ``task_type`` (``None`` when that type is not one a card task can be; an error when there is no
    mteb task either), evaluated on ``test`` when the card lists that split, else on every split but ``train``.
    """
    folder = Path(folder)
    path = folder / DATASET_CARD_FILE
    dcard = read_dataset_card(folder)
    mteb_task = dcard.mteb_task or None
    kind = str(dcard.task_type or "").lower()
    card_types = card_type_names()
    if kind not in card_types:
        if mteb_task:
            return mteb_task, None
        raise NotAnEvaluationTask(
            f"{path}: task_type {dcard.task_type!r} is not an evaluation task; valid: "
            f"{sorted(card_types)} (or set mteb_task)",
            str(dcard.task_type),
        )
    splits = list(dcard.splits) or ["test"]
    eval_splits = ["test"] if "test" in splits else [s for s in splits if s != "train"]
    if not eval_splits:
        raise LocalDataError(f"{path}: no evaluation split among {splits}")
    card = TaskCard(
        name=mteb_task or str(dcard.name or folder.name),
        type=card_types[kind],
        eval_splits=eval_splits,
        description=str(
            dcard.format or f"Local data in {folder.name}, described by its {DATASET_CARD_FILE}."
        ),
        license=dcard.license or None,
        instruction=dcard.instruction,
    )
    return mteb_task, card


def _column_source(card: TaskCard, column: str, available: list[str]) -> str:
    """The file column that feeds mteb's ``column``: the card's mapping, the column itself, or an alias."""
    if column in card.columns:
        return card.columns[column]
    if column in available:
        return column
    return next((a for a in COLUMN_ALIASES.get(column, ()) if a in available), column)


def _load_renamed(card: TaskCard, data: Path):
    import datasets

    repo = local_dataset_repo(data)
    empty = sorted(f.name for f in Path(data).iterdir() if is_data_file(f) and f.stat().st_size == 0)
    if empty:  # datasets' error for one is a StopIteration without a message (a .gitkeep is no data file)
        raise LocalDataError(f"task {card.name}: {data} holds empty file(s) {empty}: fill or remove them")
    ds = datasets.load_dataset(str(repo))
    spec = task_type(card.type)
    splits = card.eval_splits + ([card.train_split] if spec.fits_on_train else [])
    missing_splits = [s for s in splits if s not in ds]
    if missing_splits:
        raise LocalDataError(f"task {card.name}: split(s) {missing_splits} not in {data} (found {list(ds)})")
    out = {}
    for split in dict.fromkeys(splits):
        d = ds[split]
        mapping = {_column_source(card, c, d.column_names): c for c in spec.columns}
        missing = [src for src in mapping if src not in d.column_names]
        if missing:
            raise LocalDataError(
                f"task {card.name}: column(s) {missing} not in {data} split {split} (has {d.column_names}); "
                f"map them with `columns:` (mteb expects {list(spec.columns)})"
            )
        d = d.select_columns(list(mapping)).rename_columns({k: v for k, v in mapping.items() if k != v})
        out[split] = d
    return datasets.DatasetDict(out)


def reranking_as_retrieval(dataset, task: str = "the task") -> dict:
    """Rows of ``query``, ``positive`` (list) and ``negative`` (list) per split -> mteb's retrieval layout with
    each query's candidates as its ``top_ranked``, under the ids mteb's own conversion gives them (so ties break
    the same way). mteb converts only tasks whose names were appended to its module-level
    ``OLD_FORMAT_RERANKING_TASKS``; neoembed leaves that list alone and converts here."""
    from datasets import Dataset
    from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData

    out = {}
    for split, rows in dataset.items():
        kept = [r for r in rows if len(r["positive"]) > 0 and len(r["negative"]) > 0]
        if len(kept) < len(rows):  # as mteb's own conversion does, but said: the score covers fewer queries
            logger.warning(
                "%s, %s split: %d of %d queries have no positive or no negative and are left out of the score",
                task,
                split,
                len(rows) - len(kept),
                len(rows),
            )
        if not kept:  # else mteb's "Column 'id' doesn't exist", naming neither
            raise LocalDataError(f"{task}, {split} split: no query has both a positive and a negative to rank")
        corpus, queries, relevant, top_ranked = [], [], {}, {}
        for i, row in enumerate(kept):
            # one text given as a string is one candidate (enumerate would take each character for one)
            row = {**row, **{k: [row[k]] if isinstance(row[k], str) else row[k] for k in ("positive", "negative")}}
            qid = f"{split}_query{i}"
            queries.append({"id": qid, "text": row["query"]})
            docs = [(f"apositive_{qid}_{j:05d}", t, 1) for j, t in enumerate(row["positive"])]
            docs += [(f"negative_{qid}_{j:05d}", t, 0) for j, t in enumerate(row["negative"])]
            corpus += [{"title": "", "text": t, "id": doc_id} for doc_id, t, _ in docs]
            relevant[qid] = {doc_id: rel for doc_id, _, rel in docs}
            top_ranked[qid] = [doc_id for doc_id, _, _ in docs]
        out[split] = RetrievalSplitData(
            corpus=Dataset.from_list(corpus),
            queries=Dataset.from_list(queries),
            relevant_docs=relevant,
            top_ranked=top_ranked,
        )
    return out


def build_card_task(card: TaskCard, data: Path):
    """An mteb task object of the card's type whose data come from ``data`` (the type's spec says how)."""
    spec = task_type(card.type)
    metadata = _card_metadata(card, spec, data)
    base = spec.base_class()
    if spec.loads == "retrieval":  # mteb's own loader reads the folder's corpus / queries / qrels files

        class CardTask(base):  # type: ignore[valid-type,misc]
            def load_data(self, num_proc=None, **kwargs):
                if self.data_loaded:
                    return
                super().load_data(num_proc=num_proc, **kwargs)
                for splits in self.dataset.values():
                    for split, loaded in splits.items():
                        check_retrieval_split(card.name, split, loaded)

    else:

        class CardTask(base):  # type: ignore[valid-type,misc]
            def load_data(self, num_proc=None, **kwargs):
                if self.data_loaded:
                    return
                rows = _load_renamed(card, data)
                for split, d in rows.items():
                    check_rows(card, split, d)
                if spec.loads == "reranking":
                    self.dataset = {s: reranking_as_retrieval(rows, card.name) for s in self.hf_subsets}
                else:
                    self.dataset = rows
                self.data_loaded = True

    # the card's fields that change a score, which a result's data fingerprint takes in (eval.local_data)
    CardTask.card_fields = json.dumps(card.model_dump(include=SCORED_FIELDS), sort_keys=True)

    def _add_main_score(self, scores: dict) -> None:  # mteb's own: a bare KeyError after the scoring
        if self.metadata.main_score not in scores:
            computed = sorted(k for k, v in scores.items() if isinstance(v, int | float))
            raise LocalDataError(
                f"task {card.name}: main_score {self.metadata.main_score!r} is not a score a {card.type} task "
                f"computes; choose one of {computed}"
            )
        base._add_main_score(self, scores)

    CardTask._add_main_score = _add_main_score
    for key, value in spec.settings(card).items():
        setattr(CardTask, key, value)
    CardTask.metadata = metadata
    CardTask.neoembed_folder = str(data)  # as errors name it (a retrieval card's dataset path is a local repo's)
    CardTask.__name__ = f"Card{card.type}_{card.name}"
    return CardTask()


#: a task card's fields that change what is scored or how: a result is reused only where they are as they were
SCORED_FIELDS = {"type", "eval_splits", "columns", "main_score", "score_range", "train_split"}


def check_rows(card: TaskCard, split: str, rows) -> None:
    """The rows mteb would score without a word, or fail on with an error naming neither row nor file: STS scores
    that are not numbers or all one value (Spearman is NaN, which reads as the model's fault), pair labels
    other than 0 and 1, fewer than two rows to correlate."""
    where = f"task {card.name}, {split} split"
    if card.type in ("STS", "PairClassification") and len(rows) < 2:
        raise LocalDataError(f"{where}: {len(rows)} row(s); a correlation or an average precision needs 2 or more")
    if card.type == "STS":
        for i, score in enumerate(rows["score"]):
            if isinstance(score, bool) or not isinstance(score, int | float) or score != score:
                raise LocalDataError(f"{where}, row {i + 1}: score {score!r} is not a number")
        if len(set(rows["score"])) == 1:
            raise LocalDataError(f"{where}: every gold score is {rows['score'][0]}: nothing to correlate with")
    if card.type == "Clustering" and len(rows) and not isinstance(rows[0]["sentences"], str):
        raise LocalDataError(
            f"{where}, row 1: sentences is a {type(rows[0]['sentences']).__name__}, not a text: a Clustering card "
            "takes one text and its label per row (mteb's older layout, one clustering set of lists per row, is "
            "not read)"
        )
    if card.type == "PairClassification":
        bad = next(((i, v) for i, v in enumerate(rows["labels"]) if v not in (0, 1)), None)  # 1.0 and True are 1
        if bad is not None:
            raise LocalDataError(f"{where}, row {bad[0] + 1}: label {bad[1]!r}; pair labels are 0 or 1")


def check_retrieval_split(task: str, split: str, loaded: dict) -> None:
    """mteb's retrieval files as mteb read them, refused where the score would be silently wrong: a query or
    document id given twice (one text replaces the other), qrels naming a document the corpus lacks (counted as a
    miss), or no relevance above 0 (nothing to find)."""
    where = f"task {task}, {split} split"
    for kind in ("queries", "corpus"):
        repeated = sorted((i for i, n in Counter(loaded[kind]["id"]).items() if n > 1), key=str)
        if repeated:
            raise LocalDataError(f"{where}: the {kind} file gives id(s) {repeated[:5]} more than once")
    corpus = set(loaded["corpus"]["id"])
    missing = sorted({d for docs in loaded["relevant_docs"].values() for d in docs if d not in corpus}, key=str)
    if missing:
        raise LocalDataError(
            f"{where}: qrels name document(s) {missing[:5]} ({len(missing)} in all) not in the corpus"
        )
    if not any(rel > 0 for docs in loaded["relevant_docs"].values() for rel in docs.values()):
        raise LocalDataError(f"{where}: no qrels relevance is above 0: no query has a document to find")
    queries = set(loaded["queries"]["id"])
    unasked = sorted((q for q in loaded["relevant_docs"] if q not in queries), key=str)
    if unasked:
        logger.warning("%s: qrels name query id(s) %s not in the queries file: left out", where, unasked[:5])


def _card_metadata(card: TaskCard, spec, data: Path):
    from mteb.abstasks.task_metadata import TaskMetadata

    path = local_dataset_repo(data) if spec.loads == "retrieval" else data
    fields = dict(
        name=card.name,
        description=card.description,
        dataset={"path": str(path), "revision": "local"},
        type=card.type,
        category="t2t",
        modalities=["text"],
        eval_splits=card.eval_splits,
        eval_langs=["eng-Latn"],
        main_score=card.main_score or spec.main_score,
        license=card.license,
        prompt=card.instruction,
    )
    try:
        return TaskMetadata(**fields)
    except ValidationError as e:
        if not card.license or not any(err["loc"][:1] == ("license",) for err in e.errors()):
            raise
        # mteb takes an SPDX-like name or a URL; a licence in words goes into the description instead
        fields.update(license=None, description=f"{card.description} Licence: {card.license}")
        return TaskMetadata(**fields)
