"""Progress lines on stderr for a command's long steps (``simulate`` at frontier scale
spends tens of seconds in some of them): each step says what it starts, and how long it
took, on one line. Steps under ``quiet_s`` print nothing."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


class Progress:
    """``with progress.step("planning"):`` prints ``simulate: planning ... 41.2 s``."""

    def __init__(self, command: str, stream: TextIO | None = None, quiet_s: float = 2.0) -> None:
        self.command = command
        self.stream = stream if stream is not None else sys.stderr
        self.quiet_s = quiet_s

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
        if seconds >= self.quiet_s:
            print(f"{self.command}: {what} took {seconds:.1f} s", file=self.stream, flush=True)
