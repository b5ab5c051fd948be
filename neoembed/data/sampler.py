"""Task-homogeneous batches: one dataset per step, drawn with probability pi_i = n_i^alpha / sum_j n_j^alpha.

A sentence-transformers multi-dataset batch sampler (pass the class as ``multi_dataset_batch_sampler``). Each
step draws a dataset and fills the whole batch from it. Under DDP, accelerate hands consecutive batches of the
sampler to consecutive ranks; the sampler therefore yields ``world_size`` consecutive batches from the same
dataset for every step, so that the global batch of a step is single-dataset on every rank.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path

import numpy as np
import torch
from sentence_transformers.base.sampler import MultiDatasetDefaultBatchSampler, NoDuplicatesBatchSampler

__all__ = [
    "NoDuplicatesBatchSampler",
    "PowerLawDatasetBatchSampler",
    "dataset_probabilities",
    "compact_batches",
    "duplicate_free_rows",
    "no_duplicate_batches",
    "plan_no_duplicates",
    "say_sampler_shortfall",
    "text_hashes",
    "text_repeats",
]

logger = logging.getLogger(__name__)


def dataset_probabilities(sizes: list[int], alpha: float) -> list[float]:
    weights = [n**alpha for n in sizes]
    total = sum(weights)
    return [w / total for w in weights]


def text_repeats(dataset, label_columns: list[str] | tuple[str, ...] = ("label",)) -> bool:
    """Whether some text occurs in more than one row (the same query with several positives, or one row's
    negative that is another row's positive): then two rows of one batch can be each other's false negatives.

    A card prepared by :func:`neoembed.data.cards.prepare_card` has the answer on disk, found when it was built;
    any other dataset is decided on its texts' 64-bit hashes (:func:`text_hashes`), sorted in numpy, a repeated
    hash confirmed on the texts themselves (a hash collision never reads as a repeat)."""
    from neoembed.data.pairs import REPEATS, hashed_repeats

    columns = [c for c in dataset.column_names if c not in label_columns]
    side = _hashes_file(dataset, columns)
    if side is not None and side.with_name(REPEATS).is_file():
        return bool(json.loads(side.with_name(REPEATS).read_text())["repeats"])
    return hashed_repeats(text_hashes(dataset, columns), dataset, columns)


def _hashes_file(dataset, columns: list[str]) -> Path | None:
    """The hashes file of a prepared card's pairs when ``dataset`` is all of them (not a selection) and
    ``columns`` are its text columns; else None."""
    from neoembed.data.pairs import HASHES

    files = getattr(dataset, "cache_files", None) or []
    whole = getattr(dataset, "_indices", None) is None  # not a selection of the file's rows
    negatives = [f"negative_{j + 1}" for j in range(len(columns) - 2)]
    if len(files) != 1 or not whole or columns != ["query", "positive", *negatives]:
        return None
    side = Path(files[0]["filename"]).with_name(HASHES)
    if not side.is_file() or np.load(side, mmap_mode="r").shape != (len(dataset), len(columns)):
        return None
    return side


_HASH_BATCH = 10_000


def text_hashes(dataset, columns: list[str]):
    """The 64-bit hashes of every row's texts in ``columns``, as a (rows, columns) int64 array. A card prepared
    by :func:`neoembed.data.cards.prepare_card` has them on disk beside its pairs, computed in the batched map
    that read its rows (memory-mapped here, no pass over the texts); any other dataset is hashed batch by batch."""
    from neoembed.data.pairs import text_hash

    side = _hashes_file(dataset, columns)
    if side is not None:
        return np.load(side, mmap_mode="r")
    out = np.empty((len(dataset), len(columns)), dtype=np.int64)
    view = dataset.select_columns(columns)
    for start in range(0, len(dataset), _HASH_BATCH):
        batch = view[start : start + _HASH_BATCH]
        for j, c in enumerate(columns):
            out[start : start + len(batch[c]), j] = [
                text_hash(t if isinstance(t, str) else repr(t)) for t in batch[c]
            ]
    return out


class _Shortfall(logging.Filter):
    """sentence-transformers' note that a duplicate-free pass made fewer batches than planned, in neoembed's words:
    it names its own class and an "epoch" that neoembed's step-counted runs do not have."""

    SAID = re.compile(r"NoDuplicatesBatchSampler produced only (\d+) of the expected (\d+) batches")

    def filter(self, record: logging.LogRecord) -> bool:
        if m := self.SAID.match(str(record.msg)):
            made, planned = map(int, m.groups())
            record.msg = (
                "a pass over a card's rows made %d batches with no text twice of the %d it has rows for (its rows "
                "share texts: a query asked in several rows, one positive of several queries); the other %d are "
                "drawn again, so up to %.0f%% of a pass's batches repeat rows"
            )
            record.args = (made, planned, planned - made, 100 * (planned - made) / planned)
        return True


def say_sampler_shortfall() -> None:
    """Put sentence-transformers' duplicate-free sampler's shortfall note into neoembed's words (once a process)."""
    sampler_logger = logging.getLogger(NoDuplicatesBatchSampler.__module__)
    if not any(isinstance(f, _Shortfall) for f in sampler_logger.filters):
        sampler_logger.addFilter(_Shortfall())


def no_duplicate_batches(mode: bool | str, dataset, **sampler_kwargs) -> NoDuplicatesBatchSampler | None:
    """sentence-transformers' ``NoDuplicatesBatchSampler`` (no text twice in a batch, across all columns) for
    ``dataset`` when ``mode`` is True, or "auto" and :func:`text_repeats` finds a repeated text; else None."""
    if mode is False or (mode == "auto" and not text_repeats(dataset)):
        return None
    return NoDuplicatesBatchSampler(dataset, **sampler_kwargs)


def duplicate_free_rows(dataset, limit: int, label_columns: tuple[str, ...] = ("label",)) -> int:
    """How many rows, taken in order, share no text with the rows taken before them (counting stops at
    ``limit``). ``NoDuplicatesBatchSampler`` fills a batch the same greedy way, so below the batch size it can
    form no batch at all. Compared on the texts' hashes (:func:`text_hashes`), a block of rows at a time."""
    columns = [c for c in dataset.column_names if c not in label_columns]
    hashes = text_hashes(dataset, columns)
    seen: set[int] = set()
    count = 0
    for start in range(0, len(hashes), _HASH_BATCH):
        for row in np.asarray(hashes[start : start + _HASH_BATCH]).tolist():
            if seen.isdisjoint(row):
                seen.update(row)
                count += 1
                if count >= limit:
                    return count
    return count


def check_contrast(
    dataset, name: str, mask_duplicates: bool, label_columns: tuple[str, ...] = ("label",)
) -> None:
    """Refuse, before any model loads, a dataset on which InfoNCE learns nothing: rows without hard negatives that
    all share one positive (the candidates are copies of it: equal scores, zero gradient) or, with
    ``mask_duplicates``, one query (each row's in-batch candidates are the same query's other answers, which the
    mask takes out: the loss is 0 at every step). Decided on the texts' hashes, a block of rows at a time."""
    from neoembed.data.errors import DataCardError

    columns = [c for c in dataset.column_names if c not in label_columns]
    if len(columns) != 2 or len(dataset) < 2:
        return
    checks = (("positive", 1, "its candidates are copies of that positive and the gradient is 0"),)
    if mask_duplicates:
        checks += (("query", 0, "mask_duplicates takes the query's other answers out and the loss is 0"),)
    first, second = dataset[0], dataset[1]  # rows that differ here already differ: no pass over the texts
    checks = tuple(c for c in checks if first[columns[c[1]]] == second[columns[c[1]]])
    if not checks:
        return
    hashes = text_hashes(dataset, columns)
    for what, j, why in checks:
        first = hashes[0, j]
        if all(np.all(hashes[s : s + _HASH_BATCH, j] == first) for s in range(0, len(hashes), _HASH_BATCH)):
            fix = "add hard negatives" + (", or set mask_duplicates: false" if what == "query" else "")
            raise DataCardError(
                f"card {name}: all {len(dataset)} rows have the same {what} and no hard negatives, so {why} at "
                f"every step: give the rows distinct {what}s or {fix}"
            )


def plan_no_duplicates(mode: bool | str, dataset, batch_size: int, name: str) -> bool:
    """Whether dataset ``name`` gets batches without a repeated text (recipe key ``no_duplicates``), decided
    before any model loads. "auto": where a text repeats and ``batch_size`` rows free of repeats exist (else a
    warning and plain batches); True: the same, an error naming the fix when no such batch exists."""
    if mode is False or (mode == "auto" and not text_repeats(dataset)):
        return False
    free = duplicate_free_rows(dataset, batch_size)
    if free >= batch_size:
        return True
    problem = (
        f"card {name}: only {free} of its rows share no text with one another (a question with several "
        f"answers counts once), fewer than its batch size {batch_size}"
    )
    if mode == "auto":
        fix = "lower its batch_size to avoid it" if free >= 2 else "no batch of two rows avoids it"
        logger.warning("%s, so its batches may hold a text twice; %s", problem, fix)
        return False
    from neoembed.data.errors import DataCardError

    raise DataCardError(
        f"{problem}: no_duplicates: true cannot fill a batch; lower batch_size or set no_duplicates: false"
    )


def compact_batches(batch_sampler) -> Iterator[list[int]]:
    """The batches of ``batch_sampler``, the same ones in the same order; for a plain batch sampler over a
    ``RandomSampler`` (sentence-transformers' default) drawn from one permutation tensor instead of torch's
    ``randperm(n).tolist()``, a Python int per row (16.4M rows: about 0.6 GB for Table 7's cards)."""
    from torch.utils.data import BatchSampler, RandomSampler

    inner = getattr(batch_sampler, "sampler", None)
    plain = type(batch_sampler).__iter__ is BatchSampler.__iter__ and type(inner) is RandomSampler
    if not plain or inner.replacement or inner.num_samples != len(inner.data_source):
        yield from batch_sampler
        return
    n, size = len(inner.data_source), batch_sampler.batch_size
    generator = inner.generator
    if generator is None:  # as RandomSampler does: a seed drawn from torch's global generator
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=generator)
    order = order.to(torch.int32) if n < 2**31 else order
    full = n - n % size
    for start in range(0, full, size):
        yield order[start : start + size].tolist()
    # RandomSampler's trailing draw (of num_samples % n = 0 rows) comes when the n-th row is passed: before a
    # last short batch, after the last full one; the generator may be shared with other datasets' samplers
    torch.randperm(n, generator=generator)
    if full < n and not batch_sampler.drop_last:
        yield order[full:].tolist()


