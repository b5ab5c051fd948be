"""The unified contrastive trainer: sentence-transformers' trainer with thin overrides.

What is ours: the InfoNCE losses (``neoembed.losses``), the power-law dataset sampler
(``neoembed.data.sampler``), per-dataset batch sizes, and the run guarantees that pre-training and CDE get from
:mod:`neoembed.loop`, here through callbacks and one override: the output folder is checked first
(:func:`neoembed.runs.prepare_output_dir`: never silently reused), checkpoints are written to a staging folder,
sealed with a checksum marker and renamed (a kill never leaves half of one to resume from; a full disk ends in a
clear error), ``metrics.jsonl`` and TensorBoard are trimmed to the resumed step, SIGTERM / Ctrl-C checkpoint and
exit 143 / 130, a NaN loss stops, a loss stuck at 0 is reported. Everything else (optimiser, schedule, mixed
precision, DDP through accelerate, checkpoint contents and exact resume) is the sentence-transformers /
transformers trainer.

    neoembed train tiny                       # a shipped recipe by name
    neoembed train my.yaml steps=500 batch_size=64 optimizer.lr=2e-5
    neoembed train my.yaml --resume           # continue from the newest complete checkpoint
    accelerate launch --num_processes 2 -m neoembed train my.yaml
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from neoembed.adapters import (
    add_lora,
    count_parameters,
    load_training_checkpoint,
    merge_lora,
    require_peft,
    save_adapter,
)
from neoembed.data.cards import (
    DataCardError,
    card_fingerprints,
    explain_data_errors,
    load_recipe_cards,
    local_data_paths,
    prepare_card,
)
from neoembed.data.check import require_hub
from neoembed.data.sampler import (
    NoDuplicatesBatchSampler,
    PowerLawDatasetBatchSampler,
    dataset_probabilities,
    plan_no_duplicates,
)
from neoembed.loop import check_engine, check_launch, join_on_cpu
from neoembed.losses import MaskTally, build_loss
from neoembed.model_card import base_model_name, training_prompts
from neoembed.recipe import RecipeError, resolve_recipe_path
from neoembed.record import write_run_record
from neoembed.runs import (
    TRACKER_PROJECT,
    MetricsLog,
    StopSignal,
    TrainingInterrupted,
    TrainingStopped,
    check_pair_counts,
    check_trackers,
    check_weight_files,
    commit_checkpoint,
    launched_main,
    list_checkpoints,
    note_early_stop,
    prepare_output_dir,
    progress_line,
    recipe_hyperparameters,
    resume_defaults,
    resume_settings,
    run_identity,
    save_final_model,
    stage_checkpoint,
    tensorboard_hparams,
    verify_checkpoint,
    write_failed,
)
from neoembed.sentence import record_matryoshka_dims
from neoembed.train.holdout import (
    check_same_holdout,
    held_card_names,
    holdout_record,
    split_holdout,
    write_holdout_tasks,
)
from neoembed.train.recipe import UnifiedRecipe

__all__ = ["TrainingStopped", "prepare_datasets", "train"]

logger = logging.getLogger(__name__)


def prepare_datasets(recipe: UnifiedRecipe, recipe_dir: Path | None = None, reports: dict | None = None):
    """Resolve, load and check every card before training: returns (DatasetDict, cards, per-dataset batch sizes).
    ``reports`` (a dict, optional) receives each card's DropReport (rows kept and dropped, full size) by name."""
    from datasets import DatasetDict

    search = [Path(resolve_recipe_path(d, recipe_dir)) for d in recipe.card_dirs]
    loaded = load_recipe_cards(recipe.datasets, search, scored=recipe.distillation is not None)  # cards first
    require_hub([card for card, _ in loaded])  # no network: one probe and a clear error, not retries per card
    names = [card.name for card, _ in loaded]
    unknown = sorted(set(recipe.instruction_overrides) - set(names))
    if unknown:
        raise DataCardError(
            f"instruction_overrides names card(s) {unknown} that the recipe does not train on; valid: {names}"
        )
    out, cards, sizes, lines = {}, [], {}, {}
    for entry, (card, folder) in zip(recipe.datasets, loaded, strict=True):
        if card.name in recipe.instruction_overrides:
            card = card.model_copy(update={"instruction": recipe.instruction_overrides[card.name]})
        with explain_data_errors(card, folder):  # a bad byte surfaces only when the rows are read
            pairs, report = prepare_card(
                card,
                folder,
                entry.max_rows,
                entry.max_negatives,
                recipe.template,
                recipe.instructions,
                recipe.seed,
            )
        if reports is not None:
            reports[card.name] = report
        # counted in the card's batched map (pairs["query"] would walk every row in Python)
        check_pair_counts(card.name, len(pairs), report.same_as_query, report.distinct_pairs)
        bs = recipe.dataset_batch_size(entry, report.negatives_per_query)
        _check_batch(card.name, bs, len(pairs), report.negatives_per_query)
        out[card.name], sizes[card.name], lines[card.name] = pairs, bs, report
        cards.append((card, folder))
    _log_cards(lines, sizes, recipe.alpha, {name: len(rows) for name, rows in out.items()})
    return DatasetDict(out), cards, sizes


