"""The documentation site (mkdocs.yml: docs/ plus an API reference from the docstrings) builds in strict mode:
a broken link, a missing page, a page left out of the navigation or an unresolvable API reference fails CI. The
site has a home page (docs/index.md: install, the two commands, the tour), and its navigation is grouped by what a
user does, with the package's internals apart."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_with_warnings_as_errors(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(REPO / "mkdocs.yml"),
            "-d",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "own-data" / "index.html").is_file()
    home = (tmp_path / "index.html").read_text(encoding="utf8")  # the root of the site is a page, not a 404
    assert "Install and run" in home and "A short tour" in home
    api = (tmp_path / "api" / "index.html").read_text(encoding="utf8")
    assert "mine_negatives" in api and "InfoNCELoss" in api  # the reference is generated from the docstrings
    # the docstrings' Sphinx roles show as their code (they read ":func:neoembed.sentence.load"; #44's walk X)
    assert not re.search(r":(func|class|mod|data|meth|attr):<code>", api)
    assert "<code>neoembed.sentence.load</code>" in api


GROUPS = ["Start", "Train", "Evaluate", "Serve", "Reference", "Internals"]
INTERNALS = {"architecture.md", "benchmarks.md"}


def _pages(entries) -> list[str]:
    """The files a navigation (sub)tree places, in order."""
    found = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        found += _pages(value) if isinstance(value, list) else [value]
    return found


def test_every_page_is_placed_once_in_a_navigation_grouped_by_task():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf8"))
    nav = {next(iter(group)): next(iter(group.values())) for group in config["nav"]}
    assert list(nav) == GROUPS, list(nav)
    placed = _pages(config["nav"])
    pages = sorted(p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md"))
    assert sorted(placed) == pages, f"not placed: {sorted(set(pages) - set(placed))}; placed: {placed}"
    assert _pages(nav["Start"])[0] == "index.md"  # the home page opens the site
    assert set(_pages(nav["Internals"])) == INTERNALS  # internals apart from the user guides
    # the strict build checks it too: a page left out of the navigation is a warning, and warnings fail it
    assert config["validation"]["nav"]["omitted_files"] == "warn" and config["strict"]


def test_the_home_page_has_the_install_the_two_commands_and_the_tour_and_the_readme_one_screen():
    home = (REPO / "docs" / "index.md").read_text(encoding="utf8")
    readme = (REPO / "README.md").read_text(encoding="utf8")
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv")]
    assert len(commands) == 2 and all(c in home for c in commands)  # the quickstart and the tests
    assert "## A short tour" in home and "## A short tour" not in readme
    assert "docs/index.md" in readme and len(readme.splitlines()) <= 45  # a one-screen start that points here


def test_install_lines_use_the_repository_form():
    """neoembed is not on the package index: an extra is installed as `pip install -e ".[extra]"` from the
    repository's folder, never `pip install 'neoembed[extra]'` (which fails)."""
    files = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "recipes").rglob("*.yaml")]
    wrong = [
        f"{f.relative_to(REPO)}: {m.group(0)}"
        for f in files
        for m in re.finditer(r"pip install[^`\n]*?['\"]?neoembed\[", f.read_text(encoding="utf8"))
    ]
    assert not wrong, wrong
    assert 'pip install -e ".[onnx]"' in (REPO / "docs" / "export.md").read_text(encoding="utf8")


def test_training_md_names_every_key_of_the_unified_recipe():
    """own-data.md and init's comments send a reader to training.md for every recipe key; it lacked fifteen (among
    them `precision`'s values, how one trains in bf16). Each key, nested ones by their last name, is named there."""
    import typing

    from pydantic import BaseModel

    from neoembed.train.recipe import UnifiedRecipe

    def keys(model, prefix=""):
        for name, field in model.model_fields.items():
            yield prefix + name
            inner = [a for a in (field.annotation, *typing.get_args(field.annotation)) if isinstance(a, type)]
            for sub in (a for a in inner if issubclass(a, BaseModel)):
                if not prefix:
                    yield from keys(sub, name + ".")

    page = (REPO / "docs" / "training.md").read_text()
    missing = [k for k in keys(UnifiedRecipe) if not re.search(rf"[`{{ ]{re.escape(k.split('.')[-1])}[`:=]", page)]
    assert not missing, f"docs/training.md names no {missing}"
