"""Trackers of the unified trainer (``report_to``): MLflow against a local file store and TensorBoard event files,
read back; a resumed run continues the same tracked run without logging a step twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neoembed.recipe import load_recipe
from neoembed.runs import TrainingInterrupted, check_trackers
from neoembed.train import trainer as trainer_mod
from neoembed.train.recipe import UnifiedRecipe
from neoembed.train.trainer import train

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"


def _interrupted_then_resumed(recipe, monkeypatch, sigterm_at, at: int = 2) -> None:
    real = trainer_mod.unified_step
    sigterm_at(trainer_mod, "unified_step", at)
    with pytest.raises(TrainingInterrupted):
        train(recipe, recipe_dir=TINY.parent)
    monkeypatch.setattr(trainer_mod, "unified_step", real)
    train(recipe, recipe_dir=TINY.parent, resume=True)


def _tensorboard_scalars(folder: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[int, float] = {}
    for run in sorted({events.parent for events in folder.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(run))  # a run folder's event files read together, as TensorBoard reads them
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            for e in acc.Scalars(tag):
                assert e.step not in found, f"step {e.step} logged twice to TensorBoard"
                found[e.step] = e.value
    return found


def test_mlflow_file_store_and_tensorboard_read_back_across_a_resume(
    tmp_path, tiny_official, monkeypatch, sigterm_at, caplog
):
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow >= 3.10 asks for it to use a file store
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    out = tmp_path / "tracked"
    recipe = load_recipe(
        TINY,
        UnifiedRecipe,
        [
            f"model={tiny_official}",
            f"output_dir={out}",
            "datasets=[{card: pydoc_names, max_rows: 64}]",
            "save_steps=100",
            "report_to=[mlflow, tensorboard]",
        ],
    )
    with caplog.at_level("WARNING"):
        _interrupted_then_resumed(recipe, monkeypatch, sigterm_at)
    losses = {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert sorted(losses) == list(range(1, 9))
    assert "attempting to log a value" not in caplog.text  # a row's dataset name is text: not an MLflow metric
    client = MlflowClient(uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1 and runs[0].info.run_name == "tracked"  # one tracked run, continued
    saved = json.loads((out / "trackers.json").read_text())
    assert runs[0].info.run_id == saved["mlflow"]
    assert saved["mlflow_tracking_uri"] == uri  # the store the run was logged to, for a resume to check
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    steps = [m.step for m in history]
    assert sorted(steps) == list(range(1, 9)), steps  # every step once
    assert {m.step: m.value for m in history} == pytest.approx(losses, rel=1e-6)
    assert _tensorboard_scalars(out, "train/loss") == pytest.approx(losses, rel=1e-6)
    # the recipe as hyperparameters, the run loop's keys, once (the resume adds none: MLflow would refuse)
    params = runs[0].data.params
    assert (
        params["recipe.optimizer.lr"] == str(recipe.optimizer.lr) and params["recipe.temperature"] == "0.07"
    )
    assert json.loads(params["recipe.datasets"])[0]["card"] == "pydoc_names"
    assert params["recipe.max_length"] == str(recipe.max_length)  # apart from the model config's max_length
    hparams = _tensorboard_hparams(out)
    assert hparams["recipe.optimizer.lr"].number_value == pytest.approx(recipe.optimizer.lr)
    assert json.loads(hparams["recipe.report_to"].string_value) == ["mlflow", "tensorboard"]


def _tensorboard_hparams(folder: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    found = []
    for run in sorted({events.parent for events in folder.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(run))  # a run folder's event files read together, as TensorBoard reads them
        acc.Reload()
        try:
            content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        except KeyError:  # an event file without hyperparameters (a resumed run's)
            continue
        found.append(plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams)
    assert len(found) == 1, f"{len(found)} hyperparameter records"
    return found[0]


def test_a_named_tracker_that_is_not_installed_fails_before_anything_loads(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(ImportError, match=r"pip install -e '\.\[wandb\]'"):
        check_trackers(["mlflow", "wandb"])
    recipe = load_recipe(
        TINY, UnifiedRecipe, ["model=does-not-exist", f"output_dir={tmp_path}", "report_to=[wandb]"]
    )
    with pytest.raises(ImportError, match="wandb"):  # before the (missing) model or any data is touched
        train(recipe, recipe_dir=TINY.parent)
    with pytest.raises(Exception, match="trackio"):
        load_recipe(TINY, UnifiedRecipe, ["report_to=[neptune]"])


def test_recipe_hyperparameters_reach_wandb_once_and_trackio_on_every_start(tmp_path):
    """W&B keeps a resumed run's config, Trackio starts it anew: the recipe goes to W&B at the first start and to
    Trackio at every start (the offline runs themselves: benchmarks/trackers_offline.py)."""
    from types import SimpleNamespace

    from neoembed.loop import RunLoop

    class Tracker:
        def __init__(self, name):
            self.name, self.config = name, {}

        def store_init_configuration(self, values):
            self.config.update(values)

    recipe = load_recipe(TINY, UnifiedRecipe, [f"output_dir={tmp_path}"])
    loop = RunLoop.__new__(RunLoop)
    loop.recipe, loop.metrics = recipe, SimpleNamespace(hyperparameters=lambda values: None)
    for step in (0, 4):  # a first start, then a resume
        loop.step, loop.trackers = step, [Tracker("wandb"), Tracker("trackio")]
        loop.log_hyperparameters()
        wandb, trackio = loop.trackers
        assert trackio.config["recipe.temperature"] == recipe.temperature
        assert ("recipe.temperature" in wandb.config) == (step == 0)
    fresh = Tracker("mlflow")
    fresh.continued = False  # a resume's new MLflow run (its id deleted from trackers.json) gets the recipe
    loop.trackers = [fresh]
    loop.log_hyperparameters()
    assert fresh.config["recipe.temperature"] == recipe.temperature


def _main(monkeypatch, capsys, *argv) -> tuple[int, str]:
    """``neoembed ARGV`` in this process through the command line's own error handling: (exit code, stderr)."""
    import sys

    from neoembed.cli import main

    monkeypatch.setattr(sys, "argv", ["neoembed", *argv])
    with pytest.raises(SystemExit) as done:
        main()
    return done.value.code, capsys.readouterr().err


