"""Embeddings on disk in shards, and the faiss search over them.

The corpus embeddings are written shard by shard (``corpus-00000.npy``, ...) and read back memory-mapped, so no
step holds more than one shard of the corpus in RAM:

- ``flat`` (default, exact inner product): each shard in turn goes into an ``IndexFlatIP``, every query batch is
  searched in it, and the per-shard top-k lists are merged into one running top-k per query. The result equals a
  brute-force ``queries @ corpus.T`` top-k (ties broken by the lower corpus id).
- ``ivf`` / ``hnsw`` / ``ivfpq``: one approximate faiss index is trained on a sample and filled shard by shard;
  its candidates are rescored exactly from the memory-mapped embeddings, so that thresholds compare true cosine
  scores even where the index stores compressed (PQ) codes. ``ivf`` and ``hnsw`` keep every vector in the index
  (corpus-sized memory); ``ivfpq`` keeps ``pq_m`` bytes per document, and since those codes rank coarsely it
  returns the ``rescore x k`` nearest codes, of which the ``k`` best exact scores are kept.

faiss is imported here only, when a search runs (``import neoembed`` does not need it). A GPU index is used where
faiss-gpu and a GPU are present; otherwise the search runs on CPU after one warning.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from pathlib import Path

import numpy as np

from neoembed.progress import bar as progress_bar
from neoembed.record import atomic_write_text, file_sha256

__all__ = [
    "INDEX_KINDS",
    "EmbeddingShards",
    "checksum_path",
    "merge_topk",
    "search",
    "shards_to_write",
    "write_shard",
]

logger = logging.getLogger(__name__)

INDEX_KINDS = ("flat", "ivf", "hnsw", "ivfpq", "binary", "int8")
GPU_MAX_K = 2048  # faiss GPU indexes return at most 2048 neighbours per query
_PQ8_POINTS = 39 * 2**8  # training points faiss asks for 8-bit PQ codes


def checksum_path(path: Path) -> Path:
    """Where the SHA-256 of a file of the run's state is kept: ``NAME.sha256`` beside it."""
    return path.with_name(path.name + ".sha256")


def write_shard(path: Path, array: np.ndarray) -> None:
    """Save one float32 shard through a temporary file and a rename, then its SHA-256 beside it
    (``NAME.npy.sha256``): a shard whose checksum file is there and matches is complete and intact."""
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.npy")
    np.save(tmp, np.ascontiguousarray(array, dtype=np.float32))
    digest = file_sha256(tmp)
    os.replace(tmp, path)
    atomic_write_text(checksum_path(path), digest + "\n")


def shards_to_write(paths: list[Path]) -> list[int]:
    """The indices of ``paths`` a resumed run must (re)write: missing shards, and shards that do not match the
    checksum written with them (a truncated or overwritten file would otherwise be searched as it is), each of
    the latter named in a warning."""
    todo = []
    for s, path in enumerate(paths):
        if not path.is_file():
            todo.append(s)
            continue
        side = checksum_path(path)
        saved = side.read_text().strip() if side.is_file() else None
        if saved != file_sha256(path):
            why = "has no checksum (a write cut short)" if saved is None else "does not match its checksum"
            logger.warning("%s %s: computing it again", path.name, why)
            todo.append(s)
    return todo


