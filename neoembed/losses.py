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

Recipes name their loss (``loss: infonce``); :data:`LOSSES` maps the names to the classes, and each class builds
itself from a recipe (``from_recipe``) and scores bare embeddings (``embedding_loss``, which CDE's two-stage
step calls). A new loss is one class with those two methods, one entry in :data:`LOSSES` and its test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, PositiveInt, model_validator
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)
from torch import Tensor

from neoembed.config import StrictModel
from neoembed.scoring import Block, MaskFn, Matrix, contrastive_loss

__all__ = [
    "LOSSES",
    "DISTILLATION_LOSSES",
    "CachedInfoNCELoss",
    "DistillationConfig",
    "FalseNegativeConfig",
    "InfoNCELoss",
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
    "length_groups",
    "margin_mse",
    "text_keys",
]


def _hash_powers(n: int) -> list[int]:
    """base**k mod 2**64 for k < n, as signed int64 values (int64 products below wrap mod 2**64 too)."""
    out, value = [], 1
    for _ in range(n):
        out.append(value - (1 << 64) if value >= 1 << 63 else value)
        value = value * _HASH_BASE % (1 << 64)
    return out


_HASH_BASE = 0x9E3779B97F4A7C15  # odd 64-bit constant: a polynomial hash mod 2**64 with well-mixed powers


def text_keys(features: dict[str, Tensor]) -> Tensor:
    """One int64 key per row identifying its token sequence: equal texts get equal keys whatever the padding
    (right or left) and the width of the column they were tokenized in, so a hard negative matches another
    row's positive. The hash runs over the real tokens only (positions counted from the first real token);
    it is deterministic, so keys gathered from other processes compare too."""
    ids = features["input_ids"].to(torch.int64)
    mask = features.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask.to(torch.int64)
    pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
    powers = torch.tensor(_hash_powers(ids.shape[1]), device=ids.device, dtype=torch.int64)
    return ((ids + 1) * powers[pos] * mask).sum(dim=1)


def _rows(x: Matrix) -> int:
    return len(x) if isinstance(x, Tensor) else sum(len(t) for t in x)


def _cat(x: Matrix) -> Tensor:
    """A matrix given as segments, as one tensor (the segment itself when there is one)."""
    if isinstance(x, Tensor):
        return x
    return x[0] if len(x) == 1 else torch.cat(list(x))


def _segments(x: Matrix) -> list[Tensor]:
    return [x] if isinstance(x, Tensor) else list(x)


def _take(x: Matrix, lo: int, hi: int) -> Tensor:
    """Rows ``lo:hi`` of a matrix given as segments, copying only those rows."""
    parts, start = [], 0
    for seg in _segments(x):
        a, b = max(lo, start), min(hi, start + len(seg))
        if a < b:
            parts.append(seg[a - start : b - start])
        start += len(seg)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _as_mask_fn(mask: Tensor | MaskFn | None) -> MaskFn | None:
    if mask is None or callable(mask):
        return mask
    return lambda rows, cos: mask[rows]


def duplicate_masker(
    positive_keys: Tensor,
    candidate_keys: Tensor,
    offset: int = 0,
    query_keys: Tensor | None = None,
    candidate_query_keys: Tensor | None = None,
) -> MaskFn:
    """:func:`duplicate_mask` one chunk of rows at a time: ``mask(rows, cos)`` is its rows ``rows``."""
    shared = None
    if query_keys is not None:
        others = query_keys if candidate_query_keys is None else candidate_query_keys
        shared = _shared_query_pairs(query_keys, others, candidate_keys, offset)

    def mask(rows: slice, cos: Tensor | None = None) -> Tensor:
        out = positive_keys[rows, None] == candidate_keys[None, :]
        if shared is not None:
            out |= shared(rows)
        own = torch.arange(rows.stop - rows.start, device=out.device)
        out[own, own + rows.start + offset] = False
        return out

    return mask


