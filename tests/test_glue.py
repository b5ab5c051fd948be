"""``neoembed glue``: tasks and metrics as GLUE defines them, the Appendix C protocol's numbers, local data in the
hub's layout, and a run, a transfer and a resumable grid on the NeoBERT fixture (seconds on CPU)."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy.stats import spearmanr
from typer.testing import CliRunner

from neoembed.cli import app
from neoembed.glue.run import GlueRecipe, eval_interval, grid_points, lr_lambda
from neoembed.glue.tasks import TASKS, check_columns, compute_metrics, get_task, load_splits, task_score
from neoembed.runs import OutputDirError, list_checkpoints


@pytest.mark.parametrize(
    "name, key", [("MRPC", "mrpc"), ("STS-B", "stsb"), ("sst2", "sst2"), ("SST-2", "sst2")]
)
def test_task_names(name, key):
    assert get_task(name) is TASKS[key]


def test_wnli_and_unknown_tasks_fail_with_the_valid_ones():
    with pytest.raises(ValueError, match="WNLI is excluded"):
        get_task("WNLI")
    with pytest.raises(ValueError, match="'CoLA', 'SST-2'"):
        get_task("squad")


def test_metrics_match_their_definitions():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 200)
    logits = rng.normal(size=(200, 2)) + 0.8 * np.eye(2)[labels]
    pred = logits.argmax(1)
    tp, tn = ((pred == 1) & (labels == 1)).sum(), ((pred == 0) & (labels == 0)).sum()
    fp, fn = ((pred == 1) & (labels == 0)).sum(), ((pred == 0) & (labels == 1)).sum()
    mcc = (tp * tn - fp * fn) / np.sqrt(float((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))
    assert compute_metrics(TASKS["cola"], logits, labels)["matthews"] == pytest.approx(mcc)
    mrpc = compute_metrics(TASKS["mrpc"], logits, labels)
    assert mrpc["f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert mrpc["accuracy"] == pytest.approx((tp + tn) / 200)
    scores, gold = rng.normal(size=(50, 1)), rng.uniform(0, 5, 50)
    stsb = compute_metrics(TASKS["stsb"], scores, gold)
    assert stsb["pearson"] == pytest.approx(np.corrcoef(scores[:, 0], gold)[0, 1])
    assert stsb["spearman"] == pytest.approx(spearmanr(scores[:, 0], gold).statistic)


def test_task_scores_average_as_the_paper():
    mnli = {"validation_matched": {"accuracy": 0.9}, "validation_mismatched": {"accuracy": 0.8}}
    assert task_score(TASKS["mnli"], mnli) == pytest.approx(85.0)
    assert task_score(TASKS["mrpc"], {"validation": {"f1": 0.9, "accuracy": 0.86}}) == pytest.approx(88.0)


def test_protocol_numbers():
    recipe = GlueRecipe(task="mnli", batch_size=16, learning_rate=6e-6, weight_decay=1e-2)
    assert eval_interval(recipe, 392_702) == 500  # MNLI: 24,544 batches // 10 > 500
    assert eval_interval(recipe.model_copy(update={"batch_size": 8}), 3_668) == 45  # MRPC: 459 // 10
    assert (recipe.epochs, recipe.patience) == (10, 15)
    factors = [lr_lambda(s, 1000, recipe) for s in range(1000)]
    assert factors[59] == pytest.approx(1.0) and factors[0] == pytest.approx(1 / 60)  # 6% warm-up
    assert factors[899] == pytest.approx(0.1 + 0.9 / 840, rel=1e-6) and set(factors[900:]) == {0.1}
    assert len(grid_points(recipe)) == 5 * 6 * 2  # Table 6's caption


def test_shipped_recipes_hold_table_6():
    from neoembed.recipe import load_recipe

    expected = {
        "cola": (4, 6e-6, 1e-5),
        "mrpc": (8, 2e-5, 1e-5),
        "qqp": (32, 1e-5, 1e-2),
        "stsb": (8, 1e-5, 1e-2),
    }
    for task, setting in expected.items():
        r = load_recipe(f"glue/{task}", GlueRecipe)
        assert (r.batch_size, r.learning_rate, r.weight_decay) == setting
    assert {t for t in TASKS if load_recipe(f"glue/{t}", GlueRecipe).transfer_from} == {
        "mrpc",
        "stsb",
        "qnli",
        "rte",
    }


@pytest.fixture(scope="module")
def msrp_rows(shared_dir):
    with gzip.open(shared_dir / "data" / "eval" / "MSRP" / "test.jsonl.gz", "rt") as f:
        return [json.loads(line) for _, line in zip(range(64), f, strict=False)]


def _hub_layout(root, task, splits):
    """A folder as a snapshot of nyu-mll/glue: <task>/<split>-00000-of-00001.parquet."""
    (root / task).mkdir(parents=True)
    for split, rows in splits.items():
        pd.DataFrame(rows).to_parquet(root / task / f"{split}-00000-of-00001.parquet")
    return root


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("grid.batch_size=[]", "'grid.batch_size': List should have at least 1 item"),
        ("grid.weight_decay=[-1]", "'grid.weight_decay.0': Input should be greater than or equal to 0"),
        ("grid.learning_rate=[1e-5,1e-5]", "'grid.learning_rate': Value error, [1e-05, 1e-05] repeats a value"),
    ],
)
def test_grid_lists_are_checked_with_the_recipe(override, said):
    # a walk's g12 ("max() arg is an empty sequence"), g14 (after the data loaded, naming no key), g15 (one run
    # reported twice in grid.md)
    from neoembed.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=re.escape(said)):
        load_recipe("glue/mrpc", GlueRecipe, [override])


def test_local_hub_layout_and_carve(tmp_path, msrp_rows, shared_dir):
    folder = _hub_layout(tmp_path / "glue", "mrpc", {"train": msrp_rows[:40], "validation": msrp_rows[40:]})
    splits = load_splits(TASKS["mrpc"], folder, None)
    assert (splits["train"].num_rows, splits["validation"].num_rows) == (40, 24)
    carved = load_splits(TASKS["mrpc"], shared_dir / "data" / "eval" / "MSRP", "test")
    assert (carved["train"].num_rows, carved["validation"].num_rows) == (1380, 345)
    with pytest.raises(FileNotFoundError, match="can be divided with --carve SPLIT"):
        load_splits(TASKS["mrpc"], shared_dir / "data" / "eval" / "MSRP", None)
    # --carve given a split the folder lacks: told to name one it holds, not to pass --carve (a walk's g3)
    with pytest.raises(FileNotFoundError, match=r"no validation split .* give one the folder holds"):
        load_splits(TASKS["mrpc"], shared_dir / "data" / "eval" / "MSRP", "validation")


def test_a_glue_split_replaced_with_the_same_size_and_time_is_read_anew(tmp_path):
    """datasets keys a local file by its path and time: a split replaced by another version of the same size and
    time (cp -p) was trained and scored as it was (walk R's BAD-1, the route fa76bf1 did not cover)."""
    import os

    folder = tmp_path / "glue" / "mrpc"
    folder.mkdir(parents=True)
    rows = lambda label: "".join(  # noqa: E731
        json.dumps({"sentence1": f"s{i}a", "sentence2": f"s{i}b", "label": label, "idx": i}) + "\n" for i in range(8)
    )
    for split in ("train", "validation"):
        (folder / f"{split}.jsonl").write_text(rows(0))
    assert set(load_splits(TASKS["mrpc"], folder.parent, None)["train"]["label"]) == {0}
    for split in ("train", "validation"):
        new, old = tmp_path / "new.jsonl", folder / f"{split}.jsonl"
        new.write_text(rows(1))
        os.utime(new, ns=(old.stat().st_atime_ns, old.stat().st_mtime_ns))
        os.replace(new, old)
    assert set(load_splits(TASKS["mrpc"], folder.parent, None)["train"]["label"]) == {1}


def _on(model, folder, out) -> list[str]:
    """The options naming the model, the data folder and the output folder."""
    return ["--model", str(model), "--data-dir", str(folder), "--out", str(out)]


def _glue(*args):
    result = CliRunner().invoke(app, ["glue", *args], env={"HF_HUB_OFFLINE": "1"})
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def test_the_hub_unreachable_names_data_dir(monkeypatch):
    """Offline without --data-dir, glue said only "Couldn't reach 'nyu-mll/glue' on the Hub" (the walk's case)."""
    import datasets

    from neoembed.data.errors import HubUnreachable

    def unreachable(*args, **kwargs):  # what datasets raises offline (a ConnectionError naming the cause)
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(HubUnreachable, match=r"Couldn't reach .* Offline, pass --data-dir DIR .*mrpc/train-"):
        load_splits(get_task("MRPC"), None, None)
    # without HF_HUB_OFFLINE one probe says it first (the dataset client's retries took 32-68 s: a docs walk's P5)
    from neoembed.data import check

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(check, "hub_unreachable_reason", lambda: "ConnectError (no network)")
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("the hub was asked"))
    with pytest.raises(HubUnreachable, match=r"hub cannot be reached .ConnectError .*: the GLUE data could not be"):
        load_splits(get_task("MRPC"), None, None)


