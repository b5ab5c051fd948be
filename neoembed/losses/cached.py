"""The GradCache form of InfoNCE, on sentence-transformers' CachedMultipleNegativesRankingLoss."""

from __future__ import annotations

from collections.abc import Iterator

from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
)
from torch import Tensor

from neoembed.config import check_positive_int
from neoembed.losses.config import DistillationConfig, FalseNegativeConfig
from neoembed.losses.contrastive import info_nce
from neoembed.losses.infonce import _InfoNCEMixin, _objective_config, _recipe_settings, _unpack, check_flags
from neoembed.losses.masks import MaskTally


class CachedInfoNCELoss(_InfoNCEMixin, CachedMultipleNegativesRankingLoss):
    """GradCache InfoNCE: embeddings computed in mini-batches without graph, loss and embedding gradients on
    the full batch, then a second chunked pass backpropagates them. Same loss and gradients as
    :class:`InfoNCELoss` with the activations of one mini-batch: beside them, the batch's embeddings, their
    gradients and one row chunk of logits (:mod:`neoembed.scoring`)."""

    def __init__(
        self,
        model,
        temperature: float = 0.07,
        mask_duplicates: bool = True,
        reduction: str = "mean",
        mini_batch_size: int = 32,
        mini_batch_num_tokens: int | None = None,
        gather_across_devices: bool = False,
        show_progress_bar: bool = False,
        false_negatives: FalseNegativeConfig | dict | None = None,
        improved_contrastive: bool = False,
        distillation: DistillationConfig | dict | None = None,
        tally: MaskTally | None = None,
    ) -> None:
        self._setup(temperature, mask_duplicates, reduction)
        self._setup_objective(false_negatives, improved_contrastive, distillation, tally)
        check_positive_int(mini_batch_size, "mini_batch_size", " of rows")
        check_flags(gather_across_devices=gather_across_devices, show_progress_bar=show_progress_bar)
        if mini_batch_num_tokens is not None:
            check_positive_int(mini_batch_num_tokens, "mini_batch_num_tokens", " of tokens")
        super().__init__(
            model,
            scale=1.0 / temperature,
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            gather_across_devices=gather_across_devices,
            show_progress_bar=show_progress_bar,
        )

    embedding_loss = staticmethod(info_nce)  # the same loss as InfoNCELoss's

    def embed_minibatch_iter(
        self, sentence_feature, with_grad, copy_random_state, random_states=None, ranges=None
    ) -> Iterator[tuple[Tensor, object]]:
        """sentence-transformers' mini-batch pass; without gradient (the pass whose embeddings the loss
        scores), each mini-batch is written into one buffer per column, so that the scoring reads the column
        in place instead of joining a copy of the whole batch's embeddings."""
        batches = super().embed_minibatch_iter(
            sentence_feature, with_grad, copy_random_state, random_states=random_states, ranges=ranges
        )
        if with_grad or ranges is None:
            yield from batches
            return
        total, buffer, at = sum(end - begin for begin, end in ranges), None, 0
        for reps, random_state in batches:
            if buffer is None:
                buffer = reps.new_empty(total, *reps.shape[1:])
            buffer[at : at + len(reps)] = reps
            yield buffer[at : at + len(reps)], random_state
            at += len(reps)

    @classmethod
    def from_recipe(cls, model, recipe, tally: MaskTally | None = None) -> CachedInfoNCELoss:
        return cls(
            model,
            **_recipe_settings(recipe),
            mini_batch_size=recipe.loss.mini_batch_size,
            mini_batch_num_tokens=recipe.loss.mini_batch_num_tokens,
            tally=tally,
        )

    def calculate_loss(
        self, reps: list[list[Tensor]], labels: Tensor | None = None, *, with_backward: bool = False
    ):
        # the mini-batches are read in place: no copy of the batch's embeddings besides their gradients
        teacher, keys = _unpack(labels)
        loss = self._objective(reps[0], list(reps[1:]), teacher, keys)
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

    def get_config_dict(self):
        return {
            "temperature": self.tau,
            "mask_duplicates": self.mask_duplicates,
            "reduction": self.reduction,
            "mini_batch_size": self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
            **_objective_config(self),
        }