class EmbeddingShards:
    """Row-major float32 embeddings split over ``.npy`` files of ``shard_size`` rows (the last may be shorter),
    opened memory-mapped: a row range or a gather reads only the pages it touches."""

    def __init__(self, paths: list[Path], shard_size: int):
        self.paths, self.shard_size = list(paths), int(shard_size)
        self.arrays = [np.load(p, mmap_mode="r") for p in self.paths]
        if not self.arrays:
            raise ValueError("no embedding shards to read (an empty corpus or query set?)")
        self.dim = int(self.arrays[0].shape[1])
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])
        for i, a in enumerate(self.arrays[:-1]):
            if len(a) != self.shard_size:
                raise ValueError(f"shard {self.paths[i].name} has {len(a)} rows, expected {self.shard_size}")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` as one in-memory array."""
        parts = []
        for s, a in enumerate(self.arrays):
            lo, hi = max(start, self.offsets[s]), min(stop, self.offsets[s + 1])
            if lo < hi:
                parts.append(a[lo - self.offsets[s] : hi - self.offsets[s]])
        return np.ascontiguousarray(np.concatenate(parts) if len(parts) > 1 else parts[0], dtype=np.float32)

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """Embeddings of ``ids`` (any shape; ``-1`` gives a zero row): shape ``ids.shape + (dim,)``."""
        flat = np.asarray(ids).reshape(-1)
        out = np.zeros((len(flat), self.dim), dtype=np.float32)
        valid = flat >= 0
        which = np.where(valid, flat // self.shard_size, -1)
        for s in np.unique(which[valid]):
            m = which == s
            local = flat[m] - s * self.shard_size
            order = np.argsort(local)  # memmap reads in file order
            rows = np.asarray(self.arrays[s][local[order]])
            picked = np.empty_like(rows)
            picked[order] = rows
            out[m] = picked
        return out.reshape(*np.shape(ids), self.dim)


def merge_topk(scores_a, ids_a, scores_b, ids_b, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise union of two top lists, keeping the ``k`` highest scores; equal scores go to the lower id
    (missing entries are id -1 with score -inf and sort last)."""
    scores = np.concatenate([scores_a, scores_b], axis=1)
    ids = np.concatenate([ids_a, ids_b], axis=1)
    by_id = np.argsort(np.where(ids < 0, np.iinfo(np.int64).max, ids), axis=1, kind="stable")
    scores, ids = np.take_along_axis(scores, by_id, 1), np.take_along_axis(ids, by_id, 1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)


def _faiss():
    try:
        import faiss
    except ImportError as e:  # pragma: no cover - faiss-cpu is a dependency
        raise ImportError(
            "neoembed mine needs faiss: pip install -e '.[faiss]' (or '.[faiss-gpu]')"
        ) from e
    return faiss


def gpu_available(faiss) -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def _place(index, gpu: str, k: int, faiss):
    """The index on all GPUs when asked for (``on``) or possible (``auto``); else the CPU index, with a warning
    when a GPU was asked for and cannot be used."""
    if gpu == "off":
        return index, "cpu"
    if not gpu_available(faiss):
        if gpu == "on":
            warnings.warn("gpu=on but faiss-gpu or a GPU is missing: searching on CPU", stacklevel=3)
        return index, "cpu"
    if k > GPU_MAX_K:
        warnings.warn(
            f"faiss on GPU returns at most {GPU_MAX_K} neighbours, {k} asked: searching on CPU", stacklevel=3
        )
        return index, "cpu"
    try:
        return faiss.index_cpu_to_all_gpus(index), f"gpu x{faiss.get_num_gpus()}"
    except RuntimeError as e:  # index types without a GPU version (HNSW; PQ codes of fewer than 8 bits)
        warnings.warn(
            f"faiss cannot place this index on GPU ({str(e).splitlines()[0]}): searching on CPU", stacklevel=3
        )
        return index, "cpu"


def search(
    corpus: EmbeddingShards,
    queries: EmbeddingShards,
    k: int,
    index: str = "flat",
    *,
    nlist: int | None = None,
    nprobe: int = 16,
    hnsw_m: int = 32,
    ef_search: int = 128,
    pq_m: int = 16,
    rescore: int = 4,
    gpu: str = "auto",
    batch: int = 4096,
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Top-``k`` corpus ids and inner-product scores per query (``(Q, k)`` arrays, best first) and a description
    of the index used."""
    if index not in INDEX_KINDS:
        raise ValueError(f"unknown index {index!r}; valid: {list(INDEX_KINDS)}")
    if corpus.dim != queries.dim:
        raise ValueError(
            f"corpus embeddings have dim {corpus.dim}, queries {queries.dim}: embed both with one model"
        )
    faiss = _faiss()
    k = int(min(k, len(corpus)))
    if index == "flat":
        return _search_flat(corpus, queries, k, gpu, batch, progress, faiss)
    if index in ("binary", "int8"):
        return _search_quantized(corpus, queries, k, index, rescore, batch, progress)
    found = _search_approximate(
        corpus, queries, k, index, nlist, nprobe, hnsw_m, ef_search, pq_m, rescore, gpu, batch, progress, faiss
    )
    _say_short(found[1], found[2])
    return found


def _say_short(ids: np.ndarray, info: dict) -> None:
    """Once per search: how many queries got fewer than ``k`` candidates (id -1 fills their empty slots, which
    the filters pass over), recorded in ``info``, and the setting that reaches further."""
    short = int((ids < 0).any(axis=1).sum())
    info["queries_short_of_k"] = short
    if not short:
        return
    wider = "--ef-search" if info["kind"] == "hnsw" else f"--nprobe (now {info['nprobe']})"
    logger.warning(
        "%d of %d queries got fewer than %d candidates from the %s index (%d empty slots): raise %s",
        short,
        len(ids),
        ids.shape[1],
        info["kind"],
        int((ids < 0).sum()),
        wider,
    )


def _search_flat(corpus, queries, k, gpu, batch, progress, faiss):
    nq = len(queries)
    top_s = np.full((nq, k), -np.inf, dtype=np.float32)
    top_i = np.full((nq, k), -1, dtype=np.int64)
    device = "cpu"
    bar = progress_bar(
        total=len(corpus.arrays), desc="searching (exact, by shard)", unit="shard", disable=not progress
    )
    for s in range(len(corpus.arrays)):
        base = corpus.rows(int(corpus.offsets[s]), int(corpus.offsets[s + 1]))
        flat = faiss.IndexFlatIP(corpus.dim)
        flat.add(base)
        flat, device = _place(flat, gpu, k, faiss)
        kk = min(k, len(base))
        for a in range(0, nq, batch):
            b = min(a + batch, nq)
            scores, ids = flat.search(queries.rows(a, b), kk)
            ids = np.where(ids < 0, -1, ids + int(corpus.offsets[s]))
            top_s[a:b], top_i[a:b] = merge_topk(top_s[a:b], top_i[a:b], scores, ids, k)
        del flat, base
        bar.update(1)
    bar.close()
    return top_s, top_i, {"kind": "flat", "metric": "inner_product", "exact": True, "device": device}


def _search_quantized(corpus, queries, k, precision, rescore, batch, progress):
    """Codes of every shard in one exact quantized index (CPU); the ``rescore x k`` nearest codes of each query
    rescored with the float embeddings; int8 ranges from one pass over the corpus."""
    from neoembed.quantization import QuantizedIndex, rescored_search

    shards = [(int(corpus.offsets[s]), int(corpus.offsets[s + 1])) for s in range(len(corpus.arrays))]
    ranges = None
    if precision == "int8":
        parts = [corpus.rows(a, b) for a, b in shards[:1]]
        lo, hi = parts[0].min(axis=0), parts[0].max(axis=0)
        for a, b in shards[1:]:
            rows = corpus.rows(a, b)
            lo, hi = np.minimum(lo, rows.min(axis=0)), np.maximum(hi, rows.max(axis=0))
        ranges = np.vstack([lo, hi])
    index = QuantizedIndex.build(corpus.rows(*shards[0]), precision, ranges=ranges)
    for a, b in progress_bar(shards[1:], desc=f"indexing ({precision})", unit="shard", disable=not progress):
        index.add(corpus.rows(a, b))
    nq = len(queries)
    top_s = np.full((nq, k), -np.inf, dtype=np.float32)
    top_i = np.full((nq, k), -1, dtype=np.int64)
    for a in progress_bar(range(0, nq, batch), desc="searching", unit="batch", disable=not progress):
        b = min(a + batch, nq)
        scores, ids = rescored_search(index, queries.rows(a, b), k, rescore, corpus.gather)
        top_s[a:b], top_i[a:b] = scores[:, :k], ids[:, :k]
    info = {
        "kind": precision,
        "faiss": type(index.index).__name__,
        "bytes_per_vector": int(
            index.index.code_size if precision == "binary" else index.index.sa_code_size()
        ),
        "metric": "hamming" if precision == "binary" else "inner_product of int8 codes",
        "exact": False,
        "device": "cpu",
        "rescore": rescore,
        "rescored": f"the {rescore} x k nearest codes, exact cosine from the stored embeddings",
    }
    return top_s, top_i, info


def _factory(index: str, n: int, nlist: int | None, hnsw_m: int, pq_m: int, dim: int) -> tuple[str, int]:
    nlist = int(nlist or max(1, min(4 * int(math.sqrt(n)), n // 39 or 1)))
    if index == "ivf":
        return f"IVF{nlist},Flat", nlist
    if index == "hnsw":
        return f"HNSW{hnsw_m},Flat", 0
    if dim % pq_m:
        raise ValueError(
            f"ivfpq: pq_m={pq_m} must divide the embedding dimension {dim}; pick a divisor of {dim}"
        )
    nbits = pq_bits(n)
    return f"IVF{nlist},PQ{pq_m}" + (f"x{nbits}" if nbits < 8 else ""), nlist


def pq_bits(n: int) -> int:
    """Bits of each PQ sub-quantizer's code trained on ``n`` points: 8, or as many as ``n`` points can train
    (k-means needs a point per centroid). faiss asks 39 points per centroid (9,984 for 8 bits) and warns once
    per sub-quantizer below that, but the codes encode the very points they were trained on, so a tighter fit
    is what is wanted: on 3,743 MiniLM embeddings, recall@30 against flat (nprobe 16, rescore 4) was 0.69, 0.72,
    0.76, 0.79 for 5, 6, 7, 8 bits."""
    return min(8, int(math.log2(max(n, 2))))


def _search_approximate(
    corpus, queries, k, index, nlist, nprobe, hnsw_m, ef_search, pq_m, rescore, gpu, batch, progress, faiss
):
    spec, nlist = _factory(index, len(corpus), nlist, hnsw_m, pq_m, corpus.dim)
    if index == "ivfpq" and len(corpus) < _PQ8_POINTS:
        logger.warning(
            "ivfpq on %d documents: fewer than the %d faiss asks to train its PQ codes; at this size the exact "
            "--index flat is cheap, and mines the negatives ivfpq approximates",
            len(corpus),
            _PQ8_POINTS,
        )
    # PQ codes rank by a lossy score: fetch rescore x k of them and keep the k best exact scores, as binary and
    # int8 do; ivf and hnsw store the vectors, so their scores are exact already and more would not reorder
    fetch = min(k * rescore, len(corpus)) if index == "ivfpq" else k
    idx = faiss.index_factory(corpus.dim, spec, faiss.METRIC_INNER_PRODUCT)
    if hasattr(idx, "do_polysemous_training"):
        # on by default for IVF-PQ and only useful for polysemous (Hamming) filtering, which is not used here;
        # it made training on 153 vectors take 35 s instead of 0.02 s
        idx.do_polysemous_training = False
    if hasattr(idx, "pq"):  # the fewer-points case is said once above, not by faiss once per sub-quantizer
        idx.pq.cp.min_points_per_centroid = 1
    idx, device = _place(idx, gpu, fetch, faiss)
    if not idx.is_trained:
        # an evenly spaced sample: a corpus stored in some order (by source, by length) is still covered
        n_train = min(len(corpus), max(64 * max(nlist, 1), 256 * 39 if index == "ivfpq" else 0, 10_000))
        sample = np.unique(np.linspace(0, len(corpus) - 1, n_train).round().astype(np.int64))
        idx.train(corpus.gather(sample))
    for s in progress_bar(
        range(len(corpus.arrays)), desc=f"indexing ({spec})", unit="shard", disable=not progress
    ):
        idx.add(corpus.rows(int(corpus.offsets[s]), int(corpus.offsets[s + 1])))
    params = faiss.GpuParameterSpace() if device != "cpu" else faiss.ParameterSpace()
    if nlist:
        params.set_index_parameter(idx, "nprobe", min(nprobe, nlist))
    if index == "hnsw":
        params.set_index_parameter(idx, "efSearch", max(ef_search, k))
    nq = len(queries)
    top_s = np.full((nq, k), -np.inf, dtype=np.float32)
    top_i = np.full((nq, k), -1, dtype=np.int64)
    for a in progress_bar(range(0, nq, batch), desc="searching", unit="batch", disable=not progress):
        b = min(a + batch, nq)
        q = queries.rows(a, b)
        _, ids = idx.search(q, fetch)
        exact = np.einsum("qd,qkd->qk", q, corpus.gather(ids))  # true scores, whatever the index stores
        exact = np.where(ids < 0, -np.inf, exact).astype(np.float32)
        empty_s, empty_i = np.full((b - a, 0), 0, np.float32), np.full((b - a, 0), 0, np.int64)
        top_s[a:b], top_i[a:b] = merge_topk(exact, ids, empty_s, empty_i, k)
    info = {
        "kind": index,
        "faiss": spec,
        "metric": "inner_product",
        "exact": False,
        "device": device,
        "nprobe": min(nprobe, nlist) if nlist else None,
        "ef_search": max(ef_search, k) if index == "hnsw" else None,
        "rescore": rescore if index == "ivfpq" else None,
        "rescored": "exact cosine from the stored embeddings"
        + (f", of the {rescore} x k nearest codes" if index == "ivfpq" else ""),
    }
    return top_s, top_i, info
