"""Masked language modelling: choose the positions to predict and corrupt the input.

NeoBERT (Le Breton et al., 2025, Section 3.2) masks 20% of the tokens and replaces every one of them by
``[MASK]``; BERT masks 15% and replaces 80% by ``[MASK]``, 10% by a random token and leaves 10% unchanged.
Both are available (``scheme="mask"`` / ``scheme="bert"``). Special tokens (``[CLS]``, ``[SEP]``, ``[PAD]``,
``[UNK]``, ``[MASK]``) and padding are never chosen; labels are ``-100`` everywhere else, so the loss counts
the chosen positions only.

Randomness comes from an explicit ``torch.Generator``: the trainer seeds one per step from (seed, step), so
that every process masks the same global batch identically and a resumed run masks exactly as the
uninterrupted one did.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["IGNORE_INDEX", "MaskingScheme", "mask_tokens", "step_generator"]

IGNORE_INDEX = -100
MaskingScheme = Literal["mask", "bert"]


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator seeded from (seed, step, stream) alone, so a step's randomness never depends on history."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step * 7_919 + stream * 104_729) % (2**63 - 1))


def mask_tokens(
    input_ids: torch.Tensor,
    special_ids: torch.Tensor | list[int],
    mask_token_id: int,
    vocab_size: int,
    rate: float = 0.2,
    scheme: MaskingScheme = "mask",
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrupt ``input_ids`` for masked language modelling.

    Args:
        input_ids: token ids of any shape (``(1, T)`` packed or ``(B, L)`` padded), on the CPU.
        special_ids: ids that are never masked (the tokenizer's special tokens, padding included).
        mask_token_id: id of ``[MASK]``.
        vocab_size: random replacements (``scheme="bert"``) are drawn from ``[0, vocab_size)``.
        rate: probability that an eligible token is chosen.
        scheme: ``"mask"`` (100% ``[MASK]``, NeoBERT) or ``"bert"`` (80% ``[MASK]`` / 10% random / 10% kept).
        generator: source of randomness.
        attention_mask: optional 0/1 mask; positions with 0 are never chosen.

    Returns:
        ``(corrupted_ids, labels)``: labels hold the original id at chosen positions and ``-100`` elsewhere.
    """
    if not 0.0 < rate < 1.0:
        raise ValueError(f"masking rate must lie in (0, 1), got {rate}; NeoBERT uses 0.2, BERT 0.15")
    if scheme not in ("mask", "bert"):
        raise ValueError(f"unknown masking scheme {scheme!r}; valid: 'mask' (NeoBERT), 'bert' (80/10/10)")
    special = torch.as_tensor(special_ids, dtype=input_ids.dtype)
    eligible = ~torch.isin(input_ids, special)
    if attention_mask is not None:
        eligible &= attention_mask.bool()
    draw = torch.rand(input_ids.shape, generator=generator)
    chosen = eligible & (draw < rate)
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    corrupted = input_ids.clone()
    if scheme == "mask":
        corrupted[chosen] = mask_token_id
        return corrupted, labels
    action = torch.rand(input_ids.shape, generator=generator)
    to_mask = chosen & (action < 0.8)
    to_random = chosen & (action >= 0.8) & (action < 0.9)
    corrupted[to_mask] = mask_token_id
    random_ids = torch.randint(vocab_size, input_ids.shape, generator=generator, dtype=input_ids.dtype)
    corrupted[to_random] = random_ids[to_random]
    return corrupted, labels
