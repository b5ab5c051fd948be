"""The package's import graph: acyclic, and every import goes to a lower floor (docs/architecture.md).

Imports are read from the source (``ast``), including those inside functions: a lazy import is still a
dependency. A new module or package gets one line in ``FLOORS`` (the longest matching prefix gives a module's
floor); within one entry of the table modules may import each other, as long as no circle forms.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "neoembed"

# module prefix -> floor. Imports go strictly downward between entries; an entry's own modules share its floor.
FLOORS = {
    "neoembed._version": 0,
    "neoembed.config": 0,
    "neoembed.hub": 0,
    "neoembed.pooling": 0,
    # floor 1: foundations (only torch / transformers / pydantic below them)
    "neoembed.modeling": 1,
    "neoembed.recipe": 1,
    "neoembed.losses": 1,
    "neoembed.instructions": 0,
    "neoembed.scoring": 0,
    "neoembed.encode_checks": 0,  # numpy and torch only: batching says its truncation warning
    "neoembed.record": 1,
    "neoembed.plots": 1,
    "neoembed.card_schema": 1,
    "neoembed.compile": 1,
    "neoembed.quantization": 1,
    "neoembed.progress": 1,
    "neoembed.export.cpu": 1,
    "neoembed.batching": 1,
    "neoembed.model_card": 1,
    # floor 2: the bi-encoder, data, run plumbing (output folders, checkpoints, signals, metrics)
    "neoembed.sentence": 2,
    "neoembed.data": 2,
    "neoembed.runs": 2,
    "neoembed.adapters": 2,
    # floor 3: the one run loop of pre-training and CDE
    "neoembed.loop": 3,
    # floor 3: ONNX Runtime serving of an exported folder (builds on the bi-encoder; neoembed.load uses it)
    "neoembed.export.runtime": 3,
    "neoembed.export.torch_int8": 3,
    # floor 4: model kinds and their trainers
    "neoembed.train": 4,
    "neoembed.cde": 4,
    "neoembed.pretrain": 4,
    "neoembed.glue": 4,
    # floor 5: one loader for every model kind (bi-encoder or CDE)
    "neoembed.loading": 5,
    # floor 6: evaluation, hard-negative mining
    "neoembed.eval": 6,
    "neoembed.mine": 6,
    "neoembed.export": 6,
    # floor 7: commands (every subcommand module, whichever package it lives in)
    "neoembed.cli": 7,
    "neoembed.quickstart": 7,
    "neoembed.train.cli": 7,
    "neoembed.eval.cli": 7,
    "neoembed.data.cli": 7,
    "neoembed.pretrain.cli": 7,
    "neoembed.mine.cli": 7,
    "neoembed.glue.cli": 7,
    "neoembed.export.cli": 7,
    # floor 8: the entry points: the package root, the public facade (neoembed.load, the model classes, the
    # version), and ``python -m neoembed``
    "neoembed": 8,
    "neoembed.__main__": 8,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str:
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source (``from a import b`` counts ``a.b`` when
    that is a module, else ``a``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf8"))):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                found = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            targets |= {_resolve(f, modules) for f in found if f.split(".")[0] == "neoembed"}
        graph[name] = targets - {name}
    return graph


def unit(module: str) -> str:
    matches = [p for p in FLOORS if module == p or module.startswith(p + ".")]
    assert matches, f"{module} has no floor: add one line for it (or its package) to FLOORS"
    return max(matches, key=len)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_reader_sees_imports_inside_functions():
    graph = import_graph()
    assert "neoembed.cde.model" in graph["neoembed.loading"]  # top level
    assert "neoembed.eval.runner" in graph["neoembed.quickstart"]  # inside quickstart_command
    assert "neoembed.loading" in graph["neoembed.eval.runner"]  # inside _load_model
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_import_graph_is_acyclic():
    cycle = _cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_every_import_goes_to_a_lower_floor():
    wrong = []
    for module, targets in sorted(import_graph().items()):
        for target in sorted(targets):
            a, b = unit(module), unit(target)
            if a != b and FLOORS[b] >= FLOORS[a]:
                wrong.append(f"{module} (floor {FLOORS[a]}) imports {target} (floor {FLOORS[b]})")
    assert not wrong, "imports that do not go down a floor:\n" + "\n".join(wrong)


def test_nothing_inside_imports_the_package_root():
    importers = sorted(m for m, targets in import_graph().items() if "neoembed" in targets)
    assert importers == [], f"{importers} import the package root: import the module that holds the name"


def test_the_architecture_page_shows_these_floors():
    """docs/architecture.md's table is this plan, entry for entry (module names relative to the package)."""
    import re

    page = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    shown = {}
    for floor, cell in re.findall(r"^\| (\d+) \| (.+?) \|", page, flags=re.M):
        for name in re.findall(r"`([\w.]+)`", cell):
            module = name if name.startswith("neoembed") else f"neoembed.{name}"
            shown[module] = int(floor)
    assert shown == FLOORS
