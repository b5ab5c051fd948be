"""``neoembed init DATA``: a commented starter data card and training recipe for a file of your own pairs or
triplets (JSON lines, optionally gzipped, a JSON array of objects, CSV or Parquet), with the columns recognised
from their names.

The card says where the rows are and which column is the query, the positive and the hard negatives; the recipe
trains a sentence-transformers model on it with the unified contrastive recipe. Both are plain YAML meant to be
edited; ``neoembed data check CARD`` and ``neoembed train RECIPE --dry-run`` check them before anything trains.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from neoembed.data.errors import tab_separated, wide_csv_row

__all__ = ["Starter", "guess_columns", "write_starter"]

QUERY_NAMES = ("query", "anchor", "question", "q", "sentence1", "text1", "premise", "title")
POSITIVE_NAMES = ("positive", "pos", "document", "doc", "passage", "answer", "response", "sentence2", "text2")
NEGATIVE_PATTERN = re.compile(r"^(hard_)?neg(ative)?(_?\d+)?s?$", re.IGNORECASE)
DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


@dataclass
class Starter:
    card: Path
    recipe: Path
    rows: int
    columns: dict
    name: str = ""  # the card's name: the run folder is runs/<name>
    holdout: int = 0  # rows the recipe holds out of training (eval.holdout)


FORMATS = {
    "json": (".jsonl", ".json", ".jsonl.gz", ".json.gz"),
    "csv": (".csv", ".csv.gz"),
    "parquet": (".parquet",),
}
DATA_SUFFIXES = tuple(s for suffixes in FORMATS.values() for s in suffixes)  # the files init reads


def _format(path: Path) -> str:
    name = path.name.lower()
    for fmt, suffixes in FORMATS.items():
        if name.endswith(suffixes):
            return fmt
    raise ValueError(f"{path}: neoembed init reads .jsonl, .jsonl.gz, .json, .csv or .parquet files")


MIN_ROWS = 2  # a query's in-batch negatives are the other rows' positives: one row has nothing to contrast


def _lines(path: Path):
    """The file's lines as text; a byte that is not UTF-8 is an error naming the file, the line and the column
    (Python's own error names only an offset into a read buffer). A byte-order mark (Excel's UTF-8 CSV) goes."""
    with gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                yield raw.decode("utf-8-sig" if number == 1 else "utf8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}, line {number}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}): "
                    "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None


def _read(path: Path) -> tuple[list[str], int]:
    """(column names of the first row, number of rows)."""
    fmt = _format(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        return list(meta.schema.names), meta.num_rows
    if fmt == "csv":
        return _read_csv(path)
    lines = ((n, line) for n, line in enumerate(_lines(path), 1) if line.strip())
    number, first = next(lines, (0, ""))
    if not number:
        raise ValueError(f"{path} holds no rows")
    if first.lstrip().startswith("["):  # a JSON array of objects, which the card's json loader reads too
        return _read_array(path, first + "".join(line for _, line in lines))
    names, rows = list(_json_object(path, number, first)), 1
    # every line parsed, one at a time: a broken one is named here, not first by `data check`
    for number, line in lines:
        _json_object(path, number, line)
        rows += 1
    return names, rows


def _read_csv(path: Path) -> tuple[list[str], int]:
    """(column names, rows) of a CSV file; a quote left open is named by the line it opens on (read leniently,
    it would swallow every later row into one field), and so is a row with more fields than the header (an
    unquoted comma: the card's loader refuses it, and would read it shifted as the first row)."""
    reader = csv.DictReader(_lines(path), strict=True)
    rows, end = 0, 1
    try:
        if tabs := tab_separated(path, reader.fieldnames):
            raise ValueError(tabs)
        for row in reader:
            rows, end = rows + 1, reader.line_num
            if None in row:  # DictReader files the fields past the header's under the key None
                header = len(reader.fieldnames)
                raise ValueError(f"{path}, line {end}: {wide_csv_row(header + len(row[None]), header)}")
    except csv.Error as e:
        raise ValueError(
            f'{path}, line {end + 1}: {e} (a quoted field opened there is not closed: an unmatched "): close or '
            "remove the quote"
        ) from None
    return list(reader.fieldnames or []), rows


def _json_object(path: Path, number: int, line: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: line {number} is not a JSON object ({e}); write one object per line, or one JSON array of "
            "objects"
        ) from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}: line {number} is not a JSON object; write one object per line")
    return row


