"""Where a training step of the quickstart goes on CPU, and the floor that sets for its 120 steps.

    python benchmarks/quickstart_step.py              # 12 profiled steps of the shipped recipe, with and without dropout

The quickstart's own recipe, data and trainer (``neoembed.quickstart``), profiled with torch.profiler: per step,
the matrix products (mm, addmm, bmm), the dropout masks' random numbers (bernoulli_) and everything else, and the
GEMMs' FLOP rate beside this machine's matmul rate. The same
steps run a second time with the backbone's dropout set to 0 (a copy of its folder with the config changed), to
show what dropout costs. The floor for the recipe's steps is its GEMM time alone: its fp32 matrix products (FLOPs
as the profiler counts them, padding included) at the rate they ran, and at this machine's matmul rate, nothing
else. Results: benchmarks/results/quickstart_step_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from _common import header, matmul_rate, write_results
from torch.profiler import profile

from neoembed.quickstart import _recipe, build_pydoc_retrieval
from neoembed.train.trainer import train

GEMM = ("aten::mm", "aten::addmm", "aten::bmm")
RNG = ("aten::bernoulli_",)


def _no_dropout_copy(model_dir: str, out: Path) -> str:
    """The backbone's folder with every dropout probability of its config set to 0."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    for key in [k for k in config if "dropout" in k and isinstance(config[k], float)]:
        config[key] = 0.0
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(out)


def profile_steps(recipe, recipe_dir: Path, steps: int, out: Path) -> dict:
    """Run ``steps`` training steps under the profiler: self CPU time per op class per step, and the GEMMs'
    FLOPs as the profiler counts them (the product shapes, so padding included)."""
    with profile(with_flops=True) as prof:
        train(recipe.model_copy(update={"steps": steps, "output_dir": str(out)}), recipe_dir, overwrite=True)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM) / 1e6
    gemm_flops = sum(e.flops for e in events if e.key in GEMM)
    rng = sum(e.self_cpu_time_total for e in events if e.key in RNG) / 1e6
    return {
        "steps": steps,
        "per_step_s": total / steps,
        "gemm_per_step_s": gemm / steps,
        "dropout_rng_per_step_s": rng / steps,
        "other_per_step_s": (total - gemm - rng) / steps,
        "gemm_tflop_per_step": gemm_flops / steps / 1e12,
        "gemm_gflop_per_s": gemm_flops / gemm / 1e9,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="profiled steps per variant")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build_pydoc_retrieval(tmp / "data")
        recipe, recipe_path, label = _recipe(tmp, tmp / "data", None, None)
        variants = {
            "as shipped": recipe,
            "dropout 0": recipe.model_copy(update={"model": _no_dropout_copy(recipe.model, tmp / "nodrop")}),
        }
        rows = {
            name: profile_steps(r, recipe_path.parent, args.steps, tmp / "run")
            for name, r in variants.items()
        }
    rate = matmul_rate("cpu", torch.float32, 2048) / 1e9
    steps = recipe.steps
    payload = {
        "header": header(),
        "model": label,
        "recipe_steps": steps,
        "matmul_gflop_per_s": rate,
        "rows": rows,
    }
    md = [
        f"Quickstart training step on CPU ({label}; recipe: {steps} steps, batch {recipe.batch_size}, max length "
        f"{recipe.max_length}); {args.steps} profiled steps per variant, self CPU time per op class (the "
        f"profiler's own overhead included); this machine's fp32 matmul rate (2,048^3): {rate:.0f} GFLOP/s.",
        "",
        "| variant | s per step | GEMM s | dropout RNG s | other s | GEMM TFLOP per step | GEMM GFLOP/s "
        f"| {steps} steps at this rate | their GEMMs at the measured GEMM rate | their GEMMs at the matmul rate |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        md.append(
            f"| {name} | {r['per_step_s']:.2f} | {r['gemm_per_step_s']:.2f} | {r['dropout_rng_per_step_s']:.2f} "
            f"| {r['other_per_step_s']:.2f} | {r['gemm_tflop_per_step']:.3f} | {r['gemm_gflop_per_s']:.0f} "
            f"| {r['per_step_s'] * steps:.0f} s | {r['gemm_per_step_s'] * steps:.0f} s "
            f"| {r['gemm_tflop_per_step'] * 1e3 * steps / rate:.0f} s |"
        )
    write_results("quickstart_step_cpu", payload, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
