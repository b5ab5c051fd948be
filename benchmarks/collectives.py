"""Collectives per optimizer step of every trainer on 2 gloo processes, against the parameter bytes; and the step
time of 1 vs 2 processes at equal global batch (issue #40, item 6).

Each case is a real run of a shipped tiny recipe, launched as tests/test_train.py launches (``accelerate launch
--multi_gpu --num_processes 2`` with ``ACCELERATE_USE_CPU=1``). Nothing in the trainers is edited: the harness puts
``benchmarks/_probe`` on PYTHONPATH, whose ``sitecustomize.py`` makes every launched process count its
``torch.distributed`` collectives by name and bytes, its DDP buckets (through a communication hook that does what
DDP does without one) and its optimizer steps (``_probe/collective_probe.py``). Window k is what a process sent
after step k-1's update up to step k's; window 1 also holds the set-up, so the per-step figures are windows 2..N.

    python benchmarks/collectives.py                       # every case, counts and timing: ~10 minutes on 2 cores
    python benchmarks/collectives.py --cases plain cde --no-timing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from _common import REPO, header, write_results

PROBE = REPO / "benchmarks" / "_probe"
TINY_SETS = "[{card: pydoc_names, max_rows: 64}, {card: pydoc_details, max_rows: 64}, {card: pydoc_signatures, max_rows: 48, batch_size: %d}]"

# case -> (command after `-m neoembed`, overrides at 2 processes, overrides at 1 process for the same global batch).
# The unified trainer's batch is per process (tiny: 16, pydoc_signatures 8), CDE's is global, pre-training's
# micro-batch is per process.
CASES: dict[str, tuple[list[str], list[str], list[str]]] = {
    "plain": (["train", "tiny"], [], ["batch_size=32", "datasets=" + TINY_SETS % 16]),
    "plain_gather": (
        ["train", "tiny", "gather_across_devices=true"], [], ["batch_size=32", "datasets=" + TINY_SETS % 16]
    ),
    # GradCache in mini-batches of 4: 4 per step at the per-process batch of 16
    "cached": (
        ["train", "tiny", "loss.name=cached_infonce", "loss.mini_batch_size=4"],
        [], ["batch_size=32", "datasets=" + TINY_SETS % 16],
    ),
    "cde": (["train", "cde-tiny"], [], []),
    "cde_gather": (["train", "cde-tiny", "gather_across_devices=true"], [], []),
    "pretrain": (["pretrain", "pretrain-tiny"], [], ["batch.micro_batch_size=8"]),
    "pretrain_accum2": (
        ["pretrain", "pretrain-tiny", "batch.grad_accumulation=2", "batch.micro_batch_size=2"],
        [], ["batch.micro_batch_size=4"],
    ),
}  # fmt: skip


def launch(case: str, processes: int, steps: int, folder: Path) -> list[dict]:
    """One probed run of ``case``; returns each process's record (rank order)."""
    command, two, one = CASES[case]
    folder.mkdir(parents=True)
    mode = ["--multi_gpu"] if processes > 1 else ["--cpu"]
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", *mode, "--num_machines", "1",
        "--num_processes", str(processes), "--main_process_port", "0", "--mixed_precision", "no",
        "--dynamo_backend", "no", "-m", "neoembed", *command, *(two if processes > 1 else one),
        f"steps={steps}", "save_steps=1000", f"output_dir={folder / 'run'}",
    ]  # fmt: skip
    path = os.pathsep.join([str(PROBE), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {
        **os.environ, "PYTHONPATH": path, "NEOEMBED_PROBE_DIR": str(folder), "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    }  # fmt: skip
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        raise RuntimeError(f"{case} on {processes} process(es) failed:\n{r.stderr[-3000:]}")
    records = sorted((json.loads(p.read_text()) for p in folder.glob("rank*.json")), key=lambda d: d["rank"])
    if len(records) != processes or any(d["world_size"] != processes for d in records):
        raise RuntimeError(
            f"{case}: expected {processes} probed processes, got {[d['rank'] for d in records]}"
        )
    return records


def _label(event: dict) -> str:
    return f"{event['op']} ({event['kind']})" if event["kind"] else event["op"]


def windows(record: dict) -> list[dict]:
    """Per optimizer step (window 1..steps): DDP buckets and bytes, gradient all-reduces, every collective by name."""
    out = []
    for k in range(1, record["steps"] + 1):
        events = [e for e in record["events"] if e["step"] == k]
        buckets = [e for e in events if e["op"] == "ddp_hook"]
        grads = [e for e in events if e["op"] == "all_reduce" and e["kind"] in ("grad", "ddp_bucket")]
        calls, sent = Counter(), Counter()
        for e in events:
            if e["op"] != "ddp_hook":
                calls[_label(e)] += 1
                sent[_label(e)] += e["bytes"]
        out.append({
            "step": k,
            "ddp_buckets": len(buckets),
            "ddp_bucket_bytes": sum(e["bytes"] for e in buckets),
            "gradient_all_reduces": len(grads),
            "gradient_bytes": sum(e["bytes"] for e in grads),
            "collectives": {name: {"calls": calls[name], "bytes": sent[name]} for name in sorted(calls)},
        })  # fmt: skip
    return out


def summarize(case: str, records: list[dict]) -> dict:
    """Rank 0's windows (checked equal on every rank) and the steady per-step figures (windows 2..N)."""
    per_rank = [windows(r) for r in records]
    if any(w != per_rank[0] for w in per_rank[1:]):
        raise RuntimeError(f"{case}: the processes sent different collectives: {per_rank}")
    steps, params = per_rank[0], records[0]["params"]
    steady = steps[1:] or steps
    grad_calls = {s["gradient_all_reduces"] for s in steady}
    grad_bytes = {s["gradient_bytes"] for s in steady}
    return {
        "parameter_tensors": params["tensors"],
        "parameter_bytes": params["bytes"],
        "per_step": steps,
        "steady": {
            "ddp_buckets": sorted({s["ddp_buckets"] for s in steady}),
            "gradient_all_reduces": sorted(grad_calls),
            "gradient_bytes_over_parameters": sorted(round(b / params["bytes"], 4) for b in grad_bytes),
            "other": sorted(
                {
                    name
                    for s in steady
                    for name in s["collectives"]
                    if not name.endswith(("(grad)", "(ddp_bucket)"))
                }
            ),
        },
    }


def step_time(records: list[dict]) -> float:
    """Median seconds per optimizer step after the first (which holds the set-up), the slowest process's."""
    return max(statistics.median(r["step_times"][1:]) for r in records)


def _markdown(results: dict, steps: int) -> str:
    lines = [
        f"Collectives per optimizer step on 2 gloo processes (CPU), {steps} optimizer steps per run; per-step figures "
        "are steps 2..N (step 1's window also holds the set-up). Gradient reductions: DDP's buckets (counted by a "
        "communication hook) or, where no DDP wraps the model, all-reduces of a parameter's `.grad`.\n",
        "| case | parameter tensors | parameter bytes | DDP buckets / step | gradient all-reduces / step | "
        "all_reduce calls / step | reduced bytes / parameter bytes | other collectives / step (calls, bytes) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for case, r in results.items():
        s, last = r["steady"], r["per_step"][-1]
        other = ", ".join(
            f"{name} ×{c['calls']} ({c['bytes']} B)"
            for name, c in last["collectives"].items()
            if not name.endswith(("(grad)", "(ddp_bucket)"))
        )
        reduces = sum(c["calls"] for name, c in last["collectives"].items() if name.startswith("all_reduce"))
        lines.append(
            f"| {case} | {r['parameter_tensors']} | {r['parameter_bytes']:,} | {'/'.join(map(str, s['ddp_buckets']))} "
            f"| {'/'.join(map(str, s['gradient_all_reduces']))} | {reduces} | "
            f"{'/'.join(f'{x:.2f}×' for x in s['gradient_bytes_over_parameters'])} | {other or '—'} |"
        )
    lines.append(
        "\nCDE wraps each of its two stages in its own DDP: two buckets a step (each tiny stage fits DDP's first "
        "bucket), the null context's slot included although it has no gradient without context dropout, plus one "
        "all-reduce of the loss and stop flag; cde_gather adds the all-gathers of the documents' embeddings (the "
        "positives and the hard negatives, each with its gradient). The unified trainer (plain, plain_gather, cached) reduces a 4-byte "
        "stop flag each step (a signal to one process stops every process at the same step). "
        "`_broadcast_coalesced`: DDP's broadcast of the model's buffers before a forward."
    )
    timed = {c: r for c, r in results.items() if "seconds_per_step" in r}
    if timed:
        lines += [
            "\nStep time at equal global batch (median of steps 2..N, the slower process). Every process runs one "
            "torch thread (OMP_NUM_THREADS=1, as the tests launch), so 2 processes also use twice the cores: on CPU "
            "this shows the collectives' cost beside the compute, not a GPU's scaling.\n",
            "| case | 1 process (s/step) | 2 processes (s/step) | 2 / 1 |",
            "|---|---:|---:|---:|",
        ]
        for case, r in timed.items():
            one, two = r["seconds_per_step"]["1"], r["seconds_per_step"]["2"]
            lines.append(f"| {case} | {one:.3f} | {two:.3f} | {two / one:.2f} |")
    lines.append("\nEvery window of every case, with each collective by name: the .json beside this file.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-timing", action="store_true", help="skip the 1-process runs")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            two = launch(case, 2, args.steps, Path(tmp) / case / "2")
            results[case] = summarize(case, two)
            if not args.no_timing:
                one = launch(case, 1, args.steps, Path(tmp) / case / "1")
                results[case]["seconds_per_step"] = {"1": step_time(one), "2": step_time(two)}
            print(
                case, json.dumps(results[case]["steady"]), results[case].get("seconds_per_step"), flush=True
            )
    payload = {"header": header(), "steps": args.steps, "cases": {c: list(CASES[c]) for c in args.cases}}
    payload["results"] = results
    write_results("collectives_cpu", payload, _markdown(results, args.steps))


if __name__ == "__main__":
    main()
