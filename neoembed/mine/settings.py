"""A mining run's settings (:class:`MineConfig`), the model kinds its roles take, and its output folder: what an
interrupted run stores so that ``--resume`` continues it only with the same card, corpus, model and settings."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from neoembed.hub import hub_reference, model_name, resolve_packaged
from neoembed.instructions import DEFAULT_TEMPLATE
from neoembed.recipe import StrictModel, Template
from neoembed.record import atomic_write_text, file_sha256
from neoembed.runs import OutputDirError, model_identity, pipeline_sha256, prepare_output_dir

__all__ = [
    "FILTER_SETTINGS",
    "SEARCH_SETTINGS",
    "MineConfig",
    "check_index_settings",
    "check_model_kind",
    "describe_changes",
    "fresh_folder",
    "model_kind",
    "nothing_left_on_refusal",
    "prepare_run_folder",
    "refuse_cde",
    "run_fingerprint",
    "temp_file",
]

logger = logging.getLogger(__name__)


class MineConfig(StrictModel):
    """Settings of a mining run (``neoembed mine --help`` gives the same as options)."""

    num_negatives: int = Field(5, ge=1)
    range_min: int = Field(0, ge=0)  # raw rank (0 = most similar document, positives included) ...
    range_max: int = Field(30, ge=1)  # ... up to, not including, this rank; also the search depth
    max_score: float | None = None
    margin: float | None = Field(None, ge=0)  # keep: score <= positive score - margin
    max_fraction: float | None = Field(0.95, gt=0, le=1)  # keep: score <= positive - (1 - f) * |pos|; 1: off
    duplicate_threshold: float = Field(0.98, gt=0, le=1)  # cosine to a positive at or above: a near-duplicate
    index: Literal["flat", "ivf", "hnsw", "ivfpq", "binary", "int8"] = "flat"
    # binary / int8 / ivfpq (lossy codes): the rescore x range_max nearest codes rescored exactly, k kept
    rescore: int = Field(4, ge=1)
    nlist: int | None = Field(None, ge=1)
    nprobe: int = Field(16, ge=1)
    hnsw_m: int = Field(32, ge=2)
    ef_search: int = Field(128, ge=1)
    pq_m: int = Field(16, ge=1)
    gpu: Literal["auto", "on", "off"] = "auto"
    shard_size: int = Field(50_000, ge=1)
    batch_size: int = Field(64, ge=1)  # unused: the token budget below sizes every encoding batch (warned)
    # tokens per encoding batch (None: the device's default, neoembed.batching); embeddings do not depend on it
    max_batch_tokens: int | None = Field(None, ge=1)
    search_batch: int = Field(4096, ge=1)
    pooling: Literal["mean", "cls"] | None = None  # None: a saved model's own, mean for a plain checkpoint
    max_length: int | None = Field(256, ge=8)
    template: Template = DEFAULT_TEMPLATE
    max_rows: int | None = Field(None, ge=1)
    cross_encoder: Annotated[str, AfterValidator(resolve_packaged)] | None = None
    cross_encoder_batch_size: int = Field(64, ge=1)
    workers: int = Field(
        1, ge=1
    )  # encoding processes: forked on CPU, one per GPU (sentence-transformers' pool)
    name: str | None = None  # of the written card; default <source card>_mined
    keep_embeddings: bool = False  # keep OUT/.mine (embeddings, candidates) after a finished run

    @field_validator("max_fraction")
    @classmethod
    def _fraction_one_is_off(cls, value: float | None) -> float | None:
        # 1 keeps every score up to the positive's and still drops those above it; it means "no filter" in
        # every form (option, --config, key=value), so it is turned off here, where each form is validated
        return None if value == 1 else value

    @model_validator(mode="after")
    def _ranges(self):
        if self.range_max <= self.range_min:
            raise ValueError(f"range_max ({self.range_max}) must be larger than range_min ({self.range_min})")
        if self.num_negatives > self.range_max - self.range_min:
            raise ValueError(
                f"num_negatives={self.num_negatives} cannot fit in ranks [{self.range_min}, {self.range_max}): "
                f"raise range_max to at least {self.range_min + self.num_negatives} or lower num_negatives"
            )
        return self


def model_kind(path: str | Path) -> tuple[str, str] | None:
    """What a local model folder is, as sentence-transformers' ``CrossEncoder`` itself tells: with
    ``modules.json``, the ``model_type`` of ``config_sentence_transformers.json`` (``SentenceTransformer`` when
    absent; only ``CrossEncoder`` is a cross-encoder, anything else is converted with a new, random score head);
    without it, a Hugging Face checkpoint whose ``architectures`` is a ``...ForSequenceClassification`` (the head
    a cross-encoder scores with) or an encoder without one. ``(kind, why)``, or None for a hub id or an
    unrecognised folder."""
    folder = Path(path)
    if (folder / "modules.json").is_file():
        st_config = folder / "config_sentence_transformers.json"
        model_type = "SentenceTransformer"
        if st_config.is_file():
            with contextlib.suppress(ValueError, OSError, AttributeError):
                model_type = json.loads(st_config.read_text()).get("model_type") or model_type
        kind = "cross-encoder" if model_type == "CrossEncoder" else "bi-encoder"
        return kind, f"a sentence-transformers {model_type} folder (modules.json)"
    if (folder / "config.json").is_file():
        with contextlib.suppress(ValueError, OSError, AttributeError):
            architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
            if any(str(a).endswith("ForSequenceClassification") for a in architectures):
                return "cross-encoder", f"a sequence-classification checkpoint ({', '.join(architectures)})"
            named = f" ({', '.join(architectures)})" if architectures else ""
            return "bi-encoder", f"an encoder checkpoint without a score head{named}"
    return None


def refuse_cde(path: str | Path, flag: str, wanted: str) -> None:
    """Refuse (ValueError, exit 2) a CDE folder before it loads: it embeds a text only against a corpus
    context, which mining and scoring do not give it."""
    from neoembed.cde.model import is_cde_folder  # torch: imported when a command runs, not for its --help

    if is_cde_folder(path):  # reads PATH/modules.json: False for a hub id
        raise ValueError(
            f"{flag} {path} is a CDE model: it embeds a text only against a corpus context, which mining and "
            f"scoring do not build. Pass {wanted} (neoembed mteb scores a CDE model)"
        )


def check_model_kind(path: str | Path, wanted: str, flag: str) -> None:
    """Refuse (ValueError, exit 2) a local model of the wrong kind for ``flag``'s role, before it loads: a
    cross-encoder built on a bi-encoder scores with a randomly initialised head, a bi-encoder built on a
    cross-encoder embeds with a backbone trained for another task, and a CDE model needs a context."""
    refuse_cde(path, flag, f"a {wanted}")
    found = model_kind(path)
    if found is None or found[0] == wanted:
        return
    kind, why = found
    if wanted == "cross-encoder":
        effect = "it has no trained score head: a cross-encoder built on it would score with a random one"
        fix = "a CrossEncoder folder or a ...ForSequenceClassification checkpoint"
    else:
        effect = "it reads a query and a document together and scores the pair; it embeds neither alone"
        fix = "a bi-encoder (a SentenceTransformer folder or an encoder checkpoint)"
    raise ValueError(f"{flag} {path} is a {kind}, {why}, not a {wanted}: {effect}. Pass {fix}")


#: settings that size or place the work, not its result: out of a run's fingerprint, and passed over in one
#: recorded before they were left out (``batch_size`` was in it until token budgets sized every batch)
NOT_IN_FINGERPRINT = frozenset({"workers", "keep_embeddings", "max_batch_tokens", "batch_size"})

#: settings that only choose among the stored search results (the filters, the cross-encoder that rescores them):
#: an interrupted run may resume with other values, so a run that kept no row is rerun without embedding again.
#: A finished run still compares them (its card was mined with its own)
FILTER_SETTINGS = frozenset(
    {
        "num_negatives",
        "range_min",
        "max_score",
        "margin",
        "max_fraction",
        "duplicate_threshold",
        "cross_encoder",
        "cross_encoder_batch_size",
    }
)


#: settings that only shape the search over the stored embeddings (range_max: its depth): an interrupted run may
#: resume with other values, which searches the stored embeddings again (stored search results are removed, never
#: reused). A finished run still compares them, as it does the filter settings
SEARCH_SETTINGS = frozenset(
    {"range_max", "index", "rescore", "nlist", "nprobe", "hnsw_m", "ef_search", "pq_m", "gpu", "search_batch"}
)


def check_index_settings(cfg: MineConfig, dim: int | None) -> None:
    """Refuse index settings the model's embedding width cannot take, once the model is loaded and before any
    text is embedded: faiss's own refusal came at the search, after the whole corpus was embedded."""
    if cfg.index == "ivfpq" and dim and dim % cfg.pq_m:
        fits = [d for d in range(1, min(dim, 64) + 1) if dim % d == 0]
        raise ValueError(
            f"--pq-m {cfg.pq_m} must divide the model's embedding dimension {dim} (--index ivfpq splits each "
            f"embedding in pq_m parts): pick one of {fits}"
        )


