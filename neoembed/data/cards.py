"""Data cards: a YAML file that says where a training set lives, which columns are query / positive /
negatives, the instruction for its queries, its licence, and the published schema that proves its paths.

Schema (``neoembed.card_schema.TrainingCard``; unknown keys are errors)::

    name: gooaq                                  # unique name, used in logs and model cards
    paper_row: GOOAQ                             # the row of the paper's Table 7 (instruction = that row, verbatim)
    source:                                      # exactly one of:
      hub: {id: tomaarsen/gooaq-hard-negatives, config: triplet-5, split: train, revision: null}
      local: {path: data/train.jsonl.gz, format: json}   # path relative to the card's folder; format mteb: a
                                                         # folder with qrels/<split>, corpus and queries
    columns:
      query: question                            # a column, col[0], col.key, col.key[1]; or a list joined by " "
      positive: answer
      negatives: [negative_1, negative_2]        # columns; a list column expands to several negatives
    filter: "score > 4"                          # optional: keep rows where <column> <op> <number>
    labels: {topic: [World, Sports]}             # optional: integer labels -> names (ClassLabel names otherwise)
    instruction: "Given a question, ..."         # placed before queries (none before documents)
    license: apache-2.0
    size: 3012496                                # rows of the full dataset
    expected_loss: 0.0                           # share of rows the evidence says will be dropped; or unknown
    schema: {config: triplet-5, split: train, features: {question: string, ...}, num_rows: 3012496, license: ...}
    notes: "evidence: <URL of the hub page or loader code>"

Nothing is dropped silently. A column path that reaches a non-text value is an error naming the card, the spec,
the row and the type (integer class labels are read as their names); a spec that matches nothing in any row is an
error; rows dropped for a missing or empty query or positive are counted per reason, and losing a larger share
than the card's ``expected_loss`` is an error.

``expected_loss: unknown`` is for a dataset whose evidence publishes no share (say so in ``notes``): its dropped
rows are counted per reason as always, and the measured share is logged as a warning (and written in the run
record) with how to pin it, but it never stops the run. A number keeps the strict rule; pin one once
``neoembed data check CARD`` has measured the share on the full data, citing that command as the evidence.

Hard negatives: every query of a dataset gets the same number k of negatives (sentence-transformers batches are
columns). k is the number most rows carry (capped by ``max_negatives``); a row with fewer than k is dropped and
counted under "fewer than k hard negatives" (so it counts against ``expected_loss``). One short row therefore never
takes the negatives of the other rows away; ``max_negatives: 0`` trains without negatives and keeps every row.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import operator
import os
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import xxhash
import yaml
from pydantic import ValidationError

from neoembed.card_schema import CardSchemaError, TrainingCard, parse_spec
from neoembed.instructions import DEFAULT_TEMPLATE, format_with_instruction
from neoembed.recipe import RecipeError, format_validation_error, resolve_named_file

__all__ = [
    "DataCard",
    "DataCardError",
    "DropReport",
    "explain_data_errors",
    "explain_unreadable",
    "LoadedRows",
    "build_pairs",
    "build_pairs_report",
    "find_card",
    "hub_offline_mode",
    "prepare_card",
    "load_card",
    "load_card_rows",
    "load_rows",
    "text_hash",
]

DataCard = TrainingCard  # the training card's schema lives in neoembed.card_schema (shared with other cards)
UNKNOWN = "unknown"  # expected_loss of a card whose evidence publishes no share of dropped rows

logger = logging.getLogger(__name__)


class DataCardError(ValueError):
    """A card that does not validate, or data that do not match their card."""


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
    except UnicodeDecodeError as e:
        raise DataCardError(
            f"{path} is not a data card: not UTF-8 text ({e}); give the card's .yaml file"
        ) from None
    try:
        card = DataCard.model_validate(raw)
    except ValidationError as e:
        raise DataCardError(format_validation_error(e, DataCard, str(path))) from None
    if card.filter and not _FILTER.match(card.filter):
        raise DataCardError(
            f"{path}: filter {card.filter!r} must look like '<column> <op> <number>' (op: {list(_OPS)})"
        )
    try:
        for _, spec in card.columns.specs():
            parse_spec(spec)
    except CardSchemaError as e:
        raise DataCardError(f"{path}: {e}") from None
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
        also = f" (also searched: {', '.join(map(str, search_dirs))})" if search_dirs else ""
        raise DataCardError(str(e) + also) from None


# ------------------------------------------------------------------------------------------------ loading
@dataclass
class LoadedRows:
    """A card's rows: ``rows`` (at most max_rows, a seeded random sample), ``full_size`` (rows of the whole
    dataset after the card's filter: what pi_i is computed from), and rows lost while loading (qrels joins)."""

    rows: object  # datasets.Dataset
    full_size: int
    dropped: dict[str, int] = field(default_factory=dict)
    sampled: bool = False


