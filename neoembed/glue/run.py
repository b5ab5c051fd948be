"""GLUE fine-tuning with the NeoBERT paper's protocol (Appendix C), on the Hugging Face ``Trainer``.

One run: 10 epochs; evaluation on the validation split(s) every ``min(500, len(train_dataloader) // 10)`` steps;
early stopping after 15 evaluations without improvement of the task's selection metric; the best checkpoint is
kept (``<out>/model``) and scored. AdamW (betas 0.9 / 0.95, eps 1e-8) and the official schedule
(chandar-lab/NeoBERT ``conf/scheduler/glue.yaml``: 6% linear warm-up, linear decay to 10% of the peak at 90% of
the steps, constant after). ``--grid`` runs the paper's search (Table 6's caption), each run in its own folder:
finished runs are skipped, unfinished ones resume from their last checkpoint, and ``grid.md`` / ``grid.json``
hold one table. Works for any encoder ``AutoModelForSequenceClassification`` loads.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from neoembed.glue.tasks import GlueTask, check_columns, compute_metrics, load_splits, task_score
from neoembed.recipe import Recipe, StrictModel
from neoembed.record import atomic_write_text, write_run_record
from neoembed.runs import (
    StopSignal,
    TrainingInterrupted,
    commit_checkpoint,
    find_resume_checkpoint,
    list_checkpoints,
    save_final_model,
    stage_checkpoint,
    verify_checkpoint,
    write_failed,
)

RESULTS = "results.json"


class GridConfig(StrictModel):
    """The search of Table 6's caption: every combination is one run."""

    batch_size: list[PositiveInt] = [2, 4, 8, 16, 32]
    learning_rate: list[PositiveFloat] = [5e-6, 6e-6, 8e-6, 1e-5, 2e-5, 3e-5]
    weight_decay: list[float] = [1e-2, 1e-5]


class GlueRecipe(Recipe):
    """One GLUE fine-tuning run (``recipes/glue/<task>.yaml`` hold Table 6's best settings, NeoBERT 1024).

    Args:
        task: GLUE task (``cola``, ``sst2``, ``mrpc``, ``qqp``, ``stsb``, ``mnli``, ``qnli``, ``rte``).
        batch_size / learning_rate / weight_decay: the searched settings.
        epochs: training epochs (10); early stopping usually ends a run sooner.
        eval_every_max / eval_fraction: evaluate every ``min(eval_every_max, len(dataloader) // eval_fraction)``
            steps (500 and 10).
        patience: evaluations without improvement before stopping (15).
        warmup_ratio / decay_ratio / final_lr_ratio: the official schedule (0.06, 0.9, 0.1).
        max_length: tokens per input (the official 1024, capped at the tokenizer's own limit).
        eval_batch_size: validation batch size (no effect on scores).
        precision: ``auto`` (bf16 on a CUDA device that has it, else float32), ``fp32``, ``bf16`` or ``fp16``.
        transfer_from: the task whose best checkpoint the paper starts from (``mnli`` for RTE, STS-B, MRPC,
            QNLI); the checkpoint itself is given with ``--from``.
        grid: the search ``--grid`` runs.
    """

    task: str
    seed: int = 0
    batch_size: PositiveInt
    learning_rate: PositiveFloat
    weight_decay: float = Field(ge=0)
    epochs: PositiveFloat = 10
    eval_every_max: PositiveInt = 500
    eval_fraction: PositiveInt = 10
    patience: PositiveInt = 15
    warmup_ratio: float = Field(0.06, ge=0, lt=1)
    decay_ratio: float = Field(0.9, gt=0, le=1)
    final_lr_ratio: float = Field(0.1, ge=0, le=1)
    max_length: PositiveInt = 1024
    eval_batch_size: PositiveInt = 32
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    transfer_from: str | None = None
    grid: GridConfig = GridConfig()


