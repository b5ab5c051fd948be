"""A card's rows made pairs: query (with the card's instruction), positive and k hard negatives, every dropped row
counted per reason (:class:`DropReport`), the texts' hashes kept beside the pairs (the duplicate-free sampler
reads them), all in batched maps written to Arrow, so Python holds one batch of texts at a time."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from neoembed.card_schema import TrainingCard as DataCard
from neoembed.data.columns import _MISSING, _Spec
from neoembed.data.errors import DataCardError, NonFiniteScore, RowError, row_lines
from neoembed.instructions import DEFAULT_TEMPLATE, format_with_instruction

UNKNOWN = "unknown"  # expected_loss of a card whose evidence publishes no share of dropped rows

logger = logging.getLogger("neoembed.data.cards")  # a card's warnings keep the one logger name users filter on


@dataclass
class LoadedRows:
    """A card's rows: ``rows`` (at most max_rows, a seeded random sample), ``full_size`` (rows of the whole
    dataset after the card's filter: what pi_i is computed from), and rows lost while loading (qrels joins)."""

    rows: object  # datasets.Dataset
    full_size: int
    dropped: dict[str, int] = field(default_factory=dict)
    sampled: bool = False
    # (file, format) when the rows are that JSON-lines or CSV file's rows one for one (no filter, no sample):
    # a dropped row is then named by its line
    lines: tuple[Path, str] | None = None


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
    # reason -> the first row it drops, counted from 1: a "line" of the data file, or a "row" (first_unit)
    first_dropped: dict[str, int] = field(default_factory=dict)
    first_unit: str = "row"
    # when rows have fewer than k hard negatives: [N] = the rows that max_negatives: N would keep, N below k
    kept_below_k: list[int] = field(default_factory=list)

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
            f"card {self.card}: expected_loss: unknown, so the run goes on having dropped {n:,} of {where} "
            f"({_percent(self.loss)}); pin the share with expected_loss: {_round_up(self.loss)} in the card "
            "(its notes citing `neoembed data check`)"
            + (f", or keep the rows: {hint}" if (hint := self.negatives_hint()) else "")
        )

    def negatives_hint(self) -> str | None:
        """For rows dropped with fewer than k hard negatives: what each smaller ``max_negatives`` keeps."""
        if not self.kept_below_k:
            return None
        every = self.kept_below_k[0]
        if self.negatives_per_query == 1:
            return (
                f"max_negatives: 0 in the recipe (datasets: [{{card: {self.card}, max_negatives: 0}}]) keeps every "
                f"row ({every:,}), with in-batch negatives only"
            )
        smaller = [f"N={n} keeps {kept:,}" for n, kept in reversed(list(enumerate(self.kept_below_k))) if n]
        return (
            f"max_negatives: N in the recipe (datasets: [{{card: {self.card}, max_negatives: N}}]) keeps the rows "
            f"with at least N hard negatives: {', '.join(smaller)}, N=0 every row ({every:,}), with in-batch "
            "negatives only"
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
        drops = ", ".join(
            f"{k}: {v}"
            + (f" (first: {self.first_unit} {self.first_dropped[k]})" if k in self.first_dropped else "")
            for k, v in self.dropped.items()
            if v
        ) or "none"
        if self.expected_loss == UNKNOWN:
            share = f"measured {_percent(self.loss)}, expected: unknown"
        else:
            share = f"{_percent(self.loss)} vs {_percent(self.expected_loss)} expected"
        return (
            f"{self.rows_kept} of {self.rows_read} rows kept (dropped: {drops}; {share}); "
            f"{self.negatives_per_query} hard negative{'s' if self.negatives_per_query != 1 else ''} per query"
        )


def _percent(share: float) -> str:
    """A share as a percentage, two decimals; a share that would show as 0.00% but is not 0 to two significant
    digits (37 rows of 1.2 million: 0.0031%), so a report never calls a drop it refuses 0.00%."""
    p = 100 * share
    return f"{p:.2g}%" if 0 < abs(p) < 0.005 else f"{p:.2f}%"


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
    read = _map_rows(rows, reader, workdir, loaded)
    _check_hits(card, reader.hit_specs, rows)
    drop = read.data.column("_drop").to_numpy()
    for code in sorted(set(_codes(drop)), key=lambda c: int((drop == c).argmax())):  # first row first
        reason = _REASONS[code - 1]
        report.dropped[reason] = report.dropped.get(reason, 0) + int((drop == code).sum())
        report.first_dropped[reason] = int((drop == code).argmax())
    counts = _negative_counts(read)[drop == 0]
    k = _negatives_per_query(counts, max_negatives) if reader.negs else 0
    short = int((counts < k).sum())
    if short:
        report.dropped[f"fewer than {k} hard negatives"] = short
        report.first_dropped[f"fewer than {k} hard negatives"] = int((drop == 0).nonzero()[0][(counts < k).argmax()])
        report.kept_below_k = [int((counts >= _negatives_per_query(counts, n)).sum()) for n in range(k)]
    _number_first_dropped(report, loaded)
    report.rows_kept, report.negatives_per_query = int(len(counts) - short), k
    _check_loss(card, report, max_negatives, warn)
    pairs = _keep_rows(read, k, reader.score_spec is not None, workdir)
    report.same_as_query, report.distinct_pairs = _pair_counts(pairs, workdir)
    # the hidden columns stay in the file, out of the dataset: the trainer reads every column it has
    return pairs.remove_columns(["_same", "_hashes"]), report


def _number_first_dropped(report: DropReport, loaded: LoadedRows | None) -> None:
    """The first row each reason drops, as a user finds it: the data file's line where the rows are a file's
    rows one for one, else the row counted from 1 (the index counts from 0)."""
    firsts = report.first_dropped
    lines = row_lines(*loaded.lines, list(firsts.values())) if loaded is not None and loaded.lines else None
    if lines is not None:
        report.first_dropped, report.first_unit = {k: lines[i] for k, i in firsts.items()}, "line"
    else:
        report.first_dropped = {k: i + 1 for k, i in firsts.items()}


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


def _map_rows(rows, reader: _RowReader, workdir: Path | None, loaded: LoadedRows | None):
    """The first pass (see :class:`_RowReader`); a row that does not match its card is named by its file line
    where the rows are a file's rows one for one."""
    import uuid

    fingerprint = uuid.uuid4().hex  # the reader (card, specs) is not hashable by datasets; never reused
    where = (
        {"cache_file_name": str(workdir / "read.arrow")} if workdir is not None else {"keep_in_memory": True}
    )
    try:
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
    except RowError as e:
        lines = row_lines(*loaded.lines, [e.row]) if loaded is not None and loaded.lines else None
        if lines:
            e.place_at(f"{loaded.lines[0]}, line {lines[e.row]}")
        raise


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
        raise RowError(
            f"card {card.name}: ",
            i,
            f" has {got} in its scores column {spec.spec!r}, not {1 + n_negatives} numbers (the positive's "
            f"score, then one per hard negative): fix the row, or write the scores again with "
            f"`neoembed score {card.name} --teacher MODEL`",
        )
    scores = [float(x) for x in value]
    if bad := [j for j, x in enumerate(scores) if not math.isfinite(x)]:
        # a NaN target makes every loss of its batch NaN: the run would stop with a hint about the learning rate
        raise NonFiniteScore(
            f"card {card.name}: ",
            i,
            f" has a non-finite teacher score ({scores[bad[0]]}, item {bad[0]} of {value!r:.80}) in its scores "
            f"column {spec.spec!r}: fix or delete the row, or write the scores again with "
            f"`neoembed score {card.name} --teacher MODEL`",
            spec,
        )
    return scores


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
    neg_hint = f"; {hint}" if (hint := report.negatives_hint()) else ""
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
