"""The run loop of pre-training, CDE and GLUE: each supplies its data and a step function, the loop does the rest.

What the loop owns (so that the trainers cannot disagree on it):

- **resume**: accelerate's state (models, optimizer, scheduler and every registered object, the RNG of every
  process) plus ``trainer_state.json`` (the step and the caller's own state, such as data positions);
- **one checkpoint format**, every ``save_steps`` steps and at the last step: ``checkpoint-N/state``
  (``accelerator.save_state``) and ``trainer_state.json``, written to ``.checkpoint-N.partial``, sealed with a
  checksum marker and renamed (:mod:`neoembed.runs`); a full disk ends in
  :class:`~neoembed.runs.CheckpointWriteError` with the previous checkpoint intact; a caller's
  ``save_model(folder)`` adds a loadable model at the checkpoint's root (``neoembed mteb --model
  RUN/checkpoint-N``);
- **the update**: gradient clipping, optimizer and scheduler step, after a NaN/inf check that stops before the
  weights change (:class:`~neoembed.runs.TrainingStopped`);
- **stop signals**: SIGTERM / Ctrl-C finish the step, checkpoint, and raise
  :class:`~neoembed.runs.TrainingInterrupted` (exit 143 / 130); the flag travels with the step's loss so that every
  process stops at the same step;
- **metrics**: the logging window, ``metrics.jsonl`` / TensorBoard / ``training_curves.png`` (trimmed on resume),
  the zero-loss watch;
- **evaluation** (a recipe's ``eval:``): the caller's ``evaluate(step)`` every ``eval.steps`` steps and at the end,
  on the main process (its scores are broadcast), logged as ``eval_<name>`` rows; with ``keep_best``, the best
  saved step is kept out of the checkpoint rotation, survives a resume in ``trainer_state.json``, and its weights
  become the final model (``best.json`` and ``run_record.json`` say which); with ``keep_best.patience``, the run
  ends early after that many saved evaluations without a new best (the count survives a resume too);
- **trackers**: the recipe as hyperparameters (``recipe.a.b`` keys) when a run starts, to TensorBoard and accelerate's
  trackers alike.

A step function ``step_fn(step, stop_requested) -> StepOutput`` runs the forward and backward passes of one
optimizer step on every process and returns the loss averaged over processes, whether any process was asked to
stop, and the sums its logged row needs.

Around it, the setup the trainers share: :func:`accelerator` (every launched process joined), :func:`adamw` (the
one optimizer), :meth:`RunLoop.start` (resume, then the run record) and :meth:`RunLoop.finish` (the final save).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neoembed.progress import PLAIN_INTERVAL
from neoembed.record import add_to_run_record, atomic_write_text, readable_weights, write_run_record
from neoembed.runs import (
    MLFLOW_STORE_KEY,
    TRACKER_IDS,
    TRACKER_PROJECT,
    MetricsLog,
    StopSignal,
    TrainingInterrupted,
    TrainingStopped,
    check_mlflow_resume,
    check_trackers,
    commit_checkpoint,
    list_checkpoints,
    mlflow_store,
    note_early_stop,
    param_groups,
    progress_line,
    rates_from_schedule,
    read_tracker_ids,
    recipe_hyperparameters,
    run_identity,
    stage_checkpoint,
    trajectory_value,
    write_failed,
)

__all__ = [
    "RunLoop",
    "StepOutput",
    "accelerator",
    "adamw",
    "check_launch",
    "join_on_cpu",
    "mean_loss_and_stop",
    "schedule",
]

logger = logging.getLogger(__name__)


def join_on_cpu() -> bool:
    """Whether launched processes must join on the CPU: several were launched (``WORLD_SIZE``) on a machine without
    CUDA. accelerate and transformers join them over gloo only when told to run on the CPU; otherwise each trains
    alone, and all of them write the same folder."""
    import torch

    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()


def check_launch(world: int) -> None:
    """Refuse a launch where the processes would not train together: ``world`` (the processes accelerate or the
    Trainer joined) is not the number launched."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != world:
        raise RuntimeError(
            f"{launched} processes were launched (WORLD_SIZE) but accelerate sees {world}: every process would train "
            "alone. On CPU launch with `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N ...`"
        )


