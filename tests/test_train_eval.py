"""Evaluation during training (``eval:``) and the best checkpoint kept (``keep_best:``) in the unified trainer."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from neoembed.eval.runner import EvalConfig, run_mteb
from neoembed.eval.training import MtebEvaluator
from neoembed.recipe import RecipeError, check_keep_best_scores, load_recipe
from neoembed.runs import RunFinished, TrainingInterrupted
from neoembed.train import trainer as trainer_mod
from neoembed.train.recipe import UnifiedRecipe
from neoembed.train.trainer import train

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"


@pytest.fixture(scope="module")
def trecqa(shared_dir, tmp_path_factory) -> Path:
    """The first 10 queries of the real TrecQA test split (a reranking task: ndcg_at_10 among its scores)."""
    src, task = shared_dir / "data" / "eval" / "TrecQA", tmp_path_factory.mktemp("tasks") / "TrecQA"
    task.mkdir()
    with gzip.open(src / "test.jsonl.gz", "rt") as f:
        rows = [next(f) for _ in range(10)]
    with gzip.open(task / "test.jsonl.gz", "wt") as f:
        f.writelines(rows)
    card = yaml.safe_load((src / "card.yaml").read_text())
    card["splits"] = {"test": len(rows)}
    (task / "card.yaml").write_text(yaml.safe_dump(card))
    return task


def _recipe(out, tiny_official, task, *overrides):
    return load_recipe(
        TINY,
        UnifiedRecipe,
        [
            f"model={tiny_official}",
            f"output_dir={out}",
            "datasets=[{card: pydoc_names, max_rows: 64}]",
            "steps=6",
            "save_steps=2",
            f"eval={{steps: 2, tasks: [{task}], metric: ndcg_at_10}}",
            *overrides,
        ],
    )


def _train(recipe, **kw):
    return train(recipe, recipe_dir=TINY.parent, evaluator=MtebEvaluator(recipe.eval, TINY.parent), **kw)


def _rows(out: Path, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def test_scores_logged_during_training_equal_neoembed_mteb_on_the_checkpoints(
    tmp_path, tiny_official, trecqa
):
    """... and on the final model: a training max_length (32 here, shorter than TrecQA's answers) sizes the training
    batches; scores were taken, and checkpoints saved, at it while the final model carries the base model's
    limit, so the card's best score did not reproduce from the model it describes (#43)."""
    short = "max_length=32"
    out = _train(_recipe(tmp_path / "run", tiny_official, trecqa, "save_total_limit=null", short))
    logged = _rows(out, "eval_ndcg_at_10")
    assert sorted(logged) == [2, 4, 6] and _rows(out, "eval_TrecQA_ndcg_at_10") == logged
    assert len(set(logged.values())) > 1  # the model changes between evaluations
    for step, score in [*logged.items(), ("final", logged[6])]:  # `neoembed mteb --model RUN/checkpoint-N`
        model = out if step == "final" else out / f"checkpoint-{step}"
        cfg = EvalConfig(model=str(model), output=tmp_path / f"mteb-{step}", tasks=[str(trecqa)])
        entry = run_mteb(cfg).scores["TrecQA"]
        ndcg = entry["mteb"]["scores"]["test"][0]["ndcg_at_10"]
        assert score == pytest.approx(ndcg, abs=1e-9), step
        logged_entry = out / "eval" / f"step-{6 if step == 'final' else step}" / "TrecQA.json"
        assert json.loads(logged_entry.read_text())["main_score"] == entry["main_score"]
    assert (out / "training_curves.png").is_file()
    # evaluating does not move the training: the same losses as the same run without eval:
    plain = load_recipe(
        TINY,
        UnifiedRecipe,
        [f"model={tiny_official}", f"output_dir={tmp_path / 'plain'}"]
        + ["datasets=[{card: pydoc_names, max_rows: 64}]", "steps=6", "save_steps=100", short],
    )
    assert _rows(train(plain, recipe_dir=TINY.parent), "loss") == _rows(out, "loss")


def test_keep_best_survives_rotation_and_an_interrupted_resumed_run(
    tmp_path, tiny_official, trecqa, monkeypatch, sigterm_at
):
    # min: a middle step wins here; 8 steps leave room to interrupt after it
    best = ("keep_best={metric: ndcg_at_10, mode: min}", "save_total_limit=1", "steps=8")
    full = _train(_recipe(tmp_path / "full", tiny_official, trecqa, *best))
    scores = _rows(full, "eval_ndcg_at_10")
    best_step = min(scores, key=scores.get)
    assert best_step < 6, scores  # the run's trajectory puts the best before the end (else nothing to test)
    kept = sorted(p.name for p in full.glob("checkpoint-*"))
    assert kept == [f"checkpoint-{best_step}", "checkpoint-8"]  # save_total_limit 1: the newest, and the best
    assert _same_weights(full, full / f"checkpoint-{best_step}")  # the final model is the best checkpoint
    card = (full / "README.md").read_text()
    assert f"checkpoint of step {best_step} of 8" in card and f"{scores[best_step]:.6g}" in card

    out = tmp_path / "resumed"
    recipe = _recipe(out, tiny_official, trecqa, *best)
    real = trainer_mod.unified_step
    sigterm_at(trainer_mod, "unified_step", best_step + 1)
    with pytest.raises(TrainingInterrupted):
        _train(recipe)
    # the newest checkpoint (the step after the signal's) and the best one: rotation (save_total_limit 1) spared it
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        f"checkpoint-{best_step}",
        f"checkpoint-{best_step + 2}",
    ]
    monkeypatch.setattr(trainer_mod, "unified_step", real)
    _train(recipe, resume=True)
    assert _rows(out, "eval_ndcg_at_10") == pytest.approx(scores, abs=1e-9)  # each step once, same scores
    assert sorted(p.name for p in out.glob("checkpoint-*")) == kept
    assert _same_weights(out, full)
    assert f"checkpoint of step {best_step} of 8" in (out / "README.md").read_text()


