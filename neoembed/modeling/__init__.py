"""The NeoBERT backbone. Importing this registers it with transformers' Auto classes."""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from neoembed.modeling.configuration_neobert import NeoBERTConfig
from neoembed.modeling.modeling_neobert import (
    NeoBERTForMaskedLM,
    NeoBERTForSequenceClassification,
    NeoBERTForTokenClassification,
    NeoBERTModel,
)

AutoConfig.register("neobert", NeoBERTConfig, exist_ok=True)
AutoModel.register(NeoBERTConfig, NeoBERTModel, exist_ok=True)
AutoModelForMaskedLM.register(NeoBERTConfig, NeoBERTForMaskedLM, exist_ok=True)
AutoModelForSequenceClassification.register(NeoBERTConfig, NeoBERTForSequenceClassification, exist_ok=True)
AutoModelForTokenClassification.register(NeoBERTConfig, NeoBERTForTokenClassification, exist_ok=True)

__all__ = [
    "NeoBERTConfig",
    "NeoBERTForMaskedLM",
    "NeoBERTForSequenceClassification",
    "NeoBERTForTokenClassification",
    "NeoBERTModel",
]
