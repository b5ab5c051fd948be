"""The run engines side by side, to choose one for unified, CDE, pre-training and GLUE (issue #41, item 2):

(a) Hugging Face's Trainer (under sentence-transformers' SentenceTransformerTrainer), the unified trainer's
    engine until it moved onto (b) (the side-by-side of the choice: results/engines_cpu.md, at 9487f41);
(b) one accelerate loop (neoembed/loop.py's RunLoop), now every trainer's engine.

    cd benchmarks && python engines.py              # CPU, a few minutes: tiny.yaml and cde-tiny.yaml, 3 runs each
    cd benchmarks && python engines.py --skip-timing --stem engines_cpu_after   # the counts only, another record

At a commit after the move, (a) has no modules left: the counts are those of the one engine.

Measured by the script: the overrides of ``_``-prefixed methods of transformers / sentence-transformers /
accelerate classes that neoembed's classes define (found by importing the modules and walking each class's MRO),
the lines of neoembed code each engine path runs on, and step time and peak memory of each tiny recipe through
``neoembed train`` in fresh subprocesses (median over steps 2.. and over runs). What the script cannot measure
(DDP bucketing of the two-stage GradCache step, DeepSpeed / FSDP) is recorded from the sources, cited in the
markdown. The step times are each engine on its own tiny recipe, not the same work on two engines: they say what
the tests and smoke checks cost, and that neither engine's per-step overhead dominates a 2-layer model's step.
Results: results/engines_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, header, write_results

ENGINE_MODULES = {
    "hf_trainer": [],  # neoembed.train.{trainer,hf_trainer,callbacks,holdout} before the unified trainer moved
    "accelerate_loop": [
        "neoembed.loop",
        "neoembed.train.trainer",
        "neoembed.train.engine",
        "neoembed.train.holdout",
        "neoembed.cde.trainer",
        "neoembed.pretrain.trainer",
        "neoembed.glue.run",
    ],
    "shared": ["neoembed.runs", "neoembed.record"],
}

# peak resident memory of the child, printed last on stderr
RUN = r"""
import json, resource, runpy, sys
sys.argv = ["neoembed", *sys.argv[1:]]
try:
    runpy.run_module("neoembed", run_name="__main__")
except SystemExit as e:
    if e.code not in (None, 0):
        raise
