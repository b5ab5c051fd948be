"""sentence-transformers' trainer as the unified trainer runs it: per-dataset batch sizes and samplers, each
checkpoint written to a staging folder, sealed and rotated by :mod:`neoembed.runs`, and a checkpoint's weights
loaded back for a LoRA run and for keep_best's final model.

Its overrides of private transformers / sentence-transformers methods (``_get_output_dir``, ``_save_checkpoint``,
``_load_from_checkpoint``, ``_load_best_model``) are what moving unified training onto :mod:`neoembed.loop`
deletes (docs/architecture.md, "One run engine")."""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

from neoembed.adapters import load_training_checkpoint
from neoembed.data.sampler import NoDuplicatesBatchSampler
from neoembed.runs import TrainingStopped, commit_checkpoint, list_checkpoints, stage_checkpoint, write_failed

logger = logging.getLogger(__name__)


def _nan_at_this_step(state) -> bool:
    """Whether the step being saved logged a NaN/inf loss (the metrics callback stops the run there)."""
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


def unified_trainer_class():
    """The trainer class, built on first use: sentence-transformers is imported when a run starts, not before."""
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
