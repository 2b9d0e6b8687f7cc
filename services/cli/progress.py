"""A small progress bar / spinner for long waits in the CLI.

On a terminal the line is redrawn in place with ``\\r``; anywhere else (a
pipe, a CI log, a file) a plain line is written when the status text
changes, and otherwise at most once per ``interval`` seconds, so logs stay
short.  A total of 0 means "unknown": a spinner instead of a bar.

Not thread-safe: one waiter drives one :class:`Progress`.  The clock is
injected so tests can drive the non-terminal cadence without sleeping.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

SPINNER = "|/-\\"


def render_bar(done: int, total: int, width: int = 30) -> str:
    """``[#####.....]  50.0% 5/10`` (no bar, just the count, when ``total`` is 0)."""
    if total <= 0:
        return f"{done}/?"
    frac = min(max(done / total, 0.0), 1.0)
    fill = int(frac * width)
    return f"[{'#' * fill}{'.' * (width - fill)}] {100 * frac:5.1f}% {done}/{total}"


class Progress:
    """Show ``status [bar] detail`` for something that advances toward a total."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        width: int = 30,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        tty: bool | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.interval = interval
        self.clock = clock
        self.tty = _isatty(self.stream) if tty is None else tty
        self._frame = 0
        self._drawn = 0  # width of the line currently drawn on the terminal
        self._line = ""
        self._status: str | None = None
        self._last_print: float | None = None

    def render(self, done: int, total: int, status: str = "", detail: str = "") -> str:
        if total > 0:
            middle = render_bar(done, total, self.width)
        else:
            middle = SPINNER[self._frame % len(SPINNER)] + (f" {done}" if done else "")
            self._frame += 1
        return "  ".join(p for p in (status, middle, detail) if p)

    def update(self, done: int, total: int, status: str = "", detail: str = "") -> None:
        line = self.render(done, total, status, detail)
        if self.tty:
            self._redraw(line)
        else:
            now = self.clock()
            due = self._last_print is None or now - self._last_print >= self.interval
            if status != self._status or (due and line != self._line):
                self.stream.write(line + "\n")
                self.stream.flush()
                self._last_print = now
                self._line = line
        self._status = status

    def close(self, final: str = "") -> None:
        """End the bar: on a terminal, move past it; write ``final`` on a line of its own."""
        if self.tty and self._drawn:
            self.stream.write("\n")
            self._drawn = 0
        if final:
            self.stream.write(final + "\n")
        self.stream.flush()

    def _redraw(self, line: str) -> None:
        pad = max(self._drawn - len(line), 0)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._drawn = len(line)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real file
        return False