def test_keep_best_without_eval_is_refused_with_the_fix(tmp_path, tiny_official, trecqa):
    for switch in ("true", "ndcg_at_10"):  # a switch or a bare name: the form is shown
        with pytest.raises(RecipeError, match=r"keep_best names the score .*\{metric: main_score\} \(eval.metric"):
            load_recipe(TINY, UnifiedRecipe, [f"model={tiny_official}", f"keep_best={switch}"])
    # the form shown is one the recipe takes (it showed eval_main_score, which the next check refused)
    shown = _recipe(tmp_path, tiny_official, trecqa, "eval.metric=main_score", "keep_best={metric: main_score}")
    check_keep_best_scores(shown, ["TrecQA"])
    with pytest.raises(Exception, match="add an eval: block"):
        load_recipe(TINY, UnifiedRecipe, [f"model={tiny_official}", "keep_best={metric: ndcg_at_10}"])
    with pytest.raises(Exception, match="eval.steps 2 must be a multiple of save_steps 3"):
        _recipe(tmp_path, tiny_official, trecqa, "save_steps=3", "keep_best={metric: ndcg_at_10}")
    with pytest.raises(ValueError, match="no evaluator was given"):
        train(_recipe(tmp_path / "x", tiny_official, trecqa), recipe_dir=TINY.parent)


