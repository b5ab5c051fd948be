"""The typed recipe loader, overrides, seeding, and run records."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from neoembed.recipe import Recipe, RecipeError, StrictModel, apply_overrides, load_recipe, seed_everything
from neoembed.record import write_run_record


class Optim(StrictModel):
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)


class Demo(Recipe):
    steps: int = 10
    optim: Optim = Optim()
    name: str = "demo"


def test_loads_yaml_and_applies_overrides(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("seed: 3\nsteps: 5\noptim:\n  lr: 0.001\n")
    r = load_recipe(f, Demo, ["optim.lr=2e-3", "steps=7", "name=x y"])
    assert (r.seed, r.steps, r.optim.lr, r.name) == (3, 7, 2e-3, "x y")
    with pytest.raises(ValidationError):
        r.steps = 3  # frozen


def test_unknown_keys_name_the_key_and_the_valid_ones(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("seed: 1\nstepz: 5\n")
    with pytest.raises(RecipeError, match=r"unknown key 'stepz'.*Valid keys here: name, optim, seed, steps"):
        load_recipe(f, Demo)
    with pytest.raises(RecipeError, match=r"unknown key 'optim.lrr'.*Valid keys here: betas, lr"):
        load_recipe({"seed": 1}, Demo, ["optim.lrr=0.1"])


def test_overrides_are_validated_like_the_file():
    with pytest.raises(RecipeError, match="'steps'"):
        load_recipe({"seed": 1}, Demo, ["steps=many"])
    with pytest.raises(RecipeError, match="missing required key 'seed'"):
        load_recipe({}, Demo)
    with pytest.raises(RecipeError, match="key.sub=value"):
        apply_overrides({}, ["nokey"])


def test_unknown_recipe_name_lists_shipped_ones():
    with pytest.raises(RecipeError, match="not found"):
        load_recipe("no-such-recipe", Demo)


def test_a_folder_given_as_the_recipe_names_its_recipes(tmp_path):
    """Walk T, 13: `neoembed train FOLDER` said "[Errno 21] Is a directory"."""
    (tmp_path / "mine.yaml").write_text("seed: 1\n")
    with pytest.raises(RecipeError, match=r"is a folder, not a recipe file: name a .yaml file \(it holds mine.yaml\)"):
        load_recipe(tmp_path, Demo)
    # a folder here named as a shipped recipe is not taken for it: ./glue/mrpc holds GLUE's data, and
    # `neoembed glue MRPC` (recipe glue/mrpc) said "glue/mrpc is a folder, not a recipe file" (walk Y)
    from neoembed.recipe import resolve_named_file

    (tmp_path / "glue" / "mrpc").mkdir(parents=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert resolve_named_file("glue/mrpc", "recipes").name == "mrpc.yaml"


def test_seed_everything_repeats_numbers():
    seed_everything(5)
    a = torch.rand(3)
    seed_everything(5)
    assert torch.equal(a, torch.rand(3))


def test_run_record(tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("hello")
    path = write_run_record(tmp_path, "test", recipe=load_recipe({"seed": 9}, Demo), data_files=[data])
    rec = json.loads(path.read_text())
    assert rec["seed"] == 9 and rec["recipe"]["optim"]["lr"] == 1e-4
    assert rec["data"][str(data)] == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert {"torch", "transformers", "neoembed"} <= set(rec["packages"])
    assert rec["hardware"]["cpu_count"] >= 1 and "git_sha" in rec


def test_cli_version_and_help():
    r = subprocess.run([sys.executable, "-m", "neoembed", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("neoembed ")
    from typer.testing import CliRunner

    from neoembed.cli import app

    r = CliRunner().invoke(app, ["convert", "--help"])  # in-process: one interpreter start is enough
    assert r.exit_code == 0 and "--to" in r.output


def test_recipe_kind_is_a_discriminated_union_read_after_the_overrides():
    from neoembed.cde.recipe import CDERecipe
    from neoembed.recipe import kind_union
    from neoembed.train.recipe import UnifiedRecipe

    kinds = kind_union(UnifiedRecipe, CDERecipe)
    assert isinstance(load_recipe("tiny", kinds), UnifiedRecipe)  # no kind: the first schema's
    assert isinstance(load_recipe("cde-tiny", kinds), CDERecipe)
    # the override decides the schema: tiny's unified-only keys are now unknown keys of the CDE recipe
    with pytest.raises(RecipeError, match=r"(?s)invalid CDERecipe.*unknown key 'pooling'"):
        load_recipe("tiny", kinds, ["kind=cde"])
    with pytest.raises(RecipeError, match=r"unknown key 'chunk_size'"):
        load_recipe("cde-tiny", kinds, ["kind=unified"])
    with pytest.raises(RecipeError, match="'unified', 'cde'"):
        load_recipe("tiny", kinds, ["kind=mlm"])


def test_one_rule_for_paths_in_a_recipe(tmp_path, monkeypatch):
    from neoembed.recipe import resolve_recipe_path

    recipe_dir = tmp_path / "recipes"
    (recipe_dir / "model").mkdir(parents=True)
    (tmp_path / "work" / "here").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_recipe_path("model", recipe_dir) == str(
        (recipe_dir / "model").resolve()
    )  # beside the recipe
    assert resolve_recipe_path("here", recipe_dir) == "here"  # the working directory first
    assert resolve_recipe_path("org/name", recipe_dir) == "org/name"  # a hub id stays
    assert resolve_recipe_path(str(tmp_path), recipe_dir) == str(tmp_path)


def test_one_optimizer_config_for_every_recipe():
    from neoembed.cde.recipe import CDERecipe
    from neoembed.pretrain.recipe import PretrainRecipe
    from neoembed.recipe import OptimizerConfig
    from neoembed.train.recipe import UnifiedRecipe

    for schema in (UnifiedRecipe, CDERecipe, PretrainRecipe):
        assert schema.model_fields["optimizer"].annotation is OptimizerConfig
    pre = load_recipe("pretrain-tiny", PretrainRecipe)
    assert pre.optimizer.weight_decay == 0.1
    with pytest.raises(RecipeError, match="schedule:"):  # pre-training's schedule has its own block
        load_recipe("pretrain-tiny", PretrainRecipe, ["optimizer.warmup_steps=10"])


def test_one_run_settings_block_for_every_training_recipe():
    """steps, precision, checkpoints, logging, trackers, output folder and keep_best are defined once (RunSettings)
    and stay top-level keys; a recipe only changes a default."""
    from neoembed.cde.recipe import CDERecipe
    from neoembed.pretrain.recipe import PretrainRecipe
    from neoembed.recipe import RunSettings
    from neoembed.train.recipe import UnifiedRecipe

    shared = set(RunSettings.model_fields)
    assert {"steps", "precision", "save_steps", "report_to", "output_dir", "keep_best"} <= shared
    for schema in (UnifiedRecipe, CDERecipe, PretrainRecipe):
        assert issubclass(schema, RunSettings)
        for key in shared:  # the type is the block's, whatever the default
            assert schema.model_fields[key].annotation == RunSettings.model_fields[key].annotation, key
    assert load_recipe("tiny", UnifiedRecipe, ["report_to=[tensorboard]"]).report_to == ["tensorboard"]
    assert PretrainRecipe.model_fields["precision"].default == "bf16"
    assert CDERecipe.model_fields["output_dir"].default == "runs/cde"
    with pytest.raises(RecipeError, match="report_to"):
        load_recipe("cde-tiny", CDERecipe, ["report_to=[comet]"])


@pytest.mark.parametrize(
    ("recipe", "override", "key"),
    [
        ("tiny", "alpha=nan", "alpha"),
        ("tiny", "alpha=-1e6", "alpha"),
        ("tiny", "temperature=inf", "temperature"),
        ("tiny", "temperature=1e-30", "temperature"),
        ("cde-tiny", "temperature=1000", "temperature"),
        ("tiny", "optimizer.lr=inf", "optimizer.lr"),
        ("tiny", "optimizer.betas=[2,0.5]", "optimizer.betas"),
        ("tiny", "seed=-1", "seed"),
        ("cde-tiny", "context.dropout=1.5", "context.dropout"),
        ("pretrain-tiny", "schedule.final_ratio=-0.1", "schedule.final_ratio"),
        ("tiny", "distillation.weight=inf", "distillation.weight"),
        ("tiny", "distillation.student_temperature=nan", "distillation.student_temperature"),
        ("tiny", "false_negatives.margin=nan", "false_negatives.margin"),
        ("tiny", "matryoshka={dims: [8], weights: [.inf]}", "matryoshka.weights"),
        ("cde-tiny", "matryoshka={dims: [8], weights: [.nan]}", "matryoshka.weights"),
        ("tiny", "adapter.alpha=inf", "adapter.alpha"),
        # pydantic reads true as 1 and false as 0 for a number: steps=true trained one step (#43, R8)
        ("tiny", "steps=true", "steps"),
        ("tiny", "optimizer.lr=true", "optimizer.lr"),
        ("cde-tiny", "steps=false", "steps"),
        ("pretrain-tiny", "batch.micro_batch_size=true", "batch.micro_batch_size"),
        # a packed-only key under padded rows was accepted and meant nothing (#43, T10)
        ("pretrain-tiny", "data={sources: [{path: x}], packing: padded, cross_document_attention: true}", "data"),
    ],
)
def test_bad_numbers_are_refused_by_key_before_anything_loads(recipe, override, key):
    from neoembed.cde.recipe import CDERecipe
    from neoembed.pretrain.recipe import PretrainRecipe
    from neoembed.train.recipe import UnifiedRecipe

    schema = {"tiny": UnifiedRecipe, "cde-tiny": CDERecipe, "pretrain-tiny": PretrainRecipe}[recipe]
    with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
        load_recipe(recipe, schema, [override])


def test_an_error_of_an_override_names_the_override_beside_the_file():
    """A check of #43's fixes: `train tiny steps=true` said "invalid UnifiedRecipe in .../tiny.yaml", sending the
    reader to a file that is fine; the overrides the value came from are named too."""
    from neoembed.train.recipe import UnifiedRecipe

    with pytest.raises(RecipeError, match=r"invalid UnifiedRecipe in .*tiny\.yaml with seed=0 steps=true:"):
        load_recipe("tiny", UnifiedRecipe, ["seed=0", "steps=true"])


CONFIG_MODULES = (
    "neoembed.config",
    "neoembed.recipe",
    "neoembed.losses.config",
    "neoembed.card_schema",
    "neoembed.train.recipe",
    "neoembed.cde.recipe",
    "neoembed.pretrain.recipe",
    "neoembed.mine.settings",
    "neoembed.eval.config",
    "neoembed.glue.run",
)


@pytest.mark.parametrize("module", CONFIG_MODULES)
def test_every_config_refuses_nan_and_inf(module):
    """One rule for every typed config: a NaN or infinite number is refused where it is read, never trained on."""
    import importlib

    from pydantic import BaseModel

    mod = importlib.import_module(module)
    configs = [
        c
        for c in vars(mod).values()
        if isinstance(c, type) and issubclass(c, BaseModel) and c.__module__ == module
    ]
    assert configs
    assert [c.__name__ for c in configs if c.model_config.get("allow_inf_nan") is not False] == []


def test_a_card_schema_refuses_nan():
    from neoembed.card_schema import _Strict

    class Scored(_Strict):
        threshold: float = 0.0

    assert issubclass(_Strict, StrictModel)
    with pytest.raises(ValidationError, match="finite"):
        Scored(threshold=float("nan"))


def test_neoembed_commit_names_a_copy_whose_git_is_not_its_own(monkeypatch, tmp_path):
    """The GPU machine receives the working tree beside a stale .git: the commit the tree was made from
    (NEOEMBED_COMMIT, written by benchmarks/gpu_wheels.sh) is what run records and benchmark headers name."""
    from neoembed.record import git_sha

    monkeypatch.delenv("NEOEMBED_COMMIT", raising=False)
    assert git_sha(tmp_path) is None  # no checkout there
    monkeypatch.setenv("NEOEMBED_COMMIT", "2808c1481f870bfde9c5e88cbead639e19d6dc6b")
    assert git_sha(tmp_path) == git_sha() == "2808c1481f870bfde9c5e88cbead639e19d6dc6b"


def test_a_benchmark_rewriting_its_own_record_leaves_the_tree_clean(monkeypatch, tmp_path):
    """Records are written as a run goes: a rewritten record is not a change to the code that made it, while any
    other tracked change still marks the tree dirty."""
    import subprocess

    from neoembed.record import git_sha

    monkeypatch.delenv("NEOEMBED_COMMIT", raising=False)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "x_cpu.md").write_text("first rows\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git = ["git", "-C", str(tmp_path), "-c", "user.email=t@t", "-c", "user.name=t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "x"]):
        subprocess.run(git + args, check=True)
    sha = git_sha(tmp_path)
    (tmp_path / "benchmarks" / "results" / "x_cpu.md").write_text("first rows\nmore rows\n")
    assert git_sha(tmp_path) == sha and not sha.endswith("-dirty")
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_sha(tmp_path) == sha + "-dirty"


def _string_constants(tree) -> list:
    """Every string constant of a module that is not a docstring."""
    import ast

    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def test_one_function_writes_run_record_json():
    """Only neoembed.record names the file, and only its _write_record writes it: the unified trainer, the run
    loop, GLUE, mteb and the holdout all go through write_run_record / add_to_run_record."""
    import ast
    from pathlib import Path

    import neoembed
    from neoembed import record

    package = Path(neoembed.__file__).parent
    naming = [
        str(f.relative_to(package))
        for f in package.rglob("*.py")
        # the file's name as a value (a path or part of one), not a mention in a message
        if any(
            c.value.split("/")[-1] == "run_record.json" for c in _string_constants(ast.parse(f.read_text()))
        )
    ]
    assert naming == ["record.py"]
    writers = [
        fn.name
        for fn in ast.walk(ast.parse(Path(record.__file__).read_text()))
        if isinstance(fn, ast.FunctionDef)
        and any(
            isinstance(c, ast.Call) and getattr(c.func, "id", None) == "atomic_write_text"
            for c in ast.walk(fn)
        )
    ]
    assert writers == ["_write_record"]


def test_add_to_run_record_keeps_what_is_there(tmp_path):
    from neoembed.record import add_to_run_record

    add_to_run_record(tmp_path, {"keep_best": 1})  # no record yet: nothing written
    assert not (tmp_path / "run_record.json").exists()
    write_run_record(tmp_path, "train", extra={"a": 1})
    add_to_run_record(tmp_path, {"keep_best": {"step": 4}})
    saved = json.loads((tmp_path / "run_record.json").read_text())
    assert saved["a"] == 1 and saved["keep_best"] == {"step": 4} and saved["command"] == "train"
