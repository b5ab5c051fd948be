"""The documentation site (mkdocs.yml: docs/ plus an API reference from the docstrings) builds in strict mode:
a broken link, a missing page or an unresolvable API reference fails CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    api = (tmp_path / "api" / "index.html").read_text(encoding="utf8")
    assert "mine_negatives" in api and "InfoNCELoss" in api  # the reference is generated from the docstrings
