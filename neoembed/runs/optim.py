"""The optimizer's parameter groups of every trainer, and its rates on resume."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn



def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices and embeddings, not on norms and biases."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def rates_from_schedule(scheduler) -> None:
    """Set the optimizer's rates to what ``scheduler`` (a ``LambdaLR``, as transformers' and the trainers' are)
    gives at its step. A checkpoint restores the rates the saved run's schedule gave; a resume with another
    ``steps`` has another schedule, which the first resumed step would otherwise miss. With the same schedule
    this recomputes the restored rates exactly."""
    from torch.optim.lr_scheduler import LambdaLR

    scheduler = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper holds the scheduler
    if not isinstance(scheduler, LambdaLR):
        return
    groups = scheduler.optimizer.param_groups
    for group, base, rate in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * rate(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]
