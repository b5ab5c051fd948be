"""Qrels joins for mteb-style retrieval data: (query-id, corpus-id, score) qrels joined with the corpus and the
queries, without holding the corpus in memory.

The qrels (the small part: FEVER has 140k train pairs against 5.4M documents, MS MARCO 533k against 8.8M) are read
first and sampled (``max_rows``, seeded); then the corpus and the queries are streamed once, keeping only the
documents and queries that the kept qrels name. The full size is the number of positive qrels pairs.

Sources: a hub repository whose configs are the qrels (``default``), ``corpus`` and ``queries`` (mteb's layout),
or a local folder in the same layout (``qrels/<split>.tsv|jsonl[.gz]``, ``corpus.jsonl[.gz]`` or
``corpus/*.jsonl[.gz]``, likewise ``queries``).
"""

from __future__ import annotations

import csv
import gzip
import json
import random
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["join_hub", "join_local", "join_pairs"]

# rows {query: [...], positive: [...]}, the full size (positive qrels pairs), rows dropped per reason
Joined = tuple[dict[str, list[str]], int, dict[str, int]]


def join_pairs(
    pairs: list[tuple[str, str]],
    corpus: Iterable[dict],
    queries: Iterable[dict],
    max_rows: int | None = None,
    seed: int = 0,
    name: str = "join",
) -> Joined:
    """Sample ``pairs`` (query-id, corpus-id), then keep from ``corpus`` / ``queries`` only what they name (a
    progress bar on a terminal, named ``name``: a hub corpus is millions of rows)."""
    full = len(pairs)
    if max_rows is not None and full > max_rows:
        pairs = [pairs[i] for i in sorted(random.Random(seed).sample(range(full), max_rows))]
    need_docs, need_queries = {d for _, d in pairs}, {q for q, _ in pairs}
    docs = {}
    for r in _scan(corpus, f"{name}: corpus"):  # a repeated id keeps its first row, as the scan may end early
        if (i := str(r["_id"])) in need_docs and i not in docs:
            title = r.get("title") or ""
            docs[i] = f"{title} {r['text']}" if title else r["text"]
            if len(docs) == len(need_docs):  # every document the pairs name is found: the rest is not read
                break
    texts = {}
    for r in _scan(queries, f"{name}: queries"):
        if (i := str(r["_id"])) in need_queries and i not in texts:
            texts[i] = r["text"]
            if len(texts) == len(need_queries):
                break
    rows: dict[str, list[str]] = {"query": [], "positive": []}
    dropped: Counter = Counter()
    for q, d in pairs:
        if q not in texts:
            dropped["query missing"] += 1  # the qrels name a query the queries do not have
        elif d not in docs:
            dropped["positive missing"] += 1  # the qrels name a document the corpus does not have
        else:
            rows["query"].append(texts[q])
            rows["positive"].append(docs[d])
    return rows, full, dict(dropped)


def _scan(rows: Iterable[dict], desc: str) -> Iterable[dict]:
    from neoembed.progress import bar as progress_bar

    return progress_bar(rows, desc=desc, unit=" rows", unit_scale=True, leave=False, mininterval=1.0)


def _positive(rows: Iterable[dict]) -> list[tuple[str, str]]:
    return [(str(r["query-id"]), str(r["corpus-id"])) for r in rows if float(r.get("score", 1) or 0) > 0]


def join_hub(hub, max_rows: int | None = None, seed: int = 0) -> Joined:
    """The join for a hub repository in mteb's layout; the corpus and queries are streamed, not downloaded whole."""
    import datasets

    qrels = datasets.load_dataset(hub.id, hub.config, split=hub.split, revision=hub.revision)
    corpus = datasets.load_dataset(
        hub.id, hub.join.corpus, split="corpus", revision=hub.revision, streaming=True
    )
    queries = datasets.load_dataset(
        hub.id, hub.join.queries, split="queries", revision=hub.revision, streaming=True
    )
    return join_pairs(_positive(qrels), corpus, queries, max_rows, seed, name=hub.id)


def join_local(
    folder: Path, split: str = "train", join=None, max_rows: int | None = None, seed: int = 0
) -> Joined:
    """The join for a local folder in mteb's layout (see the module docstring)."""
    corpus_name = join.corpus if join is not None else "corpus"
    queries_name = join.queries if join is not None else "queries"
    qrels = _files(folder / "qrels", split) or _files(folder, f"qrels.{split}") or _files(folder, split)
    if not qrels:
        raise FileNotFoundError(
            f"{folder}: no qrels for split {split!r}; expected qrels/{split}.tsv (or .jsonl, .jsonl.gz, .tsv.gz)"
        )
    pairs = _positive(r for f in qrels for r in _read_table(f))
    corpus, queries = _named(folder, corpus_name), _named(folder, queries_name)
    return join_pairs(pairs, _stream(corpus), _stream(queries), max_rows, seed, name=folder.name)


_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".tsv", ".tsv.gz", ".csv", ".csv.gz")


def _files(folder: Path, stem: str) -> list[Path]:
    return [folder / f"{stem}{s}" for s in _SUFFIXES if (folder / f"{stem}{s}").is_file()]


def _named(folder: Path, name: str) -> list[Path]:
    sub = folder / name
    found = (
        sorted(f for f in sub.iterdir() if f.name.endswith(_SUFFIXES))
        if sub.is_dir()
        else _files(folder, name)
    )
    if not found:
        raise FileNotFoundError(
            f"{folder}: no {name} files; expected {name}.jsonl[.gz] or {name}/*.jsonl[.gz]"
        )
    return found


def _open(path: Path):
    return (
        gzip.open(path, "rt", encoding="utf8") if path.name.endswith(".gz") else open(path, encoding="utf8")
    )


def _read_table(path: Path) -> Iterator[dict]:
    with _open(path) as f:
        if ".tsv" in path.name or ".csv" in path.name:
            yield from csv.DictReader(f, delimiter="\t" if ".tsv" in path.name else ",")
        else:
            yield from (json.loads(line) for line in f if line.strip())


_ID = re.compile(r'"_id"\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+)')


class _Lazy(dict):
    """A JSON line whose ``_id`` is read first; the rest is parsed only if the row is asked for more."""

    def __init__(self, line: str, id_: str):
        super().__init__(_id=id_)
        self._line = line

    def _full(self):
        if len(self) == 1:
            self.update(json.loads(self._line))

    def __getitem__(self, k):
        if k != "_id":
            self._full()
        return super().__getitem__(k)

    def get(self, k, default=None):
        if k != "_id":
            self._full()
        return super().get(k, default)


def _stream(files: list[Path]) -> Iterator[dict]:
    """Rows of JSONL files with a cheap ``_id`` (a regex, not a JSON parse): most corpus lines are skipped unread."""
    for path in files:
        if not path.name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz")):
            yield from _read_table(path)
            continue
        with _open(path) as f:
            for line in f:
                # the regex reads the top-level _id only when "_id" occurs once (a nested object may have its own)
                m = _ID.search(line) if line.count('"_id"') == 1 else None
                if m is None:
                    if line.strip():
                        yield json.loads(line)
                    continue
                raw = m.group(1)
                yield _Lazy(line, json.loads(raw) if raw.startswith('"') else raw)