def _read_array(path: Path, text: str) -> tuple[list[str], int]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {e.lineno}, column {e.colno}: not valid JSON ({e.msg})") from None
    if not rows:
        raise ValueError(f"{path} holds an empty JSON array: no rows")
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise ValueError(
            f"{path}: item {bad} of the JSON array is a {type(rows[bad]).__name__}, not an object"
        )
    return list(rows[0]), len(rows)


def guess_columns(names: list[str]) -> dict:
    """{query, positive, negatives} from column names (the first of each known name, in the file's order)."""

    def first(candidates):
        lower = {n.lower(): n for n in names}
        return next((lower[c] for c in candidates if c in lower), None)

    query, positive = first(QUERY_NAMES), first(POSITIVE_NAMES)
    if query is None or positive is None:
        raise ValueError(
            f"cannot tell the query and positive columns from {names}: name them e.g. 'query' and 'positive' "
            f"(recognised: {', '.join(QUERY_NAMES)} / {', '.join(POSITIVE_NAMES)}), or write the card by hand "
            "(docs/training.md, \"Data cards\": its columns map any names)"
        )
    negatives = [n for n in names if NEGATIVE_PATTERN.match(n) and n not in (query, positive)]
    return {"query": query, "positive": positive, "negatives": negatives}


def _commented(lines: list[tuple[str, str]], width: int = 40) -> str:
    """YAML lines with their comments in one column (a comment-only line where the text is empty)."""
    out = [f"# {c}" if not t else f"{t.ljust(width)}  # {c}" if c else t for t, c in lines]
    return "\n".join(out) + "\n"


def _card_text(name: str, data: str, fmt: str, columns: dict, rows: int, card_path: str) -> str:
    negatives = ", ".join(columns["negatives"])
    return _commented([
        ("", f"Data card written by `neoembed init` for {Path(data).name}: where the rows are and what each column is."),
        ("", f"Check it from the folder you ran `neoembed init` in: neoembed data check {shlex.quote(card_path)}"),
        ("", 'Each key is explained beside it; more about cards (filters, hub sources): "Data cards" in docs/training.md.'),
        (f"name: {name}", f"how a recipe names this card: datasets: [{{card: {name}}}]"),
        ("source:", ""),
        (f"  local: {{path: {data}, format: {fmt}}}", "relative to this card's folder"),
        ("columns:", ""),
        (f"  query: {columns['query']}", "the column of queries"),
        (f"  positive: {columns['positive']}", "the column of each query's positive"),
        (f"  negatives: [{negatives}]", "hard-negative columns; [] for pairs (in-batch negatives only)"),
        ("", "Put before every query in training, and saved as the trained model's query prompt. Say what a query looks for."),
        ("instruction: Given a query, retrieve the passage that answers it.", ""),
        ("license: unknown", "your data's licence: it is written on the model card"),
        (f"size: {rows}", "rows in the file when init read it (a note: training counts them anew)"),
        ("expected_loss: unknown", "share of rows training may drop (empty text, fewer hard negatives than most"),
        ("", "rows): `unknown` lets `data check` measure and report it; a number (0.02) makes a larger share an error"),
    ])  # fmt: skip