def eval_interval(recipe: GlueRecipe, train_rows: int) -> int:
    """Appendix C: ``min(500, len(dataloader) // 10)`` steps (at least 1)."""
    batches = math.ceil(train_rows / recipe.batch_size)
    return max(1, min(recipe.eval_every_max, batches // recipe.eval_fraction))


def lr_lambda(step: int, total: int, recipe: GlueRecipe) -> float:
    """The official GLUE schedule as a factor of the peak rate at ``step`` of ``total``."""
    warmup = math.ceil(total * recipe.warmup_ratio)
    decay_end = max(warmup + 1, math.ceil(total * recipe.decay_ratio))
    if step < warmup:
        return (step + 1) / warmup
    if step >= decay_end:
        return recipe.final_lr_ratio
    return 1.0 - (1.0 - recipe.final_lr_ratio) * (step - warmup) / (decay_end - warmup)


# ------------------------------------------------------------------------------------------------- one run
def _tokenized(task: GlueTask, splits, tokenizer, max_length: int):
    limit = min(max_length, getattr(tokenizer, "model_max_length", max_length) or max_length)

    def encode(rows):
        texts = [rows[c] for c in task.text]
        out = tokenizer(*texts, truncation=True, max_length=limit)
        out["labels"] = (
            [float(y) for y in rows["label"]] if task.is_regression else [int(y) for y in rows["label"]]
        )
        return out

    return {
        split: data.map(encode, batched=True, remove_columns=data.column_names, desc=f"tokenize {split}")
        for split, data in splits.items()
    }


def _load_model(task: GlueTask, model: str, transfer: bool):
    """The classifier: a backbone gets a fresh head; a fine-tuned checkpoint (``--from``) keeps what fits and
    starts the classifier fresh when its label count differs (MNLI's 3 for STS-B's 1)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    # the source's own problem type goes first: MNLI's single-label one does not fit STS-B's one output
    config = AutoConfig.from_pretrained(model, problem_type=None)
    config.num_labels = task.num_labels  # fresh label names too
    config.problem_type = "regression" if task.is_regression else "single_label_classification"
    return AutoModelForSequenceClassification.from_pretrained(
        model, config=config, ignore_mismatched_sizes=transfer
    )


def _device_settings(recipe: GlueRecipe) -> dict[str, bool]:
    import torch

    kind, cuda = recipe.precision, torch.cuda.is_available()
    if kind == "auto":
        kind = "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    return {"bf16": kind == "bf16", "fp16": kind == "fp16", "dataloader_pin_memory": cuda}


def _selection_key(task: GlueTask) -> str:
    """The Trainer's metric name: evaluation on several splits prefixes each with its split (MNLI: matched)."""
    return task.selection if len(task.validation) == 1 else f"{task.validation[0]}_{task.selection}"


def _arguments(recipe: GlueRecipe, task: GlueTask, out: Path, every: int):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out / "checkpoints"),
        num_train_epochs=recipe.epochs,
        per_device_train_batch_size=recipe.batch_size,
        per_device_eval_batch_size=recipe.eval_batch_size,
        learning_rate=recipe.learning_rate,
        weight_decay=recipe.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        eval_strategy="steps",
        eval_steps=every,
        save_strategy="steps",
        save_steps=every,
        save_total_limit=None,  # _save_sealed keeps the newest and the best (transformers' end-of-run clean-up
        # would also delete the newest checkpoint of an interrupted run, the one --resume continues from)
        load_best_model_at_end=True,
        metric_for_best_model=_selection_key(task),
        greater_is_better=True,
        logging_steps=every,
        seed=recipe.seed,
        report_to=[],
        disable_tqdm=True,
        **_device_settings(recipe),
    )


def _save_sealed(trainer, write) -> None:
    """Write a checkpoint as ``neoembed train`` does (:mod:`neoembed.runs`): transformers' ``write()`` into a
    staging folder, sealed with a checksum marker, renamed; the newest checkpoint and the best one stay. A kill
    leaves the previous checkpoints whole, and a resume skips a torn one."""
    step, output = trainer.state.global_step, Path(trainer.args.output_dir)
    staged = stage_checkpoint(output, step)
    trainer.neoembed_staging = staged
    try:
        write()
    except Exception as e:  # a full disk, say: the staging folder goes, the last checkpoint stays
        raise write_failed(staged, step, e) from e
    finally:
        trainer.neoembed_staging = None
    best = trainer.state.best_global_step or None
    if best:  # transformers named the best checkpoint under the staging folder: its final place instead
        trainer.state.best_model_checkpoint = str(output / f"checkpoint-{best}")
        trainer.state.save_to_json(str(staged / f"checkpoint-{step}" / "trainer_state.json"))
    commit_checkpoint(staged / f"checkpoint-{step}", step, 1, output=output, protect=best)
    shutil.rmtree(staged, ignore_errors=True)


