"""InfoNCE, the loss of the unified contrastive recipe (NeoBERT paper, Section 5.2.1), plain and cached.

For a batch of B queries q_i, each with a positive d_i+ and k >= 0 hard negatives:

    logits_i = cos(q_i, [d_1+ ... d_B+, every hard negative of the batch]) / tau
    loss     = cross_entropy(logits, target = i), averaged over the batch (``reduction="sum"`` sums, as the
               released code does)

A document whose text equals q_i's own positive elsewhere in the batch is a duplicate, not a negative: it is
masked out of q_i's denominator (``mask_duplicates``).

| input columns | query, positive, negative_1 ... negative_k (k may be 0) |
|---|---|
| relations | equals sentence-transformers' ``MultipleNegativesRankingLoss(scale=1/tau)`` when no duplicates occur; ``CachedInfoNCELoss`` is the GradCache version (same loss and gradients, memory of one mini-batch) |
| references | van den Oord et al. 2018 (InfoNCE); Gao et al. 2021 (GradCache); Le Breton et al. 2025 (NeoBERT) |

Both classes are thin overrides of the sentence-transformers losses: they reuse their embedding, caching and
cross-device gathering, and replace only the scoring (temperature, duplicate mask, reduction). The plain loss
also encodes each batch in length groups (:func:`embed_by_length`): the same rows, fewer padding tokens.

Nested dimensions (``matryoshka:``) are sentence-transformers' ``MatryoshkaLoss`` around either form
(:func:`with_matryoshka`); CDE's two-stage step, which scores bare embeddings, sums them itself
(:meth:`MatryoshkaConfig.loss`).

Recipes name their loss in a sub-config (``loss: {name: cached_infonce, mini_batch_size: 32}``, a
:class:`LossConfig`); :data:`LOSSES` maps the names to the classes, each class lists the sub-config's keys it
reads (``recipe_options``: another loss's key is refused, not ignored), builds itself from a recipe
(``from_recipe``) and scores bare embeddings (``embedding_loss``, which CDE's two-stage step calls). A new loss
is one class with those, one entry in :data:`LOSSES` and its test.
"""

from __future__ import annotations

from pydantic import PositiveInt, field_validator, model_validator

from neoembed.config import StrictModel
from neoembed.losses.cached import CachedInfoNCELoss
from neoembed.losses.contrastive import improved_info_nce, info_nce
from neoembed.losses.distillation import DISTILLATION_LOSSES, DistillationConfig, kl_distillation, margin_mse
from neoembed.losses.grouping import embed_by_length, length_groups
from neoembed.losses.infonce import InfoNCELoss
from neoembed.losses.masks import (
    FalseNegativeConfig,
    duplicate_mask,
    duplicate_masker,
    false_negative_mask,
    false_negative_masker,
    text_keys,
)
from neoembed.losses.matryoshka import MatryoshkaConfig

__all__ = [
    "LOSSES",
    "DISTILLATION_LOSSES",
    "CachedInfoNCELoss",
    "DistillationConfig",
    "FalseNegativeConfig",
    "InfoNCELoss",
    "LossConfig",
    "MatryoshkaConfig",
    "build_loss",
    "check_loss_name",
    "counting_loss",
    "duplicate_mask",
    "duplicate_masker",
    "embed_by_length",
    "false_negative_mask",
    "false_negative_masker",
    "improved_info_nce",
    "info_nce",
    "kl_distillation",
    "length_groups",
    "margin_mse",
    "text_keys",
    "with_matryoshka",
]


#: loss name in a recipe -> its class
LOSSES: dict[str, type] = {
    "infonce": InfoNCELoss,
    "cached_infonce": CachedInfoNCELoss,
}


def check_loss_name(name: str) -> str:
    """``name`` if it is a registered loss; else an error naming the valid ones."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; valid: {sorted(LOSSES)}")
    return name


class LossConfig(StrictModel):
    """``loss:`` of a unified recipe: a loss of :data:`LOSSES` by ``name``, with the options it reads."""

    name: str = "infonce"
    mini_batch_size: PositiveInt = 32  # cached_infonce: texts per GradCache mini-batch

    @field_validator("name")
    @classmethod
    def _registered(cls, v):
        return check_loss_name(v)

    @model_validator(mode="after")
    def _options_of_this_loss(self):
        takes = LOSSES[self.name].recipe_options
        foreign = sorted(self.model_fields_set - {"name", *takes})
        if foreign:
            readers = {k: sorted(n for n, c in LOSSES.items() if k in c.recipe_options) for k in foreign}
            raise ValueError(
                "; ".join(
                    f"loss.{k} is read by {' and '.join(readers[k]) or 'no loss'} only" for k in foreign
                )
                + f", not by {self.name} (its options: {list(takes) or 'none'})"
            )
        return self


def build_loss(name: str, model, recipe):
    """The loss ``name`` for ``model``, with its settings read from ``recipe``; with ``matryoshka:``, wrapped in
    sentence-transformers' ``MatryoshkaLoss`` (:func:`with_matryoshka`)."""
    loss = LOSSES[check_loss_name(name)].from_recipe(model, recipe)
    matryoshka = getattr(recipe, "matryoshka", None)
    return loss if matryoshka is None else with_matryoshka(model, loss, matryoshka)


def with_matryoshka(model, loss, config: MatryoshkaConfig | dict):
    """``loss`` at every nested dimension of ``config``, weighted and summed: sentence-transformers'
    ``MatryoshkaLoss``, which reuses one forward pass for all dimensions (the plain loss) or decorates the GradCache
    scoring (the cached loss: each mini-batch still encoded twice). A dimension wider than the model is refused
    first, with the fix."""
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

    config = MatryoshkaConfig(**config) if isinstance(config, dict) else config
    config.check_width(model.get_embedding_dimension())
    dims, weights = zip(*config.pairs(), strict=True)
    return MatryoshkaLoss(model, loss, list(dims), list(weights))


def counting_loss(loss):
    """The InfoNCE loss inside ``loss`` (unwrapped from ``MatryoshkaLoss``): the one whose ``pop_counts`` says
    what it masked."""
    return getattr(loss, "loss", loss)
