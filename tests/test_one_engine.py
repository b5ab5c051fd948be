"""One run engine (#41): every trainer runs on ``loop.RunLoop``, so one function writes checkpoint folders, one
writes ``run_record.json``, and nothing in neoembed subclasses transformers' or sentence-transformers' Trainer
(whose private methods the unified trainer used to override). Read from the source, not by running anything."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "neoembed"


def _callers(name: str) -> set[str]:
    """``module:function`` (or ``module:Class.method``) of every call to ``name`` in the package."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        module = path.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", ".")
        tree = ast.parse(path.read_text(encoding="utf8"))
        for top in tree.body:
            for owner in [top] if not isinstance(top, ast.ClassDef) else top.body:
                if not isinstance(owner, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                where = f"{top.name}.{owner.name}" if isinstance(top, ast.ClassDef) else owner.name
                for node in ast.walk(owner):
                    if isinstance(node, ast.Call):
                        func = node.func
                        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                        if called == name:
                            found.add(f"{module}:{where}")
    return found


def test_one_function_writes_checkpoint_folders():
    assert _callers("stage_checkpoint") == {"neoembed.loop:RunLoop.save"}
    assert _callers("commit_checkpoint") == {"neoembed.loop:RunLoop.save"}


def test_one_function_writes_the_run_record():
    # eval.runner has a function of the same name, which records an evaluation through write_run_record
    writers = _callers("_write_record") - {"neoembed.eval.runner:_run_plan"}
    assert {w.split(":")[0] for w in writers} == {"neoembed.record"}, writers
    assert not any("json.dump" in line and "RUN_RECORD" in line for line in _lines())


def _lines():
    for path in PACKAGE.rglob("*.py"):
        yield from path.read_text(encoding="utf8").splitlines()


def test_no_trainer_subclass_and_no_trainer_callback():
    """The unified trainer ran on a Trainer subclass built inside a function, with overrides of its private
    ``_save_checkpoint``, ``_get_output_dir``, ``_load_from_checkpoint`` and ``_load_best_model``, and five callbacks."""
    banned = {"Trainer", "SentenceTransformerTrainer", "TrainerCallback"}
    private = {"_save_checkpoint", "_get_output_dir", "_load_from_checkpoint", "_load_best_model"}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf8"))):
            if isinstance(node, ast.ClassDef):
                bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
                assert not bases & banned, f"{path}: {node.name}({bases & banned})"
            if isinstance(node, ast.FunctionDef):
                assert node.name not in private, f"{path}: {node.name}"
