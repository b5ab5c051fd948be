"""Encoding a batch in groups of rows of similar length: the same rows, fewer padding tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

#: the cost of one more forward call, in padded tokens: a group is split off only where it saves more than this
GROUP_OVERHEAD_TOKENS = 512


def length_groups(lengths: list[int], overhead: int = GROUP_OVERHEAD_TOKENS) -> list[list[int]]:
    """Row indices split into groups of similar length that minimise padded tokens plus ``overhead`` per group:
    an exact dynamic programme over the distinct sorted lengths. With ``overhead`` > 0 an optimal split never
    separates rows of one length (moving them into the shorter group saves tokens, or a group), so the programme
    is quadratic in the distinct lengths (at most max_length), not in the rows (2 x batch x columns)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    values: list[int] = []  # the distinct lengths, ascending
    upto = [0]  # upto[j]: the rows of the j shortest distinct lengths
    for i in order:
        if values and lengths[i] == values[-1]:
            upto[-1] += 1
        else:
            values.append(lengths[i])
            upto.append(upto[-1] + 1)
    best, cut = [0] + [float("inf")] * len(values), [0] * (len(values) + 1)
    for end in range(1, len(values) + 1):
        for start in range(end):
            cost = best[start] + (upto[end] - upto[start]) * values[end - 1] + overhead
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(values)
    while end > 0:
        groups.append(order[upto[cut[end]] : upto[end]])
        end = cut[end]
    return groups[::-1]


def drops_padding(model) -> bool:
    """Whether ``model``'s encoder drops padding itself (NeoBERT's ``config.drops_padding``, padding-free by
    default): length groups would then save no token and cost forward calls. ``model`` is the unwrapped
    sentence-transformers model (a trainer may later hand the loss a DDP wrapper, which has no modules to index)."""
    first = model[0] if len(model) else None
    config = getattr(getattr(first, "auto_model", None), "config", None)
    return bool(getattr(config, "drops_padding", False))


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


def _row(t: Tensor, r: int, width: int) -> Tensor:
    """Row ``r`` of a per-row or token tensor, cut or zero-padded (masked positions) to ``width`` tokens."""
    if t.dim() == 1:
        return t[r]
    row = t[r, :width]
    return F.pad(row, (0, width - row.shape[0])) if row.shape[0] < width else row


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
