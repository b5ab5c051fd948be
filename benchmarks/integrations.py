"""docs/integrations.md's LangChain and LlamaIndex snippets, run as they stand, against encode_query (#44).

    python benchmarks/integrations.py                   # builds runs/integrations-venv once (package index)
    python benchmarks/integrations.py --python PY       # an interpreter that already has both packages

Saves the packaged all-MiniLM-L6-v2 with a query prompt, as a trained model keeps it (the MS MARCO instruction of
the paper's Table 7 in neoembed's template), to WORK/runs/my-model. Then, in a separate interpreter holding
``langchain-huggingface`` and ``llama-index-embeddings-huggingface`` (they are not test dependencies:
langchain-huggingface needs huggingface-hub<2), runs every ``python`` block of the page's LangChain and LlamaIndex
sections from WORK. Their ``query_vector`` / ``passage_vectors`` are compared with sentence-transformers'
``encode_query`` / ``encode_document`` on the same folder, beside each framework's default call (no prompt
arguments). Record: benchmarks/results/integrations_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, header, write_results  # noqa: E402

PAGE = REPO / "docs" / "integrations.md"
PACKAGES = ["sentence-transformers", "langchain-huggingface", "llama-index-embeddings-huggingface"]
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

# Runs in the integrations interpreter, from WORK: the page's blocks, then the reference and the default calls.
CHILD = r"""
import json, sys
from importlib.metadata import version
import numpy as np
from sentence_transformers import SentenceTransformer

blocks = json.loads(sys.argv[1])
model = SentenceTransformer("runs/my-model")

def unit(x):
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)

def compare(got, want):
    got, want = unit(got), unit(want)
    return {"max_abs_diff": float(np.abs(got - want).max()), "min_cosine": float((got * want).sum(-1).min())}

rows = {}
for name, code in blocks.items():
    ns = {}
    exec(compile(code, f"docs/integrations.md ({name})", "exec"), ns)
    q, p = ns["question"], ns["passages"]
    rows[f"{name}, as on the page"] = {
        "query": compare(ns["query_vector"], model.encode_query(q)),
        "passages": compare(ns["passage_vectors"], model.encode_document(p)),
    }
    if name == "LangChain":
        from langchain_huggingface import HuggingFaceEmbeddings
        plain = HuggingFaceEmbeddings(model_name="runs/my-model")
        rows["LangChain, default call"] = {"query": compare(plain.embed_query(q), model.encode_query(q)),
                                           "passages": compare(plain.embed_documents(p), model.encode_document(p))}
    if name == "LlamaIndex":
        from llama_index.embeddings.huggingface import HuggingFaceEmbedding
        plain = HuggingFaceEmbedding(model_name="runs/my-model")
        rows["LlamaIndex, default call"] = {
            "query": compare(plain.get_query_embedding(q), model.encode_query(q)),
            "passages": compare(plain.get_text_embedding_batch(p), model.encode_document(p)),
        }
pkgs = ["sentence-transformers", "transformers", "huggingface-hub", "langchain-huggingface", "langchain-core",
        "llama-index-embeddings-huggingface", "llama-index-core", "torch"]
print("RESULT " + json.dumps({"rows": rows, "packages": {k: version(k) for k in pkgs},
                              "saved_query_prompt": model.prompts.get("query")}))
"""


def page_blocks() -> dict[str, str]:
    """The ``python`` blocks of the page, by the ``## `` section they sit in (LangChain, LlamaIndex)."""
    blocks: dict[str, str] = {}
    for section in re.split(r"^## ", PAGE.read_text(encoding="utf8"), flags=re.M)[1:]:
        title = section.splitlines()[0].strip()
        code = re.findall(r"```python\n(.*?)```", section, flags=re.S)
        if code and title in ("LangChain", "LlamaIndex"):
            blocks[title] = "\n".join(code)
    if set(blocks) != {"LangChain", "LlamaIndex"}:
        raise SystemExit(f"{PAGE.name}: expected python blocks under '## LangChain' and '## LlamaIndex'")
    return blocks


def integrations_python(venv: Path) -> Path:
    """An interpreter with the packages: ``venv``'s, created and filled on first use (same torch as this one)."""
    import torch

    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        torch_pin = f"torch=={torch.__version__.split('+')[0]}"
        subprocess.run([str(python), "-m", "pip", "install", "-q", torch_pin], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PACKAGES], check=True)
    return python


def save_model(work: Path) -> None:
    from sentence_transformers import SentenceTransformer

    from neoembed.instructions import DEFAULT_TEMPLATE
    from neoembed.sentence import build_prompts, resolve_packaged

    model = SentenceTransformer(resolve_packaged("packaged:all-MiniLM-L6-v2"), device="cpu")
    model.prompts = build_prompts(INSTRUCTION, None, DEFAULT_TEMPLATE)
    model.save(str(work / "runs" / "my-model"))


def markdown(result: dict) -> str:
    lines = [
        "# LangChain and LlamaIndex snippets against encode_query (CPU)\n",
        f"Model: the packaged all-MiniLM-L6-v2 saved with the query prompt {result['saved_query_prompt']!r}. "
        "Each row: the largest |difference| of the L2-normalised vectors and the smallest cosine, against "
        "sentence-transformers' `encode_query` (question) / `encode_document` (passages) on the same folder.\n",
        "| how it was loaded | query max abs diff | query cosine | passages max abs diff | passages cosine |",
        "|---|---|---|---|---|",
    ]
    for name, r in result["rows"].items():
        q, p = r["query"], r["passages"]
        lines.append(
            f"| {name} | {q['max_abs_diff']:.2e} | {q['min_cosine']:.4f} | {p['max_abs_diff']:.2e} "
            f"| {p['min_cosine']:.4f} |"
        )
    lines += ["", "Packages of the integrations interpreter:", ""]
    lines += [f"- {k} {v}" for k, v in result["packages"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", type=Path, help="an interpreter with both packages (default: build a venv)")
    ap.add_argument("--venv", type=Path, default=REPO / "runs" / "integrations-venv")
    args = ap.parse_args()
    python = args.python or integrations_python(args.venv)
    blocks = page_blocks()
    with tempfile.TemporaryDirectory(prefix="neoembed-integrations-") as tmp:
        save_model(Path(tmp))
        out = subprocess.run(
            [str(python), "-c", CHILD, json.dumps(blocks)], cwd=tmp, capture_output=True, text=True
        )
    if out.returncode != 0:
        sys.exit(f"the integrations interpreter failed:\n{out.stderr[-4000:]}")
    result = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[7:])
    head = header()
    if args.python:  # the interpreter's location is this machine's, not the method
        head["command"] = head["command"].replace(str(args.python), "PY")
    write_results("integrations_cpu", {"header": head, **result}, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