def test_case3_keep_best_unsaved_step_refused(tmp_path, tiny_official, trecqa, run_neoembed):
    """The issue's recipe (eval every 2 steps, checkpoints every 4) could make an unsaved step the best: refused
    before any model loads, naming both keys and the fix. The other way round (eval every 4, save every 2) every
    evaluated step has a checkpoint, transformers' own opposite check does not refuse it, and the final model is
    the best step's checkpoint."""
    with pytest.raises(ValueError) as refused:
        _recipe(tmp_path, tiny_official, trecqa, "save_steps=4", "keep_best={metric: ndcg_at_10}")
    message = str(refused.value)
    assert "eval.steps 2 must be a multiple of save_steps 4" in message
    assert "save_steps: 2" in message and "eval.steps: 4" in message
    out = tmp_path / "cli"
    run = run_neoembed(
        ["train", str(TINY), f"model={tiny_official}", f"output_dir={out}", "steps=12"]
        + ["save_steps=4", f"eval={{steps: 2, tasks: [{trecqa}]}}", "keep_best={metric: ndcg_at_10}"]
    )
    assert run.exit_code == 2 and "eval.steps 2 must be a multiple of save_steps 4" in run.stderr, run.stderr
    assert not out.exists()  # refused before anything was written (or loaded)
    keep = ("eval.steps=4", "steps=8", "save_total_limit=null", "keep_best={metric: ndcg_at_10, mode: min}")
    full = _train(_recipe(tmp_path / "ok", tiny_official, trecqa, *keep))
    scores = _rows(full, "eval_ndcg_at_10")
    assert sorted(scores) == [4, 8]
    best = min(scores, key=scores.get)
    assert all((full / f"checkpoint-{step}").is_dir() for step in scores)
    assert _same_weights(full, full / f"checkpoint-{best}")
    assert f"checkpoint of step {best} of 8" in (full / "README.md").read_text()


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def test_a_failed_evaluation_keeps_its_steps_and_the_resume_runs_it_first(
    tmp_path, tiny_official, trecqa, monkeypatch, caplog
):
    """An evaluation that fails (a metric no task logs, a broken task) stopped the run before its step was saved:
    every step since the last checkpoint was lost, and with keep_best (checkpoints only at evaluated steps) all
    of them (#43, a walk's R26). Now the step is saved, marked, and a resume runs that evaluation first: the
    run ends as one never stopped. keep_best.metric may change only until a score has counted."""
    best = ("keep_best={metric: ndcg_at_10, mode: min}",)
    full = _train(_recipe(tmp_path / "full", tiny_official, trecqa, *best))
    out = tmp_path / "run"
    recipe = _recipe(out, tiny_official, trecqa, *best)
    real = MtebEvaluator.__call__

    def broken(self, model, output_path=None, epoch=-1, steps=-1):
        scores = real(self, model, output_path, epoch, steps)  # its folder written, as mteb writes it
        if steps == 4:
            raise ValueError("a score the evaluation cannot read")
        return scores

    monkeypatch.setattr(MtebEvaluator, "__call__", broken)
    with pytest.raises(ValueError, match="a score the evaluation cannot read"):
        _train(recipe)
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["evaluation_due"] and state["best"]["step"] == 2
    monkeypatch.setattr(MtebEvaluator, "__call__", real)
    other = _recipe(out, tiny_official, trecqa, "keep_best={metric: TrecQA_ndcg_at_10, mode: min}")
    with pytest.raises(ValueError, match="keeps its best step by eval_ndcg_at_10 .*keep_best.metric=ndcg_at_10"):
        _train(other, resume=True)
    # another evaluation would score later steps on other terms than the best so far: refused by name
    other = _recipe(out, tiny_official, trecqa, *best, "eval.instructions=none")
    with pytest.raises(ValueError, match=r"best so far \(step 2, .*other evaluation settings \(eval.instructions: "
                       r"'\w+' then, 'none' now\)"):  # fmt: skip
        _train(other, resume=True)
    caplog.clear()
    _train(_recipe(out, tiny_official, f"{trecqa}/../{trecqa.name}/", *best), resume=True)  # the same task folder
    assert "clearing" not in caplog.text  # the failed attempt's folder is the evaluator's own to replace
    assert _rows(out, "eval_ndcg_at_10") == pytest.approx(_rows(full, "eval_ndcg_at_10"), abs=1e-9)
    assert _same_weights(out, full)
    assert json.loads((out / "best.json").read_text()) == json.loads((full / "best.json").read_text())


def test_eval_data_edited_in_place_before_a_resume_is_refused_with_keep_best(
    tmp_path, tiny_official, trecqa, monkeypatch, sigterm_at, caplog
):
    """keep_best compared the scores after a resume with the best so far even when the eval task's files were
    edited in place meanwhile (same path, other data): the best step was picked by the data (#43). Now that
    evaluation fails (the run's steps saved), and with the files put back the resume goes on; without keep_best
    a warning says from which step the scores do not compare."""
    task = tmp_path / "TrecQA"
    task.mkdir()
    for f in trecqa.iterdir():
        (task / f.name).write_bytes(f.read_bytes())
    best = ("keep_best={metric: ndcg_at_10, mode: max}",)
    out, real = tmp_path / "run", trainer_mod.unified_step
    sigterm_at(trainer_mod, "unified_step", 3)
    with pytest.raises(TrainingInterrupted):
        _train(_recipe(out, tiny_official, task, *best))
    monkeypatch.setattr(trainer_mod, "unified_step", real)
    data, kept = task / "test.jsonl.gz", (task / "test.jsonl.gz").read_bytes()
    with gzip.open(data, "rt") as f:
        rows = f.readlines()
    with gzip.open(data, "wt") as f:
        f.writelines(rows[:5])  # the same task, half its queries
    resumed = _recipe(out, tiny_official, task, *best)
    compares = MtebEvaluator(resumed.eval, TINY.parent, compares=True)  # as neoembed train builds it
    with pytest.raises(ValueError, match=r"eval task\(s\) TrecQA changed since the evaluation at step 4 .*step 6 "
                       r".*keep_best compares"):  # fmt: skip
        train(resumed, recipe_dir=TINY.parent, evaluator=compares, resume=True)
    data.write_bytes(kept)
    train(resumed, recipe_dir=TINY.parent, evaluator=compares, resume=True)
    assert sorted(_rows(out, "eval_ndcg_at_10")) == [2, 4, 6]
    assert json.loads((out / "best.json").read_text())["last_step"] == 6
    with gzip.open(data, "wt") as f:
        f.writelines(rows[:5])
    caplog.clear()
    plain = MtebEvaluator(resumed.eval, TINY.parent)
    plain._check_same_data(out / "eval", 8, {"TrecQA": {"data_fingerprint": "edited"}})
    assert "TrecQA changed since the evaluation at step 6 (its files were edited): scores from step 8" in caplog.text