print("MAXRSS " + json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024), file=sys.stderr)
"""


def _library_classes() -> dict:
    from accelerate import Accelerator
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from transformers import PreTrainedModel, Trainer

    return {c.__name__: c for c in (Trainer, SentenceTransformerTrainer, PreTrainedModel, Accelerator,
                                    SentenceTransformer)}  # fmt: skip


def private_overrides() -> list[dict]:
    """Methods named ``_x`` (not dunders) that a neoembed class subclassing a library engine or model class
    defines and that class also has: the places an upgrade of the library can silently break. Found in the
    source (classes built inside factories included), checked against the installed library classes."""
    libs, found = _library_classes(), []
    for path in sorted((REPO / "neoembed").rglob("*.py")):
        classes = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]
        by_name = {c.name: c for c in classes}
        for node in classes:
            names = [ast.unparse(b).split(".")[-1] for b in node.bases]
            bases = [libs[n] for n in names if n in libs]
            # a mixin of the same file mixed in beside a library class overrides on its behalf
            for owner in [node, *(by_name[n] for n in names if n in by_name)] if bases else []:
                for fn in owner.body:
                    if (
                        not isinstance(fn, ast.FunctionDef)
                        or not fn.name.startswith("_")
                        or fn.name.startswith("__")
                    ):
                        continue
                    for base in bases:
                        if hasattr(base, fn.name):
                            found.append({"file": str(path.relative_to(REPO)), "method": f"{owner.name}.{fn.name}",
                                          "overrides": f"{base.__module__}.{base.__name__}.{fn.name}"})  # fmt: skip
    return found


def _lines(module: str) -> int:
    """Non-blank, non-comment lines of a module, or of every module of a package (``neoembed.runs``)."""
    path = Path(importlib.import_module(module).__file__)
    files = sorted(path.parent.glob("*.py")) if path.name == "__init__.py" else [path]
    return sum(
        1
        for f in files
        for line in f.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    )


def engine_lines() -> dict:
    return {k: {m: _lines(m) for m in ms} for k, ms in ENGINE_MODULES.items()}


def train_once(recipe: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        args = [sys.executable, "-c", RUN, "train", recipe, f"output_dir={out}", f"steps={steps}",
                f"save_steps={steps}", "logging_steps=1"]  # fmt: skip
        r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, check=False)
        if r.returncode:
            raise RuntimeError(f"{recipe}: exit {r.returncode}\n{r.stderr[-3000:]}")
        rss = json.loads(r.stderr.rsplit("MAXRSS ", 1)[1])
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        batch = {"tiny": 16, "cde-tiny": 8}[recipe]
        per_step = [
            batch / row["samples_per_s"] for row in rows if "samples_per_s" in row and row["step"] > 1
        ]
        return {"step_s": statistics.median(per_step), "peak_rss_mib": rss}


def measure(recipe: str, steps: int, reps: int) -> dict:
    runs = [train_once(recipe, steps) for _ in range(reps)]
    return {
        "runs": runs,
        "step_s": statistics.median(r["step_s"] for r in runs),
        "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in runs),
    }


CAPABILITIES = """\
| question | (a) HF Trainer / SentenceTransformerTrainer | (b) accelerate loop (RunLoop) |
|---|---|---|
| CDE's two-stage GradCache under DDP, one bucketed reduction per step | The Trainer `prepare`s the model into DDP and its `training_step` contract is one `compute_loss` and one `accelerator.backward` per micro-batch, inside its own `accelerator.accumulate`. The two-stage step backpropagates in several passes (stage 2's chunks, then stage 1's), so each pass would fire DDP's reducer: it needs a `training_step` override that runs every pass but the last under `model.no_sync()` (the context stage's gradients arrive only in the last pass, so that pass needs `find_unused_parameters`). | The step function is ours, so one bucketed reduction was a local change with no engine method to override: each stage in its own DDP wrapper, every pass but the stage's last under `no_sync` (`cde/gradcache.py::stages`; before, one `all_reduce` per parameter). Pre-training already runs `accelerator.accumulate` + `accelerator.backward` (one reduction per optimizer step). |
| DeepSpeed ZeRO / FSDP | The Trainer supports them for a plain loss. Cached (GradCache) losses fail under DeepSpeed: sentence-transformers #3173 (\"Gradient computed twice for this partition\", ZeRO + CachedMNRL), #3531 (the maintainer: CachedMNRL \"uses a few hacks that seem incompatible\" with DeepSpeed). The cached loss runs its backward inside the loss, outside the engine's `backward`. | Pre-training runs under DeepSpeed through `accelerator.backward` (its recipe checks the DeepSpeed config's accumulation, `pretrain/trainer.py`). CDE's chunked backward would go through `accelerator.backward` per pass under the loop's control; not yet run with DeepSpeed/FSDP here (no multi-GPU runner): part of porting. |
| Checkpoint / resume | Through private methods: `_save_checkpoint`, `_get_output_dir`, `_load_from_checkpoint`, `_load_best_model` (table above). | neoembed's public functions: `runs.stage_checkpoint` / `commit_checkpoint` and `accelerator.save_state` / `load_state`. |
| Step function | fixed: `compute_loss` per micro-batch | any callable: CDE's two stages, MLM, contrastive, GLUE's classification |
"""


def markdown(payload: dict) -> str:
    over = payload["private_overrides"]
    lines = payload["lines"]
    t = payload["timing"]
    out = ["## Private-API overrides neoembed defines today\n",
           "| engine | neoembed method | overrides |", "|---|---|---|"]  # fmt: skip
    for o in over:
        module = o["file"].removesuffix(".py").replace("/", ".")
        engine = next((k for k, ms in ENGINE_MODULES.items() if module in ms), "model (not an engine)")
        out.append(f"| {engine} | `{o['method']}` | `{o['overrides']}` |")
    if not over:
        out.append("| - | none | - |")
    out += ["\n## Lines of neoembed code per engine path (non-blank, non-comment)\n",
            "| engine | module | lines |", "|---|---|---|"]  # fmt: skip
    for engine, ms in lines.items():
        for m, n in ms.items():
            out.append(f"| {engine} | `{m}` | {n} |")
        out.append(f"| **{engine}** | total | **{sum(ms.values())}** |")
    out += [f"\n## Step time and peak memory (`neoembed train`, {payload['steps']} steps, median of steps 2.. "
            f"and of {payload['reps']} runs)\n",
            "| engine | recipe | s / step | peak RSS MiB |", "|---|---|---|---|"]  # fmt: skip
    for engine, recipe in (("accelerate_loop", "tiny"), ("accelerate_loop", "cde-tiny")):
        if recipe in t:
            out.append(
                f"| {engine} | {recipe} | {t[recipe]['step_s']:.3f} | {t[recipe]['peak_rss_mib']:.0f} |"
            )
    out += ["\nThe recipes differ (CDE's step encodes a context batch and runs two GradCache stages), so the "
            "times say what each path costs on its tiny recipe, not a ratio of engines.\n",
            "## What each engine can run\n", CAPABILITIES]  # fmt: skip
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-timing", action="store_true", help="only the static counts (seconds, not minutes)")
    p.add_argument("--stem", default="engines_cpu", help="the record's name in results/")
    a = p.parse_args()
    # the static counts first: they read the source, which must be the commit the header names
    payload = {"header": header(), "steps": a.steps, "reps": a.reps, "private_overrides": private_overrides(),
               "lines": engine_lines()}  # fmt: skip
    payload["timing"] = (
        {} if a.skip_timing else {r: measure(r, a.steps, a.reps) for r in ("tiny", "cde-tiny")}
    )
    j, m = write_results(a.stem, payload, markdown(payload))
    print(f"wrote {j} and {m}")


if __name__ == "__main__":
    main()
