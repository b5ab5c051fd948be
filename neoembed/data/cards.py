"""Data cards: a YAML file that says where a training set lives, which columns are query / positive /
negatives, the instruction for its queries, and its licence.

Schema (validated; unknown keys are errors)::

    name: gooaq                                  # unique name, used in logs and model cards
    source:                                      # exactly one of:
      hub: {id: tomaarsen/gooaq-hard-negatives, config: triplet-5, split: train, revision: null}
      local: {path: data/train.jsonl.gz, format: json}   # path relative to the card's folder
    columns:
      query: question                            # a column, or "col[0]" for the first item of a list column
      positive: answer
      negatives: [negative_1, negative_2]        # columns; a list column expands to several negatives
    filter: "score > 4"                          # optional: keep rows where <column> <op> <number>
    instruction: "Given a question, retrieve ..."  # placed before queries (none before documents)
    license: apache-2.0
    size: 3012496                                # rows (informational)
    notes: "..."
    provenance: {...}                            # optional: how the data was made (e.g. by ``neoembed mine``)

``revision: null`` is allowed and reported as unpinned.
"""

from __future__ import annotations

import operator
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError, model_validator

from neoembed.instructions import DEFAULT_TEMPLATE, format_with_instruction
from neoembed.recipe import RecipeError, StrictModel, format_validation_error, resolve_named_file

__all__ = ["DataCard", "DataCardError", "build_pairs", "find_card", "load_card", "load_rows"]


class DataCardError(ValueError):
    """A card that does not validate, or data that do not match their card."""


class QrelsJoin(StrictModel):
    """For mteb-style retrieval sets: qrels (query-id, corpus-id) joined with the corpus and queries configs."""

    corpus: str = "corpus"
    queries: str = "queries"


class HubSource(StrictModel):
    id: str
    config: str | None = None
    split: str = "train"
    revision: str | None = None
    join: QrelsJoin | None = None


class LocalSource(StrictModel):
    path: str
    format: Literal["json", "parquet", "csv"] = "json"


class Source(StrictModel):
    hub: HubSource | None = None
    local: LocalSource | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.hub is None) == (self.local is None):
            raise ValueError("source needs exactly one of 'hub' or 'local'")
        return self


class Columns(StrictModel):
    query: str
    positive: str
    negatives: list[str] = []


class DataCard(StrictModel):
    name: str
    source: Source
    columns: Columns
    filter: str | None = None
    instruction: str | None = None
    license: str | None = None
    size: int | None = None
    notes: str | None = None
    provenance: dict[str, Any] | None = None

    @property
    def pinned(self) -> bool:
        return self.source.local is not None or self.source.hub.revision is not None

    @property
    def research_only(self) -> bool:
        return "research" in (self.license or "").lower()


_FILTER = re.compile(r"^\s*(\w+)\s*(>=|<=|==|!=|>|<)\s*(-?[\d.]+)\s*$")
_OPS = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}


def load_card(path: str | Path) -> tuple[DataCard, Path]:
    """Validate a card file; returns the card and its folder (local paths resolve against it)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf8")) or {}
    except yaml.YAMLError as e:
        raise DataCardError(f"{path} is not valid YAML: {e}") from e
    try:
        card = DataCard.model_validate(raw)
    except ValidationError as e:
        raise DataCardError(format_validation_error(e, DataCard, str(path))) from None
    if card.filter and not _FILTER.match(card.filter):
        raise DataCardError(
            f"{path}: filter {card.filter!r} must look like '<column> <op> <number>' (op: {list(_OPS)})"
        )
    return card, path.parent


def find_card(name_or_path: str | Path, search_dirs: list[str | Path] = ()) -> Path:
    """A card file by path, by name in ``search_dirs``, or by name among the cards shipped with neoembed."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    for d in search_dirs:
        for cand in (
            Path(d) / f"{name_or_path}.yaml",
            Path(d) / f"{name_or_path}.yml",
            Path(d) / str(name_or_path),
        ):
            if cand.is_file():
                return cand
    try:
        return resolve_named_file(name_or_path, "data_cards")
    except RecipeError as e:
        raise DataCardError(
            str(e).replace("data card", "data card")
            + (f" (also searched: {', '.join(map(str, search_dirs))})" if search_dirs else "")
        ) from None


