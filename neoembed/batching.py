"""Encoding batches: texts sorted by length, cut by count or filled to a token budget, run by one loop.

``neoembed mteb``, ``neoembed mine`` and ``neoembed score`` all encode through here (``mteb`` and ``score`` by
``EmbeddingModel.encode(..., max_batch_tokens=N)``, ``mine`` by its lean encoder), so a batch is sized the same way
everywhere:

* **count batches** (sentence-transformers' ``encode``): the texts sorted longest first, ``batch_size`` at a time.
  A fixed count is a bad fit for mixed lengths: 32 documents of 4,096 tokens are 64 times the tokens of 32
  sentences of 64, so the count that fits the longest documents starves the GPU on the sentences.
* **token-budget batches** (``max_batch_tokens=N``): the texts sorted longest first by their real token count
  (after truncation to ``max_seq_length``), each batch filled while its cost stays within ``N``. The cost is what
  the forward holds: ``rows x longest row`` for a padded batch, the sum of the lengths for a packed one (NeoBERT's
  padding-free path). Peak activation memory is then bounded by ``N`` whatever the order or mix of the texts.
  A budget below the longest text is refused (a text cannot be split).

Embeddings come back in input order and equal count batches' within float32 rounding (rows are independent:
padding is masked, packed sequences attend within themselves).

**Packed, fixed-size batches (for CUDA graphs).** Where NeoBERT runs padding-free, a batch is not padded to
``(B, L)``: its tokens are packed into one ``(1, T)`` row with ``position_ids`` and ``cu_seq_lens_q``, the input
transformers' ``DataCollatorWithFlattening`` emits and NeoBERT and sentence-transformers' ``Pooling`` read
without re-padding. On CUDA the row is padded to exactly ``T = max_batch_tokens`` with filler sequences of pad
tokens (each no longer than the batch's longest text, so that they cost no more attention than its texts),
whose embeddings are dropped: every batch of a run has the same token shape, which is what a CUDA graph needs.
To capture one later, also fix the two remaining host-dependent sizes: pad ``cu_seq_lens_q`` to a fixed number
of entries by repeating its last value (zero-length sequences, which the varlen kernels skip) and pass
``max_seqlen = max_seq_length``; then the forward of one ``(1, max_batch_tokens)`` batch can be captured once
and replayed for every batch. On CPU the row is not padded (the filler would be computed for nothing).

**Lean path.** For the plain text pipeline (Transformer, Pooling, optional Normalize, a Rust tokenizer: every
bi-encoder neoembed trains or loads) each text is tokenized once, by the Rust tokenizer, and batches are padded
or packed with numpy from those token ids; the lengths the budget is filled with are those same ids. Any other
model (a CDE model, an ONNX Runtime folder, a Router) is measured with its tokenizer, then each batch goes
through the model's own ``preprocess``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "DEFAULT_MAX_BATCH_TOKENS",
    "MAX_BATCH_TOKENS_OPTION",
    "check_max_batch_tokens",
    "count_batches",
    "default_max_batch_tokens",
    "encode_token_budget",
    "lean_encode",
    "lean_supported",
    "pack_features",
    "pad_features",
    "rust_tokenizer",
    "token_budget_batches",
    "uses_packed_batches",
]

#: tokens per batch by device type. CPU: about what batch 32 holds for long documents (32 x 256), and several
#: hundred sentences a batch (measured: benchmarks/scale_encode.py, at least count batches' speed); CUDA: 8 x
#: CPU's (64 x 512 tokens), the size where a 250M encoder's matmuls are large enough to keep a GPU busy.
DEFAULT_MAX_BATCH_TOKENS = {"cpu": 8192, "cuda": 65536}
MAX_BATCH_TOKENS_OPTION = "--max-batch-tokens"


def default_max_batch_tokens(device: Any, max_seq_length: int | None = None) -> int:
    """The default token budget for a device (a ``torch.device`` or its name; other devices get CUDA's), raised
    to ``max_seq_length`` for a model whose longest text would not fit it."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    return max(DEFAULT_MAX_BATCH_TOKENS.get(kind, DEFAULT_MAX_BATCH_TOKENS["cuda"]), int(max_seq_length or 0))


def check_max_batch_tokens(value: int | None, option: str = MAX_BATCH_TOKENS_OPTION) -> int | None:
    """``value`` when it is a positive number of tokens (None: the device's default); else an error naming
    ``option``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(
            f"{option} {value!r}: give a positive number of tokens per batch (default "
            f"{DEFAULT_MAX_BATCH_TOKENS['cpu']} on CPU, {DEFAULT_MAX_BATCH_TOKENS['cuda']} on CUDA)"
        )
    return int(value)


def _longest_first(lengths: np.ndarray) -> np.ndarray:
    return np.argsort(-lengths, kind="stable")


def count_batches(lengths: Sequence[int], batch_size: int) -> list[np.ndarray]:
    """Row indices of each batch: longest first, ``batch_size`` at a time (sentence-transformers' ``encode``)."""
    order = _longest_first(np.asarray(lengths, dtype=np.int64))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def token_budget_batches(lengths: Sequence[int], max_tokens: int, packed: bool = False) -> list[np.ndarray]:
    """Row indices of each batch: longest first, each batch as full as ``max_tokens`` allows: ``rows x
    longest`` (padded) or the sum of the lengths (``packed``) within it. A text longer than the budget is an
    error (it would make a batch over the budget on its own)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    check_max_batch_tokens(max_tokens, "max_batch_tokens")
    if len(lengths) and int(lengths.max()) > max_tokens:
        raise ValueError(
            f"a text of {int(lengths.max())} tokens does not fit a batch of max_batch_tokens={max_tokens}: raise "
            f"{MAX_BATCH_TOKENS_OPTION} to at least the model's max_seq_length, or lower the max length"
        )
    order = _longest_first(lengths)
    sorted_lengths = lengths[order]
    ends = np.cumsum(sorted_lengths)
    batches, start = [], 0
    while start < len(order):
        if packed:
            before = int(ends[start - 1]) if start else 0
            stop = int(np.searchsorted(ends, before + max_tokens, side="right"))
        else:  # sorted longest first: the batch's first text sets its width
            stop = start + max_tokens // max(1, int(sorted_lengths[start]))
        stop = min(max(stop, start + 1), len(order))
        batches.append(order[start:stop])
        start = stop
    return batches


# ------------------------------------------------------------------------------------------- the lean path
def lean_supported(model) -> bool:
    """Whether ``model`` is the plain text pipeline the lean path reproduces: sentence-transformers'
    ``Transformer`` (text only, a Rust tokenizer, no lower-casing, query expansion or processing options),
    ``Pooling``, optional ``Normalize``."""
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
        and not (hasattr(model, "_can_flatten_inputs") and model._can_flatten_inputs())  # ST's own packing
    )


def uses_packed_batches(model) -> bool:
    """Whether ``model``'s encoder runs padding-free (NeoBERT's ``config.drops_padding``): its batches are then
    packed, and filled by their summed lengths."""
    first = model[0] if len(model) else None
    config = getattr(getattr(first, "auto_model", None), "config", None)
    return getattr(config, "model_type", None) == "neobert" and bool(getattr(config, "drops_padding", False))


def rust_tokenizer(model):
    """A private copy of the model's Rust tokenizer that truncates as ``encode`` does and never pads."""
    from tokenizers import Tokenizer

    hf = model.tokenizer
    backend = Tokenizer.from_str(hf._tokenizer.to_str())
    backend.no_padding()
    backend.enable_truncation(
        max_length=int(model.max_seq_length), strategy="longest_first", direction=hf.truncation_side
    )
    return backend


#: texts the Rust tokenizer encodes at a time: its Encoding objects (tokens, offsets, the overflowing rest of a
#: truncated text) take hundreds of bytes a token, so a whole shard of them held at once cost ~1 GB per 50,000
#: documents; only the ids (and type ids) are kept
_TOKENIZE_CHUNK = 2048


class _Ids(NamedTuple):
    """A text's token ids as :func:`pad_features` reads an Encoding (unpadded: every mask value is 1)."""

    ids: np.ndarray
    type_ids: np.ndarray
    attention_mask: int = 1


def _encoded_chunks(backend, texts: Sequence[str]):
    """``backend``'s (:func:`rust_tokenizer`) Encodings of ``texts``, :data:`_TOKENIZE_CHUNK` at a time."""
    for start in range(0, len(texts), _TOKENIZE_CHUNK):
        yield backend.encode_batch(list(texts[start : start + _TOKENIZE_CHUNK]), add_special_tokens=True)


def _encode_ids(backend, texts: Sequence[str]) -> tuple[list[_Ids], int]:
    """(each text's ids, how many texts were truncated), from ``backend`` (:func:`rust_tokenizer`) in chunks."""
    out, truncated = [], 0
    for chunk in _encoded_chunks(backend, texts):
        truncated += sum(bool(e.overflowing) for e in chunk)
        out += [_Ids(np.asarray(e.ids, np.int32), np.asarray(e.type_ids, np.int8)) for e in chunk]
    return out, truncated


def pad_features(encodings, pad_id: int, left: bool, with_type_ids: bool) -> dict[str, np.ndarray]:
    """A padded ``(B, L)`` batch (``input_ids``, ``attention_mask``, optional ``token_type_ids``)."""
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


def pack_features(
    token_ids: Sequence[Sequence[int]], pad_id: int, size: int | None = None
) -> dict[str, np.ndarray]:
    """A packed ``(1, T)`` batch: ``input_ids``, ``position_ids`` (0.. per sequence) and ``cu_seq_lens_q`` (the
    sequences' boundaries). With ``size``, ``T = size``: the free tokens are filled with sequences of pad tokens
    no longer than the longest text (their rows come after the texts' and are to be dropped)."""
    lengths = [len(t) for t in token_ids]
    used = sum(lengths)
    if size is not None and used > size:
        raise ValueError(f"{used} tokens do not fit a packed batch of {size}")
    free = 0 if size is None else size - used
    chunk = max([1, *lengths])
    fillers = [chunk] * (free // chunk) + ([free % chunk] if free % chunk else [])
    ids = np.full(used + free, pad_id, dtype=np.int64)
    if used:
        ids[:used] = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_ids])
    all_lengths = np.asarray(lengths + fillers, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(all_lengths)])
    positions = np.arange(used + free, dtype=np.int64) - np.repeat(starts[:-1], all_lengths)
    return {
        "input_ids": ids[None],
        "position_ids": positions[None],
        "cu_seq_lens_q": starts.astype(np.int32),
    }


