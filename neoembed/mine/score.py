"""A teacher's scores for a training card's rows: ``neoembed score CARD --teacher MODEL --out DIR``.

Each row's query is scored against its positive and each of its hard negatives, by a cross-encoder (the pair read
together) or a bi-encoder (the cosine of the two embeddings, with the teacher's own ``query`` / ``document``
prompts when it has them). The result is a copy of the card's rows (``query, positive, negative_1..k, scores``)
and a card declaring ``columns.scores``, which recipes with ``distillation`` train on.

Rows are scored in shards written to ``OUT/.score/`` as they finish, so an interrupted run continues with
``--resume`` from the first missing shard (the card, teacher and settings must be the interrupted run's: the
teacher is known by its resolved path and a hash of its weights, so another teacher is refused before it loads,
naming both); the card is written last, so its presence marks a finished run. SIGINT / SIGTERM stop the run at
once (the shards written so far are kept) with exit 130 / 143 and the ``--resume`` line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import Field

from neoembed.data.cards import (
    DataCard,
    DataCardError,
    build_pairs,
    card_fingerprints,
    find_card,
    load_card,
    load_rows,
    local_data_paths,
)
from neoembed.hub import check_model_source, model_name, resolve_packaged
from neoembed.mine.search import shards_to_write, write_shard
from neoembed.mine.settings import (
    check_model_kind,
    describe_changes,
    fresh_folder,
    model_kind,
    nothing_left_on_refusal,
    prepare_run_folder,
    refuse_cde,
)
from neoembed.progress import bar as progress_bar
from neoembed.recipe import StrictModel
from neoembed.record import atomic_write_text, file_sha256
from neoembed.runs import OutputDirError, TrainingInterrupted, model_identity
from neoembed.runs.signals import _FinalSaveSignals, _Signalled

__all__ = ["ScoreConfig", "ScoreResult", "ScoringInterrupted", "score_card", "teacher_kind"]

logger = logging.getLogger(__name__)


class ScoreConfig(StrictModel):
    """Settings of a scoring run (``neoembed score --help`` gives the same as options)."""

    kind: Literal["auto", "cross-encoder", "bi-encoder"] = "auto"
    batch_size: int = Field(64, ge=1)  # pairs per cross-encoder batch
    # tokens per bi-encoder batch (None: the device's default, neoembed.batching); scores do not depend on it
    max_batch_tokens: int | None = Field(None, ge=1)
    max_length: int | None = Field(512, ge=8)
    shard_size: int = Field(10_000, ge=1)  # rows per shard on disk (the unit a resumed run skips)
    max_rows: int | None = Field(None, ge=1)
    max_negatives: int | None = Field(None, ge=1)
    name: str | None = None  # of the written card; default <source card>_scored


@dataclass(frozen=True)
class ScoreResult:
    card: Path  # OUT/<name>.yaml
    data: Path  # OUT/<name>.jsonl
    rows: int
    kind: str
    reused: bool = False  # a --resume of a finished run: nothing written


class ScoringInterrupted(TrainingInterrupted):
    """SIGINT / SIGTERM during ``neoembed score``: the finished shards are kept, ``--resume`` continues (exit 130 /
    143)."""

    label = "scoring stopped"

    def __init__(self, signal_name: str, out: Path, done: int, total: int):
        super().__init__(signal_name, out / ".score")
        self.args = (
            f"stopped by {signal_name}: {done} of {total} shard(s) scored and kept in {out / '.score'}; continue "
            "with --resume (the same card, --teacher and options)",
        )


def teacher_kind(teacher: str, kind: str = "auto") -> str:
    """``kind``, or for ``auto`` what the folder holds (:func:`neoembed.mine.miner.model_kind`: a
    sentence-transformers CrossEncoder or a sequence-classification checkpoint is a cross-encoder, anything else
    a bi-encoder). A local folder of the other kind than ``kind`` names, or a CDE folder, is refused, before it
    loads."""
    refuse_cde(teacher, "--teacher", "a bi-encoder or a cross-encoder")
    found = model_kind(teacher)
    if kind != "auto":
        if found is not None and found[0] != kind:
            check_model_kind(teacher, kind, "--teacher")  # raises, naming the folder's kind and why
        return kind
    if found is not None:
        return found[0]
    if Path(teacher).exists():
        return "bi-encoder"
    raise ValueError(
        f"--kind auto cannot tell what the hub model {teacher!r} is: pass --kind cross-encoder or bi-encoder"
    )


def _scorer(teacher: str, kind: str, cfg: ScoreConfig, cut: dict | None = None):
    """A function from (queries, documents) lists to one score per pair. A bi-encoder's truncated texts are
    counted in ``cut`` (``texts``, and the ``limit``), not warned about per call: the run says them once."""
    if kind == "cross-encoder":
        from sentence_transformers import CrossEncoder

        import neoembed.modeling  # noqa: F401  (NeoBERT cross-encoders load through the Auto classes)

        model = CrossEncoder(teacher, max_length=cfg.max_length)
        return lambda q, d: np.asarray(
            model.predict(list(zip(q, d, strict=True)), batch_size=cfg.batch_size, show_progress_bar=False),
            dtype=np.float32,
        ).reshape(-1)
    from neoembed.batching import default_max_batch_tokens
    from neoembed.loading import load

    model = load(teacher, max_seq_length=cfg.max_length)
    tokens = cfg.max_batch_tokens or default_max_batch_tokens(model.device, model.max_seq_length)
    options = dict(max_batch_tokens=tokens, normalize_embeddings=True, convert_to_numpy=True)

    from neoembed.encode_checks import TruncationWarning, count_truncated

    prompts = model.prompts or {}

    def score(q: list[str], d: list[str]) -> np.ndarray:
        # each distinct text embedded once: a query stands beside its positive and every negative, and the rows
        # of a mined card share queries and documents
        (uq, iq), (ud, id_) = _distinct(q), _distinct(d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TruncationWarning)
            eq = model.encode_query(uq, show_progress_bar=False, **options)[iq]
            ed = model.encode_document(ud, show_progress_bar=False, **options)[id_]
        if cut is not None:  # each text once: a query stands beside its positive and every negative
            cut["limit"] = model.max_seq_length
            for texts, prompt in ((uq, prompts.get("query")), (ud, prompts.get("document"))):
                cut["texts"] = cut.get("texts", 0) + count_truncated(
                    model.tokenizer, texts, model.max_seq_length, prompt
                )
        return np.einsum("nd,nd->n", eq, ed).astype(np.float32)

    return score


def _distinct(texts: list[str]) -> tuple[list[str], np.ndarray]:
    """The distinct texts in first-seen order, and each text's position among them."""
    seen: dict[str, int] = {}
    where = np.array([seen.setdefault(t, len(seen)) for t in texts], dtype=np.int64)
    return list(seen), where


