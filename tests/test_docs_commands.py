"""Every command line of the README and docs/ runs as written.

Each line of a ``bash`` block is listed in ``HOW`` with the way it is proven, so that a new or changed documented
command fails here until someone says how it runs:

- ``run``: executed as written, in the page's order, in a scratch copy of the repository (with
  ``../shared`` beside it: a link to the repository's copy, ``tests/shared``), exit 0. A plain ``neoembed ARGS``
  line runs in the test's interpreter as the console script runs it (``run_neoembed``: every start would cost
  an import of torch, transformers and sentence-transformers; ``tests/test_cli_smoke.py`` starts the real
  script); any other line (a launcher, a redirection, ``&&``) by bash, with the installed ``neoembed`` console
  script first on ``PATH``; placeholders (``MODEL``, ``my-model``, ...) are swapped for the fixtures in ``PLACEHOLDERS``, and a line that consumes what a hub-only
  line above it would have written gets that output from a local stand-in (``STAND_INS``). Afterwards the copy
  holds nothing that git would show as untracked.
- ``slow``: the same, under ``-m slow`` (minutes).
- ``hub``: needs the Hugging Face Hub. Run offline, it must end with exit 1 or 2 and a message that names the hub,
  without a traceback; ``accelerate launch ... -m neoembed X`` lines run their inner command.
- ``install``: a ``pip install`` line: every extra it names is in ``pyproject.toml``.
- ``ci``: the README's test line, which is what ``.ci/run`` runs (checked to be the same text).
- ``readme``: a line of the README repeated word for word on the site's home page; proven as the README's.
- ``tour``: a line of the home page's tour that another page runs word for word, with nothing before it on the
  home page that it reads; proven there (each run once: every launch costs an interpreter start).
- ``own-data``: docs/own-data.md's page, run in order by ``tests/test_own_data.py``.
- ``shape``: needs what cannot exist here (a stage-2 pre-trained NeoBERT, a trained cross-encoder, a literal
  ``...``); parsed only.

Each page's ``python`` blocks run too, after its ``run`` lines, in a fresh interpreter per page, with the hub's NeoBERT
swapped for the tiny checkpoint in the official layout (``PYTHON_STAND_INS``) and the names a fragment leaves to
the reader defined first (``PYTHON_PRELUDES``).

Every ``neoembed ...`` line, in blocks and inline code, must also parse: the subcommand and every option exist.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer

from neoembed.cli import app

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

HOW = {
    "README.md": {
        'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[quickstart]"'
        " && neoembed quickstart": "slow",
        'python3 -m venv .venv && . .venv/bin/activate && pip install -q torch==2.13.0 && pip install -q -e ".[dev]"'
        " && pytest": "ci",
    },
    "backbone.md": {
        "neoembed convert chandar-lab/NeoBERT runs/neobert": "hub",
        "neoembed convert runs/neobert runs/neobert-official --to official": "run",
    },
    "integrations.md": {  # third-party packages; the page's python runs in benchmarks/integrations.py
        "pip install langchain-huggingface sentence-transformers": "install",
        "pip install llama-index-embeddings-huggingface": "install",
    },
    "cde.md": {
        'pip install -e ".[faiss,quickstart]"': "install",
        "neoembed train cde": "hub",
        "neoembed train cde-tiny": "run",
        "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 -m neoembed train cde-tiny"
        " output_dir=runs/cde-tiny-ddp": "slow",
        "neoembed mteb --model runs/cde --tasks SciFact": "hub",
        "neoembed mteb --model runs/cde --tasks SciFact --cde-context null": "hub",
    },
    "distributed.md": {
        "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 -m neoembed train tiny"
        " output_dir=runs/tiny-ddp": "slow",
        "torchrun --standalone --nproc-per-node 2 -m neoembed train tiny output_dir=runs/tiny-torchrun": "slow",
        "accelerate launch --num_processes 8 -m neoembed train neobert-unified gather_across_devices=true": "hub",
        "torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr HOST0 --master-port 29500 -m neoembed"
        " train neobert-unified gather_across_devices=true": "hub",
        "torchrun --nnodes 2 --nproc-per-node 8 --node-rank 1 --master-addr HOST0 --master-port 29500 -m neoembed"
        " train neobert-unified gather_across_devices=true": "hub",
        "mkdir -p runs": "slow",  # a fresh clone has no runs/ for the second node's log
        # the second "node" in the background, then the first in the foreground: its exit is the run's
        "torchrun --nnodes 2 --nproc-per-node 1 --node-rank 1 --master-addr localhost --master-port 29531"
        " -m neoembed train tiny output_dir=runs/tiny-2nodes > runs/node1.log 2>&1 &": "slow",
        "torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 --master-addr localhost --master-port 29531"
        " -m neoembed train tiny output_dir=runs/tiny-2nodes": "slow",
    },
    "evaluation.md": {
        "neoembed mteb --model my-model": "hub",
        "neoembed mteb --model my-model --tasks STS13,SciFact --precision bf16 --instructions none": "hub",
        "neoembed mteb --model my-model --data-dir tests/shared/data/mteb": "run",
        "neoembed mteb --model my-model --data-dir tests/shared/data/eval": "run",
        "neoembed mteb --model my-model --data-dir tests/shared/data": "slow",
        "neoembed mteb compare results/model-a results/model-b": "run",
    },
    "export.md": {
        'pip install -e ".[onnx]"': "install",
        "neoembed export runs/my-model runs/exported/ --format onnx --quantize int8": "run",
        "neoembed mteb --model runs/my-model --data-dir tests/shared/data/eval --embedding-precision binary": "run",
    },
    "glue.md": {
        "neoembed glue MNLI --model chandar-lab/NeoBERT --out runs/glue/mnli": "hub",
        "neoembed glue RTE --model chandar-lab/NeoBERT --from runs/glue/mnli": "hub",
        "neoembed glue CoLA --model chandar-lab/NeoBERT --grid --out runs/glue/cola-grid": "hub",
        "neoembed glue MRPC --model all-MiniLM-L6-v2 --data-dir tests/shared/data/eval/MSRP --carve test epochs=3": "slow",
    },
    "index.md": {  # the site's home page: the README's two lines, then the tour
        'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[quickstart]"'
        " && neoembed quickstart": "readme",
        'python3 -m venv .venv && . .venv/bin/activate && pip install -q torch==2.13.0 && pip install -q -e ".[dev]"'
        " && pytest": "readme",
        "neoembed convert chandar-lab/NeoBERT runs/neobert": "hub",
        "neoembed mteb --model my-model --tasks STS13,SciFact --precision bf16": "hub",
        "neoembed mteb --model my-model --data-dir tests/shared/data/mteb": "tour",
        "neoembed train neobert-unified steps=500 optimizer.lr=2e-5 loss.name=cached_infonce": "hub",
        'neoembed train neobert-unified "matryoshka.dims=[768,256,64]" false_negatives.margin=0.1': "hub",
        "neoembed train neobert-unified --dry-run": "tour",
        "neoembed train tiny": "run",
        "neoembed train tiny --resume": "run",
        "neoembed mine tests/data_cards/msrp_pairs.yaml --model MODEL --out runs/mined/": "tour",
        "neoembed train cde": "hub",
        "neoembed pretrain pretrain-tiny": "tour",
        "neoembed preprocess docs/ runs/shards-mydomain --tokenizer chandar-lab/NeoBERT": "hub",
        "neoembed pretrain pretrain-tiny tokenizer=chandar-lab/NeoBERT data.sources='[{path: runs/shards-mydomain}]'"
        " output_dir=runs/pretrain-mydomain": "hub",
        "neoembed glue RTE --model chandar-lab/NeoBERT --from runs/glue/mnli": "hub",
        "neoembed data check msmarco": "run",
    },
    "mine.md": {
        'pip install -e ".[faiss]"': "install",
        "neoembed mine tests/data_cards/msrp_pairs.yaml --model MODEL --out runs/mined/": "run",
        "neoembed mine CARD --model MODEL --out runs/mined-hnsw/ --corpus OTHER_CARD --index hnsw"
        " --cross-encoder CROSS_ENCODER": "shape",  # no trained cross-encoder offline: tests/test_mine.py rescores
        "neoembed mine CARD --model MODEL --out runs/mined/ --resume": "run",
        "neoembed train tiny 'datasets=[{card: runs/mined/msrp_pairs_mined.yaml}]'": "run",
    },
    "own-data.md": {
        "neoembed init pairs.jsonl --out mydata --model packaged:all-MiniLM-L6-v2": "own-data",
        "neoembed data check mydata/pairs.yaml": "own-data",
        "neoembed train mydata/pairs-recipe.yaml --dry-run": "own-data",
        "neoembed train mydata/pairs-recipe.yaml": "own-data",
        "neoembed mteb --model packaged:all-MiniLM-L6-v2 --tasks mydata/heldout-task.yaml --output results/base": "own-data",
        "neoembed mteb --model runs/pairs --tasks mydata/heldout-task.yaml --output results/pairs": "own-data",
        "neoembed mteb compare results/base results/pairs": "own-data",
    },
    "pretraining.md": {
        "neoembed preprocess refinedweb data/refinedweb --tokenizer chandar-lab/NeoBERT --min-lengths 1024,2048": "hub",
        "accelerate launch --num_processes 8 -m neoembed pretrain pretrain-stage1"
        " data.sources='[{path: data/refinedweb}]'": "hub",
        "accelerate launch --num_processes 8 -m neoembed pretrain pretrain-stage2": "hub",
        "neoembed pretrain pretrain-tiny": "run",
        "neoembed preprocess docs/ runs/shards-mydomain --tokenizer chandar-lab/NeoBERT": "hub",
        "neoembed pretrain pretrain-tiny tokenizer=chandar-lab/NeoBERT data.sources='[{path: runs/shards-mydomain}]'"
        " output_dir=runs/pretrain-mydomain": "hub",
        "neoembed pretrain pretrain-stage1 ... --resume": "shape",
        "neoembed ppl --model runs/neobert-stage2 --data data/refinedweb --lengths 512,1024,2048,4096"
        " --out runs/ppl/": "shape",
    },
    "training.md": {
        "neoembed train neobert-unified": "hub",
        "neoembed train my.yaml steps=500 optimizer.lr=2e-5": "slow",
        "neoembed train my.yaml steps=500 optimizer.lr=2e-5 --resume": "slow",
        "neoembed train my.yaml --overwrite": "slow",
        "neoembed train neobert-unified --dry-run": "run",
        "accelerate launch --num_processes 8 -m neoembed train neobert-unified gather_across_devices=true": "hub",
        'neoembed train tiny output_dir=runs/tiny-mrl "matryoshka.dims=[32,16,8]" loss.name=cached_infonce': "run",
        "neoembed train tiny output_dir=runs/tiny-fn false_negatives.margin=0.01 improved_contrastive=true": "run",
        "neoembed mine recipes/tiny/cards/pydoc_names.yaml --model recipes/tiny/model --out runs/pydoc-mined -k 2"
        " --max-length 64": "run",
        'neoembed train tiny output_dir=runs/tiny-kd "datasets=[{card: runs/pydoc-mined/pydoc_names_mined.yaml}]"'
        " distillation.loss=kl distillation.weight=0.5": "run",
    },
}

# Placeholders of the pages, and the fixture each stands for when the line runs here.
PLACEHOLDERS = {
    "my-model": "recipes/tiny/model",
    "runs/my-model": "recipes/tiny/model",
    "MODEL": "recipes/tiny/model",
    "CARD": "tests/data_cards/msrp_pairs.yaml",
    "OTHER_CARD": "tests/data_cards/sts2012_pairs.yaml",
    "my.yaml": "recipes/tiny.yaml",
}

# What a hub-only line above would have written, made locally before the line that reads it.
STAND_INS = {
    # a local tokenizer's shards where the hub tokenizer's would be: the line still needs the hub tokenizer
    "neoembed pretrain pretrain-tiny tokenizer=chandar-lab/NeoBERT data.sources='[{path: runs/shards-mydomain}]'"
    " output_dir=runs/pretrain-mydomain": ["neoembed preprocess docs/ runs/shards-mydomain --tokenizer recipes/tiny/model"],
    "accelerate launch --num_processes 8 -m neoembed pretrain pretrain-stage1 data.sources='[{path: data/refinedweb}]'": [
        "neoembed preprocess docs/ data/refinedweb --tokenizer recipes/tiny/model --min-lengths 1024,2048"
    ],
    "neoembed glue RTE --model chandar-lab/NeoBERT --from runs/glue/mnli": [
        "neoembed convert {tiny_official} runs/glue/mnli"  # the MNLI run's model; RTE's data still needs the hub
    ],
    "neoembed convert runs/neobert runs/neobert-official --to official": [
        "neoembed convert {tiny_official} runs/neobert"
    ],
    "neoembed mteb compare results/model-a results/model-b": [
        "neoembed mteb --model recipes/tiny/model --data-dir tests/shared/data/eval --output results/model-a",
        "neoembed mteb --model {tiny_official} --data-dir tests/shared/data/eval --output results/model-b",
    ],
}

PYTHON_STAND_INS = {'"chandar-lab/NeoBERT"': '"{tiny_official}"'}
PYTHON_SETUP = {"cde.md": ["neoembed train cde-tiny output_dir=runs/cde"]}
PYTHON_PRELUDES: dict[str, str] = {}  # lines a page's snippet needs before it runs (none: each defines its own)


# ------------------------------------------------------------------------------------------------ reading pages
def fenced_blocks(text: str) -> list[tuple[str, list[str]]]:
    """``(language, lines)`` of each fenced block, fences paired in order (a closing fence never opens one)."""
    blocks, language, lines = [], None, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if language is None:
                language, lines = line.strip()[3:].strip() or "text", []
            else:
                blocks.append((language, lines))
                language = None
        elif language is not None:
            lines.append(line)
    return blocks


def shell_lines(text: str) -> list[str]:
    """The command lines of a page's ``bash``/``sh``/``console`` blocks, comments and blank lines dropped."""
    found = []
    for language, lines in fenced_blocks(text):
        if language in ("bash", "sh", "console"):
            found += [s for line in lines if (s := re.sub(r"(^|\s+)#.*$", "", line).strip())]
    return found


