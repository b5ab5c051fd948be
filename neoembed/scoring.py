"""Contrastive losses without the B x N matrix: a softmax cross-entropy over cosine logits, computed and
differentiated one chunk of rows at a time.

InfoNCE scores B queries against N candidates. At the batch sizes GradCache exists for (B = 4k-65k, N = 2-8 B)
the B x N logits alone need gigabytes, and a broadcast cosine (B x N x d) cannot run at all. The loss is a
scalar, so its gradients can be formed while the rows are walked: for a chunk of rows, the logits
``cos(r_i, c_j) / tau``, their log-sum-exp, and ``softmax - target`` times the other side give the chunk's
loss and its share of both gradients; the chunk is then dropped, and the backward pass only scales what was
formed. Peak memory: the embeddings, an fp32 copy of each matrix given in segments or in lower precision,
their gradients and one chunk of logits and masks; work: the three
matrix products of the plain composition (normalise, matmul, masked_fill, cross_entropy), to which the
result and its gradients are equal within fp32 rounding.

A loss is a list of *blocks*: block ``(a, b, mask)`` scores row matrix ``rows[a]`` against column matrix
``cols[b]``; one softmax runs over the concatenated blocks of each row, and row i's target is column
``offset + i`` of block 0. Plain InfoNCE is one block; GTE's improved loss four (query-document,
query-query, document-query, document-document). ``mask(rows, cos)`` gets the slice of rows of a chunk and
their (len(rows), N) fp32 cosines and returns the entries to drop (True), or None.

A matrix may be given as a list of segments (the mini-batches GradCache embedded, or the columns
positive, negative_1, ...): they are joined once into one fp32 buffer (the copy that bf16 embeddings need
anyway), so that a chunk costs a few large matrix products, not a few per segment, and each segment's
gradient comes back as a view of one buffer. The row matrices' segments must have equal lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Block", "MaskFn", "chunk_rows", "contrastive_loss"]

#: (rows of the chunk, their (len(rows), N) fp32 cosines) -> True where an entry leaves the softmax, or None
MaskFn = Callable[[slice, Tensor], "Tensor | None"]

#: logits held at once, in elements (32 MiB of fp32): large enough for full-speed matrix products on a CPU
CHUNK_ELEMENTS = 1 << 23
#: on a GPU (256 MiB of fp32): each chunk reads the whole column matrix, so fewer, larger chunks; at B = 65,536
#: with one hard negative, 512 rows a chunk
CHUNK_ELEMENTS_CUDA = 1 << 26

_EPS = 1e-12  # F.normalize's: a vector is divided by max(|x|, eps)

Matrix = Tensor | Sequence[Tensor]


@dataclass(frozen=True)
class Block:
    """``rows[row]`` scored against ``cols[col]``; ``mask`` drops entries from the softmax."""

    row: int
    col: int
    mask: MaskFn | None = None


def chunk_rows(n_rows: int, n_columns: int, budget: int | None = None) -> int:
    """Rows per chunk so that a chunk's logits hold at most ``budget`` elements (default
    :data:`CHUNK_ELEMENTS`; at least one row)."""
    budget = CHUNK_ELEMENTS if budget is None else budget
    return max(1, min(n_rows, budget // max(1, n_columns)))


def contrastive_loss(
    rows: Sequence[Matrix],
    cols: Sequence[Matrix],
    blocks: Sequence[Block],
    temperature: float,
    offset: int = 0,
    reduction: str = "mean",
    chunk: int | None = None,
) -> Tensor:
    """The mean (or sum) over rows i of ``logsumexp_j(logits_ij) - logits_i,offset+i`` (see the module)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"unknown reduction {reduction!r}; valid: 'mean', 'sum'")
    row_segs = [[m] if isinstance(m, Tensor) else list(m) for m in rows]
    col_segs = [[m] if isinstance(m, Tensor) else list(m) for m in cols]
    lengths = [len(s) for s in row_segs[0]]
    if any([len(s) for s in segs] != lengths for segs in row_segs):
        raise ValueError("every row matrix needs segments of the same lengths")
    layout = (len(lengths), [len(s) for s in col_segs])
    spec = (tuple(blocks), float(temperature), int(offset), reduction, chunk, layout)
    flat = [t for segs in row_segs for t in segs] + [t for segs in col_segs for t in segs]
    return _ChunkedSoftmaxCE.apply(spec, *flat)


def _inverse_norms(x: Tensor) -> Tensor:
    return 1.0 / x.norm(dim=1).clamp_min(_EPS)


def _normalise_backward(grad_unit: Tensor, x: Tensor, inv: Tensor) -> Tensor:
    """In place: the gradient w.r.t. x of a loss whose gradient w.r.t. x / max(|x|, eps) is ``grad_unit``."""
    # d(x/|x|) = (I - u u^T) / |x|; below eps F.normalize divides by the constant eps, so no projection
    along = (x * grad_unit).sum(dim=1) * inv * inv * (inv < 1.0 / _EPS)
    grad_unit.mul_(inv[:, None])
    return grad_unit.addcmul_(x, (along * inv)[:, None], value=-1.0)


