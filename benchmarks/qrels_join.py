"""Peak memory and seconds of a qrels join on a synthetic mteb-layout corpus (FEVER / MS MARCO scale).

    python benchmarks/qrels_join.py                       # 1,000,000 documents, 100,000 qrels; ~3 min on 2 cores
    python benchmarks/qrels_join.py --docs 200000 --quick # a smaller run, not recorded

Writes a folder in mteb's layout (``corpus.jsonl``, ``queries.jsonl``, ``qrels/train.tsv``; documents of about 300
characters, like MS MARCO passages), then times three joins, each in its own process so that its peak resident
memory (ru_maxrss) is its own:

* ``max_rows=10000``: neoembed's join (``neoembed.data.qrels.join_local``) keeping a seeded sample of 10,000 pairs;
* ``all``: the same join with every qrels pair;
* ``dict (before)``: the join as it was before (a Python dict of the whole corpus, then the qrels) for reference.

Each child reports its resident memory after imports and its peak; their difference is what the join costs.
Results: ``benchmarks/results/qrels_join.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = (
    "river mountain city history water energy system market science music language health school family "
    "government season island forest computer network protein climate election museum bridge winter"
).split()


def write_corpus(root: Path, n_docs: int, n_qrels: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    (root / "qrels").mkdir(parents=True, exist_ok=True)
    with open(root / "corpus.jsonl", "w", encoding="utf8") as f:
        for d in range(n_docs):
            text = " ".join(rng.choice(WORDS) for _ in range(42))
            f.write(json.dumps({"_id": f"d{d}", "title": f"Title {d}", "text": text}) + "\n")
    with open(root / "queries.jsonl", "w", encoding="utf8") as f:
        for q in range(n_qrels):
            f.write(json.dumps({"_id": f"q{q}", "text": f"what is the {rng.choice(WORDS)} of {q}?"}) + "\n")
    with open(root / "qrels" / "train.tsv", "w", encoding="utf8") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for q in range(n_qrels):
            f.write(f"q{q}\td{rng.randrange(n_docs)}\t1\n")


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _dict_join(folder: Path) -> int:
    """The join before this change: every corpus document in a dict, then the qrels."""
    import csv

    docs = {}
    with open(folder / "corpus.jsonl", encoding="utf8") as f:
        for line in f:
            r = json.loads(line)
            docs[r["_id"]] = (r.get("title") or "") + (" " if r.get("title") else "") + r["text"]
    with open(folder / "queries.jsonl", encoding="utf8") as f:
        qs = {r["_id"]: r["text"] for r in map(json.loads, f)}
    with open(folder / "qrels" / "train.tsv", encoding="utf8") as f:
        rows = [(qs.get(r["query-id"]), docs.get(r["corpus-id"])) for r in csv.DictReader(f, delimiter="\t")]
    return sum(1 for q, d in rows if q and d)


def child(mode: str, folder: Path) -> None:
    """One join in this process; prints a JSON line with seconds, rows, RSS after imports and peak RSS."""
    from neoembed.data import qrels

    before = _rss_mib()
    t0 = time.perf_counter()
    if mode == "dict":
        rows = _dict_join(folder)
    else:
        out, _, _ = qrels.join_local(folder, "train", None, None if mode == "all" else int(mode), seed=0)
        rows = len(out["query"])
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "mode": mode,
                "seconds": seconds,
                "rows": rows,
                "rss_after_imports_mib": before,
                "peak_mib": peak,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--qrels", type=int, default=100_000)
    ap.add_argument("--quick", action="store_true", help="do not record the results")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "FOLDER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], Path(args.child[1]))
    sys.path.insert(0, str(REPO / "benchmarks"))
    from _common import RESULTS, header

    from neoembed.record import atomic_write_text

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "corpus"
        t0 = time.perf_counter()
        write_corpus(folder, args.docs, args.qrels)
        write_s = time.perf_counter() - t0
        size_mib = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
        results = []
        for mode in ("10000", "all", "dict"):
            r = subprocess.run(
                [sys.executable, __file__, "--child", mode, str(folder)],
                capture_output=True,
                text=True,
                check=True,
            )
            results.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(results[-1], flush=True)
    record = {
        **header(),
        "docs": args.docs,
        "qrels": args.qrels,
        "corpus_mib": size_mib,
        "write_s": write_s,
        "results": results,
    }
    if args.quick:
        return
    (RESULTS / "qrels_join.json").write_text(json.dumps(record, indent=2) + "\n")
    names = {
        "10000": "neoembed join, max_rows 10,000",
        "all": "neoembed join, all qrels",
        "dict": "dict of the corpus (before)",
    }
    lines = [
        "<!-- written by benchmarks/qrels_join.py; do not edit by hand -->",
        "# Qrels join on a synthetic mteb-layout corpus",
        "",
        f"Command: `{record['command']}`  ",
        f"Commit: `{record['commit']}`  ",
        f"Hardware: {record['hardware']}  ",
        f"Corpus: {args.docs:,} documents ({size_mib:.0f} MiB of JSONL), {args.qrels:,} queries and qrels pairs.",
        "",
        "| join | rows | seconds | RSS after imports (MiB) | peak RSS (MiB) | join's own memory (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {names[r['mode']]} | {r['rows']:,} | {r['seconds']:.1f} | {r['rss_after_imports_mib']:.0f} | "
            f"{r['peak_mib']:.0f} | {r['peak_mib'] - r['rss_after_imports_mib']:.0f} |"
        )
    atomic_write_text(RESULTS / "qrels_join.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
