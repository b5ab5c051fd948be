"""A lean text encoder for mining: the same embeddings as ``SentenceTransformer.encode``, less Python per text.

Profiled on CPU (a one-layer NeoBERT, 22,000 short texts, ``cProfile`` with CPU time), ``encode`` spent about half
its time outside the model: transformers' tokenizer wrapper turning the Rust tokenizer's lists into tensors
through a Python ``flatten`` (~1/3), sentence-transformers' per-text modality detection, and neoembed's
truncation check, which tokenizes long texts a second time (here the Rust tokenizer's own overflow
record counts them). For the plain text pipeline (Transformer, Pooling,
optional Normalize: what every bi-encoder neoembed trains or loads is) this module calls the Rust tokenizer
directly, pads (or packs) each batch with numpy and runs the modules' own ``forward``, in ``encode``'s order
(longest text first) and with its padding, so that the embeddings are the same; that loop, and the token-budget
batches ``neoembed mine --max-batch-tokens`` fills, live in :mod:`neoembed.batching`, which ``neoembed mteb`` and
``neoembed score`` encode through too. Any other model goes through ``encode``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["ForkedWorkers", "fast_encode", "fast_encode_supported"]


def fast_encode_supported(model) -> bool:
    """Whether ``model`` is the plain text pipeline :func:`fast_encode` reproduces
    (:func:`neoembed.batching.lean_supported`)."""
    from neoembed.batching import lean_supported

    return lean_supported(model)


def fast_encode(
    model,
    texts: Sequence[str],
    batch_size: int,
    normalize: bool = True,
    on_batch: Callable[[int], None] | None = None,
    max_batch_tokens: int | None = None,
    on_truncated: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Embeddings of ``texts`` (float32, one row per text, input order), as ``model.encode(texts, prompt="",
    batch_size=batch_size, normalize_embeddings=normalize)`` computes them (or with ``max_batch_tokens=N``,
    in batches filled to ``N`` tokens: :mod:`neoembed.batching`); ``model`` must satisfy
    :func:`fast_encode_supported`. ``on_batch(n)`` is called after each batch with its number of texts (progress);
    ``on_truncated(n)``, when given, with the number of texts truncated, instead of a warning."""
    from neoembed.batching import lean_encode

    if len(texts) == 0:
        return np.empty((0, model.get_embedding_dimension()), dtype=np.float32)
    out = lean_encode(
        model,
        texts,
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        normalize=normalize,
        on_batch=on_batch,
        on_truncated=on_truncated,
    )
    out = out.float().numpy()
    if not np.isfinite(out).all():
        raise FloatingPointError(
            "the model produced NaN or inf embeddings while mining; check the checkpoint (a fine-tuning run that "
            "diverged?) or load it in float32"
        )
    return out


class ForkedWorkers:
    """``workers`` CPU processes for :func:`fast_encode`, forked from this one, so that they start with the model
    already loaded: no process imports torch or reads the checkpoint again (sentence-transformers' pool spawns
    fresh interpreters, which took minutes on a busy 2-core machine). Each ``encode`` forks, splits the texts in
    contiguous parts, one per process at one torch thread, and joins the parts in order. POSIX only."""

    def __init__(self, model, workers: int):
        self.model, self.workers = model, int(workers)

    @staticmethod
    def available() -> bool:
        import multiprocessing

        return "fork" in multiprocessing.get_all_start_methods()

    def encode(
        self,
        texts: Sequence[str],
        batch_size: int,
        on_batch: Callable[[int], None] | None = None,
        max_batch_tokens: int | None = None,
        on_truncated: Callable[[int], None] | None = None,
    ) -> np.ndarray:
        """The embeddings of ``texts`` in order; ``on_batch(n)`` reports the texts the children finished, about
        twice a second; ``on_truncated(n)`` the texts they truncated, at the end (else each child warns)."""
        import multiprocessing

        global _FORKED  # read by the forked children: what they inherit is the parent's memory at the fork
        context = multiprocessing.get_context("fork")
        bounds = np.linspace(0, len(texts), min(self.workers, max(1, len(texts))) + 1).astype(int)
        done = context.Value("q", 0)  # texts embedded so far, shared with the children
        cut = context.Value("q", 0) if on_truncated is not None else None  # texts truncated, likewise
        _FORKED = (self.model, texts, batch_size, max_batch_tokens, done, cut)
        try:
            with context.Pool(len(bounds) - 1) as pool:
                result = pool.map_async(
                    _encode_part, list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))
                )
                reported = 0
                while not result.ready() or reported < done.value:
                    result.wait(0.5)
                    if on_batch is not None and done.value > reported:
                        on_batch(done.value - reported)
                    reported = done.value
                parts = result.get()
        finally:
            _FORKED = None
        if cut is not None:
            on_truncated(cut.value)
        return (
            np.concatenate(parts)
            if parts
            else np.empty((0, self.model.get_embedding_dimension()), np.float32)
        )


_FORKED = None


def _encode_part(bounds: tuple[int, int]) -> np.ndarray:
    import torch

    # one thread per process; and an OpenMP thread pool started by the parent does not survive the fork
    torch.set_num_threads(1)
    model, texts, batch_size, max_batch_tokens, done, cut = _FORKED

    def count(n: int, total=done) -> None:
        with total.get_lock():
            total.value += n

    part = texts[bounds[0] : bounds[1]]
    cuts = None if cut is None else (lambda n: count(n, cut))
    return fast_encode(
        model, part, batch_size, on_batch=count, max_batch_tokens=max_batch_tokens, on_truncated=cuts
    )