def test_a_process_other_than_the_main_one_writes_nothing_before_the_run(tmp_path, tiny_official, monkeypatch):
    """A 2-process `neoembed glue`: the main process checks that --out is empty; a second process that wrote the
    run record first made the main one refuse the folder as used (seen as a flaky exit 2)."""
    import neoembed.glue.cli as glue_cli

    seen = []
    monkeypatch.setattr(glue_cli, "_run", lambda *a: seen.append(sorted(p.name for p in out.rglob("*"))))
    monkeypatch.setenv("RANK", "1")
    out = tmp_path / "out"
    _glue("MRPC", *_on(tiny_official, tmp_path / "data", out))
    assert seen == [[]]
    monkeypatch.setenv("RANK", "0")
    _glue("MRPC", *_on(tiny_official, tmp_path / "data", out))
    assert seen[1] == ["run_record.json"]


def test_run_transfer_and_resumable_grid(tmp_path, msrp_rows, tiny_official, monkeypatch):
    """MRPC on the fixture, STS-B from its checkpoint (3 -> 1 labels: a fresh classifier), and a 2-point grid
    that a second call reads back instead of training again."""
    folder = _hub_layout(tmp_path / "data", "mrpc", {"train": msrp_rows[:40], "validation": msrp_rows[40:]})
    stsb = [{**r, "label": 5.0 * r["label"] - 0.5 * i % 2} for i, r in enumerate(msrp_rows)]
    _hub_layout(tmp_path / "data", "stsb", {"train": stsb[:40], "validation": stsb[40:]})
    model, mrpc_out = str(tiny_official), tmp_path / "mrpc"
    out = _glue(
        "MRPC", "epochs=1", "report_to=[tensorboard]", "--model", model, "--data-dir", str(folder),
        "--out", str(mrpc_out),
    )  # fmt: skip
    result = json.loads((mrpc_out / "results.json").read_text())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(mrpc_out / "tensorboard"))
    events.Reload()  # the run loop's trackers: each logged row's loss, as metrics.jsonl has it
    rows = [json.loads(line) for line in (mrpc_out / "metrics.jsonl").read_text().splitlines()]
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    assert logged == pytest.approx({r["step"]: r["loss"] for r in rows if "loss" in r}, rel=1e-6)
    assert f"MRPC: {result['score']:.2f}" in out and result["eval_every"] == 1 and result["steps"] == 5
    assert (mrpc_out / "model" / "config.json").is_file() and not list_checkpoints(mrpc_out)
    _glue(
        "STS-B",
        "epochs=1",
        "--model",
        model,
        "--data-dir",
        str(folder),
        "--out",
        str(tmp_path / "s"),
        "--from",
        str(mrpc_out),
    )
    stsb_result = json.loads((tmp_path / "s" / "results.json").read_text())
    assert set(stsb_result["validation"]["validation"]) == {"pearson", "spearman"}
    grid = [
        "MRPC",
        "epochs=1",
        "grid.batch_size=[16]",
        "grid.learning_rate=[1e-5,3e-5]",
        "grid.weight_decay=[0.01]",
    ]
    grid += ["--grid", "--model", model, "--data-dir", str(folder), "--out", str(tmp_path / "g")]
    _glue(*grid)
    table = (tmp_path / "g" / "grid.md").read_text()
    assert table.count("| 16 |") == 2
    import neoembed.glue.run as glue_run

    def no_training(*args, **kwargs):  # a retrain would write the same table: this proves it was read back
        raise AssertionError("a finished grid point was trained again")

    monkeypatch.setattr(glue_run, "run_one", no_training)
    _glue(*grid, "--resume")  # both runs finished: read back, not trained again
    assert (tmp_path / "g" / "grid.md").read_text() == table
    kept = [p for p in (tmp_path / "g").glob("*/model")]
    assert len(kept) == 1  # only the best run keeps its model
    # refused before anything runs or the record changes: a resume without --grid trained a single run into the
    # grid's folder (a walk's gr2); a grid point added wrote the refused grid into the record (g20)
    record = (tmp_path / "g" / "run_record.json").read_bytes()
    single = [a for a in grid if a != "--grid"]
    extended = [a if a != "grid.learning_rate=[1e-5,3e-5]" else "grid.learning_rate=[1e-5,3e-5,1e-4]" for a in grid]
    for args, said in ((single, "holds a grid search (grid.md): add --grid"), (extended, "grid.learning_rate")):
        refused = CliRunner().invoke(app, ["glue", *args, "--resume"], env={"HF_HUB_OFFLINE": "1"})
        assert isinstance(refused.exception, OutputDirError) and said in str(refused.exception), refused.output
        assert (tmp_path / "g" / "run_record.json").read_bytes() == record


