"""neoembed: turn NeoBERT (or any encoder) into a state-of-the-art embedding model.

Importing the package registers NeoBERT with transformers' Auto classes (``AutoConfig``, ``AutoModel``,
``AutoModelForMaskedLM``), so official and neoembed checkpoints load without ``trust_remote_code``.
Importing needs neither CUDA, flash-attn, faiss nor a compiler.
"""

__version__ = "0.1.0"

from neoembed.modeling import (  # noqa: E402  (registers the Auto classes)
    NeoBERTConfig,
    NeoBERTForMaskedLM,
    NeoBERTModel,
)

__all__ = ["NeoBERTConfig", "NeoBERTForMaskedLM", "NeoBERTModel", "__version__"]