def test_adding_or_changing_eval_does_not_block_a_resume(tmp_path, tiny_official, trecqa):
    from neoembed.runs import resume_settings

    with_eval = _recipe(tmp_path, tiny_official, trecqa)
    other = _recipe(tmp_path, tiny_official, trecqa, "eval.steps=3", "eval.metric=map_at_10")
    without = with_eval.model_copy(update={"eval": None})
    assert resume_settings(with_eval) == resume_settings(other) == resume_settings(without)
    assert resume_settings(with_eval)["steps"] == 6  # the trajectory keys are still compared


HOLDOUT = (
    "datasets=[{card: pydoc_names, max_rows: 64}, {card: pydoc_details, max_rows: 64}]",
    "steps=4", "save_steps=2", "save_total_limit=null",
    "eval={steps: 2, holdout: {rows: 16, seed: 3, cards: [pydoc_names]}, metric: ndcg_at_10}",
    "keep_best={metric: Holdout-pydoc_names_ndcg_at_10, mode: max}",
)  # fmt: skip


def _holdout_recipe(out, tiny_official, *overrides):
    return load_recipe(
        TINY, UnifiedRecipe, [f"model={tiny_official}", f"output_dir={out}", *HOLDOUT, *overrides]
    )


def _train_holdout(recipe, **kw):
    from neoembed.train.holdout import holdout_task_paths

    tasks = holdout_task_paths(recipe, TINY.parent)  # what neoembed train hands the evaluator
    return train(
        recipe, recipe_dir=TINY.parent, evaluator=MtebEvaluator(recipe.eval, TINY.parent, tasks), **kw
    )


def _batches_seen(monkeypatch) -> list[str]:
    """Every text of every training batch, as the collator receives it."""
    from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator as C

    seen, call = [], C.__call__

    def recording(self, features):
        seen.extend(v for f in features for k, v in f.items() if k != "dataset_name" and isinstance(v, str))
        return call(self, features)

    monkeypatch.setattr(C, "__call__", recording)
    return seen


def test_a_held_out_slice_is_never_trained_on_and_scores_as_neoembed_mteb_and_keep_best(
    tmp_path, tiny_official, monkeypatch
):
    """eval.holdout: 16 rows of pydoc_names drawn with seed 3; none of their queries or positives in any training
    batch (pydoc_details' queries are pydoc_names' positives: those rows go too); identity in the run record; a
    retrieval task folder that `neoembed mteb --tasks FOLDER` scores on a checkpoint exactly as logged; keep_best
    on the holdout's metric keeps that checkpoint as the final model."""
    from typer.testing import CliRunner

    from neoembed.cli import app

    seen = _batches_seen(monkeypatch)
    out = _train_holdout(_holdout_recipe(tmp_path / "run", tiny_official))
    assert len(seen) == 4 * 16 * 2  # 4 steps of 16 (query, positive) pairs
    folder = out / "eval" / "holdout-pydoc_names"
    queries = [json.loads(line)["text"] for line in (folder / "queries.jsonl").read_text().splitlines()]
    corpus = [json.loads(line)["text"] for line in (folder / "corpus.jsonl").read_text().splitlines()]
    assert len(queries) == 16 and len(corpus) == 16
    task = yaml.safe_load((folder / "task.yaml").read_text())
    assert task["type"] == "Retrieval" and task["instruction"].startswith("Given the name of a Python")
    assert not any(q.startswith("Given") for q in queries)  # the instruction once: the task card's
    trained = " ".join(seen)
    assert all(text not in seen and f". {text}" not in trained for text in queries + corpus)
    record = json.loads((out / "run_record.json").read_text())["holdout"]
    held = record["cards"]["pydoc_names"]
    assert held["rows"] == 16 and held["seed"] == 3 and len(held["indices"]) == 16
    assert (
        record["rows_out_of_training"]["pydoc_names"] >= 16
        and record["rows_out_of_training"]["pydoc_details"] > 0
    )

    logged = _rows(out, "eval_Holdout-pydoc_names_ndcg_at_10")
    assert sorted(logged) == [2, 4] and logged[2] != logged[4]
    best = max(logged, key=logged.get)
    assert best == 2 and _same_weights(
        out, out / "checkpoint-2"
    )  # keep_best: min here, for the earlier step to win
    for step in logged:  # neoembed mteb --model RUN/checkpoint-N --tasks RUN/eval/holdout-pydoc_names
        args = ["mteb", "--model", str(out / f"checkpoint-{step}"), "--tasks", str(folder)]
        result = CliRunner().invoke(app, [*args, "--output", str(tmp_path / f"mteb-{step}")])
        assert result.exit_code == 0, result.output
        entry = json.loads((tmp_path / f"mteb-{step}" / "Holdout-pydoc_names.json").read_text())
        assert entry["mteb"]["scores"]["test"][0]["ndcg_at_10"] == logged[step]  # exactly

    # a resume draws the same slice and scores the same; another holdout is another run
    again = _holdout_recipe(tmp_path / "run2", tiny_official, "steps=2")
    _train_holdout(again)
    with pytest.raises(Exception, match="eval.holdout"):
        _train_holdout(_holdout_recipe(tmp_path / "run2", tiny_official, "eval.holdout.seed=4"), resume=True)
    with pytest.raises(Exception, match="eval.holdout"):
        _train_holdout(_holdout_recipe(tmp_path / "run2", tiny_official, "eval.holdout.rows=8"), resume=True)
    _train_holdout(_holdout_recipe(tmp_path / "run2", tiny_official), resume=True)
    assert json.loads((tmp_path / "run2" / "run_record.json").read_text())["holdout"] == record
    assert _rows(tmp_path / "run2", "eval_Holdout-pydoc_names_ndcg_at_10") == logged