def _log_cards(reports: dict, sizes: dict[str, int], alpha: float, loaded: dict[str, int]) -> None:
    """One line per card: rows kept and dropped by reason, batch, pi_i (of the full sizes, as the sampler
    draws). A card that lost rows (all counted, and allowed by the card) is a warning."""
    probabilities = dataset_probabilities([reports[n].full_size or loaded[n] for n in reports], alpha)
    for (name, report), pi in zip(reports.items(), probabilities, strict=True):
        bs, texts = sizes[name], sizes[name] * (2 + reports[name].negatives_per_query)
        (logger.warning if report.dropped else logger.info)(
            "card %s: %s; %d queries per step (%d texts); pi %.4f", name, report.line(), bs, texts, pi
        )


def _check_batch(name: str, bs: int, rows: int, negatives: int) -> None:
    if bs > rows:
        raise DataCardError(
            f"card {name}: batch size {bs} is larger than the dataset ({rows} usable rows); "
            "lower batch_size (or this dataset's batch_size) or add data"
        )
    if bs == 1 and negatives == 0:  # InfoNCE over one candidate is log(1) = 0 at every step
        raise DataCardError(
            f"card {name}: a batch of 1 query without hard negatives leaves its positive nothing to be contrasted "
            "with (the loss is 0 and nothing trains): raise batch_size, or use a card with hard negatives"
        )


class _MetricsCallback(TrainerCallback):
    """Appends step, loss, learning rate, dataset, samples/s and peak memory to metrics.jsonl (through
    :class:`~neoembed.runs.MetricsLog`, which also reports a run stuck at loss 0); stops on NaN."""

    def __init__(
        self, output: Path, samplers: list, names: list[str], batch_sizes: dict, main: bool, counts
    ):
        self.log = MetricsLog(output, (), main)  # TensorBoard is transformers' own callback here
        # ``samplers``: the list the trainer appends its batch sampler to (which dataset each step drew from)
        self.samplers, self.names, self.batch_sizes = samplers, names, batch_sizes
        self.last_time, self.last_step, self.nan_step = time.perf_counter(), 0, None
        self.loss_counts = counts  # what the loss masked since the last row: its MaskTally's pop

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_step = state.global_step  # a resumed run starts at its checkpoint's step

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        scores = {
            k: float(v)
            for k, v in logs.items()
            if k.startswith("eval_") and isinstance(v, int | float) and not k.endswith("_per_second")
        }
        if scores:  # an evaluation (neoembed.eval.training): its own row, at the step it scored
            self.log.write({"step": state.global_step, **scores})
        if "loss" not in logs:
            return
        if not math.isfinite(float(logs["loss"])):
            self.nan_step, control.should_training_stop = state.global_step, True
        now, step = time.perf_counter(), state.global_step
        history = self.samplers[-1].history if self.samplers else []
        dataset = self.names[history[(step - 1) % len(history)]] if history else None
        steps = max(step - self.last_step, 1)
        samples = steps * (self.batch_sizes.get(dataset, args.per_device_train_batch_size)) * args.world_size
        if torch.cuda.is_available():
            peak = torch.cuda.max_memory_allocated() / 2**20
        else:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        row = {
            "step": step,
            "loss": float(logs["loss"]),
            "learning_rate": float(logs.get("learning_rate", float("nan"))),
            "grad_norm": float(logs["grad_norm"]) if "grad_norm" in logs else None,
            "dataset": dataset,
            "samples_per_s": samples / max(now - self.last_time, 1e-9),
            "peak_memory_mib": round(peak, 1),
            "world_size": args.world_size,
        }
        counts = self.loss_counts()  # what the loss masked (false negatives), when it masks anything
        row.update(counts)
        if counts.get("false_negative_fraction", 0.0) >= 0.99:
            logger.warning(
                "false-negative masking dropped %.1f%% of the scored negatives up to step %d: the loss has almost "
                "nothing to contrast; lower false_negatives.margin",
                100 * counts["false_negative_fraction"],
                step,
            )
        self.log.write(row)
        self.last_time, self.last_step = now, step


TRACKER_IDS = "trackers.json"
# tracker -> the environment variables with which transformers' integration continues a run of that id
RESUME_ENV = {"mlflow": {"MLFLOW_RUN_ID": "{id}"}, "wandb": {"WANDB_RUN_ID": "{id}", "WANDB_RESUME": "allow"}}