def _command_lines(text: str) -> list[str]:
    """``neoembed ...`` commands of the fenced shell blocks (``&&`` chains split, ``-m neoembed`` after a
    launcher) and of inline code spans that start with ``neoembed ``."""
    found = []
    for line in shell_lines(text):
        for part in line.split("&&"):
            part = part.strip()
            if "-m neoembed " in part:
                part = "neoembed " + part.split("-m neoembed ", 1)[1]
            if part.startswith("neoembed "):
                found.append(part)
    prose = "\n".join(
        line for line in _without_blocks(text).splitlines() if not line.lstrip().startswith("```")
    )
    return found + re.findall(r"`(neoembed [^`]+)`", prose)


def _without_blocks(text: str) -> str:
    out, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside:
            out.append(line)
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ parsing
def _check(line: str, root) -> str | None:
    """None if ``line`` parses, else why not."""
    try:
        tokens = shlex.split(line.replace("[", " ").replace("]", " "))[1:]
    except ValueError as e:
        return f"{e}"
    command, path = root, ["neoembed"]
    for token in tokens:
        if token.startswith("-") and token not in ("-", "--"):
            name = token.split("=", 1)[0]
            valid = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}
            if name not in valid:
                return f"{' '.join(path)} has no option {name} (valid: {sorted(valid)})"
        elif hasattr(command, "commands") and token in command.commands:
            command = command.commands[token]
            path.append(token)
        elif hasattr(command, "commands") and not command.commands.get(token) and len(path) == 1:
            return f"no subcommand {token!r} (valid: {sorted(command.commands)})"
    return None


