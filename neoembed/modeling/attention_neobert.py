# Copyright 2026 the neoembed developers. MIT License.
"""NeoBERT's attention functions, bundled beside every saved model with ``modeling_neobert.py`` (which imports
this file: transformers copies it along). Imports only torch and transformers.

A backend is ``fn(q, k, v, inputs) -> (out, weights or None)`` registered by name in ``ATTENTION_BACKENDS``;
q, k, v are (B, L, H, Dh) padded or (T, H, Dh) packed, q and k not yet rotated: RoPE belongs to the backend, so
that a backend may fuse it into its kernel or (CDE's position-less prefix) rotate only part of the sequence.
``eager`` and ``sdpa`` run the padded layout; ``varlen`` (CUDA: flash-attn's or torch's varlen kernel) and
``grouped`` (CPU: sequences of similar length padded together, one SDPA call per group) the packed one.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .configuration_neobert import ATTN_IMPLEMENTATIONS, NeoBERTConfig


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of the last dim by the angles; computed in float32.

    The pairs are read as complex numbers (a view, no copy, even on the strided q/k of the fused projection)
    and multiplied by cos + i sin: one vectorised kernel where the real form needs strided halves and a stack.
    Under torch.compile the real form runs instead: inductor has no code generation for complex numbers (it would
    fall back to eager kernels) and fuses the real one."""
    if torch.compiler.is_compiling():
        x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------------------------------- attention
@dataclass
class AttentionInputs:
    """What every block's attention needs, built once per forward by the model (never by a block).

    ``backend`` names the function in ``ATTENTION_BACKENDS`` that runs; RoPE tables and masks are already on
    the right device. Padded layouts carry ``key_mask``; packed layouts carry ``cu_seqlens`` and the lengths.
    """

    backend: str
    cos: torch.Tensor  # (..., L or T, 1, Dh/2) float32, broadcast over heads (NeoBERTRotaryEmbedding's)
    sin: torch.Tensor
    key_mask: torch.Tensor | None = None  # (B, 1, 1, L) bool, padded layouts; None attends to every key
    cu_seqlens: torch.Tensor | None = None  # (B+1,) int32, packed layouts
    lengths: tuple[int, ...] = ()  # per sequence, on the host (packed layouts)
    max_seqlen: int = 0
    groups: tuple = ()  # the grouped backend's plan (:func:`length_groups`), built once per forward
    order: tuple | None = None  # (order, inverse) of the grouped backend's tokens, or None: already grouped
    output_attentions: bool = False
    prefix: int = 0  # CDE's position-less prefix (its backend is registered by neoembed.cde)


#: name -> ``fn(q, k, v, inputs) -> (out, weights or None)``; q, k, v: (B, L, H, Dh) padded or (T, H, Dh)
#: packed, q and k not yet rotated: RoPE belongs to the backend, so that a backend may fuse it into its kernel
#: or (CDE's position-less prefix) rotate only part of the sequence.
ATTENTION_BACKENDS: dict = {}


def register_attention_backend(name: str):
    """Decorator adding an attention function to ``ATTENTION_BACKENDS`` under ``name``."""

    def register(fn):
        ATTENTION_BACKENDS[name] = fn
        return fn

    return register


def _rotate(q, k, inputs: AttentionInputs):
    return apply_rope(q, inputs.cos, inputs.sin), apply_rope(k, inputs.cos, inputs.sin)


@register_attention_backend("eager")
def eager_attention(q, k, v, inputs: AttentionInputs):
    """softmax(q kᵀ / √Dh + mask) v, written out; the only backend that returns the attention weights."""
    q, k = _rotate(q, k, inputs)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, L, Dh)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if inputs.key_mask is not None:
        scores = scores.masked_fill(~inputs.key_mask, torch.finfo(scores.dtype).min)
    probs = scores.float().softmax(dim=-1).to(q.dtype)
    return (probs @ v).transpose(1, 2), probs


@register_attention_backend("sdpa")
def sdpa_attention(q, k, v, inputs: AttentionInputs):
    q, k = _rotate(q, k, inputs)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, L, Dh)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=inputs.key_mask).transpose(1, 2), None


#: how much more attention work (Σ padded length² against Σ length²) a group of the ``grouped`` backend may do
#: than its sequences alone: fewer, larger SDPA calls for a little padding (benchmarks/cpu_attention.py)
GROUP_SLACK = 1.5


