"""Counts what a training process sends between processes, per optimizer step, without touching the trainers.

Installed at interpreter start by this folder's ``sitecustomize.py`` (when ``NEOEMBED_PROBE_DIR`` is set):

- every ``torch.distributed`` collective (all_reduce, all_gather, broadcast, reduce_scatter, ... by name) is
  wrapped: calls and bytes are counted, the outermost call only (``all_gather_object`` calls ``all_gather``);
  an all-reduce of a parameter's ``.grad`` is tagged ``grad`` (CDE's loop reduces gradients one tensor at a time);
- every ``DistributedDataParallel`` gets a communication hook that counts its buckets and their bytes and then
  does what DDP does without a hook (``allreduce_hook``); the all-reduce it issues is tagged ``ddp_bucket``;
- a global optimizer step hook closes each step's window (window k: the collectives after step k-1's update up
  to step k's; window 1 also holds the set-up) and times it;
- with ``NEOEMBED_PROBE_GRADS=1``, every parameter's gradient at the first optimizer step (after reduction, before
  the update) is saved beside the counts (``grads-rank<R>.pt``).

At exit a process that took at least one optimizer step writes ``rank<R>-<pid>.json`` into the folder.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
import weakref
from pathlib import Path

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
    "gather_object", "scatter_object_list", "barrier", "monitored_barrier",
)  # fmt: skip

# collectives whose second argument is what this process sends (the first: the output, or the process group)
_SENT_SECOND = (
    "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "_broadcast_coalesced",
)  # fmt: skip

_state = {"events": [], "steps": 0, "step_times": [], "params": None, "optimizers": [], "folder": None}
_local = threading.local()


def _bytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_bytes(v) for v in value)
    return 0


def _is_grad(tensor) -> bool:
    for ref in _state["optimizers"]:
        opt = ref()
        if opt is None:
            continue
        for group in opt.param_groups:
            if any(p.grad is tensor for p in group["params"]):
                return True
    return False


def _wrap(name: str, fn):
    def counted(*args, **kwargs):
        depth = getattr(_local, "depth", 0)
        if depth == 0:
            first = args[0] if args else next(iter(kwargs.values()), None)
            kind = getattr(_local, "tag", None) or (
                "grad" if name == "all_reduce" and _is_grad(first) else ""
            )
            # the bytes this process contributes: the input tensor (the output list of all_gather is its size x N)
            sent = _bytes(args[1] if name in _SENT_SECOND and len(args) > 1 else first)
            _state["events"].append({"step": _state["steps"] + 1, "op": name, "kind": kind, "bytes": sent})
        _local.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _local.depth = depth

    counted._neoembed_counted = True
    return counted


def _counting_hook(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    _state["events"].append(
        {"step": _state["steps"] + 1, "op": "ddp_hook", "kind": "bucket", "bytes": _bytes(bucket.buffer())}
    )
    _local.tag = "ddp_bucket"
    try:
        return allreduce_hook(None, bucket)
    finally:
        _local.tag = None


def _patch_ddp() -> None:
    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.register_comm_hook(None, _counting_hook)

    DistributedDataParallel.__init__ = __init__


def _patch_optimizers() -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    init = torch.optim.Optimizer.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _state["optimizers"].append(weakref.ref(self))

    torch.optim.Optimizer.__init__ = __init__
    _state["t0"] = time.perf_counter()

    def pre(optimizer, args, kwargs):
        if _state["params"] is None:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
            _state["params"] = {"tensors": len(params), "bytes": _bytes(params)}
        if _state["steps"] == 0 and os.environ.get("NEOEMBED_PROBE_GRADS") == "1":
            _save_grads(optimizer)

    def post(optimizer, args, kwargs):
        now = time.perf_counter()
        _state["step_times"].append(now - _state["t0"])
        _state["t0"], _state["steps"] = now, _state["steps"] + 1

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)


def _save_grads(optimizer) -> None:
    """Every trainable parameter's gradient by its position in the optimizer (names are not known here), zeros
    where there is none (a parameter the step did not reach: one process leaves it None, DDP fills in zeros)."""
    import torch

    grads = [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for g in optimizer.param_groups
        for p in g["params"]
        if p.requires_grad
    ]
    torch.save(grads, Path(_state["folder"]) / f"grads-rank{_rank()}.pt")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _write() -> None:
    if not _state["steps"]:
        return
    out = {
        "rank": _rank(),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "steps": _state["steps"],
        "step_times": _state["step_times"],
        "params": _state["params"],
        "events": _state["events"],
    }
    path = Path(_state["folder"]) / f"rank{_rank()}-{os.getpid()}.json"
    path.write_text(json.dumps(out))


def install(folder: str) -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _state["folder"] = folder
    for name in COLLECTIVES:
        fn = getattr(c10d, name, None)
        if fn is None or hasattr(fn, "_neoembed_counted"):
            continue
        counted = _wrap(name, fn)
        setattr(c10d, name, counted)  # torch's own callers look it up here
        if getattr(dist, name, None) is fn:
            setattr(dist, name, counted)
    coalesced = getattr(dist, "_broadcast_coalesced", None)  # DDP's parameter broadcast when it wraps a model
    if coalesced is not None and not hasattr(coalesced, "_neoembed_counted"):
        dist._broadcast_coalesced = _wrap("_broadcast_coalesced", coalesced)
    _patch_ddp()
    _patch_optimizers()
    atexit.register(_write)