class _Side:
    """One matrix of the loss, its segments (GradCache's mini-batches) joined in one fp32 buffer, with its
    inverse norms and (when wanted) one gradient buffer. Joined, a chunk costs a few matrix products whatever
    the number of segments (scored segment by segment, B = 65,536 in mini-batches of 1,024 needs 36x the
    operations of sentence-transformers' loss); the join is the fp32 copy that bf16 embeddings need anyway."""

    def __init__(self, segments: Sequence[Tensor], want_grad: bool):
        dtype = torch.float64 if any(s.dtype == torch.float64 for s in segments) else torch.float32
        self.lengths = [len(s) for s in segments]
        if len(segments) == 1:
            self.x = segments[0].detach().to(dtype)
        else:
            self.x = torch.cat([s.detach() for s in segments]).to(dtype)
        self.inv = _inverse_norms(self.x)
        self.grad = torch.zeros_like(self.x) if want_grad else None

    def __len__(self) -> int:
        return len(self.x)

    def units(self, lo: int, hi: int) -> Tensor:
        """Rows ``lo:hi`` divided by their norms (a copy of one chunk)."""
        return self.x[lo:hi] * self.inv[lo:hi, None]

    def cos(self, units: Tensor) -> Tensor:
        """(len(units), len(self)) cosines of unit rows with this side's vectors."""
        return (units @ self.x.T).mul_(self.inv[None, :])

    def add_row_grads(self, lo: int, hi: int, grad: Tensor) -> None:
        self.grad[lo:hi] += grad

    def add_col_grads(self, p: Tensor, units: Tensor) -> None:
        """Column gradients ``p^T units``."""
        self.grad.addmm_(p.T, units)

    def times(self, p: Tensor) -> Tensor:
        """``p`` (rows x len(self)) times this side's vectors."""
        return p @ self.x

    def backward(self, weight: float) -> list[Tensor]:
        """The gradient of each segment (views of one buffer)."""
        return list(_normalise_backward(self.grad, self.x, self.inv).mul_(weight).split(self.lengths))


class _ChunkedSoftmaxCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, *tensors: Tensor) -> Tensor:
        # float32 whatever autocast says: the embeddings of a bf16 step come in bf16 and are read as float32
        # (_Side), and an autocast matmul would hand back bf16 logits to accumulate into float32 gradients
        with torch.autocast(tensors[0].device.type, enabled=False):
            return _ChunkedSoftmaxCE._forward(ctx, spec, *tensors)

    @staticmethod
    def _forward(ctx, spec, *tensors: Tensor) -> Tensor:
        blocks, tau, offset, reduction, chunk, (n_row_segs, col_counts) = spec
        want = any(ctx.needs_input_grad[1:])
        n_row_mats = (len(tensors) - sum(col_counts)) // n_row_segs
        rows, at = [], 0
        for _ in range(n_row_mats):
            rows.append(_Side(tensors[at : at + n_row_segs], want))
            at += n_row_segs
        cols = []
        for count in col_counts:
            cols.append(_Side(tensors[at : at + count], want))
            at += count
        n = len(rows[0])
        weight = (1.0 / n if reduction == "mean" else 1.0) / tau
        budget = CHUNK_ELEMENTS_CUDA if tensors[0].device.type == "cuda" else CHUNK_ELEMENTS
        step = chunk or chunk_rows(n, sum(len(cols[b.col]) for b in blocks), budget)
        total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
        for start in range(0, n, step):
            total += _chunk(blocks, rows, cols, slice(start, min(n, start + step)), tau, offset, want)
        out = total.to(rows[0].x.dtype) * (weight * tau)
        if want:
            grads = [g for side in rows + cols for g in side.backward(weight)]
            ctx.save_for_backward(*grads)
            ctx.dtypes = [t.dtype for t in tensors]
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: Tensor):
        # in place: the buffers are this call's own (once_differentiable), and a copy would double the peak
        grads = [
            g.mul_(grad_output).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True)
        ]
        return (None, *grads)


def _chunk(blocks, rows, cols, sl, tau, offset, want) -> Tensor:
    """The summed loss of rows ``sl``, accumulating their gradients into the sides' buffers when ``want``."""
    units = [side.units(sl.start, sl.stop) for side in rows]
    logits = []
    for block in blocks:
        cos = cols[block.col].cos(units[block.row])
        drop = block.mask(sl, cos) if block.mask is not None else None
        cos.div_(tau)
        if drop is not None:
            cos.masked_fill_(drop, float("-inf"))
        logits.append(cos)
    lse = torch.logsumexp(torch.stack([torch.logsumexp(x, dim=1) for x in logits]), dim=0)
    own = torch.arange(sl.stop - sl.start, device=lse.device)
    target = own + sl.start + offset
    loss = (lse - logits[0][own, target]).sum(dtype=torch.float64)
    if want:
        grad_units = [None] * len(rows)
        for k, (block, p) in enumerate(zip(blocks, logits, strict=True)):
            p.sub_(lse[:, None]).exp_()  # this block's share of the softmax, in place of its logits
            if k == 0:
                p[own, target] -= 1.0
            side = cols[block.col]
            side.add_col_grads(p, units[block.row])
            p.mul_(side.inv[None, :])  # d cos_ij / d u_i = c_j / |c_j|
            g = side.times(p)
            grad_units[block.row] = g if grad_units[block.row] is None else grad_units[block.row].add_(g)
        for side, g in zip(rows, grad_units, strict=True):
            if g is not None:
                side.add_row_grads(sl.start, sl.stop, g)
    return loss
