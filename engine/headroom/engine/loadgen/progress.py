"""A dependency-free progress display on stderr: a redrawn bar on a terminal, a plain line
every few seconds otherwise (CI logs and pipes should not fill with carriage returns)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from headroom.engine.loadgen.client import RunState


def render_line(state: RunState, elapsed: float, total: int | None, duration: float | None,
                width: int = 24) -> str:  # fmt: skip
    """One status line: bar (by requests or by time), counts, concurrency, tokens/s."""
    if total:
        frac = min(1.0, state.done / total)
        where = f"{state.done}/{total} done"
    elif duration:
        frac = min(1.0, elapsed / duration)
        where = f"{min(elapsed, duration):.0f}/{duration:.0f}s, {state.done} done"
    else:
        frac, where = 0.0, f"{state.done} done"
    filled = round(frac * width)
    bar = "#" * filled + "-" * (width - filled)
    rate = state.output_tokens / elapsed if elapsed > 0 else 0.0
    return (
        f"[{bar}] {where}, {state.in_flight} in flight (target {state.concurrency}), "
        f"{state.errors} errors, {rate:,.0f} tok/s, {elapsed:.1f}s"
    )


class ProgressBar:
    """Call `update(state, elapsed)` as often as you like; it throttles its own output."""

    def __init__(
        self,
        total: int | None = None,
        duration: float | None = None,
        stream: TextIO | None = None,
        enabled: bool = True,
        line_interval_s: float = 5.0,
    ) -> None:
        self.total = total
        self.duration = duration
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.line_interval_s = line_interval_s
        self._last = -1e9
        self._last_len = 0

    def update(self, state: RunState, elapsed: float) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        interval = 0.1 if self.tty else self.line_interval_s
        if now - self._last < interval:
            return
        self._last = now
        line = render_line(state, elapsed, self.total, self.duration)
        if self.tty:
            pad = " " * max(0, self._last_len - len(line))
            self.stream.write("\r" + line + pad)
            self._last_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self, state: RunState, elapsed: float) -> None:
        """Draw the final state and end the line."""
        if not self.enabled:
            return
        self._last = -1e9
        line = render_line(state, elapsed, self.total, self.duration)
        prefix = "\r" if self.tty else ""
        pad = " " * max(0, self._last_len - len(line)) if self.tty else ""
        self.stream.write(prefix + line + pad + "\n")
        self.stream.flush()