def _shared_query_pairs(query_keys: Tensor, others: Tensor, candidate_keys: Tensor, offset: int):
    """For rows whose query another row also asks: ``rows -> (len(rows), N)`` True where the candidate is the
    positive of a row asking the same query; None when no query is asked twice (the common case)."""
    m = len(others)
    vocab, inverse = torch.unique(torch.cat([others, query_keys, candidate_keys]), return_inverse=True)
    other_id, query_id, cand_id = inverse.split([m, len(query_keys), len(candidate_keys)])
    asked = torch.bincount(other_id, minlength=len(vocab))[query_id]
    own = torch.arange(len(query_keys), device=query_keys.device) + offset
    own_row = (own < m) & (others[own.clamp(max=m - 1)] == query_keys)  # the row's own ask is term one
    shared = asked > own_row.long()
    if not bool(shared.any()):
        return None
    size = len(vocab)  # dense ids, so (query, positive) pairs compare exactly
    pairs = torch.unique(other_id * size + cand_id[:m])

    def extra(rows: slice) -> Tensor:
        out = torch.zeros(rows.stop - rows.start, len(candidate_keys), dtype=torch.bool, device=pairs.device)
        sub = shared[rows].nonzero().squeeze(1)
        if len(sub):
            out[sub] = torch.isin(query_id[rows][sub, None] * size + cand_id[None, :], pairs)
        return out

    return extra


def duplicate_mask(
    positive_keys: Tensor,
    candidate_keys: Tensor,
    offset: int = 0,
    query_keys: Tensor | None = None,
    candidate_query_keys: Tensor | None = None,
) -> Tensor:
    """(B, N) True where candidate j has the same text as a positive of query i but is not its own positive
    column ``offset + i``. Without ``query_keys`` the positives of query i are its own; with them, also those of
    every row asking the same query (one question, several answers: each answer is not a negative of the
    other row). ``candidate_keys`` begin with the positives of the rows whose queries are
    ``candidate_query_keys`` (default ``query_keys``: the same rows, as when nothing is gathered). The losses
    build it per chunk of rows (:func:`duplicate_masker`)."""
    masker = duplicate_masker(positive_keys, candidate_keys, offset, query_keys, candidate_query_keys)
    return masker(slice(0, len(positive_keys)))


def info_nce(
    queries: Matrix,
    candidates: Matrix,
    temperature: float,
    mask: Tensor | MaskFn | None = None,
    reduction: str = "mean",
    offset: int = 0,
) -> Tensor:
    """InfoNCE of queries (B, d) against candidates (N, d) whose column ``offset + i`` is query i's positive;
    ``mask`` (B, N), or a :data:`~neoembed.scoring.MaskFn` building it per chunk, drops entries. Either
    matrix may be a list of segments (see :mod:`neoembed.scoring`): memory O(B + N), never B x N."""
    block = Block(0, 0, _as_mask_fn(mask))
    return contrastive_loss([queries], [candidates], [block], temperature, offset, reduction)


def _cos(a: Tensor, b: Tensor) -> Tensor:
    """(len(a), len(b)) cosine similarities, in fp32."""
    return F.normalize(a.float(), dim=-1) @ F.normalize(b.float(), dim=-1).T


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


def false_negative_masker(
    n_candidates: int, n_columns: int, config: FalseNegativeConfig, offset: int = 0
) -> MaskFn:
    """:func:`false_negative_mask` one chunk of rows at a time, from the chunk's cosines."""
    block = n_candidates // n_columns

    def mask(rows: slice, cos: Tensor) -> Tensor:
        local = torch.arange(rows.stop - rows.start, device=cos.device)
        own = local + rows.start + offset
        positive = cos[local, own][:, None]
        margin = config.margin if config.mode == "absolute" else positive.abs() * config.margin
        out = cos > positive - margin
        if config.scope != "all":
            mine = (torch.arange(n_candidates, device=cos.device) % block)[None, :] == own[:, None]
            out &= ~mine if config.scope == "in_batch" else mine
        out[local, own] = False
        return out

    return mask


def false_negative_mask(
    queries: Tensor, candidates: Tensor, n_columns: int, config: FalseNegativeConfig, offset: int = 0
) -> Tensor:
    """(B, N) True where candidate j of query i is a suspected false negative (see :class:`FalseNegativeConfig`).
    ``candidates`` holds ``n_columns`` blocks of equal size (positives, then each hard-negative column); column
    ``offset + i`` is query i's positive and the ``offset + i``-th row of every block is one of its documents."""
    with torch.no_grad():
        masker = false_negative_masker(len(candidates), n_columns, config, offset)
        return masker(slice(0, len(queries)), _cos(queries, candidates))


