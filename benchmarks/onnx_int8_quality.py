"""What int8 serving costs in quality: a model, its fp32 ONNX graph and its int8 graph (ONNX Runtime dynamic
quantization, ``neoembed export --quantize int8``) scored by ``neoembed mteb`` on every local task of
../shared/data, with the same instructions; the issue's target is an int8 change within 0.5 points on each.

    neoembed quickstart --output runs/quickstart        # a trained model: runs/quickstart/model
    python benchmarks/onnx_int8_quality.py --model runs/quickstart/model --out runs/int8-quality

Each arm is its own ``neoembed mteb`` process writing OUT/<arm>/; the export goes to OUT/export/.
Results: benchmarks/results/onnx_int8_quality_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHARED, header, write_results  # noqa: E402

from neoembed.eval.summary import load_run  # noqa: E402
from neoembed.export.onnx import isa_suffix  # noqa: E402

TARGET = 0.005  # 0.5 points


def _arms(model: str, export: Path) -> dict[str, list[str]]:
    return {
        "torch fp32": ["--model", model],
        "onnx fp32": ["--model", str(export), "--backend", "onnx"],
        "onnx int8": [
            "--model",
            str(export),
            "--backend",
            "onnx",
            "--onnx-file",
            f"model_qint8_{isa_suffix()}.onnx",
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a trained model folder (or packaged:all-MiniLM-L6-v2)")
    p.add_argument("--out", default="runs/int8-quality")
    p.add_argument("--data-dir", default=str(SHARED / "data"), help="the local tasks")
    args = p.parse_args()
    out = Path(args.out)
    export = out / "export"
    if not (export / "onnx").is_dir():
        cmd = ["neoembed", "export", args.model, str(export), "--format", "onnx", "--quantize", "int8"]
        subprocess.run(cmd, check=True)
    arms = _arms(args.model, export)
    runs, failed = {}, []
    for arm, options in arms.items():
        folder = out / arm.replace(" ", "-")
        cmd = ["neoembed", "mteb", *options, "--data-dir", args.data_dir, "--output", str(folder)]
        if subprocess.run(cmd).returncode != 0:
            failed.append(arm)
        runs[arm] = {t: e["main_score"] for t, e in load_run(folder).items()}
    tasks = sorted({t for r in runs.values() for t in r})
    md = [f"| task | {' | '.join(arms)} | int8 - torch | within 0.5 |", "|---" * (len(arms) + 3) + "|"]
    rows = []
    for t in tasks:
        cell = {a: runs[a].get(t) for a in arms}
        delta = (
            None
            if None in (cell["torch fp32"], cell["onnx int8"])
            else cell["onnx int8"] - cell["torch fp32"]
        )
        ok = delta is not None and abs(delta) <= TARGET
        rows.append({"task": t, **cell, "delta": delta, "ok": ok})
        md.append(
            f"| {t} | " + " | ".join("–" if cell[a] is None else f"{100 * cell[a]:.2f}" for a in arms)
            + f" | {'–' if delta is None else f'{100 * delta:+.2f}'} | {'yes' if ok else '**no**'} |"
        )  # fmt: skip
    md += ["", f"- model: {args.model}; int8 graph: model_qint8_{isa_suffix()}.onnx",
           f"- failed runs: {', '.join(failed) or 'none'}"]  # fmt: skip
    write_results(
        "onnx_int8_quality_cpu", {"header": header(), "model": args.model, "rows": rows}, "\n".join(md) + "\n"
    )
    print("\n".join(md))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
