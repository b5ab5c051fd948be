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
import hashlib
import json
import logging
import operator
import random
import re
import shlex
import warnings
from dataclasses import asdict
from pathlib import Path

import yaml
from pydantic import ValidationError

from neoembed.card_schema import CardSchemaError, TrainingCard, parse_spec
from neoembed.config import load_yaml
from neoembed.data.columns import _locate_non_finite
from neoembed.data.errors import (
    DataCardError,
    HubUnreachable,
    NonFiniteScore,
    explain_unreadable,
    hub_error,
    hub_offline_mode,
    is_unreachable,
)
from neoembed.data.pairs import (
    HASHES,
    PAIRS,
    REPEATS,
    UNKNOWN,
    DropReport,
    LoadedRows,
    _check_loss,
    build_pairs,
    build_pairs_report,
    hashed_repeats,
    text_hash,
)
from neoembed.data.starter import DATA_SUFFIXES
from neoembed.instructions import DEFAULT_TEMPLATE
from neoembed.recipe import RecipeError, format_validation_error, resolve_named_file

__all__ = [
    "HASHES",
    "PAIRS",
    "REPEATS",
    "UNKNOWN",
    "DataCard",
    "DataCardError",
    "DropReport",
    "HubUnreachable",
    "hashed_repeats",
    "hub_error",
    "is_unreachable",
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
    "local_files_cache_dir",
    "check_instruction_overrides",
    "load_recipe_cards",
    "load_rows",
    "text_hash",
]

DataCard = TrainingCard  # the training card's schema lives in neoembed.card_schema (shared with other cards)

logger = logging.getLogger(__name__)

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
        raw = load_yaml(path.read_text(encoding="utf8")) or {}
    except yaml.YAMLError as e:
        raise DataCardError(f"{path} is not valid YAML: {e}") from e
    except UnicodeDecodeError as e:
        raise DataCardError(
            f"{path} is not a data card: not UTF-8 text ({e}); give the card's .yaml file"
        ) from None
    try:
        card = DataCard.model_validate(raw)
    except ValidationError as e:
        raise DataCardError(format_validation_error(e, DataCard, str(path)) + _dataset_card_hint(raw, path)) from None
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


def _dataset_card_hint(raw, path: Path) -> str:
    """A folder's own ``card.yaml`` (a dataset card: what the data is, its splits and licence) read as a data card
    fails on every key: say what it is and how to get a data card for its rows."""
    if not isinstance(raw, dict) or "columns" in raw or not {"task_type", "splits", "format"} & set(raw):
        return ""
    data = sorted(p.name for p in path.parent.iterdir() if p.name.lower().endswith(DATA_SUFFIXES))
    example = f"neoembed init {shlex.quote(str(path.parent / data[0]))} --out DIR" if data else "neoembed init"
    return (
        f"\n{path} describes a data folder (a dataset card: task_type, splits, format), not a data card, which says "
        f"where the rows are and which column is which. `{example}` writes a data card for a file of rows "
        "(docs/own-data.md)"
    )


def check_instruction_overrides(overrides: dict, cards: list[DataCard]) -> None:
    """A recipe's ``instruction_overrides`` may name only the cards it trains on (a typo would leave the card's own
    instruction in place without a word)."""
    names = [card.name for card in cards]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise DataCardError(
            f"instruction_overrides names card(s) {unknown} that the recipe does not train on; valid: {names}"
        )


def load_recipe_cards(
    entries, search_dirs: list[str | Path], scored: bool = False
) -> list[tuple[DataCard, Path]]:
    """Every dataset entry's card (the cards only: cheap), each card at most once: one named twice would be
    sampled as if it had twice its rows; with ``scored`` (distillation), each declaring teacher scores. The
    trainers and the dry run read the recipe's cards through this."""
    paths = [find_card(entry.card, search_dirs) for entry in entries]
    loaded = [load_card(path) for path in paths]
    names = [card.name for card, _ in loaded]
    for name in sorted({n for n in names if names.count(n) > 1}):
        _refuse_twice(name, [path for path, n in zip(paths, names, strict=True) if n == name])
    unscored = [card.name for card, _ in loaded if scored and not card.columns.scores]
    if unscored:
        raise DataCardError(
            f"distillation learns from each row's teacher scores, and card(s) {unscored} declare none: declare "
            "the card's score column (columns.scores), or add one with `neoembed score CARD --teacher MODEL`"
        )
    return loaded


def _refuse_twice(name: str, paths: list[Path]) -> None:
    """A card name given by two entries of a recipe: one card named twice, or two files with one ``name:`` (a
    copied card keeps its original's name), said with the files and the fix."""
    files = list(dict.fromkeys(p.resolve() for p in paths))
    if len(files) == 1:
        raise DataCardError(f"dataset {name!r} appears twice in the recipe (card {files[0]}): list it once")
    renamed = [f for f in files if f.stem != name] or files[1:]  # the copies: a file named as its card is not
    listed = ", ".join(map(str, files[:-1])) + f" and {files[-1]} " + ("both" if len(files) == 2 else "all")
    raise DataCardError(
        f"dataset {name!r} appears twice in the recipe: the card files {listed} say name: {name} (a copied "
        "card keeps its original's name). Cards are told apart by name: change name: in the copy ("
        + "; ".join(f"name: {f.stem} in {f.name}" for f in renamed)
        + ")"
    )


def local_data_paths(cards: list[tuple[DataCard, Path]]) -> list[Path]:
    """The local data (a file or a folder) of each card that has some."""
    return [(folder / c.source.local.path).resolve() for c, folder in cards if c.source.local is not None]


