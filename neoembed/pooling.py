"""The poolings a recipe or ``neoembed.load(pooling=...)`` may name (no import beyond the standard library, so
that a recipe validates before torch loads)."""

from __future__ import annotations

__all__ = ["POOLING_MODES", "pooling_mode", "pooling_name"]

#: pooling name (recipes, ``load(pooling=...)``) -> sentence-transformers' ``Pooling`` mode. A new pooling is one
#: entry here and its test (tests/test_sentence.py::test_cls_pooling_and_normalize, test_fixture_mean_pooling_matches_official_hidden_states).
POOLING_MODES = {
    "mean": "mean",  # the paper's "avg": mean over the non-padding tokens
    "cls": "cls",  # the first token's vector
}


def pooling_mode(name: str) -> str:
    """The sentence-transformers pooling mode of a registered pooling name; an error naming the valid ones."""
    if name not in POOLING_MODES:
        raise ValueError(f"unknown pooling {name!r}; valid: {sorted(POOLING_MODES)}")
    return POOLING_MODES[name]


def pooling_name(mode: str) -> str:
    """The registered name of a sentence-transformers pooling mode (the mode itself where none is registered)."""
    return next((name for name, m in POOLING_MODES.items() if m == mode), mode)
