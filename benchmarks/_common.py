"""Small helpers shared by the benchmark scripts: a header naming command, commit and hardware; timing;
writers for JSON and markdown results."""

from __future__ import annotations

import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from neoembed.record import atomic_write_text, git_sha, hardware, package_versions

REPO = Path(__file__).resolve().parents[1]
# ../shared beside the checkout (what benchmarks are run with), else the copy the tests carry (a lone clone)
SHARED = REPO.parent / "shared" if (REPO.parent / "shared").is_dir() else REPO / "tests" / "shared"
RESULTS = REPO / "benchmarks" / "results"


def header() -> dict:
    return {
        "command": " ".join(["python", *sys.argv]),
        # a copy whose .git is absent or not its own (the GPU machine's) names its commit in NEOEMBED_COMMIT
        "commit": git_sha(REPO) or "unknown (no git; set NEOEMBED_COMMIT)",
        "hardware": hardware(),
        "packages": package_versions(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_time(fn: Callable[[], object], device: str, reps: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` in seconds (device-synchronised), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def first_and_median(
    fns: dict[str, Callable[[], object]], device: str, reps: int
) -> dict[str, tuple[float, float]]:
    """Seconds of each of ``fns``' first pass, and the median of the ``reps`` passes after it; the fns interleaved
    pass by pass, so that drift hits all of them alike. The first pass pays what a process pays once (CUDA loading
    each kernel at its first launch, library handles, a CUDA graph recorded per shape): kept apart, not averaged."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(1 + reps):
        for name, fn in fns.items():
            times[name].append(median_time(fn, device, 1, warmup=0))
    return {name: (ts[0], statistics.median(ts[1:])) for name, ts in times.items()}


def matmul_rate(device: str, dtype: torch.dtype, n: int, reps: int = 5) -> float:
    """FLOP/s of an n x n x n matrix product on random data."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = median_time(lambda: a @ b, device, reps, warmup=2)
    return 2 * n**3 / t


def linear_params(model) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def model_flops(model, tokens: int, attended: float) -> float:
    """Forward FLOPs of ``tokens`` tokens that each attend to ``attended`` keys: 2 x (parameters of the linear
    layers) per token, plus 4 x attended x hidden per token and layer (QK^T and attention x V)."""
    cfg = model.config
    return tokens * (2 * linear_params(model) + cfg.num_hidden_layers * 4 * attended * cfg.hidden_size)


def real_texts(limit: int | None = None) -> list[str]:
    """Every text field of ../shared/data/**/*.jsonl.gz (sentences, questions, answers), in file order."""
    texts: list[str] = []
    for f in sorted(SHARED.glob("data/**/*.jsonl.gz")):
        with gzip.open(f, "rt", encoding="utf8") as fh:
            for line in fh:
                row = json.loads(line)
                for v in row.values():
                    items = v if isinstance(v, list) else [v]
                    texts.extend(x for x in items if isinstance(x, str) and len(x) > 3)
                if limit and len(texts) >= limit:
                    return texts[:limit]
    return texts


#: set to 1 for a run meant to replace the committed records (the GPU suite sets it)
RECORD_ENV = "NEOEMBED_RECORD"


def _tracked(path: Path) -> bool:
    if not path.parent.is_dir():
        return False
    try:
        r = subprocess.run(["git", "ls-files", "--error-unmatch", path.name], cwd=path.parent, capture_output=True)
    except OSError:  # no git here (the GPU machine's copy): nothing is tracked
        return False
    return r.returncode == 0


def results_dir(stem: str) -> Path:
    """benchmarks/results/, unless that would overwrite a committed record without NEOEMBED_RECORD=1: then the
    git-ignored benchmarks/results/local/, so that trying a benchmark leaves the checkout clean."""
    if os.environ.get(RECORD_ENV) == "1" or not _tracked(RESULTS / f"{stem}.md"):
        return RESULTS
    print(f"{stem}: committed record kept; this run goes to results/local/ ({RECORD_ENV}=1 replaces the record)")
    return RESULTS / "local"


def write_results(stem: str, payload: dict, markdown: str) -> tuple[Path, Path]:
    folder = results_dir(stem)
    folder.mkdir(parents=True, exist_ok=True)
    j, m = folder / f"{stem}.json", folder / f"{stem}.md"
    atomic_write_text(j, json.dumps(payload, indent=2, default=str) + "\n")
    head = payload["header"]
    md = (
        f"<!-- generated by benchmarks; do not edit -->\n\n"
        f"Command: `{head['command']}`  \nCommit: `{head['commit']}`  \n"
        f"Hardware: {head['hardware'].get('gpus') or head['hardware'].get('processor') or head['hardware'].get('machine')}, "
        f"{head['hardware'].get('cpu_count')} CPUs, torch threads {head['hardware'].get('torch_threads')}  \n"
        f"Time: {head['time_utc']}\n\n" + markdown
    )
    atomic_write_text(m, md)
    return j, m


def unified_engine(model, loss, dataset, *, steps: int, batch: int, out: str, lr: float = 2e-5, seed: int = 0):
    """neoembed's unified training engine (:mod:`neoembed.train.engine` on the run loop) on one dataset, as
    ``neoembed train`` runs it but without cards, checkpoints or evaluation: returns a callable that trains
    ``steps`` steps of ``batch`` rows (what the step benchmarks time against sentence-transformers' trainer)."""
    from neoembed.loop import RunLoop, accelerator, adamw
    from neoembed.recipe import load_recipe
    from neoembed.train.engine import batches, place_model_in_loss, unified_step
    from neoembed.train.recipe import UnifiedRecipe

    never = str(10**9)  # no checkpoint, one logged row at the end
    overrides = [f"steps={steps}", f"save_steps={never}", f"logging_steps={never}", f"optimizer.lr={lr}",
                 "optimizer.schedule=linear", "optimizer.weight_decay=0", f"output_dir={out}", f"seed={seed}"]
    recipe = load_recipe("tiny", UnifiedRecipe, overrides)
    acc = accelerator()
    optimizer = adamw(model, recipe.optimizer)
    wrapped, optimizer = acc.prepare(model, optimizer)
    place_model_in_loss(loss, model, wrapped)
    loader, sampler = batches(acc, model, {"d": dataset}, {"d": batch}, {}, alpha=0.5, steps=steps,
                              full_sizes=[len(dataset)], seed=seed)  # fmt: skip
    loop = RunLoop(acc, recipe, Path(out), optimizer=optimizer, parameters=wrapped.parameters, settings=None,
                   progress=False)
    model.train()
    return lambda: loop.run(*unified_step(acc, loss, loader, sampler, ["d"], {"d": batch}, 0, None))
