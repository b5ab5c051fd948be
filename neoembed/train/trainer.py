"""The unified contrastive trainer: sentence-transformers' trainer with thin overrides.

What is ours: the InfoNCE losses (``neoembed.losses``), the power-law dataset sampler
(``neoembed.data.sampler``), per-dataset batch sizes, and callbacks that write ``metrics.jsonl``, checkpoint on
SIGTERM / Ctrl-C and stop on a NaN loss. Everything else (optimiser, schedule, mixed precision, DDP through
accelerate, checkpoints and exact resume) is the sentence-transformers / transformers trainer.

    neoembed train tiny                       # a shipped recipe by name
    neoembed train my.yaml steps=500 batch_size=64 optimizer.lr=2e-5
    accelerate launch --num_processes 2 -m neoembed train my.yaml
"""

from __future__ import annotations

import json
import logging
import math
import signal
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from neoembed.data.cards import DataCardError, build_pairs, find_card, load_card, load_rows
from neoembed.data.sampler import PowerLawDatasetBatchSampler
from neoembed.losses import build_loss
from neoembed.plots import plot_training_curves
from neoembed.recipe import resolve_recipe_path
from neoembed.record import write_run_record
from neoembed.train.recipe import UnifiedRecipe

__all__ = ["TrainingStopped", "prepare_datasets", "train"]

logger = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """Training stopped early (NaN loss, out of memory); the message says why and what to do."""


def prepare_datasets(recipe: UnifiedRecipe, recipe_dir: Path | None = None):
    """Resolve, load and check every card before training: returns (DatasetDict, cards, per-dataset batch sizes)."""
    from datasets import DatasetDict

    search = [Path(resolve_recipe_path(d, recipe_dir)) for d in recipe.card_dirs]
    loaded = [load_card(find_card(entry.card, search)) for entry in recipe.datasets]  # cards first: cheap
    names = [card.name for card, _ in loaded]
    for name in {n for n in names if names.count(n) > 1}:
        raise DataCardError(f"dataset {name!r} appears twice in the recipe")
    unknown = sorted(set(recipe.instruction_overrides) - set(names))
    if unknown:
        raise DataCardError(
            f"instruction_overrides names card(s) {unknown} that the recipe does not train on; valid: {names}"
        )
    out, cards, sizes = {}, [], {}
    for entry, (card, folder) in zip(recipe.datasets, loaded, strict=True):
        if card.name in recipe.instruction_overrides:
            card = card.model_copy(update={"instruction": recipe.instruction_overrides[card.name]})
        rows = load_rows(card, folder, entry.max_rows)
        if len(rows) == 0:
            raise DataCardError(f"card {card.name}: the dataset is empty")
        pairs = build_pairs(card, rows, entry.max_negatives, recipe.template, recipe.instructions)
        bs = entry.batch_size or recipe.batch_size
        if bs > len(pairs):
            raise DataCardError(
                f"card {card.name}: batch size {bs} is larger than the dataset ({len(pairs)} usable rows); "
                "lower batch_size (or this dataset's batch_size) or add data"
            )
        out[card.name], sizes[card.name] = pairs, bs
        cards.append((card, folder))
    return DatasetDict(out), cards, sizes


class _MetricsCallback(TrainerCallback):
    """Appends step, loss, learning rate, dataset, samples/s and peak memory to metrics.jsonl; stops on NaN."""

    def __init__(self, path: Path, samplers: list, names: list[str], batch_sizes: dict[str, int]):
        # ``samplers``: the list the trainer appends its batch sampler to (which dataset each step drew from)
        self.path, self.samplers, self.names, self.batch_sizes = path, samplers, names, batch_sizes
        self.last_time, self.last_step, self.nan_step = time.perf_counter(), 0, None

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs or not state.is_world_process_zero:
            if "loss" in logs and not math.isfinite(float(logs["loss"])):
                self.nan_step, control.should_training_stop = state.global_step, True
            return
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
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.last_time, self.last_step = now, step
        if not math.isfinite(row["loss"]):
            self.nan_step, control.should_training_stop = step, True


class _SignalCallback(TrainerCallback):
    """On SIGTERM or Ctrl-C: finish the current step, write a checkpoint, stop."""

    def __init__(self):
        self.received = None

    def handler(self, signum, frame):
        if self.received is not None:  # second Ctrl-C: give up at once
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        logger.warning("%s received: checkpointing after this step, then stopping", self.received)

    def on_step_end(self, args, state, control, **kwargs):
        if self.received is not None:
            control.should_save, control.should_training_stop = True, True


def _trainer_class():
    from sentence_transformers import SentenceTransformerTrainer

    class UnifiedTrainer(SentenceTransformerTrainer):
        """Per-dataset batch sizes, and the sampler handed to the metrics callback (through ``samplers``) for
        logging which dataset each step used. Both travel as constructor arguments, per trainer."""

        def __init__(self, *args, batch_sizes: dict[str, int], samplers: list, **kwargs):
            self.neoembed_batch_sizes, self.neoembed_samplers = batch_sizes, samplers
            super().__init__(*args, **kwargs)

        def get_multi_dataset_batch_sampler(self, dataset, batch_samplers, generator=None, seed=0):
            names = list(self.train_dataset.keys())
            for name, sampler in zip(names, batch_samplers, strict=True):
                sampler.batch_size = self.neoembed_batch_sizes.get(name, sampler.batch_size)
            sampler = super().get_multi_dataset_batch_sampler(dataset, batch_samplers, generator, seed)
            self.neoembed_samplers.append(sampler)
            return sampler

    return UnifiedTrainer


