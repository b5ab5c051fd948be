"""The results folder of one scored model: its identity (weights' checksums) and who may write it."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neoembed.hub import folder_label
from neoembed.record import atomic_write_text, file_sha256
from neoembed.runs.errors import OutputDirError
from neoembed.runs.folder import RECORD, _describe, check_inputs_outside, clear_folder

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


MODEL_RECORD = "scored_model.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def model_identity(model: str) -> dict[str, Any]:
    """What a results folder records about the model it scores: the path (resolved) and a SHA-256 over its weight
    files (checkpoint folders inside a run folder left out); a hub id is recorded by name."""
    path = Path(model)
    if not path.is_dir():
        return {"model": str(model), "weights_sha256": None}
    weights = _files_sha256(path, lambda f: f.suffix in WEIGHT_SUFFIXES)
    return {"model": str(path.resolve()), "weights_sha256": weights}


def _files_sha256(folder: Path, keep) -> str:
    """A SHA-256 over the files of ``folder`` that ``keep`` takes, each by its path there and its content;
    checkpoint folders inside a run folder (and hidden ones) left out."""
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        rel = f.relative_to(folder)
        if f.is_file() and keep(f) and not rel.parts[0].startswith(("checkpoint-", ".")):
            h.update(rel.as_posix().encode() + b"\0" + file_sha256(f).encode())
    return h.hexdigest()


#: the files beside the weights that decide what a model computes: its pipeline (modules, pooling and each module's
#: config.json, prompts), its configuration and its tokenizer
PIPELINE_FILES = frozenset({
    "modules.json", "config_sentence_transformers.json", "sentence_bert_config.json", "config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json", "merges.txt",
    "spiece.model", "sentencepiece.bpe.model",
})  # fmt: skip


def pipeline_sha256(model: str) -> str | None:
    """A SHA-256 over a model folder's :data:`PIPELINE_FILES` (checkpoint folders left out): with
    :func:`model_identity`'s weights, what a cache of the model's embeddings is keyed by (a pooling changed in
    place keeps the weights). None for a hub id. Results folders keep the weights alone, as they always did."""
    path = Path(model)
    return _files_sha256(path, lambda f: f.name in PIPELINE_FILES) if path.is_dir() else None


def model_fingerprint(name: str) -> dict[str, str | None]:
    """What a model computes beyond its name, for a cache key or a resume's check: a local folder's weights and
    pipeline files (retrained, or its pooling or tokenizer changed, in place it keeps its path), a hub id's commit
    in the cache (the packaged copy's by its hub id)."""
    from neoembed.hub import hub_reference, resolve_packaged

    path = resolve_packaged(name)
    weights, pipeline = model_identity(path)["weights_sha256"], pipeline_sha256(path)
    return {
        "revision": hub_reference(path)[1],
        "weights": weights[:16] if weights else None,
        "pipeline": pipeline[:16] if pipeline else None,
    }


def default_results_dir(model: str, root: str | Path = "results") -> Path:
    """``results/<name>-<8 hex digits of the model's resolved path>``: two models never share a default folder,
    even when both are called ``checkpoint-8``. The name is a local folder's label (a run's ``model`` or
    ``checkpoint-N`` folder named by its run: :func:`neoembed.hub.folder_label`), a hub id's last part; it keeps
    letters, digits, ``.``, ``_`` and ``-`` (a ``:``, as in ``packaged:all-MiniLM-L6-v2``, trips scp, rsync and
    Windows)."""
    local = Path(model).exists()
    key = str(Path(model).resolve()) if local else str(model)
    name = re.sub(r"[^\w.-]", "_", folder_label(model) if local else Path(str(model).rstrip("/")).name)
    return Path(root) / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def claim_results_dir(output: str | Path, model: str, overwrite: bool, write: bool = True) -> None:
    """A results folder holds the scores of one model: the first run records it (:data:`MODEL_RECORD`); a run
    of another model (another path, or the same path with other weights) is refused (exit 2), or with
    ``overwrite`` clears the folder first. A non-empty folder that records no model is refused likewise.
    ``write=False`` only checks (nothing is cleared or written)."""
    out = Path(output)
    identity = model_identity(model)
    record = out / MODEL_RECORD
    if out.is_dir() and any(out.iterdir()):
        check_inputs_outside(out, (model,), "results folder")
        try:
            saved = json.loads(record.read_text()) if record.is_file() else None
        except ValueError:
            saved = None
        if saved != identity:
            held = (
                f"the scores of {saved['model']} (weights {str(saved.get('weights_sha256'))[:12]})"
                if saved
                else f"{_describe(out)}, with no record of the model scored"
            )
            if not overwrite:
                raise OutputDirError(
                    f"results folder {out} holds {held}; this run scores {identity['model']} (weights "
                    f"{str(identity['weights_sha256'])[:12]}): choose another --output (the default is unique per "
                    "model), or --overwrite to replace those results"
                )
            if not (record.is_file() or (out / RECORD).is_file()):
                raise OutputDirError(
                    f"--overwrite: {out} holds {_describe(out)}, which no neoembed command wrote: choose another "
                    "--output"
                )
            if write:
                logger.warning("--overwrite: clearing %s (%s)", out, held)
                clear_folder(out)
    if write:
        atomic_write_text(record, json.dumps(identity, indent=2) + "\n")