#: the sharded engines ``accelerate launch`` starts processes for (it sets the variable in each)
SHARDED_ENGINES = {"DeepSpeed": "ACCELERATE_USE_DEEPSPEED", "FSDP": "ACCELERATE_USE_FSDP"}
#: per trainer, the sharded engines it was verified on, and why the others are refused
ENGINE_SUPPORT = {
    "unified": ((), "sentence-transformers' cached losses compute gradients twice under DeepSpeed (its issue "
                "#3173), and neither engine has been verified with the unified trainer"),
    "cde": ((), "the two-stage GradCache wraps each stage in its own DDP module, which a sharded engine replaces"),
    "glue": ((), "not verified on it"),
    "pretrain": (("DeepSpeed",), "ZeRO-1 and ZeRO-2 are verified (one GPU, a run and its resume); FSDP is not"),
}  # fmt: skip


def check_engine(trainer: str) -> None:
    """Refuse, before any model loads, a DeepSpeed or FSDP launch of a trainer not verified on that engine
    (:data:`ENGINE_SUPPORT`): a sharded engine that silently reduces gradients twice or not at all trains wrong.
    A verified one is refused without CUDA, where accelerate would run DDP in its place."""
    import torch

    verified, why = ENGINE_SUPPORT[trainer]
    for engine, variable in SHARDED_ENGINES.items():
        if os.environ.get(variable, "false").lower() != "true":
            continue
        if engine not in verified:
            raise ValueError(
                f"{trainer} training under {engine} is not supported: {why}. Launch it with DDP (`accelerate "
                "launch --multi_gpu` or torchrun; docs/distributed.md)"
            )
        if not torch.cuda.is_available():  # accelerate shards on accelerator devices only
            raise ValueError(
                f"{engine} needs CUDA: on a machine without it accelerate would not shard, and the processes would "
                "train as plain DDP on the CPU (or each alone). Launch without the engine's config "
                "(`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N ...`; docs/distributed.md)"
            )


def accelerator(cpu: bool = False, **kwargs):
    """accelerate's ``Accelerator(**kwargs)`` with every launched process joined: on the CPU when ``cpu`` or
    :func:`join_on_cpu` says so (``ACCELERATE_USE_CPU=1`` too: accelerate reads it), a launch it did not join
    refused (:func:`check_launch`)."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=cpu or join_on_cpu(), **kwargs)
    check_launch(acc.num_processes)
    if kwargs.get("mixed_precision") == "fp16" and acc.device.type == "cpu":
        logger.warning(
            "precision=fp16 on the CPU: accelerate autocasts to fp16 only on accelerators, so this run computes "
            "in fp32 (its losses equal an fp32 run's); bf16 runs on the CPU"
        )
    return acc


def schedule(opt, optimizer, steps: int):
    """The learning-rate schedule of a recipe's :class:`~neoembed.recipe.OptimizerConfig` over ``steps`` steps,
    as transformers computes it (``constant`` keeps its warm-up)."""
    from transformers import get_scheduler

    name = opt.schedule if opt.schedule != "constant" else "constant_with_warmup"
    return get_scheduler(name, optimizer, num_warmup_steps=opt.warmup_steps, num_training_steps=steps)


def mean_loss_and_stop(loss: float, stop_requested: bool, world: int, device):
    """The loss averaged over the processes, and whether any process asked to stop: one small all-reduce."""
    import torch

    stats = torch.tensor([loss, 1.0 if stop_requested else 0.0], dtype=torch.float64)
    if world == 1:
        return stats
    stats_dev = stats.to(device)
    torch.distributed.all_reduce(stats_dev)
    stats = stats_dev.cpu()
    stats[0] /= world
    return stats


def adamw(model, opt):
    """AdamW over ``model`` with a recipe's :class:`~neoembed.recipe.OptimizerConfig` (no decay on norms, biases)."""
    import torch

    return torch.optim.AdamW(param_groups(model, opt.weight_decay), lr=opt.lr, betas=opt.betas, eps=opt.eps)


