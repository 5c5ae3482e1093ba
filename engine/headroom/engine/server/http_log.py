"""What the HTTP layer may write to the log when clients misbehave: one short line per
malformed request instead of aiohttp's traceback, and a bounded rate for lines a client (or a
file-descriptor shortage) can trigger thousands of times a second."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError

#: The logger aiohttp's per-connection handler writes to (passed as its `logger`).
HTTP_LOGGER = "headroom.server.http"
#: asyncio's message when accept() fails for want of file descriptors or memory.
ACCEPT_OUT_OF_RESOURCES = "socket.accept() out of system resource"
# Longest excerpt of a parser message in the log line (the message can quote the client's bytes).
_EXCERPT = 160


class RateLimit:
    """A token bucket: `burst` events at once, then `per_s` a second; counts what it drops."""

    def __init__(self, burst: int, per_s: float, clock: Callable[[], float] = time.monotonic):
        self.burst, self.per_s, self.clock = burst, per_s, clock
        self.tokens = float(burst)
        self.last = clock()
        self.dropped = 0

    def allow(self) -> tuple[bool, int]:
        """Whether this event may be logged, and how many were dropped since the last one."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.per_s)
        self.last = now
        if self.tokens < 1:
            self.dropped += 1
            return False, 0
        self.tokens -= 1
        dropped, self.dropped = self.dropped, 0
        return True, dropped


def one_line(text: str) -> str:
    """`text` on one printable line, shortened: parser messages quote the client's bytes."""
    # Escapes control characters (a terminal's escape sequences) and non-ASCII text.
    flat = " ".join(text.split()).encode("unicode_escape").decode("ascii")
    return flat if len(flat) <= _EXCERPT else flat[: _EXCERPT - 3] + "..."


class QuietBadRequests(logging.Filter):
    """Turns aiohttp's "Error handling request" traceback for a malformed request (a parser
    error: a line or header too long, too many headers, a bad Content-Length) into one WARNING
    line naming the client and the reason, at most `RateLimit` lines a second."""

    def __init__(self, limit: RateLimit | None = None) -> None:
        super().__init__()
        self.limit = limit or RateLimit(burst=20, per_s=1.0)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True  # anything else keeps its traceback: it is ours to fix
        allowed, dropped = self.limit.allow()
        if not allowed:
            return False
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        more = f" ({dropped} more since the last such line)" if dropped else ""
        record.msg = "malformed HTTP request from %s: %s %s%s"
        record.args = (remote, exc.code, one_line(exc.message or type(exc).__name__), more)
        record.exc_info, record.exc_text = None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def http_logger() -> logging.Logger:
    """The logger for aiohttp's connection handlers, with `QuietBadRequests` installed once."""
    logger = logging.getLogger(HTTP_LOGGER)
    if not any(isinstance(f, QuietBadRequests) for f in logger.filters):
        logger.addFilter(QuietBadRequests())
    return logger


def rate_limited_accept_errors(
    limit: RateLimit | None = None, log: logging.Logger | None = None
) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """An event-loop exception handler that writes asyncio's accept() resource error as one
    line at a bounded rate (asyncio logs it with a traceback per failed accept, thousands a
    second once the process is out of file descriptors); everything else goes to the default."""
    limit = limit or RateLimit(burst=1, per_s=0.1)
    out = log or logging.getLogger("headroom.server")

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_OUT_OF_RESOURCES:
            loop.default_exception_handler(context)
            return
        allowed, dropped = limit.allow()
        if allowed:
            more = f" ({dropped} more since the last such line)" if dropped else ""
            out.error("cannot accept connections: %s%s", context.get("exception"), more)

    return handler
