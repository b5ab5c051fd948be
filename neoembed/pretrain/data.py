"""Token shards on disk: tokenize a corpus once, read it back as documents of token ids.

Layout of a shard folder (written by :func:`preprocess`, read by :class:`ShardedCorpus`)::

    meta.json                 tokenizer, source, dtype, special ids; "complete" once every document is in
    progress.json             documents consumed and shards written so far (makes preprocessing resumable)
    shard-00000.tokens.npy    every document's token ids, concatenated ([CLS] text [SEP] per document)
    shard-00000.offsets.npy   (n_docs + 1,) int64 start of each document in the tokens file
    stats.json                length statistics (documents, tokens, quantiles, counts above 512 ... 4,096)
    subsets/gt1024/           a length-filtered subset: subset.json + docs.npy (indices into the parent)

Subsets are indices, not copies: the stage-2 mixture (full corpus, documents longer than 1,024 and longer
than 2,048 tokens) costs no extra disk.

Sources: local ``.txt`` / ``.md`` / ``.rst`` files (one document per file), ``.jsonl`` / ``.jsonl.gz`` /
``.json`` (one document per row, text in ``column``), folders of those (recursive, hidden files and folders
skipped), or a hub dataset read in streaming mode (``hub:ID[:CONFIG]`` or a corpus card such as
``data_cards/corpora/refinedweb.yaml``).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import yaml
from pydantic import ValidationError

from neoembed.card_schema import CorpusCard, CorpusColumns, HubSource, Source
from neoembed.hub import model_name
from neoembed.recipe import RecipeError, format_validation_error, resolve_named_file
from neoembed.record import atomic_write_text

__all__ = [
    "CorpusCard",
    "ShardedCorpus",
    "build_subset",
    "iter_documents",
    "length_stats",
    "load_corpus_card",
    "load_tokenizer",
    "preprocess",
]

logger = logging.getLogger(__name__)
TEXT_SUFFIXES = (".txt", ".md", ".rst")
JSON_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")


def load_tokenizer(name: str):
    """``AutoTokenizer.from_pretrained(name)``; a name that is neither a local tokenizer folder nor reachable on
    the Hugging Face Hub is an ``OSError`` (exit 2) that says which and what to pass instead."""
    from transformers import AutoTokenizer

    from neoembed.hub import resolve_packaged

    try:
        return AutoTokenizer.from_pretrained(resolve_packaged(name))  # packaged:all-MiniLM-L6-v2 as --model takes it
    except OSError as e:
        where = (
            "" if Path(name).is_dir() else ": not a local folder, and the Hugging Face Hub could not serve it"
        )
        raise OSError(
            f"could not load tokenizer {name!r}{where} ({str(e).splitlines()[0]}); pass a local tokenizer folder "
            "(a model folder holds one), or check the hub id and your network"
        ) from None


# ------------------------------------------------------------------------------------------- corpus cards
# The corpus card's schema (CorpusCard, its hub / local source) lives in neoembed.card_schema, shared with the
# training and evaluation cards.


def load_corpus_card(name_or_path: str | Path) -> tuple[CorpusCard, Path]:
    """A corpus card by path or shipped name (``refinedweb`` resolves to ``data_cards/corpora/refinedweb.yaml``)."""
    p = Path(name_or_path)
    if not p.is_file():
        p = resolve_named_file(f"corpora/{name_or_path}", "data_cards")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf8")) or {}
        return CorpusCard.model_validate(raw), p.parent
    except ValidationError as e:
        raise RecipeError(format_validation_error(e, CorpusCard, str(p))) from None


# ------------------------------------------------------------------------------------------------ reading
def _local_files(path: Path) -> list[Path]:
    """The corpus files of a file or folder: one rule for both, the suffixes :func:`_read_file` knows. A folder's
    hidden files and folders (names starting with ".": .ipynb_checkpoints, .git) are skipped: they hold copies
    and tools' files, not documents."""
    if path.is_file():
        if not path.name.lower().endswith(TEXT_SUFFIXES + JSON_SUFFIXES):
            # anything else would be parsed as JSON lines and fail as "cannot be read", which reads as a damaged copy
            raise ValueError(
                f"corpus file {path}: unsupported file type ({path.suffix or 'no suffix'}); supported: "
                f"{', '.join(TEXT_SUFFIXES)} (one document per file), {', '.join(JSON_SUFFIXES)} (one per row): "
                "convert it to JSON lines (pandas: read_parquet or read_csv, then to_json(..., orient='records', "
                "lines=True)), or give a text file its .txt suffix"
            )
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"corpus {path} does not exist: pass a text/JSONL file, a folder, or hub:ID")
    visible = [
        f for f in path.rglob("*") if f.is_file() and not any(p.startswith(".") for p in f.relative_to(path).parts)
    ]
    files = sorted(f for f in visible if f.name.lower().endswith(TEXT_SUFFIXES + JSON_SUFFIXES))
    if others := sorted(set(visible) - set(files)):
        _warn_unread(path, tuple(f.relative_to(path).as_posix() for f in others))
    if not files:
        raise FileNotFoundError(
            f"no corpus files under {path}: expected {', '.join(TEXT_SUFFIXES + JSON_SUFFIXES)} (hidden files and "
            "folders, whose names start with '.', are skipped)"
        )
    return files


