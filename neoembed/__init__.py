"""neoembed: turn NeoBERT (or any encoder) into a state-of-the-art embedding model.

``import neoembed`` is light: it imports neither torch nor transformers, so the command line starts at once.
NeoBERT is registered with transformers' Auto classes (``AutoConfig``, ``AutoModel``, ``AutoModelForMaskedLM``,
``AutoModelForSequenceClassification``, ``AutoModelForTokenClassification``) as soon as transformers' Auto
module loads in a process that imported neoembed (or at once, if it already has), so official and neoembed
checkpoints load without ``trust_remote_code`` in either order of imports. ``neoembed.NeoBERTModel`` and the
other model classes, and ``neoembed.load``, import what they need when first used. Importing needs neither
CUDA, flash-attn, faiss nor a compiler.
"""

import importlib.abc
import importlib.util
import sys

from neoembed._version import __version__

_MODEL_CLASSES = (
    "NeoBERTConfig",
    "NeoBERTForMaskedLM",
    "NeoBERTForSequenceClassification",
    "NeoBERTForTokenClassification",
    "NeoBERTModel",
)

__all__ = [*_MODEL_CLASSES, "__version__", "load"]

_AUTO = "transformers.models.auto"


def __getattr__(name: str):
    if name in _MODEL_CLASSES:
        from neoembed import modeling

        return getattr(modeling, name)
    raise AttributeError(f"module 'neoembed' has no attribute {name!r}")


def load(name_or_path, *args, **kwargs):
    """Load an embedding model (bi-encoder or CDE) as a SentenceTransformer; see :func:`neoembed.loading.load`.

    (A thin wrapper so that ``import neoembed`` does not import sentence-transformers. The package root is the
    top floor of the import graph: modules inside the package never import it, see ``docs/architecture.md``.)
    """
    from neoembed.loading import load as _load

    return _load(name_or_path, *args, **kwargs)


def _register() -> None:
    try:
        from neoembed import modeling  # noqa: F401  (its import registers the Auto classes)
    except ImportError:  # no torch: transformers works without models, and so does this
        pass


class _RegisterWithAutoClasses(importlib.abc.MetaPathFinder):
    """Registers NeoBERT once transformers' Auto module has loaded and the import that loaded it is complete.

    transformers loads its Auto module from inside other modules' initialisation (``modeling_utils`` ->
    quantizers -> ``models.auto``), and NeoBERT's model classes need those modules whole: so every
    ``transformers.*`` import is watched, and registration waits until none is executing."""

    def __init__(self) -> None:
        self.depth = 0

    def find_spec(self, fullname, path, target=None):
        if fullname.partition(".")[0] != "transformers":
            return None
        spec = next(
            (s for f in sys.meta_path if f is not self and (s := _spec(f, fullname, path, target))), None
        )
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            self.depth += 1
            try:
                run(module)
            finally:
                self.depth -= 1
            if self.depth == 0 and _AUTO in sys.modules and self in sys.meta_path:
                sys.meta_path.remove(self)
                _register()

        spec.loader.exec_module = exec_module
        return spec


def _spec(finder, fullname, path, target):
    find = getattr(finder, "find_spec", None)
    return find(fullname, path, target) if find is not None else None


if _AUTO in sys.modules:
    _register()
elif not any(isinstance(f, _RegisterWithAutoClasses) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithAutoClasses())