def _no_model_loads(monkeypatch):
    import transformers

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the trackers were checked")

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)


def test_named_tracker_not_installed_names_the_extra(monkeypatch, capsys, tmp_path, tiny_official):
    """A tracker named in report_to but not installed used to end as exit 1 "ImportError ... please report it";
    it is bad input (exit 2), naming the extra to install, before the model loads."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    _no_model_loads(monkeypatch)
    overrides = [f"model={tiny_official}", f"output_dir={tmp_path / 'run'}", "report_to=[wandb]"]
    code, err = _main(monkeypatch, capsys, "train", str(TINY), *overrides)
    assert code == 2, err
    assert "report_to: [wandb] needs the wandb package" in err and "neoembed's [wandb] extra" in err
    assert "please report it" not in err and not (tmp_path / "run" / "model.safetensors").exists()
    # GLUE too, before its data and model load (a walk's t7: transformers' load report came first)
    glue = ["glue", "MRPC", "--model", str(tiny_official), "--data-dir", "no-such-folder", "report_to=[wandb]"]
    code, err = _main(monkeypatch, capsys, *glue, "--out", str(tmp_path / "glue"))
    assert code == 2 and "report_to: [wandb] needs the wandb package" in err, err
    assert not (tmp_path / "glue").exists()


def test_mlflow_store_the_extra_cannot_write_fails_before_the_model_loads(monkeypatch, capsys, tmp_path):
    """mlflow-skinny 3.x (the [mlflow] extra) defaults to a sqlite store it cannot open (no sqlalchemy), and a
    local folder store needs MLFLOW_ALLOW_FILE_STORE=true: both used to fail after the model had loaded."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "sqlalchemy" else real(n, *a))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    _no_model_loads(monkeypatch)
    import mlflow

    model = TINY.parent / "tiny" / "model"  # a model that exists (and does not load): the store is what fails
    overrides = [f"model={model}", f"output_dir={tmp_path / 'run'}", "report_to=[mlflow]"]
    if _scheme(mlflow.get_tracking_uri()) == "sqlite":  # mlflow >= 3.7's default
        code, err = _main(monkeypatch, capsys, "train", str(TINY), *overrides)
        assert code == 2 and "is a database store" in err and "MLFLOW_ALLOW_FILE_STORE=true" in err, err
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    if hasattr(
        mlflow.environment_variables, "MLFLOW_ALLOW_FILE_STORE"
    ):  # mlflow >= 3.10 gates a folder store
        code, err = _main(monkeypatch, capsys, "train", str(TINY), *overrides)
        assert code == 2 and "writes only with MLFLOW_ALLOW_FILE_STORE=true" in err, err
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_trackers(["mlflow"])  # the documented setting passes