def improved_info_nce(
    queries: Tensor,
    candidates: Matrix,
    all_queries: Tensor,
    temperature: float,
    mask: Tensor | MaskFn | None = None,
    reduction: str = "mean",
    offset: int = 0,
) -> Tensor:
    """The "improved contrastive loss" of GTE (Li et al. 2023, Eq. 3): InfoNCE whose denominator also holds the
    query-query, document-query and document-document terms, one softmax over all four. ``all_queries`` are the
    queries of every process (the local ones at ``offset``); ``mask`` applies to the query-document terms.
    Equals sentence-transformers' ``MultipleNegativesRankingLoss(directions=("query_to_doc", "query_to_query",
    "doc_to_query", "doc_to_doc"), partition_mode="joint")``."""
    world = len(all_queries)
    positives = _take(candidates, offset, offset + len(queries))
    n_candidates = _rows(candidates)

    def own_query(rows: slice, cos: Tensor) -> Tensor:
        local = torch.arange(rows.stop - rows.start, device=cos.device)
        return local[:, None] + rows.start + offset == torch.arange(world, device=cos.device)[None, :]

    def own_documents(rows: slice, cos: Tensor) -> Tensor:
        own = torch.arange(rows.start, rows.stop, device=cos.device) + offset
        return (torch.arange(n_candidates, device=cos.device) % world)[None, :] == own[:, None]

    blocks = [Block(0, 0, _as_mask_fn(mask)), Block(0, 1, own_query), Block(1, 1), Block(1, 0, own_documents)]
    return contrastive_loss(
        [queries, positives], [candidates, all_queries], blocks, temperature, offset, reduction
    )


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


class MatryoshkaConfig(StrictModel):
    """Nested dimensions (Kusupati et al. 2022): the loss is ``sum_k weight_k * loss(embeddings[:, :dim_k])``,
    sentence-transformers' ``MatryoshkaLoss``. ``weights`` default to 1 each."""

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
        if max(self.dims) > width:
            raise ValueError(
                f"matryoshka.dims {self.dims} exceed the model's embedding dimension {width}; keep dims <= {width}"
            )

    def loss(self, fn: Callable[..., Tensor], queries: Matrix, docs, *args, **kwargs) -> Tensor:
        """``fn(queries, docs, ...)`` at every dimension, weighted and summed; ``docs`` a tensor or a list of
        matrices, each matrix a tensor or a list of segments."""
        total = 0.0
        for dim, weight in self.pairs():
            cut = [_cut(d, dim) for d in docs] if isinstance(docs, list) else _cut(docs, dim)
            total = total + weight * fn(_cut(queries, dim), cut, *args, **kwargs)
        return total


def _cut(x: Matrix, dim: int) -> Matrix:
    """The first ``dim`` dimensions of a matrix or of each of its segments (views, no copy)."""
    return x[..., :dim] if isinstance(x, Tensor) else [t[..., :dim] for t in x]


#: the cost of one more forward call, in padded tokens: a group is split off only where it saves more than this
GROUP_OVERHEAD_TOKENS = 512


