"""InfoNCE as a sentence-transformers loss: the shared scoring of the plain and cached forms, and the plain form."""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable
from typing import NamedTuple

import torch
from sentence_transformers.sentence_transformer.losses import (
    MultipleNegativesRankingLoss,
)
from torch import Tensor

from neoembed.losses.config import DistillationConfig, FalseNegativeConfig
from neoembed.losses.contrastive import improved_info_nce, info_nce
from neoembed.losses.grouping import drops_padding, embed_by_length
from neoembed.losses.masks import MaskTally, duplicate_masker, false_negative_masker, text_keys
from neoembed.losses.matrices import _cat, _rows, _segments
from neoembed.scoring import MaskFn, Matrix


def _gather(t: Tensor, with_grad: bool) -> Tensor:
    from sentence_transformers.util.distributed import all_gather

    return all_gather(t, with_grad=with_grad)


def _rank() -> int:
    return (
        torch.distributed.get_rank()
        if torch.distributed.is_available() and torch.distributed.is_initialized()
        else 0
    )


#: the positives', candidates' and queries' text keys of one batch (the duplicate mask's input)
Keys = tuple[Tensor, Tensor, Tensor]


class _Labels(NamedTuple):
    """A batch's labels with its text keys: the one argument sentence-transformers passes from ``forward`` to
    the scoring (``compute_loss_from_embeddings``, GradCache's ``calculate_loss``), so the keys travel with
    the call instead of living on the loss."""

    teacher: Tensor | None
    keys: Keys | None


def _unpack(labels) -> tuple[Tensor | None, Keys | None]:
    """(teacher scores, text keys) of ``labels``: a :class:`_Labels`, or bare labels with no keys."""
    return (labels.teacher, labels.keys) if isinstance(labels, _Labels) else (labels, None)


