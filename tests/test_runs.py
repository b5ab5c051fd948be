"""Runs that lose nothing: output folders, checkpoints that survive a kill or a full disk, exit codes, bad input
reported before any model loads, degenerate training, one model per results folder.

The numbered cases and the "poor" cases of issue #16 each have a test of their own (``test_case_N_...`` and
``test_poor_...``). Training runs use the tiny fixture and 4 steps; the fault injections run the trainer in a
forked child (no interpreter start-up) that an audit hook kills at a seeded point of a checkpoint write.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import resource
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from neoembed.recipe import load_recipe
from neoembed.runs import (
    CHECKPOINT_MARKER,
    MODEL_RECORD,
    CheckpointWriteError,
    MetricsLog,
    OutputDirError,
    check_output_flags,
    check_pairs,
    check_weight_files,
    claim_results_dir,
    commit_checkpoint,
    default_results_dir,
    find_resume_checkpoint,
    list_checkpoints,
    lock_path,
    output_lock,
    prepare_output_dir,
    resume_defaults,
    resume_settings,
    stage_checkpoint,
    trim_metrics,
    verify_checkpoint,
)
from neoembed.train.recipe import UnifiedRecipe
from neoembed.train.trainer import train

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny.yaml"
RUN = ("steps=4", "save_steps=2", "datasets=[{card: pydoc_names, max_rows: 48}]")


def _recipe(out: Path, model: Path, *overrides: str):
    return load_recipe(TINY, UnifiedRecipe, [f"model={model}", f"output_dir={out}", *RUN, *overrides])


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")
    }


def _cli(capsys, monkeypatch, *args: str) -> tuple[int, str]:
    """``neoembed ARGS`` in this process (no interpreter start-up): the exit code and stderr + stdout."""
    from neoembed.cli import main

    monkeypatch.setattr(sys, "argv", ["neoembed", *args])
    monkeypatch.delenv("NEOEMBED_DEBUG", raising=False)
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    return e.value.code, out.err + out.out


# -------------------------------------------------------------------------------------- fault injection
_AUDIT = {"active": False, "count": 0, "kill_at": None, "seed": 0, "after": None, "hook": False, "out": None}
_WATCHED = {"open", "os.rename", "os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree", "os.truncate"}


def _audit(event, args):
    """Counts the file operations on checkpoint paths; at the chosen one, tears the file being written in the
    staging folder to a seeded fraction (a kill in the middle of a write) and SIGKILLs the process."""
    if not _AUDIT["active"] or event not in _WATCHED or not any("checkpoint" in str(a) for a in args):
        return
    _AUDIT["count"] += 1
    if _AUDIT["after"] is not None:
        _AUDIT["after"](event, args)
    if _AUDIT["count"] == _AUDIT["kill_at"]:
        staged = [p for p in Path(_AUDIT["out"]).glob(".checkpoint-*.partial/**/*") if p.is_file()]
        if staged:
            latest = max(staged, key=lambda p: p.stat().st_mtime_ns)
            fraction = np.random.default_rng(_AUDIT["seed"]).random()
            os.truncate(latest, int(latest.stat().st_size * fraction))
        os.kill(os.getpid(), signal.SIGKILL)


def _install_audit():
    if not _AUDIT["hook"]:
        sys.addaudithook(_audit)  # cannot be removed: inactive (one dict lookup) outside these tests
        _AUDIT["hook"] = True


def _limit_file_size_after_checkpoint_2(event, args):
    """A full disk from the moment checkpoint-2 is published: no file may grow past 64 KiB."""
    if event == "os.rename" and str(args[1]).endswith("checkpoint-2"):
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _child(out: Path, model: Path, kill_at: int | None, seed: int, full_disk: bool) -> None:
    """In a child process: the tiny run in ``out`` under the audit hook; an exception is written to a file."""
    after = _limit_file_size_after_checkpoint_2 if full_disk else None
    _AUDIT.update(active=True, count=0, kill_at=kill_at, seed=seed, out=out, after=after)
    _install_audit()
    try:
        train(_recipe(out, model), recipe_dir=TINY.parent)
    except BaseException as e:  # noqa: BLE001 - reported through a file and the exit code
        Path(out, "child_error.txt").write_text(f"{type(e).__name__}: {e}")
        os._exit(3)
    os._exit(0)


def _in_child(*args) -> int:
    """Run :func:`_child` in a process forked from a forkserver (which has imported the trainer but never run
    OpenMP: a child forked from this process would hang in libgomp); returns its exit code (-9: SIGKILL)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["neoembed.train.trainer"])
    proc = ctx.Process(target=_child, args=args)
    proc.start()
    proc.join(600)
    return proc.exitcode


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_official):
    """An uninterrupted 4-step run (checkpoints 2 and 4, final model), and how many checkpoint file operations
    it made (the range the kills are drawn from)."""
    _install_audit()
    out = tmp_path_factory.mktemp("runs") / "finished"
    _AUDIT.update(active=True, count=0, kill_at=None, out=out)
    try:
        train(_recipe(out, tiny_official), recipe_dir=TINY.parent)
    finally:
        _AUDIT["active"] = False
    return out, _AUDIT["count"]


def _same_weights(a: Path, b: Path) -> None:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sigkill_during_a_checkpoint_write_then_resume_equals_uninterrupted(
    tmp_path, tiny_official, finished, seed
):
    ref, n_events = finished
    out = tmp_path / "killed"
    kill_at = int(np.random.default_rng(seed).integers(1, n_events + 1))
    assert _in_child(out, tiny_official, kill_at, seed, False) == -signal.SIGKILL, kill_at
    complete = [c for c in list_checkpoints(out) if verify_checkpoint(c) is None]
    if complete:
        train(_recipe(out, tiny_official), recipe_dir=TINY.parent, resume=True)
    else:  # killed inside the first checkpoint: nothing to resume, and --resume says so
        with pytest.raises(OutputDirError, match="no complete checkpoint"):
            train(_recipe(out, tiny_official), recipe_dir=TINY.parent, resume=True)
        train(_recipe(out, tiny_official), recipe_dir=TINY.parent, overwrite=True)
    _same_weights(out, ref)
    assert _steps(out) == [1, 2, 3, 4]  # every step logged once
    assert not list(out.glob(".checkpoint-*"))  # no staging folder left