def length_order(lengths: list[int] | tuple[int, ...]) -> list[int]:
    """Sequences, longest first (ties in their order): the order in which :func:`length_groups` groups them."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def length_groups(lengths: list[int] | tuple[int, ...], device=None, slack: float | None = None):
    """The ``grouped`` backend's plan for packed sequences of these lengths (host ints): sequences in
    :func:`length_order` cut greedily into groups, each padded to its longest while that costs at most
    ``slack`` times the group's own attention work. Returns ``(groups, order)``: per group its token count, its
    (b, Lg) grid, the grid positions of its tokens, the packed position of each grid position (the token count
    at padding) and its (b, 1, 1, Lg) key mask (the last two None without padding); ``order`` the packed tokens
    in group order and its inverse, or None where they are in group order already (the padding-free layout
    packs its sequences longest first for this). Built from host ints and constants only: ``torch.compile``
    traces it without a data-dependent break."""
    slack = GROUP_SLACK if slack is None else slack
    cut: list[list[int]] = []
    work = top = 0
    for i in (i for i in length_order(lengths) if lengths[i]):
        n = lengths[i]
        if cut and (len(cut[-1]) + 1) * top * top <= slack * (work + n * n):
            cut[-1].append(i)
            work += n * n
        else:
            cut.append([i])
            top, work = n, n * n
    groups = []
    for members in cut:
        lens, width = [lengths[i] for i in members], lengths[members[0]]
        size, cells = sum(lens), len(lens) * width
        real = torch.arange(width)[None] < torch.tensor(lens)[:, None]  # (b, Lg)
        grid = torch.nonzero_static(real.flatten(), size=size).flatten()
        if size == cells:
            groups.append((size, (len(lens), width), grid.to(device), None, None))
            continue
        packed = torch.full((cells,), size).index_copy(0, grid, torch.arange(size))
        groups.append(
            (size, (len(lens), width), grid.to(device), packed.to(device), real[:, None, None].to(device))
        )
    if [i for m in cut for i in m] == [i for i, n in enumerate(lengths) if n]:
        return tuple(groups), None
    starts = [0, *itertools.accumulate(lengths)]
    order = torch.cat([torch.arange(starts[i], starts[i + 1]) for m in cut for i in m])
    return tuple(groups), (order.to(device), order.argsort().to(device))


@register_attention_backend("grouped")
def grouped_attention(q, k, v, inputs: AttentionInputs):
    """Packed layout on CPU (or float32 on CUDA): one SDPA call per group of similar-length sequences
    (:func:`length_groups`), each padded to its longest; a loop over single sequences costs a call each."""
    if not inputs.groups:
        return torch.zeros_like(q), None
    q, k = _rotate(q, k, inputs)
    if inputs.order is not None:  # into group order (index_copy: its backward selects, never adds)
        q, k, v = (torch.empty_like(t).index_copy(0, inputs.order[1], t) for t in (q, k, v))
    parts = zip(inputs.groups, *(t.split([g[0] for g in inputs.groups]) for t in (q, k, v)), strict=True)
    out = torch.cat([_group_attention(g, *qkv) for g, *qkv in parts])
    return (out if inputs.order is None else torch.empty_like(out).index_copy(0, inputs.order[0], out)), None


def _group_attention(group, q, k, v):
    """One group's tokens into its (b, Lg) grid, attention, and back. Rows move only by ``index_copy``, whose
    backward selects rows (index_select's backward adds them: an index_add several times slower on CPU); the
    padding cells are copied to one extra row that is cut off."""
    size, (b, n), grid, packed, key_mask = group
    if key_mask is None:
        q, k, v = (t.unflatten(0, (b, n)).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(0, 1)
    q, k, v = (t.new_zeros(b * n, *t.shape[1:]).index_copy(0, grid, t).unflatten(0, (b, n)).transpose(1, 2)
               for t in (q, k, v))  # fmt: skip
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask).transpose(1, 2).flatten(0, 1)
    return out.new_zeros(size + 1, *out.shape[1:]).index_copy(0, packed, out)[:size]


@register_attention_backend("varlen")
def varlen_attention(q, k, v, inputs: AttentionInputs):
    """Packed layout on CUDA in half precision: flash-attn's varlen kernel, else torch's own."""
    q, k = _rotate(q, k, inputs)
    return _varlen_kernel(q, k, v, inputs), None


@torch.compiler.disable
def _varlen_kernel(q, k, v, inputs: AttentionInputs) -> torch.Tensor:
    # opaque to torch.compile, and the inputs read only in here: a traced read of the host int max_seqlen would
    # specialise the compiled layer on it, so every batch with another longest text would compile again
    cu, n = inputs.cu_seqlens, inputs.max_seqlen
    flash = _flash_varlen()
    if flash is not None:
        return flash(q, k, v, cu, cu, n, n, causal=False)
    return _torch_varlen()(q, k, v, cu, cu, n, n)


@functools.cache
def _flash_varlen():
    """flash-attn's varlen kernel if installed, else None (imported lazily, looked up once)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen():
    """torch's own varlen attention (CUDA) if this torch has it, else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def attention_backend(config: NeoBERTConfig, x: torch.Tensor, packed: bool, output_attentions: bool) -> str:
    """The registry name for this forward, from the configured implementation and the layout."""
    implementation = config._attn_implementation or "sdpa"
    if implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"unknown attn_implementation {implementation!r}; valid: {list(ATTN_IMPLEMENTATIONS)}"
        )
    if not packed:
        return "eager" if implementation == "eager" or output_attentions else "sdpa"
    # under autocast the projections hand attention half-precision q, k, v whatever the embeddings' dtype
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    half = x.is_cuda and dtype in (torch.float16, torch.bfloat16)
    if half and (_flash_varlen() is not None or _torch_varlen() is not None):
        return "varlen"
    if implementation == "flash_attention_2":
        raise RuntimeError(
            "attn_implementation='flash_attention_2' needs a CUDA device, float16/bfloat16 activations and "
            "the flash-attn package; use attn_implementation='sdpa' (padding_free=True) elsewhere."
        )
    return "grouped"
