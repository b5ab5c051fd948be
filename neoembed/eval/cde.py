"""CDE models under ``neoembed mteb``: one context per task.

Per task, a seeded sample of N texts — corpus documents for retrieval and reranking, the train split for
classification, the task's evaluation texts otherwise; with replacement only when fewer than N distinct texts
exist — goes through the first stage with the model's document prompt; the resulting context E is used for
the task's queries and documents alike. E is cached in ``OUTPUT/cde_context/<task>.pt`` (with the seed, N,
model and local data it was made for), so a rerun with the same seed reuses it and gives the same scores.
The sample is drawn as :func:`sample_context_indices` says, over the texts :func:`task_context_texts` lists; each
task's result records the positions drawn (``cde_context_indices``) and how many texts they index
(``cde_context_n_texts``), so the context can be encoded again without neoembed's sampler.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "CORPUS_TYPES",
    "sample_context_indices",
    "sample_context_texts",
    "task_context",
    "task_context_texts",
]

logger = logging.getLogger(__name__)
CORPUS_TYPES = {"Retrieval", "Reranking", "InstructionRetrieval", "InstructionReranking"}
TRAIN_TYPES = {"Classification", "MultilabelClassification"}
TEXT_COLUMNS = ("text", "sentence1", "sentence2", "sentences", "sentence")


def _strings(value):
    if isinstance(value, str):
        if value.strip():
            yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _dataset_texts(ds, corpus: bool) -> list[str]:
    cols = ds.column_names
    if corpus and "text" in cols:
        titles = ds["title"] if "title" in cols else [""] * len(ds)
        return [f"{t} {x}".strip() if t else x for t, x in zip(titles, ds["text"], strict=True) if x]
    out: list[str] = []
    for c in TEXT_COLUMNS:
        if c in cols:
            out.extend(_strings(list(ds[c])))  # a datasets Column is not a list
    return out


def task_context_texts(task) -> list[str]:
    """The distinct texts a task's context is sampled from (see the module docstring)."""
    if not getattr(task, "data_loaded", False):
        task.load_data()
    ttype = task.metadata.type
    eval_splits = set(task.metadata.eval_splits or [])
    buckets: dict[str, list[str]] = {"corpus": [], "train": [], "eval": [], "other": []}

    def walk(x, path: tuple[str, ...]) -> None:
        if isinstance(x, Mapping):
            for k, v in x.items():
                if k in ("relevant_docs", "top_ranked", "instructions"):
                    continue
                walk(v, (*path, str(k)))
        elif hasattr(x, "column_names"):
            if "queries" in path:
                return
            corpus = "corpus" in path
            texts = _dataset_texts(x, corpus)
            if corpus:
                buckets["corpus"] += texts
            elif "train" in path:
                buckets["train"] += texts
            elif set(path) & eval_splits:
                buckets["eval"] += texts
            else:
                buckets["other"] += texts

    walk(task.dataset, ())
    if ttype in CORPUS_TYPES and buckets["corpus"]:
        chosen = buckets["corpus"]
    elif ttype in TRAIN_TYPES and buckets["train"]:
        chosen = buckets["train"]
    else:
        chosen = buckets["eval"] or buckets["other"] or buckets["train"] or buckets["corpus"]
    if not chosen:
        raise ValueError(f"task {task.metadata.name}: no texts found to build a CDE context from")
    return list(dict.fromkeys(chosen))


def sample_context_indices(n_texts: int, n: int, seed: int) -> list[int]:
    """The positions of N texts among ``n_texts``: ``numpy.random.default_rng(seed).choice(n_texts, size=n,
    replace=n_texts < n)``, with replacement only when fewer than N exist."""
    rng = np.random.default_rng(seed)
    return rng.choice(n_texts, size=n, replace=n_texts < n).tolist()


def sample_context_texts(texts: list[str], n: int, seed: int) -> list[str]:
    """N texts drawn with a generator seeded by ``seed`` (:func:`sample_context_indices`)."""
    return [texts[i] for i in sample_context_indices(len(texts), n, seed)]


def task_context(
    model,
    task,
    seed: int,
    cache_dir: Path | None,
    model_id: str = "",
    max_batch_tokens: int | None = None,
    data: str | None = None,
) -> tuple[torch.Tensor, dict]:
    """The task's context E for a CDE model (cached on disk when ``cache_dir`` is given), encoded in batches
    filled to ``max_batch_tokens`` (the task's own encoding budget) when given, and the sample it was encoded
    from: ``{"n_texts": len(task_context_texts(task)), "indices": their positions drawn}``. ``data``: the
    fingerprint of the task's local files (:func:`neoembed.eval.local_data.data_fingerprint`), part of the cache's
    key, so a context sampled from files since changed is drawn again."""
    name, n = task.metadata.name, model.n_context
    key = {"seed": seed, "n": n, "model": model_id, "data": data}
    target = Path(cache_dir) / f"{name}.pt" if cache_dir is not None else None
    if target is not None and target.is_file():
        saved = torch.load(target, weights_only=False)
        if saved.get("key") == key and "indices" in saved:  # a cache without them cannot say what it drew
            return saved["context"], {"n_texts": saved["n_texts"], "indices": saved["indices"]}
    texts = task_context_texts(task)
    if len(texts) < n:
        logger.warning(
            "task %s: %d distinct texts for a context of %d: sampling with replacement", name, len(texts), n
        )
    sample = {"n_texts": len(texts), "indices": sample_context_indices(len(texts), n, seed)}
    context = model.encode_context([texts[i] for i in sample["indices"]], max_batch_tokens=max_batch_tokens)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        torch.save({"key": key, "context": context, **sample}, tmp)
        tmp.replace(target)
    return context, sample
