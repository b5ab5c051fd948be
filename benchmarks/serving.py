"""CPU serving speed: neoembed torch (padding-free), neoembed ONNX fp32 / int8, sentence-transformers' backends.

    python benchmarks/serving.py            # one run, ~10 minutes on 2 shared cores

Forms: neoembed's torch model (NeoBERT padding-free) in fp32 and with dynamic int8 linear layers
(``neoembed.load(path, quantize="int8")``), its ONNX graphs padded (``model.onnx``, as
sentence-transformers' backend runs them) and packed (``model_packed.onnx``: a batch's real tokens in rows of
several sequences), each fp32 and dynamic int8. Texts: real MTEB sentences (../shared/data/mteb/*) and long documents made of them (truncated at
``--long-max`` tokens), texts/s and ms per text at batch 1 and 32 through ``encode``. Models: all-MiniLM-L6-v2
(packaged) and a full-size NeoBERT with random weights (speed does not depend on the weights), each exported
with ``neoembed export`` (fp32 and dynamic int8). The same run measures this CPU's fp32 and int8 matrix-multiply
rates in ONNX Runtime (MatMul vs MatMulInteger, the op dynamic int8 graphs run) and records the CPU flags
(avx512_vnni / avx512_bf16 / avx2) and ``uptime`` (the machine is shared).

sentence-transformers' ONNX backends go through Optimum (``optimum-onnx``), which requires transformers<4.58:
where it does not import, those rows say why instead of a number. ``--st-python PY`` times them in the same run
with another environment's Python, one where Optimum imports (its ONNX export and ``export_dynamic_quantized_onnx_model``).
Results: benchmarks/results/serving_cpu.{json,md} on a CPU with AVX-512 VNNI, serving_cpu_<isa>.{json,md} elsewhere
(``avx2``: int8's matrix products have no VNNI there, and the weights keep 7 bits).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _common import header, write_results
from encode import TOKENIZER, long_documents, mteb_sentences

import neoembed
from neoembed.export.onnx import export, isa_suffix
from neoembed.modeling import NeoBERTConfig, NeoBERTModel
from neoembed.sentence import resolve_packaged


def cpu_facts() -> dict:
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {
        "flags": {f: f in flags for f in ("avx512_vnni", "avx512_bf16", "avx2", "amx_int8")},
        "uptime": uptime,
    }


def matmul_graph(m: int, k: int, n: int, integer: bool) -> bytes:
    """A one-node ONNX graph multiplying an (m x k) input by a stored (k x n) weight: fp32 ``MatMul``, or
    ``MatMulInteger`` on uint8 x int8 (the op dynamic int8 graphs run)."""
    import onnx
    from onnx import TensorProto, helper

    a_type, out_type = (TensorProto.UINT8, TensorProto.INT32) if integer else (TensorProto.FLOAT,) * 2
    rng = np.random.default_rng(0)
    weight = (
        rng.integers(-64, 63, (k, n), dtype=np.int8) if integer else rng.standard_normal((k, n), np.float32)
    )
    node = helper.make_node("MatMulInteger" if integer else "MatMul", ["a", "b"], ["c"])
    graph = helper.make_graph(
        [node],
        "mm",
        [helper.make_tensor_value_info("a", a_type, [m, k])],
        [helper.make_tensor_value_info("c", out_type, [m, n])],
        [onnx.numpy_helper.from_array(weight, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def matmul_rates(n: int = 1024, reps: int = 10) -> dict:
    """GOP/s of an n x n x n product in ONNX Runtime: fp32 MatMul vs uint8 x int8 MatMulInteger."""
    import onnxruntime as ort

    from neoembed.export.runtime import session_options

    out = {}
    for integer in (False, True):
        session = ort.InferenceSession(
            matmul_graph(n, n, n, integer), session_options(), providers=["CPUExecutionProvider"]
        )
        a = (
            np.random.default_rng(1).integers(0, 255, (n, n), dtype=np.uint8)
            if integer
            else np.ones((n, n), np.float32)
        )
        session.run(None, {"a": a})
        t0 = time.perf_counter()
        for _ in range(reps):
            session.run(None, {"a": a})
        out["int8" if integer else "fp32"] = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9
    out["int8_over_fp32"] = out["int8"] / out["fp32"]
    return out


#: timed passes per set (median): set from --repeats / --long-repeats
REPEATS = {"sentences": 3, "long docs": 2}


def time_encode(model, texts: list[str], batch_size: int, repeats: int) -> dict:
    """The median of ``repeats`` timed passes over ``texts`` (the machine is shared: single passes scattered by
    15% between identical forms), after a warm-up."""
    model.encode(texts[: max(batch_size, 2)], batch_size=batch_size)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.encode(texts, batch_size=batch_size)
        times.append(time.perf_counter() - t0)
    dt = sorted(times)[len(times) // 2]
    return {
        "texts_per_s": len(texts) / dt,
        "ms_per_text": 1000 * dt / len(texts),
        "n": len(texts),
        "repeats": repeats,
    }


def full_neobert(folder: Path) -> Path:
    torch.manual_seed(0)
    NeoBERTModel(NeoBERTConfig()).save_pretrained(folder)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(TOKENIZER)).save_pretrained(folder)
    return folder


ST_ONNX = r"""
import json, shutil, sys, time
from pathlib import Path
from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model
cfg = json.loads(open(sys.argv[1]).read())
folder = cfg["work"]
shutil.copytree(cfg["model"], folder)  # sentence-transformers writes its graphs beside the model

