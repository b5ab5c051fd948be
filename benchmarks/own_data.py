"""docs/own-data.md's commands on real pairs, before and after, over seeds (#44).

    python benchmarks/own_data.py                 # 3 seeds, the packaged all-MiniLM-L6-v2 (~10 min on 2 cores)
    python benchmarks/own_data.py --seeds 0 --steps 3    # a quick check of the path

The page's commands, as a user runs them from one folder: ``neoembed init pairs.jsonl --out mydata --model
packaged:all-MiniLM-L6-v2``, ``neoembed data check``, ``neoembed train mydata/pairs-recipe.yaml`` (once per seed,
``seed=S output_dir=runs/pairs-sS``, every other setting as ``init`` wrote it), ``neoembed mteb`` on a held-out
reranking task, ``neoembed mteb compare``. The pairs are ../shared/data/train/trecqa_pairs (348 rows of TrecQA's
train split, with their hard negatives); the held-out task is TrecQA's **dev** split (65 questions; the test split
is never read here), written as the page's ``mydata/heldout-task.yaml``.

"Before" is the base model scored twice: with its own saved query prompt (it has none, so none) and with the
instruction ``init`` wrote into the card (the prompt the fine-tuned model is trained with and saves); "after" is
each seed's model with its saved prompt, the default of ``neoembed mteb`` (``--query-prompt saved``). Results:
benchmarks/results/own_data_cpu.{json,md} and the ``mteb compare`` table beside them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHARED, header, write_results  # noqa: E402

from neoembed.eval.summary import load_run  # noqa: E402

BASE = "packaged:all-MiniLM-L6-v2"
TASK = "MyHeldout"


def neoembed(*args: str, cwd: Path) -> str:
    cmd = [sys.executable, "-m", "neoembed", *args]
    print("+ neoembed " + " ".join(args), flush=True)
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(
            f"neoembed {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        )
    return out.stdout


def write_inputs(folder: Path) -> None:
    """pairs.jsonl from the training pairs; mydata/heldout/test.jsonl from TrecQA's dev split, and its task card."""
    with gzip.open(SHARED / "data/train/trecqa_pairs/train.jsonl.gz", "rt", encoding="utf8") as fh:
        rows = [json.loads(line) for line in fh]
    with (folder / "pairs.jsonl").open("w", encoding="utf8") as f:
        for r in rows:
            f.write(json.dumps({k: r[k] for k in ("query", "positive", "negative") if r.get(k)}) + "\n")
    held = folder / "mydata" / "heldout"
    held.mkdir(parents=True)
    with gzip.open(SHARED / "data/eval/TrecQA/dev.jsonl.gz", "rt", encoding="utf8") as fh:
        (held / "test.jsonl").write_text(fh.read(), encoding="utf8")
    (folder / "mydata" / "heldout-task.yaml").write_text(f"name: {TASK}\ntype: Reranking\ndata: heldout\n")


def main_score(folder: Path) -> float:
    return float(load_run(folder)[TASK]["main_score"])


def run(seeds: list[int], steps: int | None, keep: Path | None) -> dict:
    work = Path(tempfile.mkdtemp(prefix="own-data-"))
    try:
        write_inputs(work)
        neoembed("init", "pairs.jsonl", "--out", "mydata", "--model", BASE, cwd=work)
        check = neoembed("data", "check", "mydata/pairs.yaml", cwd=work)
        card = yaml.safe_load((work / "mydata" / "pairs.yaml").read_text(encoding="utf8"))
        recipe = yaml.safe_load((work / "mydata" / "pairs-recipe.yaml").read_text(encoding="utf8"))
        instruction = card.get("instruction") or ""
        task = ["--tasks", "mydata/heldout-task.yaml"]
        neoembed("mteb", "--model", BASE, *task, "--output", "results/base", cwd=work)
        neoembed("mteb", "--model", BASE, *task, "--query-prompt", instruction, "--output", "results/base-prompt",
                 cwd=work)  # fmt: skip
        after = {}
        for seed in seeds:
            overrides = [f"seed={seed}", f"output_dir=runs/pairs-s{seed}"] + (
                [f"steps={steps}"] if steps else []
            )
            neoembed("train", "mydata/pairs-recipe.yaml", *overrides, cwd=work)
            neoembed(
                "mteb",
                "--model",
                f"runs/pairs-s{seed}",
                *task,
                "--output",
                f"results/pairs-s{seed}",
                cwd=work,
            )
            after[seed] = main_score(work / "results" / f"pairs-s{seed}")
        # the runs scored alike (each model with its own saved prompt); base-prompt is a setting of its own
        runs = ["results/base", *[f"results/pairs-s{s}" for s in seeds]]
        compare = neoembed("mteb", "compare", *runs, "--out", "results/compare", cwd=work)
        if keep:
            shutil.copytree(work / "results", keep, dirs_exist_ok=True)
        return {
            "instruction": instruction,
            "recipe": {
                k: recipe.get(k) for k in ("steps", "batch_size", "optimizer", "temperature", "max_length")
            },
            "data_check": check.strip().splitlines()[:6],
            "base": main_score(work / "results" / "base"),
            "base_with_instruction": main_score(work / "results" / "base-prompt"),
            "after": after,
            "compare": compare,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--steps", type=int, default=None, help="override init's steps (a quick check; not recorded)"
    )
    p.add_argument("--keep", type=Path, default=None, help="copy the results folders here")
    args = p.parse_args()
    out = run(args.seeds, args.steps, args.keep)
    scores = list(out["after"].values())
    mean = statistics.mean(scores)
    sd = statistics.stdev(scores) if len(scores) > 1 else 0.0
    md = [
        f"docs/own-data.md's commands on ../shared/data/train/trecqa_pairs ({BASE}), scored on TrecQA's dev split "
        f"(65 questions, a reranking task: mteb's main score). Recipe as `neoembed init` wrote it: {out['recipe']}.",
        "",
        "| model | query prompt | main score (x100) |",
        "|---|---|---|",
        f"| base | its own (none) | {100 * out['base']:.2f} |",
        f'| base | the card\'s instruction: "{out["instruction"]}" | {100 * out["base_with_instruction"]:.2f} |',
        *[
            f"| fine-tuned, seed {s} | saved (the card's instruction) | {100 * v:.2f} |"
            for s, v in out["after"].items()
        ],
        f"| fine-tuned, mean ± sd over {len(scores)} seeds | saved | **{100 * mean:.2f} ± {100 * sd:.2f}** |",
        "",
        f"- fine-tuned minus base with the same prompt: {100 * (mean - out['base_with_instruction']):+.2f}; "
        f"minus base with its own (no) prompt: {100 * (mean - out['base']):+.2f}",
        "",
        "`neoembed mteb compare` of the runs scored with each model's own saved prompt:",
        "",
        "```",
        out["compare"].strip(),
        "```",
    ]
    name = "own_data_cpu" if not args.steps else "own_data_cpu_quick"
    write_results(name, {"header": header(), **out, "mean": mean, "sd": sd}, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