def length_groups(lengths: list[int], overhead: int = GROUP_OVERHEAD_TOKENS) -> list[list[int]]:
    """Row indices split into groups of similar length that minimise padded tokens plus ``overhead`` per group
    (an exact dynamic programme over the sorted lengths)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sorted_len = [lengths[i] for i in order]
    best, cut = [0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        for start in range(end):
            cost = best[start] + (end - start) * sorted_len[end - 1] + overhead
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(order)
    while end > 0:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]


def _groupable(features_list: list[dict]) -> bool:
    """Right-padded token tensors and per-row tensors, plus other values (e.g. sentence-transformers'
    ``modality``) equal in every column; anything else is left to the plain forward."""
    keys = set(features_list[0])
    for features in features_list:
        mask = features.get("attention_mask")
        if set(features) != keys or not isinstance(mask, Tensor) or mask.dim() != 2:
            return False
        if mask.shape[1] > 1 and bool((mask[:, 1:] > mask[:, :-1]).any()):  # left padding or holes
            return False
        for key, value in features.items():
            if isinstance(value, Tensor):
                if value.dim() not in (1, 2) or value.shape[0] != mask.shape[0]:
                    return False
                if value.dim() == 2 and value.shape[1] != mask.shape[1]:
                    return False
            elif value != features_list[0][key]:
                return False
    return True


def embed_by_length(model, features_list: list[dict[str, Tensor]]) -> list[Tensor]:
    """Sentence embeddings of every column, computed in groups of rows of similar length across all columns,
    each group padded only to its own longest row. Same rows, same batch, same result up to float rounding
    (padding is masked out of attention and pooling); only the dropout masks are drawn per group. Falls back
    to one forward per column for inputs it cannot split (left padding, unknown feature shapes)."""
    if not _groupable(features_list):
        return [model(f)["sentence_embedding"] for f in features_list]
    rows = [(c, r) for c, f in enumerate(features_list) for r in range(len(f["attention_mask"]))]
    lengths = [int(n) for f in features_list for n in f["attention_mask"].sum(dim=1).tolist()]
    out: list[Tensor | None] = [None] * len(rows)
    for group in length_groups(lengths):
        width = max(1, max(lengths[i] for i in group))
        batch = {
            key: torch.stack([_row(features_list[rows[i][0]][key], rows[i][1], width) for i in group])
            if isinstance(value, Tensor)
            else value
            for key, value in features_list[0].items()
        }
        for i, emb in zip(group, model(batch)["sentence_embedding"].unbind(0), strict=True):
            out[i] = emb
    embeddings, start = [], 0
    for f in features_list:
        n = len(f["attention_mask"])
        embeddings.append(torch.stack(out[start : start + n]))
        start += n
    return embeddings


def _row(t: Tensor, r: int, width: int) -> Tensor:
    """Row ``r`` of a per-row or token tensor, cut or zero-padded (masked positions) to ``width`` tokens."""
    if t.dim() == 1:
        return t[r]
    row = t[r, :width]
    return F.pad(row, (0, width - row.shape[0])) if row.shape[0] < width else row


def _gather(t: Tensor, with_grad: bool) -> Tensor:
    from sentence_transformers.util.distributed import all_gather

    return all_gather(t, with_grad=with_grad)


def _rank() -> int:
    return (
        torch.distributed.get_rank()
        if torch.distributed.is_available() and torch.distributed.is_initialized()
        else 0
    )


class _InfoNCEMixin:
    tau: float
    mask_duplicates: bool
    reduction: str
    _keys: tuple[Tensor, Tensor, Tensor] | None = None  # positives', candidates' and queries' text keys
    false_negatives: FalseNegativeConfig | None = None
    improved_contrastive: bool = False
    matryoshka: MatryoshkaConfig | None = None
    distillation: DistillationConfig | None = None
    #: running sums since the trainer last logged them (:meth:`pop_counts`)
    _counts: dict[str, float] | None = None

    def _setup_objective(self, false_negatives, improved_contrastive: bool, matryoshka, distillation) -> None:
        """The options beyond plain InfoNCE: false-negative masking, GTE's improved denominator, Matryoshka,
        distillation from teacher scores."""
        if isinstance(false_negatives, dict):
            false_negatives = FalseNegativeConfig(**false_negatives)
        if isinstance(matryoshka, dict):
            matryoshka = MatryoshkaConfig(**matryoshka)
        if isinstance(distillation, dict):
            distillation = DistillationConfig(**distillation)
        object.__setattr__(self, "distillation", distillation)
        object.__setattr__(self, "false_negatives", false_negatives)
        object.__setattr__(self, "improved_contrastive", improved_contrastive)
        object.__setattr__(self, "matryoshka", matryoshka)
        object.__setattr__(
            self, "_counts", {"false_negatives_masked": 0.0, "pairs_scored": 0.0, "calls": 0.0}
        )

    def _loss(self, queries: Matrix, docs: list[Matrix], labels: Tensor | None = None) -> Tensor:
        """The loss of full-width embeddings: :meth:`_objective`, or its Matryoshka sum over nested dimensions.
        ``labels``: the rows' teacher scores, read only when distilling. Each matrix a tensor or a list of
        segments (GradCache's mini-batches), which the contrastive scoring reads in place."""
        teacher = labels if self.distillation is not None else None
        if self.matryoshka is None:
            return self._objective(queries, docs, teacher)
        return self.matryoshka.loss(self._objective, queries, docs, teacher)

    def _objective(self, queries: Matrix, docs: list[Matrix], teacher: Tensor | None) -> Tensor:
        """InfoNCE (:meth:`_score`), plus or instead of the weighted distillation loss."""
        if self.distillation is None:
            return self._score(queries, docs)
        loss = self.distillation.term(_cat(queries), [_cat(d) for d in docs], teacher)
        if self.distillation.infonce_weight > 0:
            loss = loss + self.distillation.infonce_weight * self._score(queries, docs)
        return loss

    def _mask_false_negatives(
        self, n_candidates: int, n_columns: int, mask: MaskFn | None, offset: int
    ) -> MaskFn | None:
        """``mask`` joined with the suspected false negatives (when configured), which are counted."""
        if self.false_negatives is None:
            return mask
        found_in = false_negative_masker(n_candidates, n_columns, self.false_negatives, offset)
        counts = self._counts

        def joined(rows: slice, cos: Tensor) -> Tensor:
            found = found_in(rows, cos)
            known = mask(rows, cos) if mask is not None else None
            new = found if known is None else found & ~known
            counts["false_negatives_masked"] += new.sum()
            counts["pairs_scored"] += found.numel() - len(found)
            return found if known is None else known | found

        counts["calls"] += 1.0
        return joined

    def _contrast(self, queries: Matrix, docs: list[Matrix], mask: MaskFn | None, offset: int) -> Tensor:
        """InfoNCE over the candidates, or GTE's improved contrastive loss."""
        candidates = [seg for d in docs for seg in _segments(d)]
        if not self.improved_contrastive:
            return info_nce(queries, candidates, self.tau, mask, self.reduction, offset)
        queries = _cat(queries)
        all_queries = _gather(queries, True) if self.gather_across_devices else queries
        return improved_info_nce(queries, candidates, all_queries, self.tau, mask, self.reduction, offset)

    def pop_counts(self) -> dict[str, float]:
        """What the loss masked since the last call (the trainer logs it): false negatives per query-step and
        their fraction of the scored negatives."""
        counts = self._counts or {}
        calls, pairs = counts.get("calls", 0.0), float(counts.get("pairs_scored", 0.0))
        if not calls:
            return {}
        masked = float(counts["false_negatives_masked"])  # a tensor: summed on the device, read here once
        out = {"false_negatives_masked": masked, "false_negative_fraction": masked / max(pairs, 1.0)}
        object.__setattr__(
            self, "_counts", {"false_negatives_masked": 0.0, "pairs_scored": 0.0, "calls": 0.0}
        )
        return out

    def _setup(self, temperature: float, mask_duplicates: bool, reduction: str) -> None:
        if reduction not in ("mean", "sum"):
            raise ValueError(f"unknown reduction {reduction!r}; valid: 'mean', 'sum'")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        # object.__setattr__: the cached loss forwards unknown attribute writes to the loss it wraps
        object.__setattr__(self, "tau", temperature)
        object.__setattr__(self, "mask_duplicates", mask_duplicates)
        object.__setattr__(self, "reduction", reduction)

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor) -> Tensor:
        sentence_features = list(sentence_features)
        self._remember_keys(sentence_features)
        return super().forward(sentence_features, labels)

    def _remember_keys(self, sentence_features: list[dict[str, Tensor]]) -> None:
        if not self.mask_duplicates:
            self._keys = None
            return
        pos = text_keys(sentence_features[1])
        cands = torch.cat([text_keys(f) for f in sentence_features[1:]])
        self._keys = (pos, cands, text_keys(sentence_features[0]))

    def _score(self, queries: Matrix, docs: list[Matrix]) -> Tensor:
        batch = _rows(queries)
        offset = 0
        if self.gather_across_devices:
            # every process scores its own queries against the candidates of all processes (with gradient)
            docs = [_gather(_cat(d), True) for d in docs]
            offset = _rank() * batch
        mask = None
        if self._keys is not None:
            pos, cands, query_keys = self._keys
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
        return self._contrast(queries, docs, mask, offset)