def load_rows(card: DataCard, folder: Path, max_rows: int | None = None, seed: int = 0):
    """The card's raw rows as a ``datasets.Dataset`` (see :func:`load_card_rows`)."""
    return load_card_rows(card, folder, max_rows, seed).rows


def load_card_rows(card: DataCard, folder: Path, max_rows: int | None = None, seed: int = 0) -> LoadedRows:
    """The card's rows (hub or local), filtered, then a seeded random sample of ``max_rows`` of them.

    Qrels joins (mteb retrieval sets on the hub, or a local folder in the mteb layout) sample the qrels first and
    read only the corpus documents and queries the kept qrels need (see :mod:`neoembed.data.qrels`).
    """
    import datasets

    from neoembed.data import qrels

    local, hub = card.source.local, card.source.hub
    if local is not None:
        path = (folder / local.path).resolve()
        if not path.exists():
            raise DataCardError(f"card {card.name}: local data {path} does not exist; fix source.local.path")
        if local.format == "mteb":
            return _joined(card, qrels.join_local(path, local.split, local.join, max_rows, seed))
        files = sorted(str(f) for f in path.glob("*") if f.is_file()) if path.is_dir() else [str(path)]
        if not files:
            raise DataCardError(
                f"card {card.name}: local data folder {path} holds no files (sub-folders are not read): put the "
                "data files in it or point source.local.path at one"
            )
        ds = datasets.load_dataset(local.format, data_files=files, split="train")
    else:
        try:
            if hub.join is not None:
                return _joined(card, qrels.join_hub(hub, max_rows, seed))
            ds = datasets.load_dataset(hub.id, hub.config, split=hub.split, revision=hub.revision)
        except Exception as e:
            raise hub_error(card, e) from e
    ds = _apply_filter(card, ds)
    full = len(ds)
    if max_rows is not None and full > max_rows:
        keep = sorted(random.Random(seed).sample(range(full), max_rows))  # sorted: reads stay sequential
        return LoadedRows(ds.select(keep), full, sampled=True)
    return LoadedRows(ds, full)


class HubUnreachable(DataCardError):
    """The hub could not be reached at all (offline mode, no network): the card itself may be fine."""


def hub_error(card: DataCard, e: Exception) -> DataCardError:
    """A hub failure as a card error: :class:`HubUnreachable` only when the network is the cause; a missing repo,
    config or split, or anything else, is the card's problem and says so."""
    hub = card.source.hub
    where = f"hub dataset {hub.id!r} (config {hub.config}, split {hub.split}, revision {hub.revision})"
    if is_unreachable(e):
        fix = (
            "HF_HUB_OFFLINE is set and the dataset is not in the local cache: unset it, with network access, to "
            "download it"
            if hub_offline_mode()
            else "connect to the network, or set HF_HUB_OFFLINE=1 to load a dataset already in the local cache"
        )
        return HubUnreachable(
            f"card {card.name}: the Hugging Face hub is unreachable for {where}: {e}. {fix}"
        )
    return DataCardError(
        f"card {card.name}: could not load {where}: {type(e).__name__}: {e}. Check the card's source against the "
        "dataset's page (id, config, split, revision)"
    )