def test_a_query_held_out_in_several_rows_is_one_query_with_all_its_positives(tmp_path):
    """Walk AA: own pairs that ask one question in several rows (TrecQA's, one row per correct answer) were
    written as one query per row, each with its own row's positive relevant and the others' counted as misses:
    a model scored 75.45 on a slice where grouping the rows gives 99.13. One query per text, every positive of
    it relevant; a positive shared by two queries is one document relevant to both."""
    from types import SimpleNamespace

    from datasets import Dataset

    from neoembed.train.holdout import write_holdout_tasks

    rows = Dataset.from_dict({
        "query": ["who wrote it", "who wrote it", "where is it", "who wrote it"],
        "positive": ["Ann wrote it.", "It was Ann's.", "It is here.", "Ann wrote it."],
        "negative": ["It is here.", "Bob read it.", "Bob read it.", ""],
    })  # fmt: skip
    recipe = SimpleNamespace(instructions=False, eval=SimpleNamespace(holdout=SimpleNamespace(seed=0)))
    cards = [(SimpleNamespace(name="mine", instruction=None), None)]
    write_holdout_tasks(tmp_path, {"mine": {"rows": rows, "indices": [0, 1, 2, 3]}}, cards, recipe)
    folder = tmp_path / "eval" / "holdout-mine"

    def read(name):
        return [json.loads(line) for line in (folder / name).read_text().splitlines()]

    queries = {q["text"]: q["_id"] for q in read("queries.jsonl")}
    corpus = {d["_id"]: d["text"] for d in read("corpus.jsonl")}
    relevant = {}
    for q in read("qrels/test.jsonl"):
        relevant.setdefault(q["query-id"], set()).add(corpus[q["corpus-id"]])
    assert sorted(queries) == ["where is it", "who wrote it"] and len(corpus) == 4
    assert relevant[queries["who wrote it"]] == {"Ann wrote it.", "It was Ann's."}
    assert relevant[queries["where is it"]] == {"It is here."}  # also a negative of another query's row
    assert "4 rows" in yaml.safe_load((folder / "task.yaml").read_text())["description"]


