"""No function longer than 80 lines outside tests (STYLE: small pieces a reader can hold at once).

``python tests/test_function_length.py`` lists every function over the limit, with its length (the count is
reproducible: ``ast`` line spans, decorators excluded, docstrings included). Every function of the package is held
to it: a longer one is split along its seams (setup, data, the step, the run record, the end of the run).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "neoembed"
LIMIT = 80


def long_functions(limit: int = LIMIT) -> dict[str, int]:
    """``file:function`` -> line count, for every function of the package longer than ``limit`` lines."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    out[f"{path.relative_to(PACKAGE).as_posix()}:{node.name}"] = length
    return out


def test_no_function_over_80_lines():
    found = long_functions()
    assert not found, f"functions over {LIMIT} lines: {found}; split them where the work changes hands"
    assert long_functions(limit=10), "the reader found no functions at all"


if __name__ == "__main__":
    for name, length in sorted(long_functions().items(), key=lambda kv: -kv[1]):
        print(f"{length:4d}  {name}")


MODULE_LIMIT = 600
#: modules still over MODULE_LIMIT, each at most its present size, and what takes it under: the list only shrinks
MODULES_OVER: dict[str, tuple[int, str]] = {}


def long_modules(limit: int = MODULE_LIMIT) -> dict[str, int]:
    """``file`` -> line count, for every module of the package longer than ``limit`` lines."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text(encoding="utf8").splitlines())
        if lines > limit:
            out[path.relative_to(PACKAGE).as_posix()] = lines
    return out


def test_no_module_over_600_lines():
    found = long_modules()
    new = sorted(set(found) - set(MODULES_OVER))
    assert not new, f"modules over {MODULE_LIMIT} lines: {new}; split them by role (see neoembed/data/)"
    grown = {m: n for m, n in found.items() if m in MODULES_OVER and n > MODULES_OVER[m][0]}
    assert not grown, f"{grown} grew past their cap {MODULES_OVER}: move code out instead"
    done = sorted(set(MODULES_OVER) - set(found))
    assert not done, f"{done} are at most {MODULE_LIMIT} lines now: remove them from MODULES_OVER"