def test_bad_input_exits_2(tmp_path, run_neoembed):
    run = run_neoembed(["glue", "WNLI", "--model", "x", "--out", str(tmp_path / "o")])
    assert run.exit_code == 2 and "WNLI is excluded" in run.stderr
    from neoembed.cde.model import CLASS_REF

    cde = tmp_path / "cde"  # a CDE model's folder, as it saves one (was: "Unrecognized model in cde")
    cde.mkdir()
    (cde / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": CLASS_REF}]))
    run = run_neoembed(["glue", "MRPC", "--model", str(cde), "--out", str(tmp_path / "o")])
    assert run.exit_code == 2 and "is a CDE model (two encoder stages and a corpus context)" in run.stderr
    assert not (tmp_path / "o").exists()
    data = tmp_path / "data"  # a folder that is no model (was: the tokenizer's error, after the data loaded)
    data.mkdir()
    (data / "train.jsonl").write_text("{}\n")
    run = run_neoembed(["glue", "MRPC", "--model", str(data), "--out", str(tmp_path / "o")])
    assert run.exit_code == 2 and f"{data} is not a model: expected modules.json" in run.stderr, run.stderr
    assert not (tmp_path / "o").exists()


def _a_run_stopped_at_step_4(tmp_path, msrp_rows, tiny_official, monkeypatch, capsys, model=None):
    """MRPC for 2 epochs (10 steps) run whole into ``full``, then the same run stopped by Ctrl-C after step 4
    into ``out``, in this process; returns (args, out, full's results)."""
    import os
    import signal
    import sys

    import neoembed.glue.run as glue_run
    from neoembed.cli import main
    from neoembed.runs import list_checkpoints, verify_checkpoint

    folder = _hub_layout(tmp_path / "data", "mrpc", {"train": msrp_rows[:40], "validation": msrp_rows[40:]})
    args = ["MRPC", "epochs=2", "--model", str(model or tiny_official), "--data-dir", str(folder)]
    _glue(*args, "--out", str(tmp_path / "full"))
    full = json.loads((tmp_path / "full" / "results.json").read_text())

    real, sent = glue_run.lr_lambda, []

    def ctrl_c_at_step_4(step, total, recipe):  # the scheduler's calls (one per parameter group) after step 4
        if step == 4 and not sent:
            sent.append(os.kill(os.getpid(), signal.SIGINT))  # one Ctrl-C (a second one aborts at once)
        return real(step, total, recipe)

    out = tmp_path / "run"
    monkeypatch.setattr(glue_run, "lr_lambda", ctrl_c_at_step_4)
    monkeypatch.setattr(sys, "argv", ["neoembed", "glue", *args, "--out", str(out)])
    with pytest.raises(SystemExit) as stopped:
        main()
    err = capsys.readouterr().err
    assert stopped.value.code == 130, err
    ckpts = list_checkpoints(out)
    assert f"stopped by SIGINT; checkpoint {ckpts[-1]} written: continue with --resume" in err
    assert all(verify_checkpoint(c) is None for c in ckpts) and not (out / "results.json").exists()
    monkeypatch.setattr(glue_run, "lr_lambda", real)
    return args, out, full


def test_case5_glue_stopped_by_a_signal_resumes_past_a_torn_checkpoint(
    tmp_path, msrp_rows, tiny_official, monkeypatch, capsys
):
    """A GLUE run stopped by Ctrl-C ends as ``neoembed train`` does (a sealed checkpoint, the stop message, exit
    130); a torn newer checkpoint beside it (a kill mid-write) is skipped by --resume, which continues from the
    intact one and ends with the uninterrupted run's results."""
    import sys

    from neoembed.cli import main
    from neoembed.runs import CHECKPOINT_MARKER, list_checkpoints

    args, out, full = _a_run_stopped_at_step_4(tmp_path, msrp_rows, tiny_official, monkeypatch, capsys)
    # a kill while a newer checkpoint was written: a folder without its completion marker, a staging folder
    torn = out / "checkpoint-9"
    torn.mkdir()
    (torn / "trainer_state.json").write_text("{")
    (out / ".checkpoint-10.partial").mkdir()
    # another run's settings cannot continue this one: refused by name before the model loads
    monkeypatch.setattr(
        sys, "argv", ["neoembed", "glue", *args, "learning_rate=1e-3", "--out", str(out), "--resume"]
    )
    with pytest.raises(SystemExit) as refused:
        main()
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "learning_rate: 2e-05 in the folder's run, 0.001 now" in err, err
    monkeypatch.setattr(sys, "argv", ["neoembed", "glue", *args, "--out", str(out), "--resume"])
    with pytest.raises(SystemExit) as resumed:
        main()
    output = capsys.readouterr()
    assert resumed.value.code == 0, output.err
    assert f"checkpoint-9: no {CHECKPOINT_MARKER}" in output.out + output.err
    result = json.loads((out / "results.json").read_text())
    assert result["steps"] == full["steps"] == 10 and result["best_step"] == full["best_step"]
    assert result["validation"]["validation"] == pytest.approx(full["validation"]["validation"], abs=1e-6)
    assert (out / "model" / "config.json").is_file() and not list_checkpoints(out)
    # resumed once more: nothing left to run (with its checkpoints removed, it trained again from step 0)
    written = (out / "results.json").stat().st_mtime_ns
    with pytest.raises(SystemExit) as again:
        main()
    said = capsys.readouterr()
    assert again.value.code == 0 and "its run finished at step 10, nothing left to run" in said.out, said
    assert (out / "results.json").stat().st_mtime_ns == written
    # the finished run resumed with another setting: refused by name (it was reported done, exit 0, and the
    # setting never ran: walk case 28)
    monkeypatch.setattr(
        sys, "argv", ["neoembed", "glue", *args, "learning_rate=1e-3", "--out", str(out), "--resume"]
    )
    with pytest.raises(SystemExit) as changed:
        main()
    err = capsys.readouterr().err
    assert changed.value.code == 2 and "learning_rate: 2e-05 in the folder's run, 0.001 now" in err, err
    assert (out / "results.json").stat().st_mtime_ns == written


def test_a_split_edited_between_a_kill_and_resume_is_refused_a_moved_copy_resumes(
    tmp_path, msrp_rows, tiny_official, monkeypatch, capsys
):
    """GLUE's resume compared --data-dir by its path: a train split edited between the stop and --resume was
    continued on (walk R), and so was a model whose tokenizer was edited (walk W). The splits' files and the
    model are compared by content: an edit is refused by name, the same files in another folder continue to the
    uninterrupted run's results."""
    import shutil
    import sys

    from neoembed.cli import main

    model = shutil.copytree(tiny_official, tmp_path / "model")
    args, out, full = _a_run_stopped_at_step_4(tmp_path, msrp_rows, tiny_official, monkeypatch, capsys, model)
    data = Path(args[args.index("--data-dir") + 1])
    train = data / "mrpc" / "train-00000-of-00001.parquet"
    kept = train.read_bytes()
    edited = pd.read_parquet(train)
    edited["label"] = 1 - edited["label"]
    edited.to_parquet(train)
    monkeypatch.setattr(sys, "argv", ["neoembed", "glue", *args, "--out", str(out), "--resume"])
    with pytest.raises(SystemExit) as refused:
        main()
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "splits.train: " in err and "in the folder's run" in err, err
    # the model's tokenizer edited in place: it loads beside the checkpoint's weights (walk W: resumed, exit 0)
    train.write_bytes(kept)
    tokenizer = model / "tokenizer_config.json"
    saved_tokenizer = tokenizer.read_text()
    tokenizer.write_text(json.dumps({**json.loads(saved_tokenizer), "do_lower_case": False}))
    with pytest.raises(SystemExit) as refused:
        main()
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "model_fingerprint: " in err and "splits." not in err, err
    tokenizer.write_text(saved_tokenizer)
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    (moved / "mrpc" / train.name).write_bytes(kept)
    args[args.index("--data-dir") + 1] = str(moved)
    # the model copied elsewhere too: the same model (it was refused as another --model by its path: walk W)
    args[args.index("--model") + 1] = str(shutil.copytree(model, tmp_path / "model-copy"))
    monkeypatch.setattr(sys, "argv", ["neoembed", "glue", *args, "--out", str(out), "--resume"])
    with pytest.raises(SystemExit) as resumed:
        main()
    assert resumed.value.code == 0, capsys.readouterr().err
    result = json.loads((out / "results.json").read_text())
    assert result["steps"] == 10
    assert result["validation"]["validation"] == pytest.approx(full["validation"]["validation"], abs=1e-6)


def test_a_resume_of_another_kind_or_model_is_refused_before_it_loads(
    tmp_path, msrp_rows, tiny_official, monkeypatch, capsys
):
    """An interrupted single run resumed with another --model crashed loading its checkpoint after rewriting the
    run record (a walk's g9); resumed with --grid, it started the default grid in the run's folder (gg1)."""
    import sys

    from neoembed.cli import main
    from neoembed.hub import resolve_packaged

    args, out, _ = _a_run_stopped_at_step_4(tmp_path, msrp_rows, tiny_official, monkeypatch, capsys)
    record = (out / "run_record.json").read_bytes()
    other = [*args[:-4], "--model", "packaged:all-MiniLM-L6-v2", *args[-2:]]
    cases = (
        (other, f"fine-tunes {tiny_official}, this command {resolve_packaged('packaged:all-MiniLM-L6-v2')}"),
        ([*args, "--grid"], "holds a single run, not a grid: resume it without --grid"),
    )
    for argv, said in cases:
        monkeypatch.setattr(sys, "argv", ["neoembed", "glue", *argv, "--out", str(out), "--resume"])
        with pytest.raises(SystemExit) as refused:
            main()
        err = capsys.readouterr().err
        assert refused.value.code == 2 and said in err, err
        assert (out / "run_record.json").read_bytes() == record


def test_glue_carve_refuses_an_existing_validation_split(tmp_path, msrp_rows, tiny_official):
    """--carve used to divide the named split and ignore the folder's own validation split: the score reported
    was on 20% of the carved split, with the real validation rows unused and nothing said."""
    folder = _hub_layout(tmp_path / "glue", "mrpc", {"test": msrp_rows[:40], "validation": msrp_rows[40:]})
    with pytest.raises(ValueError, match=r"already holds .*validation: validation-00000-of-00001.parquet"):
        load_splits(TASKS["mrpc"], folder, "test")
    result = CliRunner().invoke(
        app,
        ["glue", "mrpc", "--model", str(tiny_official), "--data-dir", str(folder), "--carve", "test", "--out",
         str(tmp_path / "out")],
    )  # fmt: skip
    assert result.exit_code != 0 and "drop --carve" in str(result.exception)
    assert not (tmp_path / "out").exists()  # refused before the run left anything
    alone = _hub_layout(tmp_path / "alone", "mrpc", {"validation": msrp_rows})  # the only split: carved
    carved = load_splits(TASKS["mrpc"], alone, "validation")
    assert (carved["train"].num_rows, carved["validation"].num_rows) == (51, 13)


def test_glue_refuses_a_validation_split_without_labels(tmp_path, msrp_rows, run_neoembed, tiny_official):
    """GLUE marks unlabelled (test) rows -1: a validation split of those trained and scored 0.00, exit 0 (#43, a
    walk's G08). Refused before any model loads, naming the split; a wrong class index names its row."""
    unlabelled = [{**r, "label": -1} for r in msrp_rows[40:]]
    folder = _hub_layout(tmp_path / "glue", "mrpc", {"train": msrp_rows[:40], "validation": unlabelled})
    result = run_neoembed(
        ["glue", "mrpc", "--model", tiny_official, "--data-dir", folder, "--out", tmp_path / "out"]
    )
    assert result.exit_code == 2 and "every one is -1" in result.stderr, result.output
    assert not (tmp_path / "out").exists()
    wrong = [{**r, "label": 2 if i == 3 else r["label"]} for i, r in enumerate(msrp_rows[40:])]
    splits = load_splits(
        TASKS["mrpc"], _hub_layout(tmp_path / "g2", "mrpc", {"train": msrp_rows, "validation": wrong}), None
    )
    with pytest.raises(
        ValueError,
        match=r"'validation': 1 of 24 labels are not one of \[0, 1\] \(the first: row 4, label 2\)",
    ):
        check_columns(TASKS["mrpc"], splits)
    words = [
        {**r, "label": "yes" if i == 5 else str(r["label"])} for i, r in enumerate(msrp_rows)
    ]  # a walk's G07
    splits = load_splits(
        TASKS["mrpc"], _hub_layout(tmp_path / "g3", "mrpc", {"train": words, "validation": wrong}), None
    )
    with pytest.raises(ValueError, match=r"'train': row 6's label 'yes' is not a number"):
        check_columns(TASKS["mrpc"], splits)
    # a split carved into train and validation: the row as the file numbers it (a walk's g25 named row 232
    # of the shuffled train part for row 8 of the file)
    carved = tmp_path / "carve"
    carved.mkdir()
    bad = [{**r, "label": 5 if i == 7 else r["label"]} for i, r in enumerate(msrp_rows)]
    (carved / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(ValueError, match=r"split 'test': 1 of 64 labels .* \(the first: row 8, label 5\)"):
        load_splits(TASKS["mrpc"], carved, "test")


def test_glue_stops_after_patience_evaluations_without_a_better_score(tmp_path, msrp_rows, tiny_official):
    """``patience`` (the protocol's early stopping, on the loop's ``keep_best.patience``): the run ends at the
    first evaluation that leaves the best score unbeaten ``patience`` times in a row (a tie beats nothing), and
    its record names that step."""
    folder = _hub_layout(tmp_path / "data", "mrpc", {"train": msrp_rows[:40], "validation": msrp_rows[40:]})
    out = tmp_path / "run"
    _glue(
        "MRPC",
        "epochs=4",
        "patience=2",
        *_on(tiny_official, folder, out),
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scores = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    best, stale, expected_stop = -1.0, 0, None
    for step, value in scores:
        best, stale = (value, 0) if value > best else (best, stale + 1)
        if stale == 2 and step < 20:  # at the last step the run ends anyway
            expected_stop = step
            break
    result = json.loads((out / "results.json").read_text())
    record = json.loads((out / "run_record.json").read_text())
    assert scores[-1][0] == result["steps"]
    if expected_stop is None:  # every evaluation improved: the run went to its end
        assert result["steps"] == 20 and "stopped_early" not in record
    else:
        assert result["steps"] == expected_stop < 20
        assert record["stopped_early"] == {"step": expected_stop, "patience": 2}
    assert result["best_step"] == max(scores, key=lambda s: (s[1], -s[0]))[0]


def test_glue_on_the_run_loop_equals_a_transformers_trainer(tmp_path, msrp_rows, tiny_official):
    """The run loop against the engine it replaced: transformers' ``Trainer`` with the same data, order, head
    initialisation, optimiser, schedule, clipping, evaluation interval and best-checkpoint rule (dropout and weight
    decay off, whose conventions differ: the Trainer decays RMSNorm weights) gives the same evaluations and the
    same final weights."""
    import math
    import shutil

    import torch
    from safetensors.torch import load_file
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    model = tmp_path / "model"
    shutil.copytree(tiny_official, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "classifier_dropout": 0.0}))
    folder = _hub_layout(tmp_path / "data", "mrpc", {"train": msrp_rows[:40], "validation": msrp_rows[40:]})
    out = tmp_path / "loop"
    _glue(
        "MRPC",
        "epochs=2",
        "weight_decay=0",
        "learning_rate=1e-3",
        *_on(model, folder, out),
    )
    recipe = GlueRecipe(task="mrpc", batch_size=8, learning_rate=1e-3, weight_decay=0, epochs=2)
    total = 10  # 40 rows, batch 8, 2 epochs

    set_seed(0)
    tok = AutoTokenizer.from_pretrained(model)
    splits = load_splits(TASKS["mrpc"], folder, None)
    data = {
        s: d.map(
            lambda r: tok(r["sentence1"], r["sentence2"], truncation=True, max_length=1024), batched=True
        ).select_columns(["input_ids", "attention_mask", "label"])
        for s, d in splits.items()
    }
    reference = AutoModelForSequenceClassification.from_pretrained(model, num_labels=2)
    optimizer = torch.optim.AdamW(
        reference.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"), num_train_epochs=2, per_device_train_batch_size=8,
        per_device_eval_batch_size=32, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
        load_best_model_at_end=True, metric_for_best_model="accuracy", seed=0, report_to=[], disable_tqdm=True,
        use_cpu=True, logging_steps=1,
    )  # fmt: skip
    trainer = Trainer(
        model=reference,
        args=args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        data_collator=DataCollatorWithPadding(tok),
        compute_metrics=lambda p: compute_metrics(TASKS["mrpc"], p.predictions, p.label_ids),
        optimizers=(
            optimizer,
            torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, total, recipe)),
        ),
    )
    trainer.train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "eval_accuracy", "eval_f1"):  # each step's training loss, each evaluation
        expected = {r["step"]: r[key] for r in trainer.state.log_history if key in r}
        got = {r["step"]: r[key] for r in rows if key in r}
        assert sorted(got) == sorted(expected) == list(range(1, total + 1)), key
        assert [got[s] for s in sorted(got)] == pytest.approx([expected[s] for s in sorted(got)], rel=1e-5), (
            key
        )
    assert json.loads((out / "results.json").read_text())["best_step"] == trainer.state.best_global_step
    saved = load_file(out / "model" / "model.safetensors")
    state = trainer.model.state_dict()
    assert math.isclose(len(saved), len(state), rel_tol=0.2)  # tied weights may be stored once
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, state[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_run_with_no_complete_checkpoint_starts_again_with_fresh_logs(tmp_path, msrp_rows, tiny_official):
    """--resume on a folder whose only checkpoint is torn: the run starts at its first step, the torn checkpoint
    goes, and the stale rows of metrics.jsonl are not kept beside the new ones."""
    folder = _hub_layout(tmp_path / "data", "mrpc", {"train": msrp_rows[:40], "validation": msrp_rows[40:]})
    out = tmp_path / "run"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 99.0}\n{"step": 7, "loss": 99.0}\n')
    _glue(
        "MRPC",
        "epochs=1",
        *_on(tiny_official, folder, out),
        "--resume",
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5] and 99.0 not in [
        r.get("loss") for r in rows
    ]
    assert not (out / "checkpoint-3").exists() and (out / "results.json").is_file()


