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

__all__ = ["NeoBERTConfig", "NeoBERTForMaskedLM", "NeoBERTModel", "__version__", "load"]


def load(name_or_path, *args, **kwargs):
    """Load an embedding model as a SentenceTransformer; see :func:`neoembed.sentence.load`.

    (A thin wrapper so that ``import neoembed`` does not import sentence-transformers.)
    """
    from neoembed.sentence import load as _load

    return _load(name_or_path, *args, **kwargs)