def _scheme(uri: str) -> str:
    from urllib.parse import urlparse

    return urlparse(uri).scheme


def _closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_mlflow_server_fails_in_seconds_before_the_model_loads(monkeypatch, capsys, tmp_path):
    """A tracking server that does not answer used to fail once the model had loaded, after minutes of
    mlflow's retries, as an unexpected error (exit 1); it is refused at once (exit 2), naming the URI and the
    fix."""
    import os
    import time

    uri = f"http://127.0.0.1:{_closed_port()}/"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    _no_model_loads(monkeypatch)
    model = TINY.parent / "tiny" / "model"
    overrides = [f"model={model}", f"output_dir={tmp_path / 'run'}", "report_to=[mlflow]"]
    start = time.perf_counter()
    code, err = _main(monkeypatch, capsys, "train", str(TINY), *overrides)
    assert code == 2, err
    assert time.perf_counter() - start < 15, "the check waited on mlflow's retries"
    assert f"the tracking server {uri} (MLFLOW_TRACKING_URI) could not be reached" in err, err
    assert "Start the server" in err and "set MLFLOW_TRACKING_URI" in err and "please report it" not in err
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # the check's quick settings are put back


def _run_folder_tracked_in(tmp_path, store: str) -> tuple[Path, str]:
    """A run folder whose trackers.json continues an MLflow run logged to the folder store ``store``."""
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / store).as_uri()
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("neoembed-test")).info.run_id
    out = tmp_path / "run"
    out.mkdir()
    (out / "trackers.json").write_text(json.dumps({"mlflow": run_id, "mlflow_tracking_uri": uri}))
    return out, run_id


def test_resume_with_another_mlflow_store_is_refused_naming_both_stores(monkeypatch, capsys, tmp_path):
    """A resume whose MLflow run is not in the current store used to end in "Run '...' not found ... please
    report it" once the model had loaded; it is refused first (exit 2), naming the run, the store it was
    logged to, the current store and both fixes."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    out, run_id = _run_folder_tracked_in(tmp_path, "mlA")
    other = (tmp_path / "mlB").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other)
    _no_model_loads(monkeypatch)
    model = TINY.parent / "tiny" / "model"
    overrides = [f"model={model}", f"output_dir={out}", "report_to=[tensorboard, mlflow]"]
    code, err = _main(monkeypatch, capsys, "train", str(TINY), *overrides, "--resume")
    assert code == 2, err
    assert f"MLflow run {run_id}" in err and f"current tracking store {other}" in err, err
    assert f"set MLFLOW_TRACKING_URI={(tmp_path / 'mlA').as_uri()}" in err, err
    assert f'delete the "mlflow" entry of {out / "trackers.json"}' in err and "please report it" not in err
    from neoembed.runs import check_mlflow_resume

    (out / "trackers.json").write_text(json.dumps({"mlflow": run_id}))  # written before the store was kept
    with pytest.raises(ValueError, match=r"logged to another store \(not recorded\)"):
        check_mlflow_resume(out)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlA").as_uri())
    check_trackers(["mlflow"], out, resume=True)  # back in its store, the run continues


def test_unreadable_trackers_json_on_resume_is_named(monkeypatch, capsys, tmp_path):
    """A damaged trackers.json used to stop a resume with json's bare "Expecting value: line 2 column 1",
    naming no file; the file is named, with the fix."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    out = tmp_path / "run"
    out.mkdir()
    (out / "trackers.json").write_text('{"mlflow":\n')
    _no_model_loads(monkeypatch)
    model = TINY.parent / "tiny" / "model"
    overrides = [f"model={model}", f"output_dir={out}", "report_to=[mlflow]"]
    code, err = _main(monkeypatch, capsys, "train", str(TINY), *overrides, "--resume")
    assert code == 2, err
    assert f"{out / 'trackers.json'} is unreadable" in err and "delete it" in err, err
