"""neoembed: turn NeoBERT (or any encoder) into a state-of-the-art embedding model.

Importing the package registers NeoBERT with transformers' Auto classes (``AutoConfig``, ``AutoModel``,
``AutoModelForMaskedLM``,
``AutoModelForSequenceClassification``, ``AutoModelForTokenClassification``), so official and neoembed checkpoints load without ``trust_remote_code``.
Importing needs neither CUDA, flash-attn, faiss nor a compiler.
"""

from neoembed._version import __version__
from neoembed.modeling import (  # registers the Auto classes
    NeoBERTConfig,
    NeoBERTForMaskedLM,
    NeoBERTForSequenceClassification,
    NeoBERTForTokenClassification,
    NeoBERTModel,
)

__all__ = [
    "NeoBERTConfig",
    "NeoBERTForMaskedLM",
    "NeoBERTForSequenceClassification",
    "NeoBERTForTokenClassification",
    "NeoBERTModel",
    "__version__",
    "load",
]


def load(name_or_path, *args, **kwargs):
    """Load an embedding model (bi-encoder or CDE) as a SentenceTransformer; see :func:`neoembed.loading.load`.

    (A thin wrapper so that ``import neoembed`` does not import sentence-transformers. The package root is the
    top floor of the import graph: modules inside the package never import it, see ``docs/architecture.md``.)
    """
    from neoembed.loading import load as _load

    return _load(name_or_path, *args, **kwargs)
