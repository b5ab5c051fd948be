"""GLUE fine-tuning with the NeoBERT paper's protocol (Appendix C), on neoembed's run loop (:mod:`neoembed.loop`).

One run: 10 epochs; evaluation on the validation split(s) every ``min(500, len(train_dataloader) // 10)`` steps;
early stopping after 15 evaluations without improvement of the task's selection metric; the best checkpoint is
kept (``<out>/model``) and scored. AdamW (betas 0.9 / 0.95, eps 1e-8) and the official schedule
(chandar-lab/NeoBERT ``conf/scheduler/glue.yaml``: 6% linear warm-up, linear decay to 10% of the peak at 90% of
the steps, constant after). ``--grid`` runs the paper's search (Table 6's caption), each run in its own folder:
finished runs are skipped, unfinished ones resume from their last checkpoint, and ``grid.md`` / ``grid.json``
hold one table. Works for any encoder ``AutoModelForSequenceClassification`` loads.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import shutil
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator

from neoembed.glue.tasks import GlueTask, check_columns, compute_metrics, data_key, load_splits, task_score
from neoembed.hub import model_name
from neoembed.loop import RunLoop, StepOutput, accelerator, adamw, check_engine
from neoembed.recipe import KeepBest, OptimizerConfig, Recipe, StrictModel, Tracker
from neoembed.record import RUN_RECORD, atomic_write_text, write_run_record
from neoembed.runs import (
    OutputDirError,
    find_resume_checkpoint,
    list_checkpoints,
    model_fingerprint,
    prepare_output_dir,
    recorded_settings,
    resume_defaults,
    resume_settings,
    run_identity,
    save_final_model,
)

RESULTS = "results.json"
logger = logging.getLogger(__name__)


class GridConfig(StrictModel):
    """The search of Table 6's caption: every combination is one run (each list non-empty, without repeats:
    an empty one gave no runs, a repeated value a table with a row twice)."""

    batch_size: list[PositiveInt] = Field([2, 4, 8, 16, 32], min_length=1)
    learning_rate: list[PositiveFloat] = Field([5e-6, 6e-6, 8e-6, 1e-5, 2e-5, 3e-5], min_length=1)
    weight_decay: list[Annotated[float, Field(ge=0)]] = Field([1e-2, 1e-5], min_length=1)

    @field_validator("batch_size", "learning_rate", "weight_decay")
    @classmethod
    def _no_repeats(cls, values: list):
        if len(set(values)) < len(values):
            raise ValueError(f"{values} repeats a value: list each once")
        return values


class GlueRecipe(Recipe):
    """One GLUE fine-tuning run (``recipes/glue/<task>.yaml`` hold Table 6's best settings, NeoBERT 1024).

    Args:
        task: GLUE task (``cola``, ``sst2``, ``mrpc``, ``qqp``, ``stsb``, ``mnli``, ``qnli``, ``rte``).
        batch_size / learning_rate / weight_decay: the searched settings (``batch_size``: rows per step over all
            processes).
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
        report_to: trackers, as in the training recipes (``tensorboard``, ``wandb``, ``mlflow``, ``trackio``).
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
    report_to: list[Tracker] = []
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
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    # the source's own problem type goes first: MNLI's single-label one does not fit STS-B's one output
    config = AutoConfig.from_pretrained(model, problem_type=None)
    config.num_labels = task.num_labels  # fresh label names too
    config.problem_type = "regression" if task.is_regression else "single_label_classification"
    with _quiet_loading():
        classifier, info = AutoModelForSequenceClassification.from_pretrained(
            model, config=config, ignore_mismatched_sizes=transfer, output_loading_info=True, dtype=torch.float32
        )  # fp32 weights whatever the source was saved in: the recipe's precision is autocast's over them
    _say_loaded(task, model, classifier.base_model_prefix, info)
    return classifier


@contextlib.contextmanager
def _quiet_loading():
    """transformers' weight-loading bar and its load report (a table of the new head's keys, advising training
    on a downstream task, which is what this run does); :func:`_say_loaded` says what matters in a line."""
    from transformers.utils import logging as hf_logging

    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


def _say_loaded(task: GlueTask, model: str, encoder_prefix: str, info: dict) -> None:
    """One line on the new classifier's weights; a warning for an encoder weight the checkpoint lacks (trained
    from random values: a checkpoint of another architecture would give a half-random model). Weights the
    classifier does not use (a pre-training checkpoint's masked-LM head) are expected and not named."""
    lacking = [k for k in info["missing_keys"] if k.startswith(f"{encoder_prefix}.")]
    fresh = [k for k in info["missing_keys"] if k not in lacking] + [k for k, *_ in info["mismatched_keys"]]
    name = model_name(model)
    if fresh:
        logger.info("glue %s: a new classifier (%s) on %s's encoder", task.display, ", ".join(sorted(fresh)), name)
    else:
        logger.info("glue %s: %s's classifier, every weight loaded", task.display, name)
    if lacking:
        logger.warning(
            "%s lacks %d of the encoder's weights (%s%s): they start from random values; check it is the "
            "checkpoint you meant", name, len(lacking), ", ".join(sorted(lacking)[:3]),
            ", ..." if len(lacking) > 3 else "",
        )  # fmt: skip


def _mixed_precision(recipe: GlueRecipe) -> str:
    """accelerate's ``mixed_precision`` for the recipe: ``auto`` is bf16 on a CUDA device that has it, else fp32."""
    import torch

    kind, cuda = recipe.precision, torch.cuda.is_available()
    if kind == "auto":
        kind = "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    return {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[kind]


def _selection_key(task: GlueTask) -> str:
    """The logged name of the selection metric: evaluation on several splits prefixes each with its split (MNLI:
    matched), as transformers' ``Trainer`` names them."""
    return task.selection if len(task.validation) == 1 else f"{task.validation[0]}_{task.selection}"


class _Every(StrictModel):
    steps: PositiveInt


class GlueRun(GlueRecipe):
    """A GLUE recipe with what the run loop (:class:`neoembed.loop.RunLoop`) reads, derived from the recipe and the
    training rows: the steps of its epochs, evaluation and a checkpoint every :func:`eval_interval` steps, and the
    best checkpoint by the task's selection metric kept, with early stopping after ``patience`` evaluations."""

    steps: PositiveInt
    per_epoch: PositiveInt
    save_steps: PositiveInt
    logging_steps: PositiveInt
    save_total_limit: int = 1
    eval: _Every
    keep_best: KeepBest

    @classmethod
    def of(cls, recipe: GlueRecipe, task: GlueTask, train_rows: int, world: int) -> GlueRun:
        if recipe.batch_size % world:
            raise ValueError(
                f"batch_size {recipe.batch_size} (the global batch) is not a multiple of the {world} processes"
            )
        per_epoch = math.ceil(train_rows / recipe.batch_size)
        if 0 < train_rows % recipe.batch_size < world:  # a last batch too small to give each process a row
            per_epoch -= 1
        every = eval_interval(recipe, train_rows)
        return cls(
            **recipe.model_dump(),
            steps=math.ceil(recipe.epochs * per_epoch),  # transformers' Trainer's max_steps
            per_epoch=per_epoch,
            save_steps=every,
            logging_steps=every,
            eval=_Every(steps=every),
            keep_best=KeepBest(metric=_selection_key(task), patience=recipe.patience),
        )


def epoch_order(seed: int, epoch: int, rows: int) -> list[int]:
    """The rows of one epoch in training order: the permutation of accelerate's seedable sampler (what the
    ``Trainer`` draws), seeded with ``seed + epoch``, so a resumed run draws the same batches."""
    import torch

    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def _glue_step(run: GlueRun, acc, model, train, collate):
    """The step function of GLUE fine-tuning and the row it logs: each process backpropagates its share of the
    global batch, its mean loss weighted by its share of the rows (DDP averages the gradients over processes)."""
    import numpy as np
    import torch

    world, rank = acc.num_processes, acc.process_index
    order: dict[int, list[int]] = {}
    last = {"epoch": 0.0}

    def step_fn(step: int, stop_requested: bool) -> StepOutput:
        epoch, position = divmod(step, run.per_epoch)
        if epoch not in order:
            order.clear()
            order[epoch] = epoch_order(run.seed, epoch, len(train))
        rows = order[epoch][position * run.batch_size : (position + 1) * run.batch_size]
        last["epoch"] = (step + 1) / run.per_epoch
        local = np.array_split(rows, world)[rank].tolist()
        batch = {k: v.to(acc.device) for k, v in collate([train[i] for i in local]).items()}
        loss = model(**batch).loss
        acc.backward(loss * (len(local) * world / len(rows)))
        stats = torch.tensor([loss.item() * len(local), len(local), float(stop_requested)], device=acc.device)
        if world > 1:
            stats = acc.reduce(stats, reduction="sum")
        mean = float(stats[0] / stats[1])
        return StepOutput(loss=mean, stop=bool(stats[2] > 0), sums={"loss": mean, "rows": float(stats[1])})

    def row_fn(sums: dict, seconds: float, grad_norm, lr: float) -> dict:
        return {
            "loss": sums["loss"] / sums["steps"],
            "learning_rate": lr,
            "grad_norm": grad_norm,
            "epoch": round(last["epoch"], 3),
            "samples_per_s": sums["rows"] / max(seconds, 1e-9),
        }

    return step_fn, row_fn


def _predict(acc, model, data, collate, batch_size: int):
    """Logits (or regression outputs) and labels of ``data`` in its order, in evaluation mode."""
    import numpy as np
    import torch

    was_training = model.training
    model.eval()
    outputs, labels = [], []
    try:
        with torch.no_grad(), acc.autocast():
            for first in range(0, len(data), batch_size):
                batch = collate([data[i] for i in range(first, min(first + batch_size, len(data)))])
                labels.append(batch.pop("labels").numpy())
                logits = model(**{k: v.to(acc.device) for k, v in batch.items()}).logits
                outputs.append(logits.float().cpu().numpy())
    finally:
        model.train(was_training)
    return np.concatenate(outputs), np.concatenate(labels)


def _scores(acc, model, task: GlueTask, data, collate, batch_size: int) -> dict[str, dict[str, float]]:
    """Each validation split's metrics."""
    return {
        split: compute_metrics(task, *_predict(acc, model, data[split], collate, batch_size))
        for split in task.validation
    }


def _evaluation(acc, model, task: GlueTask, data, collate, batch_size: int):
    """``evaluate(step)`` for the loop: the metrics flat, each prefixed with its split when there are several.
    ``model``: the classifier itself, not its DDP wrapper (evaluation runs on the main process alone)."""

    def evaluate(step: int) -> dict[str, float]:
        scores = _scores(acc, model, task, data, collate, batch_size)
        several = len(task.validation) > 1
        return {(f"{s}_{m}" if several else m): v for s, ms in scores.items() for m, v in ms.items()}

    return evaluate


def _resume_point(folder: Path, main: bool = True) -> Path | None:
    """The newest complete checkpoint in ``folder`` (:func:`neoembed.runs.find_resume_checkpoint`: torn ones are
    skipped and named), or None: the run starts at its first step (also when every checkpoint there is torn, or
    a run stopped before its first one left only its logs); the ``main`` process removes the torn ones."""
    if not folder.is_dir():
        return None
    written = [*list_checkpoints(folder), *folder.glob(".checkpoint-*.partial")]
    if written:
        try:
            return find_resume_checkpoint(folder)
        except ValueError as e:  # OutputDirError: nothing complete to continue from
            print(f"resume: {e}; this run starts again from its first step", file=sys.stderr)
    if not main:
        return None
    for stale in written:  # its logs are the loop's to restart (RunLoop.start)
        shutil.rmtree(stale)
    return None


def _loop(run: GlueRun, acc, model, out: Path, evaluate, settings: dict):
    """The run loop of one GLUE run in ``out``, with AdamW and the official schedule; and the model as accelerate
    prepared it (on its device; DDP-wrapped under several processes), which the step trains."""
    import torch

    optimizer = adamw(model, OptimizerConfig(lr=run.learning_rate, weight_decay=run.weight_decay))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_lambda(step, run.steps, run))
    model, optimizer = acc.prepare(model, optimizer)
    loop = RunLoop(
        acc,
        run,
        out,
        optimizer=optimizer,
        scheduler=scheduler,
        parameters=model.parameters,
        grad_clip=1.0,  # the Trainer's max_grad_norm
        settings=settings,
        desc=f"glue {run.task}",
        nan_advice="Lower learning_rate, or use precision fp32",
        evaluate=evaluate,
    )
    return loop, model


