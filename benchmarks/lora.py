"""LoRA against full fine-tuning on CPU at the same batch: trainable parameters, step time, peak memory.

    cd benchmarks && python lora.py            # packaged all-MiniLM-L6-v2, batch 32, max length 64, a few minutes

Each mode runs in a fresh subprocess (its peak resident memory is its own): the unified trainer's InfoNCE loss
(neoembed.losses) and AdamW over the trainable parameters, on (query, positive) rows of the tiny recipe's real
pydoc data. LoRA uses neoembed.adapters.add_lora (r=16, alpha=32, PEFT's default targets for BERT: query, value).
Results: results/lora_cpu.{json,md}. The machine's load average is recorded beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from _common import REPO, header, write_results

RUN = r"""
import json, resource, sys, time, torch
cfg = json.loads(sys.argv[1])
torch.manual_seed(0)
import neoembed
from neoembed.adapters import add_lora, count_parameters
from neoembed.losses import InfoNCELoss
from neoembed.sentence import resolve_packaged
rows = [json.loads(l) for l in open(cfg["data"])]
model = neoembed.load(resolve_packaged("all-MiniLM-L6-v2"), max_seq_length=cfg["max_length"])
if cfg["kind"] == "lora":
    add_lora(model, r=16, alpha=32)
trainable, total = count_parameters(model)
loss_fn = InfoNCELoss(model)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-5)
model.train()
times = []
for step in range(cfg["steps"]):
    batch = [rows[(step * cfg["batch"] + i) % len(rows)] for i in range(cfg["batch"])]
    feats = [model.tokenize([r[k] for r in batch]) for k in ("query", "positive")]
    t0 = time.perf_counter()
    loss = loss_fn(feats, None)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
print(json.dumps({"kind": cfg["kind"], "trainable": trainable, "total": total, "step_s": times[2:],
                  "loss_last": float(loss), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    data = REPO / "recipes" / "tiny" / "rows" / "pydoc_details.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    runs = {}
    for kind in ("full", "lora"):
        cfg = {
            "kind": kind,
            "data": str(data),
            "steps": args.steps,
            "batch": args.batch,
            "max_length": args.max_length,
        }
        out = subprocess.run(
            [sys.executable, "-c", RUN, json.dumps(cfg)], capture_output=True, text=True, env=env
        )
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        runs[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    load = os.getloadavg()
    rows = []
    for kind, r in runs.items():
        med = statistics.median(r["step_s"])
        rows.append(
            f"| {kind} | {r['trainable']:,} | {100 * r['trainable'] / r['total']:.2f}% | {med:.3f} | "
            f"{r['peak_rss_mib']:.0f} | {r['loss_last']:.3f} |"
        )
    md = (
        f"all-MiniLM-L6-v2, batch {args.batch} pairs, max length {args.max_length}, {args.steps} steps (median step "
        f"time of steps 3+), {args.threads} torch thread(s); load average at the end {load[0]:.2f}, {load[1]:.2f}.\n\n"
        "| mode | trainable params | share | step s (median) | peak RSS MiB | last loss |\n|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )
    payload = {"header": header(), "args": vars(args), "load_average": load, "runs": runs}
    write_results("lora_cpu", payload, md)
    print(md)


if __name__ == "__main__":
    main()