#: rows scored per scorer call: progress is reported after each (a shard of 10,000 rows took minutes on a CPU
#: between lines); large enough that the token-budget batches stay full
_PIECE = 512


def _score_shard(score, rows: dict[str, list[str]], k: int, on_rows=None) -> np.ndarray:
    """(rows, 1 + k): each query against its positive, then each negative, :data:`_PIECE` rows per scorer call;
    ``on_rows(n)`` after each."""
    parts = []
    for a in range(0, len(rows["query"]), _PIECE):
        queries = rows["query"][a : a + _PIECE]
        docs = [rows["positive"][a : a + _PIECE]] + [rows[f"negative_{j + 1}"][a : a + _PIECE] for j in range(k)]
        flat = score([q for _ in docs for q in queries], [d for column in docs for d in column])
        parts.append(flat.reshape(1 + k, len(queries)).T)
        if on_rows is not None:
            on_rows(len(queries))
    return np.concatenate(parts) if parts else np.zeros((0, 1 + k), np.float32)


def score_card(
    card: str | Path,
    teacher: str,
    out: str | Path,
    config: ScoreConfig | None = None,
    resume: bool = False,
    overwrite: bool = False,
    card_dirs=(),
    progress: bool = True,
) -> ScoreResult:
    """Score every row of ``card`` with ``teacher`` and write ``out/<name>.yaml`` + ``.jsonl`` (see the module)."""
    cfg = config or ScoreConfig()
    teacher = resolve_packaged(str(teacher))  # every path below (the cross-encoder's too) gets the folder
    check_model_source(teacher)  # a path that does not exist, or a hub id offline, before anything is written
    out = Path(out)
    src_path = find_card(card, list(card_dirs))
    src, folder = load_card(src_path)
    name = cfg.name or f"{src.name}_scored"
    kind = teacher_kind(teacher, cfg.kind)
    identity = model_identity(teacher)  # the resolved path and a hash of the weights: not the string typed
    # the packaged copy by its name: its folder is a path inside this machine's Python installation
    fingerprint = {"card_sha256": file_sha256(src_path), "teacher": model_name(identity["model"]), "kind": kind}
    fingerprint["teacher_weights_sha256"] = identity["weights_sha256"]
    # the card's rows and data files, as a training resume knows them: scores of edited rows are not theirs
    fingerprint["data"] = {"card": next(iter(card_fingerprints([(src, folder)]).values()))}
    # the kind found is in the fingerprint: --kind auto and the kind spelled out are one run
    fingerprint["settings"] = cfg.model_dump(exclude={"batch_size", "max_batch_tokens", "kind"})
    state = out / ".score"
    if resume:
        _check_same_run(out, state, name, fingerprint)
    inputs = (src_path, *local_data_paths([(src, folder)]), teacher)
    fresh = fresh_folder(out)
    if prepare_run_folder(out, state, name, fingerprint, resume, overwrite, inputs):
        logger.warning("%s already holds a finished run (%s.yaml); nothing to do", out, name)
        rows = len((out / f"{name}.jsonl").read_text().splitlines())
        return ScoreResult(out / f"{name}.yaml", out / f"{name}.jsonl", rows, kind, reused=True)
    with nothing_left_on_refusal(out, state, fresh):  # else a corrected command is refused by what it left
        pairs = build_pairs(
            src, load_rows(src, folder, cfg.max_rows), cfg.max_negatives, with_instruction=False
        )
        k = sum(c.startswith("negative_") for c in pairs.column_names)
        if k == 0:
            raise DataCardError(
                f"card {src.name} has no hard negatives to score against: mine some first "
                f"(neoembed mine {src_path} --model MODEL --out DIR), then score the mined card"
            )
    with _FinalSaveSignals():  # SIGINT / SIGTERM raise _Signalled at once: the shards on disk are kept
        try:
            scores = _score_shards(pairs, k, state, teacher, kind, cfg, progress)
            result = _write(out, name, src, src_path, pairs, scores, k, fingerprint)
        except _Signalled as e:
            for partial in (*state.glob(".scores-*.tmp*"), *out.glob(f".{name}.jsonl.tmp*")):
                partial.unlink(missing_ok=True)
            total = max(1, math.ceil(len(pairs) / cfg.shard_size))
            raise ScoringInterrupted(e.name, out, len(list(state.glob("scores-*.npy"))), total) from None
    shutil.rmtree(state, ignore_errors=True)
    return result