def test_every_documented_command_line_parses():
    root = typer.main.get_command(app)
    checked, wrong = 0, []
    for page in PAGES:
        for line in _command_lines(page.read_text(encoding="utf8")):
            checked += 1
            if (why := _check(line, root)) is not None:
                wrong.append(f"{page.relative_to(REPO)}: {line}\n    {why}")
    assert checked > 60, checked  # the pages do hold commands: the reader found them
    assert not wrong, "stale command lines:\n" + "\n".join(wrong)


def test_the_checker_catches_stale_commands():
    root = typer.main.get_command(app)
    assert _check("neoembed mteb --model m --tasks STS13", root) is None
    assert "no option --taks" in _check("neoembed mteb --model m --taks STS13", root)
    assert "no subcommand 'evaluate'" in _check("neoembed evaluate --model m", root)
    page = "```python\nx = 1\n```\ntext\n```bash\nx && neoembed quickstart  # go\n```\nsee `neoembed train tiny`"
    assert _command_lines(page) == ["neoembed quickstart", "neoembed train tiny"]  # the block after python too
    assert shell_lines(page) == ["x && neoembed quickstart"]
    # a line runs in this interpreter only where bash would just split it into words
    assert not _needs_bash("""neoembed train tiny "dims=[32,16]" 'datasets=[{card: c.yaml}]'""")
    assert all(_needs_bash(f"neoembed {x}") for x in ("a > b", "a && b", '"$X"', "x=[1]", "~/x", "a; b", "*.yaml"))


