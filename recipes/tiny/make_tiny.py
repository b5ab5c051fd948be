"""Rebuild the assets of the tiny recipes (``tiny.yaml``, ``cde-tiny.yaml``, ``pretrain-tiny.yaml``): three small
sets of text pairs drawn from the Python standard library's docstrings (PSF licence, see ``LICENSE-PSF.txt``), a
WordPiece tokenizer trained on those rows, a randomly initialised 2-layer x 32-wide NeoBERT, and pre-training shards
of one set's paragraphs.

They ship inside the package so that the tiny recipes run from an installed wheel, with nothing else on disk. The
rows depend on the Python version whose docstrings are read (the shipped ones: CPython 3.11), so rebuilding with
another Python changes them; run from the repository root::

    python recipes/tiny/make_tiny.py
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULES = [
    "base64", "bisect", "calendar", "colorsys", "copy", "csv", "datetime", "difflib", "filecmp", "fnmatch",
    "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "html", "inspect", "ipaddress", "itertools",
    "json", "keyword", "linecache", "locale", "math", "mimetypes", "operator", "os", "os.path", "pathlib",
    "pickle", "platform", "pprint", "quopri", "random", "re", "secrets", "shlex", "shutil", "statistics", "string",
    "struct", "tarfile", "tempfile", "textwrap", "time", "tokenize", "unicodedata", "urllib.parse", "uuid",
    "warnings", "zipfile", "zlib",
]  # fmt: skip
CARD_ROWS = 200  # rows per card at most: a few hundred in all
TOKENIZER_SIZE = 1500
MODEL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}


def _paragraphs(doc: str) -> list[str]:
    return [" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n") if p.strip()]


def documented_functions() -> list[dict]:
    """Public functions and classes defined in MODULES with a one-sentence summary: name, summary, the next
    paragraph (may be empty) and signature (may be empty), in a fixed order."""
    out = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not callable(obj) or not obj.__doc__:
                continue
            if getattr(obj, "__module__", None) not in (module_name, module.__name__, None):
                continue  # re-exported from elsewhere: its own module lists it
            paragraphs = _paragraphs(obj.__doc__)
            summary = paragraphs[0] if paragraphs else ""
            if not (4 <= len(summary.split()) <= 40) or "(" in summary.split()[0]:
                continue  # C functions start their docstring with the signature: keep prose only
            try:
                signature = f"{name}{inspect.signature(obj)}"
            except (TypeError, ValueError):
                signature = ""
            details = paragraphs[1] if len(paragraphs) > 1 and len(paragraphs[1].split()) >= 6 else ""
            out.append({"module": module_name, "name": f"{module_name}.{name}", "summary": summary,
                        "details": details, "signature": signature})  # fmt: skip
    return out


def _spread(rows: list[dict], n: int) -> list[dict]:
    """At most n rows, taken evenly across the list (so every module contributes)."""
    if len(rows) <= n:
        return rows
    return [rows[i * len(rows) // n] for i in range(n)]


def card_rows(functions: list[dict]) -> dict[str, list[dict]]:
    names = [{"query": f["name"], "positive": f["summary"]} for f in functions]
    details = [{"query": f["summary"], "positive": f["details"]} for f in functions if f["details"]]
    signatures = []
    with_signature = [f for f in functions if f["signature"]]
    for i, f in enumerate(with_signature):
        # the hard negative: another function of the same module (the next one that has a signature)
        others = [g for g in with_signature[i + 1 :] + with_signature[:i] if g["module"] == f["module"]]
        if others:
            signatures.append(
                {"query": f["summary"], "positive": f["signature"], "negative": others[0]["signature"]}
            )
    return {
        "pydoc_names": _spread(names, CARD_ROWS),
        "pydoc_details": _spread(details, CARD_ROWS),
        "pydoc_signatures": _spread(signatures, CARD_ROWS),
    }


def write_rows(cards: dict[str, list[dict]]) -> None:
    (HERE / "rows").mkdir(exist_ok=True)
    for name, rows in cards.items():
        with open(HERE / "rows" / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{name}: {len(rows)} rows")


def write_model(cards: dict[str, list[dict]]) -> None:
    """A WordPiece tokenizer trained on every text of the rows, and a random NeoBERT sized to its vocabulary."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    from neoembed.modeling import NeoBERTConfig
    from neoembed.modeling.modeling_neobert import NeoBERTModel

    texts = [v for rows in cards.values() for row in rows for v in row.values()]
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(
        texts, trainers.WordPieceTrainer(vocab_size=TOKENIZER_SIZE, special_tokens=specials)
    )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tokenizer = BertTokenizerFast(tokenizer_object=tok, model_max_length=512)
    out = HERE / "model"
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(0)
    config = NeoBERTConfig(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, max_length=512, **MODEL
    )
    NeoBERTModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    for code in out.glob("*.py"):
        code.unlink()  # neoembed loads NeoBERT natively; copies of its source here would only drift from it
    print(f"model: vocabulary {len(tokenizer)}, {sum(p.stat().st_size for p in out.iterdir())} bytes")


def write_shards() -> None:
    """Pre-training shards of the ``pydoc_details`` docstring paragraphs, tokenized with the tiny tokenizer (what
    ``neoembed preprocess rows/pydoc_details.jsonl shards --tokenizer model --column positive`` writes here)."""
    from transformers import AutoTokenizer

    from neoembed.pretrain.data import preprocess

    shutil.rmtree(HERE / "shards", ignore_errors=True)
    cwd = Path.cwd()
    os.chdir(HERE)  # the shards' meta.json records its inputs as given: paths relative to this folder
    try:
        stats = preprocess(
            "rows/pydoc_details.jsonl", "shards", AutoTokenizer.from_pretrained("model"), column="positive",
            progress=False,
        )  # fmt: skip
    finally:
        os.chdir(cwd)
    print(f"shards: {stats['documents']} documents, {stats['tokens']} tokens")


def main() -> None:
    cards = card_rows(documented_functions())
    write_rows(cards)
    shutil.copyfile(Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" /
                    "LICENSE.txt", HERE / "LICENSE-PSF.txt")  # fmt: skip
    write_model(cards)
    write_shards()


if __name__ == "__main__":
    main()
