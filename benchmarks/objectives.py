"""What each objective of #25 gains or costs, measured: the packaged all-MiniLM-L6-v2 fine-tuned on MSRP
paraphrase pairs with hard negatives mined by the same model (their bi-encoder scores kept as teacher scores), one
run per objective and seed, each scored by ``neoembed mteb`` on STS tasks it was not trained on.

Arms (same data, batch, steps, learning rate and seed; only the objective differs):
  infonce      InfoNCE over in-batch + mined negatives (the baseline)
  matryoshka   + ``matryoshka: {dims: [384, 256, 128, 64]}``; both scored at 384/256/128/64 dims
  distill      + ``distillation: {loss: kl, ...}`` from the mined scores, added to InfoNCE
  fn_mask      + ``false_negatives: {margin: 0.1}`` (candidates within 0.1 cosine of the positive dropped)
  lora         a LoRA adapter (r 16, alpha 32) instead of every weight, same learning rate (5e-5)
  lora_lr10    the same adapter at 5e-4

    python benchmarks/objectives.py --arms infonce,lora,lora_lr10 --stem lora_quality_cpu   # LoRA's record

    python benchmarks/objectives.py                       # 3 seeds, the record's settings
    python benchmarks/objectives.py --seeds 0 --steps 4   # a smoke run (writes objectives_smoke.*)

Results: benchmarks/results/objectives_cpu.{json,md} with the command, commit, hardware and load average.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import yaml
from _common import REPO, SHARED, header, write_results

DIMS = [384, 256, 128, 64]
ARMS: dict[str, list[str]] = {
    "infonce": [],
    "matryoshka": [f"matryoshka.dims=[{','.join(map(str, DIMS))}]"],
    # the teacher is the base model's cosine: sharpened to InfoNCE's scale (0.05), and weight 400 undoes the
    # student_temperature**2 = 0.0025 factor of Hinton's KL so the term weighs like InfoNCE
    "distill": [
        "distillation.loss=kl",
        "distillation.student_temperature=0.05",
        "distillation.teacher_temperature=0.05",
        "distillation.weight=400",
    ],
    "fn_mask": ["false_negatives.margin=0.1"],
    # LoRA (#26): r 16, alpha 32 on PEFT's default BERT targets (query, value), the full model's learning rate and
    # ten times it (adapters are usually trained with a larger one); the merged model is what neoembed mteb scores
    "lora": ["adapter.type=lora", "adapter.r=16", "adapter.alpha=32"],
    "lora_lr10": ["adapter.type=lora", "adapter.r=16", "adapter.alpha=32", "optimizer.lr=5e-4"],
}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rows", type=int, default=512, help="MSRP training pairs mined and trained on")
    p.add_argument("--tasks", default="STS16", help="evaluation tasks from the shared data's mteb/ folder")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument(
        "--stem", default=None, help="results file stem (default objectives_cpu, smoke for 1 seed)"
    )
    return p.parse_args()


def _mine(work: Path, rows: int) -> Path:
    """A card of the first ``rows`` MSRP training pairs with 2 hard negatives each and the scores that chose them."""
    from neoembed.mine.miner import MineConfig, mine_negatives
    from neoembed.sentence import resolve_packaged

    with gzip.open(SHARED / "data/train/msrp_pairs/train.jsonl.gz", "rt") as f:
        data = [json.loads(line) for _, line in zip(range(rows), f, strict=False)]
    src = work / "src"
    src.mkdir()
    (src / "pairs.jsonl").write_text(
        "".join(json.dumps({"query": r["query"], "positive": r["positive"]}) + "\n" for r in data)
    )
    card = {"name": "msrp", "source": {"local": {"path": "pairs.jsonl", "format": "json"}}}
    card |= {"columns": {"query": "query", "positive": "positive"}, "license": "MSRP licence (research use)"}
    (src / "msrp.yaml").write_text(yaml.safe_dump(card))
    config = MineConfig(num_negatives=2, range_max=20, batch_size=64, max_length=64, gpu="off")
    model = resolve_packaged("packaged:all-MiniLM-L6-v2")
    return mine_negatives(src / "msrp.yaml", model, work / "mined", config=config, progress=False).card


def _train(card: Path, arm: str, seed: int, args, out: Path) -> dict:
    """Train one arm: its wall time, median step time and the fraction of negatives masked as false."""
    from neoembed.recipe import load_recipe
    from neoembed.sentence import resolve_packaged
    from neoembed.train.recipe import UnifiedRecipe
    from neoembed.train.trainer import train

    overrides = [
        f"model={resolve_packaged('packaged:all-MiniLM-L6-v2')}",
        f"seed={seed}",
        f"output_dir={out}",
        f"datasets=[{{card: {card}}}]",
        f"steps={args.steps}",
        f"batch_size={args.batch_size}",
        "max_length=64",
        "save_steps=100000",
        "logging_steps=1",
        "optimizer.warmup_steps=3",
        *ARMS[arm],
    ]
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", UnifiedRecipe, overrides)
    t0 = time.perf_counter()
    train(recipe, recipe_dir=REPO / "recipes")
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    masked = [r["false_negative_fraction"] for r in rows if "false_negative_fraction" in r]
    return {
        "train_s": round(wall, 1),
        # the trainer's own step rate, first step (warm-up) left out: loading and saving are not step time
        "step_s": round(statistics.median(args.batch_size / r["samples_per_s"] for r in rows[1:]), 3),
        "masked_fraction": round(statistics.mean(masked), 4) if masked else None,
    }


def _score(model: Path | str, tasks: str, dim: int | None, out: Path) -> float:
    """Mean main score (x100) of ``neoembed mteb`` (run in this process, as the CLI runs it) over ``tasks``."""
    from neoembed.cli import app

    args = ["mteb", "--model", str(model), "--tasks", tasks, "--data-dir", str(SHARED / "data/mteb")]
    args += ["--instructions", "none", "--output", str(out), "--batch-size", "64"]
    if dim is not None:
        args += ["--truncate-dim", str(dim)]
    app(args, prog_name="neoembed", standalone_mode=False)
    summary = json.loads((out / "summary.json").read_text())
    return round(100 * summary["mean"], 2)


def _stats(values: list[float]) -> dict:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": round(statistics.mean(values), 2), "sd": round(sd, 2), "values": values}


def _dims(arm: str) -> list[int | None]:
    return [None, *DIMS[1:]] if arm in ("infonce", "matryoshka") else [None]


def _summarize(runs: list[dict], base: dict) -> dict:
    """Per arm and dimension: score mean and sd over seeds, the paired difference to InfoNCE, the step time."""
    table = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        row = {"step_s": _stats([r["step_s"] for r in mine]), "scores": {}}
        for dim in mine[0]["scores"]:
            row["scores"][dim] = _stats([r["scores"][dim] for r in mine])
            paired = [
                r["scores"][dim] - b["scores"][dim]
                for r in mine
                for b in runs
                if b["arm"] == "infonce" and b["seed"] == r["seed"] and dim in b["scores"]
            ]
            if arm != "infonce" and paired:
                row["scores"][dim]["vs_infonce"] = _stats([round(d, 2) for d in paired])
        table[arm] = row
    return {"base_model": base, "arms": table}


def _markdown(summary: dict, args, load: dict, complete: bool) -> str:
    dims = [str(d) for d in DIMS]
    lines = [
        f"all-MiniLM-L6-v2 (packaged) fine-tuned {args.steps} steps x batch {args.batch_size} on {args.rows} MSRP "
        f"pairs + 2 mined negatives each; seeds {args.seeds}; mean main score x100 of `neoembed mteb` over "
        f"{args.tasks} (held out of training), mean ± sd over seeds; Δ = paired difference to InfoNCE (same "
        f"seed).  \nLoad average (1 min) {load}"
        + ("" if complete else "  \n**INCOMPLETE: runs still going**"),
        "",
        "| arm | step s | "
        + " | ".join(f"{d}-d" for d in dims)
        + " | "
        + " | ".join(f"Δ {d}-d" for d in dims)
        + " |",
        "|---|---|" + "---|" * (2 * len(dims)),
    ]
    base = summary["base_model"]
    lines.append(
        "| base model (no training) | – | "
        + " | ".join(str(base.get(d, "–")) for d in dims)
        + " |"
        + " – |" * len(dims)
    )
    for arm, row in summary["arms"].items():
        cells = [row["scores"].get(d) for d in dims]
        score = [f"{c['mean']:.2f} ± {c['sd']:.2f}" if c else "–" for c in cells]
        delta = [
            f"{c['vs_infonce']['mean']:+.2f} ± {c['vs_infonce']['sd']:.2f}"
            if c and "vs_infonce" in c
            else "–"
            for c in cells
        ]
        step = row["step_s"]
        lines.append(f"| {arm} | {step['mean']:.2f} ± {step['sd']:.2f} | " + " | ".join(score + delta) + " |")
    return "\n".join(lines) + "\n"


def _record(stem: str, runs: list[dict], base: dict, args, load: dict, complete: bool) -> None:
    summary = _summarize(runs, base) if runs else {"base_model": base, "arms": {}}
    payload = {"header": header(), "settings": vars(args), "arms": {a: ARMS[a] for a in args.arms.split(",")}}
    payload |= {"load_average": load, "complete": complete, "summary": summary, "runs": runs}
    write_results(stem, payload, _markdown(summary, args, load, complete))


def main() -> None:
    args = _parse()
    seeds = [int(s) for s in args.seeds.split(",")]
    stem = args.stem or ("objectives_cpu" if len(seeds) > 1 else "objectives_smoke")
    load = {"before": os.getloadavg()}
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        card = _mine(work, args.rows)
        from neoembed.sentence import resolve_packaged

        minilm = resolve_packaged("packaged:all-MiniLM-L6-v2")
        base = {
            str(d or DIMS[0]): _score(minilm, args.tasks, d, work / f"base-{d}") for d in _dims("infonce")
        }
        for seed in seeds:
            for arm in args.arms.split(","):
                out = work / f"{arm}-{seed}"
                run = {"arm": arm, "seed": seed, **_train(card, arm, seed, args, out)}
                run["scores"] = {
                    str(d or DIMS[0]): _score(out, args.tasks, d, work / f"eval-{arm}-{seed}-{d}")
                    for d in _dims(arm)
                }
                runs.append(run)
                print(json.dumps(run), flush=True)
                shutil.rmtree(out)
                load["last"] = os.getloadavg()
                _record(stem, runs, base, args, load, complete=False)
    _record(stem, runs, base, args, load, complete=True)
    print((REPO / "benchmarks" / "results" / f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
