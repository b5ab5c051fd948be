"""The errors of data cards and what they say: a card or its data at fault (:class:`DataCardError`, exit 2), the
hub out of reach (:class:`HubUnreachable`, the card may be fine), a NaN teacher score, and an unreadable data file
named by file and line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


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


class NonFiniteScore(DataCardError):
    """A NaN or infinite teacher score; ``spec``: the card's scores column (to find the file's line)."""

    def __init__(self, message: str, spec: Any = None):
        super().__init__(message)
        self.spec = spec


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
