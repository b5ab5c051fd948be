"""Matrices given whole or as segments (GradCache's mini-batches), read in place."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from neoembed.scoring import MaskFn, Matrix


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


def _cut(x: Matrix, dim: int) -> Matrix:
    """The first ``dim`` dimensions of a matrix or of each of its segments (views, no copy)."""
    return x[..., :dim] if isinstance(x, Tensor) else [t[..., :dim] for t in x]


def _cos(a: Tensor, b: Tensor) -> Tensor:
    """(len(a), len(b)) cosine similarities, in fp32."""
    return F.normalize(a.float(), dim=-1) @ F.normalize(b.float(), dim=-1).T