def check_flags(**flags) -> None:
    """Refuse a flag given anything but True or False: "no" or 0 is a true (or false) value, not a choice."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} takes True or False, not {value!r}")


class _InfoNCEMixin:
    tau: float
    mask_duplicates: bool
    reduction: str
    false_negatives: FalseNegativeConfig | None = None
    improved_contrastive: bool = False
    distillation: DistillationConfig | None = None
    #: where false-negative masking reports what it dropped (:class:`MaskTally`; None: nobody reads it)
    tally: MaskTally | None = None

    def _setup_objective(
        self, false_negatives, improved_contrastive: bool, distillation, tally: MaskTally | None
    ) -> None:
        """The options beyond plain InfoNCE: false-negative masking (reported to ``tally``), GTE's improved
        denominator, distillation from teacher scores (nested dimensions wrap the loss:
        :func:`neoembed.losses.with_matryoshka`)."""
        if isinstance(false_negatives, dict):
            false_negatives = FalseNegativeConfig(**false_negatives)
        if isinstance(distillation, dict):
            distillation = DistillationConfig(**distillation)
        for name, value, kind in (
            ("false_negatives", false_negatives, FalseNegativeConfig),
            ("distillation", distillation, DistillationConfig),
        ):
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{name} takes a dict or a {kind.__name__} (or None), not {value!r}")
        if not isinstance(improved_contrastive, bool):
            raise TypeError(f"improved_contrastive takes True or False, not {improved_contrastive!r}")
        self.distillation = distillation
        self.false_negatives = false_negatives
        self.improved_contrastive = improved_contrastive
        self.tally = tally

    def _objective(
        self, queries: Matrix, docs: list[Matrix], teacher: Tensor | None, keys: Keys | None = None
    ) -> Tensor:
        """InfoNCE (:meth:`_score`), plus or instead of the weighted distillation loss; ``teacher``: the rows'
        teacher scores, read only when distilling. Each matrix a tensor or a list of segments (GradCache's
        mini-batches), which the contrastive scoring reads in place."""
        if self.distillation is None:
            return self._score(queries, docs, keys)
        loss = self.distillation.term(_cat(queries), [_cat(d) for d in docs], teacher)
        if self.distillation.infonce_weight > 0:
            loss = loss + self.distillation.infonce_weight * self._score(queries, docs, keys)
        return loss

    def _mask_false_negatives(
        self, n_candidates: int, n_columns: int, mask: MaskFn | None, offset: int
    ) -> MaskFn | None:
        """``mask`` joined with the suspected false negatives (when configured), which go to the tally."""
        if self.false_negatives is None:
            return mask
        found_in = false_negative_masker(n_candidates, n_columns, self.false_negatives, offset)
        tally = self.tally

        def joined(rows: slice, cos: Tensor) -> Tensor:
            found = found_in(rows, cos)
            known = mask(rows, cos) if mask is not None else None
            if tally is not None:
                tally.add(found if known is None else found & ~known, found.numel() - len(found))
            return found if known is None else known | found

        return joined

    def _contrast(self, queries: Matrix, docs: list[Matrix], mask: MaskFn | None, offset: int) -> Tensor:
        """InfoNCE over the candidates, or GTE's improved contrastive loss."""
        candidates = [seg for d in docs for seg in _segments(d)]
        if not self.improved_contrastive:
            return info_nce(queries, candidates, self.tau, mask, self.reduction, offset)
        queries = _cat(queries)
        all_queries = _gather(queries, True) if self.gather_across_devices else queries
        return improved_info_nce(queries, candidates, all_queries, self.tau, mask, self.reduction, offset)

    def _setup(self, temperature: float, mask_duplicates: bool, reduction: str) -> None:
        if reduction not in ("mean", "sum"):
            raise ValueError(f"unknown reduction {reduction!r}; valid: 'mean', 'sum'")
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise TypeError(f"temperature takes a number (e.g. 0.07), not {temperature!r}")
        if not 0 < temperature < math.inf:  # NaN fails too
            raise ValueError(f"temperature must be a positive finite number, got {temperature}")
        if temperature > 1:
            warnings.warn(
                f"temperature={temperature:g} divides the cosine similarities, so every candidate scores "
                "almost alike; sentence-transformers' scale multiplies them (the reciprocal of a temperature): "
                f"did you mean temperature={1 / temperature:.3g}?",
                stacklevel=3,
            )
        check_flags(mask_duplicates=mask_duplicates)
        self.tau = temperature
        self.mask_duplicates = mask_duplicates
        self.reduction = reduction

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor) -> Tensor:
        sentence_features = list(sentence_features)
        return super().forward(sentence_features, _Labels(labels, self._batch_keys(sentence_features)))

    def _batch_keys(self, sentence_features: list[dict[str, Tensor]]) -> Keys | None:
        """The batch's text keys for the duplicate mask, or None when duplicates are not masked."""
        if len(sentence_features) < 2:
            raise ValueError(
                f"InfoNCE needs a query and a positive column, got {len(sentence_features)} column(s)"
            )
        sizes = [f["input_ids"].shape[0] for f in sentence_features if getattr(f.get("input_ids"), "ndim", 0) == 2]
        if len(set(sizes)) > 1:  # row i's texts are row i of every column: a short column shifts every pairing
            raise ValueError(
                f"the batch's columns hold different numbers of texts ({', '.join(map(str, sizes))}, query column "
                "first): every row needs one text in each column"
            )
        if not self.mask_duplicates:
            return None
        pos = text_keys(sentence_features[1])
        cands = torch.cat([text_keys(f) for f in sentence_features[1:]])
        return pos, cands, text_keys(sentence_features[0])

    def _score(self, queries: Matrix, docs: list[Matrix], keys: Keys | None = None) -> Tensor:
        batch = _rows(queries)
        offset = 0
        if self.gather_across_devices:
            # every process scores its own queries against the candidates of all processes (with gradient)
            docs = [_gather(_cat(d), True) for d in docs]
            offset = _rank() * batch
        mask = None
        if keys is not None:
            pos, cands, query_keys = keys
            all_queries = None
            if self.gather_across_devices:
                # candidate order after gathering: [positives of all ranks, negatives_1 of all ranks, ...]
                n_cols = len(docs)
                per_col = cands.view(n_cols, -1)
                cands = torch.cat([_gather(per_col[c], False) for c in range(n_cols)])
                all_queries = _gather(query_keys, False)
            mask = duplicate_masker(pos, cands, offset, query_keys, all_queries)
        n_candidates = sum(_rows(d) for d in docs)
        mask = self._mask_false_negatives(n_candidates, len(docs), mask, offset)  # objectives (#25)
        kept: list[Tensor] = []
        loss = self._contrast(queries, docs, _counting_negatives(mask, kept), offset)
        if not self.improved_contrastive and (n_candidates < 2 or kept and not bool(torch.stack(kept).any())):
            warnings.warn(NO_NEGATIVE, stacklevel=2)
        return loss


