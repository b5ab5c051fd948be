"""Local retrieval tasks derived from ../shared/data (none of its folders is a retrieval task), written as mteb's
retrieval files (``corpus``, ``queries``, ``qrels/test``) with a ``task.yaml`` card, so ``neoembed mteb --data-dir``
runs them as full-corpus retrieval (main score nDCG@10):

- ``TrecQARetrieval``: each TrecQA test question searches the pooled candidate sentences of every question
  (positives relevant); a reranking set turned into retrieval over its whole candidate pool.
- ``MSRPRetrieval``: each MSRP test pair labelled paraphrase: ``sentence1`` searches every ``sentence2`` of the split.
- ``STS16Retrieval``: each STS16 test pair scored 4 or more: ``sentence1`` searches every ``sentence2``.

Texts are deduplicated (one id per distinct text); a query whose relevant text is itself a corpus text is kept.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import yaml

_REPO = Path(__file__).resolve().parents[1]
# ../shared beside the checkout, else the copy the tests carry (a lone clone; tests/test_mteb.py builds from it)
SHARED = _REPO.parent / "shared" if (_REPO.parent / "shared").is_dir() else _REPO / "tests" / "shared"
TASKS = ("TrecQARetrieval", "MSRPRetrieval", "STS16Retrieval")


def _read(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf8") as f:
        return [json.loads(line) for line in f]


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def write_task(
    dst: Path, name: str, pairs: list[tuple[str, list[str]]], corpus: list[str], about: str
) -> Path:
    """One retrieval folder: ``pairs`` of (query, relevant texts) searching ``corpus`` (relevant texts added)."""
    doc_id: dict[str, str] = {}
    for text in [*corpus, *(t for _, rel in pairs for t in rel)]:
        doc_id.setdefault(text, f"d{len(doc_id)}")
    query_id: dict[str, str] = {}
    qrels = []
    for query, relevant in pairs:
        qid = query_id.setdefault(query, f"q{len(query_id)}")
        qrels += [{"query-id": qid, "corpus-id": doc_id[t], "score": 1} for t in relevant]
    folder = dst / name
    _write(folder / "corpus.jsonl.gz", [{"_id": i, "title": "", "text": t} for t, i in doc_id.items()])
    _write(folder / "queries.jsonl.gz", [{"_id": i, "text": q} for q, i in query_id.items()])
    _write(folder / "qrels" / "test.jsonl.gz", qrels)
    card = {
        "name": name,
        "type": "Retrieval",
        "description": f"{about} ({len(query_id)} queries, {len(doc_id)} documents)",
    }
    (folder / "task.yaml").write_text(yaml.safe_dump(card, sort_keys=False))
    return folder


def trecqa(dst: Path, rows: int | None = None, shared: Path = SHARED) -> Path:
    data = _read(shared / "data" / "eval" / "TrecQA" / "test.jsonl.gz")[:rows]
    corpus = [t for r in data for t in (*r["positive"], *r["negative"])]
    pairs = [(r["query"], list(r["positive"])) for r in data]
    return write_task(
        dst, "TrecQARetrieval", pairs, corpus, "TrecQA test questions over all candidate answers"
    )


def _pairs_task(dst, name, rows, keep, about):
    return write_task(dst, name, [(r["sentence1"], [r["sentence2"]]) for r in rows if keep(r)],
                      [r["sentence2"] for r in rows], about)  # fmt: skip


def msrp(dst: Path, rows: int | None = None, shared: Path = SHARED) -> Path:
    data = _read(shared / "data" / "eval" / "MSRP" / "test.jsonl.gz")[:rows]
    return _pairs_task(dst, "MSRPRetrieval", data, lambda r: int(r["label"]) == 1,
                       "MSRP test paraphrases: sentence1 finds its sentence2 among all")  # fmt: skip


def sts16(dst: Path, rows: int | None = None, shared: Path = SHARED) -> Path:
    data = _read(shared / "data" / "mteb" / "STS16" / "test.jsonl.gz")[:rows]
    return _pairs_task(dst, "STS16Retrieval", data, lambda r: float(r["score"]) >= 4.0,
                       "STS16 test pairs scored >= 4: sentence1 finds its sentence2 among all")  # fmt: skip


def write_all(dst: Path, rows: int | None = None) -> list[Path]:
    return [trecqa(dst, rows), msrp(dst, rows), sts16(dst, rows)]
