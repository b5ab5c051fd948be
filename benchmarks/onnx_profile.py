"""Where the time of NeoBERT's ONNX graphs goes, fp32 against dynamic int8: ONNX Runtime's own profiler, per op type.

    python benchmarks/onnx_profile.py          # full-size NeoBERT (random weights), batch 32 real sentences
    python benchmarks/onnx_profile.py --model packaged:all-MiniLM-L6-v2
    python benchmarks/onnx_profile.py --packed  # the packed graphs, fed the rows serving feeds them

It answers what bounds the int8 speed-up: only the matrix products become int8 (MatMulInteger, with a dynamic
quantization of each activation before it); everything else (attention's softmax, RMSNorm, RoPE, SwiGLU's
elementwise work, the quantization itself) runs as in fp32. With ``M`` the fp32 graph's time in matrix products,
``T`` its total and ``r`` this CPU's int8/fp32 GEMM rate ratio (measured in the same run), the speed-up the GEMM
rates allow is ``T / (T - M + M / r)`` (Amdahl); the record sets the measured speed-up beside it, and each graph's
time beside ``encode``'s on the same batch (what serving spends outside the graph).
Results: benchmarks/results/onnx_profile_cpu[_<model>][_packed][_<isa>].{json,md} (no ``_<isa>`` on AVX-512 VNNI).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from _common import header, write_results
from encode import mteb_sentences
from serving import cpu_facts, full_neobert, matmul_rates

from neoembed.export.onnx import export, isa_suffix

# the op types that multiply matrices, fp32 and int8 (ONNX Runtime's fused forms included)
MATMUL_OPS = {
    "MatMul",
    "Gemm",
    "FusedMatMul",
    "MatMulInteger",
    "MatMulIntegerToFloat",
    "DynamicQuantizeMatMul",
}


def _session(path: Path, profile: str | None):
    import onnxruntime as ort

    from neoembed.export.runtime import session_options

    options = session_options()
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = profile
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _inputs(session, tokenizer, texts: list[str], max_length: int) -> dict:
    from neoembed.export.runtime import PACKED_INPUTS, pack_rows

    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="np")
    if {i.name for i in session.get_inputs()} == set(PACKED_INPUTS):  # a packed graph: the rows serving feeds
        return pack_rows(enc["input_ids"], enc["attention_mask"])[0]
    return {i.name: enc[i.name].astype(np.int64) for i in session.get_inputs() if i.name in enc}


def _profile(path: Path, feed_texts, tokenizer, max_length: int, reps: int, work: Path) -> dict:
    """Wall time per run (no profiler) and the profiler's time per op type (over ``reps`` runs after a warm-up)."""
    plain = _session(path, None)
    feed = _inputs(plain, tokenizer, feed_texts, max_length)
    plain.run(None, feed)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        plain.run(None, feed)
        times.append(time.perf_counter() - t0)
    profiled = _session(path, str(work / path.stem))
    profiled.run(None, feed)
    for _ in range(reps):
        profiled.run(None, feed)
    events = json.loads(Path(profiled.end_profiling()).read_text())
    per_op: dict[str, float] = defaultdict(float)
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    first_end = runs[0]["ts"] + runs[0]["dur"] if runs else 0
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first_end:
            per_op[e["args"]["op_name"]] += e["dur"] / 1e6 / reps
    return {"wall_s": float(np.median(times)), "ops_s": dict(sorted(per_op.items(), key=lambda kv: -kv[1]))}