def _warmup(steps: int) -> int:
    """A tenth of the run, at most 100 steps; none below two, since a warm-up of one step runs its only step at
    rate 0 (the linear warm-up starts from zero) and every later one at the full rate."""
    warmup = min(100, steps // 10)
    return warmup if warmup >= 2 else 0


def _recipe_text(name: str, card_dir: str, rows: int, model: str, recipe_path: str, holdout: int = 0) -> str:
    total, rows = rows, rows - holdout  # the held-out rows are never trained on
    batch = max(2, min(32, rows // 4))
    steps = max(10, min(1000, rows // batch))
    run = shlex.quote(recipe_path)
    held = [
        (f"eval: {{steps: {steps}, holdout: {{rows: {holdout}}}}}", f"{holdout} of the {total} rows kept out of "
         f"training and scored at step {steps} as runs/{name}/eval/holdout-{name}/"),
    ] if holdout else []
    return _commented([
        ("", f"Training recipe written by `neoembed init` for the card {name}: the unified contrastive recipe (InfoNCE"),
        ("", "with in-batch and hard negatives, the card's instruction before queries)."),
        ("", "Run it from the folder you ran `neoembed init` in (card_dirs and output_dir are relative to it):"),
        ("", f"  neoembed train {run} --dry-run"),
        ("", f"  neoembed train {run}"),
        ("", "Any key can be overridden on the command line (steps=500); the recipe's keys: docs/training.md."),
        ("seed: 0", "random seed: row sampling, batch order, dropout"),
        (f"model: {model}", "a hub id or a local folder: any sentence-transformers or Hugging Face encoder"),
        ("# pooling: mean", "mean or cls; unset: the model's own (a saved model's pooling, else mean)"),
        ("max_length: 128", "tokens per text during training (the saved model keeps its own limit)"),
        (f"card_dirs: [{card_dir}]", "where the card is, relative to the folder you run neoembed from"),
        ("datasets:", ""),
        (f"  - {{card: {name}}}", "the card's name (its file in card_dirs)"),
        (f"steps: {steps}", f"{steps} steps x {batch} queries: about {steps * batch / rows:.1f} passes over {rows} rows"),
        (f"batch_size: {batch}", "queries per step: more in-batch negatives, more memory"),
        ("temperature: 0.07", "InfoNCE's temperature"),
        (f"optimizer: {{lr: 5.0e-5, warmup_steps: {_warmup(steps)}, schedule: cosine}}", "learning rate and its schedule"),
        (f"save_steps: {steps}", "a checkpoint every this many steps"),
        (f"logging_steps: {max(1, steps // 20)}", "a row of metrics.jsonl (a point of training_curves.png) every this many steps"),
        (f"output_dir: runs/{name}", "the trained model, relative to the folder you run neoembed from"),
        *held,
    ])  # fmt: skip


def write_starter(
    data: str | Path,
    out: str | Path = ".",
    model: str = DEFAULT_MODEL,
    overwrite: bool = False,
    holdout: int | None = None,
):
    """Write ``out/<name>.yaml`` (card) and ``out/<name>-recipe.yaml`` for ``data``; returns a :class:`Starter`.
    ``holdout``: rows the recipe keeps out of training and scores at its last step (``eval.holdout``)."""
    data, out = Path(data), Path(out)
    if not data.is_file():
        raise FileNotFoundError(f"{data}: no such data file")
    if model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().is_dir():
        raise FileNotFoundError(
            f"--model {model}: no such folder; give a hub id (org/name) or a local model folder"
        )
    names, rows = _read(data)
    if rows < MIN_ROWS:
        raise ValueError(
            f"{data} holds {rows} row{'s' * (rows != 1)}: contrastive training needs at least {MIN_ROWS} (each "
            "query's in-batch negatives are the other rows' positives): add rows"
        )
    # at most half: the rows sharing a text with held-out ones leave training too (many more where a query repeats)
    if holdout is not None and not 1 <= holdout <= rows // 2:
        raise ValueError(
            f"--holdout {holdout}: hold out 1 to {rows // 2} of the {rows} rows in {data} (at most half: the rows "
            "sharing a query, positive or negative with held-out ones leave training too)"
            if rows >= 2 * MIN_ROWS
            else f"--holdout: {data} holds {rows} rows, all needed to train on: add rows to hold some out"
        )
    columns = guess_columns(names)
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", data.name.split(".")[0]) or "mydata"
    card, recipe = out / f"{name}.yaml", out / f"{name}-recipe.yaml"
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder: choose a folder path")
    for path in (card, recipe):
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} exists: edit it, or pass --overwrite to write a new one")
    out.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(data.resolve(), out.resolve())
    card.write_text(_card_text(name, rel, _format(data), columns, rows, card.as_posix()), encoding="utf8")
    text = _recipe_text(name, out.as_posix(), rows, model, recipe.as_posix(), holdout or 0)
    recipe.write_text(text, encoding="utf8")
    return Starter(card, recipe, rows, columns, name, holdout or 0)
