# Copyright (c) 2026 the neoembed developers. MIT License.
"""NeoBERT (Le Breton et al., 2025), top to bottom: RMSNorm -> RoPE -> attention -> SwiGLU -> block ->
encoder -> masked-LM head.

Imports only torch and transformers: this file is copied next to every saved model.

Shapes: B batch, L padded length, T packed tokens (sum of real lengths), D width, H heads, Dh = D / H.

Attention runs in one of two layouts:

* padded: ``(B, L, D)`` with a key-padding mask ``(B, 1, 1, L)`` built once per forward;
* padding-free (``config.padding_free``, or ``flash_attention_2``): the real tokens of every sequence packed
  into one ``(T, D)`` sequence for every linear layer; RoPE positions restart at 0 per sequence and attention
  is confined to each sequence by ``cu_seqlens``. On CUDA it runs in flash-attn's varlen kernel (or
  ``torch.nn.attention.varlen``); on CPU as one SDPA call per sequence. Outputs are scattered back to
  ``(B, L, D)``, so callers do not care. Input that is already packed (``position_ids`` /
  ``cu_seq_lens_q``, as transformers' ``DataCollatorWithFlattening`` emits it) stays packed.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput

try:
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # pragma: no cover - older transformers
    GradientCheckpointingLayer = nn.Module  # type: ignore[misc,assignment]

from .configuration_neobert import ATTN_IMPLEMENTATIONS, NeoBERTConfig

__all__ = ["NeoBERTForMaskedLM", "NeoBERTModel", "NeoBERTPreTrainedModel"]


# --------------------------------------------------------------------------------------------------- norm
class NeoBERTRMSNorm(nn.Module):
    """RMSNorm with its statistics in float32 (autocast-safe), output in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight.float(), self.eps)
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return y * self.weight.to(x.dtype)