def _recipe_settings(recipe) -> dict:
    """The settings every InfoNCE variant reads from a contrastive recipe."""
    return {
        "temperature": recipe.temperature,
        "mask_duplicates": recipe.mask_duplicates,
        "reduction": recipe.reduction,
        "gather_across_devices": recipe.gather_across_devices,
        "false_negatives": getattr(recipe, "false_negatives", None),
        "improved_contrastive": getattr(recipe, "improved_contrastive", False),
        "matryoshka": getattr(recipe, "matryoshka", None),
        "distillation": getattr(recipe, "distillation", None),
    }


def _objective_config(loss) -> dict:
    """The objective options of ``loss`` for its saved config."""
    return {
        "false_negatives": loss.false_negatives.model_dump() if loss.false_negatives else None,
        "improved_contrastive": loss.improved_contrastive,
        "matryoshka": loss.matryoshka.model_dump() if loss.matryoshka else None,
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
        matryoshka: MatryoshkaConfig | dict | None = None,
        distillation: DistillationConfig | dict | None = None,
    ) -> None:
        self._setup(temperature, mask_duplicates, reduction)
        self._setup_objective(false_negatives, improved_contrastive, matryoshka, distillation)
        object.__setattr__(self, "group_by_length", group_by_length)
        super().__init__(model, scale=1.0 / temperature, gather_across_devices=gather_across_devices)

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor) -> Tensor:
        if not self.group_by_length:
            return super().forward(sentence_features, labels)
        sentence_features = list(sentence_features)
        self._remember_keys(sentence_features)
        return self.compute_loss_from_embeddings(embed_by_length(self.model, sentence_features), labels)

    #: the loss on embeddings already computed (CDE's two-stage GradCache step scores with it)
    embedding_loss = staticmethod(info_nce)

    @classmethod
    def from_recipe(cls, model, recipe) -> InfoNCELoss:
        return cls(model, **_recipe_settings(recipe), group_by_length=recipe.group_by_length)

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor) -> Tensor:
        if len(embeddings) < 2:
            raise ValueError(f"InfoNCE needs a query and a positive column, got {len(embeddings)} column(s)")
        return self._loss(embeddings[0], embeddings[1:], labels)

    def get_config_dict(self):
        return {
            "temperature": self.tau,
            "mask_duplicates": self.mask_duplicates,
            "reduction": self.reduction,
            "group_by_length": self.group_by_length,
            **_objective_config(self),
        }