def load_rows(card: DataCard, folder: Path, max_rows: int | None = None):
    """The card's raw rows as a ``datasets.Dataset`` (hub or local), filtered, at most ``max_rows``."""
    import datasets

    if card.source.local is not None:
        path = (folder / card.source.local.path).resolve()
        if not path.exists():
            raise DataCardError(f"card {card.name}: local data {path} does not exist")
        files = sorted(str(f) for f in path.glob("*") if f.is_file()) if path.is_dir() else [str(path)]
        ds = datasets.load_dataset(card.source.local.format, data_files=files, split="train")
    else:
        hub = card.source.hub
        try:
            ds = datasets.load_dataset(hub.id, hub.config, split=hub.split, revision=hub.revision)
            if hub.join is not None:
                ds = _join_qrels(ds, hub, max_rows)
        except Exception as e:  # offline, missing repo, auth
            raise DataCardError(
                f"card {card.name}: could not load hub dataset {hub.id!r} (config {hub.config}, split {hub.split}): "
                f"{type(e).__name__}: {e}. Is the Hugging Face hub reachable?"
            ) from e
    if card.filter:
        col, op, value = _FILTER.match(card.filter).groups()
        if col not in ds.column_names:
            raise DataCardError(f"card {card.name}: filter column {col!r} not in {ds.column_names}")
        fn, v = _OPS[op], float(value)
        ds = ds.filter(lambda row: row[col] is not None and fn(float(row[col]), v))
    if max_rows is not None and len(ds) > max_rows:
        ds = ds.select(range(max_rows))
    return ds


def _join_qrels(qrels, hub: HubSource, max_rows: int | None):
    import datasets

    corpus = datasets.load_dataset(hub.id, hub.join.corpus, split="corpus", revision=hub.revision)
    queries = datasets.load_dataset(hub.id, hub.join.queries, split="queries", revision=hub.revision)
    docs = {r["_id"]: (r.get("title") or "") + (" " if r.get("title") else "") + r["text"] for r in corpus}
    qs = {r["_id"]: r["text"] for r in queries}
    rows = {"query": [], "positive": []}
    for r in qrels:
        q, d = qs.get(str(r["query-id"])), docs.get(str(r["corpus-id"]))
        if q and d and float(r.get("score", 1)) > 0:
            rows["query"].append(q)
            rows["positive"].append(d)
            if max_rows is not None and len(rows["query"]) >= max_rows:
                break
    return datasets.Dataset.from_dict(rows)


_PART = re.compile(r"^([^\[\]]+)((?:\[\d+\])*)$")


def _getter(spec: str, columns: list[str], card: str):
    """A row accessor for ``col``, ``col[0]``, ``col.key`` or ``col.key[1]`` (nested dicts and lists)."""
    steps: list[str | int] = []
    for part in spec.split("."):
        m = _PART.match(part)
        if not m:
            raise DataCardError(
                f"card {card}: cannot read column spec {spec!r} (use col, col[0], col.key[1])"
            )
        steps.append(m.group(1))
        steps += [int(i) for i in re.findall(r"\[(\d+)\]", m.group(2))]
    if steps[0] not in columns:
        raise DataCardError(
            f"card {card}: column {steps[0]!r} (from {spec!r}) not in the data; it has {columns}"
        )

    def get(row):
        v = row
        for st in steps:
            try:
                v = v[st]
            except (KeyError, IndexError, TypeError):
                return None
        return v

    return get


def build_pairs(
    card: DataCard,
    rows,
    max_negatives: int | None = None,
    template: str = DEFAULT_TEMPLATE,
    with_instruction: bool = True,
):
    """Rows -> a Dataset with columns ``query, positive, negative_1..k``; the card's instruction is placed before
    every query (documents stay plain). Rows with a missing query or positive are dropped."""
    import datasets

    cols = rows.column_names
    get_q = _getter(card.columns.query, cols, card.name)
    get_p = _getter(card.columns.positive, cols, card.name)
    neg_getters = [_getter(c, cols, card.name) for c in card.columns.negatives]
    instruction = card.instruction if with_instruction else None
    out: dict[str, list] = {"query": [], "positive": []}
    negs: list[list[str]] = []
    for row in rows:
        q, p = get_q(row), get_p(row)
        if not isinstance(q, str) or not isinstance(p, str) or not q.strip() or not p.strip():
            continue
        row_negs: list[str] = []
        for g in neg_getters:
            v = g(row)
            row_negs += (
                [x for x in v if isinstance(x, str)]
                if isinstance(v, list)
                else ([v] if isinstance(v, str) else [])
            )
        if max_negatives is not None:
            row_negs = row_negs[:max_negatives]
        out["query"].append(format_with_instruction(instruction, q, template))
        out["positive"].append(p)
        negs.append(row_negs)
    if not out["query"]:
        raise DataCardError(
            f"card {card.name}: no usable rows (empty data, or every query/positive is missing)"
        )
    k = min(len(n) for n in negs) if negs else 0  # a fixed number of negatives per dataset
    for j in range(k):
        out[f"negative_{j + 1}"] = [n[j] for n in negs]
    return datasets.Dataset.from_dict(out)
