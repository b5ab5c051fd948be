"""Encoding throughput on a mixed set, token-budget batches against count batches (#39, part c of scale.py).

    python benchmarks/scale_encode.py --quick          # CPU: 90 sentences + 10 documents, 2 repeats
    python benchmarks/scale_encode.py                  # CPU: 180 sentences + 20 documents, 3 repeats
    python benchmarks/scale_encode.py --device cuda    # 18,000 + 2,000 at max length 4,096, bf16

The set is ``benchmarks/encode.py``'s: the real sentences of ../shared/data/mteb/* mixed 9:1 with its long
documents (512-4,096 tokens), shuffled, truncated at each model's max length. Each model encodes the set with
``encode(texts, batch_size=32)`` (sentence-transformers' count batches: what ``neoembed mteb`` and ``score`` ran
before) and ``encode(texts, max_batch_tokens=N)`` (neoembed.batching: the device's default budget, and twice
it), interleaved, several repeats; rows give the median texts/s and tokens/s (real tokens, after
truncation), the ratio to count batches, the largest batch a forward saw (padded ``rows x width`` or packed
tokens: what peak activation memory scales with) and the largest embedding difference to count batches.

Models: the packaged all-MiniLM-L6-v2 (max length 256) and a NeoBERT of MiniLM's width (6 layers, 384 wide,
random weights: speed does not depend on them; max length 512 on CPU) in its padded and padding-free layouts.
``scale.py`` calls :func:`run` and writes the record; run alone, this script writes
benchmarks/results/scale_encode_<device>.md (+ .json).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import numpy as np
import torch
from _common import header, sync, write_results
from encode import TOKENIZER, long_documents, mteb_sentences
from transformers import AutoTokenizer

import neoembed
from neoembed.batching import default_max_batch_tokens
from neoembed.modeling import NeoBERTConfig, NeoBERTModel

COUNT_BATCH = 32


def mixed_texts(n_sentences: int, n_documents: int, seed: int = 0) -> list[str]:
    """``n_sentences`` MTEB sentences and ``n_documents`` long documents, shuffled together."""
    sentences = mteb_sentences()
    random.Random(seed).shuffle(sentences)
    texts = sentences[:n_sentences] + long_documents(sentences, n_documents, seed)
    random.Random(seed + 1).shuffle(texts)
    return texts


def _neobert(folder: str, device: str, dtype, max_length: int):
    torch.manual_seed(0)
    config = NeoBERTConfig(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536
    )
    NeoBERTModel(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(TOKENIZER)).save_pretrained(folder)
    return neoembed.load(folder, device=device, dtype=dtype, max_seq_length=max_length)


def _models(folder: str, device: str, dtype, max_length: int) -> dict:
    """name -> (model, padding_free setting or None)."""
    neo = _neobert(folder, device, dtype, max_length)
    models = {"NeoBERT 6x384 padded": (neo, False), "NeoBERT 6x384 padding-free": (neo, True)}
    models["all-MiniLM-L6-v2"] = (
        neoembed.load("packaged:all-MiniLM-L6-v2", device=device, dtype=dtype),
        None,
    )
    return models


def _largest_batch(model) -> tuple[list[int], object]:
    """A hook recording the largest input a forward of ``model`` sees (B x L ids), and its handle."""
    seen = [0]

    def hook(_module, args):
        seen[0] = max(seen[0], int(args[0]["input_ids"].numel()))

    return seen, model[0].register_forward_pre_hook(hook)


def _arms(device: str) -> dict[str, dict]:
    budget = default_max_batch_tokens(device)
    arms = {f"count batches ({COUNT_BATCH})": {"batch_size": COUNT_BATCH}}
    for n in (budget, budget * 2):
        arms[f"token budget {n}" + (" (default)" if n == budget else "")] = {"max_batch_tokens": n}
    return arms


def run(device: str = "cpu", quick: bool = False, reps: int | None = None) -> tuple[list[dict], str]:
    """Measure every model and arm; returns (rows, markdown table)."""
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    n_sent, n_docs = (18_000, 2_000) if cuda else ((90, 10) if quick else (180, 20))
    reps = reps or (3 if not quick else 2)
    texts = mixed_texts(n_sent, n_docs)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (model, padding_free) in _models(tmp, device, dtype, 4096 if cuda else 512).items():
            if padding_free is not None:
                model[0].auto_model.config.padding_free = padding_free
            rows += _measure(name, model, texts, device, reps)
    return rows, _table(rows, len(texts), n_docs)


def _measure(name: str, model, texts: list[str], device: str, reps: int) -> list[dict]:
    tokens = sum(len(e.ids) for e in _tokenize(model, texts))
    arms = _arms(device)
    times: dict[str, list[float]] = {a: [] for a in arms}
    largest, reference, diff = {}, None, {}
    model.encode(texts[:64], batch_size=COUNT_BATCH)  # warm-up
    for _ in range(reps):  # interleaved, so that a busy machine slows every arm alike
        for arm, kwargs in arms.items():
            seen, handle = _largest_batch(model)
            sync(device)
            t0 = time.perf_counter()
            emb = model.encode(texts, convert_to_numpy=True, **kwargs)
            sync(device)
            times[arm].append(time.perf_counter() - t0)
            handle.remove()
            largest[arm] = seen[0]
            reference = emb if reference is None else reference
            diff[arm] = max(diff.get(arm, 0.0), float(np.abs(emb - reference).max()))
    base = statistics.median(times[next(iter(arms))])
    out = []
    for arm, ts in times.items():
        t = statistics.median(ts)
        row = {
            "model": name, "arm": arm, "texts": len(texts), "tokens": tokens, "seconds": ts,
            "texts_per_s": len(texts) / t, "tokens_per_s": tokens / t, "vs_count": base / t,
            "largest_batch_tokens": largest[arm], "max_abs_diff": diff[arm],
        }  # fmt: skip
        out.append(row)
        print(f"{name:28s} {arm:28s} {row['texts_per_s']:8.1f} texts/s {row['vs_count']:5.2f}x", flush=True)
    return out


def _tokenize(model, texts):
    from neoembed.batching import rust_tokenizer

    return rust_tokenizer(model).encode_batch(texts, add_special_tokens=True)


def _table(rows: list[dict], n: int, n_docs: int) -> str:
    md = [
        f"{n} texts: {n - n_docs} MTEB sentences and {n_docs} long documents (9:1), shuffled; median of the "
        "repeats (seconds of each in the JSON). `vs count`: texts/s over count batches' (batch "
        f"{COUNT_BATCH}); `largest batch`: the most input ids one forward saw (padded rows x width, or packed "
        "tokens); `max diff`: largest absolute embedding difference to count batches.",
        "",
        "| model | batches | texts/s | tokens/s | vs count | largest batch | max diff |",
        "|---|---|---|---|---|---|---|",
    ]
    md += [
        f"| {r['model']} | {r['arm']} | {r['texts_per_s']:.1f} | {r['tokens_per_s']:.0f} | {r['vs_count']:.2f}x | "
        f"{r['largest_batch_tokens']} | {r['max_abs_diff']:.1e} |"
        for r in rows
    ]
    return "\n".join(md) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=None)
    args = p.parse_args()
    rows, md = run(args.device, args.quick, args.reps)
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    payload = {"header": header(), "device": args.device, "rows": rows}
    write_results(f"scale_encode_{kind}{'_quick' if args.quick else ''}", payload, md)
    print(md)


if __name__ == "__main__":
    main()