# --------------------------------------------------------------------------------------------------- RoPE
def rope_frequencies(config: NeoBERTConfig, device=None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (Dh/2,) in float32 and the cos/sin scale (YaRN's attention factor, else 1)."""
    dim, base = config.head_dim, config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device)[: dim // 2].float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    # YaRN (Peng et al., 2023): interpolate the low frequencies by `factor`, keep the high ones, blend
    # between the two with a linear ramp over the wavelengths set by beta_fast / beta_slow.
    factor, beta_fast, beta_slow = scaling["factor"], scaling["beta_fast"], scaling["beta_slow"]
    original = config.max_length

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1.0 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, float(attention_factor)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, scale: float):
    """cos and sin of shape ``(*position_ids.shape, 1, Dh/2)`` in float32 (the 1 broadcasts over heads)."""
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq
    cos, sin = torch.cos(angles), torch.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.unsqueeze(-2), sin.unsqueeze(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of the last dim by the angles; computed in float32."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------------------------------- attention
@dataclass
class PackedBatch:
    """Where the real tokens of a padded batch go when it is packed into one sequence."""

    cu_seqlens: torch.Tensor  # (B+1,) int32, cumulative lengths
    max_seqlen: int
    lengths: list[int]  # per sequence, on the host
    indices: (
        torch.Tensor | None
    )  # (T,) flat positions of real tokens in the (B*L) grid; None if input was packed


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


def packed_attention(q, k, v, packed: PackedBatch, flash_required: bool) -> torch.Tensor:
    """Attention confined to each sequence of a packed batch. q, k, v: (T, H, Dh) -> (T, H, Dh)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        flash = _flash_varlen()
        if flash is not None:
            cu = packed.cu_seqlens
            return flash(q, k, v, cu, cu, packed.max_seqlen, packed.max_seqlen, causal=False)
        varlen = _torch_varlen()
        if varlen is not None:
            cu = packed.cu_seqlens
            return varlen(q, k, v, cu, cu, packed.max_seqlen, packed.max_seqlen)
    if flash_required:
        raise RuntimeError(
            "attn_implementation='flash_attention_2' needs a CUDA device, float16/bfloat16 activations and "
            "the flash-attn package; use attn_implementation='sdpa' (padding_free=True) elsewhere."
        )
    # CPU (or float32 on CUDA): one SDPA call per sequence over the packed tensor.
    outs, start = [], 0
    for n in packed.lengths:
        if n == 0:
            continue
        sl = slice(start, start + n)
        o = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1).unsqueeze(0),
            k[sl].transpose(0, 1).unsqueeze(0),
            v[sl].transpose(0, 1).unsqueeze(0),
        )
        outs.append(o[0].transpose(0, 1))
        start += n
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)


def padded_attention(q, k, v, key_mask: torch.Tensor | None, implementation: str, output_attentions: bool):
    """Bidirectional attention over padded sequences. q, k, v: (B, L, H, Dh); key_mask: (B, 1, 1, L) bool."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, L, Dh)
    if implementation == "eager" or output_attentions:
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask, torch.finfo(scores.dtype).min)
        probs = scores.float().softmax(dim=-1).to(q.dtype)
        out = probs @ v
        weights = probs if output_attentions else None
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        weights = None
    return out.transpose(1, 2), weights  # (B, L, H, Dh)


def positionless_prefix_attention(q, k, v, q_rot, k_rot, prefix: int, key_mask, output_attentions: bool):
    """Attention where the first ``prefix`` tokens of every row are a position-less set (CDE's context vectors).

    A pair of tokens interacts through rotated q/k only when both are text tokens (relative positions among
    the text); any pair involving a prefix token uses the unrotated q/k. So permuting the prefix permutes
    nothing else, and shifting all text positions changes nothing. q, k, v, q_rot, k_rot: (B, L, H, Dh);
    q_rot/k_rot hold rotated values for the text part (positions >= prefix).
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, L, Dh)
    qt, kt = q_rot[:, prefix:].transpose(1, 2), k_rot[:, prefix:].transpose(1, 2)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-1, -2)) * scale
    scores[..., prefix:, prefix:] = (qt @ kt.transpose(-1, -2)) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, torch.finfo(scores.dtype).min)
    probs = scores.float().softmax(dim=-1).to(q.dtype)
    return (probs @ v).transpose(1, 2), (probs if output_attentions else None)


# ------------------------------------------------------------------------------------------------ SwiGLU
class NeoBERTSwiGLU(nn.Module):
    """w3(silu(gate) * value) where [gate | value] = w12(x)."""

    def __init__(self, config: NeoBERTConfig):
        super().__init__()
        hidden = config.ffn_hidden_size
        self.w12 = nn.Linear(config.hidden_size, 2 * hidden, bias=False)
        self.w3 = nn.Linear(hidden, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(gate) * value)


# ------------------------------------------------------------------------------------------------- block
class NeoBERTBlock(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(norm(x)), then x + swiglu(norm(x)). Parameter names as the official ones."""

    def __init__(self, config: NeoBERTConfig):
        super().__init__()
        self.config = config
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.ffn = NeoBERTSwiGLU(config)
        self.attention_norm = NeoBERTRMSNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = NeoBERTRMSNorm(config.hidden_size, config.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        packed: PackedBatch | None = None,
        output_attentions: bool = False,
        positionless_prefix: int = 0,
    ):
        # x: (B, L, D) padded or (T, D) packed; cos/sin broadcast to (..., 1, Dh/2)
        h = self.attention_norm(x)
        qkv = self.qkv(h).unflatten(-1, (self.num_heads, 3 * self.head_dim))  # (..., H, 3*Dh)
        q, k, v = qkv.chunk(3, dim=-1)
        implementation = self.config._attn_implementation or "sdpa"
        if positionless_prefix:
            P = positionless_prefix
            q_rot = torch.cat((q[:, :P], apply_rope(q[:, P:], cos, sin)), dim=1)
            k_rot = torch.cat((k[:, :P], apply_rope(k[:, P:], cos, sin)), dim=1)
            attn, weights = positionless_prefix_attention(
                q, k, v, q_rot, k_rot, P, key_mask, output_attentions
            )
            x = x + self.wo(attn.flatten(-2))
            x = x + self.ffn(self.ffn_norm(x))
            return x, weights
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if packed is not None:
            attn = packed_attention(q, k, v, packed, flash_required=implementation == "flash_attention_2")
            weights = None
        else:
            attn, weights = padded_attention(q, k, v, key_mask, implementation, output_attentions)
        x = x + self.wo(attn.flatten(-2))
        x = x + self.ffn(self.ffn_norm(x))
        return x, weights


# --------------------------------------------------------------------------------------------- encoder
class NeoBERTPreTrainedModel(PreTrainedModel):
    config_class = NeoBERTConfig
    config: NeoBERTConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["NeoBERTBlock"]
    _supports_sdpa = True
    _supports_flash_attn = True
    # read by sentence-transformers (is_backend_compatible): with flash attention it then packs each batch itself
    # (DataCollatorWithFlattening: position_ids, cu_seq_lens_q/k, max_length_q/k), which forward() accepts
    _supports_attention_backend = True

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """As transformers' ``from_pretrained``, but a checkpoint with missing or unexpected NeoBERT weights is an
        error listing them (never a silently half-random model). The MLM ``decoder`` is the one exception: it
        is dropped when loading the bare encoder, and freshly initialised (with a warning) when loading the
        masked-LM model from an encoder-only checkpoint."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        missing = [k for k in info.get("missing_keys", ()) if not k.startswith("decoder.")]
        unexpected = [k for k in info.get("unexpected_keys", ()) if not k.startswith("decoder.")]
        mismatched = list(info.get("mismatched_keys", ()))
        if missing or unexpected or mismatched:
            parts = [f"missing keys {sorted(missing)}"] if missing else []
            parts += [f"unexpected keys {sorted(unexpected)}"] if unexpected else []
            parts += [f"keys with mismatched shapes {mismatched}"] if mismatched else []
            raise ValueError(
                f"checkpoint {args[0] if args else kwargs.get('pretrained_model_name_or_path')!r} does not match "
                f"{cls.__name__}: " + "; ".join(parts) + ". Check that config.json belongs to these weights."
            )
        if any(k.startswith("decoder.") for k in info.get("missing_keys", ())):
            warnings.warn(
                "the checkpoint has no masked-LM decoder: it was initialised randomly (fine for pre-training, "
                "not for scoring masked tokens)",
                stacklevel=2,
            )
        return (model, info) if want_info else model

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # Official initialisation: uniform in +-range for linear layers and embeddings.
        if isinstance(module, nn.Linear):
            r = self.config.decoder_init_range
            nn.init.uniform_(module.weight, -r, r)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            r = self.config.embedding_init_range
            nn.init.uniform_(module.weight, -r, r)
        elif isinstance(module, NeoBERTRMSNorm):
            nn.init.ones_(module.weight)


def _check_inputs(config: NeoBERTConfig, input_ids, attention_mask, inputs_embeds) -> None:
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids or inputs_embeds")
    ref = input_ids if input_ids is not None else inputs_embeds
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be a 2-D (batch, length) tensor, got "
                f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}"
            )
        if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= config.vocab_size):
            raise ValueError(
                f"input_ids must lie in [0, {config.vocab_size}); got min {int(input_ids.min())}, "
                f"max {int(input_ids.max())}. Is the tokenizer the model's own?"
            )
    elif inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size:
        raise ValueError(
            f"inputs_embeds must be (batch, length, {config.hidden_size}), got {tuple(inputs_embeds.shape)}"
        )
    if attention_mask is not None:
        if attention_mask.shape != ref.shape[:2]:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} does not match input shape {tuple(ref.shape[:2])}"
            )
        if attention_mask.dtype.is_floating_point and not bool(
            ((attention_mask == 0) | (attention_mask == 1)).all()
        ):
            raise ValueError("attention_mask must be 0/1 (1 = token, 0 = padding), not an additive mask")
        if not attention_mask.dtype.is_floating_point and attention_mask.dtype != torch.bool:
            if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
                raise ValueError("attention_mask must hold only 0 and 1 (1 = token, 0 = padding)")


def _key_padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B, 1, 1, L) bool key mask, or None without padding. Fully padded rows attend to every position
    (finite garbage that callers ignore) instead of to nothing (NaN)."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    mask = attention_mask.bool()
    return (mask | ~mask.any(dim=1, keepdim=True))[:, None, None, :]


def _is_packed(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> bool:
    """Flattened input described by position_ids alone: one row in which positions restart at 0."""
    return (
        position_ids is not None
        and attention_mask is None
        and position_ids.dim() == 2
        and position_ids.shape[0] == 1
        and position_ids.shape[1] > 1
        and bool((position_ids[0, 1:] == 0).any())
    )


class NeoBERTModel(NeoBERTPreTrainedModel):
    """The NeoBERT encoder: token embedding (no position embedding) -> blocks -> final RMSNorm."""

    # official checkpoints hold the masked-LM decoder too; the bare encoder drops it without complaint
    _keys_to_ignore_on_load_unexpected = [r"^decoder\."]

    def __init__(self, config: NeoBERTConfig):
        super().__init__(config)
        self.encoder = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.transformer_encoder = nn.ModuleList(
            NeoBERTBlock(config) for _ in range(config.num_hidden_layers)
        )
        self.layer_norm = NeoBERTRMSNorm(config.hidden_size, config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.encoder = value

    def _rope(self, position_ids: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scale = rope_frequencies(self.config, device=device)
        return rope_cos_sin(position_ids, inv_freq, scale)

    def _check_length(self, length: int) -> None:
        limit = self.config.max_sequence_length
        if length > limit:
            hint = (
                "enable YaRN with rope_scaling={'type': 'yarn', 'factor': f} to go beyond the trained length"
                if self.config.rope_scaling is None
                else "raise rope_scaling.factor or truncate the input"
            )
            raise ValueError(f"sequence of {length} tokens exceeds the model's maximum of {limit}: {hint}")

    # Each layout returns (x, RoPE positions, key mask, PackedBatch or None, whether to scatter back to B x L).
    def _layout_with_prefix(self, x, attention_mask, position_ids, prefix, cu_seq_lens_q):
        B, L = x.shape[:2]
        if not 0 < prefix <= L:
            raise ValueError(f"positionless_prefix={prefix} must lie in [0, {L}]")
        if cu_seq_lens_q is not None:
            raise ValueError("positionless_prefix does not combine with packed input")
        n_text = L - prefix
        self._check_length(n_text)
        pos = torch.arange(n_text, device=x.device)[None] if position_ids is None else position_ids
        if pos.shape[-1] != n_text:
            raise ValueError(f"with positionless_prefix, position_ids must cover the {n_text} text positions")
        return x, pos, _key_padding_mask(attention_mask), None, False

    def _layout_packed_input(self, x, position_ids, cu_seq_lens_q, cu_seq_lens_k):
        """Input already packed by a flattening collator: (1, T) with sequence boundaries."""
        B, L = x.shape[:2]
        if B != 1:
            raise ValueError(f"packed input must have batch size 1, got {B}")
        if cu_seq_lens_q is None:
            starts = torch.nonzero(position_ids[0] == 0).flatten()
            cu_seq_lens_q = torch.cat([starts, starts.new_tensor([L])])
        if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k.cpu(), cu_seq_lens_q.cpu()):
            raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q (NeoBERT is self-attention only)")
        cu = cu_seq_lens_q.to(device=x.device, dtype=torch.int32)
        lengths = (cu[1:] - cu[:-1]).tolist()
        if int(cu[-1]) != L or min(lengths, default=0) < 0:
            raise ValueError(f"cu_seq_lens_q {cu.tolist()} does not describe {L} packed tokens")
        for n in lengths:
            self._check_length(n)
        if position_ids is None:
            position_ids = torch.cat([torch.arange(n, device=x.device) for n in lengths])[None]
        return x[0], position_ids[0], None, PackedBatch(cu, max(lengths, default=0), lengths, None), False

    def _layout_padded_input(self, x, attention_mask, position_ids, want_packed: bool):
        B, L = x.shape[:2]
        self._check_length(L)
        has_padding = attention_mask is not None and not bool(attention_mask.all())
        if has_padding and want_packed:
            # Padding-free: gather the real tokens; positions restart at 0 per sequence.
            mask = attention_mask.bool()
            lengths_t = mask.sum(dim=1, dtype=torch.int32)
            indices = torch.nonzero(mask.flatten()).flatten()
            cu = F.pad(torch.cumsum(lengths_t, 0, dtype=torch.int32), (1, 0))
            lengths = lengths_t.tolist()
            if position_ids is None:
                pos = torch.cumsum(mask, dim=1).flatten()[indices] - 1
            else:
                pos = position_ids.expand(B, L).flatten()[indices]
            return x.flatten(0, 1)[indices], pos, None, PackedBatch(cu, max(lengths), lengths, indices), True
        if want_packed and self.config._attn_implementation == "flash_attention_2":
            # flash attention on a batch without padding: every row is one sequence of length L
            cu = torch.arange(0, (B + 1) * L, L, device=x.device, dtype=torch.int32)
            pos = (
                torch.arange(L, device=x.device).repeat(B)
                if position_ids is None
                else position_ids.expand(B, L).flatten()
            )
            return x.flatten(0, 1), pos, None, PackedBatch(cu, L, [L] * B, None), True
        pos = torch.arange(L, device=x.device)[None] if position_ids is None else position_ids
        return x, pos, _key_padding_mask(attention_mask), None, False

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        positionless_prefix: int = 0,
        **kwargs,
    ) -> BaseModelOutput:
        """Encode a batch.

        Args:
            input_ids: (B, L) token ids, or (1, T) packed ids with ``cu_seq_lens_q`` / ``position_ids``.
            attention_mask: (B, L) with 1 for tokens and 0 for padding.
            position_ids: RoPE positions (default: 0, 1, … per sequence).
            inputs_embeds: (B, L, D) instead of ``input_ids``.
            positionless_prefix: the first P positions of every row are a position-less set (CDE's context
                vectors): no rotation for them, and attention between them and anything else ignores
                positions. ``position_ids`` then covers the L − P text positions. Runs padded attention.
        """
        for name in ("token_type_ids", "seq_idx"):
            kwargs.pop(name, None)  # tokenizers and flattening collators may send these; NeoBERT has no use
        if kwargs:
            raise TypeError(f"NeoBERTModel.forward got unexpected arguments: {sorted(kwargs)}")
        output_hidden_states = bool(
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        output_attentions = bool(output_attentions)
        _check_inputs(self.config, input_ids, attention_mask, inputs_embeds)
        x = self.encoder(input_ids) if inputs_embeds is None else inputs_embeds
        B, L = x.shape[:2]
        device = x.device
        implementation = self.config._attn_implementation or "sdpa"
        if implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"unknown attn_implementation {implementation!r}; valid: {list(ATTN_IMPLEMENTATIONS)}"
            )

        if positionless_prefix:
            x, pos, key_mask, packed, scatter_back = self._layout_with_prefix(
                x, attention_mask, position_ids, positionless_prefix, cu_seq_lens_q
            )
        elif cu_seq_lens_q is not None or _is_packed(position_ids, attention_mask):
            x, pos, key_mask, packed, scatter_back = self._layout_packed_input(
                x, position_ids, cu_seq_lens_q, cu_seq_lens_k
            )
        else:
            want_packed = implementation == "flash_attention_2" or (
                self.config.padding_free and implementation != "eager" and not output_attentions
            )
            x, pos, key_mask, packed, scatter_back = self._layout_padded_input(
                x, attention_mask, position_ids, want_packed
            )
        cos, sin = self._rope(pos, device)

        def to_output(h: torch.Tensor) -> torch.Tensor:
            """Back to the caller's layout: (B, L, D), or (1, T, D) for input that came packed."""
            if packed is None:
                return h
            if not scatter_back:
                return h[None]
            if packed.indices is None:  # flash attention on a batch without padding
                return h.unflatten(0, (B, L))
            out = h.new_zeros(B * L, h.shape[-1])
            out[packed.indices] = h
            return out.unflatten(0, (B, L))

        all_hidden = [to_output(x)] if output_hidden_states else None
        all_attn = [] if output_attentions else None
        for block in self.transformer_encoder:
            x, weights = block(
                x,
                cos,
                sin,
                key_mask=key_mask,
                packed=packed,
                output_attentions=output_attentions,
                positionless_prefix=positionless_prefix,
            )
            if output_hidden_states:
                all_hidden.append(to_output(x))
            if output_attentions:
                all_attn.append(weights)
        x = to_output(self.layer_norm(x))
        return BaseModelOutput(
            last_hidden_state=x,
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            attentions=tuple(all_attn) if all_attn is not None else None,
        )


# ----------------------------------------------------------------------------------------------- MLM head
class NeoBERTForMaskedLM(NeoBERTPreTrainedModel):
    """NeoBERT with the untied masked-LM decoder (a linear layer with bias) of the official checkpoint."""

    def __init__(self, config: NeoBERTConfig):
        super().__init__(config)
        self.model = NeoBERTModel(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.decoder = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            **kwargs,
        )
        logits = self.decoder(out.last_hidden_state)
        loss = None
        if labels is not None:
            if labels.shape != logits.shape[:-1]:
                raise ValueError(
                    f"labels shape {tuple(labels.shape)} does not match logits {tuple(logits.shape[:-1])}"
                )
            loss = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100)
        return MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )


NeoBERTModel.register_for_auto_class("AutoModel")
NeoBERTForMaskedLM.register_for_auto_class("AutoModelForMaskedLM")
