"""The pieces behind the engine server's hardening, without a server: the log's rate limit and
its one-line form of a malformed request, the loop handler for accept() failures, the
connection cap derived from the open-files limit, and the search for lone surrogates."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from headroom.engine.server import http_log, listener
from headroom.engine.server.middleware import lone_surrogate


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_limit_lets_a_burst_through_then_counts_what_it_drops() -> None:
    clock = Clock()
    limit = http_log.RateLimit(burst=2, per_s=1.0, clock=clock)
    assert [limit.allow() for _ in range(5)] == [(True, 0), (True, 0)] + [(False, 0)] * 3
    clock.now = 1.0
    assert limit.allow() == (True, 3)  # the next line says how many were dropped
    assert limit.allow() == (False, 0)


def _record(
    exc: BaseException | None, msg: str = "Error handling request from %s"
) -> logging.LogRecord:
    info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord("x", logging.ERROR, __file__, 1, msg, ("127.0.0.1",), info)


def test_a_parser_error_becomes_one_short_warning_line() -> None:
    quiet = http_log.QuietBadRequests()
    rec = _record(LineTooLong(b"a" * 20_000, "8190"))
    assert quiet.filter(rec)
    line = rec.getMessage()
    assert rec.levelno == logging.WARNING and rec.exc_info is None
    assert line.startswith("malformed HTTP request from 127.0.0.1: 400 Got more than 8190 bytes")
    assert "\n" not in line and len(line) < 250


def test_a_parser_message_with_newlines_and_raw_bytes_stays_on_one_printable_line() -> None:
    rec = _record(BadHttpMessage("Invalid header:\n\n  b'X-\x1b[31m: \xff'\n   ^"))
    assert http_log.QuietBadRequests().filter(rec)
    line = rec.getMessage()
    assert "\n" not in line and "\x1b" not in line and line.isascii()


def test_other_errors_keep_their_traceback() -> None:
    rec = _record(RuntimeError("a bug of ours"), "Unhandled exception")
    assert http_log.QuietBadRequests().filter(rec)
    assert rec.exc_info is not None and rec.levelno == logging.ERROR


def test_a_flood_of_malformed_requests_is_rate_limited() -> None:
    clock = Clock()
    quiet = http_log.QuietBadRequests(http_log.RateLimit(burst=3, per_s=1.0, clock=clock))
    kept = [quiet.filter(_record(BadHttpMessage("bad"))) for _ in range(1000)]
    assert sum(kept) == 3
    clock.now = 1.0
    rec = _record(BadHttpMessage("bad"))
    assert quiet.filter(rec) and "997 more since the last such line" in rec.getMessage()


def test_asyncios_accept_error_is_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.new_event_loop()
    clock = Clock()
    log = logging.getLogger("test.accept")
    loop.set_exception_handler(
        http_log.rate_limited_accept_errors(http_log.RateLimit(1, 0.1, clock), log)
    )
    try:
        with caplog.at_level(logging.DEBUG):
            err = OSError(24, "Too many open files")
            for _ in range(10_000):
                loop.call_exception_handler(
                    {"message": http_log.ACCEPT_OUT_OF_RESOURCES, "exception": err}
                )
            clock.now = 10.0
            loop.call_exception_handler(
                {"message": http_log.ACCEPT_OUT_OF_RESOURCES, "exception": err}
            )
            loop.call_exception_handler({"message": "something else entirely"})
    finally:
        loop.close()
    mine = [r.getMessage() for r in caplog.records if r.name == "test.accept"]
    assert len(mine) == 2
    assert mine[0] == "cannot accept connections: [Errno 24] Too many open files"
    assert "9999 more since the last such line" in mine[1]
    # Anything else still reaches asyncio's default handler.
    assert any("something else entirely" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("open_files", "listeners", "cap"),
    [(256, 1, 127), (256, 2, 63), (1024, 1, 895), (1 << 20, 1, 4096), (100, 1, 1)],
)
def test_the_connection_cap_fits_under_the_open_files_limit(
    open_files: int, listeners: int, cap: int
) -> None:
    assert listener.default_max_connections(open_files, listeners) == cap


def test_a_stats_listener_takes_a_small_share_not_half_the_api_s_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every operator-made headroom pod has a stats listener (the probes and the sidecar): at a
    # container's open-files limit of 1024 an even split left the API 447 connections of 895.
    from headroom.engine.server import runner

    monkeypatch.setattr(runner, "open_files_limit", lambda: 1024)
    alone = runner.ListenConfig(port=0)
    both = runner.ListenConfig(port=0, stats_port=1)
    assert alone.limits().max_connections == 895
    assert both.limits().max_connections == 895 - runner.STATS_MAX_CONNECTIONS
    assert both.stats_limits().max_connections == runner.STATS_MAX_CONNECTIONS
    # --max-connections is each listener's, as its help says.
    given = runner.ListenConfig(port=0, stats_port=1, max_connections=10)
    assert given.limits().max_connections == given.stats_limits().max_connections == 10


def test_a_listener_holds_no_more_connections_than_its_cap() -> None:
    """Three clients, a cap of two: the third waits in the listen queue until one closes."""
    from aiohttp import web

    async def run() -> tuple[int, int, int]:
        app = web.Application()

        async def ok(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        app.router.add_get("/", ok)
        runner = web.AppRunner(app)
        await runner.setup()
        assert runner.server is not None
        limits = listener.ConnectionLimits(max_connections=2, keepalive_timeout_s=60)
        ln = listener.Listener(runner.server, limits)
        port = await ln.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        clients = []
        for _ in range(3):
            c = socket.socket()
            c.setblocking(False)
            await loop.sock_connect(c, ("127.0.0.1", port))  # the kernel completes it
            clients.append(c)
        await asyncio.sleep(0.3)
        full = ln.open
        clients[0].close()
        for _ in range(100):  # the queued one is accepted once a slot is free
            await asyncio.sleep(0.05)
            if ln.open == 2 and len(runner.server.connections) == 2:
                break
        after = ln.open
        for c in clients[1:]:
            c.close()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if ln.open == 0:
                break
        await ln.close()
        await runner.cleanup()
        return full, after, ln.open

    full, after, end = asyncio.run(run())
    assert (full, after, end) == (2, 2, 0)


def test_a_lone_surrogate_is_found_with_its_path() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "ok\udc80"}]}]}
    assert lone_surrogate(body) == ("messages[0].content[0].text", 2, "\udc80")
    assert lone_surrogate({"prompt": ["fine", "also \U0001f600 fine"]}) is None
    assert lone_surrogate({"logit_bias": {"\ud800": 1.0}}) == ("logit_bias", 0, "\ud800")
