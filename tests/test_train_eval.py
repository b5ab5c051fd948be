"""Evaluation during training (``eval:``) and the best checkpoint kept (``keep_best:``) in the unified trainer."""

from __future__ import annotations

import gzip
import json
import os
import signal
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from neoembed.eval.runner import EvalConfig, run_mteb
from neoembed.eval.training import MtebEvaluator
from neoembed.recipe import load_recipe
from neoembed.runs import TrainingInterrupted
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
    out = _train(_recipe(tmp_path / "run", tiny_official, trecqa, "save_total_limit=null"))
    logged = _rows(out, "eval_ndcg_at_10")
    assert sorted(logged) == [2, 4, 6] and _rows(out, "eval_TrecQA_ndcg_at_10") == logged
    assert len(set(logged.values())) > 1  # the model changes between evaluations
    for step, score in logged.items():  # what `neoembed mteb --model RUN/checkpoint-N --tasks TASK` reports
        cfg = EvalConfig(
            model=str(out / f"checkpoint-{step}"), output=tmp_path / f"mteb-{step}", tasks=[str(trecqa)]
        )
        entry = run_mteb(cfg).scores["TrecQA"]
        ndcg = entry["mteb"]["scores"]["test"][0]["ndcg_at_10"]
        assert score == pytest.approx(ndcg, abs=1e-9)
        assert (
            json.loads((out / "eval" / f"step-{step}" / "TrecQA.json").read_text())["main_score"]
            == entry["main_score"]
        )
    assert (out / "training_curves.png").is_file()
    # evaluating does not move the training: the same losses as the same run without eval:
    plain = load_recipe(
        TINY,
        UnifiedRecipe,
        [f"model={tiny_official}", f"output_dir={tmp_path / 'plain'}"]
        + ["datasets=[{card: pydoc_names, max_rows: 64}]", "steps=6", "save_steps=100"],
    )
    assert _rows(train(plain, recipe_dir=TINY.parent), "loss") == _rows(out, "loss")


def test_keep_best_survives_rotation_and_an_interrupted_resumed_run(
    tmp_path, tiny_official, trecqa, monkeypatch
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

    on_log = trainer_mod._MetricsCallback.on_log

    def on_log_then_sigterm(self, args, state, control, logs=None, **kwargs):
        on_log(self, args, state, control, logs=logs, **kwargs)
        if state.global_step == best_step + 1 and logs and "loss" in logs:
            os.kill(os.getpid(), signal.SIGTERM)

    out = tmp_path / "resumed"
    recipe = _recipe(out, tiny_official, trecqa, *best)
    monkeypatch.setattr(trainer_mod._MetricsCallback, "on_log", on_log_then_sigterm)
    with pytest.raises(TrainingInterrupted):
        _train(recipe)
    # the newest checkpoint (the step after the signal's) and the best one: rotation (save_total_limit 1) spared it
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        f"checkpoint-{best_step}",
        f"checkpoint-{best_step + 2}",
    ]
    monkeypatch.setattr(trainer_mod._MetricsCallback, "on_log", on_log)
    _train(recipe, resume=True)
    assert _rows(out, "eval_ndcg_at_10") == pytest.approx(scores, abs=1e-9)  # each step once, same scores
    assert sorted(p.name for p in out.glob("checkpoint-*")) == kept
    assert _same_weights(out, full)
    assert f"checkpoint of step {best_step} of 8" in (out / "README.md").read_text()


def test_keep_best_without_eval_is_refused_with_the_fix(tmp_path, tiny_official, trecqa):
    with pytest.raises(Exception, match="add an eval: block"):
        load_recipe(TINY, UnifiedRecipe, [f"model={tiny_official}", "keep_best={metric: ndcg_at_10}"])
    with pytest.raises(Exception, match="multiple of eval.steps"):
        _recipe(tmp_path, tiny_official, trecqa, "save_steps=3", "keep_best={metric: ndcg_at_10}")
    with pytest.raises(ValueError, match="no evaluator was given"):
        train(_recipe(tmp_path / "x", tiny_official, trecqa), recipe_dir=TINY.parent)


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def test_adding_or_changing_eval_does_not_block_a_resume(tmp_path, tiny_official, trecqa):
    from neoembed.runs import resume_settings

    with_eval = _recipe(tmp_path, tiny_official, trecqa)
    other = _recipe(tmp_path, tiny_official, trecqa, "eval.steps=3", "eval.metric=map_at_10")
    without = with_eval.model_copy(update={"eval": None})
    assert resume_settings(with_eval) == resume_settings(other) == resume_settings(without)
    assert resume_settings(with_eval)["steps"] == 6  # the trajectory keys are still compared


def test_a_held_out_slice_of_the_training_cards_is_never_trained_on_and_scores_as_neoembed_mteb(
    tmp_path, tiny_official
):
    """eval.holdout: rows of a card drawn with a seed, out of training with every row sharing a text with them,
    recorded in the run record, written as a reranking task card that `neoembed mteb` scores on a checkpoint
    exactly as the evaluation during training did."""
    from neoembed.train.holdout import holdout_task_paths, split_holdout
    from neoembed.train.trainer import prepare_datasets

    settings = (
        f"model={tiny_official}", f"output_dir={tmp_path / 'run'}", "steps=4", "save_steps=2",
        "save_total_limit=5", "datasets=[{card: pydoc_names, max_rows: 64}, {card: pydoc_details, max_rows: 64}]",
        "eval={steps: 2, holdout: {rows: 16, seed: 3, cards: [pydoc_names]}, metric: ndcg_at_10}",
    )  # fmt: skip
    recipe = load_recipe(TINY, UnifiedRecipe, list(settings))
    datasets, _, sizes = prepare_datasets(recipe, TINY.parent)
    trained, held = split_holdout(recipe, datasets, sizes)
    assert len(held["pydoc_names"]) == 16 and len(trained["pydoc_names"]) <= 48
    held_texts = set(held["pydoc_names"]["query"]) | set(held["pydoc_names"]["positive"])
    for rows in trained.values():
        assert not held_texts & (set(rows["query"]) | set(rows["positive"]))
    again = split_holdout(recipe, prepare_datasets(recipe, TINY.parent)[0], sizes)[1]
    assert again["pydoc_names"]["query"] == held["pydoc_names"]["query"]  # seeded: the same slice every run
    (task,) = holdout_task_paths(recipe)
    out = train(recipe, recipe_dir=TINY.parent, evaluator=MtebEvaluator(recipe.eval, TINY.parent, [task]))
    record = json.loads((out / "run_record.json").read_text())
    assert record["holdout"]["pydoc_names"]["rows"] == 16 and record["holdout"]["pydoc_names"]["seed"] == 3
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["eval_Holdout-pydoc_names_ndcg_at_10"] for r in rows if "eval_ndcg_at_10" in r}
    assert sorted(logged) == [2, 4]
    report = run_mteb(EvalConfig(model=str(out / "checkpoint-2"), output=tmp_path / "mteb", tasks=[task]))
    scores = report.scores["Holdout-pydoc_names"]["mteb"]["scores"]["test"]
    assert scores[0]["ndcg_at_10"] == pytest.approx(logged[2], abs=1e-9)
    with pytest.raises(Exception, match="eval.holdout.rows=60"):
        bad = load_recipe(TINY, UnifiedRecipe, [*settings[:-1], "eval={steps: 2, holdout: {rows: 60}}"])
        split_holdout(bad, prepare_datasets(bad, TINY.parent)[0], sizes)
