"""Hard-negative mining for a training data card: embed, search, filter, write a card the recipes train on.

    neoembed mine tests/data_cards/msrp_pairs.yaml --model all-MiniLM-L6-v2-folder --out mined/
    neoembed train my.yaml 'datasets=[{card: mined/msrp_pairs_mined.yaml}]'

Stages (each one resumable with ``resume=True``; state lives in ``OUT/.mine`` and is removed at the end):

1. The card is read with the public loader (``neoembed.data.cards``); rows are grouped by query, so a query with
   several positives is one query with several positives. The corpus is the card's positives, plus another
   card's documents (positives and negatives) or a list of texts when ``corpus`` is given.
2. Queries get the card's instruction exactly as training puts it (``format_with_instruction``); documents get
   none. Both are embedded (unit length: inner product = cosine) in shards written to disk, so memory holds one
   shard at a time; an interrupted run re-embeds only the shards that are missing.
3. faiss search (:mod:`neoembed.mine.search`): the ``range_max`` most similar documents of every query.
4. Filters, each candidate counted under the first reason that drops it: the query's positives; documents whose
   normalised text (case, whitespace) equals a positive's or the query's; near-duplicates of a positive (cosine
   to it >= ``duplicate_threshold``); ranks below ``range_min``; then the positive-aware thresholds on the score
   (bi-encoder, or a cross-encoder's when one is given): above ``max_score``, within ``margin`` of the positive's
   score, or above ``max_fraction`` of it; a survivor with a better one's normalised text. The first
   ``num_negatives`` survivors, best score first, are kept.
5. ``OUT/<name>.jsonl`` (``query, positive, negative_1..k``; one line per source row whose query kept k
   negatives) and ``OUT/<name>.yaml``, a data card with the source card's instruction and licence and a
   ``provenance`` block (source card, model, index, settings, counts kept and dropped per reason).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from pydantic import ValidationError

from neoembed._version import __version__
from neoembed.data.cards import (
    DataCard,
    DataCardError,
    build_pairs,
    build_pairs_report,
    find_card,
    load_card,
    load_rows,
    local_data_paths,
)
from neoembed.hub import model_name, resolve_packaged
from neoembed.instructions import format_with_instruction
from neoembed.mine.encode import ForkedWorkers, fast_encode, fast_encode_supported
from neoembed.mine.filters import select_negatives, text_key
from neoembed.mine.search import EmbeddingShards, checksum_path, search, shards_to_write, write_shard
from neoembed.mine.settings import (
    FILTER_SETTINGS,
    SEARCH_SETTINGS,
    MineConfig,
    check_index_settings,
    check_model_kind,
    fresh_folder,
    model_kind,
    nothing_left_on_refusal,
    prepare_run_folder,
    run_fingerprint,
    temp_file,
)
from neoembed.progress import bar as progress_bar
from neoembed.recipe import format_validation_error
from neoembed.record import atomic_write_text, file_sha256
from neoembed.runs import require_module

__all__ = ["MineConfig", "MineResult", "check_model_kind", "mine_negatives", "model_kind"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MineResult:
    card: Path  # OUT/<name>.yaml
    data: Path  # OUT/<name>.jsonl
    counts: dict
    reused: bool = False  # a --resume of a finished run: nothing written


@dataclass
class _Pairs:
    queries: list[str]  # unique, without instruction
    corpus: list[str]  # unique documents
    row_query: np.ndarray  # per source row: index into queries
    row_positive: np.ndarray  # per source row: index into corpus
    positives: np.ndarray  # (queries, max positives) corpus ids, -1 padded


def mine_negatives(
    card: str | Path,
    model: str | Path,
    out: str | Path,
    *,
    corpus: str | Path | Sequence[str] | None = None,
    config: MineConfig | None = None,
    resume: bool = False,
    overwrite: bool = False,
    card_dirs: Sequence[str | Path] = (),
    progress: bool = True,
) -> MineResult:
    """Mine hard negatives for ``card`` with ``model`` and write ``out/<name>.yaml`` + ``.jsonl``.

    ``corpus``: another card (name or path) whose documents join the card's positives, or a list of texts.
    ``resume``: continue a run interrupted in ``out`` (same settings); ``overwrite``: replace the mining run in
    ``out``; without either a non-empty ``out`` is refused.
    """
    cfg = config or MineConfig()
    _warn_unused_batch_size(cfg)
    require_module("faiss", "faiss", "neoembed mine")  # its index; checked before any model loads
    # each model fits its role, before either loads (the packaged MiniLM by name: its folder, on every path)
    check_model_kind(model := resolve_packaged(str(model)), "bi-encoder", "--model")
    if cfg.cross_encoder is not None:
        check_model_kind(cfg.cross_encoder, "cross-encoder", "--cross-encoder")
    out = Path(out)
    src_path = find_card(card, list(card_dirs))
    src, folder = load_card(src_path)
    name = cfg.name or f"{src.name}_mined"
    corpus_card = None
    if corpus is not None and isinstance(corpus, (str, Path)):
        corpus_path = find_card(corpus, list(card_dirs))
        corpus_card = (*load_card(corpus_path), corpus_path)
    fingerprint = run_fingerprint(src_path, (src, folder), model, cfg, corpus, corpus_card)
    state = out / ".mine"
    fresh = fresh_folder(out)
    inputs = (src_path, *local_data_paths([(src, folder)]), model, corpus_card[2] if corpus_card else None)
    redo = (SEARCH_SETTINGS, ("candidates.npz",))  # a resume with other search settings searches again
    if prepare_run_folder(out, state, name, fingerprint, resume, overwrite, inputs, FILTER_SETTINGS, redo):
        logger.warning("%s already holds a finished run (%s.yaml); nothing to do", out, name)
        counts = load_card(out / f"{name}.yaml")[0].provenance["counts"]
        return MineResult(out / f"{name}.yaml", out / f"{name}.jsonl", counts, reused=True)
    with nothing_left_on_refusal(out, state, fresh):
        data = _load_pairs(src, folder, cfg, corpus, corpus_card)
        _check_enough_documents(src.name, data, cfg.num_negatives)
        if cfg.nlist is not None and cfg.index.startswith("ivf") and cfg.nlist > len(data.corpus):
            raise NothingToMine(  # faiss's own error comes after the whole corpus is embedded
                f"--nlist {cfg.nlist} exceeds the {len(data.corpus)} documents an IVF index is trained on (one "
                "cluster needs a document at least): lower --nlist, or leave it unset (chosen from the corpus size)"
            )
    query_texts = [format_with_instruction(src.instruction, q, cfg.template) for q in data.queries]
    from neoembed.loading import load

    with nothing_left_on_refusal(out, state, fresh):  # an unusable model: nothing mined, nothing kept
        encoder = load(
            str(model), pooling=cfg.pooling, max_seq_length=cfg.max_length, padding_free=_padding_free()
        )
    with nothing_left_on_refusal(out, state, fresh, () if resume else (ValueError,)):  # a resume keeps its state
        check_index_settings(cfg, encoder.get_embedding_dimension())
    corpus_emb, query_emb = _embed(encoder, data.corpus, query_texts, state, cfg, progress)
    scores, ids, index_info = _candidates(state, corpus_emb, query_emb, cfg, progress)
    negatives, reasons, neg_scores, rescore = _select(data, scores, ids, corpus_emb, query_emb, cfg, progress)
    row_scores = _row_scores(data, negatives, neg_scores, query_emb, corpus_emb, rescore)
    provenance = {
        "tool": "neoembed mine",
        "neoembed_version": __version__,
        "source_card": {"name": src.name, "file": src_path.name, "sha256": file_sha256(src_path)},
        "corpus": _corpus_description(corpus, corpus_card, len(data.corpus)),
        "model": model_name(str(model)),
        "query_instruction": src.instruction,
        "index": index_info,
        "settings": cfg.model_dump(exclude={"workers", "keep_embeddings", "name"}),
        "fingerprint": fingerprint,  # what --resume into this finished run compares (prepare_run_folder)
    }
    # no row kept is the filters' verdict alone: the state, what took the time, is kept for a relaxed --resume
    result = _write(out, name, src, data, (negatives, row_scores), reasons, provenance, cfg.num_negatives)
    if not cfg.keep_embeddings:
        del corpus_emb, query_emb
        shutil.rmtree(state, ignore_errors=True)
    return result


class NothingToMine(ValueError):
    """A mining run that would write a card with no rows (exit 2); the message says why and what to change."""


def _check_enough_documents(card: str, data: _Pairs, k: int) -> None:
    """Refuse before any model loads when no query can get ``k`` negatives: a query's negatives are distinct
    documents other than its positives, so a corpus of (distinct) documents too small writes an empty card."""
    n_pos = (data.positives >= 0).sum(axis=1)
    best = int(len(data.corpus) - n_pos.min()) if len(n_pos) else 0
    if best < k:
        raise NothingToMine(
            f"card {card}: {len(data.corpus)} distinct documents ({len(data.queries)} queries) leave at most "
            f"{best} candidate negatives per query, fewer than --num-negatives {k}: the card would have 0 rows. "
            "Lower --num-negatives, or add documents with --corpus (identical texts count once)"
        )


def _corpus_description(corpus, corpus_card, n_docs: int) -> dict:
    if corpus_card is not None:
        card, _, path = corpus_card
        what = {"card": card.name, "file": path.name, "sha256": file_sha256(path)}
    elif corpus is not None:
        what = {"texts": len(corpus)}
    else:
        what = {}
    return {"source": "source card positives" + (" + corpus" if what else ""), **what, "documents": n_docs}


def _card_documents(card: DataCard, folder: Path, max_rows: int | None) -> list[str]:
    """A corpus card's documents: its positives and every negative (its queries are not documents).

    ``build_pairs`` keeps as many negatives per row as the row with the fewest has (none, when one row lacks
    one), so each column is read on its own, as the positive of a copy of the card; a plain column of lists is
    flattened (a list inside a nested column, ``col.key``, is not read)."""
    rows = load_rows(card, folder, max_rows)
    docs: list[str] = []
    for spec in (card.columns.positive, *card.columns.negatives):
        columns = card.columns.model_copy(update={"positive": spec, "negatives": []})
        with contextlib.suppress(DataCardError):  # a column with no text rows (lists, or all missing)
            # warn=False: a row this column lacks is no row dropped from training (nothing trains on it here)
            copy = card.model_copy(update={"columns": columns})
            docs += build_pairs_report(copy, rows, with_instruction=False, warn=False)[0]["positive"]
        if spec in rows.column_names:
            docs += [
                x for v in rows[spec] if isinstance(v, list) for x in v if isinstance(x, str) and x.strip()
            ]
    return docs


def _load_pairs(src: DataCard, folder: Path, cfg: MineConfig, corpus, corpus_card) -> _Pairs:
    # max_negatives=0: the card's own negatives are not carried over, so a row without them is mined like any
    # other (with the card's k, the rows short of k negatives were dropped, their queries with them)
    pairs = build_pairs(src, load_rows(src, folder, cfg.max_rows), max_negatives=0, with_instruction=False)
    raw_q, raw_p = list(pairs["query"]), list(pairs["positive"])
    queries = list(dict.fromkeys(raw_q))
    q_index = {q: i for i, q in enumerate(queries)}
    p_index = {p: i for i, p in enumerate(dict.fromkeys(raw_p))}  # the card's documents come first
    corpus_texts = list(p_index)
    if corpus_card is not None:
        extra = _card_documents(corpus_card[0], corpus_card[1], None)
    else:
        extra = [t for t in corpus or () if isinstance(t, str) and t.strip()]
    corpus_texts += [extra[i] for i in _first_occurrences(extra) if extra[i] not in p_index]
    row_query = np.fromiter((q_index[q] for q in raw_q), np.int64, len(raw_q))
    row_positive = np.fromiter((p_index[p] for p in raw_p), np.int64, len(raw_p))
    per_query: list[list[int]] = [[] for _ in queries]
    for q, p in zip(row_query, row_positive, strict=True):
        if p not in per_query[q]:
            per_query[q].append(int(p))
    positives = np.full((len(queries), max(map(len, per_query))), -1, np.int64)
    for q, ps in enumerate(per_query):
        positives[q, : len(ps)] = ps
    return _Pairs(queries, corpus_texts, row_query, row_positive, positives)


def _first_occurrences(texts: Sequence[str]) -> np.ndarray:
    """Indices of the first copy of every distinct text, in order. Keyed by a 64-bit hash rather than a dict of
    the strings: 8 bytes per document instead of a hash-table entry (~100 MB saved at a million documents);
    two different texts sharing a key (about 1 in 10^7 at 10^7 documents) would lose one of them."""
    keys = np.fromiter(
        (
            int.from_bytes(hashlib.blake2b(t.encode("utf8"), digest_size=8).digest(), "little", signed=True)
            for t in texts
        ),
        np.int64,
        len(texts),
    )
    _, first = np.unique(keys, return_index=True)
    return np.sort(first)


def _padding_free() -> bool | None:
    """NeoBERT's layout for mining: the checkpoint's (padding-free) where CUDA runs the variable-length kernel;
    padded on CPU, where padding-free attention is a Python loop over the batch's sequences and the batches,
    sorted by length, carry little padding. Measured on CPU no slower, within the noise of a loaded machine
    (``python benchmarks/mine.py encode``: 4.9-5.7 s padded vs 5.1-6.6 s padding-free for 20,000 texts)."""
    import torch

    return None if torch.cuda.is_available() else False


@contextlib.contextmanager
def _encode_pool(model, workers: int):
    """No pool for one worker; on CPU ``workers`` processes forked with the model loaded (where the platform
    forks and the model is the plain text pipeline); else sentence-transformers' multi-process pool: one process
    per GPU (up to ``workers``), or ``workers`` CPU processes."""
    if workers <= 1:
        yield None
        return
    import torch

    if torch.cuda.is_available():
        devices = [f"cuda:{i}" for i in range(min(workers, torch.cuda.device_count()))]
    elif fast_encode_supported(model) and ForkedWorkers.available():
        yield ForkedWorkers(model, workers)
        return
    else:
        devices = ["cpu"] * workers
    pool = model.start_multi_process_pool(target_devices=devices)
    try:
        yield pool
    finally:
        model.stop_multi_process_pool(pool)


def _encode(model, texts: list[str], cfg: MineConfig, pool, on_batch=None, on_truncated=None) -> np.ndarray:
    """The texts' embeddings; ``on_batch(n)`` after each batch where the encoder can tell (the lean encoder, its
    forked workers), else once for all ``texts``; ``on_truncated(n)`` with the number of texts truncated (no
    warning then). Batches are filled to ``cfg.max_batch_tokens`` tokens (the device's default when unset):
    :mod:`neoembed.batching`."""
    from neoembed.batching import default_max_batch_tokens

    tokens = cfg.max_batch_tokens or default_max_batch_tokens(model.device, model.max_seq_length)
    if isinstance(pool, ForkedWorkers):
        return pool.encode(
            texts, cfg.batch_size, on_batch=on_batch, max_batch_tokens=tokens, on_truncated=on_truncated
        )
    if pool is None and fast_encode_supported(model):
        return fast_encode(
            model,
            texts,
            cfg.batch_size,
            on_batch=on_batch,
            max_batch_tokens=tokens,
            on_truncated=on_truncated,
        )
    if on_truncated is None:
        emb = _encode_plain(model, texts, cfg, pool, tokens)
    else:
        from neoembed.encode_checks import TruncationWarning, count_truncated

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TruncationWarning)  # counted below, and said once by the caller
            emb = _encode_plain(model, texts, cfg, pool, tokens)
        on_truncated(count_truncated(model.tokenizer, texts, model.max_seq_length))
    if on_batch is not None:
        on_batch(len(texts))
    return emb


def _encode_plain(model, texts: list[str], cfg: MineConfig, pool, max_batch_tokens: int) -> np.ndarray:
    # prompt="": the texts already carry their instruction; a saved model's default prompt must not be added
    return model.encode(
        texts,
        prompt="",
        batch_size=cfg.batch_size,
        max_batch_tokens=max_batch_tokens,
        normalize_embeddings=True,
        convert_to_numpy=True,
        show_progress_bar=False,
        pool=pool,
    )


def _embed(model, corpus: list[str], queries: list[str], state: Path, cfg: MineConfig, progress):
    """The corpus's and the queries' embeddings (:func:`_embed_sharded`); the texts truncated are said once."""
    cut: Counter = Counter()  # texts truncated, per kind
    with _encode_pool(model, cfg.workers) as pool:
        corpus_emb = _embed_sharded(model, corpus, state, "corpus", cfg, pool, progress, cut)
        query_emb = _embed_sharded(model, queries, state, "queries", cfg, pool, progress, cut)
    _warn_truncated(cut, model.max_seq_length)
    return corpus_emb, query_emb


def _embed_sharded(
    model, texts, state: Path, kind: str, cfg: MineConfig, pool, progress, cut: Counter
) -> EmbeddingShards:
    """Embed ``texts`` shard by shard into ``state/<kind>-NNNNN.npy``; shards already on disk are kept. The bar
    counts texts, batch by batch (a single shard holds up to ``shard_size`` texts: a whole pass on small data);
    ``cut[kind]`` the texts truncated."""
    n_shards = max(1, math.ceil(len(texts) / cfg.shard_size))
    paths = [state / f"{kind}-{s:05d}.npy" for s in range(n_shards)]
    todo = shards_to_write(paths)
    kept = sum(
        len(texts[s * cfg.shard_size : (s + 1) * cfg.shard_size]) for s in range(n_shards) if s not in todo
    )
    bar = progress_bar(
        total=len(texts), initial=kept, desc=f"embedding {kind}", unit="text", disable=not progress
    )

    def truncated(n: int) -> None:
        cut[kind] += n

    for s in todo:
        part = texts[s * cfg.shard_size : (s + 1) * cfg.shard_size]
        write_shard(paths[s], _encode(model, part, cfg, pool, bar.update, truncated))
    bar.close()
    return EmbeddingShards(paths, cfg.shard_size)


def _warn_truncated(cut: Counter, max_length: int) -> None:
    """One warning for the run's truncated texts, with the total (a warning per shard, with its shard's count,
    said neither)."""
    from neoembed.encode_checks import say_truncated

    parts = " and ".join(f"{n} {kind}" for kind, n in cut.items() if n)
    say_truncated(cut.total(), max_length, f" embedded ({parts})", stacklevel=4)


def _warn_unused_batch_size(cfg: MineConfig) -> None:
    """``batch_size`` set, though token budgets size every encoding batch: kept for the configs that set it
    (refusing it would break them), named so that nobody tunes it."""
    if "batch_size" in cfg.model_fields_set:
        logger.warning(
            "batch_size=%d is not used by mine: its encoding batches are filled to --max-batch-tokens tokens",
            cfg.batch_size,
        )


def _candidates(state: Path, corpus_emb, query_emb, cfg: MineConfig, progress):
    """The search stage, stored in ``state/candidates.npz`` so that a resumed run does not search again; its
    checksum file holds its SHA-256 and those of the shards it searched, so that a file altered or cut short, or
    a shard embedded again since, is searched again (named in a warning)."""
    path = state / "candidates.npz"
    seal = checksum_path(path)
    inputs = [checksum_path(p).read_text().strip() for p in (*corpus_emb.paths, *query_emb.paths)]
    if path.is_file():
        saved = seal.read_text().split() if seal.is_file() else None
        if saved == [file_sha256(path), *inputs]:
            with np.load(path) as z:
                return z["scores"], z["ids"], json.loads(str(z["info"]))
        why = (
            "has no checksum (a write cut short)"
            if saved is None
            else "does not match its checksum or shards"
        )
        logger.warning("%s %s: searching again", path.name, why)
    scores, ids, info = search(
        corpus_emb,
        query_emb,
        cfg.range_max,
        cfg.index,
        nlist=cfg.nlist,
        nprobe=cfg.nprobe,
        hnsw_m=cfg.hnsw_m,
        ef_search=cfg.ef_search,
        pq_m=cfg.pq_m,
        rescore=cfg.rescore,
        gpu=cfg.gpu,
        batch=cfg.search_batch,
        progress=progress,
    )
    tmp = state / f".candidates.tmp{os.getpid()}.npz"
    np.savez(tmp, scores=scores, ids=ids, info=json.dumps(info))
    digest = file_sha256(tmp)
    os.replace(tmp, path)
    atomic_write_text(seal, "\n".join([digest, *inputs]) + "\n")
    return scores, ids, info


def _select(data: _Pairs, scores, ids, corpus_emb, query_emb, cfg: MineConfig, progress):
    doc_keys = np.fromiter((text_key(t) for t in data.corpus), np.int64, len(data.corpus))
    query_keys = np.fromiter((text_key(t) for t in data.queries), np.int64, len(data.queries))
    rescore = _cross_encoder_scorer(cfg, data) if cfg.cross_encoder else None
    neg_scores: list = []
    negatives, reasons = select_negatives(
        data.positives,
        scores,
        ids,
        corpus_emb,
        query_emb,
        doc_keys,
        query_keys,
        cfg,
        rescore,
        progress=progress,
        scores_out=neg_scores,
    )
    return negatives, reasons, neg_scores, rescore


def _row_scores(data: _Pairs, negatives, neg_scores, query_emb, corpus_emb, rescore) -> list[list[float]]:
    """Per source row, the scores that chose its negatives: its positive's, then each kept negative's (the
    cross-encoder's when one rescored them, else the bi-encoder's cosine)."""
    q_ids, p_ids = np.asarray(data.row_query), np.asarray(data.row_positive)
    if rescore is not None:
        pos = rescore(q_ids, p_ids) if len(q_ids) else np.zeros(0, np.float32)
    else:
        pos = np.einsum("nd,nd->n", query_emb.gather(q_ids), corpus_emb.gather(p_ids))
    return [[float(pos[r]), *map(float, neg_scores[q])] for r, q in enumerate(q_ids)]


def _cross_encoder_scorer(cfg: MineConfig, data: _Pairs):
    """Scores of (query, document) pairs from a cross-encoder. Queries go without the instruction: a
    cross-encoder reads the pair itself."""
    from sentence_transformers import CrossEncoder

    import neoembed.modeling  # noqa: F401  (NeoBERT cross-encoders load through the Auto classes it registers)

    model = CrossEncoder(cfg.cross_encoder, max_length=cfg.max_length)

    def score(query_ids: np.ndarray, doc_ids: np.ndarray) -> np.ndarray:
        pairs = [(data.queries[q], data.corpus[d]) for q, d in zip(query_ids, doc_ids, strict=True)]
        out = model.predict(pairs, batch_size=cfg.cross_encoder_batch_size, show_progress_bar=False)
        return np.asarray(out, dtype=np.float32).reshape(-1)

    return score


#: the option that relaxes each score or identity filter (the others drop positives and their copies)
_RELAXES = {
    "near_duplicate": "--duplicate-threshold",
    "below_range_min": "--range-min",
    "above_max_score": "--max-score",
    "within_margin": "--margin",
    "above_fraction": "--max-fraction",
}


def _relax_hint(reasons: Counter) -> str:
    """Which option to relax first: the one whose filter dropped the most candidates (then lowering -k)."""
    counts = {r: reasons.get(r, 0) for r in _RELAXES if reasons.get(r, 0)}
    if not counts:
        return "Lower --num-negatives, or add documents with --corpus. "
    top = max(counts, key=counts.get)
    return f"Most candidates were dropped as {top} ({counts[top]:,}): relax {_RELAXES[top]}, or lower -k. "


def _write(out: Path, name: str, src: DataCard, data: _Pairs, mined, reasons: Counter, provenance, k: int):
    """``<name>.jsonl`` (one line per source row whose query kept ``k`` negatives, with ``scores``: the positive's
    and each negative's score), then ``<name>.yaml``: the card is written last, so its presence marks a finished
    run. ``mined``: (negatives per query, scores per source row)."""
    negatives, row_scores = mined
    data_path, card_path = out / f"{name}.jsonl", out / f"{name}.yaml"
    written = dropped = 0
    with temp_file(data_path) as tmp, open(tmp, "w", encoding="utf8") as f:
        for r, (q, p) in enumerate(zip(data.row_query, data.row_positive, strict=True)):
            negs = negatives[q]
            if len(negs) < k:
                dropped += 1
                continue
            row = {"query": data.queries[q], "positive": data.corpus[p]}
            row.update({f"negative_{j + 1}": data.corpus[d] for j, d in enumerate(negs)})
            row["scores"] = [round(x, 4) for x in row_scores[r]]  # 4 decimals: equal across worker counts
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            written += 1
        if written == 0:  # the temporary file goes with the error
            filters = ", ".join(sorted(FILTER_SETTINGS))
            raise NothingToMine(
                f"card {src.name}: no query kept {k} negatives after the filters ({dict(reasons)}): the card "
                f"would have 0 rows. {_relax_hint(reasons)}The embeddings and search results are kept in "
                f"{out / '.mine'}: rerun with --resume and relaxed filter settings ({filters} may change on "
                "resume) to filter them again without embedding (a wider --range-max searches them again); more "
                "documents (--corpus) need --overwrite"
            )
        f.close()
        os.replace(tmp, data_path)
    counts = {
        "rows_in": len(data.row_query),
        "rows_written": written,
        "rows_dropped_too_few_negatives": dropped,
        "queries": len(data.queries),
        "documents": len(data.corpus),
        "candidates": dict(reasons),
    }
    raw = {
        "name": name,
        "source": {"local": {"path": data_path.name, "format": "json"}},
        "columns": {
            "query": "query",
            "positive": "positive",
            "negatives": [f"negative_{j + 1}" for j in range(k)],
            "scores": "scores",
        },
        "instruction": src.instruction,
        "license": src.license,
        "size": written,
        "notes": (
            f"Card {src.name} with {k} hard negatives per row mined by neoembed mine (model {provenance['model']}, "
            f"{provenance['index']['kind']} index); rows whose query kept fewer than {k} negatives are left out. "
            "The source card's own negatives, if any, are not carried over."
        ),
        "provenance": {**provenance, "counts": counts},
    }
    try:
        DataCard.model_validate(raw)
    except ValidationError as e:  # a schema change elsewhere: say so rather than write a card nobody can read
        raise ValueError(format_validation_error(e, DataCard, str(card_path))) from None
    atomic_write_text(card_path, yaml.safe_dump(raw, sort_keys=False, allow_unicode=True, width=110))
    return MineResult(card_path, data_path, counts)