def test_a_glue_run_stopped_on_one_process_resumes_on_two(
    tmp_path, msrp_rows, tiny_official, monkeypatch, capsys
):
    """GLUE's batch_size is the global batch: a run stopped on 1 process continues on 2 (each takes half of every
    batch) to the uninterrupted run's step count and, within fp32 rounding, its validation scores."""
    import subprocess

    from test_distributed import REPO, _env, _launch

    args, out, full = _a_run_stopped_at_step_4(tmp_path, msrp_rows, tiny_official, monkeypatch, capsys)
    r = subprocess.run(
        [*_launch(2), "-m", "neoembed", "glue", *args, "--out", str(out), "--resume"],
        capture_output=True, text=True, timeout=600, env=_env(HF_HUB_OFFLINE="1"), cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "run_record.json").read_text())["world_size"] == 2  # the resume ran on two
    result = json.loads((out / "results.json").read_text())
    assert result["steps"] == full["steps"] == 10
    assert result["validation"]["validation"] == pytest.approx(full["validation"]["validation"], abs=1e-4)


def test_loading_says_in_a_line_which_weights_are_new_and_warns_of_missing_encoder_ones(
    tmp_path, tiny_official, caplog, capfd
):
    """transformers' loading bar and its load report table give way to one line naming the new classifier's
    weights; a checkpoint that lacks some of the encoder's weights (they would train from random values) is
    named in a warning; a transfer from a classifier of another label count names the restarted weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from neoembed.glue.run import _load_model

    with caplog.at_level("INFO", logger="neoembed"):
        mrpc = _load_model(get_task("MRPC"), str(tiny_official), transfer=False)
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err and "Loading weights" not in err, err
    assert "a new classifier (classifier.bias, classifier.weight, dense.bias, dense.weight)" in caplog.text
    assert "WARNING" not in caplog.text, caplog.text

    mrpc.save_pretrained(tmp_path / "mrpc")
    caplog.clear()
    with caplog.at_level("INFO", logger="neoembed"):
        _load_model(get_task("STS-B"), str(tmp_path / "mrpc"), transfer=True)
    assert "a new classifier (classifier.bias, classifier.weight)" in caplog.text, caplog.text

    partial = tmp_path / "partial"
    shutil.copytree(tiny_official, partial)
    weights = load_file(partial / "model.safetensors")
    dropped = sorted(k for k in weights if "encoder" in k or "transformer" in k)[:2]
    save_file({k: v for k, v in weights.items() if k not in dropped}, partial / "model.safetensors")
    caplog.clear()
    with caplog.at_level("INFO", logger="neoembed"):
        _load_model(get_task("MRPC"), str(partial), transfer=False)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "lacks 2 of the encoder's weights" in warned[0], caplog.text