def test_every_documented_shell_line_says_how_it_runs():
    documented = {page.name: shell_lines(page.read_text(encoding="utf8")) for page in PAGES}
    documented = {name: lines for name, lines in documented.items() if lines}
    assert documented == {name: list(how) for name, how in HOW.items()}, (
        "a documented command changed: say in HOW how the new line is proven"
    )


# ------------------------------------------------------------------------------------------------ install, ci
def test_install_lines_name_extras_that_exist():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    lines = [line for how in HOW.values() for line, mode in how.items() if "pip install" in line]
    named = {e.strip() for line in lines for group in re.findall(r"\[([^\]]+)\]", line) for e in group.split(",")}
    assert named and named <= set(extras), sorted(named - set(extras))
    assert {"faiss", "onnx", "quickstart", "dev"} <= named
    assert any(d.startswith("faiss") for d in extras["faiss"])  # the page that mines installs the index
    assert any(d.startswith("tensorboard") for d in extras["dev"])  # curves: the documented tracker is there


def test_the_readme_test_line_is_what_ci_runs():
    (line,) = [line for line, mode in HOW["README.md"].items() if mode == "ci"]
    assert line in (REPO / ".ci" / "run").read_text()
    repeated = [line for how in HOW.values() for line, mode in how.items() if mode == "readme"]
    assert repeated and set(repeated) <= set(HOW["README.md"]), repeated  # the home page's copies of the README


