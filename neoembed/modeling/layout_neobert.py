# Copyright 2026 the neoembed developers. MIT License.
"""NeoBERT's two layouts, chosen once per forward (:func:`plan_layout`, then :func:`prepare_layout`):

* padded: ``(B, L, D)`` with a key-padding mask ``(B, 1, 1, L)`` (none where nothing is padded);
* packed: the real tokens of every sequence in one ``(1, T, D)`` sequence, attention confined to each sequence
  by the standard flash keyword arguments (``cu_seq_lens_q``, ``max_length_q``); :class:`Layout` scatters the
  outputs back to ``(B, L, D)``.

And the input checks of ``NeoBERTModel.forward``. Imports only torch: copied next to every saved model with
``modeling_neobert.py``, which imports it. ``model`` below is the ``NeoBERTModel`` being run (its ``config``,
``rope`` and ``check_length``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .attention_neobert import attention_function, length_groups, length_order
from .configuration_neobert import NeoBERTConfig


def check_inputs(config: NeoBERTConfig, input_ids, attention_mask, inputs_embeds) -> None:
    """Shape and dtype checks always; value checks only on host tensors outside compilation, where they cost no
    device sync and no graph break (on CUDA an out-of-range id still fails, in the embedding lookup)."""
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
    elif inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size:
        raise ValueError(
            f"inputs_embeds must be (batch, length, {config.hidden_size}), got {tuple(inputs_embeds.shape)}"
        )
    B, L = ref.shape[:2]
    if attention_mask is not None and attention_mask.shape not in ((B, L), (B, 1, L, L), (B, 1, 1, L)):
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match input shape {(B, L)}: pass "
            f"{(B, L)} (1 = token, 0 = padding) or a bool {(B, 1, L, L)} or {(B, 1, 1, L)} mask (True = attend)"
        )
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.dtype != torch.bool:
        raise TypeError(f"a 4-D attention_mask must be bool (True = attend), got {attention_mask.dtype}")
    if torch.compiler.is_compiling() or ref.device.type != "cpu":
        return
    if input_ids is not None and input_ids.numel():
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= config.vocab_size:
            raise ValueError(
                f"input_ids must lie in [0, {config.vocab_size}); got min {low}, max {high}. "
                "Is the tokenizer the model's own?"
            )
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError(
                "attention_mask must hold only 0 and 1 (1 = token, 0 = padding), not an additive mask"
            )


def key_padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B, 1, 1, L) bool key mask. Fully padded rows attend to every position (finite garbage that callers
    ignore) instead of to nothing (NaN). Built without asking the host whether there is padding."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4:  # already (B, 1, L, L), e.g. packed rows' block-diagonal mask: as given
        return attention_mask
    mask = attention_mask.bool()
    return (mask | ~mask.any(dim=1, keepdim=True))[:, None, None, :]


@dataclass
class Layout:
    """How the tokens the blocks see relate to the caller's ``(B, L)`` grid: padded (the grid itself) or packed
    (``(1, T)``: the real tokens of every sequence in one row)."""

    batch: int
    length: int
    indices: torch.Tensor | None = None  # packed from a padded grid: (T,) flat grid positions of the tokens
    whole_rows: bool = False  # packed from a grid without padding: each row one sequence
    padding: torch.Tensor | None = None  # padded: (B, L, 1) bool, True at padding

    def unpack(self, h: torch.Tensor) -> torch.Tensor:
        """Back to the caller's layout: (B, L, D), or (1, T, D) for input that came packed (returned as is, as
        padded input is)."""
        if self.whole_rows:
            return h[0].unflatten(0, (self.batch, self.length))
        if self.indices is None:
            return h  # the tensor itself (a hidden state a caller may retain_grad on)
        out = h.new_zeros(self.batch * self.length, h.shape[-1])
        return out.index_copy(0, self.indices, h[0]).unflatten(0, (self.batch, self.length))

    def output(self, h: torch.Tensor) -> torch.Tensor:
        """The last hidden state: padding positions are zeros in every layout, so that the layouts agree."""
        h = self.unpack(h)
        return h if self.padding is None else h.masked_fill(self.padding, 0.0)


def plan_layout(config, x, attention_mask, position_ids, cu_q, output_attentions):
    """Where this forward's layout comes from, and the device tensor it must read on the host to build it (or
    None): the lengths of a padded batch to drop its padding, or the boundaries of packed input."""
    B, L = x.shape[:2]
    if cu_q is not None:
        return "packed_input", cu_q
    if position_ids is not None and attention_mask is None and B == 1 and L > 1:
        return "maybe_packed", position_ids[0]  # positions restarting at 0 mark packed sequences
    if attention_mask is not None and attention_mask.dim() == 4:
        return "padded", None  # the caller's own 4-D mask: only the padded layout applies it
    implementation = config._attn_implementation or "sdpa"
    want_packed = config.drops_padding and (implementation == "flash_attention_2" or not output_attentions)
    # Packing needs the lengths on the host: a traced export has none, so it keeps the padded layout.
    if not want_packed or torch.compiler.is_exporting():
        return "padded", None
    if attention_mask is None:
        return ("whole_rows" if implementation == "flash_attention_2" else "unpadded"), None
    return "padding_free", attention_mask.sum(dim=1)


def prepare_layout(model, plan, host, x, attention_mask, position_ids, cu_k, output_attentions):
    """The layout, the blocks' input and the attention arguments, from the plan and what was read on the
    host: packed (given packed, or a padded batch's real tokens) or padded."""
    B, L = x.shape[:2]
    if plan == "packed_input":
        return _packed_input(model, x, position_ids, cu_k, [int(c) for c in host])
    if plan == "maybe_packed":
        starts = [i for i, p in enumerate(host) if p == 0]
        if len(starts) > 1 or (starts and starts[0] != 0):
            return _packed_input(model, x, position_ids, cu_k, [*starts, L])
    if plan == "padding_free":
        lengths = [int(n) for n in host]
        if any(n < L for n in lengths):  # (no min(..., default=): dynamo breaks the graph on it)
            return _padding_free(model, x, attention_mask, position_ids, lengths)
        plan = "whole_rows" if model.config._attn_implementation == "flash_attention_2" else "unpadded"
    if plan == "whole_rows":  # flash attention on a batch without padding: each row one packed sequence
        pos = (
            torch.arange(L, device=x.device).repeat(B) if position_ids is None else position_ids.expand(B, L)
        )
        layout = Layout(B, L, whole_rows=True)
        return x.flatten(0, 1)[None], layout, _packed_attention(model, x, pos.flatten(), [L] * B)
    if plan == "unpadded":
        attention_mask = None  # no padding: no mask to build or apply
    if position_ids is None:  # given positions are the caller's (CDE's position-less prefix has none)
        model.check_length(L)
    pos = torch.arange(L, device=x.device)[None] if position_ids is None else position_ids
    attention = {
        "position_embeddings": model.rope(pos),
        "attention_mask": key_padding_mask(attention_mask),
        "implementation": attention_function(model.config, x, False, output_attentions),
    }
    padding = (
        None if attention_mask is None or attention_mask.dim() == 4 else (attention_mask == 0)[..., None]
    )
    return x, Layout(B, L, padding=padding), attention


def _padding_free(model, x, attention_mask, position_ids, lengths: list[int]):
    """Gather the real tokens of a padded batch into one sequence (attention confined to each sequence);
    for the CPU's grouped attention the rows are packed longest first, so that its groups are slices."""
    B, L = x.shape[:2]
    implementation = attention_function(model.config, x, True, False)
    rows = length_order(lengths) if implementation == "neobert_grouped" else list(range(B))
    reorder = torch.tensor(rows, device=x.device) if rows != list(range(B)) else None
    mask = attention_mask.bool() if reorder is None else attention_mask.bool()[reorder]
    lengths = [lengths[i] for i in rows]
    # nonzero_static: the count is known on the host already, so no second sync for the output size
    indices = torch.nonzero_static(mask.flatten(), size=sum(lengths)).flatten()
    if reorder is not None:  # positions in the reordered grid -> the caller's grid
        indices = reorder[indices // L] * L + indices % L
    # a token keeps its column as position, as in the padded layout (RoPE is relative: left padding
    # shifts every position of a row alike and changes nothing)
    pos = torch.arange(L, device=x.device) if position_ids is None else position_ids
    pos = pos.expand(B, L).flatten()[indices]
    attention = _packed_attention(model, x, pos, lengths, implementation)
    return x.flatten(0, 1)[indices][None], Layout(B, L, indices=indices), attention


def _packed_input(model, x, position_ids, cu_k, bounds: list[int]):
    """Input already packed by a flattening collator: (1, T) with sequence boundaries (read on the host)."""
    B, T = x.shape[:2]
    if B != 1:
        raise ValueError(f"packed input must have batch size 1, got {B}")
    if cu_k is not None and cu_k.shape != (len(bounds),):
        raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q (NeoBERT is self-attention only)")
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if not bounds or bounds[0] != 0 or bounds[-1] != T or any(n < 0 for n in lengths):
        raise ValueError(f"cu_seq_lens_q {bounds} does not describe {T} packed tokens")
    if position_ids is None:
        position_ids = torch.cat([torch.arange(n, device=x.device) for n in lengths])[None]
    return x, Layout(1, T), _packed_attention(model, x, position_ids[0], lengths)


def _packed_attention(model, x, pos, lengths: list[int], implementation: str | None = None) -> dict:
    """The attention arguments of packed sequences: the standard flash keywords, and the grouped function's
    plan (:func:`length_groups`)."""
    for n in lengths:
        model.check_length(n)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(x.device, non_blocking=True)
    implementation = implementation or attention_function(model.config, x, True, False)
    groups, order = length_groups(lengths, x.device) if implementation == "neobert_grouped" else ((), None)
    longest = max([0, *lengths])
    return {
        "position_embeddings": model.rope(pos),
        "attention_mask": None,
        "implementation": implementation,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
        "groups": groups,
        "order": order,
    }