#: a batch in which InfoNCE has nothing to contrast (its loss is exactly 0, whatever the model)
NO_NEGATIVE = (
    "InfoNCE: no query of this batch kept a negative (every candidate was its own positive, a duplicate of "
    "one of its positives, or a masked false negative), so its loss is 0 and the step learns nothing. "
    "Usual causes: every query is the same text (each row's positive is then a positive of all of them), "
    "a batch of one pair without hard negatives, or a false_negatives margin that masks everything."
)


def _counting_negatives(mask: MaskFn | None, kept: list[Tensor]) -> MaskFn | None:
    """``mask``, appending to ``kept`` per chunk whether any of its rows keeps a negative (more than its own
    positive unmasked), read once per batch: a batch with nothing to contrast gives a loss of 0 silently otherwise."""
    if mask is None:
        return None

    def counted(rows: slice, cos: Tensor) -> Tensor | None:
        out = mask(rows, cos)
        kept.append(cos.new_ones((), dtype=torch.bool) if out is None else ((~out).sum(dim=1) > 1).any())
        return out

    return counted


def _recipe_settings(recipe) -> dict:
    """The settings every InfoNCE variant reads from a contrastive recipe."""
    return {
        "temperature": recipe.temperature,
        "mask_duplicates": recipe.mask_duplicates,
        "reduction": recipe.reduction,
        "gather_across_devices": recipe.gather_across_devices,
        "false_negatives": getattr(recipe, "false_negatives", None),
        "improved_contrastive": getattr(recipe, "improved_contrastive", False),
        "distillation": getattr(recipe, "distillation", None),
    }


def _objective_config(loss) -> dict:
    """The objective options of ``loss`` for its saved config."""
    return {
        "false_negatives": loss.false_negatives.model_dump() if loss.false_negatives else None,
        "improved_contrastive": loss.improved_contrastive,
        "distillation": loss.distillation.model_dump() if loss.distillation else None,
    }


class InfoNCELoss(_InfoNCEMixin, MultipleNegativesRankingLoss):
    """InfoNCE with temperature ``tau`` (default 0.07), duplicate masking and mean/sum reduction."""

    def __init__(
        self,
        model,
        temperature: float = 0.07,
        mask_duplicates: bool = True,
        reduction: str = "mean",
        gather_across_devices: bool = False,
        group_by_length: bool = True,
        false_negatives: FalseNegativeConfig | dict | None = None,
        improved_contrastive: bool = False,
        distillation: DistillationConfig | dict | None = None,
        tally: MaskTally | None = None,
    ) -> None:
        self._setup(temperature, mask_duplicates, reduction)
        self._setup_objective(false_negatives, improved_contrastive, distillation, tally)
        check_flags(group_by_length=group_by_length, gather_across_devices=gather_across_devices)
        self.group_by_length = group_by_length
        super().__init__(model, scale=1.0 / temperature, gather_across_devices=gather_across_devices)

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor) -> Tensor:
        if not self.group_by_length:
            # a copy: the model's forward adds its outputs to the dicts it is given, which callers may reuse
            return super().forward([dict(f) for f in sentence_features], labels)
        sentence_features = list(sentence_features)
        embeddings = embed_by_length(self.model, sentence_features)
        return self.compute_loss_from_embeddings(
            embeddings, _Labels(labels, self._batch_keys(sentence_features))
        )

    #: the loss on embeddings already computed (CDE's two-stage GradCache step scores with it)
    embedding_loss = staticmethod(info_nce)

    @classmethod
    def from_recipe(cls, model, recipe, tally: MaskTally | None = None) -> InfoNCELoss:
        # a padding-free encoder pads nothing: groups would save no token and cost forward calls
        grouped = recipe.group_by_length and not drops_padding(model)
        return cls(model, **_recipe_settings(recipe), group_by_length=grouped, tally=tally)

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor) -> Tensor:
        if len(embeddings) < 2:
            raise ValueError(f"InfoNCE needs a query and a positive column, got {len(embeddings)} column(s)")
        teacher, keys = _unpack(labels)
        return self._objective(embeddings[0], embeddings[1:], teacher, keys)

    def get_config_dict(self):
        return {
            "temperature": self.tau,
            "mask_duplicates": self.mask_duplicates,
            "reduction": self.reduction,
            "group_by_length": self.group_by_length,
            **_objective_config(self),
        }