def _tracked(tracker, row: dict) -> dict:
    """A logged row as ``tracker`` takes it: no mapping (``dataset_steps``: metrics.jsonl's), and for MLflow only
    numbers (accelerate drops a text value, the dataset's name, with a warning per name); the others keep text."""
    dropped = (dict, str) if getattr(tracker, "name", "") == "mlflow" else dict
    return {k: v for k, v in row.items() if k != "step" and not isinstance(v, dropped)}


def _start_trackers(report_to, output: Path, resumed: bool, main: bool) -> list:
    """accelerate's trackers for ``report_to`` (TensorBoard is MetricsLog's own), each run named after the
    output folder, in the project :data:`~neoembed.runs.TRACKER_PROJECT` (``WANDB_PROJECT`` /
    ``TRACKIO_PROJECT`` / ``MLFLOW_EXPERIMENT_NAME`` choose another, as in the unified trainer); a resumed run
    continues the MLflow / W&B run recorded in ``OUTPUT/trackers.json`` (with the MLflow store it was logged
    to), once the MLflow run is known to be in the current store. Each tracker's ``continued`` says whether it
    continues a run."""
    names = [n for n in report_to if n != "tensorboard"]
    if not names or not main:
        return []
    from accelerate.tracking import MLflowTracker, TrackioTracker, WandBTracker

    ids = read_tracker_ids(output) if resumed else {}
    if resumed and "mlflow" in names:
        check_mlflow_resume(output)
    make = {
        "mlflow": lambda: MLflowTracker(
            os.environ.get("MLFLOW_EXPERIMENT_NAME", "Default"),
            run_id=ids.get("mlflow"),
            run_name=output.name,
        ),
        "wandb": lambda: WandBTracker(
            os.environ.get("WANDB_PROJECT", TRACKER_PROJECT),
            name=output.name,
            id=ids.get("wandb"),
            resume="allow",
        ),
        "trackio": lambda: TrackioTracker(
            os.environ.get("TRACKIO_PROJECT", TRACKER_PROJECT),
            name=output.name,
            resume="allow" if resumed else "never",  # Trackio continues a run by its name
        ),
    }
    trackers = [make[n]() for n in names]
    for tracker in trackers:
        tracker.start()
    run_ids = {}
    for name, tracker in zip(names, trackers, strict=True):
        if name == "mlflow":
            import mlflow

            run_ids[name] = tracker.active_run.info.run_id
            run_ids[MLFLOW_STORE_KEY] = mlflow_store(mlflow.get_tracking_uri())
        elif name == "wandb":
            run_ids[name] = tracker.run.id
        # a run id given (MLFLOW_RUN_ID / WANDB_RUN_ID too) continues a run; else a new one, sent the recipe
        tracker.continued = resumed and bool(ids.get(name) or os.environ.get(f"{name.upper()}_RUN_ID"))
    output.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output / TRACKER_IDS, json.dumps(run_ids, indent=1) + "\n")
    return trackers


@dataclass
class StepOutput:
    loss: float  # the step's loss, averaged over processes (a host number: one sync per step)
    stop: bool  # some process received SIGTERM / Ctrl-C (reduced together with the loss)
    sums: dict[str, float] = field(default_factory=dict)  # added up over the logging window


