"""One typed schema for every card that says where data lives: training cards (``data_cards/*.yaml``), pre-training
corpus cards (``data_cards/corpora/*.yaml``) and the dataset cards (``card.yaml``) that ``neoembed mteb --data-dir``
reads. The hub / local source is defined once, here.

This module sits on the lowest floor: it imports only pydantic, yaml and the standard library, so that ``data/``,
``pretrain/`` and ``eval/`` can all import it without importing each other.

A training card may declare its dataset's published schema (``schema:``), the evidence that its column paths can
work. Feature types are written in a compact form of the hub's ``dataset_info: features:``::

    string | int64 | int32 | float64 | bool   # a value (``dtype``)
    [string]                                  # a sequence / list of that type
    {title: string, text: string}             # a struct
    {class_label: [World, Sports, ...]}       # a ClassLabel with its names, in id order
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from neoembed.config import StrictModel

__all__ = [
    "VALUE_TYPES",
    "CardSchemaError",
    "Columns",
    "CorpusCard",
    "CorpusColumns",
    "DatasetCard",
    "DeclaredSchema",
    "HubSource",
    "LocalSource",
    "QrelsJoin",
    "Source",
    "TrainingCard",
    "parse_spec",
    "resolve_spec_type",
]

VALUE_TYPES = frozenset(
    {"string", "large_string", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"}
)
INT_TYPES = frozenset({"int8", "int16", "int32", "int64"})


class CardSchemaError(ValueError):
    """A card whose declared schema or column paths cannot work; the message names the card and the path."""


class _Strict(StrictModel):
    """Unknown keys are errors (a misspelt key never goes unnoticed); cards are immutable once read; no number is
    NaN or infinite (recipe's one strict base). A field with an alias (``schema_``: pydantic models keep the
    name ``schema`` for themselves) is read by its alias, the documented key, only."""


# ------------------------------------------------------------------------------------------------ sources
class QrelsJoin(_Strict):
    """mteb-style retrieval data: qrels (query-id, corpus-id, score) joined with the corpus and queries. On the hub
    these are configs of the same repository; in a local folder, sub-folders (or files) of these names."""

    corpus: str = "corpus"
    queries: str = "queries"


class HubSource(_Strict):
    id: str
    config: str | None = None
    split: str = "train"
    revision: str | None = None  # a commit hash quoted in the card's evidence, or null (unpinned)
    join: QrelsJoin | None = None


class LocalSource(_Strict):
    path: str  # relative to the card's folder
    format: Literal["json", "parquet", "csv", "mteb"] = "json"  # mteb: a folder with qrels/ corpus queries
    split: str = "train"  # mteb layout: the qrels split to read
    join: QrelsJoin | None = None


class Source(_Strict):
    hub: HubSource | None = None
    local: LocalSource | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.hub is None) == (self.local is None):
            raise ValueError("source needs exactly one of 'hub' or 'local'")
        return self


# ---------------------------------------------------------------------------------------- declared schema
def _check_type(t: Any, where: str) -> None:
    if isinstance(t, str):
        if t not in VALUE_TYPES:
            raise ValueError(f"{where}: unknown type {t!r}; valid: {sorted(VALUE_TYPES)}, [T], {{field: T}}")
    elif isinstance(t, list):
        if len(t) != 1:
            raise ValueError(f"{where}: a list type is written [T] with one item type, got {t!r}")
        _check_type(t[0], f"{where}[]")
    elif isinstance(t, dict):
        if set(t) == {"class_label"}:
            if not isinstance(t["class_label"], list) or not all(
                isinstance(n, str) for n in t["class_label"]
            ):
                raise ValueError(f"{where}: class_label takes the list of names, got {t['class_label']!r}")
            return
        for k, v in t.items():
            _check_type(v, f"{where}.{k}")
    else:
        raise ValueError(f"{where}: cannot read type {t!r}")


class DeclaredSchema(_Strict):
    """The dataset's schema as its publisher states it (hub README ``dataset_info``, or the public code that loads
    it); the evidence URL goes in the card's ``notes``."""

    config: str | None = None
    split: str = "train"
    features: dict[str, Any]
    num_rows: int | None = None  # num_examples of the split, as published
    license: str | None = None  # as published

    @field_validator("features")
    @classmethod
    def _types(cls, v):
        for name, t in v.items():
            _check_type(t, name)
        return v


_PART = re.compile(r"^([^\[\]]+)((?:\[\d+\])*)$")