def _model_card(recipe: UnifiedRecipe, cards, output: Path) -> None:
    from neoembed.record import atomic_write_text
    from neoembed.sentence import model_card_text

    datasets = []
    for card, _ in cards:
        src = card.source.hub.id if card.source.hub else f"local: {card.source.local.path}"
        lic = card.license or "unknown"
        if card.research_only and "research" not in lic.lower():
            lic += " (research use only)"
        datasets.append({"name": card.name, "source": src, "license": lic})
    notes = (
        f"Unified contrastive recipe: InfoNCE, cosine similarity, temperature {recipe.temperature}, "
        f"dataset sampling alpha {recipe.alpha}, batch size {recipe.batch_size}, max length {recipe.max_length}, "
        f"seed {recipe.seed}."
    )
    config = output / "config.json"
    neobert = config.is_file() and json.loads(config.read_text()).get("model_type") == "neobert"
    text = model_card_text(
        output.name, recipe.model, datasets, steps=recipe.steps, notes=notes, neobert=neobert
    )
    atomic_write_text(output / "README.md", text)


def train(recipe: UnifiedRecipe, recipe_dir: Path | None = None, resume: bool = False) -> Path:
    """Run the unified recipe; returns the output folder (final model, metrics, run record, model card)."""
    from sentence_transformers import SentenceTransformerTrainingArguments

    from neoembed.recipe import seed_everything
    from neoembed.sentence import load

    seed_everything(recipe.seed)
    output = Path(recipe.output_dir)
    datasets, cards, batch_sizes = prepare_datasets(recipe, recipe_dir)
    model = load(recipe.model, pooling=recipe.pooling, max_seq_length=recipe.max_length)
    loss = build_loss(recipe.loss, model, recipe)
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
        save_total_limit=recipe.save_total_limit,
        logging_steps=recipe.logging_steps,
        logging_nan_inf_filter=False,  # a NaN loss must reach the callback that stops the run
        report_to=list(recipe.report_to) or "none",
        seed=recipe.seed,
        data_seed=recipe.seed,
        dataloader_drop_last=True,
        multi_dataset_batch_sampler=PowerLawDatasetBatchSampler.with_settings(recipe.alpha, recipe.steps),
        disable_tqdm=False,
        dataloader_pin_memory=torch.cuda.is_available(),
    )
    samplers: list = []
    trainer = _trainer_class()(
        model=model, args=args, train_dataset=datasets, loss=loss, batch_sizes=batch_sizes, samplers=samplers
    )
    output.mkdir(parents=True, exist_ok=True)
    metrics = _MetricsCallback(output / "metrics.jsonl", samplers, list(datasets.keys()), batch_sizes)
    signals = _SignalCallback()
    trainer.add_callback(metrics)
    trainer.add_callback(signals)
    if not resume and (output / "metrics.jsonl").exists():
        (output / "metrics.jsonl").unlink()
    data_files = [
        (folder / card.source.local.path).resolve() for card, folder in cards if card.source.local is not None
    ]
    if trainer.is_world_process_zero():
        write_run_record(
            output,
            "train",
            recipe=recipe,
            data_files=[f for f in data_files if f.is_file()],
            extra={"cards": {c.name: {"pinned": c.pinned, "license": c.license} for c, _ in cards}},
        )
    previous = {s: signal.signal(s, signals.handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        trainer.train(resume_from_checkpoint=_last_checkpoint(output) if resume else None)
    except torch.OutOfMemoryError as e:
        raise TrainingStopped(
            "out of memory: lower batch_size, enable GradCache with loss=cached_infonce cache_mini_batch_size=32 (same loss, memory of "
            f"one mini-batch), or shorten max_length (now {recipe.max_length}). ({e})"
        ) from None
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if trainer.is_world_process_zero() and (output / "metrics.jsonl").exists():
            plot_training_curves(output / "metrics.jsonl", output / "training_curves.png", title=output.name)
    if metrics.nan_step is not None:
        raise TrainingStopped(
            f"the loss became NaN at step {metrics.nan_step}; training stopped and the NaN state was not saved. "
            f"The last good checkpoint is {_last_checkpoint(output) or '(none yet)'}: resume from it with a lower "
            "learning rate, or use bf16/fp32 instead of fp16."
        )
    if signals.received is not None:
        logger.warning(
            "stopped by %s; checkpoint %s written; continue with --resume",
            signals.received,
            _last_checkpoint(output),
        )
        return output
    if trainer.is_world_process_zero():
        model.save(str(output))
        _model_card(recipe, cards, output)
    return output


def _last_checkpoint(output: Path) -> str | None:
    ckpts = sorted(output.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    return str(ckpts[-1]) if ckpts else None
