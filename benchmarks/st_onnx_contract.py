"""The contract of ``neoembed export``: plain sentence-transformers loads the folder with its own ONNX backend
(``SentenceTransformer(path, backend="onnx", model_kwargs={"file_name": ...})``) in an environment where neoembed is
not installed, and its embeddings equal the torch model's.

    python benchmarks/st_onnx_contract.py --st-python /path/to/other-env/bin/python

sentence-transformers' ONNX backend goes through Optimum (``optimum-onnx``), whose release requires
transformers < 4.58, while neoembed requires transformers 5: it cannot run in neoembed's own environment, so the
loading side runs in another one (``pip install torch 'sentence-transformers[onnx]' 'transformers<4.58'``).
Models: the packaged all-MiniLM-L6-v2 and the tiny NeoBERT fixture, each exported with ``--quantize int8``; real
MTEB sentences of mixed lengths in one batch. Results: results/st_onnx_contract_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from _common import SHARED, header, write_results
from encode import mteb_sentences

import neoembed
from neoembed.export.onnx import export, isa_suffix
from neoembed.sentence import resolve_packaged

LOAD = r"""
import json, sys
import importlib.util
assert importlib.util.find_spec("neoembed") is None, "neoembed is importable here"
from sentence_transformers import SentenceTransformer
cfg = json.loads(open(sys.argv[1]).read())
out = {}
for name in cfg["files"]:
    try:
        kwargs = {"trust_remote_code": True} if cfg["remote"] else {}
        model = SentenceTransformer(cfg["path"], backend="onnx", model_kwargs={"file_name": name}, **kwargs)
        out[name] = model.encode(cfg["texts"], batch_size=len(cfg["texts"])).tolist()
    except Exception as e:
        out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
print(json.dumps(out))
"""


def _check(python: str, name: str, model_path: str, work: Path, texts: list[str]) -> list[dict]:
    out = work / name
    export(model_path, out, quantize="int8")
    expected = neoembed.load(model_path).encode(texts, batch_size=len(texts))
    files = ["onnx/model.onnx", f"onnx/model_qint8_{isa_suffix()}.onnx"]
    cfg = {"path": str(out), "files": files, "texts": texts, "remote": name == "neobert"}
    (work / f"{name}.json").write_text(json.dumps(cfg))
    r = subprocess.run([python, "-c", LOAD, str(work / f"{name}.json")], capture_output=True, text=True)
    if r.returncode != 0:
        return [{"model": name, "file": f, "error": r.stderr.strip().splitlines()[-1][:300]} for f in files]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    rows = []
    for f in files:
        if isinstance(got[f], str):
            rows.append({"model": name, "file": f, "error": got[f]})
            continue
        e = np.asarray(got[f])
        cos = (e * expected).sum(1) / np.linalg.norm(e, axis=1) / np.linalg.norm(expected, axis=1)
        rows.append(
            {
                "model": name,
                "file": f,
                "max_abs": float(np.abs(e - expected).max()),
                "min_cos": float(cos.min()),
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--st-python", required=True, help="a Python where sentence-transformers' ONNX backend imports"
    )
    args = p.parse_args()
    rng = np.random.default_rng(0)
    sentences = mteb_sentences()
    texts = [sentences[i] for i in rng.choice(len(sentences), 24, replace=False)]
    version = subprocess.run(
        [args.st_python, "-c", "import sentence_transformers as s, transformers as t, optimum.onnxruntime as o; "
         "print(s.__version__, t.__version__)"], capture_output=True, text=True
    ).stdout.strip()  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows += _check(
            args.st_python, "all-MiniLM-L6-v2", resolve_packaged("packaged:all-MiniLM-L6-v2"), work, texts
        )
        rows += _check(
            args.st_python, "neobert", str(SHARED / "fixtures" / "neobert-tiny-official"), work, texts
        )
    md = [f"Loading side: sentence-transformers {version.replace(' ', ', transformers ')}, neoembed not installed; "
          f"{len(texts)} real MTEB sentences in one batch, against neoembed's torch model.", "",
          "| model | graph | max abs diff | min cosine |", "|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            md.append(f"| {r['model']} | {r['file']} | not loaded: {r['error'][:200]} | |")
        else:
            md.append(f"| {r['model']} | {r['file']} | {r['max_abs']:.2e} | {r['min_cos']:.6f} |")
    write_results(
        "st_onnx_contract_cpu", {"header": header(), "st_env": version, "rows": rows}, "\n".join(md) + "\n"
    )
    print("\n".join(md))
    sys.exit(0 if all("error" not in r for r in rows) else 1)


if __name__ == "__main__":
    main()