def _check_same_run(out: Path, state: Path, name: str, fingerprint: dict) -> None:
    """``--resume`` continues only the run that ``out`` holds (interrupted: ``state/settings.json``; finished: the
    card's provenance): another teacher would mix two teachers' scores in one card (or report one teacher's
    scores as another's), so it is refused, naming both teachers and the fix; other settings likewise."""
    saved, card = None, out / f"{name}.yaml"
    with contextlib.suppress(OSError, ValueError, AttributeError, yaml.YAMLError):
        if (state / "settings.json").is_file():
            saved = json.loads((state / "settings.json").read_text())
        elif card.is_file():
            saved = yaml.safe_load(card.read_text()).get("provenance")
    if not isinstance(saved, dict):
        return  # nothing to compare with: _prepare_output_dir says what the folder lacks
    was = (model_name(str(saved.get("teacher"))), saved.get("teacher_weights_sha256"))  # older: the folder
    if was != (fingerprint["teacher"], fingerprint["teacher_weights_sha256"]):
        raise OutputDirError(
            f"--resume: the scores in {out} are by teacher {_teacher(*was)}; this run names teacher "
            f"{_teacher(fingerprint['teacher'], fingerprint['teacher_weights_sha256'])}: one card holds one "
            f"teacher's scores. Resume with --teacher {was[0]}, or pass --overwrite (instead of --resume) to "
            "score again with this teacher, or choose a new --out"
        )
    # a run recorded before its data were fingerprinted: prepare_run_folder says so, once
    keys = ("card_sha256", "kind", "settings", "data")[: 4 if "data" in saved else 3]
    changed = describe_changes({k: saved.get(k) for k in keys}, {k: fingerprint[k] for k in keys})
    if changed:
        stale = "the card's rows or data files changed since, and the scores stored are of the old rows; "
        data = stale if "data." in changed else ""
        raise OutputDirError(
            f"--resume: the run in {out} was made with other settings ({changed}); {data}resume with the "
            "original card, data and options, or pass --overwrite to score again"
        )


