"""A job's progress where the user is looking: one line on the console at least once a minute; the per-batch bar
stays in the job's log.

Snakemake shows what a job writes to its standard streams on its own console, and the rule scripts point
``sys.stderr`` at the job's log, where tqdm draws the bar. :func:`progress` keeps that bar and also writes, to the
process's original stderr (the console), a line when a loop starts, every ``STAGEREPLAY_PROGRESS_SECONDS``
seconds (default 60) from a background thread (so a batch that runs for many minutes still reports), and when it
ends: items done of the total, tokens per second (the tokens the greedy loop chose or fed, every row, since the
loop started) and the time left at the rate so far. Nothing here reaches a result.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, Iterable, Iterator, TypeVar

from tqdm import tqdm

from stagereplay.decode.greedy import TOKENS

T = TypeVar("T")
INTERVAL_VARIABLE = "STAGEREPLAY_PROGRESS_SECONDS"


def interval_seconds() -> float:
    raw = os.environ.get(INTERVAL_VARIABLE, "60")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{INTERVAL_VARIABLE}={raw!r}: give the seconds between progress lines, a number above 0")
    return seconds


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Reporter:
    """Counts items done and writes the console lines; ``line()`` is what one looks like."""

    def __init__(self, desc: str, total: int, stream=None, clock=time.monotonic):
        self.desc, self.total, self.done = desc, total, 0
        self.stream = stream if stream is not None else sys.__stderr__
        self.clock = clock
        self.started, self.tokens_at_start = clock(), TOKENS.total
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def line(self) -> str:
        elapsed = max(self.clock() - self.started, 1e-9)
        tokens = TOKENS.total - self.tokens_at_start
        share = f" ({100 * self.done // self.total}%)" if self.total else ""
        if not self.done and not tokens:
            return f"[stagereplay] {self.desc}: 0/{self.total} items, started"
        if self.done >= self.total:
            left = f"done in {duration(elapsed)}"
        elif self.done:
            left = f"ETA {duration(elapsed / self.done * (self.total - self.done))}"
        else:
            left = "ETA after the first batch"
        return (f"[stagereplay] {self.desc}: {self.done}/{self.total} items{share}, {tokens / elapsed:.1f} tokens/s, "
                f"{left}")

    def write(self) -> None:
        if self.stream is not None:
            print(self.line(), file=self.stream, flush=True)

    def start(self, interval: float) -> None:
        self.write()

        def tick():
            while not self._stop.wait(interval):
                self.write()

        self._thread = threading.Thread(target=tick, name=f"progress {self.desc}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.done >= self.total:
            self.write()


def progress(batches: Iterable[T], desc: str, *, enabled: bool = True,
             items: Callable[[T], int] = lambda batch: len(batch.items), mininterval: float = 2) -> Iterator[T]:
    """Iterate over ``batches`` with tqdm's bar in the job's log and the console lines (``items(batch)``: how many
    items a batch holds; batches of items by default). ``enabled`` False: neither."""
    batches = list(batches)
    bar = tqdm(batches, desc=desc, disable=not enabled, mininterval=mininterval)
    if not enabled:
        yield from bar
        return
    reporter = Reporter(desc, sum(items(b) for b in batches))
    reporter.start(interval_seconds())
    try:
        for batch in bar:
            yield batch
            reporter.done += items(batch)
    finally:
        reporter.stop()
