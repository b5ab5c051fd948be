"""Data cards at scale (#39, part b): ``neoembed data check`` and the first training step's data preparation on
synthetic cards of 0.1M-4M rows, cold and from the prepared-card cache.

    python benchmarks/scale_cards.py --make-card 1000000 --out runs/card-1m        # only write a card
    python benchmarks/scale_cards.py --rows 100000 1000000 --work-dir runs/scale-cards
    python benchmarks/scale_cards.py --rows 100000 --tree ../before --tag _before  # another checkout's neoembed

A synthetic card: rows drawn with a fixed seed from the texts of ../shared/data/train/* (each query suffixed with
its row number, so that texts stay distinct; a positive is two sentences, a negative one, which gives about
0.8 GB of JSONL per million rows), 3 hard negatives each, plain JSONL beside its card.

Every measurement is a process of its own, sampled every 20 ms: peak ``RssAnon`` (/proc/PID/status: the
process's own memory; the Arrow files datasets memory-maps are file pages, not counted) and ``VmHWM`` for
reference, wall time and CPU time (user + system). ``cold``: empty datasets and card caches (the JSON is read and
converted, the rows read and kept); ``cached``: the same command again. ``data check``: ``python -m neoembed data
check CARD --sample 0``. ``first step``: ``neoembed.train.trainer.prepare_datasets`` on a recipe with this one
card, ``plan_no_duplicates`` (``no_duplicates: auto``), the power-law sampler over sentence-transformers' batch
sampler, and the rows of its first batch of 256. The machine's load (/proc/loadavg) is recorded with each run:
on a shared machine wall time varies with it, CPU time much less.
Results: benchmarks/results/scale_cards_cpu{tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import SHARED, header, write_results

from neoembed.record import git_sha

NEGATIVES, FIRST_BATCH = 3, 256
HERE = Path(__file__).resolve()
START = time.perf_counter()


def _train_texts() -> list[str]:
    """Every text of ../shared/data/train/*/*.jsonl.gz, in file order, without repeats."""
    texts: dict[str, None] = {}
    for f in sorted(SHARED.glob("data/train/*/*.jsonl.gz")):
        with gzip.open(f, "rt", encoding="utf8") as fh:
            for line in fh:
                for v in json.loads(line).values():
                    if isinstance(v, str) and len(v.strip()) > 3:
                        texts[v.strip()] = None
    return list(texts)


def make_card(rows: int, out: Path, seed: int = 0) -> Path:
    """A synthetic card of ``rows`` rows in ``out`` (see the module docstring); returns the card file."""
    texts = _train_texts()
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "rows.jsonl", "w", encoding="utf8") as f:
        for i in range(rows):
            row = {
                "query": f"{rng.choice(texts)} #{i}",
                "positive": f"{rng.choice(texts)} {rng.choice(texts)}",
            }
            row |= {f"negative_{j + 1}": rng.choice(texts) for j in range(NEGATIVES)}
            f.write(json.dumps(row) + "\n")
    card = {
        "name": f"synthetic_{rows}",
        "source": {"local": {"path": "rows.jsonl", "format": "json"}},
        "columns": {
            "query": "query",
            "positive": "positive",
            "negatives": [f"negative_{j + 1}" for j in range(NEGATIVES)],
        },
        "instruction": "Given a question, retrieve passages that answer it.",
        "license": "synthetic rows of ../shared/data/train (research use)",
        "size": rows,
        "notes": f"benchmarks/scale_cards.py --make-card {rows} (seed {seed})",
    }
    (out / "card.yaml").write_text(json.dumps(card, indent=1) + "\n")
    return out / "card.yaml"


def _first_step(card: str) -> None:
    """The child of a ``first step`` measurement: what training prepares before its first step, then the rows of
    that step's batch. Prints one JSON line of phase times."""
    import torch
    from sentence_transformers.base.sampler import DefaultBatchSampler, NoDuplicatesBatchSampler
    from torch.utils.data import ConcatDataset, RandomSampler

    from neoembed.data.sampler import PowerLawDatasetBatchSampler, plan_no_duplicates
    from neoembed.train.recipe import UnifiedRecipe
    from neoembed.train.trainer import prepare_datasets

    t0 = time.perf_counter()
    recipe = UnifiedRecipe(
        model="unused", datasets=[{"card": card}], batch_size=FIRST_BATCH, steps=10, seed=0
    )
    datasets, _, sizes = prepare_datasets(recipe)
    t1 = time.perf_counter()
    ds = next(iter(datasets.values()))
    unique = plan_no_duplicates(recipe.no_duplicates, ds, FIRST_BATCH, "card")
    t2 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    kind = NoDuplicatesBatchSampler if unique else DefaultBatchSampler
    inner = ds if unique else RandomSampler(ds, generator=g)
    batch_sampler = kind(inner, batch_size=FIRST_BATCH, drop_last=True, generator=g)
    sampler = PowerLawDatasetBatchSampler(ConcatDataset([ds]), [batch_sampler], alpha=0.5, num_steps=10)
    rows = ds[next(iter(sampler))]
    t3 = time.perf_counter()
    assert len(rows["query"]) == FIRST_BATCH
    print(
        json.dumps(
            {
                "imports_s": t0 - START,
                "prepare_s": t1 - t0,
                "no_duplicates_s": t2 - t1,
                "first_batch_s": t3 - t2,
                "unique": unique,
            }
        )
    )