def test_the_home_pages_tour_lines_run_on_their_pages():
    tour = [line for line, mode in HOW["index.md"].items() if mode == "tour"]
    run = {line for page, how in HOW.items() if page != "index.md" for line, mode in how.items() if mode == "run"}
    assert tour and set(tour) <= run, sorted(set(tour) - run)


# ------------------------------------------------------------------------------------------------ running
def _scratch_copy(tmp_path: Path, shared: Path) -> Path:
    """The repository's files as a fresh clone has them, in a git repository of its own (nothing committed:
    ``git status`` then shows what the commands left that is not ignored), with ``../shared`` beside it.

    ``shared`` is the repository's copy of the shared folder (``tests/shared``). The pages name ``../shared/...``,
    the folder beside a checkout; rather than rewrite their lines, ``../shared`` of the scratch copy is a plain
    link to that copy, so each line runs as written. The copy's own ``tests/shared`` is the same link (21 MB not
    copied once per page)."""
    root = tmp_path / "neoembed"
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file() and not name.startswith("tests/shared/"):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    (root / "tests" / "shared").symlink_to(shared)
    (tmp_path / "shared").symlink_to(shared)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    return root


def _as_run_here(line: str, tiny_official: Path) -> str:
    for name, value in sorted(PLACEHOLDERS.items(), key=lambda kv: -len(kv[0])):
        line = re.sub(rf"(?<![\w/.-]){re.escape(name)}(?![\w/.-])", value, line)
    return line.replace("{tiny_official}", str(tiny_official))