def test_a_bad_holdout_is_refused_before_the_model_loads(tmp_path, tiny_official, caplog):
    """rows > 0, cards of the recipe, and a card left with a batch to train on: each refused naming the fix."""
    from neoembed.data.cards import DataCardError
    from neoembed.train.holdout import check_same_holdout

    missing_model = str(tmp_path / "no-model")  # reaching the model would be another error
    with pytest.raises(RecipeError, match="eval.holdout.rows"):
        _holdout_recipe(tmp_path / "a", missing_model, "eval.holdout.rows=0")
    with pytest.raises(RecipeError, match=r"eval.holdout.cards names \['msmarco'\].*valid: \['pydoc_names'"):
        _train_holdout(_holdout_recipe(tmp_path / "b", missing_model, "eval.holdout.cards=[msmarco]"))
    with pytest.raises(DataCardError, match="card pydoc_names: 64 rows cannot give eval.holdout.rows=60"):
        _train_holdout(_holdout_recipe(tmp_path / "c", missing_model, "eval.holdout.rows=60"))
    # the card that loses rows to another's holdout is named too (pydoc_details' queries are pydoc_names' positives)
    with pytest.raises(DataCardError, match="card pydoc_details: .* rows are left for training"):
        _train_holdout(
            _holdout_recipe(
                tmp_path / "d",
                missing_model,
                "datasets=[{card: pydoc_names}, {card: pydoc_details, max_rows: 24}]",
                "eval.holdout.rows=184",
            )
        )
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    # a resume whose data would draw another slice (the run record's hash differs) is refused
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "run_record.json").write_text(
        json.dumps({"holdout": {"cards": {"x": {"texts_sha256": "0"}}}})
    )
    with pytest.raises(DataCardError, match="card x: the held-out rows differ"):
        check_same_holdout(tmp_path / "e", {"cards": {"x": {"texts_sha256": "1"}}})
    # walk AC: a card holding no rows out read "keeps no rows of this card and 69 more ... with them"
    from neoembed.train.holdout import _say_lost

    caplog.clear()
    with caplog.at_level("INFO", logger="neoembed.train.holdout"):
        _say_lost("other", 120, 0, 51)
        _say_lost("held", 342, 50, 124)
    assert [r.getMessage() for r in caplog.records if r.name == "neoembed.train.holdout"] == [
        "card other: eval.holdout takes 69 rows that share a query, positive or hard negative with held-out rows "
        "out of training: 51 of its 120 rows train",
        "card held: eval.holdout takes 50 held-out rows and 168 rows that share a query, positive or hard negative "
        "with held-out rows out of training: 124 of its 342 rows train",
    ]
    # walk AC: a run recorded before repeated held-out queries were grouped logged scores on one query per row;
    # resumed, its task was rewritten grouped and keep_best compared the two. Refused where the grouping differs.
    grouped = {"cards": {"x": {"texts_sha256": "0", "rows": 50, "queries": 26}}}
    with pytest.raises(DataCardError, match="its 50 rows hold 26 distinct queries, so the scores logged so far"):
        check_same_holdout(tmp_path / "e", grouped)
    check_same_holdout(tmp_path / "e", {"cards": {"x": {"texts_sha256": "0", "rows": 50, "queries": 50}}})
    # walk AD: an eval.tasks folder named as the holdout's task failed at the first evaluation, after training,
    # naming two temporary folders
    from neoembed.train.cli import _evaluator

    task = tmp_path / "copy"
    (task / "qrels").mkdir(parents=True)
    (task / "task.yaml").write_text("name: Holdout-pydoc_names\ntype: Retrieval\ndata: .\n")
    (task / "queries.jsonl").write_text('{"_id": "q0", "text": "a"}\n')
    (task / "corpus.jsonl").write_text('{"_id": "d0", "title": "", "text": "b"}\n')
    (task / "qrels" / "test.jsonl").write_text('{"query-id": "q0", "corpus-id": "d0", "score": 1}\n')
    recipe = _holdout_recipe(tmp_path / "f", missing_model, "keep_best=null", f"eval.tasks=[{task}]")
    with pytest.raises(RecipeError, match="eval.tasks holds a task named Holdout-pydoc_names, the name of"):
        _evaluator(recipe, TINY.parent)


def test_keep_best_patience_ends_the_run_at_the_first_unbeaten_evaluations(tmp_path, tiny_official, trecqa):
    """``keep_best.patience`` (transformers' ``EarlyStoppingCallback`` here, the run loop's in CDE, pre-training and
    GLUE): the run stops at the evaluation that leaves the best unbeaten ``patience`` times in a row, and its record
    names the step."""
    best = ("keep_best={metric: ndcg_at_10, mode: min}", "steps=8")
    scores = _rows(_train(_recipe(tmp_path / "full", tiny_official, trecqa, *best)), "eval_ndcg_at_10")
    low, stale, expected = float("inf"), 0, None
    for step, value in sorted(scores.items()):
        low, stale = (value, 0) if value < low else (low, stale + 1)
        if stale == 1 and step < 8:  # at the last step the run ends anyway
            expected = step
            break
    assert expected is not None and expected < 8, (
        scores
    )  # the trajectory has an unbeaten evaluation to stop at
    early = ("keep_best={metric: ndcg_at_10, mode: min, patience: 1}", "steps=8")
    out = _train(_recipe(tmp_path / "early", tiny_official, trecqa, *early))
    assert sorted(_rows(out, "eval_ndcg_at_10")) == [s for s in sorted(scores) if s <= expected]
    assert f"Training steps: {expected} of the 8 planned." in (out / "README.md").read_text()  # R23: said 8
    assert json.loads((out / "run_record.json").read_text())["stopped_early"] == {
        "step": expected,
        "patience": 1,
    }
    # finished, and not to be resumed "with more steps": its patience count would stop it again
    with pytest.raises(RunFinished, match=rf"finished at step {expected}, .*patience=1 ended it early") as e:
        _train(_recipe(tmp_path / "early", tiny_official, trecqa, *early), resume=True)
    assert "resume with more steps" not in str(e.value)