class CachedInfoNCELoss(_InfoNCEMixin, CachedMultipleNegativesRankingLoss):
    """GradCache InfoNCE: embeddings computed in mini-batches without graph, loss and embedding gradients on
    the full batch, then a second chunked pass backpropagates them. Same loss and gradients as
    :class:`InfoNCELoss` at the memory of one mini-batch."""

    def __init__(
        self,
        model,
        temperature: float = 0.07,
        mask_duplicates: bool = True,
        reduction: str = "mean",
        mini_batch_size: int = 32,
        gather_across_devices: bool = False,
        show_progress_bar: bool = False,
        false_negatives: FalseNegativeConfig | dict | None = None,
        improved_contrastive: bool = False,
        matryoshka: MatryoshkaConfig | dict | None = None,
        distillation: DistillationConfig | dict | None = None,
    ) -> None:
        self._setup(temperature, mask_duplicates, reduction)
        self._setup_objective(false_negatives, improved_contrastive, matryoshka, distillation)
        super().__init__(
            model,
            scale=1.0 / temperature,
            mini_batch_size=mini_batch_size,
            gather_across_devices=gather_across_devices,
            show_progress_bar=show_progress_bar,
        )

    embedding_loss = staticmethod(info_nce)  # the same loss as InfoNCELoss's

    @classmethod
    def from_recipe(cls, model, recipe) -> CachedInfoNCELoss:
        return cls(model, **_recipe_settings(recipe), mini_batch_size=recipe.cache_mini_batch_size)

    def calculate_loss(
        self, reps: list[list[Tensor]], labels: Tensor | None = None, *, with_backward: bool = False
    ):
        # the mini-batches are read in place: no copy of the batch's embeddings besides their gradients
        loss = self._loss(reps[0], list(reps[1:]), labels)
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
            **_objective_config(self),
        }


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


def build_loss(name: str, model, recipe):
    """The loss ``name`` for ``model``, with its settings read from ``recipe``."""
    loss = LOSSES[check_loss_name(name)].from_recipe(model, recipe)
    if getattr(loss, "matryoshka", None) is not None:
        loss.matryoshka.check_width(model.get_embedding_dimension())
    return loss