class _TrackerIdsCallback(TrainerCallback):
    """Writes the id of each tracked run (MLflow, W&B) to ``OUTPUT/trackers.json`` once the trackers have started,
    so that ``--resume`` continues the same tracked run (:func:`_tracker_env`) instead of opening a new one."""

    def __init__(self, callbacks: list, output: Path, main: bool):
        self.callbacks, self.output, self.main = callbacks, output, main

    def on_train_begin(self, args, state, control, **kwargs):
        ids = {}
        for cb in self.callbacks:
            run = None
            if type(cb).__name__ == "MLflowCallback" and getattr(cb, "_initialized", False):
                run = cb._ml_flow.active_run()
                ids["mlflow"] = run.info.run_id if run is not None else None
            elif type(cb).__name__ == "WandbCallback" and getattr(cb, "_wandb", None) is not None:
                ids["wandb"] = cb._wandb.run.id if cb._wandb.run is not None else None
        ids = {k: v for k, v in ids.items() if v}
        if ids and self.main:
            from neoembed.record import atomic_write_text

            atomic_write_text(self.output / TRACKER_IDS, json.dumps(ids, indent=1) + "\n")


class _RecipeHyperparameters(TrainerCallback):
    """The recipe as ``a.b`` hyperparameters (:func:`~neoembed.runs.recipe_hyperparameters`: the run loop's keys)
    to each tracker transformers started, at a run's first start (a resumed run has them; MLflow refuses a
    changed parameter; Trackio gets them again), beside the TrainingArguments and model config transformers sends
    itself."""

    def __init__(self, callbacks: list, recipe: UnifiedRecipe, main: bool):
        self.callbacks, self.recipe, self.main = callbacks, recipe, main

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.main:
            return
        values = recipe_hyperparameters(self.recipe)
        for cb in self.callbacks:
            name = type(cb).__name__
            if name == "TrackioCallback" and getattr(cb, "_initialized", False):  # a resumed run too: it
                cb._trackio.config.update(values, allow_val_change=True)  # starts with a new config
            elif state.global_step > 0:
                continue
            elif name == "TensorBoardCallback" and cb.tb_writer is not None:
                tensorboard_hparams(cb.tb_writer, values)
            elif name == "MLflowCallback" and getattr(cb, "_initialized", False):
                _mlflow_params(cb, values)
            elif name == "WandbCallback" and getattr(getattr(cb, "_wandb", None), "run", None) is not None:
                cb._wandb.config.update(values, allow_val_change=True)


def _mlflow_params(cb, values: dict) -> None:
    """MLflow parameters in its batches; a value over its length limit (a long datasets list) is left out, said once."""
    limit = cb._MAX_PARAM_VAL_LENGTH
    long = [k for k, v in values.items() if len(str(v)) > limit]
    if long:
        logger.warning(
            "MLflow: %s longer than %d characters, not logged (run_record.json has them)", long, limit
        )
    items = [(k, v) for k, v in values.items() if k not in long]
    for i in range(0, len(items), cb._MAX_PARAMS_TAGS_PER_BATCH):
        cb._ml_flow.log_params(dict(items[i : i + cb._MAX_PARAMS_TAGS_PER_BATCH]))


@contextlib.contextmanager
def _tracker_env(output: Path, resume: bool):
    """The W&B / Trackio project (:data:`~neoembed.runs.TRACKER_PROJECT`, as in the run loop) and, on resume, the
    environment that makes transformers' MLflow / W&B integrations continue the recorded runs (a variable the user
    set wins); restored afterwards."""
    saved = output / TRACKER_IDS
    ids = json.loads(saved.read_text()) if resume and saved.is_file() else {}
    env = {k: v.format(id=ids[t]) for t, kv in RESUME_ENV.items() if t in ids for k, v in kv.items()}
    env |= {"WANDB_PROJECT": TRACKER_PROJECT, "TRACKIO_PROJECT": TRACKER_PROJECT}
    env = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(env)
    try:
        yield
    finally:
        for k in env:
            os.environ.pop(k, None)


class _PlainProgress(TrainerCallback):
    """Output that is not a terminal (CI, a scheduler's log) gets no progress bar (its redraws are noise there)
    but one plain line per logging step and per evaluation: step of total, loss, rate and time left."""

    def __init__(self, stream=None):
        import sys

        self.stream = stream or sys.stderr
        self.t0, self.first = time.perf_counter(), 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0, self.first = time.perf_counter(), state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:  # one line per step, not one per process
            return
        step = state.global_step
        values = {
            k: v
            for k, v in (logs or {}).items()
            if (k in ("loss", "learning_rate") or k.startswith("eval_"))
            and not k.endswith(("_runtime", "_per_second"))
        }
        if values:
            rate = (step - self.first) / max(time.perf_counter() - self.t0, 1e-9)
            print(progress_line(step, state.max_steps, values, rate), file=self.stream, flush=True)


class _SignalCallback(TrainerCallback):
    """On SIGTERM or Ctrl-C: finish the current step, write a checkpoint, stop."""

    def __init__(self, stop: StopSignal):
        self.stop = stop

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop.anywhere(args.device):  # every process stops at this step, a signal to one of them too
            control.should_save, control.should_training_stop = True, True


