"""The command line starts at once: ``neoembed --help`` and every ``neoembed CMD --help`` import neither torch,
transformers, sentence-transformers, datasets, mteb nor numpy (#41); a command imports what it needs when it
runs. Checked in a fresh interpreter (this one has torch loaded), on ``sys.modules``.

``import neoembed`` stays light too, and transformers' Auto classes still know NeoBERT in either order of
imports: the package registers it when transformers' Auto module loads."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "sentence_transformers", "datasets", "mteb", "numpy")

_HELP = f"""
import json, sys
from typer.testing import CliRunner
from neoembed.cli import app

runner = CliRunner()
names = [c.name or c.callback.__name__ for c in app.registered_commands] + [g.name for g in app.registered_groups]
seen = {{}}
for argv in [["--help"], *[[n, "--help"] for n in names], ["data", "check", "--help"], ["mteb", "compare", "--help"]]:
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, (argv, result.output)
    seen[" ".join(argv)] = [m for m in {HEAVY!r} if m in sys.modules]
print(json.dumps(seen))
"""


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_every_help_starts_without_heavy_imports():
    seen = json.loads(_run(_HELP))
    assert len(seen) >= 15  # the root, twelve-odd commands and the subcommands of data and mteb
    assert {argv: mods for argv, mods in seen.items() if mods} == {}


def test_import_neoembed_is_light_and_auto_classes_know_neobert_in_either_order():
    light = _run(f"import sys, neoembed; print([m for m in {HEAVY!r} if m in sys.modules])")
    assert light == "[]"
    after = "import neoembed\nfrom transformers import AutoConfig\nprint(type(AutoConfig.for_model('neobert')).__name__)"
    before = (
        "from transformers import AutoModel\nimport neoembed\nfrom transformers import AutoConfig\n"
        + after.split("\n", 1)[1]
    )
    assert _run(after) == "NeoBERTConfig"
    assert _run(before) == "NeoBERTConfig"
    lazy = "import neoembed\nprint(neoembed.NeoBERTModel.__name__, neoembed.NeoBERTConfig().model_type)"
    assert _run(lazy) == "NeoBERTModel neobert"


_BAD = f"""
import atexit, json, sys
atexit.register(lambda: print(json.dumps([m for m in {HEAVY!r} if m in sys.modules])))
sys.argv = ["neoembed", *json.loads(sys.argv[1])]
from neoembed.cli import main
main()
"""


def test_a_missing_input_is_refused_before_heavy_imports(tmp_path):
    """A mistyped path costs a second, not the 5-10 s of importing torch first (``init`` took 38 s under load);
    so do a model or tokenizer the hub cannot be asked about offline (``mteb`` also built mteb's task registry
    first: 20 s; ``train``, ``glue``, ``pretrain`` and ``preprocess`` took 8-13 s) and a recipe value that does
    not validate (the recipe types import no torch)."""
    import os

    missing = "no-such-org/no-such-model"
    cases = (
        ["init", "no-such-file.jsonl"],
        ["train", "no-such-recipe.yaml"],
        ["train", "tiny", "steps=no-such"],
        ["train", "tiny", f"model={missing}"],
        ["train", "cde-tiny", f"model={missing}"],
        ["glue", "RTE", "--model", missing],
        ["pretrain", "pretrain-tiny", f"tokenizer={missing}"],
        ["preprocess", "corpus.txt", "shards", "--tokenizer", missing],
        ["mteb", "--model", "./no-such-model", "--tasks", "STS12"],
        ["mteb", "--model", missing, "--tasks", "STS12"],
        ["convert", missing, "converted"],
    )
    (tmp_path / "corpus.txt").write_text("a document\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for argv in cases:
        out = subprocess.run(
            [sys.executable, "-c", _BAD, json.dumps(argv)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=tmp_path,
        )
        heavy = json.loads(out.stdout.strip().splitlines()[-1])
        assert (out.returncode, heavy) == (2, []), (argv, out.stderr[-2000:])
        assert "no-such" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]  # a refused command wrote nothing


def test_a_hub_model_in_the_local_cache_passes_the_offline_check(tmp_path, monkeypatch):
    """The early check refuses only what loading would: a hub id whose files are in the local cache loads
    offline, so it passes, and the loader reads its kind from the cache (a plain checkpoint here: no
    modules.json); one that is not, a mistyped local path and a name that is no hub id are refused."""
    import huggingface_hub.constants
    import pytest

    from neoembed.hub import check_model_source, hub_modules_json

    snapshot = tmp_path / "models--org--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--org--cached" / "refs").mkdir()
    (tmp_path / "models--org--cached" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    check_model_source("org/cached")
    assert hub_modules_json("org/cached") is False  # what sentence.load's kind check asks
    (snapshot / "modules.json").write_text("[]")
    assert hub_modules_json("org/cached") is True
    check_model_source(str(snapshot))  # a local model folder
    with pytest.raises(FileNotFoundError, match="is not a model: expected modules.json"):
        check_model_source(str(tmp_path))  # a local folder that is none, as loading it would say
    check_model_source("packaged:all-MiniLM-L6-v2")
    with pytest.raises(ValueError, match="packaged:all-minilm-l6-v2 is not a packaged model; the one packaged is"):
        check_model_source("packaged:all-minilm-l6-v2")  # not sent to the hub as a repo id
    with pytest.raises(OSError, match="hub could not be asked"):
        check_model_source("org/not-cached")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_model_source("./no/such/folder")
    # a tokenizer cached without its model's config.json loads offline (preprocess, pretrain): it passes too
    only = tmp_path / "models--org--tokenizer" / "snapshots" / "abc123"
    only.mkdir(parents=True)
    (only / "tokenizer_config.json").write_text("{}")
    (tmp_path / "models--org--tokenizer" / "refs").mkdir()
    (tmp_path / "models--org--tokenizer" / "refs" / "main").write_text("abc123")
    check_model_source("org/tokenizer", tokenizer=True)
    with pytest.raises(OSError, match="hub could not be asked"):
        check_model_source("org/tokenizer")  # not a model: loading one from it would fail offline