def is_unreachable(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) means "no connection", not "wrong request"."""
    names = {
        "ConnectionError",
        "ConnectTimeout",
        "ConnectError",
        "Timeout",
        "ReadTimeout",
        "OfflineModeIsEnabled",
    }
    names |= {"ProxyError", "NameResolutionError", "MaxRetryError", "TimeoutException"}
    seen: BaseException | None = e
    while seen is not None:
        if type(seen).__name__ in names or isinstance(seen, (ConnectionError, TimeoutError)):
            return True
        if "offline mode is enabled" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    # datasets in offline mode reports a missing cache as FileNotFoundError / its own errors naming offline mode
    return hub_offline_mode() and "offline" in str(e).lower()


def hub_offline_mode() -> bool:
    """Whether the user asked the Hugging Face libraries to stay offline (``HF_HUB_OFFLINE``), read now (not at
    import, as huggingface_hub's constant is)."""
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")


def _joined(card: DataCard, joined) -> LoadedRows:
    import datasets

    rows, full, dropped = joined
    ds = datasets.Dataset.from_dict(rows)
    return LoadedRows(_apply_filter(card, ds), full, dropped, sampled=len(ds) < full)


def _apply_filter(card: DataCard, ds):
    if not card.filter:
        return ds
    col, op, value = _FILTER.match(card.filter).groups()
    if col not in ds.column_names:
        raise DataCardError(f"card {card.name}: filter column {col!r} not in {ds.column_names}")
    fn, v = _OPS[op], float(value)
    # batched, one column: Python sees a block of that column's values at a time, not every row as a dict
    keep = lambda values: [x is not None and fn(float(x), v) for x in values]  # noqa: E731
    return ds.filter(keep, batched=True, batch_size=10_000, input_columns=[col])


# ----------------------------------------------------------------------------------------- reading columns
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
            )
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
        hint = " (map integer labels to names with the card's `labels:`)" if isinstance(v, int) else ""
        return DataCardError(
            f"card {self.card.name}: {self.role} spec {self.spec!r} reaches a {type(v).__name__} in row {i} "
            f"({why}): {str(v)[:80]!r}{hint}"
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


# --------------------------------------------------------------------------------------------- pair building
@dataclass
class DropReport:
    """What one card's data gave: rows read and kept, rows dropped per reason, negatives per query."""

    card: str
    rows_read: int
    rows_kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    negatives_per_query: int = 0
    full_size: int | None = None
    sampled: bool = False
    expected_loss: float | str = 0.0  # or UNKNOWN
    # of the kept pairs: how many have the query equal to its positive (formatted as a query), how many differ
    # (by the texts' hashes); what ``neoembed.runs.check_pair_counts`` warns about, counted in the build's map
    same_as_query: int = 0
    distinct_pairs: int = 0

    @property
    def loss(self) -> float:
        return sum(self.dropped.values()) / max(self.rows_read, 1)

    def pin_hint(self) -> str | None:
        """For a card with ``expected_loss: unknown`` that dropped rows: the measured share and how to pin it."""
        if self.expected_loss != UNKNOWN or not self.dropped:
            return None
        n = sum(self.dropped.values())
        where = (
            f"a seeded sample of {self.rows_read:,} rows (of {self.full_size:,}); measure the full data without "
            "--max-rows before pinning"
            if self.sampled and self.full_size
            else f"{self.rows_read:,} rows"
        )
        return (
            f"card {self.card}: expected_loss is unknown (its evidence publishes no share), so the run goes on: "
            f"measured {100 * self.loss:.2f}% ({n:,} dropped of {where}). To pin it, set expected_loss: "
            f"{_round_up(self.loss)} in the card and cite `neoembed data check {self.card}` and its output in notes"
        )

    def as_dict(self) -> dict:
        return {
            "rows_read": self.rows_read,
            "rows_kept": self.rows_kept,
            "dropped": dict(self.dropped),
            "loss": round(self.loss, 6),
            "expected_loss": self.expected_loss,
            "line": self.line(),
            "negatives_per_query": self.negatives_per_query,
            "full_size": self.full_size,
            "sampled": self.sampled,
        }

    def line(self) -> str:
        drops = ", ".join(f"{k}: {v}" for k, v in self.dropped.items() if v) or "none"
        if self.expected_loss == UNKNOWN:
            share = f"measured {100 * self.loss:.2f}%, expected: unknown"
        else:
            share = f"{100 * self.loss:.2f}% vs {100 * self.expected_loss:.2f}% expected"
        return (
            f"{self.rows_kept} of {self.rows_read} rows kept (dropped: {drops}; {share}); "
            f"{self.negatives_per_query} hard negatives per query"
        )


def _round_up(share: float) -> float:
    """A measured share as a card value: 4 decimals, rounded up so that the measured data pass."""
    return math.ceil(share * 10_000) / 10_000


def build_pairs(card, rows, max_negatives=None, template=DEFAULT_TEMPLATE, with_instruction=True):
    """Rows -> a Dataset with columns ``query, positive, negative_1..k`` (see :func:`build_pairs_report`)."""
    return build_pairs_report(card, rows, max_negatives, template, with_instruction)[0]


def build_pairs_report(
    card: DataCard,
    rows,
    max_negatives: int | None = None,
    template: str = DEFAULT_TEMPLATE,
    with_instruction: bool = True,
    loaded: LoadedRows | None = None,
    warn: bool = True,
    workdir: Path | None = None,
):
    """Rows -> (Dataset with ``query, positive, negative_1..k``, :class:`DropReport`). The card's instruction goes
    before every query (documents stay plain); every dropped row is counted (see the module docstring).
    ``warn=False``: the caller reports an ``expected_loss: unknown`` card's share itself (``report.pin_hint()``).

    The rows stream through two batched ``datasets.map`` passes, never into Python lists: the first reads every
    row (errors name the row, in row order), the second keeps the rows with k negatives, in Arrow. ``workdir``:
    where their Arrow files go (then also ``text_hashes.npy``, see :func:`neoembed.data.sampler.text_hashes`);
    without it they stay in memory for in-memory rows, or go to the datasets cache beside the rows' files."""
    reader = _RowReader(card, rows, template, with_instruction)
    report = DropReport(card.name, len(rows), expected_loss=card.expected_loss)
    if loaded is not None:
        report.full_size, report.sampled = loaded.full_size, loaded.sampled
        report.rows_read += sum(loaded.dropped.values())
        report.dropped.update(loaded.dropped)
    read = _map_rows(rows, reader, workdir)
    _check_hits(card, reader.hit_specs, rows)
    drop = read.data.column("_drop").to_numpy()
    for code in sorted(set(_codes(drop)), key=lambda c: int((drop == c).argmax())):  # first row first
        reason = _REASONS[code - 1]
        report.dropped[reason] = report.dropped.get(reason, 0) + int((drop == code).sum())
    counts = _negative_counts(read)[drop == 0]
    k = _negatives_per_query(counts, max_negatives) if reader.negs else 0
    short = int((counts < k).sum())
    if short:
        report.dropped[f"fewer than {k} hard negatives"] = short
    report.rows_kept, report.negatives_per_query = int(len(counts) - short), k
    _check_loss(card, report, max_negatives, warn)
    pairs = _keep_rows(read, k, reader.score_spec is not None, workdir)
    report.same_as_query, report.distinct_pairs = _pair_counts(pairs, workdir)
    # the hidden columns stay in the file, out of the dataset: the trainer reads every column it has
    return pairs.remove_columns(["_same", "_hashes"]), report


def _pair_counts(pairs, workdir: Path | None) -> tuple[int, int]:
    """(pairs whose query equals its positive, distinct (query, positive) pairs), from the hidden columns; with
    ``workdir``, the texts' hashes are written there too (:data:`HASHES`)."""
    import numpy as np

    same = int(np.count_nonzero(pairs.data.column("_same").to_numpy(zero_copy_only=False)))
    width = 2 + sum(c.startswith("negative_") for c in pairs.column_names)
    path = workdir / HASHES if workdir is not None else None
    hashes = _write_hashes(pairs, width, path)
    pair = hashes[:, 0].astype(np.uint64) ^ (hashes[:, 1].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    distinct = len(np.unique(pair))
    if path is not None:  # no_duplicates: auto's question, answered once here for every later run
        columns = ["query", "positive"] + [f"negative_{j + 1}" for j in range(width - 2)]
        (workdir / REPEATS).write_text(json.dumps({"repeats": hashed_repeats(hashes, pairs, columns)}))
    return same, distinct


def hashed_repeats(hashes, dataset, columns: list[str]) -> bool:
    """Whether a text occurs twice among ``hashes`` ((rows, columns) int64: the hashes of ``dataset``'s
    ``columns``), sorted in numpy; a repeated hash is confirmed on the two texts, so a collision is no repeat."""
    import numpy as np

    flat = np.asarray(hashes).reshape(-1)
    ordered = np.sort(flat)
    repeated = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
    del ordered
    for value in repeated:
        first, second = np.flatnonzero(flat == value)[:2]
        (r1, c1), (r2, c2) = divmod(int(first), len(columns)), divmod(int(second), len(columns))
        if dataset[r1][columns[c1]] == dataset[r2][columns[c2]]:
            return True
    return False


_REASONS = ("query missing", "query empty", "positive missing", "positive empty")


def _codes(drop) -> list[int]:
    import numpy as np

    return [int(c) for c in np.flatnonzero(np.bincount(drop, minlength=len(_REASONS) + 1)) if c]


def _negative_counts(read):
    import pyarrow.compute as pc

    return pc.list_value_length(read.data.column("negatives")).to_numpy(zero_copy_only=False)


class _RowReader:
    """The first pass's batch function: every row read in order, to ``query`` (instruction before it),
    ``positive``, ``negatives`` (the non-empty ones), ``label`` (scores) and ``_drop`` (0: kept, else 1 + the
    index of its reason in ``_REASONS``), with the 64-bit hashes of the texts (``_hashes``: query, positive,
    then one per negative) and whether the query equals its positive as a query (``_same``). Errors are raised at the first row that has one, as the row-by-row loop did."""

    def __init__(self, card: DataCard, rows, template: str, with_instruction: bool):
        cols, feats = rows.column_names, getattr(rows, "features", None)
        self.card, self.template = card, template
        self.instruction = card.instruction if with_instruction else None
        self.readers = {
            role: [_Spec(card, role, s, cols, feats) for s in ([v] if isinstance(v, str) else v)]
            for role, v in (("query", card.columns.query), ("positive", card.columns.positive))
        }
        self.negs = [_Spec(card, "negatives", s, cols, feats) for s in card.columns.negatives]
        spec = card.columns.scores
        self.score_spec = _Spec(card, "scores", spec, cols, feats) if spec else None
        self.hit_specs = [s for specs in self.readers.values() for s in specs] + self.negs

    def features(self):
        import datasets

        text, hashes = datasets.Value("string"), datasets.List(datasets.Value("int64"))
        out = {"query": text, "positive": text, "negatives": datasets.List(text), "_hashes": hashes}
        out["_same"] = datasets.Value("bool")
        if self.score_spec is not None:
            out["label"] = datasets.List(datasets.Value("float64"))
        return datasets.Features({**out, "_drop": datasets.Value("int8")})

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        out = {name: [] for name in self.features()}
        for r, i in enumerate(indices):
            query, positive, negatives, scores, code = self._row(batch, r, i)
            out["query"].append(query)
            out["positive"].append(positive)
            out["negatives"].append(negatives)
            out["_drop"].append(code)
            out["_hashes"].append([text_hash(t) for t in (query, positive, *negatives)] if not code else [])
            same = not code and query == format_with_instruction(self.instruction, positive, self.template)
            out["_same"].append(same)
            if self.score_spec is not None:
                out["label"].append(scores)
        return out

    def _row(self, batch: dict, r: int, i: int):
        texts, reason = {}, None
        for role, specs in self.readers.items():
            parts = [s.text(batch[s.steps[0]][r], i) for s in specs]
            if any(p is _MISSING for p in parts):
                reason = reason or f"{role} missing"
                continue
            texts[role] = " ".join(parts)
            if not texts[role].strip():
                reason = reason or f"{role} empty"
        row_negs: list[str] = []
        for s in self.negs:
            got, _ = s.texts(batch[s.steps[0]][r], i)
            row_negs += got
        if reason:
            return None, None, [], None, 1 + _REASONS.index(reason)
        scores = None
        if self.score_spec is not None:
            s = self.score_spec
            scores = _row_scores(self.card, s, batch[s.steps[0]][r], i, len(row_negs))
        keep = [j for j, n in enumerate(row_negs) if n.strip()]
        if scores is not None:  # each negative keeps its own score
            scores = [scores[0]] + [scores[1 + j] for j in keep]
        query = format_with_instruction(self.instruction, texts["query"], self.template)
        return query, texts["positive"], [row_negs[j] for j in keep], scores, 0


def text_hash(text: str) -> int:
    """A text's signed 64-bit xxh3 hash (the duplicate checks compare these; equal hashes are confirmed on the
    texts themselves)."""
    h = xxhash.xxh3_64_intdigest(text.encode("utf8"))
    return h - (1 << 64) if h >= 1 << 63 else h


_MAP_BATCH = 1000  # rows per batch of both passes: Python holds one batch of texts at a time


def _map_rows(rows, reader: _RowReader, workdir: Path | None):
    """The first pass (see :class:`_RowReader`)."""
    import uuid

    fingerprint = uuid.uuid4().hex  # the reader (card, specs) is not hashable by datasets; never reused
    where = (
        {"cache_file_name": str(workdir / "read.arrow")} if workdir is not None else {"keep_in_memory": True}
    )
    return rows.map(
        reader,
        batched=True,
        batch_size=_MAP_BATCH,
        with_indices=True,
        remove_columns=rows.column_names,
        features=reader.features(),
        load_from_cache_file=False,
        new_fingerprint=fingerprint,
        desc=f"reading {reader.card.name}",
        **where,
    )


def _keep_rows(read, k: int, scores: bool, workdir: Path | None):
    """The second pass, in Arrow: the kept rows with k negatives, as ``query, positive, negative_1..k[, label]``;
    with ``workdir``, the texts' hashes of those rows are written beside them (``text_hashes.npy``)."""
    import uuid

    import datasets

    text = datasets.Value("string")
    feats = {"query": text, "positive": text} | {f"negative_{j + 1}": text for j in range(k)}
    if scores:
        feats["label"] = datasets.List(datasets.Value("float64"))
    feats |= {"_hashes": datasets.List(datasets.Value("int64")), "_same": datasets.Value("bool")}
    where = {"cache_file_name": str(workdir / PAIRS)} if workdir is not None else {"keep_in_memory": True}
    kept = read.with_format("arrow").map(
        _KeepRows(k, scores),
        batched=True,
        batch_size=_MAP_BATCH * 10,
        remove_columns=read.column_names,
        features=datasets.Features(feats),
        load_from_cache_file=False,
        new_fingerprint=uuid.uuid4().hex,
        desc="keeping rows",
        **where,
    )
    return kept.with_format(None)


PAIRS = "pairs.arrow"  # a card's cached pairs (see neoembed.data.card_cache)
REPEATS = "text_repeats.json"  # beside them: whether a text repeats (no_duplicates: auto)
HASHES = "text_hashes.npy"  # beside a card's pairs: (rows, 2 + k) int64, the hashes of each row's texts


class _KeepRows:
    """The second pass's batch function (Arrow table in, Arrow table out): rows read without a drop reason and
    with at least k negatives, their first k negatives as columns, their scores and hashes cut to match."""

    def __init__(self, k: int, scores: bool):
        self.k, self.scores = k, scores

    def __call__(self, table):
        import pyarrow as pa
        import pyarrow.compute as pc

        enough = pc.greater_equal(pc.list_value_length(table["negatives"]), self.k)
        t = table.filter(pc.and_(pc.equal(table["_drop"], 0), enough))
        out = {"query": t["query"], "positive": t["positive"]}
        for j in range(self.k):
            out[f"negative_{j + 1}"] = pc.list_element(t["negatives"], j)
        if self.scores:
            out["label"] = pc.list_slice(t["label"], 0, 1 + self.k)
        out["_hashes"] = pc.list_slice(t["_hashes"], 0, 2 + self.k)
        out["_same"] = t["_same"]
        return pa.table(out)


def _write_hashes(kept, width: int, path: Path | None):
    """The ``_hashes`` column as a (rows, width) int64 array, filled chunk by chunk: in memory, or in ``path``."""
    import numpy as np
    import pyarrow.compute as pc

    shape = (len(kept), width)
    out = np.lib.format.open_memmap(path, "w+", np.int64, shape) if path else np.empty(shape, np.int64)
    start = 0
    for chunk in kept.data.column("_hashes").chunks:
        values = pc.list_flatten(chunk).to_numpy(zero_copy_only=False).reshape(-1, width)
        out[start : start + len(values)] = values
        start += len(values)
    return out


def _row_scores(card: DataCard, spec: _Spec, v, i: int, n_negatives: int) -> list[float]:
    """Row ``i``'s teacher scores (``v``: its scores column's value): one number for the positive and one per
    negative, else an error."""
    value = spec.read_value(v, i)
    ok = isinstance(value, list) and all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in value
    )
    if not ok or len(value) != 1 + n_negatives:
        got = "nothing" if value is _MISSING else repr(value)[:80]
        raise DataCardError(
            f"card {card.name}: row {i} has {got} in its scores column {spec.spec!r}, not {1 + n_negatives} "
            f"numbers (the positive's score, then one per hard negative): fix the row, or write the scores "
            f"again with `neoembed score {card.name} --teacher MODEL`"
        )
    scores = [float(x) for x in value]
    if bad := [j for j, x in enumerate(scores) if not math.isfinite(x)]:
        # a NaN target makes every loss of its batch NaN: the run would stop with a hint about the learning rate
        raise NonFiniteScore(
            f"card {card.name}: row {i} has a non-finite teacher score ({scores[bad[0]]}, item {bad[0]} of "
            f"{value!r:.80}) in its scores column {spec.spec!r}: fix or delete the row, or write the scores again "
            f"with `neoembed score {card.name} --teacher MODEL`",
            spec,
        )
    return scores


class NonFiniteScore(DataCardError):
    """A NaN or infinite teacher score; ``spec``: the card's scores column (to find the file's line)."""

    def __init__(self, message: str, spec: _Spec | None = None):
        super().__init__(message)
        self.spec = spec


def _locate_non_finite(files: list[Path], spec: _Spec) -> str | None:
    """``FILE, line N`` of the first JSON line whose ``spec`` value holds a NaN or infinite number (Python's json
    reads NaN and Infinity, as pyarrow's reader does), or None. The value is read as the card reads it."""
    import gzip

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


def _negatives_per_query(counts, cap: int | None) -> int:
    """The count most rows carry (ties: the larger), capped by ``cap`` (``counts``: an integer numpy array)."""
    import numpy as np

    if len(counts) == 0:
        return 0
    tally = np.bincount(np.minimum(counts, cap) if cap is not None else counts)
    return int(len(tally) - 1 - np.argmax(tally[::-1]))  # the last of the most frequent: the larger count


def _check_hits(card: DataCard, specs: list[_Spec], rows) -> None:
    for s in specs:
        if s.hits == 0 and len(rows) > 0:
            first = rows[0]
            raise DataCardError(
                f"card {card.name}: {s.role} spec {s.spec!r} matched nothing in any of the {len(rows)} rows "
                f"(row 0: {_shape(first)}); fix the path in the card's columns"
            )


def _shape(v, depth: int = 0):
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_shape(x, depth + 1)}" for k, x in list(v.items())[:8]) + "}"
    if isinstance(v, list):
        return f"list[{len(v)}]" + (f" of {_shape(v[0], depth + 1)}" if v and depth < 2 else "")
    return type(v).__name__