def run_one(
    recipe: GlueRecipe, task: GlueTask, model: str, out: Path, data_options: dict, transfer: bool
) -> dict:
    """Fine-tune on the run loop, keep the best checkpoint in ``out/model``, score it on every validation split,
    write ``out/results.json``; a run with checkpoints in ``out`` continues from the last one."""
    from transformers import AutoTokenizer, DataCollatorWithPadding, set_seed

    check_engine("glue")
    acc = accelerator(mixed_precision=_mixed_precision(recipe))
    set_seed(recipe.seed)
    splits = load_splits(task, **data_options)
    check_columns(task, splits)
    tokenizer = AutoTokenizer.from_pretrained(model)
    data = _tokenized(task, splits, tokenizer, recipe.max_length)
    run = GlueRun.of(recipe, task, len(data["train"]), acc.num_processes)
    # the splits and the model by content (its tokenizer loads beside the checkpoint's weights); a run recorded
    # before the keys resumes
    files = data_key(task, **data_options) | {"model_fingerprint": model_fingerprint(model)}
    settings, defaults = resume_settings(run) | files, resume_defaults(run) | files
    checkpoint = _resume_point(out, acc.is_main_process)
    acc.wait_for_everyone()  # the other processes start after the main one cleared a stale folder
    if checkpoint is not None:  # the folder's run must be this run (a grid point resumes without --resume)
        prepare_output_dir(
            out, overwrite=False, resume=True, settings=settings, defaults=defaults, checkpoints=False, what="--out"
        )
    collate = DataCollatorWithPadding(tokenizer, return_tensors="pt")
    classifier = _load_model(task, model, transfer)
    evaluate = _evaluation(acc, classifier, task, data, collate, run.eval_batch_size)
    loop, prepared = _loop(run, acc, classifier, out, evaluate, settings)
    loop.start(checkpoint, "glue", data_files=[], extra={"model": model, "transfer": transfer})
    loop.run(*_glue_step(run, acc, prepared, data["train"], collate))
    summary: dict = {}

    def save_final() -> None:
        results = _scores(acc, classifier, task, data, collate, run.eval_batch_size)

        def write(staged: Path) -> None:
            classifier.save_pretrained(staged / "model")
            tokenizer.save_pretrained(staged / "model")

        save_final_model(out, write, loop.step)  # all or nothing
        best = loop.best_record()
        summary.update(
            task=task.display,
            score=task_score(task, results),
            validation=results,
            best_step=best["step"] if best else None,
            steps=loop.step,
            eval_every=run.eval.steps,
            settings={k: getattr(recipe, k) for k in ("batch_size", "learning_rate", "weight_decay", "seed")},
            model=model_name(model),  # the packaged copy by name, not a path of this machine
        )
        atomic_write_text(out / RESULTS, json.dumps(summary, indent=2) + "\n")
        for done in list_checkpoints(out):  # the best one is out/model now
            shutil.rmtree(done)

    loop.finish(save_final)
    acc.end_training()
    return summary or json.loads((out / RESULTS).read_text())  # the other processes read the main one's


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
    """The run record of ``out``; a grid's carries the recipe's settings (the grid's lists among them), which a
    resume compares before any grid point runs."""
    extra = {"model": model, "from": source, "grid": grid}
    if grid:
        extra.update(run_identity(resume_settings(recipe)))
    write_run_record(out, "glue", recipe=recipe, extra=extra)


