"""Distillation from teacher scores: Margin-MSE and KL, and their recipe block."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor

from neoembed.config import StrictModel


def _own_scores(queries: Tensor, docs: list[Tensor], temperature: float) -> Tensor:
    """(B, len(docs)) cosine of each query with its own positive and hard negatives, divided by ``temperature``."""
    return (
        torch.stack([F.cosine_similarity(queries.float(), d.float(), dim=-1) for d in docs], dim=1)
        / temperature
    )


def margin_mse(queries: Tensor, docs: list[Tensor], teacher: Tensor, config: DistillationConfig) -> Tensor:
    """Margin-MSE (Hofstätter et al. 2020): the mean squared difference between the student's margins
    ``s(q, d+) - s(q, d-_j)`` and the teacher's, with student scores ``cos / student_temperature``. Equals
    sentence-transformers' ``MarginMSELoss(similarity_fct=pairwise_cos_sim)`` at ``student_temperature: 1``."""
    student = _own_scores(queries, docs, config.student_temperature)
    teacher = teacher.detach().float()
    return F.mse_loss(student[:, :1] - student[:, 1:], teacher[:, :1] - teacher[:, 1:])


def kl_distillation(
    queries: Tensor, docs: list[Tensor], teacher: Tensor, config: DistillationConfig
) -> Tensor:
    """KL(teacher || student) over each query's positive and hard negatives (Lin et al. 2020), softmaxes at the
    student and teacher temperatures, scaled by the student temperature squared. Equals sentence-transformers'
    ``DistillKLDivLoss(similarity_fct=pairwise_cos_sim)`` at the same temperatures."""
    student = torch.log_softmax(_own_scores(queries, docs, config.student_temperature), dim=1)
    target = torch.softmax(teacher.detach().float() / config.teacher_temperature, dim=1)
    return F.kl_div(student, target, reduction="batchmean") * config.student_temperature**2


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
