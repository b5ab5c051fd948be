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
:class:`LossConfig`); :data:`LOSSES` maps the names to each class (imported when a run builds it) and the
sub-config's keys it reads (another loss's key is refused, not ignored); the class builds itself from a recipe
(``from_recipe``) and scores bare embeddings (``embedding_loss``, which CDE's two-stage step calls). A new loss
is one class with those, one entry in :data:`LOSSES` and its test.

The recipe blocks (:mod:`neoembed.losses.config`) import no torch, and neither does this package until one of
the losses or functions below is asked for: a recipe validates before torch loads.
"""

from __future__ import annotations

import importlib

from neoembed.losses.config import (
    LOSSES,
    DistillationConfig,
    FalseNegativeConfig,
    LossConfig,
    LossEntry,
    MatryoshkaConfig,
    check_loss_name,
    loss_class,
)
from neoembed.losses.distillation import DISTILLATION_LOSSES, kl_distillation, margin_mse

#: the names that import torch and sentence-transformers, each from its module, when first asked for
_LAZY = {
    "CachedInfoNCELoss": "cached",
    "InfoNCELoss": "infonce",
    "improved_info_nce": "contrastive",
    "info_nce": "contrastive",
    "embed_by_length": "grouping",
    "length_groups": "grouping",
    "duplicate_mask": "masks",
    "duplicate_masker": "masks",
    "false_negative_mask": "masks",
    "false_negative_masker": "masks",
    "text_keys": "masks",
    "MaskTally": "masks",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LOSSES",
    "DISTILLATION_LOSSES",
    "CachedInfoNCELoss",
    "DistillationConfig",
    "FalseNegativeConfig",
    "InfoNCELoss",
    "LossConfig",
    "LossEntry",
    "MaskTally",
    "MatryoshkaConfig",
    "build_loss",
    "check_loss_name",
    "duplicate_mask",
    "duplicate_masker",
    "embed_by_length",
    "false_negative_mask",
    "false_negative_masker",
    "improved_info_nce",
    "info_nce",
    "kl_distillation",
    "loss_class",
    "length_groups",
    "margin_mse",
    "text_keys",
    "with_matryoshka",
]


def build_loss(name: str, model, recipe, tally=None):
    """The loss ``name`` for ``model``, with its settings read from ``recipe``; with ``matryoshka:``, wrapped in
    sentence-transformers' ``MatryoshkaLoss`` (:func:`with_matryoshka`). False-negative masking reports what it
    drops to ``tally`` (a :class:`~neoembed.losses.masks.MaskTally`) where one is given."""
    loss = loss_class(name).from_recipe(model, recipe, tally=tally)
    matryoshka = getattr(recipe, "matryoshka", None)
    return loss if matryoshka is None else with_matryoshka(model, loss, matryoshka)


def with_matryoshka(model, loss, config: MatryoshkaConfig | dict | list[int]):
    """``loss`` at every nested dimension of ``config``, weighted and summed: sentence-transformers'
    ``MatryoshkaLoss``, which reuses one forward pass for all dimensions (the plain loss) or decorates the GradCache
    scoring (the cached loss: each mini-batch still encoded twice). A dimension wider than the model is refused
    first, with the fix."""
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

    # the dims alone, as sentence-transformers' MatryoshkaLoss takes them
    if isinstance(config, (list, tuple)):
        config = {"dims": list(config)}
    config = MatryoshkaConfig(**config) if isinstance(config, dict) else config
    if not isinstance(config, MatryoshkaConfig):
        raise TypeError(f"with_matryoshka takes a list of dims, a dict or a MatryoshkaConfig, not {config!r}")
    config.check_width(model.get_embedding_dimension())
    dims, weights = zip(*config.pairs(), strict=True)
    return MatryoshkaLoss(model, loss, list(dims), list(weights))