def test_an_eval_task_on_an_unreachable_hub_is_refused_before_training(monkeypatch, trecqa, tmp_path):
    """An mteb task name reads its data from the hub: offline, `neoembed train` trained the first eval.steps and
    then failed the evaluation with "please report it" (#43, a walk's W18). Now it is refused at the start; local
    task folders need no hub, and with HF_HUB_OFFLINE (mteb reads the local cache) a task is refused where its
    dataset is not in the cache (it trained up to the first evaluation, a docs walk's P8)."""
    import huggingface_hub.constants

    from neoembed.data import check
    from neoembed.data.cards import HubUnreachable
    from neoembed.recipe import EvalSettings

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(check, "hub_unreachable_reason", lambda: "ConnectError (no network)")
    with pytest.raises(HubUnreachable, match=r"eval.tasks \['STS16'\] read their data from the Hugging Face hub"):
        MtebEvaluator(EvalSettings(steps=2, tasks=["STS16", str(trecqa)]), TINY.parent)
    assert MtebEvaluator(EvalSettings(steps=2, tasks=[str(trecqa)]), TINY.parent).tasks == [str(trecqa)]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(check, "hub_unreachable_reason", lambda: pytest.fail("probed the hub offline"))
    with pytest.raises(HubUnreachable, match=r"eval.tasks \['STS16'\]: HF_HUB_OFFLINE is set and their datasets"):
        MtebEvaluator(EvalSettings(steps=2, tasks=["STS16", str(trecqa)]), TINY.parent)
    (tmp_path / "hub" / "datasets--mteb--sts16-sts").mkdir(parents=True)  # in the cache: mteb will read it there
    MtebEvaluator(EvalSettings(steps=2, tasks=["STS16"]), TINY.parent)


def test_an_unknown_eval_task_is_refused_before_training(tmp_path, tiny_official, trecqa, capsys, monkeypatch):
    """eval.tasks naming no task folder, card or mteb task trained every step up to the first evaluation, then
    died in mteb's KeyError ("please report it") with no checkpoint (#43, a walk's T27). A path that does not
    exist is said to be one (mteb's "not found" named no folder), and --dry-run checks the tasks too (R25)."""
    from test_runs import _cli

    recipe = _recipe(tmp_path / "out", tiny_official, "NoSuchTask")
    with pytest.raises(ValueError, match="eval.tasks: 'NoSuchTask' not found"):
        MtebEvaluator(recipe.eval, TINY.parent)
    code, said = _cli(capsys, monkeypatch, "train", str(TINY), "--dry-run", "eval={steps: 4, tasks: [no/such]}")
    assert code == 2 and "eval.tasks: no/such is no task folder or task card" in said, said
    assert MtebEvaluator(_recipe(tmp_path / "o2", tiny_official, trecqa).eval, TINY.parent).tasks == [
        str(trecqa)
    ]
    assert not (tmp_path / "out").exists()


def test_a_keep_best_metric_eval_does_not_log_is_refused_at_the_recipe(tmp_path, tiny_official, trecqa):
    """keep_best.metric with a typo was found after training to the first evaluation (transformers' KeyError,
    no checkpoint; the fixed metric then refused on --resume): #43, a walk's T28."""
    with pytest.raises(ValueError, match=r"keep_best.metric 'ndcg_at_1O' is not a score eval: logs"):
        _recipe(tmp_path, tiny_official, trecqa, "keep_best={metric: ndcg_at_1O}")
    for fine in ("ndcg_at_10", "TrecQA_ndcg_at_10"):  # the mean over tasks, one task's
        recipe = _recipe(tmp_path, tiny_official, trecqa, f"keep_best={{metric: {fine}}}")
        check_keep_best_scores(recipe, MtebEvaluator(recipe.eval, TINY.parent).task_names)
    # a task's name misspelt (R27): only the tasks know their names, so it is checked once they resolve
    recipe = _recipe(tmp_path, tiny_official, trecqa, "keep_best={metric: Trecqa_ndcg_at_10}")
    with pytest.raises(ValueError, match=r"'Trecqa_ndcg_at_10' is not a score .*did you mean 'TrecQA_ndcg_at_10'"):
        check_keep_best_scores(recipe, MtebEvaluator(recipe.eval, TINY.parent).task_names)


