"""The recipe blocks of the losses (``loss:``, ``false_negatives:``, ``distillation:``, ``matryoshka:``) and the
registry of losses by name. Nothing here imports torch: a recipe validates, and a command refuses a bad one,
before torch loads; the methods that compute import what they need when called."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, NamedTuple

from pydantic import Field, PositiveInt, field_validator, model_validator

from neoembed.config import StrictModel
from neoembed.losses.distillation import DISTILLATION_LOSSES

if TYPE_CHECKING:
    from torch import Tensor

    from neoembed.scoring import Matrix


class LossEntry(NamedTuple):
    """A loss of :data:`LOSSES`: its class as ``module:Class`` (imported when a run builds it, so that a recipe
    validates without torch) and the keys of the recipe's loss sub-config it reads (another loss's key is
    refused, not ignored)."""

    path: str
    options: tuple[str, ...] = ()

    def load(self) -> type:
        module, name = self.path.split(":")
        return getattr(importlib.import_module(module), name)


#: loss name in a recipe -> its entry; a new loss is one class, one entry here and its test
LOSSES: dict[str, LossEntry] = {
    "infonce": LossEntry("neoembed.losses.infonce:InfoNCELoss"),
    "cached_infonce": LossEntry(
        "neoembed.losses.cached:CachedInfoNCELoss", ("mini_batch_size", "mini_batch_num_tokens")
    ),
}


def check_loss_name(name: str) -> str:
    """``name`` if it is a registered loss; else an error naming the valid ones."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; valid: {sorted(LOSSES)}")
    return name


def loss_class(name: str) -> type:
    """The class of registered loss ``name`` (imports torch and sentence-transformers)."""
    return LOSSES[check_loss_name(name)].load()


class LossConfig(StrictModel):
    """``loss:`` of a unified recipe: a loss of :data:`LOSSES` by ``name``, with the options it reads."""

    name: str = "infonce"
    mini_batch_size: PositiveInt = 32  # cached_infonce: texts per GradCache mini-batch
    # cached_infonce: mini-batches filled to this many tokens instead (sentence-transformers' option), so that a
    # batch of long documents takes more, smaller mini-batches and one of short texts fewer
    mini_batch_num_tokens: PositiveInt | None = None

    @field_validator("name")
    @classmethod
    def _registered(cls, v):
        return check_loss_name(v)

    @model_validator(mode="after")
    def _options_of_this_loss(self):
        takes = LOSSES[self.name].options
        foreign = sorted(self.model_fields_set - {"name", *takes})
        if foreign:
            readers = {k: sorted(n for n, e in LOSSES.items() if k in e.options) for k in foreign}
            raise ValueError(
                "; ".join(
                    f"loss.{k} is read by {' and '.join(readers[k]) or 'no loss'} only" for k in foreign
                )
                + f", not by {self.name} (its options: {list(takes) or 'none'})"
            )
        return self


class FalseNegativeConfig(StrictModel):
    """False-negative masking: a candidate scoring above its query's positive minus a margin is dropped from
    that query's denominator, judged on the model's own (detached) cosine similarities.

    ``mode: absolute`` drops ``s > s_pos - margin``; ``mode: relative`` drops ``s > s_pos - |s_pos| * margin``,
    which equals sentence-transformers' ``s_pos * (1 - margin)`` for positive scores and stays below the positive
    when it is negative (sentence-transformers PR #3821). ``scope``: ``all`` candidates, ``in_batch`` (the other
    queries' documents) or ``hard`` (the query's own hard negatives)."""

    margin: float = Field(0.0, ge=0.0)
    mode: Literal["absolute", "relative"] = "absolute"
    scope: Literal["all", "in_batch", "hard"] = "all"

    @model_validator(mode="after")
    def _check(self):
        # cosines lie in [-1, 1]: an absolute margin of 2 drops every candidate (s > s_pos - 2 always), and a
        # relative one of 1 every candidate scoring above 0 when the positive does; the loss would be 0
        limit = 2.0 if self.mode == "absolute" else 1.0
        if self.margin >= limit:
            what = (
                "every negative (cosine scores lie in [-1, 1])"
                if self.mode == "absolute"
                else "every negative scoring above 0 whenever the positive does"
            )
            raise ValueError(
                f"false_negatives.margin={self.margin:g} with mode {self.mode} masks {what}, so the loss is 0 "
                f"and nothing trains: use a margin below {limit:g} (0.05-0.1 is usual)"
            )
        return self


