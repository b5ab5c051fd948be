"""The row-chunked contrastive scoring (neoembed.scoring) against its slow twin: the plain composition
normalise -> matmul -> masked_fill -> cross_entropy, whose B x N logits autograd keeps.

Losses and gradients are compared in float64 (equal to 1e-12) and in bfloat16 inputs (within the reference's
own bf16 error); the masks built per chunk against the whole-matrix masks; and the chunking itself, so that no
chunk of logits exceeds its budget (the cached loss's memory claim)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from neoembed import scoring
from neoembed.losses import (
    FalseNegativeConfig,
    duplicate_mask,
    duplicate_masker,
    false_negative_mask,
    false_negative_masker,
    improved_info_nce,
    info_nce,
)
from neoembed.scoring import Block, contrastive_loss


def _plain(q, c, tau, mask=None, reduction="mean", offset=0):
    logits = F.normalize(q, dim=-1) @ F.normalize(c, dim=-1).T / tau
    if mask is not None:
        logits = logits.masked_fill(mask, float("-inf"))
    return F.cross_entropy(logits, torch.arange(len(q)) + offset, reduction=reduction)


def _grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    loss = fn(*xs)
    return loss.detach(), torch.autograd.grad(loss, xs)


def _data(b=23, n_cols=4, d=12, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, d, generator=g, dtype=dtype)
    c = torch.randn(b * n_cols, d, generator=g, dtype=dtype)
    mask = torch.rand(b, b * n_cols, generator=g) < 0.3
    mask[torch.arange(b), torch.arange(b)] = False
    return q, c, mask


def _cut_into(x, segments: int, layout: str):
    """``x`` as ``segments`` views of its buffer ("adjacent"), or as separate tensors; one segment: ``x``."""
    if segments == 1:
        return x
    parts = list(x.tensor_split(segments))
    return parts if layout == "adjacent" else [p.clone() for p in parts]


@pytest.mark.parametrize("chunk", [None, 1, 5, 23])
@pytest.mark.parametrize(
    ("segments", "layout"), [(1, ""), (3, "adjacent"), (3, "separate"), (20, "separate")]
)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_loss_and_gradients_equal_the_plain_composition(chunk, segments, layout, reduction):
    q, c, mask = _data()
    ref, ref_g = _grads(lambda q, c: _plain(q, c, 0.07, mask, reduction), q, c)

    def chunked(q, c):
        cols, rows = _cut_into(c, segments, layout), _cut_into(q, segments, layout)
        block = Block(0, 0, lambda sl, cos: mask[sl])
        return contrastive_loss([rows], [cols], [block], 0.07, reduction=reduction, chunk=chunk)

    out, out_g = _grads(chunked, q, c)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(out_g, ref_g, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)


def test_chunked_loss_with_an_offset_and_zero_vectors():
    """Column offset + i is the target (a gathered batch); a zero vector is divided by eps, as F.normalize does."""
    q, c, _ = _data(b=6, n_cols=3)
    c[4] = 0.0
    ref, ref_g = _grads(lambda q, c: _plain(q, c, 0.05, offset=6), q, c)
    out, out_g = _grads(lambda q, c: info_nce(q, c, 0.05, offset=6), q, c)
    assert torch.allclose(out, ref, rtol=1e-12)
    for a, b in zip(out_g, ref_g, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)


def test_bf16_inputs_within_the_references_own_bf16_error():
    q, c, mask = _data(b=64, n_cols=2, d=32, dtype=torch.float32)
    exact, exact_g = _grads(lambda q, c: _plain(q.double(), c.double(), 0.07, mask), q, c)
    low = [x.bfloat16() for x in (q, c)]
    ref, ref_g = _grads(lambda q, c: _plain(q, c, 0.07, mask), *low)
    out, out_g = _grads(lambda q, c: info_nce(q, c, 0.07, mask), *low)
    assert out.dtype == torch.bfloat16 or out.dtype == torch.float32
    assert abs(float(out) - float(exact)) <= 2 * abs(float(ref) - float(exact)) + 1e-6
    for a, b, e in zip(out_g, ref_g, exact_g, strict=True):
        assert a.dtype == torch.bfloat16
        assert (a.double() - e.double()).abs().max() <= 2 * (b.double() - e.double()).abs().max() + 1e-6


def test_bf16_autocast_step_scores_in_float32():
    """A bf16 training step (autocast on, the encoder's embeddings in bf16) scores the bf16 values in float32:
    loss and gradients equal the float32 composition on the same values (autocast must not turn the chunk's
    matmuls into bf16 ones; found on the GPU, where it raised a dtype mismatch)."""
    q, c, mask = _data(b=40, n_cols=3, d=32, dtype=torch.float32)
    low = [x.bfloat16() for x in (q, c)]
    ref, ref_g = _grads(lambda q, c: _plain(q.float(), c.float(), 0.07, mask), *low)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_g = _grads(lambda q, c: info_nce(q, c, 0.07, mask), *low)
    assert torch.allclose(out.float(), ref, rtol=1e-6)
    for a, b in zip(out_g, ref_g, strict=True):
        assert a.dtype == torch.bfloat16
        assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-5)


def test_improved_loss_equals_its_whole_matrix_form():
    """GTE's four-term denominator as four blocks, against the four matrices concatenated."""
    q, c, mask = _data(b=9, n_cols=3)
    tau = 0.1

    def reference(q, c):
        cos = lambda a, b: F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T  # noqa: E731
        rows = torch.arange(len(q))
        p = c[: len(q)]
        qd = (cos(q, c) / tau).masked_fill(mask, float("-inf"))
        qq = (cos(q, q) / tau).masked_fill(torch.eye(len(q), dtype=torch.bool), float("-inf"))
        dq = cos(q, p).T / tau
        mine = (torch.arange(len(c)) % len(q))[None, :] == rows[:, None]
        dd = (cos(p, c) / tau).masked_fill(mine, float("-inf"))
        return (torch.logsumexp(torch.cat([qd, qq, dq, dd], 1), 1) - qd[rows, rows]).mean()

    ref, ref_g = _grads(reference, q, c)
    out, out_g = _grads(lambda q, c: improved_info_nce(q, c, q, tau, mask), q, c)
    assert torch.allclose(out, ref, rtol=1e-12)
    for a, b in zip(out_g, ref_g, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)


def _duplicate_mask_whole(
    positive_keys, candidate_keys, offset=0, query_keys=None, candidate_query_keys=None
):
    """The whole-matrix construction the chunked masker replaces: (B, M) @ (M, N) float matrices."""
    mask = positive_keys[:, None] == candidate_keys[None, :]
    if query_keys is not None:
        others = query_keys if candidate_query_keys is None else candidate_query_keys
        same_query = (query_keys[:, None] == others[None, :]).float()
        is_their_positive = (candidate_keys[: len(others), None] == candidate_keys[None, :]).float()
        mask |= (same_query @ is_their_positive) > 0
    rows = torch.arange(len(positive_keys))
    mask[rows, rows + offset] = False
    return mask


@pytest.mark.parametrize("seed", range(4))
def test_duplicate_mask_per_chunk_equals_the_whole_matrix_form(seed):
    """Repeated texts and repeated queries (one question, several answers), gathered from two ranks."""
    g = torch.Generator().manual_seed(seed)
    world_queries = torch.randint(0, 12, (20,), generator=g)  # queries of both ranks, many asked twice
    candidates = torch.randint(0, 30, (60,), generator=g)  # positives of both ranks, then negatives
    local, offset = slice(10, 20), 10
    args = (candidates[local], candidates, offset, world_queries[local], world_queries)
    whole = _duplicate_mask_whole(*args)
    assert torch.equal(duplicate_mask(*args), whole)
    masker = duplicate_masker(*args)
    chunks = torch.cat([masker(slice(a, min(10, a + 3))) for a in range(0, 10, 3)])
    assert torch.equal(chunks, whole)
    assert whole.any()  # the case is not vacuous
    no_repeats = torch.arange(20)
    args = (candidates[local], candidates, offset, no_repeats[local], no_repeats)
    assert torch.equal(duplicate_mask(*args), _duplicate_mask_whole(*args))


def test_false_negative_mask_per_chunk_equals_the_whole_matrix_form(monkeypatch):
    monkeypatch.setattr(scoring, "CHUNK_ELEMENTS", 50)  # two rows a chunk
    q, c, _ = _data(b=8, n_cols=3, dtype=torch.float32)
    for config in [
        FalseNegativeConfig(margin=0.1),
        FalseNegativeConfig(margin=0.3, mode="relative", scope="hard"),
        FalseNegativeConfig(margin=0.2, scope="in_batch"),
    ]:
        whole = false_negative_mask(q, c, 3, config)
        seen = []

        def record(sl, cos, config=config, seen=seen):
            m = false_negative_masker(len(c), 3, config)(sl, cos)
            seen.append(m)
            return m

        info_nce(q, c, 0.07, record)
        assert torch.equal(torch.cat(seen), whole)


def test_no_chunk_of_logits_exceeds_its_budget(monkeypatch):
    """The memory claim of the cached loss: logits exist one chunk at a time, never B x N."""
    monkeypatch.setattr(scoring, "CHUNK_ELEMENTS", 600)
    q, c, _ = _data(b=50, n_cols=4, dtype=torch.float32)
    shapes = []

    def record(sl, cos):
        shapes.append(tuple(cos.shape))

    loss = info_nce(q.requires_grad_(), c.requires_grad_(), 0.07, record)
    loss.backward()
    assert shapes and max(r * n for r, n in shapes) <= 600
    assert sum(r for r, _ in shapes) == 50
    assert torch.allclose(loss, _plain(q.detach(), c.detach(), 0.07), rtol=1e-6)


@pytest.mark.parametrize("layout", ["adjacent", "separate"])
def test_fp32_matrices_in_few_buffers_are_read_in_place(monkeypatch, layout):
    """The memory claim of the cached loss at B = 65k: beside the embeddings, only their gradients and one
    chunk. fp32 matrices given in at most MAX_PARTS buffers (GradCache's columns, each one buffer) are
    scored in place: no operation in the forward or backward pass makes a new tensor as large as a matrix
    except the two gradient buffers."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Large(TorchDispatchMode):
        def __init__(self, numel):
            super().__init__()
            self.numel, self.made = numel, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            fresh = not func._schema.is_mutable and not any(r.alias_info for r in func._schema.returns)
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if fresh and isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                    self.made.append(str(func))
            return out

    monkeypatch.setattr(scoring, "CHUNK_ELEMENTS", 8 * 192)  # 8 rows a chunk
    q, c, _ = _data(b=64, n_cols=3, d=32, dtype=torch.float32)
    rows = [x.requires_grad_() for x in _cut_into(q, 4, layout)]
    cols = [x.requires_grad_() for x in _cut_into(c, 12, layout)]
    with Large(q.numel()) as large:
        loss = contrastive_loss([rows], [cols], [Block(0, 0)], 0.07)
        loss.backward()
    assert large.made == ["aten.new_zeros.default"] * 2, large.made
    assert torch.allclose(loss, _plain(q, c, 0.07), rtol=1e-5)


def test_the_operations_of_a_chunk_do_not_grow_with_the_segments(monkeypatch):
    """GradCache hands the loss its mini-batches as segments: a chunk scored segment by segment made
    B = 65,536 in mini-batches of 1,024 launch 36x the kernels of sentence-transformers' loss (8.9 s against
    1.25 s on an H200). The number of tensor operations must not depend on how the matrices are cut."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(scoring, "CHUNK_ELEMENTS", 4 * 3 * 64)  # 4 rows a chunk: 16 chunks
    q, c, _ = _data(b=64, n_cols=3, dtype=torch.float32)

    def ops(segments: int) -> int:
        # separate tensors, as GradCache's mini-batches come (beyond MAX_PARTS of them, joined)
        rows = [x.clone().requires_grad_() for x in q.tensor_split(segments)]
        cols = [x.clone().requires_grad_() for x in c.tensor_split(3 * segments)]
        with Count() as count:
            contrastive_loss([rows], [cols], [Block(0, 0)], 0.07).backward()
        return count.n

    whole, cut = ops(1), ops(16)
    assert cut < whole + 6 * 16 * 4, (whole, cut)  # a few joins and splits per segment, nothing per chunk
