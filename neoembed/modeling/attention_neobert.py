# Copyright 2026 the neoembed developers. MIT License.
"""NeoBERT's rotary embedding and attention functions, bundled beside every saved model with ``modeling_neobert.py`` (which imports
this file: transformers copies it along). Imports only torch and transformers.

Each function has the signature of transformers' ``AttentionInterface``: ``fn(module, query, key, value,
attention_mask, scaling=None, dropout=0.0, **kwargs) -> (out, weights or None)``, with query, key and value
``(B, H, L, Dh)`` (already rotated: RoPE belongs to the attention module) and ``out`` ``(B, L, H, Dh)``. The padded
layout runs transformers' own ``sdpa`` or :func:`eager_attention_forward` (the one that returns the weights).
Packed sequences are ``(1, H, T, Dh)`` with the standard flash keyword arguments (``cu_seq_lens_q``,
``max_length_q``) and run one of the two functions registered here under their names: ``neobert_varlen`` (CUDA in half precision: flash-attn's or torch's varlen kernel) and
``neobert_grouped`` (CPU: sequences of similar length padded together, one SDPA call per group).
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from .configuration_neobert import ATTN_IMPLEMENTATIONS, NeoBERTConfig, _from_rope_scaling


class NeoBERTRotaryEmbedding(nn.Module):
    """RoPE's inverse frequencies (Dh/2,) and their cos/sin at given positions.

    ``config.rope_parameters`` picks the variant: ``default`` (the paper's RoPE, base ``rope_theta``) or one of
    the scalings transformers defines (``yarn``, ``linear``, ``dynamic``, ...), computed by transformers' own
    functions so that the keys mean what they mean in every transformers model. The frequencies stay float32
    whatever dtype the model is cast to: in bfloat16, positions in the thousands would be off by radians."""

    inv_freq: torch.Tensor
    original_inv_freq: torch.Tensor

    def __init__(self, config: NeoBERTConfig, device=None):
        super().__init__()
        if (config.rope_parameters or {}).get("rope_theta") is None:
            # a mapping set on a built config, as from_pretrained(..., rope_parameters=...) or rope_scaling=...
            # sets it: transformers standardises RoPE settings only as a config is built, so it is built again
            params = _from_rope_scaling(config.rope_parameters or {})  # unset values dropped, "type" read
            built = type(config).from_dict({**config.to_dict(), "rope_parameters": params})
            config.rope_parameters = built.rope_parameters
        self.config = config
        self.rope_type = config.rope_type
        # read by transformers' dynamic_rope_update (the "dynamic" scaling recomputes past this length)
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        init = self.compute_default_rope_parameters
        if self.rope_type != "default":
            init = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init(config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(
        config: NeoBERTConfig, device=None, **kwargs
    ) -> tuple[torch.Tensor, float]:
        """The paper's frequencies ``base ** (-2i / Dh)``, and a cos/sin scale of 1."""
        dim, base = config.head_dim, config.rope_parameters["rope_theta"]
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32) / dim
        return 1.0 / (base**exponents), 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape ``(*position_ids.shape, Dh/2)``, float32 (``x`` gives only the device)."""
        angles = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(x.device, torch.float32)
        cos, sin = torch.cos(angles), torch.sin(angles)
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos, sin

    def _apply(self, fn, recurse=True):
        # a cast of the whole model (.to(torch.bfloat16), .half()) moves the frequencies but keeps them float32
        kept = {name: buf for name, buf in self._buffers.items() if buf is not None}
        super()._apply(fn, recurse)
        for name, buf in kept.items():
            moved = self._buffers[name]
            if moved.dtype != torch.float32 and buf.dtype == torch.float32:
                self._buffers[name] = buf.to(moved.device)
        return self


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
def eager_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """softmax(q kᵀ · scaling + mask) v, written out; ``attention_mask`` a bool key mask (True: attend)."""
    scores = (query @ key.transpose(-1, -2)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    probs = scores.float().softmax(dim=-1).to(query.dtype)
    return (probs @ value).transpose(1, 2), probs


#: how much more attention work (Σ padded length² against Σ length²) a group of ``neobert_grouped`` may do
#: than its sequences alone: fewer, larger SDPA calls for a little padding (benchmarks/cpu_attention.py)
GROUP_SLACK = 1.5


def length_order(lengths: list[int] | tuple[int, ...]) -> list[int]:
    """Sequences, longest first (ties in their order): the order in which :func:`length_groups` groups them."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def length_groups(lengths: list[int] | tuple[int, ...], device=None, slack: float | None = None):
    """The plan of ``neobert_grouped`` for packed sequences of these lengths (host ints): sequences in
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


def grouped_attention_forward(module, query, key, value, attention_mask=None, groups=(), order=None, **kwargs):
    """Packed layout on CPU (or float32 on CUDA): one SDPA call per group of similar-length sequences
    (:func:`length_groups`: ``groups`` and ``order``, planned once per forward), each padded to its longest; a
    loop over single sequences costs a call each."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, Dh)
    if not groups:
        return torch.zeros_like(q)[None], None
    if order is not None:  # into group order (index_copy: its backward selects, never adds)
        q, k, v = (torch.empty_like(t).index_copy(0, order[1], t) for t in (q, k, v))
    parts = zip(groups, *(t.split([g[0] for g in groups]) for t in (q, k, v)), strict=True)
    out = torch.cat([_group_attention(g, *qkv) for g, *qkv in parts])
    return (out if order is None else torch.empty_like(out).index_copy(0, order[0], out))[None], None


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


def varlen_attention_forward(module, query, key, value, attention_mask=None, **kwargs):
    """Packed layout on CUDA in half precision: flash-attn's varlen kernel, else torch's own."""
    return _varlen_kernel(query, key, value, kwargs), None


@torch.compiler.disable
def _varlen_kernel(query, key, value, kwargs: dict) -> torch.Tensor:
    # opaque to torch.compile (a graph break), with nothing before or after it in its caller (each would be a graph
    # of its own), and the host int max_length_q read only in here: a traced read would specialise the compiled
    # layer on it, so every batch with another longest text would compile again
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, Dh), as the varlen kernels take them
    cu, n = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    flash = _flash_varlen()
    if flash is not None:
        return flash(q, k, v, cu, cu, n, n, causal=False)[None]
    return _torch_varlen()(q, k, v, cu, cu, n, n)[None]


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


#: neoembed's functions in transformers' AttentionInterface (a copy beside a saved model registers its own)
PACKED_FUNCTIONS = {"neobert_grouped": grouped_attention_forward, "neobert_varlen": varlen_attention_forward}
for _name, _fn in PACKED_FUNCTIONS.items():
    AttentionInterface.register(_name, _fn)


def attention_function(config: NeoBERTConfig, x: torch.Tensor, packed: bool, output_attentions: bool) -> str:
    """The AttentionInterface name for this forward, from the configured implementation and the layout."""
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
        return "neobert_varlen"
    if implementation == "flash_attention_2":
        raise RuntimeError(
            "attn_implementation='flash_attention_2' needs a CUDA device, float16/bfloat16 activations and "
            "the flash-attn package; use attn_implementation='sdpa' (padding_free=True) elsewhere."
        )
    return "neobert_grouped"
