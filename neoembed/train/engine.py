"""The unified trainer on :class:`neoembed.loop.RunLoop`: its batches, its step and the row it logs.

From sentence-transformers: the data collator (tokenisation), the batch samplers (with neoembed's power-law
multi-dataset sampler, :mod:`neoembed.data.sampler`), the losses and the model. From accelerate: the processes,
mixed precision, DDP and the sharding of batches across processes (consecutive batches of the sampler to
consecutive ranks, which is why the sampler yields ``world_size`` batches of the same dataset per step). From the
loop: everything else (checkpoints, resume, signals, NaN stop, metrics, trackers, evaluation and keep_best).

One step takes the next batch of this process, scores it with the loss under the recipe's precision, runs the
backward pass (DDP reduces the gradients in its buckets), and reduces the loss and the stop flag over the
processes in one all-reduce. On resume the batches already trained on are skipped by index (the samplers are
pure functions of the seed, so the skipped batches are the ones the run drew, and no row is tokenised twice).
"""

from __future__ import annotations

import itertools
import logging

import torch

from neoembed.data.sampler import NoDuplicatesBatchSampler, PowerLawDatasetBatchSampler, say_sampler_shortfall
from neoembed.loop import StepOutput, mean_loss_and_stop

__all__ = ["batches", "place_model_in_loss", "unified_step"]

logger = logging.getLogger(__name__)

#: the dataloader's keys that are a text column's features, by their suffix (sentence-transformers' collator)
_FEATURE_SUFFIX = "input_ids"


def batches(
    acc,
    model,
    datasets: dict,
    batch_sizes: dict,
    no_duplicates: dict,
    *,
    alpha: float,
    steps: int,
    full_sizes: list[int],
    seed: int,
):
    """The training DataLoader, prepared by accelerate: sentence-transformers' collator over one batch sampler
    per dataset (no text twice in a batch where ``no_duplicates[name]``), drawn from by the power-law sampler
    (``steps`` steps, pi_i over ``full_sizes``). Returns ``(dataloader, sampler)``; ``sampler.history`` names
    each step's dataset."""
    from sentence_transformers.base.sampler import DefaultBatchSampler
    from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator
    from torch.utils.data import ConcatDataset, DataLoader, RandomSampler

    collator = SentenceTransformerDataCollator(preprocess_fn=model.preprocess)
    generator = torch.Generator().manual_seed(seed)
    samplers = []
    for name, dataset in datasets.items():
        kwargs = {
            "batch_size": batch_sizes[name],
            "drop_last": True,
            "valid_label_columns": collator.valid_label_columns,
            "generator": generator,
            "seed": seed,
        }
        if no_duplicates.get(name):
            logger.info("card %s: a text repeats across rows, so no batch holds it twice", name)
            say_sampler_shortfall()
            samplers.append(NoDuplicatesBatchSampler(dataset, **kwargs))
        else:
            samplers.append(DefaultBatchSampler(RandomSampler(dataset, generator=generator), **kwargs))
    joined = ConcatDataset(list(datasets.values()))
    sampler = PowerLawDatasetBatchSampler(
        joined, samplers, generator=generator, seed=seed, alpha=alpha, num_steps=steps, full_sizes=full_sizes
    )
    loader = DataLoader(
        joined, batch_sampler=sampler, collate_fn=collator, pin_memory=torch.cuda.is_available()
    )
    acc.even_batches = False  # batches differ in size between datasets: none is padded with another's rows
    return acc.prepare(loader), sampler


def place_model_in_loss(loss: torch.nn.Module, model: torch.nn.Module, wrapped: torch.nn.Module) -> None:
    """The processes' wrapper (DDP) of ``model`` in ``loss`` and the losses it wraps (``MatryoshkaLoss``), so that
    the loss's forward passes go through it and DDP reduces their gradients; the model's own methods the losses
    call stay reachable on the wrapper."""
    if wrapped is model:
        return
    for attr in ("preprocess", "get_embedding_dimension"):
        if not hasattr(wrapped, attr):
            setattr(wrapped, attr, getattr(model, attr))
    for child in list(loss.children()):
        if child is model:
            loss.model = wrapped
        elif isinstance(child, torch.nn.Module):
            place_model_in_loss(child, model, wrapped)


def _features(inputs: dict) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor | None]:
    """A collated batch as the losses take it: one feature dict per text column, in column order, and the
    labels (distillation's teacher scores) if the batch has them."""
    features, seen = [], set()
    for key in inputs:
        if not key.endswith("_" + _FEATURE_SUFFIX):
            continue
        prefix = key[: -len(_FEATURE_SUFFIX)]
        if prefix not in seen:
            seen.add(prefix)
            features.append({k[len(prefix) :]: v for k, v in inputs.items() if k.startswith(prefix)})
    return features, inputs.get("label")


def _peak_memory_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def unified_step(acc, loss_fn, loader, sampler, names: list[str], batch_sizes: dict, first_step: int, tally):
    """The loop's ``(step_fn, row_fn)`` for unified training, its batches starting at ``first_step`` (a resumed
    run's step). ``tally``: what false-negative masking dropped since the last row (a :class:`MaskTally`)."""
    loader = acc.skip_first_batches(loader, first_step) if first_step else loader
    iterator, world, device = iter(loader), acc.num_processes, acc.device
    if first_step:
        # the first batch draws the loader's base seed from the global generator, which a fresh run does before
        # its first step and the checkpoint's restored state already follows: drawn again here, it would move
        # every dropout mask of the resumed steps
        with torch.random.fork_rng(devices=[]):
            first = next(iterator, None)  # None: a run stopped at its last step has no batch left
        iterator = itertools.chain([first] if first is not None else [], iterator)
    seen: dict = {"datasets": {}, "step": first_step}  # datasets: each one's steps since the last row

    def step_fn(step: int, stop_requested: bool) -> StepOutput:
        features, labels = _features(next(iterator))
        with acc.autocast():
            loss = loss_fn(features, labels)
        acc.backward(loss)
        stats = mean_loss_and_stop(float(loss.detach()), stop_requested, world, device)
        name = names[sampler.history[step]] if step < len(sampler.history) else None
        seen["datasets"][name] = seen["datasets"].get(name, 0) + 1
        seen["step"] = step + 1
        samples = batch_sizes.get(name, 0) * world
        sums = {"loss": float(stats[0]), "samples": samples}
        return StepOutput(loss=float(stats[0]), stop=bool(stats[1] > 0), sums=sums)

    def row_fn(sums: dict, seconds: float, grad_norm, lr: float) -> dict:
        row = {
            "loss": sums["loss"] / sums["steps"],
            "learning_rate": lr,
            "grad_norm": grad_norm,
            # the row's steps' datasets: one name, or "a+b" where its window drew several (with each one's steps)
            "dataset": "+".join(str(n) for n in seen["datasets"]) or None,
            **({"dataset_steps": dict(seen["datasets"])} if len(seen["datasets"]) > 1 else {}),
            "samples_per_s": sums["samples"] / max(seconds, 1e-9),
            "peak_memory_mib": round(_peak_memory_mib(), 1),
            "world_size": world,
        }
        seen["datasets"] = {}
        counts = tally.pop() if tally is not None else {}  # what the loss masked, when it masks anything
        row.update(counts)
        if counts.get("false_negative_fraction", 0.0) >= 0.99:
            logger.warning(
                "false-negative masking dropped %.1f%% of the scored negatives up to step %d: the loss has almost "
                "nothing to contrast; lower false_negatives.margin",
                100 * counts["false_negative_fraction"],
                seen["step"],
            )
        return row

    return step_fn, row_fn
