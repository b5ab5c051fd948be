"""Two-stage GradCache: the gradient of full backpropagation through both CDE stages at the memory of one chunk.

One training step of the contextual model reads N context documents (first stage → E), then B queries and
B (1 + k) documents through the second stage given E. Backpropagating through all of it at once holds the
activations of N + B (2 + k) sequences. Instead:

1. first stage without gradient, chunk by chunk → E;
2. second stage without gradient on query and document chunks given E → embeddings;
3. the loss on the detached embeddings; backward → the gradient of every embedding (cached);
4. second stage again, chunk by chunk, *with* gradient (the random state of step 2 replayed, so dropout masks
   are the same), backpropagating the cached gradients: accumulates the second stage's gradients and E's;
5. first stage again, chunk by chunk, with gradient, backpropagating E's gradient.

The result is the gradient of full backpropagation (same loss, same gradients up to float rounding; tested for
chunk sizes 1, 2 and the whole batch) — Gao et al. 2021's GradCache extended through the context.

Across processes, each stage is one module for DDP (:func:`stages`): the first stage's parameters are reached only
by step 5's backward passes, the second stage's only by step 4's, so one DDP wrapper per stage reduces each in its
buckets once a step, its replays under ``no_sync`` but the last (what DDP does for gradient accumulation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = [
    "ContextStage",
    "RandomState",
    "TextStage",
    "full_backprop_step",
    "stages",
    "two_stage_gradcache_step",
]

Batch = dict[str, Tensor]


class RandomState:
    """The CPU and CUDA random states at construction, to replay a forward pass with the same dropout."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    @contextmanager
    def replay(self):
        devices = list(range(len(self.cuda))) if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state_all(self.cuda)
            yield


def _chunks(batch: Batch, size: int):
    n = batch["input_ids"].shape[0]
    for start in range(0, n, size):
        yield (
            start,
            {
                k: (v[start : start + size] if torch.is_tensor(v) and v.dim() > 0 else v)
                for k, v in batch.items()
            },
        )


def _use_context(module, e: Tensor, dropped: Tensor | None) -> Tensor:
    """E with the step's dropped slots replaced by the learned null context (differentiable in both)."""
    if dropped is None or not bool(dropped.any()):
        return e
    return torch.where(dropped[:, None], module.null_context.to(e.dtype).expand_as(e), e)


def _texts(module, batch: Batch, context: Tensor) -> Tensor:
    return module.embed_texts(
        batch["input_ids"], batch["attention_mask"], context, batch.get("prompt_length")
    )


class ContextStage(nn.Module):
    """The first stage as one module (``first_stage`` and ``context_mlp``): context documents -> E."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.first_stage, self.context_mlp = model.first_stage, model.context_mlp
        self._model = (model,)  # a tuple, not a submodule: the model's other parameters belong to TextStage

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self._model[0].embed_context(input_ids, attention_mask)


class TextStage(nn.Module):
    """The second stage as one module (``second_stage``, the context's norm, the soft prompt, the null context,
    the output MLP): batches of texts given E -> their embeddings."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.second_stage, self.context_norm, self.output_mlp = (
            model.second_stage,
            model.context_norm,
            model.output_mlp,
        )
        self.soft_prompt, self.null_context = model.soft_prompt, model.null_context
        self._model = (model,)

    def forward(self, batches: list[Batch], context: Tensor, dropped: Tensor | None = None) -> list[Tensor]:
        model = self._model[0]
        used = _use_context(model, context, dropped)
        return [_texts(model, batch, used) for batch in batches]


def stages(
    model: nn.Module, wrap: Callable[[nn.Module], nn.Module] | None = None
) -> tuple[nn.Module, nn.Module]:
    """``(ContextStage, TextStage)`` of a CDE model, each passed through ``wrap`` (e.g. a DDP constructor).
    Refuses a model with a trainable parameter in neither stage or in both (DDP would not reduce it, or twice)."""
    first, second = ContextStage(model), TextStage(model)
    ids = [{id(p) for p in stage.parameters() if p.requires_grad} for stage in (first, second)]
    trainable = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    missing = [trainable[i] for i in trainable.keys() - ids[0] - ids[1]]
    shared = [trainable[i] for i in ids[0] & ids[1]]
    if missing or shared:
        raise ValueError(
            f"the CDE model's trainable parameters must each belong to exactly one stage; in none: {missing}, "
            f"in both: {shared}"
        )
    return (first, second) if wrap is None else (wrap(first), wrap(second))


