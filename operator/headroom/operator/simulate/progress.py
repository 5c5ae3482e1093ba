"""Progress of a long read or replay on stderr: one redrawn line on a terminal, a plain line
every few seconds otherwise (logs and pipes should not fill with carriage returns), nothing at
all when it is off (the CLI turns it on for a terminal, or with --progress)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Call `update` as often as you like (it throttles itself); `done` ends a stage."""

    def __init__(
        self, enabled: bool, stream: TextIO | None = None, line_interval_s: float = 5.0
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.line_interval_s = line_interval_s
        self._last = -1e9
        self._width = 0
        self._started = time.monotonic()

    def start(self, label: str) -> None:
        """A new stage: its clock starts now, and a terminal shows its label at once."""
        self._started = time.monotonic()
        # A log gets its first line after line_interval_s: a short stage shows only its end.
        self._last = -1e9 if self.tty else self._started
        if self.enabled and self.tty:
            self._write(f"{label} ...", end="")

    def update(self, label: str, done: float, total: float) -> None:
        """`done` of `total` units of the stage `label`."""
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < (0.1 if self.tty else self.line_interval_s):
            return
        self._last = now
        frac = min(1.0, done / total) if total > 0 else 0.0
        line = f"{label}: {frac:4.0%} ({now - self._started:.1f} s)"
        self._write(line, end="" if self.tty else "\n")

    def done(self, line: str) -> None:
        """End the stage with a summary `line`."""
        if self.enabled:
            self._write(f"{line} ({time.monotonic() - self._started:.1f} s)", end="\n")

    def _write(self, line: str, end: str) -> None:
        if self.tty:
            pad = " " * max(0, self._width - len(line))
            self.stream.write("\r" + line + pad + end)
            self._width = 0 if end else len(line)
        else:
            self.stream.write(line + end)
        self.stream.flush()
