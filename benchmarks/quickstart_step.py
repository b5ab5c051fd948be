"""Where a training step of the quickstart goes on CPU, and the floor that sets for its 120 steps.

    python benchmarks/quickstart_step.py              # 12 profiled steps of the shipped recipe, with and without dropout

The quickstart's own recipe, data and trainer (``neoembed.quickstart``), profiled with torch.profiler: per step,
the matrix products (mm, addmm, bmm), the dropout masks' random numbers (bernoulli_) and everything else, and the
GEMMs' FLOP rate beside this machine's matmul rate. The same
steps run a second time with the backbone's dropout set to 0 (a copy of its folder with the config changed), to
show what dropout costs. The floor for the recipe's steps is its GEMM time alone: its fp32 matrix products (FLOPs
as the profiler counts them, padding included) at the rate they ran, and at this machine's matmul rate, nothing
else.

Below the table, the floor without any padding: the recipe's batches drawn as the trainer draws them (seeded, batch
size rows each, the query with its instruction, max length applied) from the quickstart's training pairs, their
real tokens, the tokens after the shipped length grouping (``neoembed.losses.length_groups``) and after plain
per-column padding; the forward and backward FLOPs of the real tokens alone (3 x the forward: 2 x linear
parameters per token, 4 x length x hidden per token and layer for attention) at the matmul rate. And what torch's
CPU random numbers cost per element (dropout draws one per activation it masks). Results:
benchmarks/results/quickstart_step_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
from _common import header, linear_params, matmul_rate, write_results
from torch.profiler import profile

from neoembed.instructions import format_with_instruction
from neoembed.losses import length_groups
from neoembed.quickstart import QUERY_INSTRUCTION, _recipe, build_pydoc_retrieval
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


def token_floor(recipe, data: Path, rate: float) -> dict:
    """Tokens per step of the recipe's batches (real, length-grouped, padded per column) and the time its steps'
    forward and backward FLOPs on real tokens alone take at ``rate`` FLOP/s."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    pairs = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(recipe.model)
    cfg = AutoConfig.from_pretrained(recipe.model)
    encoder = AutoModel.from_pretrained(recipe.model).encoder  # the pooler is not used by sentence embeddings
    forward_per_token, attention = 2 * linear_params(encoder), 4 * cfg.num_hidden_layers * cfg.hidden_size

    def lengths(texts):
        ids = tok(texts, truncation=True, max_length=recipe.max_length)["input_ids"]
        return [len(i) for i in ids]

    queries = lengths(
        [format_with_instruction(QUERY_INSTRUCTION, r["query"], recipe.template) for r in pairs]
    )
    docs = lengths([r["positive"] for r in pairs])
    rng, n = random.Random(recipe.seed), recipe.steps
    real = grouped = per_column = flops = 0
    for _ in range(n):
        rows = rng.sample(range(len(pairs)), recipe.batch_size)
        columns = [[queries[i] for i in rows], [docs[i] for i in rows]]
        every = columns[0] + columns[1]
        real += sum(every)
        grouped += sum(len(g) * max(every[i] for i in g) for g in length_groups(every))
        per_column += sum(len(c) * max(c) for c in columns)
        flops += 3 * sum(t * (forward_per_token + attention * t) for t in every)
    return {
        "steps": n,
        "real_tokens_per_step": real / n,
        "grouped_tokens_per_step": grouped / n,
        "per_column_padded_tokens_per_step": per_column / n,
        "real_tflop": flops / 1e12,
        "real_floor_s": flops / rate,
    }


def rng_ns_per_element(n: int = 4_000_000) -> dict:
    """torch's CPU random numbers: nanoseconds per element (median of 5)."""
    x = torch.empty(n)
    draws = {
        "bernoulli_": lambda: torch.empty_like(x).bernoulli_(0.9),
        "rand": lambda: torch.rand_like(x),
        "randint uint8": lambda: torch.randint(0, 256, (n,), dtype=torch.uint8),
    }
    out = {}
    for name, draw in draws.items():
        draw()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            draw()
            times.append(time.perf_counter() - t0)
        out[name] = sorted(times)[2] / n * 1e9
    return out


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
        floor = token_floor(recipe, tmp / "data", rate * 1e9)
    rng = rng_ns_per_element()
    steps = recipe.steps
    payload = {
        "header": header(),
        "model": label,
        "recipe_steps": steps,
        "matmul_gflop_per_s": rate,
        "rows": rows,
        "token_floor": floor,
        "rng_ns_per_element": rng,
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
    md += [
        "",
        f"- Tokens per step over {floor['steps']} seeded batches of the recipe: {floor['real_tokens_per_step']:,.0f} "
        f"real; {floor['grouped_tokens_per_step']:,.0f} after the shipped length grouping; "
        f"{floor['per_column_padded_tokens_per_step']:,.0f} padded per column.",
        f"- Their forward and backward FLOPs on real tokens alone: {floor['real_tflop']:.1f} TFLOP, at least "
        f"**{floor['real_floor_s']:.0f} s** at the matmul rate for the {floor['steps']} steps, with no padding and "
        "every other operation free.",
        "- torch's CPU random numbers, ns per element: "
        + ", ".join(f"{k} {v:.1f}" for k, v in rng.items())
        + ".",
    ]
    write_results("quickstart_step_cpu", payload, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