def timed(model, texts, bs, repeats):
    model.encode(texts[: max(bs, 2)], batch_size=bs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.encode(texts, batch_size=bs)
        times.append(time.perf_counter() - t0)
    dt = sorted(times)[len(times) // 2]
    return {"texts_per_s": len(texts) / dt, "ms_per_text": 1000 * dt / len(texts), "n": len(texts), "repeats": repeats}

fp32 = SentenceTransformer(folder, backend="onnx")
export_dynamic_quantized_onnx_model(fp32, cfg["isa"], folder)
# its file name follows the weight type of the CPU's config: model_qint8_avx512_vnni.onnx, model_quint8_avx2.onnx
written = sorted(Path(folder, "onnx").glob(f"model_*int8_{cfg['isa']}.onnx"))
int8 = SentenceTransformer(folder, backend="onnx", model_kwargs={"file_name": f"onnx/{written[0].name}"})
out = {}
for name, model in (("st onnx", fp32), (f"st onnx int8 ({written[0].name})", int8)):
    model.max_seq_length = min(model.max_seq_length, cfg["max_len"])
    out[name] = {f"{label} b{bs}": timed(model, texts, bs, r) for label, texts, bs, r in cfg["sets"]}
print(json.dumps(out))
"""


def st_onnx_elsewhere(python: str, path: str, sets: dict, sets_b1: dict, max_len: int, work: Path) -> dict:
    """sentence-transformers' ONNX backend and its dynamic int8 export, timed by ``python``: an environment where
    Optimum imports (it needs transformers < 4.58, neoembed's environment has 5), on the same texts and batches."""
    import json
    import sys

    cfg = {
        "model": path,
        "isa": isa_suffix(),
        "max_len": max_len,
        "sets": [["sentences", sets["sentences"][0], 32, REPEATS["sentences"]]]
        + [[label, texts, bs, REPEATS[label]] for label, (texts, sizes) in sets_b1.items() for bs in sizes],
    }
    config = work / "st-onnx.json"
    config.write_text(json.dumps({**cfg, "work": str(work / "st-onnx-model")}))
    r = subprocess.run([python, "-c", ST_ONNX, str(config)], capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stderr[-2000:], file=sys.stderr)
        return {"st onnx": {"error": r.stderr.strip().splitlines()[-1][:300]}}
    return json.loads(r.stdout.strip().splitlines()[-1])


def st_onnx_forms(path: str) -> dict:
    """sentence-transformers' own ONNX backend (fp32; int8 by its export_dynamic_quantized_onnx_model)."""
    from sentence_transformers import SentenceTransformer

    try:
        model = SentenceTransformer(path, backend="onnx")
    except Exception as e:  # Optimum missing or not importable under this transformers
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"model": model}


def forms_for(name: str, path: str, work: Path, max_len: int) -> dict:
    out = work / name
    export(path, out, quantize="int8")
    int8 = f"model_qint8_{isa_suffix()}.onnx"
    torch_form = "neoembed torch (padding-free)" if name == "neobert" else "neoembed torch"
    forms = {
        torch_form: neoembed.load(path),
        torch_form.replace("torch", "torch int8"): neoembed.load(path, quantize="int8"),
        "neoembed onnx fp32": neoembed.load(out, backend="onnx"),
        "neoembed onnx int8": neoembed.load(out, backend="onnx", file_name=int8),
        "neoembed onnx fp32 packed": neoembed.load(out, backend="onnx", file_name="model_packed.onnx"),
        "neoembed onnx int8 packed": neoembed.load(
            out, backend="onnx", file_name=f"model_packed_qint8_{isa_suffix()}.onnx"
        ),
    }
    if name == "minilm":
        from sentence_transformers import SentenceTransformer

        forms["st torch"] = SentenceTransformer(path)
        st = st_onnx_forms(path)
        forms["st onnx"] = st.get("model") or st["error"]
    for model in forms.values():
        if not isinstance(model, str):
            model.max_seq_length = min(model.max_seq_length, max_len)
    return forms


def measure(forms: dict, sets: dict) -> dict:
    rows = {}
    for form, model in forms.items():
        if isinstance(model, str):
            rows[form] = {"error": model}
            continue
        rows[form] = {}
        for set_name, (texts, batch_sizes) in sets.items():
            for bs in batch_sizes:
                rows[form][f"{set_name} b{bs}"] = time_encode(model, texts, bs, REPEATS[set_name])
                print(form, set_name, bs, rows[form][f"{set_name} b{bs}"], flush=True)
    return rows


def table(model: str, rows: dict) -> list[str]:
    cols = sorted({c for r in rows.values() for c in r if c != "error"})
    lines = [f"### {model}", "", "| form | " + " | ".join(f"{c} texts/s (ms/text)" for c in cols) + " |"]
    lines.append("|---" * (len(cols) + 1) + "|")
    for form, r in rows.items():
        if "error" in r:
            lines.append(f"| {form} | not runnable: {r['error'][:160]} |")
            continue
        cells = [f"{r[c]['texts_per_s']:.1f} ({r[c]['ms_per_text']:.1f})" for c in cols]
        lines.append(f"| {form} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sentences", type=int, default=128)
    parser.add_argument("--batch1", type=int, default=32)
    parser.add_argument("--long", type=int, default=4)
    parser.add_argument("--long-max", type=int, default=1024)
    parser.add_argument(
        "--st-python",
        help="a Python whose environment runs sentence-transformers' ONNX backend (Optimum: transformers < 4.58); "
        "its ONNX and ONNX-int8 rows are timed there, in this run",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over the sentences (median)")
    parser.add_argument("--long-repeats", type=int, default=2, help="timed passes over the long documents")
    args = parser.parse_args()
    REPEATS.update({"sentences": args.repeats, "long docs": args.long_repeats})
    torch.set_num_threads(torch.get_num_threads())
    head, facts = header(), cpu_facts()
    rates = matmul_rates()
    sentences = mteb_sentences()
    rng = np.random.default_rng(0)
    picked = [sentences[i] for i in rng.choice(len(sentences), args.sentences, replace=False)]
    docs = long_documents(sentences, args.long)
    sets = {"sentences": (picked, (1, 32)), "long docs": (docs, (1,))}
    sets_b1 = {"sentences": (picked[: args.batch1], (1,)), "long docs": (docs, (1,))}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        minilm = resolve_packaged("packaged:all-MiniLM-L6-v2")
        results["all-MiniLM-L6-v2"] = measure_split(
            forms_for("minilm", minilm, work, args.long_max), sets, sets_b1
        )
        if args.st_python:
            st_rows = st_onnx_elsewhere(args.st_python, minilm, sets, sets_b1, args.long_max, work)
            results["all-MiniLM-L6-v2"].pop("st onnx", None)
            results["all-MiniLM-L6-v2"].update(st_rows)
        neobert = str(full_neobert(work / "neobert-random"))
        results["NeoBERT full size (random)"] = measure_split(
            forms_for("neobert", neobert, work, args.long_max), sets, sets_b1
        )
    payload = {"header": head, "cpu": facts, "matmul_gops": rates, "args": vars(args), "results": results}
    md = [
        f"uptime at start: `{facts['uptime']}`  ",
        f"CPU flags: {facts['flags']}  ",
        f"ONNX Runtime matmul (1024^3): fp32 {rates['fp32']:.1f} GOP/s, int8 {rates['int8']:.1f} GOP/s "
        f"(int8/fp32 {rates['int8_over_fp32']:.2f}x)",
        "",
    ]
    for model, rows in results.items():
        md += table(model, rows)
    md += speedups(results)
    # one record per instruction set: int8's speed-up is the CPU's (VNNI or not), so each keeps its own
    stem = "serving_cpu" if isa_suffix() == "avx512_vnni" else f"serving_cpu_{isa_suffix()}"
    write_results(stem, payload, "\n".join(md))


def _fastest(rows: dict, prefix: str, column: str) -> tuple[str, float] | None:
    timed = {f: r[column]["texts_per_s"] for f, r in rows.items() if f.startswith(prefix) and column in r}
    return max(timed.items(), key=lambda kv: kv[1]) if timed else None


def speedups(results: dict) -> list[str]:
    """The issue's two ratios per column: neoembed's fastest form over sentence-transformers' fastest backend
    (all-MiniLM-L6-v2), and NeoBERT's fastest int8 form (ONNX or torch) over its padding-free torch model."""
    lines = ["### Ratios (same run)", ""]
    minilm, neobert = results.get("all-MiniLM-L6-v2", {}), results.get("NeoBERT full size (random)", {})
    for column in sorted({c for r in minilm.values() for c in r if c != "error"}):
        ours, theirs = _fastest(minilm, "neoembed", column), _fastest(minilm, "st ", column)
        if ours and theirs:
            lines.append(
                f"- all-MiniLM-L6-v2, {column}: {ours[0]} {ours[1]:.1f} / {theirs[0]} {theirs[1]:.1f} texts/s = "
                f"**{ours[1] / theirs[1]:.2f}x**"
            )
    base = neobert.get("neoembed torch (padding-free)", {})
    int8 = {f: r for f, r in neobert.items() if "int8" in f}
    for column in sorted(c for c in base if c != "error"):
        best = _fastest(int8, "neoembed", column)
        if best:
            ratio = best[1] / base[column]["texts_per_s"]
            lines.append(f"- NeoBERT, {column}: {best[0]} / neoembed torch (padding-free) = **{ratio:.2f}x**")
    return [*lines, ""]


def measure_split(forms: dict, sets: dict, sets_b1: dict) -> dict:
    """batch 32 on all picked sentences, batch 1 on the first ``--batch1`` of them (and the long documents)."""
    rows = measure(forms, {"sentences": (sets["sentences"][0], (32,))})
    for form, extra in measure(forms, sets_b1).items():
        rows[form] = {**rows[form], **extra} if "error" not in extra else extra
    return rows


if __name__ == "__main__":
    main()
