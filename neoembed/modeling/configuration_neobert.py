# Copyright 2026 the neoembed developers. MIT License.
"""NeoBERT configuration (Le Breton et al., 2025, "NeoBERT: A Next-Generation BERT").

This file and ``modeling_neobert.py`` hold the whole model. They import only torch and transformers and
are copied next to every saved model, so that a saved folder loads with ``trust_remote_code=True`` where
neoembed is not installed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from transformers import PretrainedConfig

try:  # transformers >= 5: RoPE settings live in one `rope_parameters` mapping
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
except ImportError:  # pragma: no cover - older transformers
    ROPE_INIT_FUNCTIONS = {}

try:  # transformers >= 5 builds configs as strict dataclasses
    from huggingface_hub.dataclasses import strict
except ImportError:  # pragma: no cover - older huggingface_hub
    strict = None
if strict is None or not dataclasses.is_dataclass(PretrainedConfig):  # transformers < 5: a plain class

    def strict(cls):  # type: ignore[no-redef]
        return cls


#: Version of the neoembed checkpoint layout written by ``save_pretrained``.
NEOEMBED_FORMAT_VERSION = 1

ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")

#: Written into every saved config.json: the two files copied beside the weights.
NEOEMBED_AUTO_MAP = {
    "AutoConfig": "configuration_neobert.NeoBERTConfig",
    "AutoModel": "modeling_neobert.NeoBERTModel",
    "AutoModelForMaskedLM": "modeling_neobert.NeoBERTForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_neobert.NeoBERTForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_neobert.NeoBERTForTokenClassification",
}


@strict
class NeoBERTConfig(PretrainedConfig):
    r"""Configuration of a NeoBERT encoder.

    Defaults are those of the released NeoBERT (250M parameters: 28 layers of width 768, 12 heads,
    SwiGLU, pre-RMSNorm, RoPE, 4,096 tokens, 30,522-token uncased WordPiece vocabulary).

    Args:
        vocab_size: size of the token vocabulary.
        hidden_size: model width ``d``.
        num_hidden_layers: number of encoder blocks.
        num_attention_heads: attention heads; ``hidden_size`` must be divisible by it.
        intermediate_size: nominal feed-forward width; the SwiGLU hidden size is
            ``8 * ceil(int(2 * intermediate_size / 3) / 8)`` (as in the official model).
        norm_eps: epsilon of the RMSNorm layers.
        max_length: longest sequence the model was trained on (the official key; also readable as
            ``max_position_embeddings``). Longer input runs with a warning; a RoPE scaling with ``factor`` s
            extends the supported length to ``s * max_length`` (``max_sequence_length``).
        rope_parameters: transformers' RoPE mapping: ``rope_type`` (``"default"``, or a scaling transformers
            defines: ``"yarn"``, ``"linear"``, ``"dynamic"``, ...), ``rope_theta`` (the base, 10,000) and the
            scaling's own keys, e.g. ``{"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}`` (YaRN's
            ``beta_fast`` 32 / ``beta_slow`` 1 / ``attention_factor`` default as in the paper;
            ``original_max_position_embeddings`` defaults to ``max_length``). Folders written before this key
            existed, with ``rope_theta`` and ``rope_scaling={"type": "yarn", "factor": s, ...}``, and the keyword
            ``rope_scaling=`` itself, are read into it.
        padding_free: drop padding inside the model (tokens of all sequences packed into one sequence for
            every linear layer, attention confined to each sequence) and return padded outputs.
        pad_token_id: id of ``[PAD]``.
        embedding_init_range / decoder_init_range: bounds of the uniform initialisation of embeddings and
            linear layers (official keys).
        classifier_init_range: standard deviation of the normal initialisation of the classification heads'
            linear layers (official key and rule).
        classifier_dropout: dropout of the classification heads (the official 0.1; the encoder has none).
    """

    model_type = "neobert"
    attribute_map = {"max_position_embeddings": "max_length", "rms_norm_eps": "norm_eps"}

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 28
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    norm_eps: float = 1e-5
    max_length: int = 4096
    rope_parameters: dict | None = None
    padding_free: bool = True
    pad_token_id: int | None = 0
    embedding_init_range: float = 0.02
    decoder_init_range: float = 0.02
    classifier_init_range: float = 0.02
    classifier_dropout: float = 0.1
    neoembed_format: int = NEOEMBED_FORMAT_VERSION
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs: Any):
        # Official extra keys: accepted, checked for consistency, not kept.
        dim_head = kwargs.pop("dim_head", None)
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if dim_head is not None and dim_head != self.hidden_size // self.num_attention_heads:
            raise ValueError(
                f"inconsistent config: dim_head={dim_head} but hidden_size / num_attention_heads = "
                f"{self.hidden_size // self.num_attention_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"RoPE needs an even head dimension, got {self.head_dim}")
        official_kwargs = kwargs.pop("kwargs", None)
        if official_kwargs not in (None, {}) and not isinstance(official_kwargs, dict):
            raise ValueError(f"official 'kwargs' key must be a mapping, got {official_kwargs!r}")
        auto_map = kwargs.pop("auto_map", None)
        if auto_map is not None and not isinstance(auto_map, dict):
            raise ValueError(f"'auto_map' must be a mapping, got {auto_map!r}")
        # An official auto_map names the official remote code (model.py); this class is ours, so the config
        # always points at the two bundled files (transformers needs the attribute to load them remotely).
        self.auto_map = dict(NEOEMBED_AUTO_MAP)
        for key in ("max_position_embeddings",):
            if key in kwargs:
                self.max_length = int(kwargs.pop(key))
        if not 0.0 <= self.classifier_dropout < 1.0:
            raise ValueError(f"classifier_dropout must lie in [0, 1), got {self.classifier_dropout}")
        if self.max_length <= 0:
            raise ValueError(f"max_length must be positive, got {self.max_length}")
        legacy = kwargs.pop("rope_scaling", None)
        if legacy is not None:
            if self.rope_parameters:
                raise ValueError(
                    "pass the RoPE settings once: rope_parameters (transformers 5) or the older rope_scaling"
                )
            self.rope_parameters = _from_rope_scaling(legacy)
        if self.rope_parameters is not None:
            self.rope_parameters = dict(self.rope_parameters)  # standardisation edits it in place
        # transformers standardises: rope_theta (kwarg or old config.json key) moves into rope_parameters,
        # rope_type defaults to "default", scalings get original_max_position_embeddings = max_length
        super().__post_init__(**kwargs)
        _check_rope_type(self.rope_parameters)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn_hidden_size(self) -> int:
        """SwiGLU hidden size: ``8 * ceil(int(2 * intermediate_size / 3) / 8)``."""
        return 8 * math.ceil(int(2 * self.intermediate_size / 3) / 8)

    @property
    def drops_padding(self) -> bool:
        """Whether a padded batch runs packed, its padding dropped inside the model: ``padding_free`` with an
        attention other than eager, or flash attention (outputs with attention weights always run padded)."""
        implementation = self._attn_implementation or "sdpa"
        return implementation == "flash_attention_2" or (self.padding_free and implementation != "eager")

    @property
    def rope_type(self) -> str:
        return (self.rope_parameters or {}).get("rope_type", "default")

    @property
    def max_sequence_length(self) -> int:
        """Longest supported input: ``max_length``, times the RoPE scaling's factor when there is one."""
        factor = (self.rope_parameters or {}).get("factor")
        if self.rope_type == "default" or factor is None:
            return self.max_length
        return int(self.max_length * factor)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["auto_map"] = dict(NEOEMBED_AUTO_MAP)
        return out


