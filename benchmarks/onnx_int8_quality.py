"""What int8 serving costs in quality: a model, its fp32 ONNX graph and its int8 graph (ONNX Runtime dynamic
quantization, ``neoembed export --quantize int8``: one weight scale per output channel) scored by ``neoembed mteb``
on every local task of ../shared/data, with the same instructions, beside torch's own int8 (``neoembed mteb
--quantize int8``: the same scheme on the torch model's linear layers), the packed int8 graph
(``model_packed_qint8_<isa>.onnx``: its activations are quantized over rows without padding, so its ranges differ)
and the per-tensor graph of sentence-transformers' default scheme; the issue's target is an int8 change within 0.5 points on each.

    neoembed quickstart --output runs/quickstart        # a trained model: runs/quickstart/model
    python benchmarks/onnx_int8_quality.py --model runs/quickstart/model --out runs/int8-quality

Each arm is its own ``neoembed mteb`` process writing OUT/<arm>/; the export goes to OUT/export/.
Results: benchmarks/results/onnx_int8_quality_cpu.{json,md} on a CPU with AVX-512 VNNI, ..._cpu_<isa>.{json,md}
elsewhere. The per-tensor arm quantizes full 8-bit int8 weights on every CPU; sentence-transformers' own avx2
config uses uint8 weights instead (``model_quint8_avx2.onnx``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SHARED, header, write_results  # noqa: E402

from neoembed.eval.summary import load_run  # noqa: E402
from neoembed.export.onnx import isa_suffix  # noqa: E402

TARGET = 0.005  # 0.5 points


PER_TENSOR = "model_qint8_per_tensor.onnx"


def _per_tensor(export: Path) -> None:
    """sentence-transformers' default scheme beside neoembed's: one weight scale per tensor."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    target = export / "onnx" / PER_TENSOR
    if not target.is_file():
        quantize_dynamic(
            str(export / "onnx" / "model.onnx"), str(target), weight_type=QuantType.QInt8, per_channel=False
        )


def _arms(model: str, export: Path) -> dict[str, list[str]]:
    onnx = ["--model", str(export), "--backend", "onnx"]
    return {
        "torch fp32": ["--model", model],
        "torch int8": ["--model", model, "--quantize", "int8"],
        "onnx fp32": onnx,
        "onnx int8": [*onnx, "--onnx-file", f"model_qint8_{isa_suffix()}.onnx"],
        "onnx int8 packed": [*onnx, "--onnx-file", f"model_packed_qint8_{isa_suffix()}.onnx"],
        "onnx int8 per tensor": [*onnx, "--onnx-file", PER_TENSOR],
    }


#: the arms whose change from torch fp32 is tabled; the first three are neoembed's int8 forms (the target's)
CHANGES = {
    "onnx int8": "int8",
    "onnx int8 packed": "packed int8",
    "torch int8": "torch int8",
    "onnx int8 per tensor": "per tensor",
}
TARGETED = list(CHANGES)[:3]


def _change(cell: dict, arm: str) -> float | None:
    return None if None in (cell["torch fp32"], cell[arm]) else cell[arm] - cell["torch fp32"]


def _table(runs: dict, arms: dict) -> tuple[list[dict], list[str]]:
    heads = " | ".join(f"{name} - torch" for name in CHANGES.values())
    md = [
        f"| task | {' | '.join(arms)} | {heads} | within 0.5 |",
        "|---" * (len(arms) + len(CHANGES) + 2) + "|",
    ]
    rows = []
    for t in sorted({t for r in runs.values() for t in r}):
        cell = {a: runs[a].get(t) for a in arms}
        deltas = {arm: _change(cell, arm) for arm in CHANGES}
        ok = all(deltas[a] is not None and abs(deltas[a]) <= TARGET for a in TARGETED)
        rows.append({"task": t, **cell, "delta": deltas, "ok": ok})
        shown = ["–" if cell[a] is None else f"{100 * cell[a]:.2f}" for a in arms]
        shown += ["–" if d is None else f"{100 * d:+.2f}" for d in deltas.values()]
        md.append(f"| {t} | " + " | ".join(shown) + f" | {'yes' if ok else '**no**'} |")
    return rows, md


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
    _per_tensor(export)
    arms = _arms(args.model, export)
    runs, failed = {}, []
    for arm, options in arms.items():
        folder = out / arm.replace(" ", "-")
        cmd = ["neoembed", "mteb", *options, "--data-dir", args.data_dir, "--output", str(folder)]
        if subprocess.run(cmd).returncode != 0:
            failed.append(arm)
        runs[arm] = {t: e["main_score"] for t, e in load_run(folder).items()}
    rows, md = _table(runs, arms)
    bits = json.loads((export / "export.json").read_text()).get("int8_weight_bits", 8)
    md += ["", f"- model: {args.model}; int8 graphs: model_qint8_{isa_suffix()}.onnx and "
           f"model_packed_qint8_{isa_suffix()}.onnx (per channel, {bits}-bit weights on this CPU), {PER_TENSOR}",
           "- torch int8: `neoembed mteb --quantize int8` (the torch model's linear layers in dynamic int8, "
           "padding-free)",
           "- within 0.5: each of neoembed's int8 forms (ONNX padded and packed, torch) within 0.5 points of torch fp32",
           f"- failed runs: {', '.join(failed) or 'none'}"]  # fmt: skip
    # one record per instruction set, as serving.py: without VNNI the int8 weights keep 7 bits
    stem = "onnx_int8_quality_cpu" + ("" if isa_suffix() == "avx512_vnni" else f"_{isa_suffix()}")
    write_results(stem, {"header": header(), "model": args.model, "rows": rows}, "\n".join(md) + "\n")
    print("\n".join(md))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
