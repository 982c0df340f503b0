"""The progress bar of a library call: a tqdm bar over the call's decodes (one construction, replica or transplant
over one batch each), its postfix the tokens the greedy loop has chosen or fed so far and their rate, refreshed
every second by a thread while a decode runs, so that a decode of minutes shows it is alive. It appears only once
a call has run for :data:`DELAY` seconds: short calls print nothing.

Knows nothing of what is decoded; reads :data:`stagereplay.decode.greedy.TOKENS`.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from stagereplay.decode.greedy import TOKENS

DELAY = 2.0  # seconds before a call's bar appears


class Progress:
    """One call's bar; ``enabled`` False prints nothing."""

    def __init__(self, description: str, enabled: bool = True):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=0, desc=description, unit="decode", disable=not enabled, delay=DELAY, leave=True)
        self.enabled = enabled
        self.started = time.monotonic()
        self.tokens = TOKENS.total

    def add(self, decodes: int) -> None:
        """The call will run ``decodes`` more decodes than counted so far."""
        self.bar.total += decodes

    @contextmanager
    def decode(self, what: str):
        """One decode, named ``what`` in the bar while it runs."""
        stop = threading.Event()
        watcher = threading.Thread(target=self.watch, args=(stop, what), daemon=True) if self.enabled else None
        if watcher is not None:
            watcher.start()
        try:
            yield
        finally:
            stop.set()
            if watcher is not None:
                watcher.join()
            self.bar.update(1)
            self.show(what)

    def watch(self, stop: threading.Event, what: str) -> None:
        while not stop.wait(1.0):
            self.show(what)

    def show(self, what: str) -> None:
        elapsed = time.monotonic() - self.started
        if not self.enabled or elapsed < DELAY:
            return
        tokens = TOKENS.total - self.tokens
        self.bar.set_postfix_str(f"{what}; {tokens} tokens, {tokens / elapsed:.1f}/s")

    def close(self) -> None:
        self.bar.close()
