"""The errors of data cards and what they say: a card or its data at fault (:class:`DataCardError`, exit 2), the
hub out of reach (:class:`HubUnreachable`, the card may be fine), a NaN teacher score, and an unreadable data file
named by file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from neoembed.hub import hub_offline_mode, is_unreachable  # noqa: F401  (their home before hub.py)


class DataCardError(ValueError):
    """A card that does not validate, or data that do not match their card."""


class HubUnreachable(DataCardError):
    """The hub could not be reached at all (offline mode, no network): the card itself may be fine."""


def hub_error(card, e: Exception) -> DataCardError:
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


class RowError(DataCardError):
    """Data of one row that do not match their card: ``head + place + tail``, the place "row N" counting from 1
    (``row``: the index, from 0) until :meth:`place_at` names the file's line."""

    def __init__(self, head: str, row: int, tail: str):
        self.head, self.row, self.tail, self.placed = head, row, tail, False
        super().__init__(f"{head}row {row + 1}{tail}")

    def place_at(self, where: str) -> None:
        """Say ``where`` (e.g. ``FILE, line N``) instead of the row's number."""
        self.args, self.placed = (f"{self.head}{where}{self.tail}",), True


class NonFiniteScore(RowError):
    """A NaN or infinite teacher score; ``spec``: the card's scores column (to find the file's line)."""

    def __init__(self, head: str, row: int, tail: str, spec: Any = None):
        super().__init__(head, row, tail)
        self.spec = spec


# ---------------------------------------------------------------------------- unreadable local data files
def explain_unreadable(path: Path, error: BaseException, fmt: str = "json") -> str:
    """Why a local data file in the card's ``fmt`` cannot be read, by file and line where it has one: JSON
    lines and CSV (plain or .gz) by their first line that is not UTF-8 or not JSON, a CSV with a header and
    no rows; a parquet file that pyarrow cannot open. Else the loader's own error. (The datasets library
    names neither.)"""
    path = Path(path)
    if path.is_file() and (other := _other_format(path, fmt)) is not None:
        return f"{path} is {other} data, not {fmt}: set the card's format to {other.lower()} (source.local.format)"
    if path.is_file():
        try:
            reason = _explain_parquet(path) if fmt == "parquet" else _explain_text(path, fmt)
        except (OSError, EOFError) as e:
            return f"{path}: cannot be read ({e}); is it a complete .gz file?"
        if reason:
            return reason
    error = error.__cause__ or error  # datasets wraps its reader's error in "An error occurred ..."
    return f"{path}: cannot be read as data: {type(error).__name__}: {error}"


def _other_format(path: Path, fmt: str) -> str | None:
    """The format a file's first bytes show where the card names another: a Parquet file starts with ``PAR1``
    (read as text, its first line is "not UTF-8"), JSON lines with ``{``, a JSON array with ``[``."""
    with open(path, "rb") as f:
        head = f.read(4)
    if fmt != "parquet" and head == b"PAR1":
        return "Parquet"
    if fmt != "json" and head.lstrip()[:1] in (b"{", b"["):  # JSON lines, or a JSON array
        return "JSON"
    return None


class _NotUtf8(Exception):
    """A line that is not UTF-8; the message names the file, the line and the fix."""


def _raw_lines(path: Path):
    import gzip

    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
        yield from f