def test_a_run_stopped_before_its_first_checkpoint_names_the_fix_that_works(tmp_path):
    """#43 walk, A6 and A13: a run stopped before its first checkpoint (a second Ctrl-C; a full disk at the first
    save, whose error said "--resume") left its record and metrics. Started again it was refused with "pass
    --resume", and --resume with "holds no complete checkpoint": each message named the other. Both now name
    --overwrite, which works."""
    from neoembed.runs.checkpoints import write_failed

    out = tmp_path / "run"
    staged = stage_checkpoint(out, 2)
    (out / "run_record.json").write_text(json.dumps({"command": "neoembed train tiny"}))
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    error = str(write_failed(staged, 2, OSError(28, "No space left on device")))
    assert "No checkpoint was written before it" in error and "start again with --overwrite" in error, error
    assert "--resume" not in error
    with pytest.raises(OutputDirError, match="stopped before its first checkpoint.*pass --overwrite"):
        prepare_output_dir(out, overwrite=False, resume=False, main_process=True)
    with pytest.raises(OutputDirError, match="no complete checkpoint"):
        prepare_output_dir(out, overwrite=False, resume=True, main_process=True)
    prepare_output_dir(out, overwrite=True, resume=False, main_process=True)  # the fix named: it clears
    assert not any(out.iterdir())
    # a command that keeps no checkpoints (mine resumes from its shards) keeps the usual message
    (out / "run_record.json").write_text("{}")
    with pytest.raises(OutputDirError, match="pass --resume to continue"):
        prepare_output_dir(out, overwrite=False, resume=False, checkpoints=False, main_process=True)
    # the refusals name the run the folder holds: a GLUE --out pointed at a pre-training run said neither
    (out / "run_record.json").write_text(json.dumps({"command": "pretrain", "resume_settings": {"lr": 1}}))
    with pytest.raises(OutputDirError, match=r"is not empty \(it holds a pretrain run: run_record.json\)"):
        prepare_output_dir(out, overwrite=False, resume=False, checkpoints=False, main_process=True)
    with pytest.raises(OutputDirError, match=r"holds a different run \(a pretrain run\)"):
        prepare_output_dir(out, overwrite=False, resume=True, settings={"lr": 2}, main_process=True)
    # a command neither resumes nor clears another command's run: glue --out PRETRAIN_RUN --overwrite deleted it
    other = "holds a pretrain run .*, not a glue run: choose a new --out"
    for overwrite, resume in ((True, False), (False, True)):
        flags = {"command": "glue", "what": "--out", "overwrite": overwrite, "resume": resume}
        with pytest.raises(OutputDirError, match=other):
            prepare_output_dir(out, main_process=True, **flags)
        with pytest.raises(OutputDirError, match=other):
            check_output_flags(out, **flags)
    assert (out / "run_record.json").is_file()
    (out / "run_record.json").write_text(json.dumps({"command": "train-cde"}))  # neoembed train's, CDE recipe
    prepare_output_dir(out, command="train", overwrite=True, resume=False, main_process=True)
    assert not any(out.iterdir())


def test_poor_full_disk_during_a_checkpoint_leaves_the_previous_one_intact(tmp_path, tiny_official, finished):
    """RLIMIT_FSIZE (a file may not grow past 64 KiB) set once checkpoint-2 is published: checkpoint-4's weights
    cannot be written. The run ends with a clear error naming checkpoint-2, which resumes to the same model."""
    ref, _ = finished
    out = tmp_path / "full"

    assert _in_child(out, tiny_official, None, 0, True) == 3
    error = (out / "child_error.txt").read_text()
    (out / "child_error.txt").unlink()
    assert error.startswith(CheckpointWriteError.__name__) and "checkpoint-4" in error
    assert "File too large" in error and str(out / "checkpoint-2") in error and "intact" in error
    assert [c.name for c in list_checkpoints(out)] == ["checkpoint-2"] and verify_checkpoint(
        out / "checkpoint-2"
    ) is None
    assert not list(out.glob(".checkpoint-*"))
    train(_recipe(out, tiny_official), recipe_dir=TINY.parent, resume=True)
    _same_weights(out, ref)


# ------------------------------------------------------------------------------------------- numbered cases
def test_case_1_a_finished_run_is_not_replaced_without_a_flag(
    tmp_path, tiny_official, finished, capsys, monkeypatch
):
    ref, _ = finished
    before = _snapshot(ref)
    code, err = _cli(
        capsys, monkeypatch, "train", str(TINY), f"model={tiny_official}", f"output_dir={ref}", "steps=3"
    )
    assert code == 2 and "is not empty" in err and "--resume" in err and "--overwrite" in err
    assert "Traceback" not in err and _snapshot(ref) == before  # nothing deleted, rotated or added


@pytest.mark.parametrize("trainer", ["train", "cde", "pretrain"])
def test_a_used_folder_or_nothing_to_resume_is_refused_before_the_data_is_read(tmp_path, monkeypatch, trainer):
    """The flags against the folder need no run settings: each trainer says them before it reads its data (a
    card of millions of rows takes minutes to prepare), where it used to say them after."""
    import importlib

    from neoembed.cde.recipe import CDERecipe
    from neoembed.pretrain.recipe import PretrainRecipe

    module, reads, recipe_file, kind, run = {
        "train": ("neoembed.train.trainer", "_training_data", TINY, UnifiedRecipe, "train"),
        "cde": ("neoembed.cde.trainer", "prepare_sources", REPO / "recipes" / "cde-tiny.yaml", CDERecipe, "train_cde"),
        "pretrain": (
            "neoembed.pretrain.trainer", "_open_sources", REPO / "recipes" / "pretrain-tiny.yaml", PretrainRecipe,
            "pretrain",
        ),
    }[trainer]  # fmt: skip
    module = importlib.import_module(module)

    def read(*args, **kwargs):
        raise AssertionError("the data was read before the folder was checked")

    monkeypatch.setattr(module, reads, read)
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    for out, flags, said in (
        (used, {}, "is not empty"),
        (tmp_path / "none", {"resume": True}, "does not exist, there is no run to continue"),
        (used, {"overwrite": True}, "but no run_record.json"),
    ):
        recipe = load_recipe(recipe_file, kind, [f"output_dir={out}"])
        with pytest.raises(OutputDirError, match=said):
            getattr(module, run)(recipe, **flags)
    assert (used / "notes.txt").read_text() == "mine"


def test_case_2_resume_refuses_another_run_and_names_the_differences(tmp_path, tiny_official, finished):
    ref, _ = finished
    before = _snapshot(ref)
    with pytest.raises(OutputDirError, match=r"optimizer\.lr: 0\.001 in the folder's run, 0\.5 now"):
        train(_recipe(ref, tiny_official, "optimizer.lr=0.5"), recipe_dir=TINY.parent, resume=True)
    with pytest.raises(OutputDirError, match=r"checkpoint-4 is at step 4, past this run's steps=3"):
        train(_recipe(ref, tiny_official, "steps=3"), recipe_dir=TINY.parent, resume=True)
    # a section switched on is one difference, as set now (was: "matryoshka: null ..., "(not set)" now" and
    # "matryoshka.dims: "(not set)" ..., [32, 16] now")
    with pytest.raises(OutputDirError) as refused:
        train(_recipe(ref, tiny_official, "matryoshka={dims: [32, 16]}"), recipe_dir=TINY.parent, resume=True)
    assert 'matryoshka: null in the folder\'s run, {"dims": [32, 16]' in str(refused.value), refused.value
    assert "matryoshka." not in str(refused.value) and "(not set)" not in str(refused.value), refused.value
    assert _snapshot(ref) == before


def test_resuming_a_finished_run_says_so_and_writes_nothing(
    tmp_path, tiny_official, finished, capsys, monkeypatch
):
    """A job that always passes --resume (a preemptible queue) ends cleanly once its run is done: exit 0, the
    step it finished at, nothing loaded or rewritten. More steps train on; a folder whose later checkpoints were
    removed runs again from the newest one left (test_case_3, test_cde_resume_equals_uninterrupted)."""
    from neoembed.runs import RunFinished

    ref, _ = finished
    assert json.loads((ref / "run_record.json").read_text())["finished"]["step"] == 4
    before = _snapshot(ref)
    with pytest.raises(RunFinished, match=r"finished at step 4, nothing left to run; .*steps=8"):
        train(_recipe(ref, tiny_official), recipe_dir=TINY.parent, resume=True)
    with pytest.raises(RunFinished):  # the same model folder, spelled with a trailing slash: not another run
        train(_recipe(ref, f"{tiny_official}/"), recipe_dir=TINY.parent, resume=True)
    code, said = _cli(capsys, monkeypatch, "train", str(TINY), f"model={tiny_official}", f"output_dir={ref}",
                      *RUN, "--resume")  # fmt: skip
    assert code == 0 and "its run finished at step 4, nothing left to run" in said, said
    assert _snapshot(ref) == before
    extended = tmp_path / "extended"
    shutil.copytree(ref, extended)
    train(_recipe(extended, tiny_official, "steps=6"), recipe_dir=TINY.parent, resume=True)
    assert _steps(extended)[-1] == 6
    assert json.loads((extended / "run_record.json").read_text())["finished"]["step"] == 6


