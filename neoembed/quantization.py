"""Quantized embedding search with rescoring: int8 / binary document codes, float queries.

The scheme of sentence-transformers' ``quantize_embeddings`` / ``semantic_search_faiss(..., rescore_multiplier=N)``:

1. the documents are stored as codes: ``binary`` packs the sign bits (``quantize_embeddings(..., "ubinary")``, 1
   bit a dimension) into a faiss ``IndexBinaryFlat`` (Hamming distance); ``int8`` maps each dimension to 256
   levels between the ranges seen on the documents (``quantize_embeddings(..., "int8", ranges=...)``), one byte a
   dimension in a faiss ``IndexScalarQuantizer`` (``QT_8bit_direct_signed``);
2. the query is quantized the same way and the ``N x k`` nearest codes are the candidates;
3. the candidates are rescored with the float query: against the codes (``rescore_docs="quantized"``: bits read
   as 0/1, int8 codes dequantized to the ranges -- sentence-transformers' own rescoring) or against the float
   documents (``"float"``: a two-tier store whose float embeddings sit on disk, as ``neoembed mine`` keeps them),
   and the best ``k`` (or all candidates, see :func:`rescored_search`) are kept, best first.

Departure from ``semantic_search_faiss``: its uint8 first stage takes inner products of codes in 0..255, where each
dimension's offset outweighs the signal; here int8 codes are centred (``- 128``, the signed codes of
``quantize_embeddings(..., "int8")``) before the inner product, as sentence-transformers' usearch path does.
Scores are inner products: callers normalize embeddings first when their similarity is cosine. faiss and
sentence-transformers are imported when an index is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["QUANTIZED_PRECISIONS", "RESCORE_DOCS", "QuantizedIndex", "rescored_search"]

QUANTIZED_PRECISIONS = ("int8", "binary")
RESCORE_DOCS = ("quantized", "float")


def _check(precision: str, rescore_docs: str = "quantized") -> None:
    if precision not in QUANTIZED_PRECISIONS:
        raise ValueError(
            f"quantized precision {precision!r}: choose one of {', '.join(QUANTIZED_PRECISIONS)}"
        )
    if rescore_docs not in RESCORE_DOCS:
        raise ValueError(f"rescore_docs {rescore_docs!r}: choose one of {', '.join(RESCORE_DOCS)}")


def _int8_index(faiss, dim: int):
    """An exact inner-product index of int8 codes that stores one byte per dimension: faiss' direct signed 8-bit
    scalar quantizer keeps every code in [-128, 127] as it is (its scores equal ``IndexFlatIP``'s over the same
    codes, tested). A faiss without it gets ``IndexFlatIP``: the same scores, four bytes per dimension."""
    direct = getattr(faiss.ScalarQuantizer, "QT_8bit_direct_signed", None)
    if direct is None:
        return faiss.IndexFlatIP(dim)
    return faiss.IndexScalarQuantizer(dim, direct, faiss.METRIC_INNER_PRODUCT)


@dataclass
class QuantizedIndex:
    """Document codes of one precision in an exact faiss index (``IndexBinaryFlat`` / ``IndexFlatIP``)."""

    precision: str
    dim: int
    ranges: np.ndarray | None  # int8: (2, dim) per-dimension min and max of the documents
    index: object

    @classmethod
    def build(cls, documents: np.ndarray, precision: str, ranges: np.ndarray | None = None) -> QuantizedIndex:
        """An index of ``documents`` (float, ``(n, dim)``); int8 ranges default to the documents' own."""
        _check(precision)
        import faiss

        documents = np.asarray(documents, dtype=np.float32)
        dim = documents.shape[1]
        if precision == "int8" and ranges is None:
            ranges = np.vstack([documents.min(axis=0), documents.max(axis=0)])
        if precision == "binary":
            index = faiss.IndexBinaryFlat(8 * ((dim + 7) // 8))
        else:
            index = _int8_index(faiss, dim)
        out = cls(precision, dim, ranges, index)
        out.add(documents)
        return out

    def codes(self, embeddings: np.ndarray) -> np.ndarray:
        """``embeddings`` as this index takes them: packed sign bits, or int8 codes as float32 (stored in one byte
        each)."""
        from sentence_transformers.util import quantize_embeddings

        embeddings = np.asarray(embeddings, dtype=np.float32)
        if self.precision == "binary":
            return quantize_embeddings(embeddings, precision="ubinary")
        return quantize_embeddings(embeddings, precision="int8", ranges=self.ranges).astype(np.float32)

    def add(self, documents: np.ndarray) -> None:
        self.index.add(self.codes(documents))

    def __len__(self) -> int:
        return int(self.index.ntotal)

    def candidates(self, queries: np.ndarray, n: int) -> np.ndarray:
        """Ids ``(Q, n)`` of the ``n`` nearest codes to the quantized ``queries`` (Hamming or int8 inner product)."""
        _, ids = self.index.search(self.codes(queries), int(min(n, len(self))))
        return ids.astype(np.int64)

    def dequantized(self, ids: np.ndarray) -> np.ndarray:
        """The stored codes of ``ids`` (any shape; -1 gives zeros) in the float queries' space: bits as 0/1, int8
        codes mapped back to the start of their level (the formula of sentence-transformers' private
        ``_dequantize_embeddings``)."""
        flat = np.asarray(ids).reshape(-1)
        valid = flat >= 0
        rows = np.zeros((len(flat), self.dim), dtype=np.float32)
        if valid.any():
            stored = np.stack([self.index.reconstruct(int(i)) for i in flat[valid]])
            if self.precision == "binary":
                rows[valid] = np.unpackbits(stored.astype(np.uint8), axis=-1)[:, : self.dim]
            else:
                steps = (self.ranges[1] - self.ranges[0]) / 255
                steps = np.where(steps == 0, 1, steps)
                rows[valid] = (stored.astype(np.float64) + 128) * steps + self.ranges[0]
        return rows.reshape(*np.shape(ids), self.dim)


def rescored_search(
    index: QuantizedIndex,
    queries: np.ndarray,
    k: int,
    multiplier: int,
    float_documents=None,
    keep: str = "k",
) -> tuple[np.ndarray, np.ndarray]:
    """Scores and ids ``(Q, m)``, best first: the ``multiplier x k`` nearest codes, rescored with the float
    ``queries``. ``float_documents`` (a function ids -> ``ids.shape + (dim,)`` embeddings) rescores against float
    documents; None against the codes (sentence-transformers' rescoring). ``keep="k"`` returns the best ``k``
    (``semantic_search_faiss``'s output), ``"all"`` every rescored candidate. Equal scores go to the lower id;
    missing candidates (a corpus smaller than asked) are id -1 with score -inf."""
    if multiplier < 1:
        raise ValueError(f"rescore multiplier {multiplier}: must be 1 or more")
    queries = np.asarray(queries, dtype=np.float32)
    ids = index.candidates(queries, k * multiplier)
    docs = float_documents(ids) if float_documents is not None else index.dequantized(ids)
    scores = np.einsum("qd,qkd->qk", queries.astype(np.float64), docs.astype(np.float64))
    scores = np.where(ids < 0, -np.inf, scores)
    by_id = np.argsort(np.where(ids < 0, np.iinfo(np.int64).max, ids), axis=1, kind="stable")
    scores, ids = np.take_along_axis(scores, by_id, 1), np.take_along_axis(ids, by_id, 1)
    order = np.argsort(-scores, axis=1, kind="stable")
    if keep == "k":
        order = order[:, :k]
    return np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)
