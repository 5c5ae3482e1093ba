"""The server's listening sockets: an accept loop of our own in front of aiohttp's connection
handling, so that slow or idle clients cannot exhaust the process.

- At most `max_connections` connections are open per listener; further clients wait in the
  kernel's listen queue until one closes (no accept-and-drop, and no file descriptor used).
- When accept() fails for want of file descriptors, one line is logged at a bounded rate and
  accepting resumes a second later. asyncio's own accept loop, on that error, logs a traceback
  per attempt and reschedules itself per attempt: tens of megabytes of log in seconds.
- Timeouts: the headers of a request must arrive within `header_timeout_s` of its first byte,
  and a connection with no request in flight is closed after `keepalive_timeout_s` (aiohttp's
  keep-alive timer, which runs from the connection's start and from each response).
- A client that stops reading a response: once the socket's buffers are full, a write waits
  (the transport paused writing); if it still cannot go on after `send_timeout_s`, the
  connection is aborted. That is a disconnect: the handler is cancelled and its engine
  requests are aborted (generation.Generation), so their KV blocks and the slot come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import BaseModel, ConfigDict, Field

from headroom.engine.server.http_log import RateLimit, http_logger

log = logging.getLogger("headroom.server")

#: The kernel's queue of connections not accepted yet (aiohttp's default).
BACKLOG = 128
#: File descriptors left for everything but client connections (model files, the GPU
#: driver, logs, the listening sockets), when the connection cap is derived from the limit.
RESERVED_FDS = 128
#: The derived cap never exceeds this, however high the open-files limit.
MAX_DEFAULT_CONNECTIONS = 4096
#: Seconds between accept() attempts while the process is out of file descriptors.
ACCEPT_RETRY_S = 1.0
#: Seconds a response may stay stuck on a client that takes none of it (a write waiting for
#: the socket's full buffers). A reading client never waits this long: it frees the ~64 KiB
#: above the transport's low-water mark in a moment. As long as the request side's body
#: timeout (30 s), and within the kubelet's default liveness window (3 probes 10 s apart),
#: so non-reading clients cannot keep the probe out of a full connection table for longer.
SEND_TIMEOUT_S = 30.0
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class ConnectionLimits(BaseModel):
    """Timeouts (seconds) and the connection cap of one listener."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    keepalive_timeout_s: float = Field(default=5.0, gt=0)
    header_timeout_s: float = Field(default=10.0, gt=0)
    send_timeout_s: float = Field(default=SEND_TIMEOUT_S, gt=0)
    max_connections: int = Field(default=1024, ge=1)


