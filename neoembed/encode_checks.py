"""What ``EmbeddingModel.encode`` (:mod:`neoembed.sentence`) checks around sentence-transformers' own encode:
items that are not strings, texts the model truncates (counted with the prompt they are encoded with), the shape
of an empty result, and NaN or inf embeddings (found before quantization turns them into codes)."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "NonFiniteEmbeddingError",
    "TruncationWarning",
    "check_encodable",
    "check_finite",
    "check_items",
    "check_truncate_dim",
    "count_truncated",
    "empty_result",
    "say_truncated",
    "warn_truncation",
]


class TruncationWarning(UserWarning):
    """Texts longer than the model's ``max_seq_length`` were truncated. A class of neoembed's own, so that the
    command line prints it as neoembed's plain "warning: ..." line whichever library called ``encode``."""


class NonFiniteEmbeddingError(FloatingPointError):
    """Raised when an encoder returns NaN or inf embeddings (typically float16 overflow)."""


def check_items(items: Sequence) -> None:
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise TypeError(f"encode() takes strings; item {i} is {type(item).__name__}: {str(item)[:80]!r}")


def check_encodable(items: Sequence[str]) -> None:
    """A ``ValueError`` naming the first item that is not valid Unicode text (a lone surrogate, as a bad
    decode with ``errors="surrogateescape"`` leaves), which the tokenizer refuses without naming it."""
    for i, item in enumerate(items):
        try:
            item.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"encode() takes valid Unicode text; item {i} holds {item[e.start:e.end]!r} at position {e.start} "
                f"({e.reason}): {item[:80]!r}"
            ) from None


def check_truncate_dim(value, width: int | None, loaded: int | None = None) -> int:
    """``value`` as an int within 1..``width`` (the dimensions the model embeds at); else a ``ValueError``
    naming it: a negative value would slice dimensions off the end, 0 would give empty embeddings and a value
    beyond the width none of the narrowing asked for. ``loaded``: the ``truncate_dim`` the model was loaded
    with, named when it is what bounds ``value``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"truncate_dim must be a whole number of dimensions (e.g. 16), not {value!r} "
            f"({type(value).__name__}): pass an int, or None for the full width"
        )
    if value < 1 or (width is not None and value > width):
        what = (
            f"the width this model was loaded with (truncate_dim={loaded}; load without it for more)"
            if loaded is not None
            else "the model's embedding dimension"
        )
        raise ValueError(f"truncate_dim {value} is outside 1..{width or 'the width'}, {what}")
    return int(value)


def count_truncated(tokenizer, texts: Sequence[str], limit: int | None, prompt: str | None = None) -> int:
    """How many of ``texts``, after ``prompt``, have more than ``limit`` tokens (0 without a limit)."""
    if not limit:
        return 0
    prompt = prompt or ""
    # a WordPiece/BPE token covers at least one character, so only long strings can overflow
    candidates = [prompt + t for t in texts if len(prompt) + len(t) + 2 > limit]
    if not candidates:
        return 0
    lengths = tokenizer(
        candidates, add_special_tokens=True, truncation=False, return_length=True, verbose=False
    )["length"]
    return sum(int(n) > limit for n in lengths)


def warn_truncation(tokenizer, texts: Sequence[str], limit: int | None, prompt: str | None) -> None:
    """One :class:`TruncationWarning` when any of ``texts``, after ``prompt``, has more than ``limit`` tokens."""
    too_long = count_truncated(tokenizer, texts, limit, prompt)
    say_truncated(too_long, limit, " with their prompt" if prompt else "", stacklevel=4)


def say_truncated(count: int, limit: int | None, which: str = "", stacklevel: int = 3) -> None:
    """One :class:`TruncationWarning` for ``count`` texts (``which``: what they are, e.g. " scored") longer than
    ``limit`` tokens; nothing for 0. A caller that encodes in parts counts each part's and says the total once."""
    if count:
        warnings.warn(
            f"{count} text(s){which} exceed max_seq_length={limit} tokens and are truncated "
            "(raise the model's max_seq_length to keep more: max_length in a recipe, --max-length on the "
            "command line)",
            TruncationWarning,
            stacklevel=stacklevel,
        )


#: bytes per stored value and dtype of each sentence-transformers precision (binary: 8 dimensions a byte)
_PRECISIONS = {
    "float32": (1, np.float32),
    "int8": (1, np.int8),
    "uint8": (1, np.uint8),
    "binary": (8, np.int8),
    "ubinary": (8, np.uint8),
}


def empty_result(width: int, precision: str, convert_to_tensor: bool, convert_to_numpy: bool):
    """What encoding no text returns: shape (0, the width the call would give), in its precision's dtype."""
    per_byte, dtype = _PRECISIONS.get(precision or "float32", (1, np.float32))
    width = -(-width // per_byte)
    if convert_to_tensor:
        return torch.from_numpy(np.empty((0, width), dtype=dtype))
    if convert_to_numpy:
        return np.empty((0, width), dtype=dtype)
    return []


def check_finite(out: Any) -> None:
    tensors = out if isinstance(out, list) else [out]
    for t in tensors:
        if isinstance(t, dict):  # token embeddings and the like: sentence-transformers' per-text outputs
            check_finite([v for v in t.values() if isinstance(v, (torch.Tensor, np.ndarray))])
            continue
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            bad = not bool(torch.isfinite(t).all())
        elif isinstance(t, np.ndarray) and np.issubdtype(t.dtype, np.floating):
            bad = not bool(np.isfinite(t).all())
        else:
            continue
        if bad:
            raise NonFiniteEmbeddingError(
                "the encoder returned NaN or inf embeddings. With float16 this is usually an overflow: load the "
                "model with dtype='bf16' (same range as float32) or dtype='fp32'."
            )