def _check_loss(card: DataCard, report: DropReport, max_negatives: int | None, warn: bool = True) -> None:
    if report.rows_kept == 0:
        raise DataCardError(f"card {card.name}: no usable rows ({report.line()})")
    if card.expected_loss == UNKNOWN:
        if warn and (hint := report.pin_hint()):
            logger.warning(hint)
        return
    if report.loss <= _allowed_loss(card.expected_loss, report.rows_read, report.sampled):
        return
    k = report.negatives_per_query
    neg_hint = ""
    if any(r.startswith("fewer than") for r in report.dropped):
        fewer = f"max_negatives: {k - 1} or 0" if k > 1 else "max_negatives: 0"
        neg_hint = f"; {fewer} for this dataset in the recipe keeps the rows with fewer hard negatives"
    raise DataCardError(
        f"card {card.name}: {report.line()}. That is more than the card's expected_loss "
        f"({card.expected_loss}): check the card's column paths against the data, or, if the dataset really "
        f"lacks these values, set expected_loss to at least {_round_up(report.loss)} in the card with its evidence "
        f"(or `unknown` where the evidence publishes no share){neg_hint}"
    )


def _allowed_loss(expected: float, n: int, sampled: bool) -> float:
    """The share of rows a card may lose: its expected_loss; on a random sample (max_rows), three standard
    deviations more, since a sample of n rows loses a little more or less than the whole dataset by chance."""
    tolerance = 3 * (expected * (1 - expected) / max(n, 1)) ** 0.5 if sampled else 0.0
    return expected + tolerance + 1e-9