def _unwrapped(stage: nn.Module) -> nn.Module:
    return getattr(stage, "module", stage)  # DDP's wrapped module; no-gradient passes need no reducer


def _sync_unless(last: bool, stage: nn.Module):
    """DDP's ``no_sync`` for every backward of a step but its last (no-op without DDP)."""
    no_sync = getattr(stage, "no_sync", None)
    return contextlib.nullcontext() if last or no_sync is None else no_sync()


def full_backprop_step(
    module,
    context: Batch,
    queries: Batch,
    documents: Batch,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    dropped: Tensor | None = None,
    model_stages: tuple[nn.Module, nn.Module] | None = None,
) -> Tensor:
    """The reference: both stages with gradient at once; ``loss.backward()``; returns the detached loss.
    ``model_stages``: :func:`stages` of ``module`` (DDP-wrapped across processes); default unwrapped."""
    first, second = model_stages or stages(module)
    e = first(context["input_ids"], context["attention_mask"])
    q, d = second([queries, documents], e, dropped)  # one forward of the stage: one DDP reduction
    loss = loss_fn(q, d)
    loss.backward()
    return loss.detach()


def two_stage_gradcache_step(
    module,
    context: Batch,
    queries: Batch,
    documents: Batch,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    chunk_size: int,
    dropped: Tensor | None = None,
    backward: Callable[[Tensor], None] | None = None,
    model_stages: tuple[nn.Module, nn.Module] | None = None,
) -> Tensor:
    """Steps 1–5 above; gradients accumulate into ``module``'s parameters. Returns the detached loss.

    ``backward`` (default ``Tensor.backward``) runs each surrogate backward, e.g. ``accelerator.backward``.
    ``model_stages``: :func:`stages` of ``module``; DDP-wrapped ones reduce on each stage's last backward.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    run_backward = backward or (lambda t: t.backward())
    first, second = model_stages or stages(module)

    # 1. first stage without gradient
    ctx_states, parts = [], []
    with torch.no_grad():
        for _, chunk in _chunks(context, chunk_size):
            ctx_states.append(RandomState())
            parts.append(_unwrapped(first)(chunk["input_ids"], chunk["attention_mask"]))
    e = torch.cat(parts)

    # 2. second stage without gradient
    text_states: dict[str, list[RandomState]] = {"q": [], "d": []}
    embeddings: dict[str, Tensor] = {}
    with torch.no_grad():
        for key, batch in (("q", queries), ("d", documents)):
            out = []
            for _, chunk in _chunks(batch, chunk_size):
                text_states[key].append(RandomState())
                out.extend(_unwrapped(second)([chunk], e, dropped))
            embeddings[key] = torch.cat(out)

    # 3. loss on detached embeddings → cached gradients
    q = embeddings["q"].detach().requires_grad_()
    d = embeddings["d"].detach().requires_grad_()
    loss = loss_fn(q, d)
    loss.backward()
    grads = {"q": q.grad, "d": d.grad}

    # 4. second stage with gradient against the cached gradients; accumulates E's gradient
    e_leaf = e.detach().requires_grad_()
    replays = [
        (key, start, chunk)
        for key, batch in (("q", queries), ("d", documents))
        for start, chunk in _chunks(batch, chunk_size)
    ]
    states = text_states["q"] + text_states["d"]
    for i, ((key, start, chunk), state) in enumerate(zip(replays, states, strict=True)):
        with _sync_unless(i == len(replays) - 1, second):
            with state.replay():
                (out,) = second([chunk], e_leaf, dropped)
            g = grads[key][start : start + out.shape[0]]
            run_backward((out * g.to(out.dtype)).sum())

    # 5. first stage with gradient against E's gradient (every process runs it: its last backward reduces)
    e_grad = e_leaf.grad if e_leaf.grad is not None else torch.zeros_like(e_leaf)
    chunks = list(_chunks(context, chunk_size))
    for i, ((start, chunk), state) in enumerate(zip(chunks, ctx_states, strict=True)):
        with _sync_unless(i == len(chunks) - 1, first):
            with state.replay():
                part = first(chunk["input_ids"], chunk["attention_mask"])
            g = e_grad[start : start + part.shape[0]]
            run_backward((part * g.to(part.dtype)).sum())
    return loss.detach()