def run_fingerprint(src_path: Path, source, model, cfg: MineConfig, corpus, corpus_card) -> dict:
    """What an interrupted run must share with its resumption for the stored shards to be reusable.

    ``source``: the card and its folder. ``data`` knows the card's rows and data files (and the corpus card's)
    as ``neoembed train --resume`` knows them (:func:`~neoembed.data.cards.card_fingerprints`): a card file
    alone left an edited data file's texts mixed with the old embeddings."""
    from neoembed.data.cards import card_fingerprints

    def data_of(card_and_folder) -> str:
        return next(iter(card_fingerprints([card_and_folder]).values()))

    if corpus_card is not None:
        corpus_id = file_sha256(corpus_card[2])
    elif corpus is not None:
        h = hashlib.sha256()
        for text in corpus:  # one text at a time: a joined copy of a large corpus would double its memory
            h.update(text.encode("utf8") + b"\x00")
        corpus_id = h.hexdigest()
    else:
        corpus_id = None
    return {
        "card_sha256": file_sha256(src_path),
        "corpus": corpus_id,
        "data": {"card": data_of(source), "corpus": data_of(corpus_card[:2]) if corpus_card else None},
        "model": model_name(str(model)),  # the packaged copy by name, not this machine's site-packages path
        # a folder retrained (or its pooling changed) in place keeps its name, as a hub id moved to a new commit does:
        # the stored embeddings are the old model's
        "model_weights_sha256": model_identity(str(model))["weights_sha256"],
        "model_pipeline_sha256": pipeline_sha256(str(model)),
        "model_revision": hub_reference(str(model))[1],
        "settings": cfg.model_dump(exclude=set(NOT_IN_FINGERPRINT)),
        "rows": ROWS_MINED,
    }