def _nan_at_this_step(state) -> bool:
    logged = next((h for h in reversed(state.log_history) if "loss" in h), None)
    return (
        logged is not None
        and logged.get("step") == state.global_step
        and not math.isfinite(float(logged["loss"]))
    )


class _CheckpointLoads:
    """Mixed into the unified trainer (before sentence-transformers' trainer): how a checkpoint's weights come
    back, on resume and for keep_best's final model."""

    def _load_from_checkpoint(self, checkpoint_path: str) -> None:
        # a LoRA run's checkpoints hold PEFT's layer names, which sentence-transformers' fresh model lacks
        model = getattr(self.model, "_orig_mod", self.model)
        if getattr(model, "neoembed_lora_config", None) is None:
            return super()._load_from_checkpoint(checkpoint_path)
        return load_training_checkpoint(model, checkpoint_path)

    def _load_best_model(self):
        # sentence-transformers logs a failed load and goes on with the last step's weights while the state
        # and the model card name the best step: a best step without its checkpoint stops the run instead
        best, folder = self.state.best_global_step, self.state.best_model_checkpoint
        if not folder or Path(folder).name != f"checkpoint-{best}" or not Path(folder).is_dir():
            raise TrainingStopped(
                f"keep_best: the best step {best} has no checkpoint ({folder}); no final model was saved. "
                "Evaluate only at saved steps (eval.steps a multiple of save_steps)"
            )
        self.model.model_card_data.set_best_model_step(best)
        self._load_from_checkpoint(folder)


def _trainer_class():
    from sentence_transformers import SentenceTransformerTrainer

    class UnifiedTrainer(_CheckpointLoads, SentenceTransformerTrainer):
        """Per-dataset batch sizes, the sampler handed to the metrics callback (through ``samplers``) for logging
        which dataset each step used, and checkpoints written to a staging folder, sealed with a checksum marker
        and renamed (neoembed.runs). All of it travels as constructor arguments, per trainer."""

        def __init__(
            self,
            *args,
            batch_sizes: dict,
            samplers: list,
            settings: dict | None,
            keep: int | None,
            no_duplicates: dict[str, bool] | None = None,
            **kwargs,
        ):
            # ``keep``: save_total_limit, applied here (transformers gets none: its end-of-run clean-up would also
            # delete the newest checkpoint of an interrupted run kept for --resume); ``no_duplicates``: card name ->
            # no text twice in its batches
            self.neoembed_batch_sizes, self.neoembed_samplers = batch_sizes, samplers
            self.neoembed_keep = keep
            self.neoembed_no_duplicates = no_duplicates or {}
            self.neoembed_settings, self._neoembed_staging = settings, None
            super().__init__(*args, **kwargs)

        def get_batch_sampler(self, dataset, **kwargs):  # sentence-transformers passes keywords only
            if any(self.train_dataset[n] is dataset for n, u in self.neoembed_no_duplicates.items() if u):
                return NoDuplicatesBatchSampler(dataset, **kwargs)
            return super().get_batch_sampler(dataset, **kwargs)

        def get_multi_dataset_batch_sampler(self, dataset, batch_samplers, generator=None, seed=0):
            names = list(self.train_dataset.keys())
            for name, sampler in zip(names, batch_samplers, strict=True):
                sampler.batch_size = self.neoembed_batch_sizes.get(name, sampler.batch_size)
                if isinstance(sampler, NoDuplicatesBatchSampler):
                    logger.info("card %s: a text repeats across rows, so no batch holds it twice", name)
            sampler = super().get_multi_dataset_batch_sampler(dataset, batch_samplers, generator, seed)
            self.neoembed_samplers.append(sampler)
            return sampler

        def _get_output_dir(self, trial):
            # transformers writes a checkpoint into <this>/checkpoint-N: the staging folder while one is written
            if self._neoembed_staging is not None:
                return str(self._neoembed_staging)
            return super()._get_output_dir(trial)

        def _save_checkpoint(self, model, trial):
            if _nan_at_this_step(self.state):  # a NaN step at a save step: its state is not a checkpoint
                return
            step, output = self.state.global_step, Path(self.args.output_dir)
            main = self.args.should_save
            staged = output / f".checkpoint-{step}.partial"
            if main:
                stage_checkpoint(output, step)
            self.accelerator.wait_for_everyone()
            self._neoembed_staging = staged
            try:
                super()._save_checkpoint(model, trial)
            except Exception as e:  # a full disk, say: the staging folder goes, the last checkpoint stays
                raise write_failed(staged, step, e) from e
            finally:
                self._neoembed_staging = None
            self.accelerator.wait_for_everyone()
            _point_at_best(self.state, staged / f"checkpoint-{step}", output, main)
            if main:
                commit_checkpoint(
                    staged / f"checkpoint-{step}", step, None, self.neoembed_settings, output=output
                )
                shutil.rmtree(staged, ignore_errors=True)  # the emptied staging folder (commit may have gone)
                _rotate(output, self.neoembed_keep, self.state.best_global_step)
            self.accelerator.wait_for_everyone()

    return UnifiedTrainer


