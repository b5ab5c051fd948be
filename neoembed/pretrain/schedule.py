"""NeoBERT's learning-rate schedule (Section 3.3): linear warm-up, cosine decay to 10% over 90% of the steps,
then constant.

With peak ``p``, warm-up ``W`` and total steps ``T`` (``t`` counts optimizer steps from 0)::

    lr(t) = p * t / W                                                   t < W
    lr(t) = p * (0.1 + 0.9 * 0.5 * (1 + cos(pi * (t - W) / (0.9 T - W))))   W <= t < 0.9 T
    lr(t) = 0.1 * p                                                     t >= 0.9 T

For T = 1M and W = 2,000 this is the paper's "decay over 90% of the steps, then constant for the last 100k".
``decay_fraction`` (0.9) and ``final_ratio`` (0.1) are recipe settings.
"""

from __future__ import annotations

import math

__all__ = ["lr_at", "lr_lambda"]


def lr_at(
    t: int, peak: float, warmup: int, total: int, decay_fraction: float = 0.9, final_ratio: float = 0.1
) -> float:
    """The learning rate at optimizer step ``t``."""
    end = decay_fraction * total
    if end <= warmup:
        raise ValueError(
            f"the decay must end after the warm-up: decay_fraction * steps = {end:g} <= warmup_steps = {warmup}; "
            "lower warmup_steps or raise steps"
        )
    if t < warmup:
        return peak * t / warmup
    if t < end:
        cosine = 0.5 * (1.0 + math.cos(math.pi * (t - warmup) / (end - warmup)))
        return peak * (final_ratio + (1.0 - final_ratio) * cosine)
    return peak * final_ratio


def lr_lambda(warmup: int, total: int, decay_fraction: float = 0.9, final_ratio: float = 0.1):
    """The schedule as a multiplier of the peak, for ``torch.optim.lr_scheduler.LambdaLR``."""
    lr_at(0, 1.0, warmup, total, decay_fraction, final_ratio)  # validate now, not at the first step

    def factor(t: int) -> float:
        return lr_at(t, 1.0, warmup, total, decay_fraction, final_ratio)

    return factor