def _status_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def measure(cmd: list[str], env: dict, cwd: str | None = None) -> dict:
    """Run ``cmd``; its wall and CPU time, peak RssAnon and VmHWM (MiB, sampled every 20 ms), exit code, output."""
    load = os.getloadavg()[0]
    # files, not pipes: a pipe could fill and block the child
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=err, text=True)
        anon = hwm = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            anon = max(anon, _status_kib(proc.pid, "RssAnon"))
            hwm = max(hwm, _status_kib(proc.pid, "VmHWM"))
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        out.seek(0), err.seek(0)
        out, err = out.read(), err.read()
    code = os.waitstatus_to_exitcode(status)
    if code:
        print(err[-3000:], file=sys.stderr)
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_anon_mib": round(anon / 1024, 1),
        "peak_vmhwm_mib": round(hwm / 1024, 1),
        "exit": code,
        "load_1min": load,
        "stdout_tail": out[-400:],
    }


def run_size(rows: int, work: Path, tree: str | None, only: list[str] | None = None) -> list[dict]:
    folder = work / f"card-{rows}"
    card = folder / "card.yaml"
    if not card.is_file():
        t0 = time.perf_counter()
        make_card(rows, folder)
        print(f"{rows:,} rows: card written in {time.perf_counter() - t0:.0f} s", flush=True)
    size_mb = (folder / "rows.jsonl").stat().st_size / 1e6
    commands = {
        "data check": [sys.executable, "-m", "neoembed", "data", "check", str(card), "--sample", "0"],
        "first step": [sys.executable, str(HERE), "--first-step", str(card)],
    }
    # run in the measured checkout: `python -m` puts the working directory first on the path
    where = str(Path(tree).resolve()) if tree else str(HERE.parents[1])
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=where)
    startup = measure(
        [sys.executable, "-m", "neoembed", "data", "check", "--help"], env, where
    )  # imports, no data
    out = [
        {
            "rows": rows,
            "jsonl_mb": round(size_mb, 1),
            "what": "startup (data check --help)",
            "state": "-",
            **startup,
        }
    ]
    for what, cmd in commands.items():
        if only and what not in only:
            continue
        caches = folder / "caches"
        shutil.rmtree(caches, ignore_errors=True)
        env |= {"HF_DATASETS_CACHE": str(caches / "datasets"), "NEOEMBED_CARD_CACHE": str(caches / "cards")}
        for state in ("cold", "cached"):
            m = measure(cmd, env, where)
            out.append({"rows": rows, "jsonl_mb": round(size_mb, 1), "what": what, "state": state, **m})
            print(json.dumps(out[-1]), flush=True)
        shutil.rmtree(caches, ignore_errors=True)
    return out