def _restarted_batch(batches: Iterator[list[int]], i: int, sampler) -> list[int]:
    """The first batch of dataset ``i``'s restarted sampler; one that yields none (a ``NoDuplicatesBatchSampler``
    whose data holds too few rows free of repeats) is an error naming the fix, not a bare StopIteration."""
    batch = next(batches, None)
    if batch is None:
        raise RuntimeError(
            f"dataset {i} (in recipe order) yields no batch of {sampler.batch_size} rows; lower its batch_size, "
            "or set no_duplicates: false if its texts repeat"
        )
    return batch


def _world() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


class PowerLawDatasetBatchSampler(MultiDatasetDefaultBatchSampler):
    """Draw a dataset per step with pi_i ∝ n_i^alpha; each dataset's own batch sampler fills the batch and is
    restarted (next epoch of that dataset) when exhausted. ``history`` lists the dataset index of each step."""

    def __init__(
        self,
        dataset,
        batch_samplers,
        generator=None,
        seed: int = 0,
        alpha: float = 0.5,
        num_steps: int | None = None,
        full_sizes: list[int] | None = None,
    ) -> None:
        super().__init__(dataset, batch_samplers, generator=generator, seed=seed)
        self.alpha, self.num_steps = alpha, num_steps
        self.sizes = [len(d) for d in dataset.datasets]  # rows loaded: where each dataset's indices start
        # pi_i follows each dataset's full size (max_rows loads a sample; the paper's n_i is the whole dataset)
        if full_sizes is not None and len(full_sizes) != len(self.sizes):
            raise ValueError(f"full_sizes has {len(full_sizes)} entries for {len(self.sizes)} datasets")
        self.full_sizes = list(full_sizes) if full_sizes is not None else self.sizes
        self.probabilities = dataset_probabilities(self.full_sizes, self.alpha)
        self.history: list[int] = []
        self.world_size = _world()
        # Batches differ in size (per-dataset batch sizes). accelerate's BatchSamplerShard silently skips every
        # batch whose length differs from ``batch_size`` unless it is None (then lengths are dynamic).
        self.batch_size = None

    @classmethod
    def with_settings(cls, alpha: float, num_steps: int | None = None, full_sizes: list[int] | None = None):
        """What to pass as ``multi_dataset_batch_sampler``: the trainer calls it with the datasets (picklable).
        ``full_sizes``: each dataset's full row count, in the order of the datasets (default: the rows loaded)."""
        return functools.partial(cls, alpha=alpha, num_steps=num_steps, full_sizes=full_sizes)

    def __iter__(self) -> Iterator[list[int]]:
        g = torch.Generator().manual_seed(self.seed + 1_000_003 * self.epoch)
        offsets = [0, *accumulate(self.sizes)]
        iters = [compact_batches(s) for s in self.batch_samplers]
        probs = torch.tensor(self.probabilities)
        self.history = []
        for _ in range(len(self) // self.world_size):
            i = int(torch.multinomial(probs, 1, generator=g))
            self.history.append(i)
            for _rank in range(self.world_size):  # the same dataset for every rank of this step
                try:
                    batch = next(iters[i])
                except StopIteration:
                    if hasattr(self.batch_samplers[i], "set_epoch"):
                        self.batch_samplers[i].set_epoch(getattr(self.batch_samplers[i], "epoch", 0) + 1)
                    iters[i] = compact_batches(self.batch_samplers[i])
                    batch = _restarted_batch(iters[i], i, self.batch_samplers[i])
                yield [j + offsets[i] for j in batch]

    def __len__(self) -> int:
        steps = self.num_steps or sum(len(s) for s in self.batch_samplers) // self.world_size
        return steps * self.world_size
