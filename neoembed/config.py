"""The one strict base of every typed config in neoembed: recipes, loss settings, data cards, mining.

It sits on the lowest floor (pydantic only), so that every foundation module can build on it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["StrictModel"]


class StrictModel(BaseModel):
    """Base of every typed config: unknown keys are rejected, objects are immutable, and no number may be NaN or
    infinite (``alpha=nan`` or ``lr=inf`` fail here, by key, not inside a run)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