def parse_spec(spec: str) -> list[str | int]:
    """``col``, ``col[0]``, ``col.key``, ``col.key[1]`` -> steps (names and list indices). A name applied to a list
    reads that field of every item (a list of structs gives a list of values), as ``datasets`` presents them."""
    steps: list[str | int] = []
    for part in spec.split("."):
        m = _PART.match(part)
        if not m:
            raise CardSchemaError(f"cannot read column spec {spec!r} (use col, col[0], col.key, col.key[1])")
        steps.append(m.group(1))
        steps += [int(i) for i in re.findall(r"\[(\d+)\]", m.group(2))]
    return steps


def resolve_spec_type(spec: str, features: dict[str, Any]) -> Any:
    """The declared type a column spec reaches, or :class:`CardSchemaError` saying where the path fails."""
    steps = parse_spec(spec)
    t: Any = features  # a row is a struct of its features
    for i, st in enumerate(steps):
        here = (
            spec
            if i == 0
            else f"{steps[0]}" + "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in steps[1:i])
        )
        if isinstance(st, int):
            if not isinstance(t, list):
                raise CardSchemaError(
                    f"spec {spec!r}: [{st}] indexes {here!r}, which is {_show(t)}, not a list"
                )
            t = t[0]
        elif isinstance(t, list) and isinstance(t[0], dict) and "class_label" not in t[0]:
            if st not in t[0]:
                raise CardSchemaError(
                    f"spec {spec!r}: the items of {here!r} have no field {st!r} ({sorted(t[0])})"
                )
            t = [t[0][st]]
        elif isinstance(t, dict) and "class_label" not in t:
            if st not in t:
                where = "the dataset" if i == 0 else repr(here)
                raise CardSchemaError(f"spec {spec!r}: {where} has no field {st!r}; it has {sorted(t)}")
            t = t[st]
        else:
            raise CardSchemaError(f"spec {spec!r}: {st!r} reads a field of {here!r}, which is {_show(t)}")
    return t


def _show(t: Any) -> str:
    if isinstance(t, str):
        return f"a {t}"
    if isinstance(t, list):
        return f"a list of {_show(t[0])}"
    if isinstance(t, dict) and "class_label" in t:
        return "a class label"
    return "a struct"


# ------------------------------------------------------------------------------------------ training cards
ColumnSpec = str | list[str]  # a list: the parts' texts joined by a space, in order (e.g. title + answer)


class Columns(_Strict):
    query: ColumnSpec
    positive: ColumnSpec
    negatives: list[str] = []
    # a teacher's scores of each row's positive, then of each of its negatives in order (a list of numbers);
    # ``neoembed mine`` and ``neoembed score`` write it; recipes with ``distillation`` train on it
    scores: str | None = None

    def specs(self) -> list[tuple[str, str]]:
        """(role, spec) for every column spec of the card."""
        out = []
        for role in ("query", "positive"):
            v = getattr(self, role)
            out += [(role, s) for s in ([v] if isinstance(v, str) else v)]
        return out + [("negatives", s) for s in self.negatives]


