"""What the InfoNCE losses drop from a query's denominator: duplicates of its positive, found by text keys, and
suspected false negatives, found by the model's own scores."""

from __future__ import annotations

import torch
from torch import Tensor

from neoembed.losses.config import FalseNegativeConfig
from neoembed.losses.matrices import _cos
from neoembed.scoring import MaskFn


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


class MaskTally:
    """What false-negative masking dropped since the last :meth:`pop`, for whoever logs it (the trainer makes
    one and hands it to the loss): the loss adds to it and keeps no count of its own."""

    def __init__(self) -> None:
        self._zero()

    def _zero(self) -> None:
        self.masked: Tensor | float = 0.0  # summed on the device, read on the host once per pop
        self.scored = 0  # negatives the masking looked at (every candidate but each query's own positive)
        self.calls = 0  # chunks of query rows masked

    def add(self, masked: Tensor, scored: int) -> None:
        """One chunk of rows: ``masked`` (bool) the negatives masking dropped, ``scored`` how many it looked at."""
        self.masked = self.masked + masked.sum()
        self.scored += scored
        self.calls += 1

    def pop(self) -> dict[str, float]:
        """Masked false negatives and their fraction of the scored negatives, then zeros; {} with nothing added
        since the last pop (nothing to log)."""
        if not self.calls:
            return {}
        masked = float(self.masked)
        out = {"false_negatives_masked": masked, "false_negative_fraction": masked / max(self.scored, 1)}
        self._zero()
        return out


def false_negative_mask(
    queries: Tensor, candidates: Tensor, n_columns: int, config: FalseNegativeConfig, offset: int = 0
) -> Tensor:
    """(B, N) True where candidate j of query i is a suspected false negative (see :class:`FalseNegativeConfig`).
    ``candidates`` holds ``n_columns`` blocks of equal size (positives, then each hard-negative column); column
    ``offset + i`` is query i's positive and the ``offset + i``-th row of every block is one of its documents."""
    with torch.no_grad():
        masker = false_negative_masker(len(candidates), n_columns, config, offset)
        return masker(slice(0, len(queries)), _cos(queries, candidates))