def prepare_card(
    card: DataCard,
    folder: Path,
    max_rows: int | None = None,
    max_negatives: int | None = None,
    template: str = DEFAULT_TEMPLATE,
    with_instruction: bool = True,
    seed: int = 0,
    warn: bool = True,
):
    """Load a card's rows and build its pairs: ``(Dataset, DropReport)``; the report's ``full_size`` is the
    dataset's full row count (pi_i), its ``dropped`` every row lost on the way, per reason (``warn``: see
    :func:`build_pairs_report`). A local card's result is kept on disk (:mod:`neoembed.data.card_cache`): the
    next run with the same card, files and settings memory-maps it instead of reading the data again."""
    from neoembed.data import card_cache

    settings = [max_rows, max_negatives, template, with_instruction, seed]
    root = card_cache.cache_root()
    if root is None or card.source.local is None:  # hub data: the datasets cache keeps its Arrow files
        return _prepare(card, folder, settings, warn, None)
    files = card_cache.data_files((folder / card.source.local.path).resolve())
    if not files:  # the loader's own error names the fix
        return _prepare(card, folder, settings, warn, None)
    key = card_cache.entry_key(card.model_dump_json(), files, settings)
    with card_cache.locked_entry(root, key) as entry:
        if (hit := card_cache.read_entry(entry, PAIRS)) is None:
            with card_cache.building(entry) as work:  # removed if the build fails
                _, report = _prepare(card, folder, settings, warn, work)
                card_cache.seal_entry(work, entry, asdict(report), [PAIRS, HASHES, REPEATS])
            logger.info("card %s: prepared pairs kept in %s", card.name, entry)
            hit = card_cache.read_entry(entry, PAIRS)
        else:
            _check_loss(card, DropReport(**hit[1]), max_negatives, warn)  # the same warning as the first run
            logger.debug("card %s: prepared pairs read back from %s", card.name, entry)
    pairs, report = hit
    return pairs, DropReport(**report)