@functools.cache  # once per folder and process: the files are listed again to fingerprint and to read them
def _warn_unread(folder: Path, names: tuple[str, ...]) -> None:
    """A folder's files of other types are left out: a parquet or CSV part of a corpus would vanish unsaid."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    logger.warning(
        "corpus folder %s: %d file(s) of other types are not read: %s (read: %s; convert data files to JSON lines)",
        folder,
        len(names),
        shown,
        ", ".join(TEXT_SUFFIXES + JSON_SUFFIXES),
    )


def _iter_file(path: Path, column: str) -> Iterator[str]:
    """A file's documents; a file that cannot be read (truncated .gz, not UTF-8, not JSON) is a ``ValueError``
    naming it (exit 2), not the library's anonymous error."""
    try:
        yield from _read_file(path, column)
    except (EOFError, UnicodeDecodeError, json.JSONDecodeError, gzip.BadGzipFile) as e:
        raise ValueError(
            f"corpus file {path} cannot be read ({type(e).__name__}: {e}): is it complete UTF-8 text or JSON "
            "lines (a truncated .gz fails `gzip -t`)? Copy it again or remove it"
        ) from None


def _check_text(path: Path, text: str) -> str:
    """Refuse a text file that is not text (random or binary bytes decode to U+FFFD replacement characters)."""
    bad = text.count("\ufffd") + text.count("\x00")
    if bad > max(8, len(text) // 100):
        raise ValueError(
            f"corpus file {path} is not UTF-8 text ({bad} of {len(text)} characters undecodable or NUL): "
            "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) or remove it from the corpus"
        )
    return text


def _json_kind(value) -> str:
    """A parsed JSON value's kind, as JSON names it."""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}
    kinds[type(None)] = "null"
    return kinds.get(type(value), type(value).__name__)


def _read_file(path: Path, column: str) -> Iterator[str]:
    # utf-8-sig: a byte-order mark (what Windows editors write first) is dropped, not read as text or as JSON
    name = path.name.lower()
    if name.endswith(TEXT_SUFFIXES):
        text = _check_text(path, path.read_text(encoding="utf-8-sig", errors="replace"))
        if text.strip():
            yield text
        return
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8-sig") as f:
        if name.endswith((".json", ".json.gz")) and f.read(1) == "[":
            f.seek(0)
            rows = ((f"row {i}", row) for i, row in enumerate(json.load(f), 1))
        else:
            f.seek(0)
            rows = ((f"line {n}", _json_line(path, n, line)) for n, line in enumerate(f, 1) if line.strip())
        for where, row in rows:
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}, {where}: not a JSON object ({_json_kind(row)}): {json.dumps(row)[:80]}; each "
                    f'row is one document, an object such as {{"{column}": "..."}}: fix or remove that row'
                )
            if column not in row:
                raise ValueError(f"{path}, {where}, has no column {column!r} (columns: {sorted(row)}); pass --column")
            text = row[column]
            if text is not None and not isinstance(text, str):  # a number or a list: a data error, not a blank
                raise ValueError(
                    f"{path}, {where}: its {column!r} is {_json_kind(text)}, not text: {json.dumps(text)[:80]}; "
                    "fix or remove that row"
                )
            if text is not None and text.strip():  # null or blank: no document, as an empty file is none
                yield text


