"""The padding-free layout's CPU attention: how many sequences one SDPA call takes (``GROUP_SLACK``).

    python benchmarks/cpu_attention.py              # tiny NeoBERT and one 768-wide layer, batches of 256
    python benchmarks/cpu_attention.py --quick      # fewer repetitions

On CPU the packed layout confines attention to each sequence by grouping sequences of similar length and padding
each group to its longest (``attention_neobert.length_groups``): ``slack`` bounds a group's attention work
(Σ padded length²) against its sequences' own (Σ length²). Slack 0 is one SDPA call per sequence (what the
backend did before), slack ∞ one call for the batch (attention as padded, the linear layers still packed).
Measured side by side in one process, forward + backward of the whole model, on the token lengths of real
texts (the training rows of ../shared/data/train, queries and positives as separate batches, max_length 128,
batches drawn with a fixed seed), against the padded layout (``padding_free=False``) of the same weights.
Results: benchmarks/results/cpu_attention_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random

import torch
from _common import SHARED, header, median_time, write_results
from transformers import AutoTokenizer

import neoembed.modeling.attention_neobert as mn
from neoembed.modeling import NeoBERTConfig, NeoBERTModel

SLACKS = [0.0, 1.25, 1.5, 2.0, 4.0, float("inf")]
MODELS = {
    "tiny (3 x 64)": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256),
    "one 768-wide layer": dict(
        hidden_size=768, num_hidden_layers=1, num_attention_heads=12, intermediate_size=3072
    ),
}


def batches(batch: int, count: int, max_length: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    tok = AutoTokenizer.from_pretrained(str(SHARED / "fixtures" / "neobert-tiny-official"))
    rows = [json.loads(x) for f in sorted((SHARED / "data" / "train").glob("*/train.jsonl.gz"))
            for x in gzip.open(f, "rt")]  # fmt: skip
    rng = random.Random(0)
    out = []
    for i in range(count):
        take = rng.sample(rows, batch)
        column = "query" if i % 2 == 0 else "positive"
        enc = tok([r[column] for r in take], padding=True, truncation=True, max_length=max_length,
                  return_tensors="pt")  # fmt: skip
        out.append((column, enc["input_ids"], enc["attention_mask"]))
    return out


def step(model, data) -> None:
    for _, ids, mask in data:
        model(input_ids=ids, attention_mask=mask).last_hidden_state.square().mean().backward()


def measure(reps: int, batch: int) -> list[dict]:
    data = batches(batch, 4, 128)
    lengths = [m.sum(1).tolist() for _, _, m in data]
    rows = []
    for name, kwargs in MODELS.items():
        torch.manual_seed(0)
        model = NeoBERTModel(NeoBERTConfig(**kwargs)).train()
        model.config.padding_free = False
        padded = median_time(lambda m=model: step(m, data), "cpu", reps)
        rows.append({"model": name, "arm": "padded layout", "seconds": padded, "calls": len(data)})
        model.config.padding_free = True
        for slack in SLACKS:
            mn.GROUP_SLACK = slack
            calls = sum(len(mn.length_groups(n)[0]) for n in lengths)
            t = median_time(lambda m=model: step(m, data), "cpu", reps)
            rows.append({"model": name, "arm": f"packed, slack {slack:g}", "seconds": t, "calls": calls})
            print(json.dumps(rows[-1]), flush=True)
    return rows, lengths


def markdown(rows: list[dict], lengths: list[list[int]], batch: int) -> str:
    real = sum(map(sum, lengths))
    grid = sum(len(n) * max(n) for n in lengths)
    out = [
        "# CPU attention of the padding-free layout: sequences per SDPA call",
        "",
        f"Forward + backward over 4 batches of {batch} real texts (2 of queries, 2 of positives, max_length 128): "
        f"{real:,} real tokens, {grid:,} padded ({1 - real / grid:.0%} padding). Median of repetitions, one "
        "process; `calls`: SDPA calls per layer over the 4 batches. Slack 0: one call per sequence; ∞: one call "
        "per batch.",
        "",
        "| model | arm | SDPA calls | s (4 batches) | vs padded layout |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        base = next(x for x in rows if x["model"] == r["model"] and x["arm"] == "padded layout")
        out.append(
            f"| {r['model']} | {r['arm']} | {r['calls']} | {r['seconds']:.3f} | {r['seconds'] / base['seconds']:.2f} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=256)
    a = ap.parse_args()
    rows, lengths = measure(3 if a.quick else 7, a.batch)
    md = markdown(rows, lengths, a.batch)
    write_results("cpu_attention_cpu", {"header": header(), "rows": rows, "lengths": lengths}, md)
    print(md)


if __name__ == "__main__":
    main()