def test_resume_on_another_process_count_is_refused_where_the_batch_is_per_process(
    tiny_official, finished, monkeypatch
):
    """The unified recipe's batch_size is each process's: a run of 1 process resumed on 2 would double its global
    batch. Refused before any model loads, naming the count; a folder written before the count was recorded
    resumes on 1 process (the default) as before."""
    ref, _ = finished
    assert json.loads((ref / "run_record.json").read_text())["resume_settings"]["processes"] == 1
    before = _snapshot(ref)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(OutputDirError, match=r"processes: 1 in the folder's run, 2 now"):
        train(_recipe(ref, tiny_official), recipe_dir=TINY.parent, resume=True)
    assert _snapshot(ref) == before
    recipe = _recipe(ref, tiny_official)
    assert resume_defaults(recipe, per_process_batch=True)["processes"] == 1
    assert "processes" not in resume_settings(recipe)  # CDE, GLUE: a global batch, the count may change


def test_case_3_metrics_are_trimmed_to_the_resumed_step(tmp_path, tiny_official, finished):
    """Killed after step 3 with save_steps=2: metrics.jsonl holds steps 1-3 (and a torn 4th line), the newest
    checkpoint is 2. The resume logs 3 and 4 again, once each; the curves are drawn from those rows."""
    ref, _ = finished
    out = tmp_path / "run"
    out.mkdir()
    for name in ("checkpoint-2", "run_record.json"):
        (shutil.copytree if name.startswith("check") else shutil.copy)(ref / name, out / name)
    rows = (ref / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(rows[:3]) + '\n{"step": 4, "lo')
    train(_recipe(out, tiny_official), recipe_dir=TINY.parent, resume=True)
    assert _steps(out) == [1, 2, 3, 4]
    assert (out / "metrics.jsonl").read_text().splitlines()[:2] == rows[:2]
    assert (out / "training_curves.png").stat().st_size > 1000
    _same_weights(out, ref)


def test_case_4_steps_zero_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    out = tmp_path / "o"
    code, err = _cli(
        capsys, monkeypatch, "train", str(TINY), "model=does/not/exist", f"output_dir={out}", "steps=0"
    )
    assert code == 2 and "'steps'" in err and "greater than 0" in err and "got 0" in err
    assert str(TINY) in err and not out.exists()  # the model path was never tried, nothing was written


def test_case_5_to_7_the_run_records_the_negatives_it_trained_with(tmp_path, tiny_official, finished):
    from neoembed.train.trainer import prepare_datasets

    ref, _ = finished
    record = json.loads((ref / "run_record.json").read_text())
    assert record["negatives_per_query"] == {"pydoc_names": 0} and record["batch_size"] == {"pydoc_names": 16}
    rows = [{"q": f"query {i}", "p": f"positive {i}", "n": [f"neg {i}a", f"neg {i}b"]} for i in range(20)]
    data = tmp_path / "negs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    card = tmp_path / "negs.yaml"
    card.write_text(
        f"name: negs\nsource: {{local: {{path: {data}}}}}\ncolumns: {{query: q, positive: p, negatives: [n]}}\n"
    )
    recipe = _recipe(tmp_path / "x", tiny_official, f"datasets=[{{card: {card}, batch_size: 4}}]")
    datasets, _, _ = prepare_datasets(recipe, TINY.parent)
    assert datasets["negs"].column_names == ["query", "positive", "negative_1", "negative_2"]


def test_case_8_a_results_folder_belongs_to_one_model(tmp_path, tiny_official, capsys, monkeypatch):
    a, b = tmp_path / "a" / "checkpoint-8", tmp_path / "b" / "checkpoint-8"
    for folder, seed in ((a, 0), (b, 1)):
        folder.mkdir(parents=True)
        for f in tiny_official.iterdir():
            shutil.copy(f, folder / f.name)
        weights = load_file(str(folder / "model.safetensors"))
        weights = {k: v + seed for k, v in weights.items()}
        from safetensors.torch import save_file

        save_file(weights, str(folder / "model.safetensors"))
    assert default_results_dir(str(a)) != default_results_dir(str(b))  # same basename, different folders
    assert default_results_dir(str(a)).name.startswith("a-checkpoint-8-")  # a checkpoint named by its run
    assert default_results_dir("packaged:all-MiniLM-L6-v2").name.startswith("packaged_all-MiniLM-L6-v2-")  # no ":"
    results = tmp_path / "results"
    claim_results_dir(results, str(a), overwrite=False)
    (results / "STS16.json").write_text("{}")
    claim_results_dir(results, str(a), overwrite=False)  # the same model again: its results are kept
    code, err = _cli(
        capsys, monkeypatch, "mteb", "--model", str(b), "--output", str(results), "--tasks", "STS16"
    )
    assert code == 2 and str(a) in err and str(b) in err and "--overwrite" in err
    assert json.loads((results / MODEL_RECORD).read_text())["model"] == str(a.resolve())
    # the same path with other weights (retrained in place) is another model too
    shutil.copy(b / "model.safetensors", a / "model.safetensors")
    with pytest.raises(OutputDirError, match="holds the scores of"):
        claim_results_dir(results, str(a), overwrite=False)
    claim_results_dir(results, str(b), overwrite=True)  # --overwrite: the old model's results go
    assert not (results / "STS16.json").exists()


def test_case_9_convert_refuses_a_used_folder(tmp_path, tiny_official, capsys, monkeypatch):
    dst = tmp_path / "trained"
    code, _ = _cli(capsys, monkeypatch, "convert", str(tiny_official), str(dst))
    assert code == 0
    before = _snapshot(dst)
    code, err = _cli(capsys, monkeypatch, "convert", str(tiny_official), str(dst), "--to", "official")
    assert code == 2 and "not empty" in err and "--overwrite" in err and _snapshot(dst) == before
    code, err = _cli(
        capsys, monkeypatch, "convert", str(tiny_official), str(dst), "--to", "official", "--overwrite"
    )
    assert code == 0, err
    assert "model.NeoBERT" in (dst / "config.json").read_text()
    code, err = _cli(capsys, monkeypatch, "convert", str(dst), str(dst), "--overwrite")
    assert code == 2 and "same folder" in err and (dst / "config.json").is_file()
    # a SRC that fails to convert leaves the model --overwrite would replace as it was, and nothing beside it
    before = _snapshot(dst)
    (broken := tmp_path / "broken").mkdir()
    (broken / "config.json").write_text((tiny_official / "config.json").read_text())  # and no weights
    code, err = _cli(capsys, monkeypatch, "convert", str(broken), str(dst), "--overwrite")
    assert code == 2 and "no weights" in err and _snapshot(dst) == before, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "trained"]
    # DST ".": its files are staged beside the folder it is, not inside it (where --overwrite cleared them)
    monkeypatch.chdir(dst)
    code, err = _cli(capsys, monkeypatch, "convert", str(broken), ".", "--overwrite")
    assert code == 2 and "no weights" in err and _snapshot(dst) == before, err
    code, err = _cli(capsys, monkeypatch, "convert", str(tiny_official), ".", "--overwrite")
    assert code == 0 and (dst / "model.safetensors").is_file(), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "trained"]
    (empty := tmp_path / "empty").mkdir()
    monkeypatch.chdir(empty)
    code, err = _cli(capsys, monkeypatch, "convert", str(tiny_official), ".")
    assert code == 0 and (empty / "config.json").is_file() and not list(empty.glob(".*converting")), err