def _json_line(path: Path, number: int, line: str):
    """One line of a JSON-lines file, parsed; a line that is not JSON is named by its number in the file."""
    try:
        return json.loads(line)
    except ValueError as e:
        raise ValueError(f"{path}, line {number}: not JSON ({e}): fix or remove that line") from None


def iter_documents(source: str, column: str = "text") -> Iterator[str]:
    """Documents (strings) of a local path, ``hub:ID[:CONFIG]`` (streamed) or a corpus card name/path."""
    if source.startswith("hub:"):
        parts = source[4:].split(":")
        card = CorpusCard(
            name=parts[0],
            source=Source(hub=HubSource(id=parts[0], config=parts[1] if len(parts) > 1 else None)),
            columns=CorpusColumns(text=column),
        )
        yield from _iter_card(card, Path("."))
        return
    path = Path(source)
    if path.suffix in (".yaml", ".yml") or (not path.exists() and "/" not in source):
        card, folder = load_corpus_card(source)
        yield from _iter_card(card, folder)
        return
    for f in _local_files(path):
        yield from _iter_file(f, column)


def _iter_card(card: CorpusCard, folder: Path) -> Iterator[str]:
    if card.source.local is not None:
        for f in _local_files((folder / card.source.local.path).resolve()):
            yield from _iter_file(f, card.columns.text)
        return
    import datasets

    from neoembed.data.check import hub_unreachable_reason
    from neoembed.data.errors import hub_offline_mode

    hub = card.source.hub
    # one probe first: offline, the dataset client retries for about half a minute before it gives up
    down = "HF_HUB_OFFLINE is set" if hub_offline_mode() else hub_unreachable_reason()
    if down is not None:
        raise OSError(
            f"could not stream hub dataset {hub.id!r}: the Hugging Face hub cannot be reached ({down}). Offline, "
            "point preprocess at local files instead."
        )
    try:
        ds = datasets.load_dataset(hub.id, hub.config, split=hub.split, revision=hub.revision, streaming=True)
        for row in ds:
            text = row.get(card.columns.text)
            if isinstance(text, str) and text.strip():
                yield text
    except (OSError, ConnectionError, ValueError) as e:
        raise OSError(
            f"could not stream hub dataset {hub.id!r} (config {hub.config}, split {hub.split}): {e}. "
            "Is the Hugging Face hub reachable? Offline, point preprocess at local files instead."
        ) from e


# ---------------------------------------------------------------------------------------------- writing
def _token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def _save_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def _source_fingerprint(source: str) -> dict:
    """A local corpus (a file or folder) as the path it resolves to and its files' names, sizes and modification
    times: a rerun resumes by skipping the documents already written, which is right only on the same files, and a
    finished folder is reused only for them. A corpus card or hub id: its name (the card's files are its own)."""
    path = Path(source)
    if source.startswith("hub:") or path.suffix in (".yaml", ".yml") or not path.exists():
        return {"source": source}
    files = _local_files(path)
    root = path if path.is_dir() else path.parent
    listed = [(f.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()]]
    return {
        "source": str(path.resolve()),
        "files": hashlib.sha256(json.dumps(listed).encode()).hexdigest(),
    }