# ------------------------------------------------------------------------------------------------ the loops
def _finish(emb, truncate_dim: int | None, normalize: bool, to_cpu: bool):
    import torch

    if truncate_dim is not None:
        emb = emb[..., :truncate_dim]
    if normalize:
        emb = torch.nn.functional.normalize(emb, p=2, dim=1)
    return emb.cpu() if to_cpu else emb


def _plan(lengths: Sequence[int], sort_keys: Sequence[int], batch_size, max_batch_tokens, packed: bool):
    if max_batch_tokens is None:
        return count_batches(sort_keys, batch_size)
    return token_budget_batches(lengths, max_batch_tokens, packed)


def lean_encode(
    model,
    texts: Sequence[str],
    *,
    batch_size: int = 32,
    max_batch_tokens: int | None = None,
    normalize: bool = True,
    truncate_dim: int | None = None,
    fixed_size: bool | None = None,
    to_cpu: bool = True,
    warn_truncation: bool = True,
    on_batch: Callable[[int], None] | None = None,
    on_truncated: Callable[[int], None] | None = None,
):
    """Embeddings of ``texts`` (one row each, input order; a tensor) through the lean path; ``model`` must
    satisfy :func:`lean_supported`. Count batches of ``batch_size`` (sorted by characters, as ``encode``
    sorts them: the same batches, padded as ``encode`` pads) unless ``max_batch_tokens`` is given: then
    token-budget batches, packed where the model runs padding-free, to exactly ``max_batch_tokens`` tokens
    when ``fixed_size`` (default: on CUDA). ``on_batch(n)`` after each batch of ``n`` texts; ``on_truncated(n)``
    gets the number of texts truncated, instead of the warning (a caller encoding in parts warns once)."""
    import torch

    hf, device = model.tokenizer, model.device
    pad_id = hf.pad_token_id if hf.pad_token_id is not None else 0
    encodings, truncated = _encode_ids(rust_tokenizer(model), texts)
    packed = max_batch_tokens is not None and uses_packed_batches(model)
    size = (
        max_batch_tokens if packed and (device.type == "cuda" if fixed_size is None else fixed_size) else None
    )
    lengths = [len(e.ids) for e in encodings]
    out = None
    with torch.inference_mode():
        for rows in _plan(lengths, [len(t) for t in texts], batch_size, max_batch_tokens, packed):
            if packed:
                features = pack_features([encodings[i].ids for i in rows], pad_id, size)
            else:
                with_types = "token_type_ids" in hf.model_input_names
                features = pad_features(
                    [encodings[i] for i in rows], pad_id, hf.padding_side == "left", with_types
                )
            features = {k: torch.from_numpy(v).to(device) for k, v in features.items()}
            emb = model({**features, "modality": "text"})["sentence_embedding"][: len(rows)]
            emb = _finish(emb, truncate_dim, normalize, to_cpu)
            if out is None:
                out = emb.new_empty((len(texts), emb.shape[1]))
            out[torch.as_tensor(rows, device=out.device)] = emb
            if on_batch is not None:
                on_batch(len(rows))
    if on_truncated is not None:
        on_truncated(truncated)
    elif warn_truncation:
        from neoembed.encode_checks import say_truncated

        say_truncated(truncated, model.max_seq_length)
    return out


