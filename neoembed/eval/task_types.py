"""Evaluation task types: one spec per type, the only place that names them.

A spec gives what a local task of that type needs (the columns mteb expects, the usual main score, mteb's
abstract task class, the name dataset cards use for it, the class settings a card adds) and its place in the
paper's Table 4 (order, task count in MTEB(eng, v1)). Adding a task type is one :class:`TaskTypeSpec` in
:data:`TASK_TYPES` and its test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module

__all__ = ["TASK_TYPES", "TaskTypeSpec", "card_type_names", "task_type"]


@dataclass(frozen=True)
class TaskTypeSpec:
    name: str  #: mteb's type name (``TaskMetadata.type``)
    mteb_eng_v1_tasks: int  #: tasks of this type in MTEB(eng, v1) (Table 4's suite)
    card_type: str | None = None  #: the ``task_type`` of dataset cards (``card.yaml``); None: no local cards
    columns: tuple[str, ...] = ()  #: mteb's columns; () for Retrieval (mteb's own corpus/queries/qrels files)
    main_score: str | None = None  #: the type's usual main score
    base: str | None = None  #: "module:Class" of mteb's abstract task, imported when a card task is built
    #: class attributes a card sets on its task class, from the card (score range, train split, ...)
    settings: Callable[[object], dict] = lambda card: {}
    loads: str = "rows"  #: how the data load: "rows" (renamed columns), "reranking" (converted), "retrieval"
    fits_on_train: bool = False  #: the card's ``train_split`` is loaded too (a classifier is fitted on it)

    def base_class(self) -> type:
        module, _, name = self.base.partition(":")
        return getattr(import_module(module), name)


TASK_TYPES: dict[str, TaskTypeSpec] = {
    spec.name: spec
    for spec in (
        TaskTypeSpec(
            "Classification", 12, "classification", ("text", "label"), "accuracy",
            "mteb.abstasks.classification:AbsTaskClassification",
            settings=lambda card: {"train_split": card.train_split}, fits_on_train=True,
        ),
        TaskTypeSpec(
            "Clustering", 11, "clustering", ("sentences", "labels"), "v_measure",
            "mteb.abstasks.clustering:AbsTaskClustering",
            # local sets are small: cluster every document, not mteb's 4% sample
            settings=lambda card: {"max_fraction_of_documents_to_embed": None},
        ),
        TaskTypeSpec(
            "PairClassification", 3, "pair_classification", ("sentence1", "sentence2", "labels"), "max_ap",
            "mteb.abstasks.pair_classification:AbsTaskPairClassification",
        ),
        TaskTypeSpec(
            "Reranking", 4, "reranking", ("query", "positive", "negative"), "map_at_1000",
            "mteb.abstasks.text.reranking:AbsTaskReranking", loads="reranking",
        ),
        TaskTypeSpec(
            "Retrieval", 15, "retrieval", (), "ndcg_at_10", "mteb.abstasks.retrieval:AbsTaskRetrieval",
            loads="retrieval",
        ),
        TaskTypeSpec(
            "STS", 10, "sts", ("sentence1", "sentence2", "score"), "cosine_spearman", "mteb.abstasks.sts:AbsTaskSTS",
            settings=lambda card: dict(zip(("min_score", "max_score"), card.score_range, strict=True)),
        ),
        TaskTypeSpec("Summarization", 1),  # in Table 4's suite; no local card tasks
    )
}  # fmt: skip


def card_type_names() -> dict[str, str]:
    """Dataset cards' ``task_type`` -> mteb type name, for the types a local card can hold."""
    return {s.card_type: s.name for s in TASK_TYPES.values() if s.card_type and s.base}


def task_type(name: str) -> TaskTypeSpec:
    """The spec of a type a card task can be; an error naming the valid ones otherwise."""
    spec = TASK_TYPES.get(name)
    if spec is None or spec.base is None:
        valid = sorted(n for n, s in TASK_TYPES.items() if s.base)
        raise ValueError(f"unknown task type {name!r} for a task card; valid: {valid}")
    return spec