def open_files_limit() -> int:
    """This process's soft limit on open files (RLIMIT_NOFILE); a large number when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)


def default_max_connections(open_files: int, listeners: int = 1) -> int:
    """Connections per listener that fit under the open-files limit with `RESERVED_FDS` to spare
    (and room for one more in the middle of accept()), at most `MAX_DEFAULT_CONNECTIONS`."""
    share = (open_files - RESERVED_FDS) // max(1, listeners) - 1
    return max(1, min(MAX_DEFAULT_CONNECTIONS, share))


# Slow readers cut off: one line per 10 s at most, however many clients trigger it.
_SEND_TIMEOUT_LOG = RateLimit(burst=1, per_s=0.1)


class ConnectionHandler(web.RequestHandler):
    """aiohttp's per-connection protocol, plus a deadline for the headers of each request, a
    deadline for a stalled write (`send_timeout_s`), and a callback when the connection ends
    (the listener's count). `request_started` and `request_finished` are called by the app's
    outermost middleware."""

    def __init__(
        self,
        manager: web.Server,
        *,
        loop: asyncio.AbstractEventLoop,
        header_timeout_s: float,
        on_lost: Callable[[], None],
        send_timeout_s: float = SEND_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self.hr_loop = loop
        self.hr_header_timeout_s = header_timeout_s
        self.hr_send_timeout_s = send_timeout_s
        self.hr_on_lost: Callable[[], None] | None = on_lost
        self.hr_in_request = False
        self.hr_header_timer: asyncio.TimerHandle | None = None
        self.hr_send_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        # The first byte of a request (none in flight) starts its headers' clock.
        if not self.hr_in_request and self.hr_header_timer is None:
            self.hr_header_timer = self.hr_loop.call_later(
                self.hr_header_timeout_s, self._headers_too_slow
            )
        super().data_received(data)

    def request_started(self) -> None:
        """The request's headers are in: stop their clock."""
        self.hr_in_request = True
        self._cancel_header_timer()

    def request_finished(self) -> None:
        self.hr_in_request = False

    def _cancel_header_timer(self) -> None:
        if self.hr_header_timer is not None:
            self.hr_header_timer.cancel()
            self.hr_header_timer = None

    def _headers_too_slow(self) -> None:
        self.hr_header_timer = None
        if not self.hr_in_request and self.transport is not None:
            log.debug("closing a connection whose request headers took over %.1fs",
                      self.hr_header_timeout_s)  # fmt: skip
            self.force_close()

    def pause_writing(self) -> None:
        # The transport's buffer is over its high-water mark: writes wait from here on.
        super().pause_writing()
        if self.hr_send_timer is None:
            self.hr_send_timer = self.hr_loop.call_later(
                self.hr_send_timeout_s, self._send_too_slow
            )

    def resume_writing(self) -> None:
        self._cancel_send_timer()
        super().resume_writing()

    def _cancel_send_timer(self) -> None:
        if self.hr_send_timer is not None:
            self.hr_send_timer.cancel()
            self.hr_send_timer = None

    def _send_too_slow(self) -> None:
        self.hr_send_timer = None
        if self.transport is None:
            return
        allowed, dropped = _SEND_TIMEOUT_LOG.allow()
        if allowed:
            more = f" ({dropped} more since the last such line)" if dropped else ""
            log.warning("closing a connection whose client took no response bytes for %gs "
                        "(send timeout)%s", self.hr_send_timeout_s, more)  # fmt: skip
        # abort, not close: close() would wait for the buffer to drain, which is the problem.
        # connection_lost follows, which cancels the handler (handler_cancellation) and so
        # aborts its engine requests, as for a client that hung up.
        self.transport.abort()

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        cause = exc.__cause__ if isinstance(exc, web.RequestPayloadError) else None
        if isinstance(cause, HttpProcessingError):
            # A malformed body (bad gzip, chunk framing) found while aiohttp discards the unread
            # body of a request already answered, say with a 401. It logs that as an
            # "Unhandled exception" traceback; the parser error underneath gets the one quiet
            # line of http_log.QuietBadRequests instead, as malformed HTTP does.
            peer = self.transport.get_extra_info("peername") if self.transport else None
            remote = peer[0] if isinstance(peer, tuple) and peer else "?"
            self.logger.exception("Error handling request from %s", remote, exc_info=cause)
            return
        super().log_exception(*args, **kw)

    def release(self) -> None:
        """Give the connection's slot back to the listener (once)."""
        on_lost, self.hr_on_lost = self.hr_on_lost, None
        if on_lost is not None:
            on_lost()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_timer()
        self._cancel_send_timer()
        try:
            super().connection_lost(exc)
        finally:
            self.release()


class Listener:
    """One listening socket whose connections `server` (the runner's aiohttp server) handles."""

    def __init__(
        self,
        server: web.Server,
        limits: ConnectionLimits,
        handler_args: dict[str, Any] | None = None,
    ) -> None:
        self.server = server
        self.limits = limits
        self.handler_args = {
            "keepalive_timeout": limits.keepalive_timeout_s,
            "logger": http_logger(),
            **(handler_args or {}),
        }
        self.open = 0
        self.sock: socket.socket | None = None
        self._has_room = asyncio.Event()
        self._has_room.set()
        self._task: asyncio.Task[None] | None = None
        self._full_log = RateLimit(burst=1, per_s=0.1)
        self._emfile_log = RateLimit(burst=1, per_s=0.1)

    async def start(self, host: str, port: int) -> int:
        """Bind and listen; the bound port (for `port` 0)."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        sock = socket.create_server(addr, family=family, backlog=BACKLOG)
        sock.setblocking(False)
        self.sock = sock
        self._task = asyncio.create_task(self._accept_loop(sock))
        return int(sock.getsockname()[1])

    async def close(self) -> None:
        """Stop accepting and close the listening socket (open connections stay)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _protocol(self) -> ConnectionHandler:
        return ConnectionHandler(
            self.server,
            loop=asyncio.get_running_loop(),
            header_timeout_s=self.limits.header_timeout_s,
            send_timeout_s=self.limits.send_timeout_s,
            on_lost=self._release,
            **self.handler_args,
        )

    async def _serve(self, conn: socket.socket) -> None:
        """Hand an accepted socket to aiohttp; its slot is released when it closes."""
        made: list[ConnectionHandler] = []

        def factory() -> ConnectionHandler:
            made.append(self._protocol())
            return made[0]

        self.open += 1
        try:
            await asyncio.get_running_loop().connect_accepted_socket(factory, sock=conn)
        except OSError as e:  # the client left before the transport was set up
            log.debug("dropped a connection while setting it up: %s", e)
            conn.close()
            if made:
                made[0].release()
            else:
                self._release()

    def _release(self) -> None:
        self.open -= 1
        self._has_room.set()

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.open >= self.limits.max_connections:
                self._has_room.clear()
                allowed, dropped = self._full_log.allow()
                if allowed:
                    log.warning("%d connections open (--max-connections): new ones wait in "
                                "the listen queue%s", self.open,
                                f" ({dropped} more times)" if dropped else "")  # fmt: skip
                await self._has_room.wait()
                continue
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as e:
                if sock.fileno() == -1:
                    return  # closed under us
                if e.errno not in _OUT_OF_RESOURCES:
                    log.debug("accept() failed: %s", e)  # e.g. the client reset first
                    continue
                allowed, dropped = self._emfile_log.allow()
                if allowed:
                    log.error("cannot accept connections (%d open): %s; retrying every %.0fs%s",
                              self.open, e, ACCEPT_RETRY_S,
                              f" ({dropped} more failures)" if dropped else "")  # fmt: skip
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            await self._serve(conn)
