"""How many passes over a user's pairs `neoembed init` should train for, chosen on pairs the own-data page does not
report on (#44).

    python benchmarks/init_size.py                       # MSRP and STS2012 pairs, 1/2/4/8 passes, 2 seeds
    python benchmarks/init_size.py --passes 1 --seeds 0 --data sts2012_pairs    # a quick check of the path
    python benchmarks/init_size.py --data msrp_pairs --passes 8 --add      # the record's missing cells only

For each pair set of ../shared/data/train (msrp_pairs, sts2012_pairs; never trecqa_pairs, whose TrecQA dev split
the own-data page reports): a seeded fifth of the rows (at most 300) is held out as a retrieval task (each held-out
query against the held-out positives); the rest is the user's ``pairs.jsonl``. Then the own-data page's commands:
``neoembed init pairs.jsonl --out mydata --model packaged:all-MiniLM-L6-v2``, ``neoembed train`` with init's recipe
and ``steps`` = passes x init's steps (one pass), ``neoembed mteb`` on the held-out task with each model's saved
prompt, and the base model with its own (none) and with the card's instruction.
Record: benchmarks/results/init_size_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHARED, header, write_results  # noqa: E402
from own_data import neoembed  # noqa: E402  (the page's commands as a user runs them)

from neoembed.eval.summary import load_run  # noqa: E402

BASE = "packaged:all-MiniLM-L6-v2"
TASK = "Heldout"


def write_inputs(name: str, folder: Path) -> int:
    """``pairs.jsonl`` and the held-out retrieval task ``heldout/`` (+ ``heldout-task.yaml``); returns the rows
    held out."""
    with gzip.open(SHARED / "data" / "train" / name / "train.jsonl.gz", "rt", encoding="utf8") as fh:
        rows = [json.loads(line) for line in fh]
    rows = [r for r in rows if r.get("query", "").strip() and r.get("positive", "").strip()]
    random.Random(0).shuffle(rows)
    n_held = min(300, len(rows) // 5)
    held, train = rows[:n_held], rows[n_held:]
    with (folder / "pairs.jsonl").open("w", encoding="utf8") as f:
        f.writelines(json.dumps({"query": r["query"], "positive": r["positive"]}) + "\n" for r in train)
    corpus: dict[str, str] = {}
    for r in held:
        corpus.setdefault(r["positive"], f"d{len(corpus)}")
    task = folder / "heldout"
    (task / "qrels").mkdir(parents=True)
    lines = {
        "queries.jsonl": [{"_id": f"q{i}", "text": r["query"]} for i, r in enumerate(held)],
        "corpus.jsonl": [{"_id": i, "title": "", "text": t} for t, i in corpus.items()],
        "qrels/test.jsonl": [
            {"query-id": f"q{i}", "corpus-id": corpus[r["positive"]], "score": 1} for i, r in enumerate(held)
        ],
    }
    for file, items in lines.items():
        (task / file).write_text("".join(json.dumps(x) + "\n" for x in items), encoding="utf8")
    card = {"name": TASK, "type": "Retrieval", "data": "heldout", "eval_splits": ["test"]}
    (folder / "heldout-task.yaml").write_text(yaml.safe_dump(card), encoding="utf8")
    return n_held


def score(folder: Path) -> float:
    return float(load_run(folder)[TASK]["main_score"])


def run_set(
    name: str, passes: list[int], seeds: list[int], save: Callable[[dict], None], done: dict | None = None
) -> dict:
    """One pair set; ``save(result so far)`` after every trained model, so a run stopped early keeps the cells
    it measured. ``done``: this set's result in the record (``--add``): its base scores and cells are kept, and
    only the cells it lacks are trained."""
    work = Path(tempfile.mkdtemp(prefix=f"init-size-{name}-"))
    try:
        n_held = write_inputs(name, work)
        neoembed("init", "pairs.jsonl", "--out", "mydata", "--model", BASE, cwd=work)
        recipe = yaml.safe_load((work / "mydata" / "pairs-recipe.yaml").read_text(encoding="utf8"))
        card = yaml.safe_load((work / "mydata" / "pairs.yaml").read_text(encoding="utf8"))
        task = ["--tasks", "heldout-task.yaml"]
        if done is not None:
            if (done["init_steps"], done["rows_trained"]) != (recipe["steps"], _rows(work)):
                sys.exit(f"{name}: init sizes this set differently from the record: --add cannot extend it")
            return _train_cells(work, recipe, passes, seeds, done, save)
        neoembed("mteb", "--model", BASE, *task, "--output", "results/base", cwd=work)
        neoembed("mteb", "--model", BASE, *task, "--query-prompt", card["instruction"], "--output",
                 "results/base-prompt", cwd=work)  # fmt: skip
        result = {
            "rows_trained": _rows(work),
            "rows_held_out": n_held,
            "init_steps": recipe["steps"],
            "batch_size": recipe["batch_size"],
            "base": score(work / "results" / "base"),
            "base_with_instruction": score(work / "results" / "base-prompt"),
            "after": {},
        }
        return _train_cells(work, recipe, passes, seeds, result, save)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _rows(work: Path) -> int:
    return sum(1 for _ in (work / "pairs.jsonl").open())


def _train_cells(work: Path, recipe: dict, passes, seeds, result: dict, save: Callable[[dict], None]) -> dict:
    """Train and score each (passes, seed) cell ``result`` lacks (keyed by strings, as in the JSON record)."""
    for k in passes:
        for seed in seeds:
            if str(seed) in result["after"].get(str(k), {}):
                continue
            run = f"runs/p{k}-s{seed}"
            neoembed("train", "mydata/pairs-recipe.yaml", f"steps={k * recipe['steps']}", f"seed={seed}",
                     f"output_dir={run}", cwd=work)  # fmt: skip
            neoembed("mteb", "--model", run, "--tasks", "heldout-task.yaml", "--output", f"results/p{k}-s{seed}",
                     cwd=work)  # fmt: skip
            result["after"].setdefault(str(k), {})[str(seed)] = score(work / "results" / f"p{k}-s{seed}")
            save(result)
    return result


def markdown(results: dict, complete: bool = True) -> str:
    lines = [
        "Each pair set: a seeded fifth (at most 300 rows) held out as a retrieval task; `neoembed init` on the rest "
        f"({BASE}); training at passes x init's one-pass steps; nDCG@10 (x100) on the held-out task, each model "
        "with its saved prompt; gain = fine-tuned minus the base model with its own (no) prompt.\n",
        "| pairs | rows trained | batch | passes | steps | nDCG@10 mean ± sd | gain |",
        "|---|---|---|---|---|---|---|",
    ]
    gains: dict[int, list[float]] = {}
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['rows_trained']} | {r['batch_size']} | base (none / instruction) | 0 | "
            f"{100 * r['base']:.2f} / {100 * r['base_with_instruction']:.2f} | |"
        )
        for k, by_seed in r["after"].items():
            v = list(by_seed.values())
            mean, sd = statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0
            gains.setdefault(int(k), []).append(mean - r["base"])
            seeds = f" ({len(v)} seed{'s' * (len(v) > 1)})" if not complete else ""
            lines.append(
                f"| {name} | {r['rows_trained']} | {r['batch_size']} | {k}{seeds} | {int(k) * r['init_steps']} | "
                f"{100 * mean:.2f} ± {100 * sd:.2f} | {100 * (mean - r['base']):+.2f} |"
            )
    # a mean over the pair sets only where every set has the cell (a stopped run lacks some)
    shared = {k: g for k, g in gains.items() if len(g) == len(results)}
    if shared:
        best = max(shared, key=lambda k: statistics.mean(shared[k]))
        lines += ["", "Mean gain over the pair sets, by passes measured on every set: " + ", ".join(
            f"{k}: {100 * statistics.mean(g):+.2f}" for k, g in sorted(shared.items())
        ) + f". Best: {best}."]  # fmt: skip
    if not complete:
        lines += [
            "",
            "**Incomplete**: the run stopped before every cell was measured; these are the cells it had.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", default=["msrp_pairs", "sts2012_pairs"])
    p.add_argument("--passes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--add", action="store_true", help="keep the record's cells and measure only those it lacks")
    args = p.parse_args()
    if "trecqa_pairs" in args.data:
        sys.exit("trecqa_pairs is the own-data page's report: choose the rule on other pairs")
    results: dict[str, dict] = {}
    head = header()
    if args.add:  # the record's cells stay, with the commit and command that measured them
        old = json.loads((Path(__file__).resolve().parent / "results" / "init_size_cpu.json").read_text())
        results = old["results"]
        earlier = old["header"].get("carried") or []  # a record extended before names its own sources
        earlier = [earlier] if isinstance(earlier, dict) else earlier
        head["carried"] = [*earlier, {k: old["header"][k] for k in ("commit", "command")}]

    def save(complete: bool) -> str:
        md = markdown(results, complete)
        if head.get("carried"):
            sources = "; ".join(f"`{c['commit']}` (`{c['command']}`)" for c in head["carried"])
            md += f"\nCells this command did not train are carried from the records of {sources}.\n"
        write_results("init_size_cpu", {"header": head, "complete": complete, "results": results}, md)
        return md

    for name in args.data:

        def partial(result: dict, name: str = name) -> None:
            results[name] = result
            save(False)

        results[name] = run_set(name, args.passes, args.seeds, partial, results.get(name) if args.add else None)
    # complete: every set has the same cells (--add may leave one set short of another's)
    cells = {frozenset((k, len(v)) for k, v in r["after"].items()) for r in results.values()}
    print(save(len(cells) == 1))


if __name__ == "__main__":
    main()
