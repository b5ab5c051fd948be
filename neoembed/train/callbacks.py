"""What the unified trainer tells transformers' Trainer at its events: a ``metrics.jsonl`` row per logging step
(dataset, rate, memory, masked false negatives; a NaN loss stops), plain progress lines where the output is not a
terminal, SIGTERM / Ctrl-C turned into a checkpoint and a stop, each tracked run's id (so ``--resume`` continues
it) and the recipe as hyperparameters; and, on resume, the logs trimmed to the checkpoint's step."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from neoembed.runs import (
    TRACKER_PROJECT,
    MetricsLog,
    StopSignal,
    progress_line,
    recipe_hyperparameters,
    tensorboard_hparams,
)
from neoembed.train.recipe import UnifiedRecipe

logger = logging.getLogger(__name__)


class MetricsCallback(TrainerCallback):
    """Appends step, loss, learning rate, dataset, samples/s and peak memory to metrics.jsonl (through
    :class:`~neoembed.runs.MetricsLog`, which also reports a run stuck at loss 0); stops on NaN."""

    def __init__(self, output: Path, samplers: list, names: list[str], batch_sizes: dict, main: bool, counts):
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


class TrackerIdsCallback(TrainerCallback):
    """Writes the id of each tracked run (MLflow, W&B) to ``OUTPUT/trackers.json`` once the trackers have started,
    so that ``--resume`` continues the same tracked run (:func:`tracker_env`) instead of opening a new one."""

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


class RecipeHyperparameters(TrainerCallback):
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
def tracker_env(output: Path, resume: bool):
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


class PlainProgress(TrainerCallback):
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


class SignalCallback(TrainerCallback):
    """On SIGTERM or Ctrl-C: finish the current step, write a checkpoint, stop."""

    def __init__(self, stop: StopSignal):
        self.stop = stop

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop.anywhere(args.device):  # every process stops at this step, a signal to one of them too
            control.should_save, control.should_training_stop = True, True


def _purge_tensorboard(trainer, step: int) -> None:
    """On resume: transformers' TensorBoard writer hides the events logged after the resumed checkpoint."""
    import functools

    from transformers.integrations import TensorBoardCallback

    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, TensorBoardCallback) and cb._SummaryWriter is not None:
            cb._SummaryWriter = functools.partial(cb._SummaryWriter, purge_step=step + 1)


def resume_logs(trainer, checkpoint: Path, output: Path, main: bool) -> None:
    """On resume: the metrics and TensorBoard events logged after ``checkpoint`` go (its step is logged again)."""
    from neoembed.runs import trim_metrics

    step = json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]
    trim_metrics(output / "metrics.jsonl", step) if main else None
    _purge_tensorboard(trainer, step)
    logger.warning("resuming from %s (step %d)", checkpoint, step)


def add_callbacks(
    trainer, recipe: UnifiedRecipe, metrics: MetricsCallback, stop: StopSignal, output: Path, main: bool
) -> None:
    trainer.add_callback(metrics)
    trainer.add_callback(SignalCallback(stop))
    if not is_terminal():  # transformers' own printer would add a raw dict per log beside our line
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(PlainProgress())
    trainer.add_callback(TrackerIdsCallback(trainer.callback_handler.callbacks, output, main))
    trainer.add_callback(RecipeHyperparameters(trainer.callback_handler.callbacks, recipe, main))
    if recipe.keep_best is not None and recipe.keep_best.patience is not None:
        from transformers import EarlyStoppingCallback  # its count travels in the checkpoint's trainer state

        trainer.add_callback(EarlyStoppingCallback(early_stopping_patience=recipe.keep_best.patience))


def is_terminal() -> bool:
    import sys

    return sys.stderr.isatty()
