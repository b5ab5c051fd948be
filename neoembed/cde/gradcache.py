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
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["RandomState", "full_backprop_step", "two_stage_gradcache_step"]

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


def full_backprop_step(
    module,
    context: Batch,
    queries: Batch,
    documents: Batch,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    dropped: Tensor | None = None,
) -> Tensor:
    """The reference: both stages with gradient at once; ``loss.backward()``; returns the detached loss."""
    e = module.embed_context(context["input_ids"], context["attention_mask"])
    e = _use_context(module, e, dropped)
    loss = loss_fn(_texts(module, queries, e), _texts(module, documents, e))
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
) -> Tensor:
    """Steps 1–5 above; gradients accumulate into ``module``'s parameters. Returns the detached loss.

    ``backward`` (default ``Tensor.backward``) runs each surrogate backward, e.g. ``accelerator.backward``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    run_backward = backward or (lambda t: t.backward())

    # 1. first stage without gradient
    ctx_states, parts = [], []
    with torch.no_grad():
        for _, chunk in _chunks(context, chunk_size):
            ctx_states.append(RandomState())
            parts.append(module.embed_context(chunk["input_ids"], chunk["attention_mask"]))
    e = torch.cat(parts)

    # 2. second stage without gradient
    text_states: dict[str, list[RandomState]] = {"q": [], "d": []}
    embeddings: dict[str, Tensor] = {}
    with torch.no_grad():
        used = _use_context(module, e, dropped)
        for key, batch in (("q", queries), ("d", documents)):
            out = []
            for _, chunk in _chunks(batch, chunk_size):
                text_states[key].append(RandomState())
                out.append(_texts(module, chunk, used))
            embeddings[key] = torch.cat(out)

    # 3. loss on detached embeddings → cached gradients
    q = embeddings["q"].detach().requires_grad_()
    d = embeddings["d"].detach().requires_grad_()
    loss = loss_fn(q, d)
    loss.backward()
    grads = {"q": q.grad, "d": d.grad}

    # 4. second stage with gradient against the cached gradients; accumulates E's gradient
    e_leaf = e.detach().requires_grad_()
    for key, batch in (("q", queries), ("d", documents)):
        for (start, chunk), state in zip(_chunks(batch, chunk_size), text_states[key], strict=True):
            with state.replay():
                out = _texts(module, chunk, _use_context(module, e_leaf, dropped))
            g = grads[key][start : start + out.shape[0]]
            run_backward((out * g.to(out.dtype)).sum())

    # 5. first stage with gradient against E's gradient
    if e_leaf.grad is not None:
        for (start, chunk), state in zip(_chunks(context, chunk_size), ctx_states, strict=True):
            with state.replay():
                part = module.embed_context(chunk["input_ids"], chunk["attention_mask"])
            g = e_leaf.grad[start : start + part.shape[0]]
            run_backward((part * g.to(part.dtype)).sum())
    return loss.detach()
