"""The shipped tiny recipes run from an installed wheel, with nothing of the source tree or ../shared on disk.

The wheel is built from this checkout without network (``pip wheel --no-build-isolation --no-index``: the build
backend, hatchling, comes with the ``dev`` extra), installed with ``--no-deps`` into a fresh virtual environment that
sees this environment's packages (torch, transformers, ...) behind its own, and ``neoembed train tiny``,
``neoembed train cde-tiny`` and ``neoembed pretrain pretrain-tiny`` run from an empty folder outside the repository,
with PYTHONPATH cleared so that the wheel's neoembed, not this checkout's, is the one imported.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY_ASSETS_MAX_BYTES = (
    650_000  # model, tokenizer, rows, cards, shards and licence of the tiny recipes, uncompressed
)


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


def _build_wheel(dist: Path) -> Path:
    try:
        import hatchling  # noqa: F401
    except ImportError:
        pytest.fail("the wheel test builds without network and needs hatchling: pip install -e '.[dev]'")
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    _run([*pip, "-w", dist, REPO])
    (wheel,) = dist.glob("neoembed-*.whl")
    return wheel


def _venv_with(wheel: Path, root: Path) -> tuple[Path, dict]:
    """A fresh venv with the wheel installed; this environment's site-packages come after its own."""
    env_dir = root / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", env_dir])
    python = env_dir / "bin" / "python"
    child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    child_env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{child_env.get('PATH', '')}"
    # pip alone on the path, so that the install neither sees nor touches this environment's neoembed
    import pip

    pip_only = root / "pip_only"
    pip_only.mkdir()
    (pip_only / "pip").symlink_to(Path(pip.__file__).parent)
    install = [python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--disable-pip-version-check"]
    _run([*install, wheel], env={**child_env, "PYTHONPATH": str(pip_only)})
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([python, "-c", purelib]).stdout.strip())
    parents = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in parents)
    (site / "zz_parent_env.pth").write_text(lines)
    return python, child_env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("wheel")
    wheel = _build_wheel(root / "dist")
    python, env = _venv_with(wheel, root)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(root / "hf-datasets"))
    env.update(TOKENIZERS_PARALLELISM="false")
    return wheel, python, env, root


def test_the_wheel_ships_the_tiny_recipes_with_their_model_rows_cards_and_licence(installed):
    wheel = installed[0]
    tiny = "neoembed/recipes/tiny/"
    with zipfile.ZipFile(wheel) as z:
        sizes = {i.filename: i.file_size for i in z.infolist()}
        licence = z.read(tiny + "LICENSE-PSF.txt").decode()
    for name in (
        "recipes/tiny.yaml",
        "recipes/cde-tiny.yaml",
        "recipes/pretrain-tiny.yaml",
        "data_cards/agnews.yaml",
    ):
        assert f"neoembed/{name}" in sizes, name
    cards = ("pydoc_names", "pydoc_details", "pydoc_signatures")
    model = (
        "model/config.json",
        "model/model.safetensors",
        "model/tokenizer.json",
        "model/tokenizer_config.json",
    )
    for name in (
        *model,
        *(f"cards/{c}.yaml" for c in cards),
        *(f"rows/{c}.jsonl" for c in cards),
        "shards/meta.json",
        "shards/shard-00000.tokens.npy",
        "shards/shard-00000.offsets.npy",
        "README.md",
    ):
        assert tiny + name in sizes, name
    assert "PYTHON SOFTWARE FOUNDATION LICENSE" in licence
    assert sum(s for n, s in sizes.items() if n.startswith(tiny)) < TINY_ASSETS_MAX_BYTES


def test_tiny_cde_tiny_and_pretrain_tiny_train_from_the_installed_wheel_outside_the_source_tree(installed):
    _, python, env, root = installed
    find = "import importlib.util; print(importlib.util.find_spec('neoembed').origin)"  # without importing it
    where = _run([python, "-c", find], env=env, cwd=root).stdout.strip()
    assert Path(where).is_relative_to(root / "venv"), where  # the wheel's neoembed, not this checkout's
    work = root / "work"
    work.mkdir()
    # the runs at once, one thread each: each is mostly imports and model loading, and the models are tiny
    runs = {
        "tiny": [python.parent / "neoembed", "train", "tiny"],
        "cde-tiny": [python.parent / "neoembed", "train", "cde-tiny", "steps=2", "save_steps=100"],
        "pretrain-tiny": [python.parent / "neoembed", "pretrain", "pretrain-tiny", "steps=4"],
    }
    logs = {name: root / f"{name}.log" for name in runs}  # files, not pipes: a full pipe would stall a run
    procs = {}
    for name, cmd in runs.items():
        with open(logs[name], "w") as log:
            procs[name] = subprocess.Popen(
                [str(c) for c in cmd], cwd=work, env={**env, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=log
            )
    for name, proc in procs.items():
        proc.wait(timeout=300)
        assert proc.returncode == 0, f"{name} failed:\n{logs[name].read_text()[-4000:]}"
    tiny = work / "runs" / "tiny"
    assert (tiny / "model.safetensors").is_file() and (tiny / "checkpoint-8").is_dir()
    assert len((tiny / "metrics.jsonl").read_text().splitlines()) == 8
    record = json.loads((tiny / "run_record.json").read_text())
    assert set(record["cards"]) == {"pydoc_names", "pydoc_details", "pydoc_signatures"}
    # the shipped model, read from the installed package
    assert Path(record["recipe"]["model"]).is_relative_to(root / "venv"), record["recipe"]["model"]
    assert "PSF-2.0" in (tiny / "README.md").read_text()
    cde = work / "runs" / "cde-tiny"
    assert (cde / "cde_head.safetensors").is_file() and (cde / "first_stage").is_dir()
    assert len((cde / "metrics.jsonl").read_text().splitlines()) == 2
    cde_model = json.loads((cde / "run_record.json").read_text())["recipe"]["model"]
    assert Path(cde_model).is_relative_to(root / "venv"), cde_model
    pre = work / "runs" / "pretrain-tiny"
    rows = [json.loads(line) for line in (pre / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    assert abs(rows[0]["loss"] - math.log(1500)) < 0.1  # ln |V| of the shipped tokenizer
    pre_recipe = json.loads((pre / "run_record.json").read_text())["recipe"]
    for used in (pre_recipe["tokenizer"], pre_recipe["data"]["sources"][0]["path"]):
        assert Path(used).is_relative_to(root / "venv"), used  # the shipped tokenizer and shards
