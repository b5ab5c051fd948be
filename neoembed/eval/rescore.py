"""``neoembed mteb --embedding-precision int8|binary --rescore N``: retrieval on quantized documents, rescored.

A search backend of mteb's own kind (``IndexEncoderSearchProtocol``, given to mteb's ``SearchEncoderWrapper``):
mteb encodes queries and documents in float as usual; the backend keeps the documents as int8 / binary codes
(:mod:`neoembed.quantization`, sentence-transformers' ``quantize_embeddings``), takes the ``N x 10`` nearest codes to
each quantized query (10: the cut-off of nDCG@10, retrieval's main score) and rescores them with the float query,
against the codes (``rescore_docs="quantized"``, sentence-transformers' ``semantic_search_faiss`` rescoring) or
against the float documents (``"float"``). Every rescored candidate is returned, best first, so metrics at cut-offs
above ``N x 10`` (recall@100, MAP@1000) see only those candidates. Reranking tasks (a candidate list per query)
run the same two stages within each query's candidates. Other task types have no search to rescore: they are
scored on the quantized embeddings as without ``--rescore`` (mteb's ``CompressionWrapper``), and their result
says ``rescore_applied: false``.
"""

from __future__ import annotations

import numpy as np

from neoembed.quantization import RESCORE_DOCS, QuantizedIndex, rescored_search

__all__ = [
    "RESCORE_K",
    "RESCORE_TYPES",
    "RescoringIndex",
    "check_rescore",
    "rescore_fields",
    "rescore_label",
    "rescoring_search_model",
    "scoring_model",
]

RESCORE_K = 10  # the cut-off of nDCG@10
RESCORE_TYPES = ("Retrieval", "Reranking")


def rescore_label(multiplier: int | None, rescore_docs: str) -> str:
    """The setting as summaries and comparisons name it: ``none`` or ``4x vs float docs``."""
    return "none" if not multiplier else f"{multiplier}x vs {rescore_docs} docs"


def _numpy(embeddings) -> np.ndarray:
    if hasattr(embeddings, "detach"):
        embeddings = embeddings.detach().float().cpu().numpy()
    return np.asarray(embeddings, dtype=np.float32)


class RescoringIndex:
    """mteb search backend: quantized documents, the ``multiplier x 10`` nearest rescored with float queries."""

    def __init__(self, precision: str, multiplier: int, rescore_docs: str, normalize: bool):
        if rescore_docs not in RESCORE_DOCS:
            raise ValueError(f"rescore_docs {rescore_docs!r}: choose one of {', '.join(RESCORE_DOCS)}")
        self.precision, self.multiplier, self.rescore_docs = precision, int(multiplier), rescore_docs
        self.normalize = normalize
        self.clear()

    def _prepare(self, embeddings) -> np.ndarray:
        x = _numpy(embeddings)
        if self.normalize:  # cosine models: inner products of unit vectors
            x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(x, dtype=np.float32)

    def add_documents(self, embeddings, idxs: list[str]) -> None:
        docs = self._prepare(embeddings)
        self.docs = docs if self.docs is None else np.concatenate([self.docs, docs])
        self.idxs.extend(idxs)
        self.index = QuantizedIndex.build(self.docs, self.precision)

    def _search(self, index: QuantizedIndex, docs: np.ndarray, queries: np.ndarray):
        def gather(ids):
            return np.where((ids >= 0)[..., None], docs[np.maximum(ids, 0)], 0.0)

        float_docs = gather if self.rescore_docs == "float" else None
        scores, ids = rescored_search(index, queries, RESCORE_K, self.multiplier, float_docs, keep="all")
        keep = ids >= 0
        return [s[m].tolist() for s, m in zip(scores, keep, strict=True)], [
            i[m].tolist() for i, m in zip(ids, keep, strict=True)
        ]

    def search(self, embeddings, top_k, similarity_fn=None, top_ranked=None, query_idx_to_id=None):
        """(scores, indices) per query: indices into the added documents, or into each query's ``top_ranked``
        candidates when reranking (int8 codes keep the ranges of all the task's documents)."""
        if self.index is None:
            raise ValueError("no documents indexed: add_documents comes first")
        queries = self._prepare(embeddings)
        if top_ranked is None:
            return self._search(self.index, self.docs, queries)
        position = {doc_id: i for i, doc_id in enumerate(self.idxs)}
        all_scores, all_ids = [], []
        for q in range(len(queries)):
            ranked = [position[d] for d in top_ranked.get(query_idx_to_id[q]) or []]
            if not ranked:
                all_scores.append([])
                all_ids.append([])
                continue
            docs = self.docs[ranked]
            sub = QuantizedIndex.build(docs, self.precision, ranges=self.index.ranges)
            scores, ids = self._search(sub, docs, queries[q : q + 1])
            all_scores += scores
            all_ids += ids
        return all_scores, all_ids

    def clear(self) -> None:
        self.docs, self.idxs, self.index = None, [], None


