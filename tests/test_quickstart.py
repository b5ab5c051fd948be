"""The quickstart: a real retrieval set from Python's docs, and the whole pipeline end to end (short run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from neoembed.quickstart import build_pydoc_retrieval
from neoembed.runs import OutputDirError


def test_pydoc_retrieval_set(tmp_path):
    counts = build_pydoc_retrieval(tmp_path)
    assert counts["train_pairs"] > 300 and counts["test_queries"] > 50
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert all(row["query"] not in row["positive"] for row in train)  # the summary line is removed
    task = tmp_path / "eval" / "PythonDocsRetrieval"
    test_docs = {json.loads(line)["text"] for line in (task / "corpus.jsonl").read_text().splitlines()}
    assert not test_docs & {row["positive"] for row in train}  # held-out modules
    assert (task / "task.yaml").is_file() and (task / "qrels" / "test.jsonl").is_file()


def test_quickstart_end_to_end_tiny_backbone(tmp_path, tiny_official):
    """The whole pipeline (data, eval before, train, eval after, table, save, encode) with a tiny NeoBERT."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "neoembed",
            "quickstart",
            "--output",
            str(tmp_path),
            "--steps",
            "2",
            "--model",
            str(tiny_official),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "PythonDocsRetrieval nDCG@10" in r.stdout and "before" in r.stdout and "after 2 steps" in r.stdout
    assert "encode([...]) -> array of shape (2, 64)" in r.stdout
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "nDCG" not in line]
    assert [row.split("|")[2].strip() for row in rows] == ["none", "yes", "yes"]  # the fair baseline too
    assert (tmp_path / "model" / "model.safetensors").is_file()
    assert (tmp_path / "results" / "quickstart.md").is_file()


def test_an_interrupted_quickstart_continues_with_resume(tmp_path, tiny_official, run_neoembed, sigterm_at):
    """A signal in the quickstart's training said "continue with --resume", which quickstart did not take: a rerun
    was refused and --overwrite threw the checkpoint away (#43)."""
    from neoembed.train import trainer as trainer_mod

    out = tmp_path / "q"
    args = ["quickstart", "--output", str(out), "--steps", "4", "--model", str(tiny_official)]
    real = trainer_mod.unified_step
    sigterm_at(trainer_mod, "unified_step", 2)
    r = run_neoembed(args)
    assert r.exit_code == 143 and "continue with --resume" in r.stderr, r.stderr[-2000:]
    trainer_mod.unified_step = real  # sigterm_at's monkeypatch puts it back after the test as well
    r = run_neoembed(args)
    assert r.exit_code == 2 and "pass --resume to continue" in r.stderr, r.stderr[-2000:]
    r = run_neoembed([*args, "--resume"])
    assert r.exit_code == 0 and "after 4 steps" in r.stdout, r.stderr[-3000:]
    record = json.loads((out / "model" / "run_record.json").read_text())
    assert record["finished"]["step"] == 4
    scored = sorted(out.glob("results/*/PythonDocsRetrieval.json"))
    stamps = [p.stat().st_mtime_ns for p in scored]
    # finished: reported again, nothing trained nor scored again; omitted, --steps and --model are the run's
    r = run_neoembed(["quickstart", "--output", str(out), "--resume"])
    assert r.exit_code == 0 and "after 4 steps" in r.stdout, r.stderr[-3000:]
    assert len(scored) == 3 and [p.stat().st_mtime_ns for p in scored] == stamps
    # other steps trained the model on to step 6, then failed at the results folders (walk P's B3)
    r = run_neoembed([*args[:4], "6", *args[5:], "--resume"])
    assert r.exit_code == 2 and f"was started with --steps 4 --model {tiny_official}" in r.stderr, r.stderr[-2000:]
    assert json.loads((out / "model" / "run_record.json").read_text())["finished"]["step"] == 4
    from neoembed.quickstart import _same_quickstart  # an option given as its default is the default (walk R)

    early = tmp_path / "defaults"
    early.mkdir()
    (early / "quickstart.json").write_text('{"written_by": "neoembed quickstart", "steps": null, "model": null}\n')
    assert _same_quickstart(early, None, "packaged:all-MiniLM-L6-v2") == (None, None)
    with pytest.raises(OutputDirError, match="was started with the defaults"):
        _same_quickstart(early, None, str(tiny_official))
    r = run_neoembed(["quickstart", "--output", str(tmp_path / "new"), "--resume"])
    assert r.exit_code == 2 and "holds no quickstart to continue" in r.stderr
    early = tmp_path / "early"  # stopped before its training started: nothing in model/ to continue from
    early.mkdir()
    (early / "quickstart.json").write_text('{"written_by": "neoembed quickstart"}\n')
    r = run_neoembed(["quickstart", "--output", str(early), "--steps", "2", "--model", str(tiny_official), "--resume"])
    assert r.exit_code == 0 and "after 2 steps" in r.stdout, r.stderr[-3000:]