def check_same_kind_and_model(out: Path, model: str, grid: bool) -> None:
    """``--resume`` into ``out``: the folder's run must be of the same kind (a grid or a single run) and start from
    the same ``model`` (``--model``, or ``--from``'s checkpoint), checked before the run record is rewritten or a
    model loads."""
    try:
        saved = json.loads((out / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return  # no record (a folder of an older version, or none yet): the settings' check decides
    # a single run's record is rewritten by its run loop, without the key
    then = bool(saved.get("grid")) or (out / "grid.json").is_file()
    if then != grid:
        raise OutputDirError(
            f"--resume: --out {out} holds a grid search (grid.md): add --grid to resume it, or choose another --out"
            if then
            else f"--resume: --out {out} holds a single run, not a grid: resume it without --grid, or choose "
            "another --out for the grid"
        )
    before = saved.get("model")
    recorded = recorded_settings(out).get("model_fingerprint")  # the record, else the newest checkpoint's
    if before is not None and not _same_model(before, model, recorded):
        raise OutputDirError(
            f"--resume: the run in {out} fine-tunes {before}, this command {model}: resume with the --model "
            "(and --from) it started with, or pass --overwrite to start again from the new one"
        )


def _same_model(a: str, b: str, recorded: dict | None = None) -> bool:
    """The same hub id, or two paths of one local folder, or a local folder with the weights and pipeline files
    the run recorded (``recorded``: its ``model_fingerprint``; a copy elsewhere is the same model)."""
    if Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve():
        return True  # edited in place: the resume settings' model_fingerprint names it
    if Path(b).is_dir() and recorded is not None and recorded.get("weights"):
        return model_fingerprint(b) == recorded
    return a == b