class TrainingCard(_Strict):
    """A contrastive training set: where it lives, which columns are query / positive / hard negatives, the
    instruction before its queries, its licence, and the evidence that its paths match the published schema."""

    name: str
    paper_row: str | None = None  # the row of the paper's Table 7 this card trains (e.g. MEDMCQA_CLUST)
    source: Source
    columns: Columns
    filter: str | None = None
    # column spec -> class names by id, for integer labels the dataset does not publish as a ClassLabel
    labels: dict[str, list[str]] = {}
    instruction: str | None = None
    license: str | None = None
    # rows of the full dataset (before max_rows); pi_i uses it where the data is not counted (a dry run)
    size: Annotated[int, Field(ge=1)] | None = None
    # the share of rows the card expects to drop (missing values the evidence shows); losing more is an error.
    # "unknown": the evidence publishes no share. Dropped rows are still counted per reason and reported as a
    # warning with the measured share (and how to pin it), but never stop the run.
    expected_loss: float | Literal["unknown"] = 0.0
    schema_: DeclaredSchema | None = Field(None, alias="schema")
    notes: str | None = None
    # how the data was made, for cards written by tools (``neoembed mine``: source card, model, index, counts)
    provenance: dict[str, Any] | None = None

    @field_validator("expected_loss", mode="before")
    @classmethod
    def _share(cls, v):  # one message for the union (pydantic reports each member's failure apart)
        if v == "unknown":
            return v
        try:
            share = None if isinstance(v, bool) else float(v)
        except (TypeError, ValueError):
            share = None
        if share is None or not 0.0 <= share <= 1.0:
            raise ValueError("expected a share of the rows from 0 to 1, or 'unknown'")
        return share

    @property
    def pinned(self) -> bool:
        return self.source.local is not None or self.source.hub.revision is not None

    @property
    def research_only(self) -> bool:
        return "research" in (self.license or "").lower()

    def schema_problems(self) -> list[str]:
        """Every way the card's column paths, config and split disagree with its declared schema ([] = none)."""
        sch = self.schema_
        if sch is None:
            return []
        problems = []
        hub = self.source.hub
        if hub is not None and hub.join is None and (hub.config, hub.split) != (sch.config, sch.split):
            problems.append(
                f"source reads config {hub.config!r} split {hub.split!r} but the schema is declared for config "
                f"{sch.config!r} split {sch.split!r}"
            )
        features = sch.features
        if (hub is not None and hub.join is not None) or (
            self.source.local is not None and self.source.local.format == "mteb"
        ):
            features = {"query": "string", "positive": "string"}  # what the qrels join yields
            for need in ("query-id", "corpus-id"):
                if need not in sch.features:
                    problems.append(
                        f"a qrels join needs a {need!r} column; the declared qrels have {sorted(sch.features)}"
                    )
        for role, spec in self.columns.specs():
            try:
                t = resolve_spec_type(spec, features)
            except CardSchemaError as e:
                problems.append(f"{role}: {e}")
                continue
            problems += _leaf_problems(role, spec, t, self.labels)
        if self.filter:
            col = self.filter.split()[0]
            if col not in features:
                problems.append(f"filter column {col!r} is not in the declared features {sorted(features)}")
        return problems


def _leaf_problems(role: str, spec: str, t: Any, labels: dict[str, list[str]]) -> list[str]:
    """A query or positive must reach text (or a class label, read as its name); negatives text or a list of it."""
    ok = t in ("string", "large_string") or (isinstance(t, dict) and "class_label" in t)
    ok = ok or (isinstance(t, str) and t in INT_TYPES and spec in labels)
    if role == "negatives" and isinstance(t, list):
        ok = t[0] in ("string", "large_string")
    if ok:
        return []
    return [
        f"{role}: spec {spec!r} reaches {_show(t)}, not text"
        + (" (map integer labels to names with `labels:`)" if isinstance(t, str) and t in INT_TYPES else "")
    ]


# ------------------------------------------------------------------------------------------- corpus cards
class CorpusColumns(_Strict):
    text: str = "text"


class CorpusCard(_Strict):
    """A pre-training corpus: where it lives, which column holds the text, its licence."""

    name: str
    kind: Literal["corpus"] = "corpus"
    source: Source
    columns: CorpusColumns = CorpusColumns()
    license: str | None = None
    size: Annotated[int, Field(ge=1)] | None = None
    notes: str | None = None


# ------------------------------------------------------------------------------------------ dataset cards
class RepositorySource(BaseModel):
    """Where a folder of evaluation data was built from: a public repository at a commit."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)
    repository: str | None = None
    commit: str | None = None
    paths: list[str] = []


class DatasetCard(BaseModel):
    """``card.yaml`` of a data folder (e.g. ``../shared/data/mteb/STS12``). These files are written by the project
    that builds the folders, so keys beyond the ones neoembed reads are kept, not rejected."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)
    name: str | None = None
    mteb_task: str | None = None
    task_type: str | None = None
    format: str | None = None
    splits: dict[str, int] = {}
    license: str | None = None
    instruction: str | None = None
    source: RepositorySource | Source | None = None
    # how the folder's data compares with the mteb task's (the data's own account, said beside its scores)
    mteb_test_rows: int | None = None
    same_pairs_and_scores_as_mteb: bool | None = None
    identical_reason: str | None = None

    def differs_from_mteb(self) -> str | None:
        """Why the folder's scores do not compare with the mteb task's published ones, or None: the card says
        its pairs and scores are not MTEB's, or its test split holds another number of rows."""
        test = self.splits.get("test")
        if self.same_pairs_and_scores_as_mteb is False and self.identical_reason:
            return self.identical_reason
        if self.mteb_test_rows is not None and test is not None and test != self.mteb_test_rows:
            return f"{test:,} test rows where the mteb task has {self.mteb_test_rows:,}"
        if self.same_pairs_and_scores_as_mteb is False:
            return "its card says its pairs and scores are not the mteb task's"
        return None