def _from_rope_scaling(scaling: dict) -> dict:
    """An older ``rope_scaling`` mapping (``{"type": "yarn", "factor": s, "beta_fast": 32.0, "beta_slow": 1.0,
    "attention_factor": None}``, as neoembed wrote it) as ``rope_parameters``: ``type`` becomes ``rope_type``,
    unset (None) values are dropped so that transformers' defaults apply, the same ones as before."""
    if not isinstance(scaling, dict):
        raise ValueError(
            f"rope_scaling must be a mapping such as {{'type': 'yarn', 'factor': 2.0}}, got {scaling!r}"
        )
    params = {k: v for k, v in scaling.items() if v is not None and k != "type"}
    params.setdefault("rope_type", scaling.get("type", "default"))
    return params


def _check_rope_type(params: dict | None) -> None:
    kind = (params or {}).get("rope_type", "default")
    if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"unknown rope_parameters rope_type {kind!r}; valid: {['default', *sorted(ROPE_INIT_FUNCTIONS)]}"
        )
    factor = (params or {}).get("factor")
    if factor is not None and (not isinstance(factor, int | float) or factor < 1):
        raise ValueError(f"rope_parameters factor must be a number >= 1, got {factor!r}")


NeoBERTConfig.register_for_auto_class()

__all__ = ["ATTN_IMPLEMENTATIONS", "NEOEMBED_FORMAT_VERSION", "NeoBERTConfig"]