def test_a_quickstart_killed_before_its_first_checkpoint_trains_again_on_resume(
    tmp_path, tiny_official, run_neoembed, sigterm_at
):
    """Walk AB: the quickstart's recipe saves at the end only (save_steps 1000), so a SIGKILL in its training left
    model/ without a checkpoint; --resume then said "holds no complete checkpoint: start the run again without
    --resume" and a run without it "is not empty: pass --resume". --resume trains again from the start, and the
    scores before training are kept, not scored again."""
    import shutil

    from neoembed.train import trainer as trainer_mod

    out = tmp_path / "q"
    args = ["quickstart", "--output", str(out), "--steps", "4", "--model", str(tiny_official)]
    real = trainer_mod.unified_step
    sigterm_at(trainer_mod, "unified_step", 2)
    assert run_neoembed(args).exit_code == 143
    trainer_mod.unified_step = real
    for ckpt in (out / "model").glob("checkpoint-*"):  # what a SIGKILL leaves: the run record, no checkpoint
        shutil.rmtree(ckpt)
    before = sorted(out.glob("results/before*/PythonDocsRetrieval.json"))
    stamps = [p.stat().st_mtime_ns for p in before]
    r = run_neoembed([*args, "--resume"])
    assert r.exit_code == 0 and "stopped before its first checkpoint: it starts again" in r.stdout, r.stderr[-3000:]
    assert "after 4 steps" in r.stdout
    assert json.loads((out / "model" / "run_record.json").read_text())["finished"]["step"] == 4
    assert len(before) == 2 and [p.stat().st_mtime_ns for p in before] == stamps


@pytest.mark.slow
def test_quickstart_end_to_end_short(tmp_path):
    """The README's command with its real backbone (packaged MiniLM), 2 steps instead of the recipe's 120."""
    r = subprocess.run(
        [sys.executable, "-m", "neoembed", "quickstart", "--output", str(tmp_path), "--steps", "2"],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "PythonDocsRetrieval nDCG@10" in r.stdout and "before" in r.stdout and "after 2 steps" in r.stdout
    assert "all-MiniLM-L6-v2 (packaged)" in r.stdout
    assert "truncated, as in the quoted numbers" in r.stdout and "max_seq_length=" not in r.stderr
    assert "encode([...]) -> array of shape (2, 384)" in r.stdout
    assert (tmp_path / "model" / "model.safetensors").is_file()


def test_data_lost_a_used_output_is_refused_without_overwrite(tmp_path, capsys, monkeypatch):
    from neoembed.cli import main

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["neoembed", "quickstart", "--output", str(tmp_path), *args])
        with pytest.raises(SystemExit) as e:
            main()
        return e.value.code, capsys.readouterr().err

    (tmp_path / "notes.txt").write_text("mine")
    code, err = run()  # not "pass --overwrite to replace the quickstart it holds": it holds none (#43, Q04)
    assert code == 2 and "holds files no quickstart wrote" in err and str(tmp_path) in err
    code, err = run("--overwrite")  # a folder no quickstart wrote is never cleared
    assert code == 2 and "is not this command's folder" in err
    (tmp_path / "notes.txt").unlink()
    (tmp_path / "quickstart.json").write_text("{}")  # an earlier quickstart's folder
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "quickstart.md").write_text("scores")
    code, err = run()
    assert code == 2 and "--overwrite" in err
    assert (tmp_path / "results" / "quickstart.md").read_text() == "scores"


def test_the_truncation_warning_becomes_the_quickstarts_own_line(capsys):
    """#44 walk: the quickstart printed the encoder's truncation warning, whose fix (a recipe's max_length,
    --max-length) the quickstart has no way to take; it says the documents are truncated as in the quoted
    numbers, once, and lets every other warning through."""
    import warnings

    from neoembed.encode_checks import TruncationWarning
    from neoembed.quickstart import _truncation_noted

    with pytest.warns(UserWarning, match="another warning") as seen, _truncation_noted():
        for n in (15, 3):
            warnings.warn(f"{n} text(s) exceed max_seq_length=256 tokens", TruncationWarning, stacklevel=1)
        warnings.warn("another warning", UserWarning, stacklevel=1)
    assert not [w for w in seen if issubclass(w.category, TruncationWarning)]
    out = capsys.readouterr().out
    assert out.count("truncated, as in the quoted numbers") == 1, out