def _environment() -> dict:
    """The environment of the lines bash runs: offline, one thread each (the suite's other worker shares the
    cores), this interpreter's ``neoembed`` console script first on ``PATH``."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", NEOEMBED_DEBUG="")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def _needs_bash(command: str) -> bool:
    """Whether bash would do more with ``command`` than split it into words: an operator, redirection,
    expansion or glob outside quotes (or an expansion inside double quotes)."""
    quote = None
    for c in command:
        if quote == "'":
            quote = None if c == "'" else quote
        elif quote == '"':
            if c == '"':
                quote = None
            elif c in "$`\\":
                return True
        elif c in "'\"":
            quote = c
        elif c in "|&;<>()$`*?~{}[]\\!":
            return True
    return False


def _run_line(command: str, root: Path, env: dict, run_neoembed) -> tuple[int, str, str]:
    """``command`` in ``root``: (exit code, stdout, stderr). A plain ``neoembed ARGS`` line in this interpreter
    (``run_neoembed``, ``env``'s debug switch), anything else by bash in ``env``."""
    args = shlex.split(command)
    if args[0] == "neoembed" and not _needs_bash(command):
        r = run_neoembed(args[1:], cwd=root, env={"NEOEMBED_DEBUG": env["NEOEMBED_DEBUG"]})
        return r.exit_code, r.stdout, r.stderr
    r = subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def _run_page(
    page: str, modes: set[str], tmp_path: Path, shared: Path, tiny_official: Path, env: dict, run_neoembed
) -> list[str]:
    """Runs the page's lines of ``modes`` in order in a scratch copy, in ``env`` (``_environment``); returns what
    went wrong."""
    root = _scratch_copy(tmp_path / page, shared)
    wrong = []
    for line, mode in HOW.get(page, {}).items():
        if mode not in modes:
            continue
        for command in [*STAND_INS.get(line, []), line]:
            command = _as_run_here(command, tiny_official)
            code, out, err = _run_line(command, root, env, run_neoembed)
            if code != 0:
                wrong.append(f"{page}: {command}\n  exit {code}\n{out[-1500:]}\n{err[-3000:]}")
                return wrong
    if modes & {"run"} and (why := _run_python_blocks(page, root, tiny_official, env, run_neoembed)) is not None:
        return [why]
    left = [s for s in subprocess.run(
        ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.splitlines() if s.startswith("??")]
    if left:
        wrong.append(f"{page}: left files that git would show as untracked: {left}")
    return wrong


def python_blocks(page: str) -> list[str]:
    """The page's python blocks (own-data.md's runs in ``tests/test_own_data.py``, after the page's commands;
    integrations.md's needs LangChain and LlamaIndex, which are not test dependencies: ``benchmarks/integrations.py``
    runs it, and ``test_integrations_page_is_what_its_benchmark_runs`` checks that it finds the blocks)."""
    if page in ("own-data.md", "integrations.md"):
        return []
    path = REPO / page if page == "README.md" else REPO / "docs" / page
    return ["\n".join(lines) for language, lines in fenced_blocks(path.read_text(encoding="utf8")) if language == "python"]


def _run_python_blocks(page: str, root: Path, tiny_official: Path, env: dict, run_neoembed) -> str | None:
    """The page's python blocks in order in one fresh interpreter (as a reader's script runs them); None if they
    ran, else what failed."""
    blocks = python_blocks(page)
    if not blocks:
        return None
    for command in PYTHON_SETUP.get(page, []):
        code, _, err = _run_line(command, root, env, run_neoembed)
        if code != 0:
            return f"{page}: {command}\n  exit {code}\n{err[-3000:]}"
    code = PYTHON_PRELUDES.get(page, "") + "\n".join(blocks)
    for name, value in PYTHON_STAND_INS.items():
        code = code.replace(name, value.replace("{tiny_official}", str(tiny_official)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=_environment(), capture_output=True, text=True)
    return None if r.returncode == 0 else f"{page}: python blocks\n{code}\n{r.stderr[-3000:]}"


def _run_pages(modes: set[str], tmp_path, shared_dir, tiny_official, run_neoembed) -> None:
    """Every page with lines of ``modes`` or python blocks, one after the other (the lines that run in this
    interpreter change its working folder)."""
    pages = [page for page, how in HOW.items() if modes & set(how.values()) or python_blocks(page)]
    pages += [page.name for page in PAGES if page.name not in HOW and python_blocks(page.name)]
    env = _environment()
    wrong = [w for p in pages for w in _run_page(p, modes, tmp_path, shared_dir, tiny_official, env, run_neoembed)]
    assert not wrong, "\n\n".join(wrong)


def test_documented_commands_run_as_written(tmp_path, shared_dir, tiny_official, run_neoembed):
    pytest.importorskip("faiss")  # the pages that mine install it (test_install_lines_name_extras_that_exist)
    _run_pages({"run"}, tmp_path, shared_dir, tiny_official, run_neoembed)


@pytest.mark.slow
def test_documented_slow_commands_run_as_written(tmp_path, shared_dir, tiny_official, run_neoembed):
    pytest.importorskip("faiss")
    _run_pages({"run", "slow"}, tmp_path, shared_dir, tiny_official, run_neoembed)


def _hub_lines_offline(
    page: str, tmp_path: Path, shared: Path, tiny_official: Path, env: dict, run_neoembed
) -> list[str]:
    """The page's hub-only lines (a launcher's inner command) by bash, offline; returns what went wrong. A
    stand-in a line needs runs first and must succeed."""
    root, wrong = None, []
    for line, mode in HOW[page].items():
        if mode != "hub":
            continue
        root = root or _scratch_copy(tmp_path / page, shared)
        for command in [*STAND_INS.get(line, []), re.sub(r"^.*-m neoembed ", "neoembed ", line)]:
            code, out, err = _run_line(_as_run_here(command, tiny_official), root, env, run_neoembed)
            said = out + err
            if command not in line:  # a stand-in
                ok = code == 0
            else:
                # the hub named by a message written for it: the generic handler's "please report it" (an
                # unexpected error, whose text may mention the hub in passing) does not count
                ok = (
                    code in (1, 2)
                    and "hub" in said.lower()
                    and "Traceback" not in said
                    and "please report it" not in said
                )
            if not ok:
                wrong.append(f"{page}: {command}: exit {code}\n{said[-1500:]}")
    return wrong


def test_hub_only_commands_say_so_offline(tmp_path, shared_dir, tiny_official, run_neoembed):
    """Each page's hub-only lines, offline (the hub is unreachable here): each must stop with exit 1 or 2 and a
    message that names the hub, not a traceback."""
    pages = [page for page, how in HOW.items() if "hub" in how.values()]
    assert sum(list(how.values()).count("hub") for how in HOW.values()) >= 20
    env = _environment()
    wrong = [w for p in pages for w in _hub_lines_offline(p, tmp_path, shared_dir, tiny_official, env, run_neoembed)]
    assert not wrong, "\n\n".join(wrong)


def test_integrations_page_is_what_its_benchmark_runs():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from integrations import page_blocks
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    blocks = page_blocks()
    assert 'query_encode_kwargs={"prompt_name": "query"}' in blocks["LangChain"]
    assert "query_instruction=saved" in blocks["LlamaIndex"]
    for code in blocks.values():  # the names the benchmark compares with encode_query / encode_document
        compile(code, "integrations.md", "exec")
        assert all(name in code for name in ("question", "passages", "query_vector", "passage_vectors"))


def test_every_time_the_docs_quote_for_a_command_is_measured():
    """A documented line whose comment quotes a time on CPU, and the objective recipes whose times the prose
    quotes, are timed by benchmarks/doc_timings.py; the record holds each, and a comment's number is the record's
    (a changed command or a changed time needs the benchmark rerun)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from doc_timings import TIMED, timed_lines
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    record = json.loads((REPO / "benchmarks" / "results" / "doc_timings_cpu.json").read_text())
    measured = {row["command"]: row for row in record["rows"]}
    lines = timed_lines()
    assert len(lines) >= 8
    for page, command in lines:
        assert command in measured and measured[command]["exit"] == 0, (page, command)
    for page in sorted((REPO / "docs").glob("*.md")):
        for line in page.read_text(encoding="utf8").splitlines():
            quoted = re.search(r"# (\d+) s on 2 CPU cores", line)
            if quoted and TIMED.search(line):
                command = line.split("  #")[0].split(" # ")[0].strip()
                seconds = measured[command]["seconds"]  # one run: within a second or a fifth of it
                assert abs(int(quoted.group(1)) - seconds) <= max(1.0, 0.2 * seconds), (page.name, line, seconds)