def _query_prompt(recipe: UnifiedRecipe, cards) -> str:
    """The prefix every training query carried ("" when cards differ or instructions are off)."""
    instructions = [card.instruction if recipe.instructions else None for card, _ in cards]
    return training_prompts(instructions, recipe.template)["query"]


def _point_at_best(state, checkpoint: Path, output: Path, main: bool) -> None:
    """transformers records the best checkpoint under the folder it wrote to (the staging folder): every rank's
    state (each loads the best model at the end) and, on the main process, the trainer_state.json about to be
    sealed (the one a resume reads) name the checkpoint's final place."""
    if not state.best_global_step:
        return
    state.best_model_checkpoint = str(output / f"checkpoint-{state.best_global_step}")
    if main:
        state.save_to_json(str(checkpoint / "trainer_state.json"))


def _rotate(output: Path, keep: int | None, best_step: int | None) -> None:
    """``save_total_limit``: the ``keep`` newest checkpoints stay, and the best one (``keep_best``) besides."""
    if not keep:
        return
    best = output / f"checkpoint-{best_step}" if best_step else None
    for old in list_checkpoints(output)[:-keep]:
        if old != best:
            shutil.rmtree(old, ignore_errors=True)


def _best_line(recipe: UnifiedRecipe, state) -> str:
    """The model card's sentence on which checkpoint the final model is (``keep_best``)."""
    if recipe.keep_best is None or not state.best_global_step:
        return ""
    return (
        f" The final model is the checkpoint of step {state.best_global_step} of {state.global_step}, the best by "
        f"{recipe.keep_best.metric} ({recipe.keep_best.mode}): {state.best_metric:.6g}."
    )


def _model_card(recipe: UnifiedRecipe, cards, output: Path, best: str = "") -> None:
    from neoembed.model_card import model_card_text
    from neoembed.record import atomic_write_text

    datasets = []
    for card, _ in cards:
        src = card.source.hub.id if card.source.hub else f"local: {card.source.local.path}"
        lic = card.license or "unknown"
        if card.research_only and "research" not in lic.lower():
            lic += " (research use only)"
        datasets.append({"name": card.name, "source": src, "license": lic})
    batch = f"batch size {recipe.batch_size}"
    if recipe.batch_texts is not None:  # the per-dataset query counts are in run_record.json
        batch = f"{recipe.batch_texts} texts per step (query, positive and hard negatives)"
    notes = (
        f"Unified contrastive recipe: InfoNCE, cosine similarity, temperature {recipe.temperature}, "
        f"dataset sampling alpha {recipe.alpha}, {batch}, max length {recipe.max_length}, "
        f"seed {recipe.seed}.{best}"
    )
    if recipe.matryoshka is not None:
        dims = ", ".join(str(d) for d, _ in recipe.matryoshka.pairs())
        notes += f" Matryoshka dimensions {dims}: load with `truncate_dim=` one of them."
    config = output / "config.json"
    neobert = config.is_file() and json.loads(config.read_text()).get("model_type") == "neobert"
    text = model_card_text(
        output.name,
        base_model_name(recipe.model),
        datasets,
        steps=recipe.steps,
        notes=notes,
        neobert=neobert,
        query_prompt=_query_prompt(recipe, cards),
    )
    atomic_write_text(output / "README.md", text)


def _training_args(recipe: UnifiedRecipe, output: Path, full_sizes: list[int]):
    from sentence_transformers import SentenceTransformerTrainingArguments

    opt = recipe.optimizer
    args = SentenceTransformerTrainingArguments(
        output_dir=str(output),
        max_steps=recipe.steps,
        per_device_train_batch_size=recipe.batch_size,
        learning_rate=opt.lr,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        adam_epsilon=opt.eps,
        weight_decay=opt.weight_decay,
        warmup_steps=opt.warmup_steps,
        lr_scheduler_type=opt.schedule if opt.schedule != "constant" else "constant_with_warmup",
        max_grad_norm=opt.grad_clip,
        bf16=recipe.precision == "bf16",
        fp16=recipe.precision == "fp16",
        save_strategy="steps",
        save_steps=recipe.save_steps,
        logging_steps=recipe.logging_steps,
        logging_nan_inf_filter=False,  # a NaN loss must reach the callback that stops the run
        report_to=list(recipe.report_to) or "none",
        run_name=output.name,  # the tracked run's name, as the run loop names it
        project=os.environ.get("TRACKIO_PROJECT", TRACKER_PROJECT),  # Trackio's project, as the run loop's
        **_eval_args(recipe),
        seed=recipe.seed,
        data_seed=recipe.seed,
        dataloader_drop_last=True,
        multi_dataset_batch_sampler=PowerLawDatasetBatchSampler.with_settings(
            recipe.alpha, recipe.steps, full_sizes
        ),
        disable_tqdm=not _is_terminal(),  # a bar on a terminal; elsewhere _PlainProgress's lines
        dataloader_pin_memory=torch.cuda.is_available(),
        use_cpu=join_on_cpu(),
    )
    # keep_best: set after the arguments' own check, which asks the opposite of ours (save_steps a multiple of
    # eval_steps, so an evaluated step may have no checkpoint); check_keep_best asks for a checkpoint at every
    # evaluated step, and transformers then always finds the best one to load
    args.load_best_model_at_end = recipe.keep_best is not None
    check_launch(args.world_size)  # every launched process joined (join_on_cpu: also without CUDA)
    return args


