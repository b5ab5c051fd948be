"""fp16 evaluation against fp32: ``neoembed mteb`` on the local tasks of ../shared/data, once per precision and model;
the target is every task's main score within +-0.002 of its fp32 score.

    python benchmarks/mteb_precision.py --device cuda --model MINILM --model runs/demo-pretrain/pretrained
    python benchmarks/mteb_precision.py --compare-only OUT     # the table from the runs already in OUT

Each (model, precision) run is its own ``neoembed mteb`` process writing to OUT/<model name>-<precision>/.
Results: benchmarks/results/mteb_precision_<device>.{json,md}.
"""

from __future__ import annotations

import argparse
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
        str(SHARED / "data"),
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], help="a model folder (repeat for several)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="runs/mteb-precision", help="folder of the runs")
    p.add_argument("--compare-only", action="store_true", help="no new runs: the table from OUT's runs")
    args = p.parse_args()
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
    md += ["", f"- failed runs: {', '.join(failed) or 'none'}"]
    write_results(
        f"mteb_precision_{args.device.split(':')[0]}",
        {"header": header(), "models": results, "failed": failed},
        "\n".join(md) + "\n",
    )
    print("\n".join(md))
    sys.exit(1 if failed or not all(r["ok"] for rows in results.values() for r in rows) else 0)


if __name__ == "__main__":
    main()