class RunLoop:
    """One training run in ``output``: ``resume`` (optional), then ``run``; the caller saves the final model."""

    def __init__(
        self,
        accelerator,
        recipe,
        output: Path,
        *,
        optimizer,
        parameters: Callable[[], Any],
        settings: dict | None,
        scheduler=None,
        grad_clip: float | None = None,
        registered: tuple = (),
        trainer_state: Callable[[], dict] = dict,
        desc: str = "train",
        progress: bool = True,
        nan_advice: str = "",
        evaluate: Callable[[int], dict[str, float]] | None = None,
        save_model: Callable[[Path], None] | None = None,
        eval_data: list | None = None,  # the held-out data's fingerprints: a score depends on them as on eval:
    ):
        self.acc, self.recipe, self.output = accelerator, recipe, Path(output)
        # by default the recipe's optimizer block: its schedule over recipe.steps and its clipping
        if scheduler is None:
            scheduler = schedule(recipe.optimizer, optimizer, recipe.steps)
        grad_clip = recipe.optimizer.grad_clip if grad_clip is None else grad_clip
        self.optimizer, self.scheduler = optimizer, scheduler
        self.parameters, self.grad_clip = parameters, grad_clip
        self.settings, self.trainer_state, self.desc, self.progress = settings, trainer_state, desc, progress
        self.nan_advice, self.evaluate, self.save_model, self.eval_data = nan_advice, evaluate, save_model, eval_data
        self.best: dict | None = None  # keep_best: {"step", "metric", "value"} of the best saved step so far
        self.stale = 0  # keep_best.patience: saved evaluations since the best one
        self._evaluation_due = False  # this step's evaluation failed: a resume from its checkpoint runs it first
        self.metrics = MetricsLog(self.output, recipe.report_to, accelerator.is_main_process)
        check_trackers(recipe.report_to)
        self.trackers: list = []
        self.step = 0
        # the sums of the steps since the last logged row (and their seconds): a checkpoint keeps them
        self._window: dict[str, float] = {}
        self._window_seconds, self._t0 = 0.0, None
        # objects that are not accelerate-prepared (the scheduler; CDE's model and optimizer) travel in its state
        for obj in (scheduler, *registered):
            accelerator.register_for_checkpointing(obj)

    def resume(self, checkpoint: Path, load_state: Callable[[dict], None] = lambda state: None) -> int:
        """Load ``checkpoint`` (the newest complete one, from :func:`neoembed.runs.prepare_output_dir`)."""
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        load_state(state)  # the caller's checks first (an exact resume needs the same global batch)
        self.acc.load_state(str(checkpoint / "state"))
        rates_from_schedule(self.scheduler)  # a resume with other steps: the new schedule's rate from here
        self.step = int(state["step"])
        window = state.get("log_window") or {}  # the logging window the checkpoint fell inside
        self._window, self._window_seconds = dict(window.get("sums", {})), float(window.get("seconds", 0.0))
        self.best = state.get("best")
        keep = getattr(self.recipe, "keep_best", None)
        if self.best is not None and keep is not None and keep.metric != self.best["metric"]:
            raise ValueError(
                f"--resume: this run keeps its best step by eval_{self.best['metric']} (step {self.best['step']} so "
                f"far); keep_best.metric {keep.metric!r} would compare it with another score. Resume with "
                f"keep_best.metric={self.best['metric']}, or start a new run in another output_dir"
            )
        self._check_best_comparable(state.get("best_scored_with"))
        self.stale = int(state.get("evaluations_since_best", 0))
        self._evaluation_due = bool(state.get("evaluation_due", False))
        self.metrics.truncate(self.step)
        self.acc.print(f"resumed from {checkpoint} at step {self.step}")
        return self.step

    def _scored_with(self) -> dict:
        """The evaluation settings a score depends on: all of ``eval:`` but how often it runs and in what batches,
        and the held-out data's fingerprints (``eval_data``; a shard folder replaced in place keeps its path)."""
        evaluation = getattr(self.recipe, "eval", None)
        dumped = evaluation.model_dump(mode="json") if evaluation is not None else {}
        return {k: v for k, v in dumped.items() if k not in ("steps", "batch_size")} | {"data": self.eval_data}

    def _check_best_comparable(self, then: dict | None) -> None:
        """keep_best compares every later score with the best so far: refuse a resume whose evaluation scores
        another way (other held-out data, tasks or metric), where the comparison would pick by the data."""
        if then is None or self.best is None or getattr(self.recipe, "keep_best", None) is None:
            return  # nothing counted yet, or a checkpoint written before the settings were recorded
        now = {k: v for k, v in self._scored_with().items() if k in then or k != "data"}  # then: before data was
        changed = [f"eval.{k}: {then.get(k)!r} then, {now.get(k)!r} now" for k in sorted(then.keys() | now.keys())
                   if trajectory_value(k, then.get(k)) != trajectory_value(k, now.get(k))]  # fmt: skip
        if changed:
            raise ValueError(
                f"--resume: keep_best's best so far (step {self.best['step']}, eval_{self.best['metric']} "
                f"{self.best['value']:.6g}) was scored with other evaluation settings ({'; '.join(changed)}): a "
                "score of another evaluation does not compare with it. Resume with the evaluation it was scored "
                "with, or start a new run in another output_dir"
            )

    def start(
        self,
        checkpoint: Path | None,
        command: str,
        *,
        data_files: list[Path],
        extra: dict,
        load_state: Callable[[dict], None] = lambda state: None,
    ) -> None:
        """Resume from ``checkpoint`` (``None``: a new run), then write ``run_record.json`` on the main process;
        its ``extra`` is the world size, the caller's ``extra``, and the settings a resume compares."""
        if checkpoint is not None:
            self.resume(checkpoint, load_state)
        else:  # a run started again in its folder (a GLUE grid point) logs from its first step afresh
            self.metrics.truncate(0)
        if self.acc.is_main_process:
            self.output.mkdir(parents=True, exist_ok=True)
            extra = {"world_size": self.acc.num_processes, **extra, **run_identity(self.settings)}
            write_run_record(self.output, command, recipe=self.recipe, data_files=data_files, extra=extra)

    def finish(self, save_final: Callable[[], None]) -> None:
        """After :meth:`run`: ``save_final()`` on the main process while every other process waits for it; with
        ``keep_best``, the best checkpoint's state is loaded first (every process) and ``best.json`` written."""
        self.acc.wait_for_everyone()
        if self.best is not None and self.best["step"] != self.step:
            self.acc.load_state(str(self.output / f"checkpoint-{self.best['step']}" / "state"))
            # every process has read the best state before save_final may delete it (GLUE removes its checkpoints)
            self.acc.wait_for_everyone()
        if self.acc.is_main_process:
            save_final()
            readable_weights(self.output)
            if self.best is not None:
                best = self.best_record()
                atomic_write_text(self.output / "best.json", json.dumps(best, indent=1) + "\n")
                add_to_run_record(self.output, {"keep_best": best})
                print(
                    f"keep_best: the final model is step {best['step']} of {self.step}, the best by "
                    f"eval_{best['metric']} ({best['mode']}): {best['value']:.6g}",
                    file=sys.stderr,
                )
        self.acc.wait_for_everyone()

    def best_record(self) -> dict | None:
        """With ``keep_best``, after :meth:`run`: the final model's step, metric, score and mode, and the last step."""
        if self.best is None:
            return None
        return {**self.best, "mode": self.recipe.keep_best.mode, "last_step": self.step}

    def _scores(self) -> dict[str, float]:
        """The evaluation's scores on every process (the main process evaluates). A failure raises on every
        process, so that they save the steps trained together (:meth:`run`) instead of waiting on each other."""
        scores, failed = None, None
        if self.acc.is_main_process:
            try:
                scores = self.evaluate(self.step)
            except Exception as e:  # bad input (a metric no task logs) or a broken task: raised after the save
                failed = e
        if self.acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            scores = broadcast_object_list([scores])[0]
        if failed is not None:
            raise failed
        if scores is None:  # this process only follows: the main process says why
            raise TrainingStopped(f"the evaluation at step {self.step} failed on the main process (its error above)")
        return scores

    def _evaluate(self, saved: bool) -> bool:
        """Score the model now (main process), log the scores, and track the best ``saved`` step; True when
        ``keep_best.patience`` evaluations in a row found no better one (the run ends)."""
        scores = self._scores()
        row = {"step": self.step, **{f"eval_{k}": v for k, v in scores.items()}}
        self.metrics.write(row)
        for tracker in self.trackers:
            tracker.log(_tracked(tracker, row), step=self.step)
        if self.acc.is_main_process:
            shown = "  ".join(f"{k} {v:.4g}" for k, v in row.items() if k != "step")
            print(f"eval at step {self.step}: {shown}", file=sys.stderr, flush=True)
        keep = getattr(self.recipe, "keep_best", None)
        if keep is None or not saved:
            return False
        if keep.metric not in scores:
            raise ValueError(
                f"keep_best.metric {keep.metric!r} is not an evaluation score; they are: {sorted(scores)}"
            )
        value = scores[keep.metric]
        if self.best is None or (
            value > self.best["value"] if keep.mode == "max" else value < self.best["value"]
        ):
            self.best, self.stale = {"step": self.step, "metric": keep.metric, "value": value}, 0
        else:
            self.stale += 1
        return keep.patience is not None and self.stale >= keep.patience

    def _evaluate_or_save(self, saving: bool) -> bool:
        """:meth:`_evaluate`; when it fails, the steps trained are saved first (a checkpoint here, whatever
        ``save_steps`` says), marked so that a resume runs this evaluation before it trains on."""
        try:
            return self._evaluate(saved=saving)
        except Exception:
            self._evaluation_due = True
            saved = self.save()
            if self.acc.is_main_process:
                print(
                    f"the evaluation at step {self.step} failed; the steps trained are saved in {saved}: fix the "
                    "cause (below) and continue with --resume, which runs this evaluation first",
                    file=sys.stderr,
                    flush=True,
                )
            raise

    def _due_evaluation(self) -> bool:
        """A resume from a checkpoint whose evaluation failed runs it now (True: ``keep_best.patience`` is out)."""
        due, self._evaluation_due = self._evaluation_due, False
        if not due or self.evaluate is None or getattr(self.recipe, "eval", None) is None:
            return False
        # failing again leaves the checkpoint as it is: nothing new was trained
        return self._evaluate(saved=True) and self.step < self.recipe.steps

    def _stopped_early(self) -> None:
        if self.acc.is_main_process:
            best, patience = self.best, self.recipe.keep_best.patience
            note_early_stop(self.output, self.step, patience, best["metric"], best["step"])

    def save(self) -> Path:
        step, main = self.step, self.acc.is_main_process
        staged = self.output / f".checkpoint-{step}.partial"
        if main:
            stage_checkpoint(self.output, step)
        self.acc.wait_for_everyone()
        try:
            self.acc.save_state(str(staged / "state"))
            if main:
                if self.save_model is not None:  # a loadable model beside the state (neoembed mteb reads it)
                    self.save_model(staged)
                state = {"step": step, **self.trainer_state(), "best": self.best}
                state["best_scored_with"] = self._scored_with() if self.best is not None else None
                seconds = time.perf_counter() - self._t0 if self._t0 is not None else 0.0
                state["log_window"] = {"sums": self._window, "seconds": seconds}
                state["evaluations_since_best"] = self.stale
                state["evaluation_due"] = self._evaluation_due
                atomic_write_text(staged / "trainer_state.json", json.dumps(state, indent=2) + "\n")
        except Exception as e:  # a full disk, say: the staging folder goes, the last checkpoint stays
            raise write_failed(staged, step, e) from e
        self.acc.wait_for_everyone()
        if main:
            best = self.best["step"] if self.best else None
            commit_checkpoint(staged, step, self.recipe.save_total_limit, self.settings, protect=best)
        self.acc.wait_for_everyone()
        return self.output / f"checkpoint-{step}"

    def _update(self, out: StepOutput) -> tuple[float | None, float]:
        if not math.isfinite(out.loss):
            ckpts = list_checkpoints(self.output)
            raise TrainingStopped(
                f"the loss is {out.loss} at step {self.step + 1}: training stopped before the update. Last "
                f"checkpoint: {ckpts[-1] if ckpts else 'none'}. {self.nan_advice}; then --resume"
            )
        grad_norm = self.acc.clip_grad_norm_(self.parameters(), self.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return (float(grad_norm) if grad_norm is not None else None), lr

    def log_hyperparameters(self) -> None:
        """The recipe as ``recipe.a.b`` hyperparameters, to TensorBoard and every tracker at a run's first start;
        a resumed run has them already (MLflow refuses a changed parameter, W&B keeps its config), except
        Trackio's, whose resumed run starts with a new config, and a new tracked run of a resumed one (its id
        deleted from ``trackers.json``)."""
        hyperparameters = recipe_hyperparameters(self.recipe)
        if self.step == 0:
            self.metrics.hyperparameters(hyperparameters)
        for tracker in self.trackers:
            if not getattr(tracker, "continued", self.step > 0) or tracker.name == "trackio":
                tracker.store_init_configuration(hyperparameters)

    def run(
        self,
        step_fn: Callable[[int, bool], StepOutput],
        row_fn: Callable[[dict, float, float | None, float], dict],
    ) -> None:
        """Train from ``self.step`` to ``recipe.steps``. ``row_fn(sums, seconds, grad_norm, lr)`` turns the
        window's sums (with ``steps``, the number of steps in it) into the logged row, without ``step``."""
        from tqdm.auto import tqdm

        r = self.recipe
        self.trackers = _start_trackers(
            self.recipe.report_to, self.output, self.step > 0, self.acc.is_main_process
        )
        self.log_hyperparameters()
        shown = self.progress and self.acc.is_main_process
        plain = (
            shown and not sys.stderr.isatty()
        )  # not a terminal: a line per logging step, not a bar's redraws
        bar = tqdm(total=r.steps, initial=self.step, desc=self.desc, disable=not shown or plain)
        first, start = self.step, time.perf_counter()
        said = start  # when the last plain line was printed
        # a resumed run's first row averages its whole window, the steps before the checkpoint included
        sums, self._t0 = self._window, time.perf_counter() - self._window_seconds
        stopped, early = None, self._due_evaluation()
        with StopSignal() as stop:
            while self.step < r.steps and not early:
                out = step_fn(self.step, stop.received is not None)
                grad_norm, lr = self._update(out)
                self.step += 1
                bar.update(1)
                for k, v in {**out.sums, "steps": 1}.items():
                    sums[k] = sums.get(k, 0.0) + v
                if self.step % r.logging_steps == 0 or self.step == r.steps:
                    now = time.perf_counter()
                    row = {"step": self.step, **row_fn(sums, now - self._t0, grad_norm, lr)}
                    self.metrics.write(row)
                    for tracker in self.trackers:
                        tracker.log(_tracked(tracker, row), step=self.step)
                    bar.set_postfix(loss=f"{row['loss']:.3f}")
                    if plain:
                        rate = (self.step - first) / max(now - start, 1e-9)
                        values = {k: row[k] for k in ("loss", "learning_rate", "lr") if k in row}
                        print(progress_line(self.step, r.steps, values, rate), file=sys.stderr, flush=True)
                        said = now
                    sums.clear()
                    self._t0 = time.perf_counter()
                elif plain and (now := time.perf_counter()) - said >= PLAIN_INTERVAL:  # slow steps: still a line
                    rate = (self.step - first) / max(now - start, 1e-9)
                    print(progress_line(self.step, r.steps, {}, rate), file=sys.stderr, flush=True)
                    said = now
                saving = self.step % r.save_steps == 0 or self.step == r.steps  # mteb and keep_best name the last
                evaluation, patience_out = getattr(r, "eval", None), False
                if self.evaluate is not None and evaluation is not None:
                    if self.step % evaluation.steps == 0 or self.step == r.steps:
                        patience_out = self._evaluate_or_save(saving)
                if out.stop:
                    stopped = self.save()
                    break
                if saving:
                    self.save()
                if patience_out and self.step < r.steps:
                    self._stopped_early()
                    break
        if early:
            self._stopped_early()
        bar.close()
        self.metrics.close(title=self.output.name)
        for tracker in self.trackers:
            tracker.finish()
        if stopped is not None:
            self.acc.end_training()
            raise TrainingInterrupted(stop.received or "SIGTERM", stopped, last_step=self.step >= r.steps)