def _teacher(path, weights) -> str:
    return f"{path} (weights {str(weights)[:12]})" if weights else str(path)


def _score_shards(pairs, k: int, state: Path, teacher: str, kind: str, cfg: ScoreConfig, progress: bool):
    """Every row's scores, shard by shard into ``state/scores-NNNNN.npy``; shards on disk are kept."""
    n_shards = max(1, math.ceil(len(pairs) / cfg.shard_size))
    paths = [state / f"scores-{s:05d}.npy" for s in range(n_shards)]
    todo = shards_to_write(paths)
    cut: dict = {}
    score = _scorer(teacher, kind, cfg, cut) if todo else None
    left = sum(min(cfg.shard_size, len(pairs) - s * cfg.shard_size) for s in todo)
    # counted in rows from the rows already on disk: a resume's bar goes on where the run stopped
    with progress_bar(
        total=len(pairs), initial=len(pairs) - left, desc="scoring", unit="row", disable=not progress or not todo
    ) as bar:
        for s in todo:
            rows = pairs[s * cfg.shard_size : (s + 1) * cfg.shard_size]
            write_shard(paths[s], _score_shard(score, rows, k, bar.update))
    from neoembed.encode_checks import say_truncated

    say_truncated(cut.get("texts", 0), cut.get("limit"), " scored")
    return np.concatenate([np.load(p) for p in paths])


def _write(
    out: Path, name: str, src: DataCard, src_path: Path, pairs, scores, k: int, fingerprint
) -> ScoreResult:
    """``<name>.jsonl``, then ``<name>.yaml`` (written last: its presence marks a finished run)."""
    data_path, card_path = out / f"{name}.jsonl", out / f"{name}.yaml"
    columns = ["query", "positive", *(f"negative_{j + 1}" for j in range(k))]
    tmp = out / f".{name}.jsonl.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf8") as f:
        for i, row in enumerate(pairs.select_columns(columns)):
            row["scores"] = [round(float(x), 4) for x in scores[i]]
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, data_path)
    raw = {
        "name": name,
        "source": {"local": {"path": data_path.name, "format": "json"}},
        "columns": {"query": "query", "positive": "positive", "negatives": columns[2:], "scores": "scores"},
        "instruction": src.instruction,
        "license": src.license,
        "size": len(pairs),
        "notes": (
            f"Card {src.name} with each row's {fingerprint['kind']} scores from {fingerprint['teacher']} (positive, "
            f"then each of its {k} hard negatives), written by neoembed score."
        ),
        "provenance": {
            "tool": "neoembed score",
            "source_card": {"name": src.name, "file": src_path.name},
            **fingerprint,
        },
    }
    DataCard.model_validate(raw)
    atomic_write_text(card_path, yaml.safe_dump(raw, sort_keys=False, allow_unicode=True, width=110))
    return ScoreResult(card_path, data_path, len(pairs), fingerprint["kind"])
