"""fp16 evaluation against fp32: ``neoembed mteb`` on the local tasks of ../shared/data, once per precision and model;
the target is every task's main score within +-0.002 of its fp32 score.

    python benchmarks/mteb_precision.py --device cuda --model MINILM --model runs/demo-pretrain/pretrained
    python benchmarks/mteb_precision.py --compare-only OUT     # the table from the runs already in OUT

``--embeddings``: quantized embeddings instead (fp32, int8, binary, and both with ``--rescore``), on the local
retrieval tasks derived from ../shared/data (benchmarks/_retrieval_tasks.py); the issue's target is binary with
rescoring within 0.5 nDCG@10 of fp32 on each. Results: benchmarks/results/embedding_precision_retrieval_<device>.{json,md}
(``_x<N>`` added for a multiplier other than 4).

    OMP_NUM_THREADS=1 python benchmarks/mteb_precision.py --embeddings --device cpu --model MINILM --rescore 4

Each (model, precision) run is its own ``neoembed mteb`` process writing to OUT/<model name>-<precision>/.
Results: benchmarks/results/mteb_precision_<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHARED, header, write_results  # noqa: E402

from neoembed.eval.summary import load_run  # noqa: E402

TOLERANCE = 0.002


def precision_deltas(fp32: dict[str, dict], fp16: dict[str, dict]) -> list[dict]:
    """Per task: both main scores, their difference, and whether it lies within the tolerance. A task missing
    from one side is reported as such (never silently dropped)."""
    rows = []
    for task in sorted(set(fp32) | set(fp16)):
        a, b = fp32.get(task), fp16.get(task)
        if a is None or b is None:
            rows.append(
                {"task": task, "fp32": a and a["main_score"], "fp16": b and b["main_score"], "ok": False}
            )
            continue
        delta = float(b["main_score"]) - float(a["main_score"])
        rows.append(
            {
                "task": task,
                "fp32": a["main_score"],
                "fp16": b["main_score"],
                "delta": delta,
                "ok": abs(delta) <= TOLERANCE,
            }
        )
    return rows


def run(model: str, precision: str, out: Path, device: str) -> int:
    cmd = [
        sys.executable,
        "-m",
        "neoembed",
        "mteb",
        "--model",
        model,
        "--data-dir",
        os.path.relpath(SHARED / "data"),  # relative: the command is logged and recorded
        "--precision",
        precision,
        "--device",
        device,
        "--output",
        str(out),
        "--overwrite",
    ]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


def local_tasks(data: Path) -> set[str]:
    """The evaluation tasks ``neoembed mteb --data-dir`` finds: every card's name whose task_type is not training
    data."""
    import yaml

    cards = (yaml.safe_load(c.read_text(encoding="utf8")) for c in sorted(data.glob("*/*/card.yaml")))
    return {c["name"] for c in cards if c.get("task_type") != "contrastive_pairs"}


def _run_record(folder: Path) -> dict | None:
    f = folder / "run_record.json"
    return json.loads(f.read_text(encoding="utf8")) if f.is_file() else None


def polars_origin() -> str:
    """'installed', or the shim that stands in for it on the GPU machine (benchmarks/gpu_shims)."""
    try:
        import polars
    except ImportError:
        return "not installed"
    return (
        "benchmarks/gpu_shims stand-in (not carried)" if "gpu_shims" in str(polars.__file__) else "installed"
    )


EMBEDDING_ARMS = {  # name -> extra neoembed mteb options ({n}: the --rescore multiplier)
    "fp32": [],
    "int8": ["--embedding-precision", "int8"],
    "binary": ["--embedding-precision", "binary"],
    "int8+rescore": ["--embedding-precision", "int8", "--rescore", "{n}"],
    "binary+rescore": ["--embedding-precision", "binary", "--rescore", "{n}"],
    "binary+rescore(float docs)": [
        "--embedding-precision",
        "binary",
        "--rescore",
        "{n}",
        "--rescore-docs",
        "float",
    ],
}
TARGET = 0.005  # binary + rescoring within 0.5 nDCG@10 points of fp32


def _embedding_arm(model: str, data: Path, out: Path, options: list[str], device: str) -> int:
    cmd = [sys.executable, "-m", "neoembed", "mteb", "--model", model, "--data-dir", str(data),
           "--instructions", "none", "--device", device, "--output", str(out), "--overwrite", *options]  # fmt: skip
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


def embeddings_main(args) -> None:
    """Every arm of EMBEDDING_ARMS on the derived retrieval tasks; one table of nDCG@10 per task and arm."""
    import _retrieval_tasks

    out = Path(args.out)
    data = out / "data"
    if not args.compare_only:
        _retrieval_tasks.write_all(data)
    model = args.model[0] if args.model else None
    runs, failed = {}, []
    for arm, options in EMBEDDING_ARMS.items():
        folder = out / arm.replace("+", "_").replace("(", "_").replace(")", "").replace(" ", "_")
        options = [o.format(n=args.rescore) for o in options]
        if not args.compare_only and _embedding_arm(model, data, folder, options, args.device) != 0:
            failed.append(arm)
        runs[arm] = {t: {"main_score": e["main_score"], "wall_time_s": e["wall_time_s"],
                         "rescore": e.get("rescore", "none")} for t, e in load_run(folder).items()}  # fmt: skip
    tasks = sorted({t for r in runs.values() for t in r})
    arms = list(EMBEDDING_ARMS)
    md = [
        f"| task (nDCG@10) | {' | '.join(arms)} | binary+rescore - fp32 | within 0.5 |",
        "|---" * (len(arms) + 3) + "|",
    ]
    rows = []
    for t in tasks:
        cell = {a: runs[a].get(t, {}).get("main_score") for a in arms}
        delta = (
            None if None in (cell["fp32"], cell["binary+rescore"]) else cell["binary+rescore"] - cell["fp32"]
        )
        ok = delta is not None and delta >= -TARGET
        rows.append({"task": t, **cell, "delta": delta, "ok": ok})
        md.append(f"| {t} | " + " | ".join("–" if cell[a] is None else f"{100 * cell[a]:.2f}" for a in arms)
                  + f" | {'–' if delta is None else f'{100 * delta:+.2f}'} | {'yes' if ok else '**no**'} |")  # fmt: skip
    md += ["", f"- rescore multiplier: {args.rescore} (candidates = {args.rescore} x 10 per query)",
           f"- failed runs: {', '.join(failed) or 'none'}"]  # fmt: skip
    name = f"embedding_precision_retrieval_{args.device.split(':')[0]}"
    if (
        args.rescore != 4
    ):  # sentence-transformers' default multiplier keeps the plain name; others a record each
        name += f"_x{args.rescore}"
    write_results(
        name, {"header": header(), "rescore": args.rescore, "rows": rows, "runs": runs}, "\n".join(md) + "\n"
    )
    print("\n".join(md))
    sys.exit(1 if failed else 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], help="a model folder (repeat for several)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="runs/mteb-precision", help="folder of the runs")
    p.add_argument("--compare-only", action="store_true", help="no new runs: the table from OUT's runs")
    p.add_argument(
        "--embeddings", action="store_true", help="quantized embeddings (+ rescoring), retrieval tasks"
    )
    p.add_argument("--rescore", type=int, default=4, help="--embeddings: the rescore multiplier")
    args = p.parse_args()
    if args.embeddings:
        if not args.model and not args.compare_only:
            p.error("name one --model (or --compare-only)")
        return embeddings_main(args)
    out = Path(args.out)
    if not args.model and not args.compare_only:
        p.error("name at least one --model (or --compare-only)")
    names = [Path(m).name for m in args.model] or sorted({d.name.rsplit("-", 1)[0] for d in out.iterdir()})
    failed = []
    if not args.compare_only:
        for model in args.model:
            for precision in ("fp32", "fp16"):
                if run(model, precision, out / f"{Path(model).name}-{precision}", args.device) != 0:
                    failed.append(f"{model} {precision}")
    md = ["| model | task | fp32 | fp16 | fp16 - fp32 | within +-0.002 |", "|---|---|---|---|---|---|"]
    results = {}
    for name in names:
        rows = precision_deltas(load_run(out / f"{name}-fp32"), load_run(out / f"{name}-fp16"))
        results[name] = rows
        md += [
            f"| {name} | {r['task']} | {r['fp32']} | {r['fp16']} | {r.get('delta', float('nan')):+.4f} | "
            f"{'yes' if r['ok'] else '**no**'} |"
            for r in rows
        ]
    expected = local_tasks(SHARED / "data")
    left_out = {
        n: sorted(expected - {r["task"] for r in rows if r["fp32"] is not None})
        for n, rows in results.items()
    }
    polars = "unknown (--compare-only: the runs were made elsewhere)" if args.compare_only else polars_origin()
    md += ["", f"- failed runs: {', '.join(failed) or 'none'}", f"- polars: {polars}"]
    md += [f"- {d.name}: made on {', '.join(rec['hardware'].get('gpus') or []) or rec['hardware'].get('processor')}"
           f" ({rec['device']}, {rec['time_utc']}, neoembed {rec.get('git_sha') or 'commit not recorded'})"
           for d in sorted(out.iterdir()) if (rec := _run_record(d))]  # fmt: skip
    md += [f"- {n}: tasks of the data folder with no fp32 score (left out): {', '.join(t) or 'none'}"
           for n, t in left_out.items()]  # fmt: skip
    write_results(
        f"mteb_precision_{args.device.split(':')[0]}",
        {
            "header": header(),
            "models": results,
            "failed": failed,
            "left_out": left_out,
            "polars": polars,
        },
        "\n".join(md) + "\n",
    )
    print("\n".join(md))
    sys.exit(1 if failed or not all(r["ok"] for rows in results.values() for r in rows) else 0)


if __name__ == "__main__":
    main()
