"""Contextual batching and false-negative filtering (CDE, Morris & Rush 2024, Section 4).

Contextual batches are hard batches: pairs whose queries and documents are alike share a batch, so in-batch
negatives are difficult and the batch's documents form a coherent context. For each training source:

1. a frozen teacher (any sentence-transformers model) embeds every query q and document d; optionally an SVD
   reduces the embeddings (128 dims by default) and they are normalised;
2. spherical k-means (faiss) on the pair vectors [e(q); e(d)], trained on those plus the swapped [e(d); e(q)],
   with k = ceil(pairs / cluster_size); each pair goes to its nearest centroid. Sources never mix.

Each epoch, the clusters of a source are concatenated in random order (or along a greedy nearest-centroid
tour) and cut into batches of ``batch_size``; the tail is dropped; the batches of all sources are shuffled
together. Under DDP rank r takes slice r of every global batch. The clustering is cached on disk under a hash
of everything it depends on (teacher, texts, settings), and so are the teacher's embeddings of the hard
negatives.

False negatives: the teacher scores each batch's queries against its documents; a document scoring at least
the query's own positive (or above a fixed threshold) is removed from that query's denominator — never made a
positive — except the query's own hard negatives.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import torch

from neoembed.progress import bar

__all__ = [
    "ContextualBatches",
    "cluster_pairs",
    "false_negative_mask",
    "normalise",
    "random_batches",
    "reduce_dimensions",
    "teacher_embeddings",
]

logger = logging.getLogger(__name__)


def normalise(x: np.ndarray) -> np.ndarray:
    return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float32)


TEACHER_CHUNK = 1024  # texts per teacher call: the unit of the progress line, the same with or without it


def teacher_embeddings(teacher, texts: list[str], batch_size: int = 64, progress: bool = False) -> np.ndarray:
    """Unit-length float32 teacher embeddings of ``texts``, encoded :data:`TEACHER_CHUNK` texts at a time whether
    or not ``progress`` shows it (so a run's clustering does not depend on its console): with ``progress``,
    neoembed's progress line (a bar on a terminal, plain lines with the time left in a log), not the
    library's per-call bars."""
    parts = []
    with bar(total=len(texts), desc="teacher embeddings", unit="text", disable=not progress) as shown:
        for start in range(0, len(texts), TEACHER_CHUNK):
            chunk = texts[start : start + TEACHER_CHUNK]
            parts.append(
                teacher.encode(chunk, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False)
            )
            shown.update(len(chunk))
    return normalise(np.concatenate(parts).astype(np.float32, copy=False))


def reduce_dimensions(x: np.ndarray, dims: int | None) -> np.ndarray:
    """Project onto the top ``dims`` right singular vectors (no centring: cosine geometry is kept), normalise."""
    if dims is None or dims >= x.shape[1]:
        return normalise(x)
    _, _, vt = np.linalg.svd(x.astype(np.float64), full_matrices=False)
    return normalise(x @ vt[:dims].T)


def cluster_pairs(
    queries: np.ndarray,
    documents: np.ndarray,
    cluster_size: int,
    seed: int = 0,
    niter: int = 20,
) -> tuple[np.ndarray, np.ndarray]:
    """Spherical k-means on [e(q); e(d)] (trained with the swapped [e(d); e(q)] too): (assignment per pair,
    centroids)."""
    import faiss

    n = len(queries)
    k = max(1, math.ceil(n / cluster_size))
    pairs = normalise(np.concatenate([queries, documents], axis=1))
    if k == 1:
        return np.zeros(n, dtype=np.int64), pairs.mean(0, keepdims=True)
    swapped = normalise(np.concatenate([documents, queries], axis=1))
    train = np.ascontiguousarray(np.concatenate([pairs, swapped]))
    kmeans = faiss.Kmeans(
        train.shape[1], k, niter=niter, spherical=True, seed=seed, verbose=False, min_points_per_centroid=1
    )
    kmeans.train(train)
    _, assign = kmeans.index.search(np.ascontiguousarray(pairs), 1)
    return assign[:, 0].astype(np.int64), kmeans.centroids.copy()


def _tour(centroids: np.ndarray, start: int) -> list[int]:
    """Greedy nearest-neighbour tour over the centroids (cosine), from ``start``."""
    left = set(range(len(centroids))) - {start}
    order = [start]
    while left:
        rest = np.fromiter(left, dtype=np.int64)
        nxt = int(rest[np.argmax(centroids[rest] @ centroids[order[-1]])])
        order.append(nxt)
        left.remove(nxt)
    return order


class ContextualBatches:
    """Per-epoch contextual batches over several sources (global row indices, single-source batches).

    Args:
        assignments: per source, the cluster of each of its pairs (from :func:`cluster_pairs`).
        offsets: per source, the global index of its first pair.
        batch_size: the *global* batch size (every rank takes ``batch_size / world_size`` of it).
        centroids: per source, the cluster centroids (needed for ``tour=True``).
    """

    def __init__(
        self,
        assignments: list[np.ndarray],
        offsets: list[int],
        batch_size: int,
        seed: int = 0,
        tour: bool = False,
        centroids: list[np.ndarray] | None = None,
    ):
        if tour and centroids is None:
            raise ValueError("tour=True needs the centroids")
        self.assignments, self.offsets, self.batch_size = assignments, offsets, batch_size
        self.seed, self.tour, self.centroids = seed, tour, centroids
        for a in assignments:
            if len(a) < batch_size:
                raise ValueError(
                    f"a source has {len(a)} pairs, fewer than the batch size {batch_size}: lower batch_size"
                )

    def epoch(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, epoch])
        batches: list[list[int]] = []
        for s, (assign, offset) in enumerate(zip(self.assignments, self.offsets, strict=True)):
            clusters = [np.flatnonzero(assign == c) for c in np.unique(assign)]
            ids = np.unique(assign)
            if self.tour:
                start = int(rng.integers(len(ids)))
                order = _tour(self.centroids[s][ids], start)
            else:
                order = rng.permutation(len(ids)).tolist()
            rows = np.concatenate([rng.permutation(clusters[i]) for i in order])
            n = len(rows) // self.batch_size * self.batch_size  # the tail is dropped
            batches += [
                (rows[i : i + self.batch_size] + offset).tolist() for i in range(0, n, self.batch_size)
            ]
        return [batches[i] for i in rng.permutation(len(batches))]

    def steps_per_epoch(self) -> int:
        return sum(len(a) // self.batch_size for a in self.assignments)

    @staticmethod
    def rank_slice(batch: list[int], rank: int, world: int) -> list[int]:
        if len(batch) % world:
            raise ValueError(f"batch size {len(batch)} is not a multiple of the {world} processes")
        per = len(batch) // world
        return batch[rank * per : (rank + 1) * per]


def random_batches(sizes: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """The baseline: random single-source batches (same sources, sizes and tail rule)."""
    rng = np.random.default_rng(seed)
    batches, offset = [], 0
    for n in sizes:
        rows = rng.permutation(n) + offset
        m = n // batch_size * batch_size
        batches += [rows[i : i + batch_size].tolist() for i in range(0, m, batch_size)]
        offset += n
    return batches


def clustering_key(**parts) -> str:
    """A stable hash of everything a clustering depends on (texts included)."""
    h = hashlib.sha256()
    for k in sorted(parts):
        v = parts[k]
        if isinstance(v, list) and v and isinstance(v[0], str):
            h.update(k.encode())
            for t in v:
                h.update(t.encode("utf8", "surrogatepass") + b"\0")
        else:
            h.update(f"{k}={json.dumps(v, sort_keys=True, default=str)}".encode())
    return h.hexdigest()[:24]


def teacher_identity(name: str) -> dict:
    """What a teacher's embeddings depend on, for the cache key and a resume's check: its name and
    :func:`neoembed.runs.model_fingerprint` (a folder's weights and pipeline, a hub id's commit)."""
    from neoembed.runs import model_fingerprint

    return {"name": name, **model_fingerprint(name)}


def cached_clustering(cache_dir: Path | None, key: str, compute):
    """(assignment, centroids, teacher query/document embeddings) from ``cache_dir/key.npz``, else computed and
    stored (:func:`cached_arrays`)."""
    return cached_arrays(cache_dir, key, compute, ("assign", "centroids", "q", "d"))


def cached_arrays(cache_dir: Path | None, key: str, compute, names: tuple[str, ...]) -> tuple[np.ndarray, ...]:
    """``compute()``'s arrays, one per name, from ``cache_dir/key.npz``, else computed and stored (written
    atomically; ``cache_dir`` None: computed every time)."""
    path = None if cache_dir is None else Path(cache_dir) / f"{key}.npz"
    if path is not None and path.is_file():
        with np.load(path) as z:
            return tuple(z[name] for name in names)
    arrays = tuple(compute())
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # one temporary file per process: runs started together (a sweep sharing the default cache) write one key
        tmp = path.with_name(f".{key}.tmp{os.getpid()}.npz")
        np.savez(tmp, **dict(zip(names, arrays, strict=True)))
        os.replace(tmp, path)
    return arrays


def false_negative_mask(
    teacher_queries: torch.Tensor,
    teacher_documents: torch.Tensor,
    n_negatives: int = 0,
    threshold: float | None = None,
) -> torch.Tensor:
    """(B, D) True where document j must leave query i's denominator.

    Documents are laid out as the loss reads them: the B positives first (column i is query i's positive), then
    the hard negatives, ``n_negatives`` per query, query-major (columns B + i·k … B + i·k + k − 1 are query i's).
    A document is a false negative for query i when its teacher score is at least that of i's positive (or
    above ``threshold`` when given). Query i's positive and its own hard negatives are never masked.
    """
    q = torch.nn.functional.normalize(teacher_queries.float(), dim=-1)
    d = torch.nn.functional.normalize(teacher_documents.float(), dim=-1)
    scores = q @ d.T
    B, D = scores.shape
    if D != B * (1 + n_negatives):
        raise ValueError(f"{D} documents for {B} queries with {n_negatives} hard negatives each")
    rows = torch.arange(B)
    if threshold is None:
        mask = scores >= scores[rows, rows][:, None]
    else:
        mask = scores > threshold
    keep = torch.zeros_like(mask)
    keep[rows, rows] = True
    for j in range(n_negatives):
        keep[rows, B + rows * n_negatives + j] = True
    return mask & ~keep