def _eval_args(recipe: UnifiedRecipe) -> dict:
    """Evaluation every ``eval.steps`` (the evaluator is neoembed.eval.training's) and, with ``keep_best``,
    transformers' best-model tracking, which survives a resume in trainer_state.json (``load_best_model_at_end``
    is set by :func:`_training_args`)."""
    if recipe.eval is None:
        return {"eval_strategy": "no"}
    out = {"eval_strategy": "steps", "eval_steps": recipe.eval.steps}
    if recipe.keep_best is not None:
        out |= {
            "metric_for_best_model": f"eval_{recipe.keep_best.metric}",
            "greater_is_better": recipe.keep_best.mode == "max",
        }
    return out


def _purge_tensorboard(trainer, step: int) -> None:
    """On resume: transformers' TensorBoard writer hides the events logged after the resumed checkpoint."""
    import functools

    from transformers.integrations import TensorBoardCallback

    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, TensorBoardCallback) and cb._SummaryWriter is not None:
            cb._SummaryWriter = functools.partial(cb._SummaryWriter, purge_step=step + 1)


def _resume_logs(trainer, checkpoint: Path, output: Path, main: bool) -> None:
    """On resume: the metrics and TensorBoard events logged after ``checkpoint`` go (its step is logged again)."""
    from neoembed.runs import trim_metrics

    step = json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]
    trim_metrics(output / "metrics.jsonl", step) if main else None
    _purge_tensorboard(trainer, step)
    logger.warning("resuming from %s (step %d)", checkpoint, step)


def _write_run_record(
    recipe: UnifiedRecipe,
    output: Path,
    cards,
    reports: dict,
    datasets,
    settings: dict,
    batch_sizes: dict,
    holdout: tuple[dict, dict],
) -> None:
    """``run_record.json``, and the holdout's task folders (``eval/holdout-<card>/``) that it describes."""
    held, holdout_identity = holdout
    write_holdout_tasks(output, held, cards, recipe)
    write_run_record(
        output,
        "train",
        recipe=recipe,
        data_files=[f for f in local_data_paths(cards) if f.is_file()],
        extra={
            "base_model": base_model_name(recipe.model),  # the model card's hub id (None: a local model)
            "cards": {
                c.name: {"pinned": c.pinned, "license": c.license, "data": reports[c.name].as_dict()}
                for c, _ in cards
            },
            "negatives_per_query": {n: d.num_columns - 2 for n, d in datasets.items()},
            "batch_size": batch_sizes,  # queries per step of each dataset
            "holdout": holdout_identity,  # eval.holdout: each card's held-out rows (indices, seed, hash of texts)
            "world_size": settings["processes"],  # the launched count (check_launch: every process joined)
            **run_identity(settings),
        },
    )


def _fit(trainer, checkpoint: Path | None, stop: StopSignal, recipe: UnifiedRecipe, output: Path, main: bool):
    """``trainer.train`` with the stop signals caught, out-of-memory explained, and the curves plotted."""
    from neoembed.plots import plot_training_curves

    try:
        with stop:
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint is not None else None)
    except torch.OutOfMemoryError as e:
        raise TrainingStopped(
            "out of memory: lower batch_size, enable GradCache with loss.name=cached_infonce loss.mini_batch_size=32 (same loss, memory of "
            f"one mini-batch), or shorten max_length (now {recipe.max_length}). ({e})"
        ) from None
    finally:
        if main and (output / "metrics.jsonl").exists():
            plot_training_curves(output / "metrics.jsonl", output / "training_curves.png", title=output.name)