def test_case_10_resume_without_a_checkpoint_is_an_error(tmp_path, tiny_official, capsys, monkeypatch):
    out = tmp_path / "o"
    code, err = _cli(
        capsys, monkeypatch, "train", str(TINY), f"model={tiny_official}", f"output_dir={out}", "--resume"
    )
    assert code == 2 and "no run to continue" in err and not out.exists()
    out.mkdir()
    (out / "run_record.json").write_text("{}")
    code, err = _cli(
        capsys, monkeypatch, "train", str(TINY), f"model={tiny_official}", f"output_dir={out}", "--resume"
    )
    assert code == 2 and "no complete checkpoint" in err and "without --resume" in err


# ---------------------------------------------------------------------------------------------- poor cases
def test_poor_truncated_checkpoint_is_skipped_by_name(tmp_path, tiny_official, finished, capsys):
    ref, _ = finished
    out = tmp_path / "run"
    shutil.copytree(ref, out)
    weights = out / "checkpoint-4" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # a kill or a full disk in the middle of the write
    (out / "model.safetensors").unlink()
    train(_recipe(out, tiny_official), recipe_dir=TINY.parent, resume=True)
    said = capsys.readouterr().out
    assert "skipped checkpoint-4: model.safetensors has" in said and "(truncated)" in said
    assert "resuming from checkpoint-2" in said
    _same_weights(out, ref)


def test_poor_sigint_and_sigterm_exit_130_and_143_after_checkpointing(
    tmp_path, tiny_official, capsys, monkeypatch, sigterm_at
):
    from neoembed.train import trainer as trainer_mod

    real = trainer_mod.unified_step
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        monkeypatch.setattr(trainer_mod, "unified_step", real)
        sigterm_at(trainer_mod, "unified_step", 1, sig)
        out = tmp_path / sig.name
        args = ["train", str(TINY), f"model={tiny_official}", f"output_dir={out}", *RUN]
        got, err = _cli(capsys, monkeypatch, *args)
        assert got == code, err
        assert f"stopped by {sig.name}" in err and "--resume" in err and "Traceback" not in err
        # the signal lands in step 1, after its stop flag was read: the next step ends the run
        (ckpt,) = list_checkpoints(out)
        assert ckpt.name in ("checkpoint-1", "checkpoint-2") and str(ckpt) in err
        assert verify_checkpoint(ckpt) is None and not (out / "model.safetensors").exists()


def test_a_closed_terminal_checkpoints_as_sigterm_does_unless_nohup_ignores_it(
    tmp_path, tiny_official, capsys, monkeypatch, sigterm_at
):
    """#43, a walk's T18: SIGHUP (a terminal or ssh session closed) killed a run with 129 and no checkpoint,
    losing up to save_steps of work. It checkpoints and stops as SIGTERM does; under nohup (SIGHUP ignored) the
    run is meant to go on, and the handler is not installed."""
    from neoembed.runs.signals import stop_signals
    from neoembed.train import trainer as trainer_mod

    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        sigterm_at(trainer_mod, "unified_step", 1, signal.SIGHUP)
        out = tmp_path / "hup"
        got, err = _cli(capsys, monkeypatch, "train", str(TINY), f"model={tiny_official}", f"output_dir={out}", *RUN)
        assert got == 129 and "stopped by SIGHUP" in err and "--resume" in err, err
        (ckpt,) = list_checkpoints(out)
        assert verify_checkpoint(ckpt) is None
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        assert signal.SIGHUP not in stop_signals()
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.parametrize("steps", ["-5", "0"])
def test_poor_negative_or_zero_steps_fail_before_the_model_loads(tmp_path, capsys, monkeypatch, steps):
    out = tmp_path / "o"
    code, err = _cli(
        capsys, monkeypatch, "train", str(TINY), "model=nowhere", f"output_dir={out}", f"steps={steps}"
    )
    assert code == 2 and "'steps': Input should be greater than 0" in err and not out.exists()


@pytest.mark.parametrize(
    "override", ["batch_size=0", "save_steps=0", "logging_steps=-1", "max_length=0", "optimizer.lr=0"]
)
def test_poor_recipe_values_are_validated_up_front(tmp_path, capsys, monkeypatch, override):
    code, err = _cli(
        capsys, monkeypatch, "train", str(TINY), "model=nowhere", f"output_dir={tmp_path / 'o'}", override
    )
    key = override.split("=")[0]
    assert code == 2 and f"'{key}'" in err and "greater than" in err and not (tmp_path / "o").exists()


