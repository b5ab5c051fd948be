"""The CDE loss: InfoNCE of a process's queries against its own documents, or against the documents of every
process, with the teacher's false negatives and duplicate documents masked out of each denominator."""

from __future__ import annotations

import torch

from neoembed.cde.batching import false_negative_mask
from neoembed.cde.recipe import CDERecipe
from neoembed.losses import InfoNCELoss, duplicate_mask

__all__ = ["cde_loss", "gathered_documents", "step_mask"]


def cde_loss(
    queries: torch.Tensor,
    documents: torch.Tensor,
    temperature: float,
    mask: torch.Tensor | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """InfoNCE of B queries against D documents whose column ``offset + i`` is query i's positive."""
    # the unified recipe's InfoNCE, on embeddings the two-stage step has already computed
    return InfoNCELoss.embedding_loss(
        queries, documents, temperature, mask=mask, reduction="mean", offset=offset
    )


def gathered_documents(documents: torch.Tensor, rows: int) -> torch.Tensor:
    """The documents of every process in one process's layout: all positives (process order, i.e. the global
    batch's order), then all hard negatives. ``documents``: this process's ``rows`` positives, then its hard
    negatives. Gathered with their gradients (sentence-transformers' ``all_gather``): each process's backward
    returns to every process the gradient of its own documents."""
    from sentence_transformers.util.distributed import all_gather

    parts = [documents[:rows], documents[rows:]] if documents.shape[0] > rows else [documents]
    return torch.cat([all_gather(part, with_grad=True) for part in parts])


def step_mask(
    recipe: CDERecipe, src, local: list[int], d_texts: list[str], keep: tuple[int, int] | None = None
) -> torch.Tensor | None:
    """The documents masked out of each query's denominator: the teacher's false negatives, duplicates.
    ``src``: the step's ``trainer.Source`` (its queries and teacher embeddings); ``local``: its rows.
    ``keep``: (first row, rows) of the mask one process keeps, when it scores its queries against the
    documents of every process (``local`` and ``d_texts`` are then the global batch's)."""
    mask = None
    if recipe.filtering.enabled and src.teacher_q is not None:
        tq = src.teacher_q[local]
        td = src.teacher_d[local]
        if src.k:
            td = torch.cat([td, src.teacher_n[local].reshape(-1, td.shape[-1])])
        mask = false_negative_mask(tq, td, src.k, recipe.filtering.threshold)
    if recipe.mask_duplicates:  # d_texts: the local positives first, then their hard negatives
        ids: dict[str, int] = {}
        keys = torch.tensor([ids.setdefault(t, len(ids)) for t in d_texts])
        # the same question on two rows (several answers): each row's answer is not the other's negative
        queries = torch.tensor([ids.setdefault("query\0" + src.queries[i], len(ids)) for i in local])
        dup = duplicate_mask(keys[: len(local)], keys, query_keys=queries)
        mask = dup if mask is None else (mask | dup)
    return mask if mask is None or keep is None else mask[keep[0] : keep[0] + keep[1]]