def train(
    recipe: UnifiedRecipe,
    recipe_dir: Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    evaluator=None,
) -> Path:
    """Run the unified recipe; returns the output folder (final model, metrics, run record, model card).

    The output folder must be new or empty, unless ``resume`` (continue the run it holds, from its newest
    complete checkpoint) or ``overwrite`` (clear it); see :func:`neoembed.runs.prepare_output_dir`. A recipe with
    ``eval:`` needs ``evaluator``: ``MtebEvaluator(recipe.eval, recipe_dir, holdout_task_paths(recipe, recipe_dir))``
    (eval.training's, train.holdout's; ``neoembed train`` passes it: evaluation sits above training). Raises
    :class:`~neoembed.runs.TrainingInterrupted` after checkpointing on SIGTERM / Ctrl-C."""
    from neoembed.recipe import seed_everything
    from neoembed.sentence import load

    seed_everything(recipe.seed)
    _check_extras(recipe, evaluator)
    output = Path(recipe.output_dir)
    main = launched_main()
    # bad data, a used output folder and truncated weights fail before the model loads
    datasets, cards, batch_sizes, reports, held, holdout = _training_data(recipe, recipe_dir)
    full_sizes = [reports[name].full_size or len(datasets[name]) for name in datasets]
    no_duplicates = {
        n: plan_no_duplicates(recipe.no_duplicates, d, batch_sizes[n], n) for n, d in datasets.items()
    }
    settings = resume_settings(recipe, per_process_batch=True) | (data := card_fingerprints(cards))
    checkpoint = prepare_output_dir(
        output,
        overwrite=overwrite,
        resume=resume,
        settings=settings,
        defaults=resume_defaults(recipe, per_process_batch=True) | data,  # a run from before data.* resumes
        main_process=main,
    )
    check_same_holdout(output, holdout, resuming=checkpoint is not None)
    check_weight_files(recipe.model)
    model = load(recipe.model, pooling=recipe.pooling, compile=recipe.compile)
    base_max_length = _training_length(model, recipe)  # the saved model gets base_max_length back
    if recipe.adapter is not None:
        a = recipe.adapter
        add_lora(model, a.r, a.alpha, a.dropout, a.target_modules)
        logger.info("LoRA adapter: %d of %d parameters train", *count_parameters(model))
    with _tracker_env(output, checkpoint is not None):  # before sentence-transformers' trainer sets a project
        samplers: list = []
        tally = MaskTally()  # what false-negative masking drops, logged with each metrics row
        trainer = _trainer_class()(
            model=model,
            args=_training_args(recipe, output, full_sizes),
            train_dataset=datasets,
            loss=build_loss(recipe.loss.name, model, recipe, tally),
            batch_sizes=batch_sizes,
            samplers=samplers,
            settings=settings,
            keep=recipe.save_total_limit,
            evaluator=evaluator,
            no_duplicates=no_duplicates,
        )
        output.mkdir(parents=True, exist_ok=True)
        metrics = _MetricsCallback(output, samplers, list(datasets.keys()), batch_sizes, main, tally.pop)
        stop = StopSignal()
        _add_callbacks(trainer, recipe, metrics, stop, output, main)
        if checkpoint is not None:
            _resume_logs(trainer, checkpoint, output, main)
        if main:
            _write_run_record(recipe, output, cards, reports, datasets, settings, batch_sizes, (held, holdout))
        _fit(trainer, checkpoint, stop, recipe, output, main)
    if metrics.nan_step is not None:
        raise TrainingStopped(
            f"the loss became NaN at step {metrics.nan_step}; training stopped and the NaN state was not saved. "
            f"The last good checkpoint is {_last_checkpoint(output) or '(none yet)'}: resume from it with a lower "
            "learning rate, or use bf16/fp32 instead of fp16."
        )
    if stop.received is not None:
        raise TrainingInterrupted(stop.received, _last_checkpoint(output))
    if main:
        _note_early_stop(recipe, trainer.state, output)
        _save_final(recipe, model, cards, output, trainer.state, base_max_length)
    return output


def _note_early_stop(recipe: UnifiedRecipe, state, output: Path) -> None:
    """``keep_best.patience`` ended the run before ``steps``: said on the console and in the run record, as the
    run loop says it."""
    patience = recipe.keep_best.patience if recipe.keep_best is not None else None
    if patience is None or state.global_step >= recipe.steps:
        return
    note_early_stop(output, state.global_step, patience, recipe.keep_best.metric, state.best_global_step)


def _training_data(recipe: UnifiedRecipe, recipe_dir: Path | None):
    """Every card loaded and checked, with its report and batch size, and the holdout's rows taken out (with
    what the run record keeps of them)."""
    held_card_names(recipe, recipe_dir)  # an unknown eval.holdout card fails before any data loads
    reports: dict = {}
    datasets, cards, batch_sizes = prepare_datasets(recipe, recipe_dir, reports)
    sizes = {name: len(d) for name, d in datasets.items()}
    datasets, held = split_holdout(recipe, datasets, cards, batch_sizes)
    return datasets, cards, batch_sizes, reports, held, holdout_record(recipe, held, sizes, datasets)


def _add_callbacks(
    trainer, recipe: UnifiedRecipe, metrics: _MetricsCallback, stop: StopSignal, output: Path, main: bool
) -> None:
    trainer.add_callback(metrics)
    trainer.add_callback(_SignalCallback(stop))
    if not _is_terminal():  # transformers' own printer would add a raw dict per log beside our line
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(_PlainProgress())
    trainer.add_callback(_TrackerIdsCallback(trainer.callback_handler.callbacks, output, main))
    trainer.add_callback(_RecipeHyperparameters(trainer.callback_handler.callbacks, recipe, main))
    if recipe.keep_best is not None and recipe.keep_best.patience is not None:
        from transformers import EarlyStoppingCallback  # its count travels in the checkpoint's trainer state

        trainer.add_callback(EarlyStoppingCallback(early_stopping_patience=recipe.keep_best.patience))