def _phase_dict(r: dict) -> dict:
    """A first-step child's phase times (its last output line), else {}."""
    try:
        phases = json.loads(r["stdout_tail"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {}
    return phases if isinstance(phases, dict) else {}


def _phases(r: dict) -> str:
    phases = _phase_dict(r)
    return ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in phases.items() if k.endswith("_s"))


def _markdown(results: list[dict], tree: str | None) -> str:
    lines = [
        "Targets (#39): peak anonymous memory <= 1.5 GB at 4M rows, <= 30 s per million rows cold on 2 cores, "
        "<= 5 s from the cache. The `startup` row is `data check --help` (the command line's own start); the "
        "first step's time includes importing the trainer (torch, transformers: its `imports` phase), and its "
        "data work is the other `phases` and the summary below.\n",
        f"neoembed from {'another checkout (' + tree + ')' if tree else 'this checkout'}; synthetic cards of "
        f"../shared/data/train texts, {NEGATIVES} hard negatives per row; each measurement its own process. "
        "Peak anonymous memory: RssAnon sampled every 20 ms (the memory-mapped Arrow files are not in it).\n",
        "| rows | JSONL (MB) | command | caches | wall (s) | CPU (s) | peak RssAnon (MiB) | peak VmHWM (MiB) | "
        "load (1 min) | exit | phases (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['rows']:,} | {r['jsonl_mb']:,} | {r['what']} | {r['state']} | {r['wall_s']} | {r['cpu_s']} | "
            f"{r['peak_rss_anon_mib']:,} | {r['peak_vmhwm_mib']:,} | {r['load_1min']:.1f} | {r['exit']} | "
            f"{_phases(r)} |"
        )
    return "\n".join(lines) + "\n" + _summary(results)


def _summary(results: list[dict]) -> str:
    """Per size: the cold data check's CPU time beyond the command's start-up, per million rows; the cached
    first step's phases (the command's time from the cache is mostly its imports: the package root loads torch
    and transformers); the largest peak RssAnon."""
    lines = [
        "\n| rows | data check cold: CPU beyond start-up (s per 1M rows) | first step from the caches: "
        "prepare + no_duplicates + first batch (s) | largest peak RssAnon (MiB) |",
        "|---|---|---|---|",
    ]
    for rows in dict.fromkeys(r["rows"] for r in results):
        mine = [r for r in results if r["rows"] == rows]
        start = next((r["cpu_s"] for r in mine if r["what"].startswith("startup")), 0.0)
        cold = next((r["cpu_s"] for r in mine if r["what"] == "data check" and r["state"] == "cold"), None)
        cached = next((r for r in mine if r["what"] == "first step" and r["state"] == "cached"), None)
        phases = _phase_dict(cached) if cached else {}
        inside = sum(phases.get(k, 0.0) for k in ("prepare_s", "no_duplicates_s", "first_batch_s"))
        per_m = f"{(cold - start) / rows * 1e6:.1f}" if cold is not None else "-"
        peak = max(r["peak_rss_anon_mib"] for r in mine)
        lines.append(f"| {rows:,} | {per_m} | {inside:.2f} | {peak:,} |")
    return "\n".join(lines) + "\n"


def _record_text(payload: dict) -> str:
    """The markdown record of a results JSON, as write_results writes it."""
    head = payload["header"]
    hw = head["hardware"]
    return (
        "<!-- generated by benchmarks; do not edit -->\n\n"
        f"Command: `{head['command']}`  \nCommit: `{head['commit']}`  \n"
        f"Hardware: {hw.get('gpus') or hw.get('processor') or hw.get('machine')}, {hw.get('cpu_count')} CPUs, "
        f"torch threads {hw.get('torch_threads')}  \nTime: {head['time_utc']}\n\n"
        + _markdown(payload["results"], payload.get("tree"))
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--make-card", type=int, metavar="N", help="only write a synthetic card of N rows (--out)"
    )
    ap.add_argument("--out", type=Path, help="the folder of --make-card's card")
    ap.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument(
        "--work-dir", type=Path, default=Path("runs/scale-cards"), help="cards and caches (deleted)"
    )
    ap.add_argument("--tree", help="a neoembed checkout to measure instead of this one (its PYTHONPATH)")
    ap.add_argument("--tag", default="", help="suffix of the results' file names")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic cards in --work-dir")
    ap.add_argument("--only", nargs="+", choices=["data check", "first step"], help="measure only these")
    ap.add_argument("--render", type=Path, help="write the markdown of a results JSON again (no measuring)")
    ap.add_argument("--first-step", help=argparse.SUPPRESS)  # the child of a ``first step`` measurement
    args = ap.parse_args()
    if args.first_step:
        return _first_step(args.first_step)
    if args.render:
        payload = json.loads(args.render.read_text())
        md = HERE.parent / "results" / args.render.with_suffix(".md").name
        return md.write_text(_record_text(payload))
    if args.make_card:
        card = make_card(args.make_card, args.out or Path(f"card-{args.make_card}"))
        return print(f"wrote {card} ({(card.parent / 'rows.jsonl').stat().st_size / 1e6:,.0f} MB of JSONL)")
    results = []
    for rows in args.rows:
        results += run_size(rows, args.work_dir, args.tree, args.only)
        if not args.keep:
            shutil.rmtree(args.work_dir / f"card-{rows}", ignore_errors=True)
    tree = f"{args.tree} (commit {git_sha(Path(args.tree))})" if args.tree else None
    payload = {"header": header(), "tree": tree, "results": results}
    _, md = write_results(f"scale_cards_cpu{args.tag}", payload, _markdown(results, args.tree))
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