def vocab_sha256(tokenizer) -> str:
    """A tokenizer's vocabulary (token -> id) as a hash: what a shard folder was tokenized with."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()


def _shard_meta(out: Path, source: str, tokenizer, column: str, max_docs: int | None, shard_tokens: int):
    """The ``meta.json`` a shard folder gets, and the progress to resume from; refuses a folder that holds
    shards of other inputs (a resume must reread exactly the documents it skips)."""
    fingerprint = {
        **_source_fingerprint(str(source)),
        "column": column,
        "tokenizer": model_name(tokenizer.name_or_path) if getattr(tokenizer, "name_or_path", None) else None,
        "vocab_size": len(tokenizer),
        # the vocabulary itself: two tokenizers with one name and size (a retrained local one) still differ here
        "vocab_sha256": vocab_sha256(tokenizer),
        "max_docs": max_docs,
        "shard_tokens": shard_tokens,
    }
    meta = {
        **fingerprint,
        "format": 1,
        "dtype": np.dtype(_token_dtype(len(tokenizer))).name,
        "special_ids": sorted(set(tokenizer.all_special_ids)),
        "mask_token_id": tokenizer.mask_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "complete": False,
    }
    state = {"docs": 0, "shards": 0, "tokens": 0}
    if (out / "meta.json").exists():
        old = json.loads((out / "meta.json").read_text())
        if old.get("tokenizer"):  # a folder begun before the packaged tokenizer was recorded by name
            old["tokenizer"] = model_name(old["tokenizer"])
        diff = [f"{k}: {old.get(k)!r} there, {v!r} now" for k, v in fingerprint.items() if old.get(k) != v]
        if diff:
            raise ValueError(
                f"{out} already holds shards made from other inputs or another tokenizer ({'; '.join(diff)}): "
                "rerun with the same inputs to resume (a corpus whose files changed is other inputs), or choose "
                "a new output folder"
            )
        meta["complete"] = old.get("complete", False)
        if (out / "progress.json").exists():
            state = json.loads((out / "progress.json").read_text())
    return meta, state


class _ShardWriter:
    """Token ids gathered into shards of at least ``shard_tokens`` tokens; each shard written moves
    ``progress.json`` to the documents consumed so far (where a rerun resumes)."""

    def __init__(self, out: Path, dtype, shard_tokens: int, state: dict):
        self.out, self.dtype, self.shard_tokens, self.state = out, dtype, shard_tokens, state
        self.pieces: list[np.ndarray] = []
        self.n_in_shard, self.consumed = 0, state["docs"]

    def add(self, ids: list[int]) -> None:
        self.pieces.append(np.asarray(ids, dtype=np.int64))
        self.n_in_shard += len(ids)
        self.consumed += 1
        if self.n_in_shard >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.pieces:
            return
        lengths = np.array([len(p) for p in self.pieces], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        idx, state = self.state["shards"], self.state
        _save_npy(self.out / f"shard-{idx:05d}.tokens.npy", np.concatenate(self.pieces).astype(self.dtype))
        _save_npy(self.out / f"shard-{idx:05d}.offsets.npy", offsets)
        state.update(docs=self.consumed, shards=idx + 1, tokens=state["tokens"] + int(offsets[-1]))
        atomic_write_text(self.out / "progress.json", json.dumps(state) + "\n")
        self.pieces, self.n_in_shard = [], 0


def _write_shards(
    docs: Iterator[str], writer: _ShardWriter, tokenizer, max_docs, batch_size: int, progress: bool
):
    """Tokenize ``docs`` in batches into ``writer``, skipping the documents of finished shards first."""
    from neoembed.progress import bar as progress_bar

    skipped = 0
    while skipped < writer.consumed and next(docs, None) is not None:  # resume: skip finished documents
        skipped += 1
    bar = progress_bar(
        total=max_docs, initial=writer.consumed, unit="doc", desc="tokenizing", disable=not progress
    )

    def encode(texts):
        enc = tokenizer(texts, add_special_tokens=True, return_attention_mask=False, verbose=False)
        for ids in enc["input_ids"]:
            writer.add(ids)
        bar.update(len(texts))

    batch = []
    for text in docs:
        if max_docs is not None and writer.consumed + len(batch) >= max_docs:
            break
        batch.append(text)
        if len(batch) >= batch_size:
            encode(batch)
            batch = []
    if batch:
        encode(batch)
    writer.flush()
    bar.close()


def preprocess(
    source: str,
    out_dir: str | Path,
    tokenizer,
    column: str = "text",
    shard_tokens: int = 50_000_000,
    max_docs: int | None = None,
    batch_size: int = 256,
    min_lengths: tuple[int, ...] = (),
    progress: bool = True,
) -> dict:
    """Tokenize ``source`` into shards under ``out_dir``; returns the length statistics.

    Each document becomes ``[CLS] text [SEP]`` (no truncation). Resumable: rerun the same command after an
    interruption and it skips the documents already in finished shards. ``min_lengths`` builds the
    length-filtered subsets (documents with more than L tokens) at the end.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta, state = _shard_meta(out, source, tokenizer, column, max_docs, shard_tokens)
    if not meta["complete"]:
        atomic_write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n")
        writer = _ShardWriter(out, _token_dtype(len(tokenizer)), shard_tokens, state)
        _write_shards(iter_documents(source, column), writer, tokenizer, max_docs, batch_size, progress)
        if not any(out.glob("shard-*.tokens.npy")):
            raise ValueError(
                f"corpus {source} holds no documents (its files are empty or blank, or no row has a non-empty "
                f"{column!r}): nothing to tokenize - check the path, or pass --column"
            )
        meta["complete"] = True
        atomic_write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n")
    else:
        logger.info("%s already holds the finished shards of these inputs: nothing tokenized", out)
    corpus = ShardedCorpus(out)
    stats = length_stats(corpus.lengths)
    atomic_write_text(out / "stats.json", json.dumps(stats, indent=2) + "\n")
    for n in min_lengths:
        build_subset(out, n)
    return stats