#: the card fields that decide which rows train and how (a licence or a note may change on resume)
ROW_FIELDS = {"source", "columns", "filter", "labels", "instruction", "size"}


def card_fingerprints(cards: list[tuple[DataCard, Path]]) -> dict[str, str]:
    """``data.<card>``: a hash of each card's :data:`ROW_FIELDS` and of its local data's bytes. The trainers add
    these to the settings compared on resume, so a run does not continue on changed data without a word (a hub
    card's data is pinned by the revision in its source)."""
    from neoembed.record import file_sha256

    found = {}
    for card, folder in cards:
        fields = card.model_dump(mode="json", include=ROW_FIELDS)
        h = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
        if card.source.local is not None:
            path = (folder / card.source.local.path).resolve()
            for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
                if f.is_file():
                    h.update(f"{f.relative_to(path) if f != path else f.name}:{file_sha256(f)}".encode())
        found[f"data.{card.name}"] = h.hexdigest()[:16]
    return found


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
        # a relative card_dirs entry is read from the working folder, which a user may have left
        searched = ", ".join(str(Path(d).absolute()) for d in search_dirs)
        also = f" (also searched: {searched})" if search_dirs else ""
        raise DataCardError(str(e) + also) from None


# ------------------------------------------------------------------------------------------------ loading
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
        ds = _read_local(local.format, files)
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
    one_file = local is not None and len(files) == 1 and local.format in ("json", "csv") and not card.filter
    return LoadedRows(ds, full, lines=(Path(files[0]), local.format) if one_file else None)


def _read_local(fmt: str, files: list[str]):
    """A local source's files as one ``datasets.Dataset``. A CSV's first row with more fields than its header
    (an unquoted comma) would be read by pandas as an index followed by the row shifted one column; with
    ``index_col=False`` pandas warns instead, and that warning is an error here, which
    :func:`explain_data_errors` names by its line. (A later row so wide is an error of pandas' own.)"""
    import datasets

    cache = local_files_cache_dir(files)
    if fmt != "csv":
        return datasets.load_dataset(fmt, data_files=files, split="train", cache_dir=cache)
    from pandas.errors import ParserWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", ParserWarning)
        return datasets.load_dataset("csv", data_files=files, split="train", index_col=False, cache_dir=cache)


def local_files_cache_dir(files: list[str]) -> str:
    """A datasets cache folder for these files as they are now: datasets keys a local file by its path and
    modification time alone, so a file edited without a new time (``cp -p``, ``rsync -a``, ``tar x`` of another
    version) was read back as it was. Keyed by :func:`neoembed.record.file_stamp` (small files by content)."""
    import datasets.config

    from neoembed.record import file_stamp

    stamps = [(str(Path(f).resolve()), file_stamp(f)) for f in files]
    key = hashlib.sha256(json.dumps(stamps, sort_keys=True).encode()).hexdigest()[:16]
    return str(Path(datasets.config.HF_DATASETS_CACHE) / "neoembed-local" / key)


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

    def number(x):
        try:
            return float(x)
        except (TypeError, ValueError):
            raise DataCardError(
                f"card {card.name}: a row has {x!r:.60} in column {col!r}, which the card's filter {card.filter!r} "
                "compares as a number: fix that row, or change the filter"
            ) from None

    # batched, one column: Python sees a block of that column's values at a time, not every row as a dict
    keep = lambda values: [x is not None and fn(number(x), v) for x in values]  # noqa: E731
    kept = ds.filter(keep, batched=True, batch_size=10_000, input_columns=[col])
    if len(ds) and not len(kept):  # else reported as "the dataset is empty", which the file is not
        raise DataCardError(
            f"card {card.name}: its filter {card.filter!r} keeps none of its {len(ds)} rows: loosen the filter"
        )
    return kept


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


@contextlib.contextmanager
def explain_data_errors(card, folder: Path):
    """Around the reading of a card's local data (loading and iterating its rows): the datasets library's own
    errors (JSON, Arrow, a decode error met while iterating) become a
    :class:`~neoembed.data.cards.DataCardError` (exit 2) that names the file, the line and the fix, read
    as the card's format says. The readers' own error log lines (pyarrow's message, before the error it
    raises) are kept off the console: the error raised here says it better."""
    logs = [logging.getLogger(f"datasets.packaged_modules.{m}.{m}") for m in ("json", "csv", "parquet")]
    levels = [log.level for log in logs]
    if card.source.local is not None:
        for log in logs:
            log.setLevel(logging.CRITICAL)
    try:
        yield
    except NonFiniteScore as e:
        if card.source.local is None or e.placed:
            raise
        local = Path(folder) / card.source.local.path
        local = local.resolve()
        files = sorted(p for p in local.glob("*") if p.is_file()) if local.is_dir() else [local]
        if e.spec and (where := _locate_non_finite(files, e.spec)):
            e.place_at(f"row {e.row + 1} (the first such value: {where})")
        elif len(files) == 1:
            e.place_at(f"row {e.row + 1} (file {files[0]})")
        raise
    except DataCardError:
        raise
    except Exception as e:
        if card.source.local is None:
            raise
        local = Path(folder) / card.source.local.path
        files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
        reasons = [explain_unreadable(p, e, card.source.local.format) for p in files]
        named = [r for r in reasons if ", line " in r] or reasons[:1]
        raise DataCardError(f"card {card.name}: {named[0]}") from None
    finally:
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)
