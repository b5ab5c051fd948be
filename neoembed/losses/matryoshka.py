"""Nested dimensions (Matryoshka) and their recipe block."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import Field, PositiveInt, model_validator
from torch import Tensor

from neoembed.config import StrictModel
from neoembed.losses.matrices import _cut
from neoembed.scoring import Matrix


class MatryoshkaConfig(StrictModel):
    """Nested dimensions (Kusupati et al. 2022): the loss is ``sum_k weight_k * loss(embeddings[:, :dim_k])``.
    ``weights`` default to 1 each. The unified losses are wrapped in sentence-transformers' ``MatryoshkaLoss``
    (:func:`neoembed.losses.with_matryoshka`); :meth:`loss` serves CDE's two-stage step, on bare embeddings."""

    dims: list[PositiveInt] = Field(min_length=1)
    weights: list[float] | None = None

    @model_validator(mode="after")
    def _check(self):
        if len(set(self.dims)) != len(self.dims):
            raise ValueError(f"matryoshka.dims {self.dims} repeat a dimension; list each once")
        if self.weights is not None and len(self.weights) != len(self.dims):
            raise ValueError(
                f"matryoshka.weights has {len(self.weights)} entries for {len(self.dims)} dims {self.dims}: "
                "give one weight per dimension, or none (1 each)"
            )
        if self.weights is not None and min(self.weights) <= 0:
            raise ValueError(
                f"matryoshka.weights {self.weights} has a weight <= 0, so its dimension is not trained (or trained "
                "away): give positive weights, or drop the dimension from dims"
            )
        return self

    def pairs(self) -> list[tuple[int, float]]:
        """(dim, weight), largest dimension first."""
        weights = self.weights if self.weights is not None else [1.0] * len(self.dims)
        return sorted(zip(self.dims, weights, strict=True), reverse=True)

    def check_width(self, width: int) -> None:
        """Fail when a dimension exceeds the model's embedding width."""
        if max(self.dims) > width:
            raise ValueError(
                f"matryoshka.dims {self.dims} exceed the model's embedding dimension {width}; keep dims <= {width}"
            )

    def loss(self, fn: Callable[..., Tensor], queries: Matrix, docs, *args, **kwargs) -> Tensor:
        """``fn(queries, docs, ...)`` at every dimension, weighted and summed; ``docs`` a tensor or a list of
        matrices, each matrix a tensor or a list of segments."""
        total = 0.0
        for dim, weight in self.pairs():
            cut = [_cut(d, dim) for d in docs] if isinstance(docs, list) else _cut(docs, dim)
            total = total + weight * fn(_cut(queries, dim), cut, *args, **kwargs)
        return total
