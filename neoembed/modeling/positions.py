"""How long an input a model's positions take: one rule for ``neoembed.load`` / ``neoembed mteb --max-length``
(the loaded model's config) and ``neoembed train``'s ``max_length`` (config.json, before the model loads)."""

from __future__ import annotations

from types import SimpleNamespace

from neoembed.modeling.configuration_neobert import NeoBERTConfig

__all__ = ["position_limit"]


def position_limit(config) -> tuple[int | None, bool]:
    """The longest input the model of ``config`` (a config object, or a config.json read as a dict before the model
    loads) takes, and whether a longer one fails: learned absolute positions (``max_position_embeddings``: BERT,
    MiniLM, RoBERTa) embed no token past their table; NeoBERT's rotary positions have no table and extrapolate past
    the length it supports (``max_length`` times its RoPE scaling's factor, e.g. YaRN's)."""
    if isinstance(config, dict):
        neobert = config.get("model_type") == "neobert"
        config = NeoBERTConfig.from_dict(config) if neobert else SimpleNamespace(**config)
    if getattr(config, "model_type", None) == "neobert":  # its max_position_embeddings aliases max_length
        return config.max_sequence_length, False
    positions = getattr(config, "max_position_embeddings", None)
    return (positions, True) if isinstance(positions, int) else (None, False)