def test_an_eval_metric_the_tasks_type_has_no_score_of_is_refused_before_training(
    tmp_path, tiny_official, trecqa
):
    """T29 of the walk: eval.metric ndcg_at_10 over an STS task trained to the first evaluation and died there
    ("please report it"). A ranking score on a task that ranks nothing, or a correlation on a ranking task, is
    refused before training; main_score and the task's own scores pass."""
    sts = Path(__file__).parent / "shared" / "data" / "mteb" / "STS16"
    with pytest.raises(ValueError, match=r"'ndcg_at_10' is a ranking score, which task STS16 \(STS\)"):
        MtebEvaluator(_recipe(tmp_path / "a", tiny_official, sts).eval, TINY.parent)
    for task, metric in ((trecqa, "cosine_spearman"), (trecqa, "spearman")):
        with pytest.raises(ValueError, match=f"'{metric}' is a correlation"):
            MtebEvaluator(
                _recipe(tmp_path / "b", tiny_official, task, f"eval.metric={metric}").eval, TINY.parent
            )
    for task, metric in ((sts, "cosine_spearman"), (sts, "main_score"), (trecqa, "map_at_1000")):
        MtebEvaluator(_recipe(tmp_path / "c", tiny_official, task, f"eval.metric={metric}").eval, TINY.parent)


def test_on_two_processes_rank_0_evaluates_once_and_every_rank_keeps_the_same_best(
    tmp_path, tiny_official, trecqa
):
    """2 gloo processes with eval and keep_best: each evaluation is logged once and scores what one process scores
    on the same checkpoint (rank 0 runs the evaluator, sentence-transformers broadcasts its scores);
    the best step is the same on every rank: the final model is its checkpoint and rotation spared it."""
    import subprocess

    from test_distributed import REPO, _env, _launch

    out = tmp_path / "ddp"
    overrides = [
        f"model={tiny_official}", f"output_dir={out}", "datasets=[{card: pydoc_names, max_rows: 64}]", "steps=8",
        "save_steps=2", "save_total_limit=1", f"eval={{steps: 2, tasks: [{trecqa}], metric: ndcg_at_10}}",
        "keep_best={metric: ndcg_at_10, mode: min}",
    ]  # fmt: skip
    r = subprocess.run(
        [*_launch(2), "-m", "neoembed", "train", str(TINY), *overrides],
        capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "eval_ndcg_at_10" in row] == [2, 4, 6, 8]  # once each
    assert {row["world_size"] for row in rows if "loss" in row} == {2}
    scores = _rows(out, "eval_ndcg_at_10")
    best = min(scores, key=scores.get)
    kept = sorted(p.name for p in out.glob("checkpoint-*"))
    assert kept == sorted({f"checkpoint-{best}", "checkpoint-8"})
    assert _same_weights(out, out / f"checkpoint-{best}")
    assert f"checkpoint of step {best} of 8" in (out / "README.md").read_text()
    cfg = EvalConfig(model=str(out / f"checkpoint-{best}"), output=tmp_path / "one", tasks=[str(trecqa)])
    one = run_mteb(cfg).scores["TrecQA"]["mteb"]["scores"]["test"][0]["ndcg_at_10"]
    assert scores[best] == pytest.approx(one, abs=1e-6)


def test_on_two_processes_a_failed_evaluation_saves_on_every_rank_and_stops(tmp_path, tiny_official, trecqa):
    """The main process evaluates: when that failed, the others waited for its scores until the launcher ended
    them, and nothing was saved. Every process now saves the step together and stops; the main process's error
    is the one said (#43, a walk's R26)."""
    import subprocess

    from test_distributed import REPO, _env, _launch

    from neoembed.runs import list_checkpoints, verify_checkpoint

    out = tmp_path / "ddp"
    overrides = [
        f"model={tiny_official}", f"output_dir={out}", "datasets=[{card: pydoc_names, max_rows: 64}]", "steps=4",
        "save_steps=4", f"eval={{steps: 2, tasks: [{trecqa}], metric: ndcg_at_1O}}",
    ]  # fmt: skip
    r = subprocess.run(
        [*_launch(2), "-m", "neoembed", "train", str(TINY), *overrides],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO,
    )  # fmt: skip
    assert r.returncode != 0 and "did you mean 'ndcg_at_1' or 'ndcg_at_10'" in r.stderr, r.stderr[-3000:]
    assert "please report it" not in r.stderr, r.stderr[-3000:]
    (checkpoint,) = list_checkpoints(out)
    assert checkpoint.name == "checkpoint-2" and verify_checkpoint(checkpoint) is None
    assert json.loads((checkpoint / "trainer_state.json").read_text())["evaluation_due"]