def _prepare(card: DataCard, folder: Path, settings: list, warn: bool, workdir: Path | None):
    max_rows, max_negatives, template, with_instruction, seed = settings
    loaded = load_card_rows(card, folder, max_rows, seed)
    if len(loaded.rows) == 0 and not loaded.dropped:
        raise DataCardError(f"card {card.name}: the dataset is empty")
    return build_pairs_report(
        card,
        loaded.rows,
        max_negatives,
        template,
        with_instruction,
        loaded=loaded,
        warn=warn,
        workdir=workdir,
    )


# ---------------------------------------------------------------------------- unreadable local data files
def explain_unreadable(path: Path, error: BaseException) -> str:
    """Why a JSON-lines data file (plain or .gz) cannot be read, by file and line: its first line that is not
    UTF-8 or not JSON; else the loader's own error. (The datasets library names neither.)"""
    import gzip

    path = Path(path)
    if path.is_file():
        opener = gzip.open if path.suffix == ".gz" else open
        try:
            with opener(path, "rb") as f:
                if not any(raw.strip() for raw in f):
                    return f"{path}: holds no rows (empty, or blank lines only): fill it or remove it from the card"
                f.seek(0)
                for number, raw in enumerate(f, 1):
                    try:
                        line = raw.decode("utf-8").strip()
                    except UnicodeDecodeError as e:
                        return (
                            f"{path}, line {number}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}): "
                            "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                        )
                    if line:
                        try:
                            json.loads(line)
                        except ValueError as e:
                            return f"{path}, line {number}: not a JSON object ({e}): fix or delete that line"
        except (OSError, EOFError) as e:
            return f"{path}: cannot be read ({e}); is it a complete .gz file?"
    return f"{path}: cannot be read as data: {type(error).__name__}: {error}"


@contextlib.contextmanager
def explain_data_errors(card, folder: Path):
    """Around the reading of a card's local data (loading and iterating its rows): the datasets library's own
    errors (JSON, Arrow, a decode error met while iterating) become a
    :class:`~neoembed.data.cards.DataCardError` (exit 2) that names the file, the line and the fix."""
    try:
        yield
    except NonFiniteScore as e:
        if card.source.local is None:
            raise
        local = Path(folder) / card.source.local.path
        local = local.resolve()
        files = sorted(p for p in local.glob("*") if p.is_file()) if local.is_dir() else [local]
        if e.spec and (where := _locate_non_finite(files, e.spec)):
            raise NonFiniteScore(f"{e} (the first such value: {where})", e.spec) from None
        if len(files) == 1:
            raise NonFiniteScore(f"{e} (file {files[0]})", e.spec) from None
        raise
    except DataCardError:
        raise
    except Exception as e:
        if card.source.local is None:
            raise
        local = Path(folder) / card.source.local.path
        files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
        reasons = [explain_unreadable(p, e) for p in files]
        named = [r for r in reasons if ", line " in r] or reasons[:1]
        raise DataCardError(f"card {card.name}: {named[0]}") from None
