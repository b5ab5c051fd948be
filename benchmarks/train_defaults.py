"""Which run settings pay end to end (issue #42, item 5): ``neoembed train`` timed from the command's start to its
exit (imports, model load, compilation, every step, the save), one setting changed per arm.

    python benchmarks/train_defaults.py --device cuda [--model DIR]   # GPU: the two jobs below
    python benchmarks/train_defaults.py --quick                        # CPU: 4 steps an arm, checks the arms run

Jobs, both on the README's main job's data (``neoembed quickstart``'s retrieval set from this machine's Python
documentation, built once):
- quickstart: its recipe as shipped (all-MiniLM-L6-v2, 120 steps, batch 32, fp32); arms: as shipped, compile=true,
  precision=bf16;
- neobert: full-size NeoBERT with random weights (speed does not depend on them) at the unified recipe's
  precision (bf16) and max_length (512), batch 64, --neobert-steps steps; arms: eager, compile=true.

Per arm: the wall time, the steady step time (the logged samples/s of the run's second half), the peak
memory and how often torch recompiled a compiled layer (``TORCH_LOGS=recompiles``). A setting is worth a
default only where its arm's wall time is lower; the record also gives the step count from which it would be (its extra start-up over its per-step saving). Results:
benchmarks/results/train_defaults_<device>.{json,md}, written after each arm (a run cut short keeps its arms).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import REPO, header, write_results
from train_step_cuda import QUICK_CONFIG, build_backbone

# in order of value: a run cut at its time box keeps the first
ARMS = [
    ("quickstart", "as shipped (fp32, eager)", []),
    ("quickstart", "compile=true", ["compile=true"]),
    ("neobert", "bf16, eager", []),
    ("neobert", "bf16, compile=true", ["compile=true"]),
    ("quickstart", "bf16", ["precision=bf16"]),
]


def run_arm(recipe: list[str], out: Path, batch: int) -> dict:
    """One ``neoembed train`` in a fresh process: wall seconds, steady seconds per step, peak memory."""
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "neoembed", "train", *recipe, f"output_dir={out}", "--overwrite"],
        cwd=REPO,
        capture_output=True,
        text=True,
        # torch logs each recompilation of a compiled layer: a layer recompiled per batch shape runs eager past
        # torch's recompile limit, which a compiled arm no faster per step than eager would show
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TORCH_LOGS": "recompiles"},
    )
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        return {"wall_s": wall, "error": r.stderr[-1500:]}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [row["samples_per_s"] for row in rows if "samples_per_s" in row]
    rate = statistics.median(rates[len(rates) // 2 :])
    return {
        "wall_s": wall,
        "step_s": batch / rate,
        "peak_memory_mib": max(row.get("peak_memory_mib", 0) for row in rows),
        "last_loss": rows[-1].get("loss"),
        "recompilations": r.stderr.count("Recompiling function"),
    }


def breakeven(base: dict, arm: dict) -> str:
    """From how many steps ``arm`` beats ``base`` end to end (its extra start-up over its per-step saving)."""
    if "error" in arm or "error" in base:
        return "-"
    saving = base["step_s"] - arm["step_s"]
    extra = (arm["wall_s"] - base["wall_s"]) + saving * arm["steps"]  # wall = start-up + steps x step time
    if extra <= 0:
        return "from the first step"
    return "never (slower per step)" if saving <= 0 else f"{extra / saving:,.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="CPU, 4 steps an arm, a 2 x 64 NeoBERT")
    p.add_argument(
        "--model", default=None, help="the quickstart's backbone (default: packaged all-MiniLM-L6-v2)"
    )
    p.add_argument("--neobert-steps", type=int, default=150)
    p.add_argument("--jobs", default="quickstart,neobert")
    args = p.parse_args()
    if args.device != "cuda" and not args.quick:
        p.error("the defaults are measured on a GPU (--device cuda); --quick checks the arms on CPU")
    from neoembed.quickstart import _recipe, build_pydoc_retrieval

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build_pydoc_retrieval(tmp / "data")
        recipe, recipe_path, _ = _recipe(tmp, tmp / "data", 4 if args.quick else None, args.model)
        card = f"datasets=[{{card: {tmp / 'data' / 'pydocs.yaml'}}}]"
        log = f"logging_steps={1 if args.quick else 10}"  # the step time is read off the logged rows
        neobert = tmp / "neobert"
        if "neobert" in args.jobs:
            build_backbone(
                str(neobert), QUICK_CONFIG if args.quick else {}, "cpu" if args.quick else args.device
            )
        steps = {"quickstart": recipe.steps, "neobert": 4 if args.quick else args.neobert_steps}
        base = {
            "quickstart": [str(recipe_path), card, f"model={recipe.model}", f"steps={steps['quickstart']}", log],
            "neobert": [str(recipe_path), card, f"model={neobert}", f"steps={steps['neobert']}", log,
                        "precision=bf16", "max_length=512", "batch_size=64"],
        }  # fmt: skip
        batch = {"quickstart": recipe.batch_size, "neobert": 64}
        for i, (job, name, overrides) in enumerate(a for a in ARMS if a[0] in args.jobs.split(",")):
            cmd = base[job] + overrides
            if args.quick:  # the CPU check runs every arm in fp32 (bf16 training is refused there)
                cmd = [c for c in cmd if c != "precision=bf16"]
            result = run_arm(cmd, tmp / f"{job}-{i}", batch[job])
            rows.append({"job": job, "arm": name, "overrides": overrides, "steps": steps[job], **result})
            print(json.dumps(rows[-1]), flush=True)
            record(args, rows)


def record(args, rows: list[dict]) -> Path:
    first = {}
    lines = []
    for r in rows:
        base = first.setdefault(r["job"], r)
        cells = (
            f"{r['wall_s']:.1f} | {1e3 * r['step_s']:.1f} | {r['peak_memory_mib']:,.0f} | {r.get('recompilations', '-')}"
            if "error" not in r
            else f"{r['wall_s']:.1f} | failed: {r['error'].splitlines()[-1][:120]} | - | -"
        )
        pays = "(the baseline)" if r is base else breakeven(base, r)
        lines.append(f"| {r['job']} | {r['arm']} | {r['steps']} | {cells} | {pays} |")
    md = [
        "`neoembed train` from the command's start to its exit, one setting changed per arm; step time from the "
        "logged samples/s of the run's second half.",
        "",
        "| job | arm | steps | wall s | step ms | peak memory MiB | recompilations | beats the job's first arm end to "
        "end from step |",
        "|---|---|---|---|---|---|---|---|",
        *lines,
    ]
    stem = "train_defaults_cpu_quick" if args.quick else f"train_defaults_{args.device}"
    return write_results(stem, {"header": header(), "rows": rows}, "\n".join(md) + "\n")[1]


if __name__ == "__main__":
    main()