def _is_terminal() -> bool:
    import sys

    return sys.stderr.isatty()


def _check_first_module(recipe: UnifiedRecipe) -> None:
    """A local sentence-transformers folder whose first module is a StaticEmbedding, refused before the data or
    the model load (see :func:`_refuse_static`)."""
    modules, first = Path(str(recipe.model)) / "modules.json", ""
    with contextlib.suppress(OSError, ValueError, TypeError, IndexError, KeyError, AttributeError):
        first = str(json.loads(modules.read_text())[0]["type"]).rsplit(".", 1)[-1]  # unreadable: load tells
    _refuse_static(first, recipe, first == "StaticEmbedding")


def _training_length(model, recipe: UnifiedRecipe) -> int | None:
    """The recipe's max_length set on the loaded model for training; returns the model's own. A first module
    whose token limit cannot be set (a read-only max_seq_length) is a static model, refused here for a model
    known only once loaded (a hub id)."""
    limit = getattr(type(model[0]), "max_seq_length", None)
    _refuse_static(type(model[0]).__name__, recipe, isinstance(limit, property) and limit.fset is None)
    base = model.max_seq_length
    model.max_seq_length = recipe.max_length
    return base


def _refuse_static(kind: str, recipe: UnifiedRecipe, static: bool) -> None:
    """The unified trainer trains models that read padded token sequences (its losses find repeated texts from
    token ids and attention masks, and max_length truncates them); a StaticEmbedding model reads a bag of token
    vectors with neither, and has no max_seq_length to set."""
    if static:
        raise RecipeError(
            f"model {recipe.model} is a static-embedding model (its first module is a {kind}: one vector per "
            "token, no positions, no max_seq_length): neoembed train trains transformer encoders only. Train "
            "it with sentence-transformers' own SentenceTransformerTrainer (e.g. MultipleNegativesRankingLoss), "
            "or set model: to a transformer encoder"
        )


def _check_max_length(recipe: UnifiedRecipe) -> None:
    """A ``max_length`` beyond a local model's learned positions fails at the first long text, deep in the
    embedding lookup: refuse it here, naming the key (RoPE models such as NeoBERT extrapolate: a warning)."""
    config = Path(str(recipe.model)) / "config.json"
    if not config.is_file():
        return
    cfg = json.loads(config.read_text())
    positions, trained = cfg.get("max_position_embeddings"), cfg.get("max_length")
    if isinstance(positions, int) and recipe.max_length > positions:
        raise RecipeError(
            f"max_length={recipe.max_length} exceeds the {positions} positions of model {recipe.model} "
            "(config.json max_position_embeddings): lower max_length"
        )
    if isinstance(trained, int) and recipe.max_length > trained:
        logger.warning(
            "max_length=%d is longer than the %d tokens model %s was trained at (rotary positions extrapolate; "
            "quality beyond its length is not measured)",
            recipe.max_length,
            trained,
            recipe.model,
        )


def _check_extras(recipe: UnifiedRecipe, evaluator) -> None:
    """The engine, trackers, PEFT and the evaluator a recipe needs: checked before data or the model load."""
    check_engine("unified")
    check_trackers(recipe.report_to)
    _check_first_module(recipe)
    _check_max_length(recipe)
    if recipe.adapter is not None:
        require_peft()
    if recipe.eval is not None and evaluator is None:
        raise ValueError(
            "the recipe has an eval: block but no evaluator was given: pass "
            "evaluator=neoembed.eval.training.MtebEvaluator(recipe.eval, recipe_dir), or run neoembed train"
        )


def _save_final(recipe: UnifiedRecipe, model, cards, output: Path, state, base_max_length) -> None:
    """The final model, all or nothing (:func:`neoembed.runs.save_final_model`): with keep_best, the best
    checkpoint's weights (loaded back by transformers); a LoRA adapter alone in ``adapter/``, then merged into the
    saved weights; the query instruction as the saved ``query`` prompt and the base model's max_seq_length (the
    recipe's max_length was for training); then the model card."""

    def save(folder: Path) -> None:
        if recipe.adapter is not None:
            save_adapter(model, folder / "adapter")
            merge_lora(model)
        model.prompts = {**model.prompts, "query": _query_prompt(recipe, cards), "document": ""}
        model.max_seq_length = base_max_length
        model.save(str(folder))
        if recipe.matryoshka is not None:
            record_matryoshka_dims(folder, recipe.matryoshka.dims)

    save_final_model(output, save, state.global_step)
    _model_card(recipe, cards, output, _best_line(recipe, state))


def _last_checkpoint(output: Path) -> Path | None:
    complete = [c for c in list_checkpoints(output) if verify_checkpoint(c) is None]
    return complete[-1] if complete else None