def _stop_callback(stop: StopSignal):
    """On SIGTERM or Ctrl-C: finish the current step, write a checkpoint, stop (as ``neoembed train``)."""
    from transformers import TrainerCallback

    class StopCallback(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if stop.received is not None:
                control.should_save, control.should_training_stop = True, True

    return StopCallback()


def _trainer(recipe: GlueRecipe, task: GlueTask, model, tokenizer, data, out: Path, stop: StopSignal):
    import torch
    from transformers import DataCollatorWithPadding, EarlyStoppingCallback, Trainer

    class GlueTrainer(Trainer):
        """The official GLUE schedule instead of the Trainer's named ones; sealed checkpoints."""

        neoembed_staging: Path | None = None

        def create_scheduler(self, num_training_steps: int, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lambda step: lr_lambda(step, num_training_steps, recipe)
                )
            return self.lr_scheduler

        def _get_output_dir(self, trial):
            # transformers writes a checkpoint into <this>/checkpoint-N: the staging folder while one is written
            if self.neoembed_staging is not None:
                return str(self.neoembed_staging)
            return super()._get_output_dir(trial)

        def _save_checkpoint(self, model, trial):
            _save_sealed(self, lambda: super(GlueTrainer, self)._save_checkpoint(model, trial))

    evaluation = {s: data[s] for s in task.validation}
    return GlueTrainer(
        model=model,
        args=_arguments(recipe, task, out, eval_interval(recipe, len(data["train"]))),
        train_dataset=data["train"],
        eval_dataset=evaluation if len(evaluation) > 1 else evaluation[task.validation[0]],
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        compute_metrics=lambda p: compute_metrics(task, p.predictions, p.label_ids),
        callbacks=[EarlyStoppingCallback(early_stopping_patience=recipe.patience), _stop_callback(stop)],
    )


def _resume_point(folder: Path) -> Path | None:
    """The newest complete checkpoint in ``folder`` (:func:`neoembed.runs.find_resume_checkpoint`: torn ones are
    skipped and named), or None: the run starts at its first step (also when every checkpoint there is torn)."""
    if not folder.is_dir() or not (list_checkpoints(folder) or any(folder.glob(".checkpoint-*.partial"))):
        return None
    try:
        return find_resume_checkpoint(folder)
    except ValueError as e:  # OutputDirError: nothing complete to continue from
        print(f"resume: {e}; this run starts again from its first step", file=sys.stderr)
        shutil.rmtree(folder)
        return None


def run_one(
    recipe: GlueRecipe, task: GlueTask, model: str, out: Path, data_options: dict, transfer: bool
) -> dict:
    """Fine-tune, keep the best checkpoint in ``out/model``, score it on every validation split, write
    ``out/results.json``; a run with checkpoints in ``out/checkpoints`` continues from the last one."""
    from transformers import AutoTokenizer, set_seed

    set_seed(recipe.seed)
    splits = load_splits(task, **data_options)
    check_columns(task, splits)
    tokenizer = AutoTokenizer.from_pretrained(model)
    data = _tokenized(task, splits, tokenizer, recipe.max_length)
    stop = StopSignal()
    trainer = _trainer(recipe, task, _load_model(task, model, transfer), tokenizer, data, out, stop)
    checkpoint = _resume_point(out / "checkpoints")
    with stop:
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint is not None else None)
    if stop.received is not None:
        done = [c for c in list_checkpoints(out / "checkpoints") if verify_checkpoint(c) is None]
        raise TrainingInterrupted(stop.received, done[-1] if done else None)
    results = {split: _evaluate(trainer, task, data[split]) for split in task.validation}
    save_final_model(out, lambda staged: trainer.save_model(str(staged / "model")))  # all or nothing
    summary = {
        "task": task.display,
        "score": task_score(task, results),
        "validation": results,
        "best_step": _best_step(trainer),
        "steps": trainer.state.global_step,
        "eval_every": trainer.args.eval_steps,
        "settings": {k: getattr(recipe, k) for k in ("batch_size", "learning_rate", "weight_decay", "seed")},
        "model": model,
    }
    atomic_write_text(out / RESULTS, json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the best one is out/model now
    return summary


def _evaluate(trainer, task: GlueTask, data) -> dict[str, float]:
    prediction = trainer.predict(data)
    return compute_metrics(task, prediction.predictions, prediction.label_ids)


def _best_step(trainer) -> int | None:
    best = trainer.state.best_model_checkpoint
    return int(best.rsplit("-", 1)[-1]) if best else None


# ---------------------------------------------------------------------------------------------------- grid
def grid_points(recipe: GlueRecipe) -> list[GlueRecipe]:
    """Every setting of the recipe's grid, as recipes."""
    g = recipe.grid
    return [
        recipe.model_copy(update={"batch_size": b, "learning_rate": lr, "weight_decay": wd})
        for b, lr, wd in itertools.product(g.batch_size, g.learning_rate, g.weight_decay)
    ]


def run_name(recipe: GlueRecipe) -> str:
    return f"bs{recipe.batch_size}_lr{recipe.learning_rate:g}_wd{recipe.weight_decay:g}_seed{recipe.seed}"


def run_grid(recipe: GlueRecipe, task: GlueTask, model: str, out: Path, data_options: dict, transfer: bool):
    """Each grid point in ``out/<run_name>``: done ones (``results.json``) are read back, others run (or resume);
    only the best run keeps its model. The table is rewritten after every run."""
    rows = []
    for point in grid_points(recipe):
        folder = out / run_name(point)
        if (folder / RESULTS).is_file():
            rows.append(json.loads((folder / RESULTS).read_text()))
        else:
            rows.append(run_one(point, task, model, folder, data_options, transfer))
        rows[-1]["run"] = folder.name
        _keep_best_model(out, rows)
        write_grid_table(out, task, rows)
    return rows


def _keep_best_model(out: Path, rows: list[dict]) -> None:
    best = max(rows, key=lambda r: r["score"])["run"]
    for row in rows:
        if row["run"] != best:
            shutil.rmtree(out / row["run"] / "model", ignore_errors=True)


def write_grid_table(out: Path, task: GlueTask, rows: list[dict]) -> None:
    """``grid.json`` (every run, best first) and ``grid.md`` (one table)."""
    rows = sorted(rows, key=lambda r: -r["score"])
    metrics = [f"{s}/{m}" if len(task.validation) > 1 else m for s in task.validation for m in task.metrics]
    lines = [
        f"# {task.display} grid ({len(rows)} runs; best first)",
        "",
        "| batch | lr | wd | seed | score | " + " | ".join(metrics) + " | best step | steps |",
        "|---|---|---|---|---|" + "---|" * len(metrics) + "---|---|",
    ]
    for r in rows:
        s = r["settings"]
        values = [100 * r["validation"][sp][m] for sp in task.validation for m in task.metrics]
        lines.append(
            f"| {s['batch_size']} | {s['learning_rate']:g} | {s['weight_decay']:g} | {s['seed']} | "
            f"{r['score']:.2f} | "
            + " | ".join(f"{v:.2f}" for v in values)
            + f" | {r['best_step']} | {r['steps']} |"
        )
    atomic_write_text(out / "grid.md", "\n".join(lines) + "\n")
    atomic_write_text(out / "grid.json", json.dumps({"task": task.display, "runs": rows}, indent=2) + "\n")


# ------------------------------------------------------------------------------------------ transfer source
def resolve_from(path: str) -> str:
    """The checkpoint ``--from`` names: a model folder, a ``neoembed glue`` run (its ``model/``) or grid (its best
    run's ``model/``)."""
    folder = Path(path)
    if (folder / "grid.json").is_file():
        best = json.loads((folder / "grid.json").read_text())["runs"][0]["run"]
        folder = folder / best
    if (folder / RESULTS).is_file() and (folder / "model").is_dir():
        folder = folder / "model"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"--from {path}: no model there (no config.json in {folder}); give a model folder or the --out of a "
            "finished `neoembed glue MNLI` run or grid"
        )
    return str(folder)


def record(out: Path, recipe: GlueRecipe, model: str, source: str | None, grid: bool) -> None:
    write_run_record(out, "glue", recipe=recipe, extra={"model": model, "from": source, "grid": grid})
