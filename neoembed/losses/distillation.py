"""Distillation from teacher scores: Margin-MSE and KL (their recipe block is
:class:`neoembed.losses.config.DistillationConfig`). Light at import: the recipe block validates names against
:data:`DISTILLATION_LOSSES` before torch loads."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import Tensor


class Temperatures(Protocol):
    """What the losses read of the recipe's ``distillation:`` block (:class:`~neoembed.losses.config.DistillationConfig`)."""

    student_temperature: float
    teacher_temperature: float


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


def margin_mse(queries: Tensor, docs: list[Tensor], teacher: Tensor, config: Temperatures) -> Tensor:
    """Margin-MSE (Hofstätter et al. 2020): the mean squared difference between the student's margins
    ``s(q, d+) - s(q, d-_j)`` and the teacher's, with student scores ``cos / student_temperature``:
    sentence-transformers' ``MarginMSELoss`` on those scores."""
    return _on_embeddings("margin_mse", queries, docs, teacher, config)


def kl_distillation(queries: Tensor, docs: list[Tensor], teacher: Tensor, config: Temperatures) -> Tensor:
    """KL(teacher || student) over each query's positive and hard negatives (Lin et al. 2020), softmaxes at the
    student and teacher temperatures, scaled by the student temperature squared: sentence-transformers'
    ``DistillKLDivLoss`` on cosine scores."""
    return _on_embeddings("kl", queries, docs, teacher, config)


#: distillation loss name in a recipe (``distillation: {loss: ...}``) -> the function over embeddings and teacher
#: scores; a new one is one function, one entry, one test
DISTILLATION_LOSSES: dict[str, Callable[..., Tensor]] = {"margin_mse": margin_mse, "kl": kl_distillation}
