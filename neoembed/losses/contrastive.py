"""The contrastive scorings over embeddings: InfoNCE and GTE's improved contrastive loss."""

from __future__ import annotations

import torch
from torch import Tensor

from neoembed.losses.matrices import _as_mask_fn, _rows, _take
from neoembed.scoring import Block, MaskFn, Matrix, contrastive_loss


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