def _text_lines(path: Path, fmt: str):
    """The file's lines as text (.gz read through); a line that is not UTF-8 raises :class:`_NotUtf8`. A CSV
    may open with a byte-order mark (Excel's UTF-8 CSV), which pandas skips; a JSON line may not."""
    for number, raw in enumerate(_raw_lines(path), 1):
        try:
            yield raw.decode("utf-8-sig" if fmt == "csv" and number == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise _NotUtf8(
                f"{path}, line {number}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}): "
                "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
            ) from None


def _explain_text(path: Path, fmt: str) -> str | None:
    if not any(line.strip() for line in _raw_lines(path)):
        return f"{path}: holds no rows (empty, or blank lines only): fill it or remove it from the card"
    try:
        return _explain_csv(path) if fmt == "csv" else _explain_json_lines(path)
    except _NotUtf8 as e:
        return str(e)


def _explain_json_lines(path: Path) -> str | None:
    for number, line in enumerate(_text_lines(path, "json"), 1):
        if line.strip():
            try:
                json.loads(line)
            except ValueError as e:
                return f"{path}, line {number}: not a JSON object ({e}): fix or delete that line"
    return None


def _explain_csv(path: Path) -> str | None:
    import csv

    reader = csv.reader(_text_lines(path, "csv"), strict=True)
    header, records, end = None, 0, 0  # end: the last line of the last complete record
    try:
        for row in reader:
            records, end = records + bool(row), reader.line_num  # a blank line holds no row, for pandas too
            if header is None:
                header = row or None
                if tabs := tab_separated(path, header):
                    return tabs
            elif len(row) > len(header):  # pandas refuses it, or reads a first row's start as an index
                return f"{path}, line {end}: {wide_csv_row(len(row), len(header))}"
    except csv.Error as e:
        if "unexpected end of data" not in str(e):
            return f"{path}, line {reader.line_num}: not a CSV row ({e}): fix or delete that line"
        return (
            f'{path}, line {end + 1}: a quoted field opened there is not closed (an unmatched "): close or '
            "remove the quote"
        )
    if records == 1:
        return (
            f"{path}: has a header and no rows: add rows under its header line, or remove the file from the "
            "card"
        )
    return None


def tab_separated(path: Path, header: list[str] | None) -> str | None:
    """Why a file read as CSV whose header names hold tabs is refused: it is tab-separated."""
    if not header or not any("\t" in name for name in header):
        return None
    return (
        f"{path}: its header line holds tabs: the file is tab-separated, and it is read as comma-separated: "
        "replace the tabs with commas (quoting the fields that hold commas), or write JSON lines"
    )


def wide_csv_row(fields: int, header: int) -> str:
    """Why a CSV row with more fields than its header is refused, and the fix (with its line before it)."""
    return (
        f"has {fields} fields, the header {header}: quote the fields that contain commas "
        '("what time is it, please"), or remove the extra commas'
    )


def _explain_parquet(path: Path) -> str | None:
    import pyarrow.parquet as pq

    try:
        pq.ParquetFile(path).metadata  # noqa: B018 - reading the footer is the check
    except Exception as e:  # pyarrow raises ArrowInvalid or OSError for a file it cannot open
        return (
            f"{path}: is not a readable parquet file (truncated or damaged: {e}): write it again from its "
            "source, or point the card at the right file"
        )
    return None


#: :func:`row_lines` reads a file this far at most (about a second of lines)
LINE_SCAN_ROWS = 200_000


def row_lines(path: Path, fmt: str, rows: list[int]) -> dict[int, int] | None:
    """The file line of each 0-based row in ``rows``, for a JSON-lines or CSV file whose rows the loader reads
    one for one (a blank line holds no row; a CSV row after its header, by the line it starts on); None where
    the file is not so (a JSON array) or cannot be read, or a row lies past :data:`LINE_SCAN_ROWS`. Reads up
    to the last row asked for, once."""
    import csv

    wanted, found = set(rows), {}
    if not wanted:
        return found
    if max(wanted) >= LINE_SCAN_ROWS:  # a scan in Python of millions of lines to name one: counted rows do
        return None
    try:
        if fmt == "csv":
            reader, index, start = csv.reader(_text_lines(path, "csv")), -2, 1  # the header is row -1
            for record in reader:
                index += bool(record)
                if record and index in wanted:
                    found[index] = start
                start = reader.line_num + 1
                if len(found) == len(wanted):
                    break
        else:
            index = -1
            for number, line in enumerate(_text_lines(path, "json"), 1):
                if line.strip():
                    if index == -1 and line.lstrip().startswith("["):
                        return None  # a JSON array: its rows are not lines
                    index += 1
                    if index in wanted:
                        found[index] = number
                    if len(found) == len(wanted):
                        break
    except (OSError, EOFError, _NotUtf8, csv.Error):
        return None
    return found if len(found) == len(wanted) else None