#: which of the card's rows are mined: recorded since the rows without negatives of their own are mined too (a
#: run recorded before lost them, and its stored embeddings hold fewer queries and documents)
ROWS_MINED = "every row with a query and a positive"


def fresh_folder(out: Path) -> bool:
    """Whether ``out`` is absent or empty: a run that creates it removes it again when refused
    (:func:`nothing_left_on_refusal`). Asked before :func:`prepare_run_folder` creates it."""
    return not out.exists() or (out.is_dir() and not any(out.iterdir()))


@contextlib.contextmanager
def nothing_left_on_refusal(out: Path, state: Path, fresh: bool, errors=(ValueError, OSError)):
    """A refused run (mine, score) leaves nothing behind: its state folder, and ``out`` itself when this run created it."""
    try:
        yield
    except errors:
        shutil.rmtree(state, ignore_errors=True)
        if fresh and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise


@contextlib.contextmanager
def temp_file(path: Path):
    """A temporary file beside ``path``, to write and then rename onto it: removed when the write fails or is
    interrupted, and so are those an earlier process left there (named by its pid, which a resumed run has not)."""
    for stale in path.parent.glob(f".{glob.escape(path.name)}.tmp*"):
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def prepare_run_folder(
    out: Path,
    state: Path,
    name: str,
    fingerprint: dict,
    resume: bool,
    overwrite: bool,
    inputs: tuple = (),
    may_change: frozenset = frozenset(),
    redo: tuple[frozenset, tuple[str, ...]] = (frozenset(), ()),
) -> bool:
    """Create ``out`` for a fresh run, or check that ``resume`` continues the same run. True: already finished.

    The folder rules are every writer's (:func:`neoembed.runs.prepare_output_dir`: a non-empty folder needs
    ``--resume`` or ``--overwrite``, and ``--overwrite`` clears only a folder that ``neoembed mine`` wrote); on
    resume the settings must equal the interrupted run's, except those in ``may_change`` and ``redo``'s: settings
    that may change at the cost of the state files it names (and their checksums), removed so that the stage that
    wrote them runs again; the new settings are then recorded. ``inputs``: the card, its data and the model,
    which ``out`` may not hold."""
    settings = state / "settings.json"
    clearable = (f"{name}.yaml", f"{state.name}/{settings.name}")
    prepare_output_dir(
        out,
        overwrite=overwrite,
        resume=resume,
        checkpoints=False,
        what="--out",
        clearable=clearable,
        inputs=inputs,
    )
    if resume and not settings.is_file():
        if (out / f"{name}.yaml").is_file():
            _check_finished_run(out / f"{name}.yaml", fingerprint)
            return True
        raise OutputDirError(f"--resume: {out} holds no interrupted mining run ({settings} is missing)")
    if resume:
        try:
            saved = json.loads(settings.read_text())
        except (UnicodeDecodeError, ValueError) as e:
            raise OutputDirError(
                f"--resume: {settings}, the interrupted run's settings, is unreadable ({e}): pass --overwrite "
                "(instead of --resume) to start again, or choose a new --out"
            ) from None
        saved = _in_current_terms(saved if isinstance(saved, dict) else {}, fingerprint, out)
        free = may_change | redo[0]
        changed = describe_changes(_without(saved, free), _without(fingerprint, free))
        if changed:
            fix = "resume with the original settings, or mine into a new folder"
            raise OutputDirError(
                f"--resume: the run in {out} was started with other settings ({changed}); "
                + (_DATA_CHANGED if "data." in changed else _MODEL_CHANGED if "model_" in changed else fix)
            )
        # everything else is equal (checked above): what differs beyond may_change is redo's settings
        redone = describe_changes(_without(saved, may_change), _without(fingerprint, may_change))
        if redone:
            logger.warning("--resume with other search settings (%s): what is stored is searched again", redone)
            for file in redo[1]:
                for path in (state / file, state / f"{file}.sha256"):
                    path.unlink(missing_ok=True)
            atomic_write_text(settings, json.dumps(fingerprint, indent=1, sort_keys=True))
        return False
    state.mkdir(parents=True, exist_ok=True)
    atomic_write_text(settings, json.dumps(fingerprint, indent=1, sort_keys=True))
    return False