def rescoring_search_model(wrapper, precision: str, multiplier: int, rescore_docs: str):
    """mteb's ``SearchEncoderWrapper`` around the float ``wrapper``, searching through a :class:`RescoringIndex`."""
    from mteb.models.model_meta import ScoringFunction
    from mteb.models.search_wrappers import SearchEncoderWrapper

    similarity = wrapper.mteb_model_meta.similarity_fn_name
    if similarity not in (ScoringFunction.COSINE, ScoringFunction.DOT_PRODUCT):
        raise ValueError(
            f"--rescore scores inner products: the model's similarity is {similarity}; use cosine or dot models"
        )
    index = RescoringIndex(
        precision, multiplier, rescore_docs, normalize=similarity is ScoringFunction.COSINE
    )
    return SearchEncoderWrapper(wrapper, index_backend=index)


def check_rescore(cfg) -> None:
    """Refuse an evaluation config's (``neoembed.eval.config.EvalConfig``) rescoring settings that cannot run."""
    if cfg.rescore is None:
        return
    if cfg.rescore < 1:
        raise ValueError(f"rescore {cfg.rescore}: the multiplier is 1 or more (candidates = N x 10)")
    if cfg.embedding_precision == "fp32":
        raise ValueError(
            "rescore needs quantized documents: add --embedding-precision int8 or binary (fp32 has nothing to rescore)"
        )
    if cfg.rescore_docs not in RESCORE_DOCS:
        raise ValueError(f"rescore_docs {cfg.rescore_docs!r}: choose one of {', '.join(RESCORE_DOCS)}")


def _rescores(cfg, task) -> bool:
    """Whether ``task`` runs with rescoring: asked for, and a task type with a search to rescore."""
    return bool(cfg.rescore) and task.metadata.type in RESCORE_TYPES


def rescore_fields(cfg, task) -> dict:
    """What a task's result says of rescoring (``rescore``: the run's setting, the same for every task)."""
    fields = {"rescore": rescore_label(cfg.rescore, cfg.rescore_docs)}
    if cfg.rescore:
        fields |= {
            "rescore_multiplier": cfg.rescore,
            "rescore_docs": cfg.rescore_docs,
            "rescore_applied": _rescores(cfg, task),
        }
    return fields


def scoring_model(wrapper, cfg, task):
    """What mteb scores ``task`` with: ``wrapper`` searching quantized documents with rescoring where the task
    has a search to rescore, else mteb's ``CompressionWrapper`` for int8 / binary embeddings (int8 maps each
    dimension to 256 levels between the ranges seen on the task's embeddings; binary keeps the sign bits, scored
    with Hamming-equivalent similarities), else ``wrapper`` as is."""
    if _rescores(cfg, task):
        return rescoring_search_model(wrapper, cfg.embedding_precision, cfg.rescore, cfg.rescore_docs)
    if cfg.embedding_precision == "fp32":
        return wrapper
    from mteb.models import CompressionWrapper
    from mteb.types import OutputDType

    dtype = OutputDType.INT8 if cfg.embedding_precision == "int8" else OutputDType.BINARY
    return CompressionWrapper(wrapper, dtype)