def test_poor_yaml_syntax_error_names_file_and_line(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 0\nmodel: x\nsteps: [1, 2\nbatch_size: 4\n")
    code, err = _cli(capsys, monkeypatch, "train", str(bad))
    assert (
        code == 2 and str(bad) in err and "not valid YAML" in err and "line" in err and "Traceback" not in err
    )


def test_poor_list_at_the_top_of_a_recipe(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "list.yaml"
    bad.write_text("- seed: 0\n- model: x\n")
    code, err = _cli(capsys, monkeypatch, "train", str(bad))
    assert code == 2 and str(bad) in err and "mapping" in err and "list" in err


def _card(tmp_path: Path, data: Path) -> Path:
    card = tmp_path / "card.yaml"
    card.write_text(f"name: mine\nsource: {{local: {{path: {data}}}}}\ncolumns: {{query: q, positive: p}}\n")
    return card


def _train_card(capsys, monkeypatch, tmp_path, card) -> tuple[int, str]:
    out = tmp_path / "o"
    args = [
        "train",
        str(TINY),
        f"model={REPO / 'recipes' / 'tiny' / 'model'}",  # a model that exists: the data is what is refused
        f"output_dir={out}",
        f"datasets=[{{card: {card}}}]",
        "batch_size=2",
    ]
    code, err = _cli(capsys, monkeypatch, *args)
    assert not out.exists()
    return code, err


def test_poor_empty_data_file_is_named(tmp_path, capsys, monkeypatch):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    code, err = _train_card(capsys, monkeypatch, tmp_path, _card(tmp_path, data))
    assert code == 2 and "card mine" in err and str(data) in err and "empty" in err


def test_poor_malformed_json_line_is_named_by_file_and_line(tmp_path, capsys, monkeypatch):
    data = tmp_path / "bad.jsonl.gz"
    lines = [json.dumps({"q": f"q{i}", "p": f"p{i}"}) for i in range(5)]
    lines.insert(3, '{"q": "broken", "p": ')
    with gzip.open(data, "wt") as f:
        f.write("\n".join(lines) + "\n")
    code, err = _train_card(capsys, monkeypatch, tmp_path, _card(tmp_path, data))
    assert code == 2 and f"{data}, line 4: not a JSON object" in err and "Traceback" not in err


def test_poor_non_utf8_data_is_named(tmp_path, capsys, monkeypatch):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"q": "a", "p": "b"}\n{"q": "caf\xe9", "p": "d"}\n')
    code, err = _train_card(capsys, monkeypatch, tmp_path, _card(tmp_path, data))
    assert code == 2 and f"{data}, line 2: not UTF-8" in err and "0xe9" in err


def test_poor_truncated_weights_fail_by_name_before_loading(tmp_path, tiny_official, capsys, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(tiny_official, model)
    os.truncate(model / "model.safetensors", 1 << 20)
    with pytest.raises(OutputDirError, match="truncated"):
        check_weight_files(model)
    check_weight_files(tiny_official)  # an intact folder passes
    out = tmp_path / "o"
    code, err = _cli(capsys, monkeypatch, "train", str(TINY), f"model={model}", f"output_dir={out}", *RUN)
    assert code == 2 and str(model / "model.safetensors") in err and "truncated" in err
    assert not out.exists()
    code, err = _cli(capsys, monkeypatch, "mteb", "--model", str(model), "--output", str(tmp_path / "r"))
    assert code == 2 and "truncated" in err and not (tmp_path / "r").exists()


def test_poor_unknown_mteb_task_fails_before_the_model_loads(tmp_path, capsys, monkeypatch):
    out = tmp_path / "r"
    model = tmp_path / "model"  # a folder with a config: a name or folder that is no model is refused first
    model.mkdir()
    (model / "config.json").write_text("{}")  # never loaded: the task is refused before
    code, err = _cli(
        capsys, monkeypatch, "mteb", "--model", str(model), "--tasks", "STS17x", "--output", str(out)
    )
    assert code == 2 and "'STS17x' is not an mteb task" in err and "STS17" in err and not out.exists()


def test_poor_batch_size_zero_is_a_usage_error(tmp_path, capsys, monkeypatch):
    code, err = _cli(capsys, monkeypatch, "mteb", "--model", "nowhere", "--batch-size", "0")
    assert code == 2 and "Invalid value for '--batch-size'" in err and "greater than or equal to 1" in err
    code, err = _cli(capsys, monkeypatch, "ppl", "--model", "x", "--data", "y", "--batch-size", "0")
    assert code == 2 and "--batch-size" in err


def test_poor_identical_rows_warn(tmp_path, tiny_official, caplog):
    from neoembed.train.trainer import prepare_datasets

    data = tmp_path / "same.jsonl"
    data.write_text(json.dumps({"q": "the same text", "p": "the same text"}) + "\n" * 1)
    data.write_text((json.dumps({"q": "the same text", "p": "the same text"}) + "\n") * 64)
    recipe = _recipe(tmp_path / "x", tiny_official, f"datasets=[{{card: {_card(tmp_path, data)}}}]")
    with caplog.at_level(logging.WARNING, logger="neoembed.runs"):
        prepare_datasets(recipe, TINY.parent)
    said = caplog.text
    assert "64 of 64 pairs have the query equal to its positive" in said
    assert "63 of 64 pairs repeat another pair (1 distinct, one pair: nothing to contrast, the loss is 0)" in said
    # ten pairs four times each: fewer negatives, not a loss of 0 (it said "the loss is 0": walk T, 23)
    rows = [{"q": f"question {i}", "p": f"answer {i}"} for i in range(10)] * 4
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="neoembed.runs"):
        prepare_datasets(recipe, TINY.parent)
    assert "30 of 40 pairs repeat another pair (10 distinct, each 4.0 times on average" in caplog.text
    assert "loss is 0" not in caplog.text


def test_poor_zero_loss_and_gradient_for_20_logged_steps_warns(tmp_path, caplog):
    log = MetricsLog(tmp_path, (), True)
    with caplog.at_level(logging.WARNING, logger="neoembed.runs"):
        for step in range(1, 20):
            log.write({"step": step, "loss": 0.0, "grad_norm": 0.0})
        assert "degenerate" not in caplog.text  # 19 rows: not yet
        log.write({"step": 20, "loss": 0.0, "grad_norm": 0.0})
        log.write({"step": 21, "loss": 0.0, "grad_norm": 0.0})
    assert caplog.text.count("degenerate training") == 1 and "up to step 20" in caplog.text
    log = MetricsLog(tmp_path / "b", (), True)
    (tmp_path / "b").mkdir()
    for step in range(1, 40):  # a non-zero row in between resets the count
        log.write({"step": step, "loss": 0.0 if step % 15 else 0.5, "grad_norm": 0.0})
    assert not log.degenerate_warned


# ------------------------------------------------------------------------------------------ the helpers
def test_prepare_output_dir_rules(tmp_path):
    out = tmp_path / "o"
    assert prepare_output_dir(out, overwrite=False, resume=False) is None and not out.exists()
    out.mkdir()
    assert prepare_output_dir(out, overwrite=False, resume=False) is None  # empty: fine
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match=r"not empty \(it holds notes.txt\)"):
        prepare_output_dir(out, overwrite=False, resume=False)
    with pytest.raises(OutputDirError, match="is not this command's folder"):
        prepare_output_dir(out, overwrite=True, resume=False)  # never clears a folder that is not ours
    assert (out / "notes.txt").is_file()
    (out / "run_record.json").write_text(json.dumps({"resume_settings": {"steps": 8, "seed": 0}}))
    prepare_output_dir(out, overwrite=True, resume=False)
    assert not any(out.iterdir())
    with pytest.raises(OutputDirError, match="exclude each other"):
        prepare_output_dir(out, overwrite=True, resume=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputDirError, match="is a file"):
        prepare_output_dir(tmp_path / "file", overwrite=False, resume=False)


def test_only_the_launchs_main_process_checks_a_fresh_folder(tmp_path, monkeypatch):
    """The main process writes its run record right after the check: another process of the launch checking
    the same folder would refuse it as used (two-process `neoembed glue` did, #43). Every caller gets this by
    default, as `output_lock` does."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "run_record.json").write_text("{}")  # what the main process has just written
    monkeypatch.setenv("RANK", "1")
    assert prepare_output_dir(out, overwrite=False, resume=False) is None
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(OutputDirError, match="holds a run stopped before its first checkpoint"):  # used
        prepare_output_dir(out, overwrite=False, resume=False)


def test_resume_accepts_a_run_recorded_before_a_field_existed_while_it_is_at_its_default(tmp_path):
    """A field added later (with a default that keeps the old behaviour) is missing from older run records:
    resuming such a run passes while the field is at its default, and names it once it is not."""
    recipe = UnifiedRecipe(seed=0, model="m", datasets=[{"card": "c"}])
    now, defaults = resume_settings(recipe), resume_defaults(recipe)
    old = {k: v for k, v in now.items() if k not in ("batch_texts", "group_by_length")}
    out = tmp_path / "run"
    out.mkdir()
    (out / "run_record.json").write_text(json.dumps({"resume_settings": old}))
    kw = {"overwrite": False, "resume": True, "checkpoints": False, "defaults": defaults}
    assert prepare_output_dir(out, settings=now, **kw) is None
    changed = resume_settings(recipe.model_copy(update={"group_by_length": False}))
    with pytest.raises(
        OutputDirError, match=r'group_by_length: "\(not set\)" in the folder\'s run, false now'
    ):
        prepare_output_dir(out, settings=changed, **kw)
    with pytest.raises(OutputDirError, match="batch_texts"):  # without the defaults: every new key differs
        prepare_output_dir(out, settings=now, **{**kw, "defaults": None})


def test_resume_may_change_gradcaches_piece_size_but_not_the_loss(tmp_path):
    """A run that ran out of memory resumes with smaller GradCache pieces or with GradCache turned on (the same
    loss and gradients): ``loss.mini_batch_size``, ``loss.name`` between ``infonce`` and ``cached_infonce`` (the
    remedy the out-of-memory message gives) and CDE's ``chunk_size`` may change; the temperature may not."""
    from neoembed.cde.recipe import CDERecipe

    kw = {"overwrite": False, "resume": True, "checkpoints": False}
    unified = UnifiedRecipe(seed=0, model="m", datasets=[{"card": "c"}], loss={"name": "cached_infonce"})
    plain = UnifiedRecipe(seed=0, model="m", datasets=[{"card": "c"}])
    cde = CDERecipe(seed=0, model="m", datasets=[{"card": "c"}], chunk_size=8)
    for recipe, memory, other in (
        (unified, {"loss": {"name": "cached_infonce", "mini_batch_size": 4}}, {"temperature": 0.5}),
        (cde, {"chunk_size": 2}, {"temperature": 0.5}),
        (cde, {"chunk_size": None}, {"temperature": 0.5}),  # plain backpropagation: the same loss too
        (unified, {"loss": {"name": "infonce"}}, {"temperature": 0.5}),
        (plain, {"loss": {"name": "cached_infonce", "mini_batch_size": 4}}, {"temperature": 0.5}),
    ):
        out = tmp_path / f"run-{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        (out / "run_record.json").write_text(json.dumps({"resume_settings": resume_settings(recipe)}))
        smaller = type(recipe).model_validate({**recipe.model_dump(), **memory})
        assert prepare_output_dir(out, settings=resume_settings(smaller), **kw) is None
        with pytest.raises(OutputDirError, match="temperature"):
            prepare_output_dir(out, settings=resume_settings(smaller.model_copy(update=other)), **kw)


def _stage(out: Path, step: int, payload: bytes) -> Path:
    staged = stage_checkpoint(out, step)
    (staged / "sub").mkdir()
    (staged / "sub" / "weights.bin").write_bytes(payload)
    (staged / "state.json").write_text(json.dumps({"step": step}))
    return commit_checkpoint(staged, step, keep=2, settings={"seed": 0, "steps": 9})


def test_checkpoints_are_sealed_verified_and_rotated(tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    for step in (1, 2, 3):
        _stage(out, step, bytes([step]) * 1000)
    assert [c.name for c in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]  # keep=2
    marker = json.loads((out / "checkpoint-3" / CHECKPOINT_MARKER).read_text())
    assert set(marker["files"]) == {"sub/weights.bin", "state.json"} and marker["step"] == 3
    assert find_resume_checkpoint(out) == out / "checkpoint-3"
    (out / "checkpoint-3" / "sub" / "weights.bin").write_bytes(b"\0" * 1000)  # same size, other bytes
    assert "checksum" in verify_checkpoint(out / "checkpoint-3")
    stage_checkpoint(out, 4)  # an interrupted write
    with caplog.at_level(logging.WARNING, logger="neoembed.runs"):
        assert find_resume_checkpoint(out) == out / "checkpoint-2"
    assert (
        ".checkpoint-4.partial: an unfinished write" in caplog.text
        and "checkpoint-3: sub/weights.bin" in caplog.text
    )
    (out / "checkpoint-2" / CHECKPOINT_MARKER).unlink()
    with pytest.raises(
        OutputDirError, match="no complete checkpoint.*checkpoint-2: no checkpoint_complete.json"
    ):
        find_resume_checkpoint(out)
    again = _stage(out, 2, b"x" * 10)  # a checkpoint of the same step replaces the old one whole
    assert verify_checkpoint(again) is None and (again / "sub" / "weights.bin").read_bytes() == b"x" * 10


def test_trim_metrics_drops_later_and_torn_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo'
    )
    trim_metrics(path, 4)
    assert [json.loads(r)["step"] for r in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_check_pairs_quiet_on_real_pairs(shared_dir):
    rows = [
        json.loads(line) for line in gzip.open(shared_dir / "data/train/msrp_pairs/train.jsonl.gz", "rt")
    ][:200]
    assert check_pairs("msrp", [r["query"] for r in rows], [r["positive"] for r in rows]) == []


def test_poor_task_folder_without_its_split_fails_before_the_model_loads(
    shared_dir, tmp_path, capsys, monkeypatch
):
    data = tmp_path / "data" / "STS16"
    data.mkdir(parents=True)
    shutil.copy(
        shared_dir / "data" / "mteb" / "STS16" / "test.jsonl.gz", data / "train.jsonl.gz"
    )  # wrong split
    out = tmp_path / "r"
    model = tmp_path / "model"  # a folder with a config: a name or folder that is no model is refused first
    model.mkdir()
    (model / "config.json").write_text("{}")  # never loaded: the task is refused before
    args = [
        "mteb",
        "--model",
        str(model),
        "--data-dir",
        str(data.parent),
        "--tasks",
        "STS16",
        "--output",
        str(out),
    ]
    code, err = _cli(capsys, monkeypatch, *args)
    assert (
        code == 2 and f"{data}: task STS16 is evaluated on split(s) ['test'], the folder has ['train']" in err
    )
    assert "add test.jsonl.gz" in err and not out.exists()


def test_preprocess_resumes_only_a_folder_of_the_same_inputs(tmp_path, tiny_official, capsys, monkeypatch):
    text = tmp_path / "a.txt"
    text.write_text("".join(f"document number {i} about neobert\n" for i in range(40)))
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    args = ["preprocess", str(text), "--tokenizer", str(tiny_official)]
    code, err = _cli(capsys, monkeypatch, args[0], args[1], str(other), *args[2:])
    assert code == 2 and "no meta.json" in err and (other / "notes.txt").read_text() == "mine"
    out = tmp_path / "shards"
    assert _cli(capsys, monkeypatch, args[0], args[1], str(out), *args[2:])[0] == 0
    meta = json.loads((out / "meta.json").read_text())
    # the folder's shards came from another tokenizer of the same name and size (a retrained local one)
    (out / "meta.json").write_text(json.dumps({**meta, "vocab_sha256": "0" * 64}))
    code, err = _cli(capsys, monkeypatch, args[0], args[1], str(out), *args[2:])
    assert code == 2 and "another tokenizer" in err and "vocab_sha256" in err


def test_ppl_refuses_a_used_output_folder_before_loading(tmp_path, capsys, monkeypatch):
    out = tmp_path / "ppl"
    out.mkdir()
    (out / "ppl.json").write_text("{}")
    code, err = _cli(
        capsys, monkeypatch, "ppl", "--model", "nowhere", "--data", str(tmp_path), "--out", str(out)
    )
    assert (
        code == 2 and "not empty" in err and "--overwrite" in err and (out / "ppl.json").read_text() == "{}"
    )
    assert "--resume" not in err, err  # ppl has no such option: the refusal offers what it has


# ----------------------------------------------------------------------------------- one writer per folder
_HOLD = (
    "import sys, time; from neoembed.runs import output_lock\n"
    "with output_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(600)\n"
)


def _holder(folder: Path):
    """Another process holding ``folder``'s lock (as any neoembed writer does for its whole run)."""
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(folder)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_data_lost_a_second_writer_into_one_folder_is_refused_naming_the_holder(
    tmp_path, tiny_official, capsys, monkeypatch
):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = _snapshot(out)
    proc = _holder(out)
    try:
        args = ["train", str(TINY), f"model={tiny_official}", f"output_dir={out}", *RUN, "--resume"]
        code, err = _cli(capsys, monkeypatch, *args)
        assert code == 2 and str(out) in err and f"pid {proc.pid}" in err and "in use" in err, err
        for cmd in (
            ["convert", str(tiny_official), str(out)],
            ["mteb", "--model", str(tiny_official), "--output", str(out), "--tasks", "STS12"],
        ):
            code, err = _cli(capsys, monkeypatch, *cmd)
            assert code == 2 and f"pid {proc.pid}" in err, (cmd, err)
        # the folder through a link is the same folder (walk T, 38: both trained, their steps interleaved)
        link = tmp_path / "link"
        link.symlink_to(out)
        code, err = _cli(capsys, monkeypatch, *args[:3], f"output_dir={link}", *RUN, "--resume")
        assert code == 2 and f"pid {proc.pid}" in err and "in use" in err, err
        assert _snapshot(out) == before  # the refused commands did not touch the folder
    finally:
        proc.kill()  # SIGKILL: no chance to clean up
        proc.wait()
    # the killed holder's lock file is left behind, but the OS dropped its lock: the next writer takes it over
    assert lock_path(out).exists()
    with output_lock(out):
        assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
    assert not lock_path(out).exists()


def test_a_link_to_a_folder_whose_parent_is_read_only_locks_beside_the_link(tmp_path, monkeypatch):
    """`~/runs/x -> /scratch/$USER` under a read-only /scratch: the lock beside the link's target (taken so that
    a link and its target share one lock) could not be made, and the run was refused naming a folder the user
    never typed (walk W). The lock goes beside the link then; beside the target wherever it can."""
    import neoembed.runs.lock as lock

    scratch, home = tmp_path / "scratch", tmp_path / "home"
    (scratch / "user").mkdir(parents=True)
    home.mkdir()
    (home / "out").symlink_to(scratch / "user")
    assert lock_path(home / "out") == scratch / ".user.neoembed-lock"
    real = lock._writable
    monkeypatch.setattr(lock, "_writable", lambda folder: folder != scratch and real(folder))
    assert lock_path(home / "out") == home / ".out.neoembed-lock"
    with output_lock(home / "out"):
        assert (home / ".out.neoembed-lock").exists() and not (scratch / ".user.neoembed-lock").exists()
    # a link to a folder not made yet: refused before the run (mkdir failed after it, "[Errno 17] File exists")
    (home / "dangling").symlink_to(scratch / "later")
    with pytest.raises(OutputDirError, match=r"dangling is a link to .*later, which does not exist: make that"):
        with output_lock(home / "dangling"):
            pass


def test_case7_score_and_glue_take_the_output_lock(tmp_path, tiny_official, capsys, monkeypatch):
    """``neoembed score`` and ``neoembed glue`` wrote (and resumed into) their folders without the lock every other
    writer holds: two resumes into one folder interleaved. Both are refused now while another process holds it,
    naming the holder, and leave the folder as it was."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run_record.json").write_text("{}\n")
    before = _snapshot(out)
    proc = _holder(out)
    try:
        for cmd in (
            ["score", "pydoc_names", "--teacher", str(tiny_official), "--out", str(out), "--resume"],
            ["glue", "MRPC", "--model", str(tiny_official), "--out", str(out), "--resume"],
        ):
            code, err = _cli(capsys, monkeypatch, *cmd)
            assert code == 2 and f"--out {out} is in use" in err and f"pid {proc.pid}" in err, (cmd, err)
        assert _snapshot(out) == before
    finally:
        proc.kill()
        proc.wait()


def test_data_lost_the_lock_is_released_on_any_exit(tmp_path, capsys, monkeypatch):
    out = tmp_path / "deep" / "o"
    with pytest.raises(KeyboardInterrupt), output_lock(out):
        raise KeyboardInterrupt
    assert not lock_path(out).exists() and not (tmp_path / "deep").exists()  # nothing left behind
    code, err = _cli(capsys, monkeypatch, "train", str(TINY), "model=nowhere", f"output_dir={out}", "seed=x")
    assert code == 2 and not lock_path(out).exists() and not (tmp_path / "deep").exists()
    with output_lock(out), output_lock(out):  # reentrant: a command and the library function it calls
        pass


def test_resume_on_changed_card_data_is_refused_naming_the_card(tmp_path, tiny_official):
    """T32 of the walk: a run resumed after its card's data changed went on without a word (and its run record
    held no fingerprint of the data). Each card's row fields and data bytes are now a resume setting; a folder
    whose run predates them resumes as before."""
    from neoembed.data.cards import card_fingerprints, load_card

    for sub in ("cards", "rows"):
        shutil.copytree(TINY.parent / "tiny" / sub, tmp_path / sub)
    out, cards = tmp_path / "run", f"card_dirs=[{tmp_path / 'cards'}]"
    train(_recipe(out, tiny_official, cards, "steps=2"), recipe_dir=TINY.parent)
    saved = json.loads((out / "run_record.json").read_text())["resume_settings"]
    assert len(saved["data.pydoc_names"]) == 16
    card, folder = load_card(tmp_path / "cards" / "pydoc_names.yaml")  # a licence may change: no row does
    assert card_fingerprints([(card, folder)]) == card_fingerprints(
        [(card.model_copy(update={"license": "x"}), folder)]
    )
    rows = tmp_path / "rows" / "pydoc_names.jsonl"
    rows.write_text(rows.read_text() + '{"query": "one more", "positive": "row"}\n')
    before = _snapshot(out)
    with pytest.raises(OutputDirError, match=r"data\.pydoc_names: \"\w+\" in the folder's run, \"\w+\" now"):
        train(_recipe(out, tiny_official, cards), recipe_dir=TINY.parent, resume=True)
    assert _snapshot(out) == before
    for path in [out / "run_record.json", *out.glob("checkpoint-*/" + CHECKPOINT_MARKER)]:  # an older folder
        record = json.loads(path.read_text())
        record["resume_settings"].pop("data.pydoc_names")
        path.write_text(json.dumps(record))
    train(_recipe(out, tiny_official, cards), recipe_dir=TINY.parent, resume=True)
    assert _steps(out) == [1, 2, 3, 4]


def test_a_changed_dataset_entry_or_card_is_said_by_its_key():
    """Walk T, 30-31: a resume with one dataset's max_rows changed printed both `datasets` lists whole (600
    characters each) to compare by eye; a card whose instruction changed showed two hashes and no hint of what
    they stand for."""
    from neoembed.runs.folder import _differences

    then = {"datasets": [{"card": "a", "max_rows": 64}, {"card": "b", "max_rows": None}], "data.a": "cb01"}
    now = {"datasets": [{"card": "a", "max_rows": 60}, {"card": "b", "max_rows": None}], "data.a": "be2f"}
    assert _differences(then, now, {}) == [
        'data.a: "cb01" in the folder\'s run, "be2f" now (the card\'s source, columns, filter, labels, instruction '
        "or size, or its data files differ)",
        "datasets.0.max_rows: 64 in the folder's run, 60 now",
    ]
    swapped = {"datasets": list(reversed(now["datasets"])), "data.a": "cb01"}
    assert [line.split(":")[0] for line in _differences(now | {"data.a": "cb01"}, swapped, {})] == [
        "datasets.0.card", "datasets.0.max_rows", "datasets.1.card", "datasets.1.max_rows"
    ]  # fmt: skip
    assert _differences(then, then, {}) == []
    dropped = _differences(then, {**then, "data.a": "(not set)"}, {})  # walk Y: it said the card's fields differ
    assert dropped == ['data.a: "cb01" in the folder\'s run, "(not set)" now (trained on in one run only)']
    # a hub id not in the cache as the run started recorded no commit: the one cached since is the same model,
    # and a run from such a hub id could never be resumed (walk W); a recorded commit still compares
    hub = {"revision": None, "weights": None, "pipeline": None}
    assert _differences({"model_fingerprint": hub}, {"model_fingerprint": {**hub, "revision": "aaaa"}}, {}) == []
    then, now = ({"model_fingerprint": {**hub, "revision": commit}} for commit in ("aaaa", "bbbb"))
    moved = _differences(then, now, {})
    assert len(moved) == 1 and moved[0].startswith("model_fingerprint: ")


def test_resume_on_a_base_model_edited_in_place_is_refused_naming_it(tmp_path, tiny_official, caplog):
    """Walk T, 33: a base model folder whose tokenizer was edited in place (the same shapes) was resumed on
    without a word: the checkpoint brings the weights, the tokenizer loads from the base, and the loss jumped
    from 0.34 to 1.11. The base model's weights, pipeline files and commit are a resume setting; a copy of the
    folder elsewhere is the same model."""
    base = shutil.copytree(tiny_official, tmp_path / "base")
    out = tmp_path / "run"
    train(_recipe(out, base, "steps=2"), recipe_dir=TINY.parent)
    tokenizer = base / "tokenizer_config.json"
    kept = tokenizer.read_text()
    tokenizer.write_text(json.dumps({**json.loads(kept), "do_lower_case": False}))
    before = _snapshot(out)
    with pytest.raises(OutputDirError, match=r"model_fingerprint: .*\"pipeline\": \"\w+\"} in the folder's run"):
        train(_recipe(out, base, "steps=4"), recipe_dir=TINY.parent, resume=True)
    assert _snapshot(out) == before
    tokenizer.write_text(kept)
    with caplog.at_level(logging.WARNING, logger="neoembed.runs"):
        train(_recipe(out, base, "steps=4"), recipe_dir=TINY.parent, resume=True)
    assert _steps(out) == [1, 2, 3, 4]
    # more steps: the schedule is the new one's from the next step, said with the step (walk X, 22)
    assert "steps 2 in the folder's run, 4 now: the learning-rate schedule is recomputed for 4 steps, so from " \
        "step 3 the rate is the new schedule's" in caplog.text
    # the same model copied elsewhere is the same model (it was refused as another `model` path: walk W); a run
    # recorded before model_fingerprint compares the path, as it did then
    copy = shutil.copytree(base, tmp_path / "copy")
    train(_recipe(out, copy, "steps=6"), recipe_dir=TINY.parent, resume=True)
    assert _steps(out) == [1, 2, 3, 4, 5, 6]
    from neoembed.runs.folder import _differences

    assert _differences({"model": str(base)}, {"model": str(copy)}, {})[0].startswith("model: ")
    assert _differences({"model": "org/a", "model_fingerprint": {}}, {"model": "org/b", "model_fingerprint": {}}, {})


def test_a_signal_handled_during_the_stop_reduction_stops_every_process_one_step_later(monkeypatch):
    """`StopSignal.anywhere` on 2 processes: SIGTERM to one of them, handled while it waited in the all-reduce of
    the stop flags, came too late for the other's answer. Answering True there made this process checkpoint and
    stop alone while the other went on to its next gradient reduction (a hang, seen once in CI); both now stop at
    the next step."""
    import torch.distributed as dist

    from neoembed.runs.signals import StopSignal

    stop = StopSignal()

    def all_reduce(flag, op):  # the other process's flag is 0: it has received nothing
        if stop.received is None:
            stop.handle(signal.SIGTERM, None)  # Python runs the handler once the blocking call returns

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert stop.anywhere() is False and stop.received == "SIGTERM"  # the other process was told 0: go on
    assert stop.anywhere() is True  # this process's flag is in this reduction: every process stops here


def test_walk_overwrite_refuses_a_folder_holding_what_the_run_reads(
    tmp_path, tiny_official, capsys, monkeypatch
):
    """`train model=RUN output_dir=RUN --overwrite` (or the model a checkpoint of RUN) cleared RUN and then found
    no model; `mteb --model RUN --output RUN` advised --overwrite, which did the same; `mine` into the folder of
    its own card deleted the card. A used folder holding what the run reads is refused whatever the flags, and
    nothing in it changes."""
    from neoembed.runs import claim_results_dir

    run = tmp_path / "run"
    shutil.copytree(tiny_official, run)
    shutil.copytree(tiny_official, run / "checkpoint-2")
    (run / "run_record.json").write_text("{}")  # a folder neoembed wrote: --overwrite would clear it
    before = _snapshot(run)
    for model in (run, run / "checkpoint-2"):
        code, err = _cli(
            capsys, monkeypatch, "train", str(TINY), f"model={model}", f"output_dir={run}", "--overwrite"
        )
        assert code == 2 and f"holds {model}, which this run reads" in err, err
    code, err = _cli(capsys, monkeypatch, "mteb", "--model", str(run), "--output", str(run), "--overwrite",
                     "--tasks", "STS16", "--data-dir", str(REPO / "tests" / "shared" / "data" / "mteb"))  # fmt: skip
    assert code == 2 and "which this run reads" in err, err
    with pytest.raises(OutputDirError, match="which this run reads"):
        claim_results_dir(run, str(run), overwrite=True)
    card = run / "cards" / "mine.yaml"
    card.parent.mkdir()
    card.write_text("name: mine\n")
    with pytest.raises(OutputDirError, match="which this run reads"):
        prepare_output_dir(
            run, overwrite=True, resume=False, checkpoints=False, inputs=("hub/model-id", card)
        )
    assert _snapshot(run) == {**before, **{k: v for k, v in _snapshot(run).items() if k.startswith("cards")}}
    other = tmp_path / "other"
    shutil.copytree(run, other)
    assert prepare_output_dir(other, overwrite=True, resume=False, inputs=(run, "hub/model-id")) is None
    assert not any(other.iterdir())  # a folder that holds no input is still cleared


def test_walk_ctrl_c_in_a_command_without_its_own_handler_says_how_to_continue(capsys, monkeypatch, tmp_path):
    """`neoembed mteb` and `neoembed mine` stopped by Ctrl-C exited 130 without a word: typer turns the
    KeyboardInterrupt into a returned 130, so the command line's own message never ran."""
    import neoembed.eval.cli as eval_cli

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_cli, "_run", ctrl_c)
    data = str(REPO / "tests" / "shared" / "data" / "mteb")
    code, said = _cli(capsys, monkeypatch, "mteb", "--model", "packaged:all-MiniLM-L6-v2", "--tasks", "STS16",
                      "--data-dir", data, "--output", str(tmp_path / "results"))  # fmt: skip
    assert code == 130 and "interrupted by Ctrl-C: rerun the same command: it reuses the tasks it finished" in said
    # ppl keeps nothing to continue from: it said "rerun the same command to continue" all the same
    import neoembed.pretrain.cli as pretrain_cli

    monkeypatch.setattr(pretrain_cli, "_ppl", ctrl_c)
    code, said = _cli(capsys, monkeypatch, "ppl", "--model", "m", "--data", "d", "--out", str(tmp_path / "ppl"))
    assert code == 130 and "interrupted by Ctrl-C: rerun the command to start again" in said, said
    # a training run aborted by a second Ctrl-C said to start again, which its earlier checkpoints refuse
    import neoembed.train.trainer as trainer

    monkeypatch.setattr(trainer, "train", ctrl_c)
    code, said = _cli(capsys, monkeypatch, "train", "tiny", f"output_dir={tmp_path / 'run'}")
    assert code == 130 and "rerun with --resume to continue from its newest checkpoint" in said, said
    # SIGTERM (what a scheduler sends) in such a command exited 143 without a word (mine kept its shards)
    import os
    import signal

    monkeypatch.setattr(eval_cli, "_run", lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.getsignal(signal.SIGTERM)
    code, said = _cli(capsys, monkeypatch, "mteb", "--model", "packaged:all-MiniLM-L6-v2", "--tasks", "STS16",
                      "--data-dir", data, "--output", str(tmp_path / "results"))  # fmt: skip
    assert code == 143 and "stopped by SIGTERM: rerun the same command: it reuses the tasks it finished" in said
    assert signal.getsignal(signal.SIGTERM) is before  # the process's own handler is put back
