"""Which retrieved candidates become negatives: identity filters, rank range, positive-aware thresholds.

Every retrieved candidate ends with one code: ``kept`` (written), ``unused`` (passed every filter, but the query
already had ``num_negatives``), or the first reason in :data:`REASONS` order that dropped it.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable

import numpy as np

from neoembed.progress import bar as progress_bar

__all__ = ["OUTCOMES", "REASONS", "select_negatives", "text_key"]

#: Why a candidate is dropped, in the order the filters apply (a candidate counts under the first).
REASONS = (
    "positive",  # one of the query's own positives
    "positive_duplicate",  # same text as a positive up to case and whitespace
    "query_duplicate",  # same text as the query up to case and whitespace
    "near_duplicate",  # cosine to a positive >= duplicate_threshold
    "below_range_min",  # raw rank < range_min
    "above_max_score",  # score > max_score
    "within_margin",  # score > positive score - margin
    "above_fraction",  # score > positive score - (1 - max_fraction) * |positive score|
    "negative_duplicate",  # passed, but the same text as a better candidate of the query up to case and whitespace
)
OUTCOMES = ("kept", "unused", *REASONS)
_CODE = {name: i + 2 for i, name in enumerate(REASONS)}  # 0: passes; kept/unused are decided per query


def text_key(text: str) -> int:
    """A 64-bit key of ``text`` up to case and whitespace: equal keys mean duplicate texts."""
    norm = " ".join(text.casefold().split()).encode("utf8")
    return int.from_bytes(hashlib.blake2b(norm, digest_size=8).digest(), "little", signed=True)


def select_negatives(
    positives: np.ndarray,
    scores: np.ndarray,
    ids: np.ndarray,
    corpus_emb,
    query_emb,
    doc_keys: np.ndarray,
    query_keys: np.ndarray,
    cfg,
    rescore: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    batch: int = 512,
    progress: bool = True,
    scores_out: list | None = None,
) -> tuple[list[np.ndarray], Counter]:
    """Per query, the corpus ids of its negatives (best first, at most ``cfg.num_negatives``), and the count of
    every outcome over all retrieved candidates.

    ``positives``: (Q, P) corpus ids, -1 padded. ``scores``/``ids``: (Q, K) search results in rank order.
    ``corpus_emb`` / ``query_emb``: :class:`~neoembed.mine.search.EmbeddingShards`. ``rescore(q, d)``: optional
    scores of (query index, corpus id) pairs (a cross-encoder) that replace the bi-encoder's for the thresholds
    and the order of the survivors. ``scores_out`` (a list) receives, per query, the scores of its kept
    negatives (the ones that chose them: the cross-encoder's when ``rescore`` is given)."""
    negatives: list[np.ndarray] = []
    counts: Counter = Counter({name: 0 for name in OUTCOMES})
    for a in progress_bar(range(0, len(ids), batch), desc="filtering", unit="batch", disable=not progress):
        b = min(a + batch, len(ids))
        code, sc, valid = _identity_codes(
            positives[a:b], ids[a:b], scores[a:b], corpus_emb, doc_keys, query_keys[a:b], cfg
        )
        pos_score = _positive_scores(positives[a:b], corpus_emb, query_emb.rows(a, b))
        if rescore is not None:
            sc, pos_score = _rescored(rescore, a, positives[a:b], ids[a:b], sc, valid & (code == 0))
        code = np.where(code == 0, _threshold_codes(sc, pos_score, cfg), code)
        passing = valid & (code == 0)
        for r in range(b - a):
            idx = np.flatnonzero(passing[r])
            idx = idx[np.argsort(-sc[r, idx], kind="stable")]  # rank order already, unless rescored
            # the corpus is deduplicated by exact text only: "A cat" and "a  cat" would be one row's two negatives
            first = np.sort(np.unique(doc_keys[ids[a + r, idx]], return_index=True)[1])
            counts["negative_duplicate"] += len(idx) - len(first)
            idx = idx[first]
            keep = idx[: cfg.num_negatives]
            negatives.append(ids[a + r, keep])
            if scores_out is not None:
                scores_out.append(sc[r, keep])
            counts["kept"] += len(keep)
            counts["unused"] += len(idx) - len(keep)
        for name, c in _CODE.items():
            counts[name] += int(np.count_nonzero(valid & (code == c)))
    return negatives, counts


def _identity_codes(pos, cid, scores, corpus_emb, doc_keys, query_keys, cfg):
    """Codes of the filters that do not look at scores: positives, duplicates, rank range."""
    valid, has_pos = cid >= 0, pos >= 0
    safe_c, safe_p = np.maximum(cid, 0), np.maximum(pos, 0)
    is_pos = ((cid[:, :, None] == pos[:, None, :]) & has_pos[:, None, :]).any(-1)
    c_keys = doc_keys[safe_c]
    text_dup = ((c_keys[:, :, None] == doc_keys[safe_p][:, None, :]) & has_pos[:, None, :]).any(-1)
    query_dup = c_keys == query_keys[:, None]
    cos = np.einsum("bkd,bpd->bkp", corpus_emb.gather(cid), corpus_emb.gather(pos))
    near = np.where(has_pos[:, None, :], cos, -np.inf).max(-1) >= cfg.duplicate_threshold
    rank_low = np.arange(cid.shape[1])[None, :] < cfg.range_min
    code = np.zeros(cid.shape, np.int8)
    # lowest priority first: a later (higher-priority) reason overwrites an earlier one
    for mask, name in (
        (rank_low, "below_range_min"),
        (near, "near_duplicate"),
        (query_dup, "query_duplicate"),
        (text_dup, "positive_duplicate"),
        (is_pos, "positive"),
    ):
        code = np.where(mask, _CODE[name], code)
    return code, scores.astype(np.float32, copy=True), valid


def _positive_scores(pos, corpus_emb, queries) -> np.ndarray:
    """The lowest score among each query's positives: the thresholds are relative to the weakest positive."""
    s = np.einsum("bd,bpd->bp", queries, corpus_emb.gather(pos))
    return np.where(pos >= 0, s, np.inf).min(1)


def _rescored(rescore, offset, pos, cid, sc, candidates):
    """Cross-encoder scores for the surviving candidates and for the positives."""
    rows, cols = np.nonzero(candidates)
    sc = sc.copy()
    sc[~candidates] = -np.inf  # dropped already: their scores no longer matter
    if len(rows):
        sc[rows, cols] = rescore(rows + offset, cid[rows, cols])
    prow, pcol = np.nonzero(pos >= 0)
    pos_sc = np.full(pos.shape, np.inf, np.float32)
    pos_sc[prow, pcol] = rescore(prow + offset, pos[prow, pcol])
    return sc, pos_sc.min(1)


def _threshold_codes(sc, pos_score, cfg) -> np.ndarray:
    pos = pos_score[:, None]
    code = np.zeros(sc.shape, np.int8)
    if cfg.max_fraction is not None:
        code = np.where(sc > pos - (1 - cfg.max_fraction) * np.abs(pos), _CODE["above_fraction"], code)
    if cfg.margin is not None:
        code = np.where(sc > pos - cfg.margin, _CODE["within_margin"], code)
    if cfg.max_score is not None:
        code = np.where(sc > cfg.max_score, _CODE["above_max_score"], code)
    return code