def _token_lengths(model, texts: list[str]) -> list[int]:
    """Each text's token count as the model's tokenizer truncates it (the Rust tokenizer where there is one)."""
    tok = model.tokenizer
    if getattr(tok, "_tokenizer", None) is not None and model.max_seq_length:
        return [len(e.ids) for chunk in _encoded_chunks(rust_tokenizer(model), texts) for e in chunk]
    limit = {"truncation": True, "max_length": int(model.max_seq_length)} if model.max_seq_length else {}
    return [
        int(n)
        for n in tok(texts, add_special_tokens=True, return_length=True, verbose=False, **limit)["length"]
    ]


def encode_token_budget(
    model,
    inputs: list,
    max_batch_tokens: int,
    *,
    prompt: str | None = None,
    show_progress_bar: bool = False,
    save_to_cpu: bool = True,
    normalize_embeddings: bool = False,
    truncate_dim: int | None = None,
    device=None,
    **kwargs,
):
    """Sentence embeddings of ``inputs`` (a stacked tensor, input order) in token-budget batches: what
    ``EmbeddingModel.encode(..., max_batch_tokens=N)`` runs in place of sentence-transformers' count batches.
    The lean path where it applies, else each batch through the model's own ``preprocess`` and forward
    (``kwargs``, e.g. a CDE model's ``dataset_embeddings``, go to both)."""
    import torch
    from sentence_transformers.util import batch_to_device
    from tqdm.auto import tqdm

    check_max_batch_tokens(max_batch_tokens, "max_batch_tokens")
    kwargs.pop("batch_size", None)  # the budget sizes the batches
    texts = all(isinstance(t, str) for t in inputs)
    include_prompt = getattr(model[1], "include_prompt", True) if len(model) > 1 else True
    bar = tqdm(total=len(inputs), desc="Batches", unit="text", disable=not show_progress_bar)
    finish = dict(truncate_dim=truncate_dim, to_cpu=save_to_cpu)
    if texts and not kwargs and lean_supported(model) and (not prompt or include_prompt) and device is None:
        model.eval()
        full = [prompt + t for t in inputs] if prompt else list(inputs)
        out = lean_encode(
            model,
            full,
            max_batch_tokens=max_batch_tokens,
            normalize=normalize_embeddings,
            warn_truncation=False,
            on_batch=bar.update,
            **finish,
        )
        bar.close()
        return out
    if not texts:
        raise TypeError("max_batch_tokens sizes batches of texts: encode other inputs with batch_size")
    device = (
        model._resolve_inference_device(device)
        if hasattr(model, "_resolve_inference_device")
        else model.device
    )
    model.eval()
    lengths = _token_lengths(model, [(prompt or "") + t for t in inputs])
    out = None
    with torch.inference_mode():
        for rows in token_budget_batches(lengths, max_batch_tokens, packed=False):
            features = model.preprocess([inputs[i] for i in rows], prompt=prompt, **kwargs)
            emb = model(batch_to_device(features, device), **kwargs)["sentence_embedding"]
            emb = _finish(emb, truncate_dim, normalize_embeddings, save_to_cpu)
            if out is None:
                out = emb.new_empty((len(inputs), emb.shape[1]))
            out[torch.as_tensor(rows, device=out.device)] = emb
            bar.update(len(rows))
    bar.close()
    return out