def length_stats(lengths: np.ndarray) -> dict:
    """Documents, tokens, mean / quantiles / max of the length, and documents above common context sizes."""
    lengths = np.asarray(lengths)
    if len(lengths) == 0:
        return {"documents": 0, "tokens": 0}
    q = np.percentile(lengths, [10, 50, 90, 99])
    return {
        "documents": int(len(lengths)),
        "tokens": int(lengths.sum()),
        "mean": round(float(lengths.mean()), 1),
        "p10": int(q[0]),
        "median": int(q[1]),
        "p90": int(q[2]),
        "p99": int(q[3]),
        "max": int(lengths.max()),
        "longer_than": {str(n): int((lengths > n).sum()) for n in (128, 512, 1024, 2048, 4096)},
    }


def build_subset(shard_dir: str | Path, min_length: int) -> Path:
    """Index the documents with more than ``min_length`` tokens as ``shard_dir/subsets/gt{min_length}``."""
    corpus = ShardedCorpus(shard_dir)
    docs = np.nonzero(corpus.lengths > min_length)[0].astype(np.int64)
    target = Path(shard_dir) / "subsets" / f"gt{min_length}"
    target.mkdir(parents=True, exist_ok=True)
    _save_npy(target / "docs.npy", docs)
    info = {"parent": "../..", "min_length": min_length, "documents": int(len(docs))}
    info["tokens"] = int(corpus.lengths[docs].sum()) if len(docs) else 0
    atomic_write_text(target / "subset.json", json.dumps(info, indent=2) + "\n")
    return target


# ---------------------------------------------------------------------------------------------- reading
#: shard files up to this size are hashed whole for :meth:`ShardedCorpus.content_key`
HASHED_WHOLE = 64 * 2**20

def _load_shard_array(path: Path, mmap: bool = False) -> np.ndarray:
    """One ``.npy`` array of a shard folder; a missing, truncated or corrupt file is named (exit 2)."""
    try:
        return np.load(path, mmap_mode="r" if mmap else None)
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(
            f"shard file {path} cannot be read ({e}): the shard folder is incomplete or damaged; run "
            "`neoembed preprocess` again into a new folder"
        ) from None


