"""Progress of long stages (mining, preprocessing, evaluation, joining data): tqdm's bar on a terminal; where
stderr is not one (CI, a scheduler's log) a bar's carriage-return redraws pile into one unreadable line, so there
it prints plain lines instead — the first once the stage has run ``delay`` seconds (a stage quicker than that stays
silent), then one every ``interval`` seconds and one when it ends: count, rate, time elapsed and time left."""

from __future__ import annotations

import logging
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

# Seconds between two plain lines: a scheduler's log stays short, and a stalled stage shows within a minute.
PLAIN_INTERVAL = 30.0
PLAIN_DELAY = 2.0


def bar(
    iterable=None,
    *,
    desc: str,
    unit: str = "it",
    total=None,
    initial: int = 0,
    disable: bool = False,
    interval: float | None = None,
    delay: float | None = None,
    stream=None,
    **tqdm_kwargs,
):
    """A progress bar for ``iterable`` (or for ``update`` calls against ``total``): tqdm's on a terminal,
    :class:`PlainProgress` elsewhere (``interval`` and ``delay`` default to :data:`PLAIN_INTERVAL` and
    :data:`PLAIN_DELAY`), nothing with ``disable``. ``tqdm_kwargs`` are the terminal bar's only."""
    stream = stream if stream is not None else sys.stderr
    if disable or _is_terminal(stream):
        from tqdm.auto import tqdm

        return tqdm(
            iterable,
            desc=desc,
            unit=unit,
            total=total,
            initial=initial,
            disable=disable,
            file=stream,
            **tqdm_kwargs,
        )
    return PlainProgress(
        iterable,
        desc=desc,
        unit=unit,
        total=total,
        initial=initial,
        interval=PLAIN_INTERVAL if interval is None else interval,
        delay=PLAIN_DELAY if delay is None else delay,
        stream=stream,
    )


def _is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class PlainProgress:
    """The part of tqdm's interface neoembed's stages use (iteration, ``update``, ``close``, ``with``), written as
    whole lines."""

    def __init__(
        self,
        iterable=None,
        *,
        desc: str,
        unit: str = "it",
        total=None,
        initial: int = 0,
        interval: float = PLAIN_INTERVAL,
        delay: float = PLAIN_DELAY,
        stream=None,
    ):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.desc, self.unit, self.total = iterable, desc, unit.strip(), total
        self.n, self.initial, self.interval, self.delay = initial, initial, interval, delay
        self.stream = stream if stream is not None else sys.stderr
        self.closed = False
        self.printed = None  # the count the last line showed; None before the first line
        self.start = time.perf_counter()
        self.last = self.start
        # the count and time at the first update: what comes before it is start-up (a shard tokenized whole before
        # its first batch, a model's first call), which a time left measured from the start counted as the pace:
        # "left 2:10:03" at 128 texts after 9 s, for a stage done in minutes
        self.first: tuple[int, float] | None = None

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if self.first is None:
            self.first = (self.n, now)
        shown = self.printed is not None
        if now - (self.last if shown else self.start) >= (self.interval if shown else self.delay):
            self.last = now
            self._line()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # a stage past its delay ends with a line, unless its last line already says where it ended
        late = self.printed is not None or time.perf_counter() - self.start >= self.delay
        if late and self.n != self.printed:
            self._line()

    def _line(self) -> None:
        from tqdm import tqdm

        elapsed = time.perf_counter() - self.start
        done = self.n - self.initial
        rate = done / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.desc}: {self.n:,}"]
        if self.total:
            parts[0] += f"/{self.total:,} {self.unit} ({100 * self.n / self.total:.0f}%)"
        else:
            parts[0] += f" {self.unit}"
        parts.append(
            f"{rate:,.1f} {self.unit}/s" if rate >= 1 or rate == 0 else f"{1 / rate:,.1f} s/{self.unit}"
        )
        parts.append(f"elapsed {tqdm.format_interval(elapsed)}")
        since, then = self.first or (self.n, 0.0)
        pace = (self.n - since) / (time.perf_counter() - then) if self.n > since else 0.0
        if self.total and pace > 0:  # none yet at the first update: its batch is all there is to go by
            parts.append(f"left {tqdm.format_interval(max(self.total - self.n, 0) / pace)}")
        print("  ".join(parts), file=self.stream, flush=True)
        self.printed = self.n


@contextmanager
def library_noise(*loggers: str):
    """Another library's warnings, and the log records of ``loggers`` below ERROR, kept off the console while the
    block runs (torch's ONNX exporter prints a dozen notices about its own internals on every export; ``""`` is
    the root logger); neoembed's own warnings, told by their class (:func:`is_own_category`), still show: the file
    a library's warning names is often the neoembed module that called it. With ``neoembed --verbose``
    (neoembed's logger at DEBUG) everything shows."""
    if logging.getLogger("neoembed").isEnabledFor(logging.DEBUG):
        yield
        return
    levels = {name: logging.getLogger(name).level for name in loggers}
    root, handlers = logging.getLogger(), list(logging.getLogger().handlers)
    for name in loggers:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        for handler in [h for h in root.handlers if h not in handlers]:  # a library's logging.basicConfig()
            root.removeHandler(handler)  # would print every later line a second time, as "INFO:name:..."
    for w in caught:
        if is_own_category(w.category):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def is_own_file(filename: str) -> bool:
    """Whether ``filename`` is a module of neoembed (where a warning was issued)."""
    return Path(filename).resolve().is_relative_to(_PACKAGE)


def is_own_category(category: type[Warning]) -> bool:
    """Whether a warning class is one neoembed defines (such as :class:`neoembed.sentence.TruncationWarning`,
    attributed to whichever library called ``encode``)."""
    return category.__module__.split(".")[0] == "neoembed"


def is_own_warning(category: type[Warning], filename: str) -> bool:
    """Whether a warning is neoembed's: of a class it defines, or issued in its modules."""
    return is_own_category(category) or is_own_file(filename)


_PACKAGE = Path(__file__).resolve().parent
