"""The NeoBERT backbone. Importing this registers it with transformers' Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM

from neoembed.modeling.configuration_neobert import NeoBERTConfig
from neoembed.modeling.modeling_neobert import NeoBERTForMaskedLM, NeoBERTModel

AutoConfig.register("neobert", NeoBERTConfig, exist_ok=True)
AutoModel.register(NeoBERTConfig, NeoBERTModel, exist_ok=True)
AutoModelForMaskedLM.register(NeoBERTConfig, NeoBERTForMaskedLM, exist_ok=True)

__all__ = ["NeoBERTConfig", "NeoBERTForMaskedLM", "NeoBERTModel"]