class ShardedCorpus:
    """Documents of a shard folder (or of a subset folder), memory-mapped: ``corpus[i]`` is an int64 array."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        docs = None
        if (self.path / "subset.json").is_file():
            info = json.loads((self.path / "subset.json").read_text())
            docs = np.load(self.path / "docs.npy")
            root = (self.path / info["parent"]).resolve()
        else:
            root = self.path
        if not (root / "meta.json").is_file():
            raise FileNotFoundError(
                f"{self.path} is not a shard folder (no meta.json): make one with `neoembed preprocess`"
            )
        self.meta = json.loads((root / "meta.json").read_text())
        if self.meta.get("complete") is False:  # what a preprocess stopped midway leaves: part of the corpus
            progress = root / "progress.json"
            done = json.loads(progress.read_text()).get("docs") if progress.is_file() else None
            raise ValueError(
                f"{root} is unfinished: its preprocess stopped before the end (meta.json says complete: false"
                + (f"; {done:,} documents so far" if isinstance(done, int) else "")
                + "): rerun the same `neoembed preprocess` command to finish it"
            )
        shards = sorted(root.glob("shard-*.tokens.npy"))
        if not shards:
            raise FileNotFoundError(f"{root} holds no shards yet: run (or finish) `neoembed preprocess`")
        self._shards = shards
        self._tokens = [_load_shard_array(s, mmap=True) for s in shards]
        self._vocab = self.meta.get("vocab_size")
        offsets = [_load_shard_array(Path(str(s).replace(".tokens.npy", ".offsets.npy"))) for s in shards]
        for s, tokens, o in zip(shards, self._tokens, offsets, strict=True):
            if len(o) == 0 or int(o[-1]) > len(tokens):
                raise ValueError(
                    f"shard {s} is truncated ({len(tokens)} tokens, its offsets need {int(o[-1]) if len(o) else '?'}):"
                    " run `neoembed preprocess` again into a new folder"
                )
        n_per = np.array([len(o) - 1 for o in offsets])
        self._shard_of = np.repeat(np.arange(len(shards)), n_per)
        self._starts = np.concatenate([o[:-1] for o in offsets]).astype(np.int64)
        self._lengths = np.concatenate([np.diff(o) for o in offsets]).astype(np.int64)
        self._docs = docs  # None = every document
        self._root = root
        self.fingerprint = hashlib.sha256(
            json.dumps([self.meta.get("source"), int(self._lengths.sum()), len(self._lengths)]).encode()
            + (docs.tobytes() if docs is not None else b"")
        ).hexdigest()[:16]

    def content_key(self) -> str:
        """What a resume compares, so that a run does not continue on other or edited shards: the folder's
        ``meta.json``, a subset's index, and each shard file by its bytes; a file over :data:`HASHED_WHOLE` by
        its size and its first and last MiB (hashing terabytes at every start would cost more than an edit in
        place risks). By content, so a copy of the folder elsewhere has the same key."""
        h = hashlib.sha256((self._root / "meta.json").read_bytes())
        if self._docs is not None:
            h.update(self._docs.tobytes())
        for f in sorted(self._root.glob("shard-*.npy")):
            size = f.stat().st_size
            h.update(f"{f.name}:{size}:".encode())
            with open(f, "rb") as fh:
                if size <= HASHED_WHOLE:
                    h.update(fh.read())
                else:
                    h.update(fh.read(1 << 20))
                    fh.seek(size - (1 << 20))
                    h.update(fh.read())
        return h.hexdigest()[:16]

    def __len__(self) -> int:
        return len(self._lengths) if self._docs is None else len(self._docs)

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths if self._docs is None else self._lengths[self._docs]

    def __getitem__(self, i: int) -> np.ndarray:
        j = int(i) if self._docs is None else int(self._docs[i])
        s, shard = self._starts[j], self._shard_of[j]
        raw = self._tokens[shard][s : s + self._lengths[j]]
        # one reduction per document on the stored ids (uint16 ids cannot be negative), so that a damaged shard
        # is named here, not by the model's embedding
        if self._vocab is not None and len(raw) and (
            raw.max() >= self._vocab or (raw.dtype.kind == "i" and raw.min() < 0)
        ):
            bad = int(raw.max() if raw.max() >= self._vocab else raw.min())
            raise ValueError(
                f"shard {self._shards[shard]} holds token id {bad} (document {j}), outside the vocabulary of "
                f"{self._vocab} tokens its meta.json records: the shard is damaged or was not written by "
                "`neoembed preprocess`; run it again into a new folder"
            )
        return np.asarray(raw, dtype=np.int64)