class DistillationConfig(StrictModel):
    """Distillation from teacher scores (each row's ``label``: the teacher's score of its positive, then of each
    hard negative): ``loss`` is a name in :data:`DISTILLATION_LOSSES`, added with ``weight`` to InfoNCE weighted
    ``infonce_weight`` (0: distillation alone, InfoNCE not computed)."""

    loss: str = "kl"
    weight: float = Field(1.0, ge=0.0)
    infonce_weight: float = Field(1.0, ge=0.0)
    student_temperature: float = Field(1.0, gt=0.0)
    teacher_temperature: float = Field(1.0, gt=0.0)

    @model_validator(mode="after")
    def _check(self):
        if self.loss not in DISTILLATION_LOSSES:
            raise ValueError(f"unknown distillation loss {self.loss!r}; valid: {sorted(DISTILLATION_LOSSES)}")
        if self.weight == 0:
            raise ValueError(
                "distillation.weight=0 adds nothing to the loss, so the run would distil nothing while its record "
                "says it did: give a positive weight, or remove the distillation block"
            )
        return self

    def term(self, queries: Tensor, docs: list[Tensor], teacher: Tensor | None) -> Tensor:
        """The weighted distillation loss; teacher scores of the wrong shape are an error saying what to fix."""
        if len(docs) < 2:  # one candidate: its softmax is 1 and it has no margin, whatever the scores
            raise ValueError(
                "distillation compares each row's positive with its hard negatives, and these rows have none: "
                "the loss would be 0 whatever the teacher says. Train on rows with hard negatives, or without "
                "distillation"
            )
        want = (len(queries), len(docs))
        if teacher is None or tuple(teacher.shape) != want:
            got = "none" if teacher is None else tuple(teacher.shape)
            raise ValueError(
                f"distillation needs each row's teacher scores (positive, then each of its {len(docs) - 1} hard "
                f"negatives): expected labels of shape {want}, got {got}. Declare the card's score column "
                "(columns.scores) or add one with `neoembed score CARD --teacher MODEL`; in a "
                "sentence-transformers dataset, a label column holding each row's list of scores"
            )
        finite = teacher.isfinite().all(dim=1)
        if not bool(finite.all()):  # the batch's rows: the card check names the file's rows before training
            rows = (~finite).nonzero().flatten().tolist()
            raise ValueError(
                f"teacher scores of batch row(s) {rows[:10]} are NaN or infinite: the loss would be NaN and the "
                "weights with it. Drop those rows or rescore them (`neoembed data check CARD` names them in a card)"
            )
        return self.weight * DISTILLATION_LOSSES[self.loss](queries, docs, teacher, self)


class MatryoshkaConfig(StrictModel):
    """Nested dimensions (Kusupati et al. 2022): the loss is ``sum_k weight_k * loss(embeddings[:, :dim_k])``.
    ``weights`` default to 1 each. The unified losses are wrapped in sentence-transformers' ``MatryoshkaLoss``
    (:func:`neoembed.losses.with_matryoshka`); :meth:`loss` serves CDE's two-stage step, on bare embeddings."""

    dims: list[PositiveInt] = Field(min_length=1)
    weights: list[float] | None = None

    @model_validator(mode="after")
    def _check(self):
        if len(set(self.dims)) != len(self.dims):
            raise ValueError(f"matryoshka.dims {self.dims} repeat a dimension; list each once")
        if self.weights is not None and len(self.weights) != len(self.dims):
            raise ValueError(
                f"matryoshka.weights has {len(self.weights)} entries for {len(self.dims)} dims {self.dims}: "
                "give one weight per dimension, or none (1 each)"
            )
        if self.weights is not None and min(self.weights) <= 0:
            raise ValueError(
                f"matryoshka.weights {self.weights} has a weight <= 0, so its dimension is not trained (or trained "
                "away): give positive weights, or drop the dimension from dims"
            )
        return self

    def pairs(self) -> list[tuple[int, float]]:
        """(dim, weight), largest dimension first."""
        weights = self.weights if self.weights is not None else [1.0] * len(self.dims)
        return sorted(zip(self.dims, weights, strict=True), reverse=True)

    def check_width(self, width: int) -> None:
        """Fail when a dimension exceeds the model's embedding width."""
        if wide := [d for d in self.dims if d > width]:
            raise ValueError(
                f"matryoshka.dims {self.dims}: {', '.join(map(str, wide))} exceed the model's embedding dimension "
                f"{width}; keep dims <= {width}"
            )

    def loss(self, fn: Callable[..., Tensor], queries: Matrix, docs, *args, **kwargs) -> Tensor:
        """``fn(queries, docs, ...)`` at every dimension, weighted and summed; ``docs`` a tensor or a list of
        matrices, each matrix a tensor or a list of segments."""
        from neoembed.losses.matrices import _cut

        total = 0.0
        for dim, weight in self.pairs():
            cut = [_cut(d, dim) for d in docs] if isinstance(docs, list) else _cut(docs, dim)
            total = total + weight * fn(_cut(queries, dim), cut, *args, **kwargs)
        return total