def _without(fingerprint: dict, keys: frozenset) -> dict:
    settings = fingerprint.get("settings")
    if not keys or not isinstance(settings, dict):
        return fingerprint
    return {**fingerprint, "settings": {k: v for k, v in settings.items() if k not in keys}}


def _check_finished_run(card: Path, fingerprint: dict) -> None:
    """``--resume`` into a finished run is "nothing to do" only for the same run: the mined card keeps the
    fingerprint it was made with (cards mined before it did are taken as they are)."""
    import yaml

    changed = ""
    with contextlib.suppress(OSError, AttributeError, yaml.YAMLError):
        saved = (yaml.safe_load(card.read_text()).get("provenance") or {}).get("fingerprint")
        if isinstance(saved, dict):
            changed = describe_changes(_in_current_terms(saved, fingerprint, card.parent), fingerprint)
    if changed:
        data = "the data it was mined from changed since; " if "data." in changed else ""
        raise OutputDirError(
            f"--resume: {card.parent} holds a finished run made with other settings ({changed}); {data}"
            "pass --overwrite (instead of --resume) to mine again, or choose a new --out"
        )


_DATA_CHANGED = (
    "the rows or data files of the card (data.card) or of the --corpus card (data.corpus) changed since, and "
    "what is stored was computed from the old texts: restore the data, or pass --overwrite (instead of "
    "--resume) to start again on the new data, or write into a new folder"
)


_MODEL_CHANGED = (
    "the model changed since (the same folder retrained, its pooling or tokenizer changed, or the hub id's commit "
    "moved), and what is stored was embedded by the old one: pass --overwrite (instead of --resume) to mine "
    "again, or write into a new folder"
)


def _in_current_terms(saved: dict, fingerprint: dict, out: Path) -> dict:
    """A recorded fingerprint as this version records one: the packaged model by name (older runs recorded its
    folder); a run recorded before the fingerprint held its data (``data``) resumes, said in a warning:
    refusing it would throw its embeddings away for a check it never had a chance to pass (``neoembed train
    --resume`` passes a run from before ``data.*`` likewise)."""
    if "rows" in fingerprint and "rows" not in saved:
        raise OutputDirError(
            f"--resume: the run in {out} was mined by an earlier neoembed, which dropped the card's rows without "
            "negatives of their own (they are mined now): its stored embeddings do not match these rows; pass "
            "--overwrite (instead of --resume) to mine again, or choose a new --out"
        )
    if isinstance(saved.get("model"), str):
        saved = {**saved, "model": model_name(saved["model"])}
    for key in ("model_weights_sha256", "model_pipeline_sha256", "model_revision"):  # recorded before: as now
        if key not in saved:
            saved = {**saved, key: fingerprint.get(key)}
    if "data" in saved or "data" not in fingerprint:
        return saved
    logger.warning(
        "--resume: the run in %s was recorded before its data files were fingerprinted: its cards' data are "
        "taken as unchanged (pass --overwrite instead of --resume if they changed)",
        out,
    )
    return {**saved, "data": fingerprint["data"]}


def describe_changes(before: dict, now: dict) -> str:
    """Each setting that differs, with its value in the folder's run and now ('' when none does)."""
    before = _without(before, NOT_IN_FINGERPRINT)

    def value(d, path: str):
        for part in path.split("."):
            d = d.get(part) if isinstance(d, dict) else None
        return d

    return "; ".join(
        f"{k}: {value(before, k)!r} then, {value(now, k)!r} now" for k in sorted(_diff(before, now))
    )


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    keys = set(a) | set(b)
    out = []
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out
