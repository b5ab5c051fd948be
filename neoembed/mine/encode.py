"""A lean text encoder for mining: the same embeddings as ``SentenceTransformer.encode``, less Python per text.

Profiled on CPU (a one-layer NeoBERT, 22,000 short texts, ``cProfile`` with CPU time), ``encode`` spent about half
its time outside the model: transformers' tokenizer wrapper turning the Rust tokenizer's lists into tensors
through a Python ``flatten`` (~1/3), sentence-transformers' per-text modality detection, and neoembed's
truncation check, which tokenizes long texts a second time (here the Rust tokenizer's own overflow
record counts them). For the plain text pipeline (Transformer, Pooling,
optional Normalize: what every bi-encoder neoembed trains or loads is) this module calls the Rust tokenizer
directly, pads each batch with numpy and runs the modules' own ``forward``, in ``encode``'s order (longest text
first) and with its padding, so that the embeddings are the same. Any other model goes through ``encode``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["ForkedWorkers", "fast_encode", "fast_encode_supported"]


def fast_encode_supported(model) -> bool:
    """Whether ``model`` is the plain text pipeline :func:`fast_encode` reproduces."""
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

    modules = list(model)
    if not modules or type(modules[0]) is not Transformer or len(modules) > 3:
        return False
    if len(modules) < 2 or type(modules[1]) is not Pooling:
        return False
    if len(modules) == 3 and type(modules[2]) is not Normalize:
        return False
    transformer = modules[0]
    tokenizer = getattr(model, "tokenizer", None)
    return (
        getattr(tokenizer, "_tokenizer", None) is not None  # a Rust ("fast") tokenizer
        and set(getattr(transformer, "modality_config", {"text": None})) == {"text"}
        and not getattr(transformer, "do_lower_case", False)
        and getattr(transformer, "query_expansion", None) is None
        and not getattr(transformer, "processing_kwargs", None)
        and bool(model.max_seq_length)
        and not (hasattr(model, "_can_flatten_inputs") and model._can_flatten_inputs())  # packed batches
    )


def _backend(model):
    """A private copy of the model's Rust tokenizer that truncates as ``encode`` does and never pads."""
    from tokenizers import Tokenizer

    hf = model.tokenizer
    backend = Tokenizer.from_str(hf._tokenizer.to_str())
    backend.no_padding()
    backend.enable_truncation(
        max_length=int(model.max_seq_length), strategy="longest_first", direction=hf.truncation_side
    )
    return backend


def fast_encode(
    model, texts: Sequence[str], batch_size: int, normalize: bool = True, on_batch: Callable[[int], None] | None = None
) -> np.ndarray:
    """Embeddings of ``texts`` (float32, one row per text, input order), as ``model.encode(texts, prompt="",
    batch_size=batch_size, normalize_embeddings=normalize)`` computes them; ``model`` must satisfy
    :func:`fast_encode_supported`. ``on_batch(n)`` is called after each batch with its number of texts (progress)."""
    import torch

    hf, backend = model.tokenizer, _backend(model)
    pad_id = hf.pad_token_id if hf.pad_token_id is not None else 0
    left = hf.padding_side == "left"
    order = np.argsort([-len(t) for t in texts], kind="stable")  # encode's order: longest text first
    out = np.empty((len(texts), model.get_embedding_dimension()), dtype=np.float32)
    truncated = 0
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            rows = order[start : start + batch_size]
            encodings = backend.encode_batch([texts[i] for i in rows], add_special_tokens=True)
            truncated += sum(bool(e.overflowing) for e in encodings)
            features = _pad(encodings, pad_id, left, "token_type_ids" in hf.model_input_names)
            features = {k: torch.from_numpy(v).to(model.device) for k, v in features.items()}
            emb = model({**features, "modality": "text"})["sentence_embedding"].float()
            if normalize:
                emb = torch.nn.functional.normalize(emb, p=2, dim=1)
            out[rows] = emb.cpu().numpy()
            if on_batch is not None:
                on_batch(len(rows))
    if truncated:
        warnings.warn(
            f"{truncated} text(s) exceed max_seq_length={model.max_seq_length} tokens and are truncated "
            "(raise --max-length to keep more)",
            stacklevel=2,
        )
    if not np.isfinite(out).all():
        raise FloatingPointError(
            "the model produced NaN or inf embeddings while mining; check the checkpoint (a fine-tuning run that "
            "diverged?) or load it in float32"
        )
    return out


def _pad(encodings, pad_id: int, left: bool, with_type_ids: bool) -> dict[str, np.ndarray]:
    width = max(len(e.ids) for e in encodings)
    ids = np.full((len(encodings), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(encodings), width), dtype=np.int64)
    types = np.zeros((len(encodings), width), dtype=np.int64)
    for r, e in enumerate(encodings):
        n = len(e.ids)
        cols = slice(width - n, width) if left else slice(0, n)
        ids[r, cols], mask[r, cols], types[r, cols] = e.ids, e.attention_mask, e.type_ids
    features = {"input_ids": ids, "attention_mask": mask}
    if with_type_ids:
        features["token_type_ids"] = types
    return features


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
        self, texts: Sequence[str], batch_size: int, on_batch: Callable[[int], None] | None = None
    ) -> np.ndarray:
        """The embeddings of ``texts`` in order; ``on_batch(n)`` reports the texts the children finished, about
        twice a second."""
        import multiprocessing

        global _FORKED  # read by the forked children: what they inherit is the parent's memory at the fork
        context = multiprocessing.get_context("fork")
        bounds = np.linspace(0, len(texts), min(self.workers, max(1, len(texts))) + 1).astype(int)
        done = context.Value("q", 0)  # texts embedded so far, shared with the children
        _FORKED = (self.model, texts, batch_size, done)
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
    model, texts, batch_size, done = _FORKED

    def count(n: int) -> None:
        with done.get_lock():
            done.value += n

    return fast_encode(model, texts[bounds[0] : bounds[1]], batch_size, on_batch=count)
