"""Reading a card's column specs (``col``, ``col[0]``, ``col.key``, ``col.key[1]``) from rows: the value or an error
naming the card, the spec, the row and the type."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

from neoembed.card_schema import TrainingCard as DataCard
from neoembed.card_schema import parse_spec
from neoembed.data.errors import DataCardError, RowError

_MISSING = object()


class _Spec:
    """One column spec read from rows: the value, ``_MISSING`` (absent, null, index past the end), or an error
    naming the card, the spec, the row and the type where the path meets something it cannot read."""

    def __init__(self, card: DataCard, role: str, spec: str, columns: list[str], features):
        self.card, self.role, self.spec = card, role, spec
        self.steps = parse_spec(spec)
        if self.steps[0] not in columns:
            raise DataCardError(
                f"card {card.name}: {role} column {self.steps[0]!r} (from {spec!r}) not in the data; it has {columns}"
                + (": names holding tabs, so the file is tab-separated; write it comma-separated (or as JSON lines)"
                   if any("\t" in str(c) for c in columns) else "")
            )  # fmt: skip
        self.names = card.labels.get(spec) or _class_label_names(features, self.steps)
        self.hits = 0

    def read(self, row: dict, i: int):
        """The spec's value in ``row`` (a dict of every column)."""
        return self.read_value(row[self.steps[0]], i)

    def read_value(self, v, i: int):
        """The spec's value, starting from its column's value ``v`` in row ``i`` (steps after the column)."""
        for st in self.steps[1:]:
            if v is None:
                return _MISSING
            if isinstance(st, int):
                if not isinstance(v, list):
                    raise self._error(i, v, f"[{st}] needs a list")
                if st >= len(v):
                    return _MISSING
                v = v[st]
            elif isinstance(v, dict):
                if st not in v:
                    return _MISSING
                v = v[st]
            elif isinstance(v, list) and all(isinstance(x, dict) or x is None for x in v):
                v = [x.get(st) if x is not None else None for x in v]  # a field of every item
            else:
                raise self._error(i, v, f"{st!r} reads a field")
        if v is None:
            return _MISSING
        self.hits += 1
        return v

    def text(self, v, i: int):
        """A query or positive, from its column's value ``v``: text, or an integer class label read as its name."""
        v = self.read_value(v, i)
        if v is _MISSING or isinstance(v, str):
            return v
        if isinstance(v, int) and not isinstance(v, bool) and self.names:
            if not 0 <= v < len(self.names):
                raise self._error(i, v, f"label {v} is outside the {len(self.names)} names")
            return self.names[v]
        raise self._error(i, v, "expected text")

    def texts(self, v, i: int) -> tuple[list[str], int]:
        """Negatives, from their column's value ``v``: (texts, missing items). A list expands; nulls inside it are
        counted, not errors."""
        v = self.read_value(v, i)
        if v is _MISSING:
            return [], 0
        items = v if isinstance(v, list) else [v]
        bad = next((x for x in items if x is not None and not isinstance(x, str)), None)
        if bad is not None:
            raise self._error(i, bad, "expected text or a list of text")
        return [x for x in items if x is not None], sum(x is None for x in items)

    def _error(self, i: int, v, why: str) -> DataCardError:
        hint = " (map integer labels to names with the card's `labels:`)" if isinstance(v, int) and not self.names else ""
        return RowError(
            f"card {self.card.name}: {self.role} spec {self.spec!r} reaches a {type(v).__name__} in ",
            i,
            f" ({why}): {str(v)[:80]!r}{hint}",
        )


def _class_label_names(features, steps) -> list[str] | None:
    """The ClassLabel names at the end of ``steps`` in a ``datasets.Features`` (None if it is not a ClassLabel)."""
    f = features
    for st in steps:
        if not isinstance(st, int) and not isinstance(f, dict):
            f = getattr(f, "feature", None)  # a field of a list of structs: step into the item type first
        if isinstance(st, int):
            f = getattr(f, "feature", None)  # Sequence / List -> its item type
        elif isinstance(f, dict) and st in f:
            f = f[st]
        else:
            return None
        if f is None:
            return None
    return list(f.names) if type(f).__name__ == "ClassLabel" else None


def _locate_non_finite(files: list[Path], spec: _Spec) -> str | None:
    """``FILE, line N`` of the first JSON line whose ``spec`` value holds a NaN or infinite number (Python's json
    reads NaN and Infinity, as pyarrow's reader does), or None. The value is read as the card reads it."""
    for path in files:
        opener = gzip.open if path.suffix == ".gz" else open
        try:
            with opener(path, "rt", encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    row = json.loads(line) if line.strip() else {}
                    if spec.steps[0] in row and _has_non_finite(spec.read_value(row[spec.steps[0]], number)):
                        return f"{path}, line {number}"
        except (OSError, EOFError, ValueError):  # DataCardError is a ValueError: a line the spec cannot read
            continue  # not JSON lines (parquet, csv): the row number is all the error can give
    return None


def _has_non_finite(v) -> bool:
    if isinstance(v, list):
        return any(_has_non_finite(x) for x in v)
    return isinstance(v, float) and not math.isfinite(v)