def _encode_s(folder: Path, graph: Path, texts: list[str], max_length: int, reps: int) -> float:
    """Median seconds of ``encode`` on the same batch through neoembed's ONNX module (tokenizing, the graph,
    pooling and normalization): set beside the graph's own time, what serving spends outside the graph."""
    import neoembed

    model = neoembed.load(folder, backend="onnx", file_name=graph.name)
    model.max_seq_length = min(model.max_seq_length, max_length)
    model.encode(texts, batch_size=len(texts))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.encode(texts, batch_size=len(texts))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--model", help="a model neoembed.load opens (default: full-size NeoBERT, random weights)"
    )
    parser.add_argument("--packed", action="store_true", help="the packed graphs (model_packed*.onnx)")
    args = parser.parse_args()
    head, facts, rates = header(), cpu_facts(), matmul_rates()
    from transformers import AutoTokenizer

    sentences = mteb_sentences()
    rng = np.random.default_rng(0)
    texts = [sentences[i] for i in rng.choice(len(sentences), args.batch, replace=False)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = args.model or full_neobert(work / "neobert-random")
        if str(model).startswith("packaged:"):
            from neoembed.sentence import resolve_packaged

            model = resolve_packaged(str(model))
        export(str(model), work / "export", quantize="int8")
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        stem = "model_packed" if args.packed else "model"
        graphs = {
            "fp32": work / f"export/onnx/{stem}.onnx",
            "int8": work / f"export/onnx/{stem}_qint8_{isa_suffix()}.onnx",
        }
        prof = {k: _profile(p, texts, tokenizer, args.max_length, args.reps, work) for k, p in graphs.items()}
        for k, p in graphs.items():
            prof[k]["encode_s"] = _encode_s(work / "export", p, texts, args.max_length, args.reps)
    r = rates["int8_over_fp32"]
    total = sum(prof["fp32"]["ops_s"].values())
    mm = sum(v for k, v in prof["fp32"]["ops_s"].items() if k in MATMUL_OPS)
    allowed = total / (total - mm + mm / r)
    measured = prof["fp32"]["wall_s"] / prof["int8"]["wall_s"]
    summary = {"gemm_ratio": r, "fp32_matmul_share": mm / total, "allowed": allowed, "measured": measured,
               "fraction_of_allowed": (measured - 1) / (allowed - 1) if allowed > 1 else None}  # fmt: skip
    md = [
        f"uptime at start: `{facts['uptime']}`  ",
        f"CPU flags: {facts['flags']}  ",
        f"Batch {args.batch} real MTEB sentences, "
        + ("packed into rows of the batch's longest" if args.packed else "padded to the batch's longest")
        + f"; median of {args.reps} runs.",
        "",
        f"- ONNX Runtime GEMM (1024^3): fp32 {rates['fp32']:.1f}, int8 {rates['int8']:.1f} GOP/s: r = {r:.2f}",
        f"- model: {args.model or 'full-size NeoBERT (random weights)'}",
        f"- fp32 graph: {1000 * prof['fp32']['wall_s']:.1f} ms per batch, matrix products "
        f"{100 * mm / total:.1f}% of its kernel time; encode through neoembed's ONNX module "
        f"{1000 * prof['fp32']['encode_s']:.1f} ms",
        f"- int8 graph: {1000 * prof['int8']['wall_s']:.1f} ms per batch; encode "
        f"{1000 * prof['int8']['encode_s']:.1f} ms",
        f"- speed-up allowed by the GEMM rates (Amdahl): {allowed:.2f}x; measured {measured:.2f}x "
        f"({100 * summary['fraction_of_allowed']:.0f}% of the allowed gain, (measured - 1) / (allowed - 1))",
        "",
        "| op type | fp32 ms | fp32 share | int8 ms | int8 share |",
        "|---|---|---|---|---|",
    ]
    ops = sorted(set(prof["fp32"]["ops_s"]) | set(prof["int8"]["ops_s"]),
                 key=lambda k: -(prof["fp32"]["ops_s"].get(k, 0) + prof["int8"]["ops_s"].get(k, 0)))  # fmt: skip
    t8 = sum(prof["int8"]["ops_s"].values())
    for op in ops[:15]:
        a, b = prof["fp32"]["ops_s"].get(op, 0.0), prof["int8"]["ops_s"].get(op, 0.0)
        md.append(
            f"| {op} | {1000 * a:.1f} | {100 * a / total:.1f}% | {1000 * b:.1f} | {100 * b / t8:.1f}% |"
        )
    payload = {"header": head, "cpu": facts, "matmul_gops": rates, "args": vars(args), "summary": summary,
               "profile": prof}  # fmt: skip
    stem = (
        "onnx_profile_cpu"
        if args.model is None
        else f"onnx_profile_cpu_{Path(args.model.split(':')[-1]).name}"
    )
    stem += "_packed" if args.packed else ""
    stem += "" if isa_suffix() == "avx512_vnni" else f"_{isa_suffix()}"  # one record per instruction set
    write_results(stem, payload, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
