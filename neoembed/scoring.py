"""Contrastive losses without the B x N matrix: a softmax cross-entropy over cosine logits, computed and
differentiated one chunk of rows at a time.

InfoNCE scores B queries against N candidates. At the batch sizes GradCache exists for (B = 4k-65k, N = 2-8 B)
the B x N logits alone need gigabytes, and a broadcast cosine (B x N x d) cannot run at all. The loss is a
scalar, so its gradients can be formed while the rows are walked: for a chunk of rows, the logits
``cos(r_i, c_j) / tau``, their log-sum-exp, and ``softmax - target`` times the other side give the chunk's
loss and its share of both gradients; the chunk is then dropped, and the backward pass only scales what was
formed. Peak memory: the embeddings, their gradients and one chunk of logits and masks (plus an fp32 copy of a
matrix that comes in lower precision or in many separate pieces); work: the three
matrix products of the plain composition (normalise, matmul, masked_fill, cross_entropy), to which the
result and its gradients are equal within fp32 rounding.

A loss is a list of *blocks*: block ``(a, b, mask)`` scores row matrix ``rows[a]`` against column matrix
``cols[b]``; one softmax runs over the concatenated blocks of each row, and row i's target is column
``offset + i`` of block 0. Plain InfoNCE is one block; GTE's improved loss four (query-document,
query-query, document-query, document-document). ``mask(rows, cos)`` gets the slice of rows of a chunk and
their (len(rows), N) fp32 cosines and returns the entries to drop (True), or None.

A matrix may be given as a list of segments (the mini-batches GradCache embedded, or the columns
positive, negative_1, ...). Segments that lie one after another in one buffer are read as one matrix in
place; up to :data:`MAX_PARTS` buffers are scored buffer by buffer into one chunk of logits; more, or
lower precision, are joined once into one fp32 buffer (the copy bf16 embeddings need anyway), so that a
chunk costs a few large matrix products, not a few per mini-batch. Each segment's gradient comes back as a
view of one buffer. The row matrices' segments must have equal lengths.
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
    n_rows, n_targets = sum(lengths), sum(len(s) for s in col_segs[blocks[0].col])
    if offset + n_rows > n_targets:
        raise ValueError(
            f"row i's positive is column offset + i: {n_rows} rows at offset {offset} need at least "
            f"{offset + n_rows} candidates, got {n_targets}"
        )
    layout = (len(lengths), [len(s) for s in col_segs])
    spec = (tuple(blocks), float(temperature), int(offset), reduction, chunk, layout)
    flat = [t for segs in row_segs for t in segs] + [t for segs in col_segs for t in segs]
    return _ChunkedSoftmaxCE.apply(spec, *flat)


def _inverse_norms(x: Tensor) -> Tensor:
    return 1.0 / x.norm(dim=1).clamp_min(_EPS)


def _normalise_backward(grad_unit: Tensor, x: Tensor, inv: Tensor) -> Tensor:
    """In place: the gradient w.r.t. x of a loss whose gradient w.r.t. x / max(|x|, eps) is ``grad_unit``."""
    # d(x/|x|) = (I - u u^T) / |x|; below eps F.normalize divides by the constant eps, so no projection
    along = torch.bmm(x[:, None, :], grad_unit[:, :, None]).view(-1) * inv * inv * (inv < 1.0 / _EPS)
    grad_unit.mul_(inv[:, None])
    return grad_unit.addcmul_(x, (along * inv)[:, None], value=-1.0)


#: at most this many separate buffers are scored in place; more (GradCache's mini-batches as they come) are
#: joined first, since a chunk costs a few matrix products per buffer
MAX_PARTS = 16


def _runs(segments: Sequence[Tensor]) -> list[Tensor]:
    """The segments as matrices without a copy: each run of segments that lie one after another in one
    buffer (the views of a split, GradCache's mini-batches written into one, their first dimensions for
    Matryoshka) becomes one matrix."""
    runs: list[list[Tensor]] = []
    for s in segments:
        prev = runs[-1][-1] if runs else None
        adjacent = (
            prev is not None
            and s.dim() == 2
            and s.stride() == prev.stride()
            and s.stride(1) == 1
            and s.shape[1] == prev.shape[1]
            and s.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
            and s.data_ptr() == prev.data_ptr() + len(prev) * prev.stride(0) * prev.element_size()
        )
        if adjacent:
            runs[-1].append(s)
        else:
            runs.append([s])
    return [_as_one(run) for run in runs]


def _as_one(run: list[Tensor]) -> Tensor:
    first = run[0].detach()
    if len(run) == 1:
        return first
    rows = sum(len(s) for s in run)
    return first.new_empty(0).set_(
        first.untyped_storage(), first.storage_offset(), (rows, first.shape[1]), first.stride()
    )


class _Side:
    """One matrix of the loss, with its inverse norms and (when wanted) one gradient buffer. Its segments are
    read in place when they are fp32 already and lie in at most :data:`MAX_PARTS` buffers (the columns
    positive, negative_1, ..., each one tensor); otherwise they are joined into one fp32 buffer (the copy
    that bf16 embeddings need anyway), since a chunk costs a few matrix products per buffer: scored mini-batch
    by mini-batch, B = 65,536 in mini-batches of 1,024 needs 36x the operations of one product."""

    def __init__(self, segments: Sequence[Tensor], want_grad: bool):
        dtype = torch.float64 if any(s.dtype == torch.float64 for s in segments) else torch.float32
        self.lengths = [len(s) for s in segments]
        parts = _runs(segments) if all(s.dtype == dtype for s in segments) else []
        if not parts or len(parts) > MAX_PARTS:
            parts = [torch.cat([s.detach() for s in segments]).to(dtype)]
        self.parts = parts
        self.bounds = [0]
        for part in parts:
            self.bounds.append(self.bounds[-1] + len(part))
        self.inv = torch.cat([_inverse_norms(part) for part in parts])
        self.grad = parts[0].new_zeros(self.bounds[-1], parts[0].shape[1]) if want_grad else None

    def __len__(self) -> int:
        return self.bounds[-1]

    def _spans(self):
        return zip(self.parts, self.bounds[:-1], self.bounds[1:], strict=True)

    def units(self, lo: int, hi: int) -> Tensor:
        """Rows ``lo:hi`` divided by their norms (a copy of one chunk)."""
        rows = [
            part[max(lo, a) - a : min(hi, b) - a] for part, a, b in self._spans() if max(lo, a) < min(hi, b)
        ]
        return (rows[0] if len(rows) == 1 else torch.cat(rows)) * self.inv[lo:hi, None]

    def cos(self, units: Tensor) -> Tensor:
        """(len(units), len(self)) cosines of unit rows with this side's vectors."""
        if len(self.parts) == 1:
            out = units @ self.parts[0].T
        else:
            out = units.new_empty(len(units), len(self))
            for part, a, b in self._spans():
                torch.mm(units, part.T, out=out[:, a:b])
        return out.mul_(self.inv[None, :])

    def add_row_grads(self, lo: int, hi: int, grad: Tensor) -> None:
        self.grad[lo:hi] += grad

    def add_col_grads(self, p: Tensor, units: Tensor) -> None:
        """Column gradients ``p^T units``."""
        for _, a, b in self._spans():
            self.grad[a:b].addmm_(p[:, a:b].T, units)

    def times(self, p: Tensor) -> Tensor:
        """``p`` (rows x len(self)) times this side's vectors."""
        out = None
        for part, a, b in self._spans():
            out = p[:, a:b] @ part if out is None else out.addmm_(p[:, a:b], part)
        return out

    def backward(self, weight: float) -> list[Tensor]:
        """The gradient of each segment (views of one buffer)."""
        for part, a, b in self._spans():
            _normalise_backward(self.grad[a:b], part, self.inv[a:b]).mul_(weight)
        return list(self.grad.split(self.lengths))


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
        out = total.to(rows[0].inv.dtype) * (weight * tau)
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
    own = torch.arange(sl.stop - sl.start, device=units[0].device)
    target = own + sl.start + offset
    picked = logits[0][own, target]
    # logsumexp by hand, so that exp(logits - max) is formed in place of the logits: no second chunk-sized
    # buffer, and it is the softmax up to a per-row scale; a row with every entry masked is shifted by 0, as
    # torch.logsumexp does
    top = torch.stack([x.amax(dim=1) for x in logits]).amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    sums = sum(x.sub_(top[:, None]).exp_().sum(dim=1) for x in logits)
    loss = (top + sums.log() - picked).sum(dtype=torch.float64)
    if want:
        grad_units = [None] * len(rows)
        for k, (block, p) in enumerate(zip(blocks, logits, strict=True)):
            p.div_(sums[:, None])  # this block's share of the softmax, in place of its logits
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
