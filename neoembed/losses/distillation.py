"""Distillation from teacher scores: Margin-MSE and KL, and their recipe block."""

from __future__ import annotations

import functools
from collections.abc import Callable

from pydantic import Field, model_validator
from torch import Tensor

from neoembed.config import StrictModel


@functools.cache
def _sentence_transformers_loss(name: str, student_temperature: float, teacher_temperature: float):
    """sentence-transformers' loss ``name`` on cosine scores (one per setting: its once-only teacher-scale check
    stays once)."""
    from sentence_transformers.sentence_transformer.losses import DistillKLDivLoss, MarginMSELoss
    from sentence_transformers.util import pairwise_cos_sim

    if name == "margin_mse":
        return MarginMSELoss(None, similarity_fct=lambda a, b: pairwise_cos_sim(a, b) / student_temperature)
    return DistillKLDivLoss(
        None,
        similarity_fct=pairwise_cos_sim,
        student_temperature=student_temperature,
        teacher_temperature=teacher_temperature,
    )


def _on_embeddings(name: str, queries: Tensor, docs: list[Tensor], teacher: Tensor, config) -> Tensor:
    """sentence-transformers' loss ``name`` on embeddings already computed, in float32 (bf16 scores would round
    the margins away)."""
    loss = _sentence_transformers_loss(name, config.student_temperature, config.teacher_temperature)
    return loss.compute_loss_from_embeddings([queries.float(), *(d.float() for d in docs)], teacher.float())


def margin_mse(queries: Tensor, docs: list[Tensor], teacher: Tensor, config: DistillationConfig) -> Tensor:
    """Margin-MSE (Hofstätter et al. 2020): the mean squared difference between the student's margins
    ``s(q, d+) - s(q, d-_j)`` and the teacher's, with student scores ``cos / student_temperature``:
    sentence-transformers' ``MarginMSELoss`` on those scores."""
    return _on_embeddings("margin_mse", queries, docs, teacher, config)


def kl_distillation(
    queries: Tensor, docs: list[Tensor], teacher: Tensor, config: DistillationConfig
) -> Tensor:
    """KL(teacher || student) over each query's positive and hard negatives (Lin et al. 2020), softmaxes at the
    student and teacher temperatures, scaled by the student temperature squared: sentence-transformers'
    ``DistillKLDivLoss`` on cosine scores."""
    return _on_embeddings("kl", queries, docs, teacher, config)


#: distillation loss name in a recipe (``distillation: {loss: ...}``) -> the function over embeddings and teacher
#: scores; a new one is one function, one entry, one test
DISTILLATION_LOSSES: dict[str, Callable[..., Tensor]] = {"margin_mse": margin_mse, "kl": kl_distillation}


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
        want = (len(queries), len(docs))
        if teacher is None or tuple(teacher.shape) != want:
            got = "none" if teacher is None else tuple(teacher.shape)
            raise ValueError(
                f"distillation needs each row's teacher scores (positive, then each of its {len(docs) - 1} hard "
                f"negatives): expected labels of shape {want}, got {got}. Declare the card's score column "
                "(columns.scores) or add one with `neoembed score CARD --teacher MODEL`"
            )
        return self.weight * DISTILLATION_LOSSES[self.loss](queries, docs, teacher, self)
