"""The pieces behind the engine server's hardening: the log's rate limit and its one-line form
of a malformed request, the loop handler for accept() failures, the connection cap derived from
the open-files limit, the search for lone surrogates, and (on 127.0.0.1, without an engine) the
request pipeline's middleware and the listener's per-connection deadlines."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from headroom.engine.server import http_log, listener
from headroom.engine.server.middleware import (
    admission_middleware,
    connection_middleware,
    error_middleware,
    expect_handler,
    lone_surrogate,
    read_json,
)
from headroom.engine.server.state import STATE_KEY, ServerSettings, ServerState


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
    [(256, 1, 127), (256, 2, 63), (1024, 1, 895), (1 << 20, 1, 4096), (100, 1, 1), (256, 0, 127)],
)
def test_the_connection_cap_fits_under_the_open_files_limit(
    open_files: int, listeners: int, cap: int
) -> None:
    assert listener.default_max_connections(open_files, listeners) == cap


@pytest.mark.parametrize(
    ("soft", "limit"), [(1000, 1000), (listener.resource.RLIM_INFINITY, 1 << 20)]
)
def test_the_open_files_limit_is_the_soft_one_and_unlimited_is_a_large_number(
    monkeypatch: pytest.MonkeyPatch, soft: int, limit: int
) -> None:
    """RLIM_INFINITY (-1 on Linux) must not become a negative connection cap."""
    hard = listener.resource.RLIM_INFINITY
    monkeypatch.setattr(listener.resource, "getrlimit", lambda _: (soft, hard))
    assert listener.open_files_limit() == limit


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


# --- the request pipeline (middleware.py) on a bare app, without an engine ------------------

_LIMIT = 8 * 1024  # room for 5000 digits or levels of nesting


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes
    continued: bool  # an interim `100 Continue` came first

    def code(self) -> str:
        return str(json.loads(self.body)["error"]["code"])


_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


async def _pipeline(
    request: bytes,
    state: ServerState | None = None,
    admission: bool = False,
    logged_sizes: list[int] | None = None,
) -> Reply:
    """One raw `request` to an app behind a Listener with the server's connection, error (and
    admission) middleware: /v1/echo and /echo answer with the JSON object read_json returns,
    /slow gives the body a tenth of a second, /conn reports the connection's request state.
    `logged_sizes` gets the response sizes the access log sees."""
    from aiohttp import web
    from aiohttp.abc import AbstractAccessLogger

    class Sizes(AbstractAccessLogger):
        def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
            if logged_sizes is not None:
                logged_sizes.append(response.body_length)

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(await read_json(request, _LIMIT, timeout_s=30.0))

    async def slow(request: web.Request) -> web.Response:
        return web.json_response(await read_json(request, _LIMIT, timeout_s=0.1))

    async def conn(request: web.Request) -> web.Response:
        proto = request.protocol
        assert isinstance(proto, listener.ConnectionHandler)
        return web.json_response(
            {"in_request": proto.hr_in_request, "header_timer": proto.hr_header_timer is not None}
        )

    async def redirect(_: web.Request) -> web.Response:
        raise web.HTTPFound("/elsewhere")

    async def boom(_: web.Request) -> web.Response:
        raise RuntimeError("a bug of ours")

    async def bad(_: web.Request) -> web.Response:
        raise web.HTTPBadRequest()

    middlewares: list[Any] = [connection_middleware, error_middleware]
    if admission:
        middlewares.append(admission_middleware)
    app = web.Application(middlewares=middlewares)
    app[STATE_KEY] = state or ServerState(ServerSettings(served_model_name="m"))
    for path in ("/v1/echo", "/echo"):
        app.router.add_post(path, echo, expect_handler=expect_handler)
    app.router.add_post("/slow", slow)
    app.router.add_get("/conn", conn)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/boom", boom)
    app.router.add_get("/bad", bad)
    runner = web.AppRunner(app)
    await runner.setup()
    assert runner.server is not None
    access = {"access_log_class": Sizes, "access_log": logging.getLogger("test.access")}
    ln = listener.Listener(runner.server, listener.ConnectionLimits(), access)
    port = await ln.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        await writer.drain()
        raw = await reader.read()  # every request here ends with Connection: close
        writer.close()
    finally:
        await ln.close()
        await runner.cleanup()
    continued = raw.startswith(_CONTINUE)
    head, _, body = raw.removeprefix(_CONTINUE).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return Reply(
        int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body, continued
    )


def _post(body: bytes, path: str = "/echo", extra: str = "", chunked: bool = False) -> bytes:
    """A POST of `body` that closes the connection after its response."""
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}"
    if chunked:
        return (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + (
            f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        )
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _padded(size: int) -> bytes:
    """A JSON object of exactly `size` bytes."""
    return b'{"p": "' + b"x" * (size - 9) + b'"}'


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_of_exactly_the_limit_is_read_and_one_byte_more_is_a_413(chunked: bool) -> None:
    """The limit is inclusive, whether the size is declared (Content-Length) or counted."""
    ok = asyncio.run(_pipeline(_post(_padded(_LIMIT), chunked=chunked)))
    assert ok.status == 200 and json.loads(ok.body) == json.loads(_padded(_LIMIT))
    over = asyncio.run(_pipeline(_post(_padded(_LIMIT + 1), chunked=chunked)))
    assert over.status == 413 and over.code() == "request_too_large"


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"[1, 2]", "invalid_json"),
        (b'{"a": ', "invalid_json"),
        (b'{"a": "\\udc80"}', "invalid_unicode"),
        (b'{"a": ' + b"[" * 5000, "invalid_json"),  # past the recursion limit
        (b'{"a": ' + b"9" * 5000 + b"}", "invalid_json"),  # past int's 4300 digits
    ],
)
def test_a_body_that_is_no_json_object_or_not_valid_unicode_is_a_400(raw: bytes, code: str) -> None:
    """A list, broken or too deep JSON, a huge integer or a lone surrogate escape: the client's
    400, not a 500."""
    reply = asyncio.run(_pipeline(_post(raw)))
    assert reply.status == 400 and reply.code() == code


def test_a_lone_surrogate_is_a_400_naming_its_field_and_a_pair_is_valid_unicode() -> None:
    """The 400's param is the field's path; `\\ud83d\\ude00` is one code point, no 400."""
    reply = asyncio.run(_pipeline(_post(b'{"messages": [{"content": "ok\\udc80"}]}')))
    error = json.loads(reply.body)["error"]
    assert (reply.status, error["param"]) == (400, "messages[0].content")
    reply = asyncio.run(_pipeline(_post(b'{"a": "\\ud83d\\ude00"}')))
    assert reply.status == 200 and json.loads(reply.body) == {"a": "\U0001f600"}


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()


def test_an_http_exception_keeps_its_status_and_headers_and_a_redirect_passes() -> None:
    """A 405 or 400 becomes an OpenAI body (the 405 keeps Allow); a 3xx is no error; a bug is a
    500."""
    reply = asyncio.run(_pipeline(_get("/echo")))
    assert reply.status == 405 and reply.headers["allow"] == "POST"
    error = json.loads(reply.body)["error"]
    assert (error["code"], error["message"]) == ("method_not_allowed", "Method Not Allowed")
    reply = asyncio.run(_pipeline(_get("/bad")))  # a 400 is an error too
    assert (reply.status, reply.code()) == (400, "bad_request")
    reply = asyncio.run(_pipeline(_get("/redirect")))
    assert reply.status == 302 and reply.headers["location"] == "/elsewhere"
    reply = asyncio.run(_pipeline(_get("/boom")))
    assert reply.status == 500 and json.loads(reply.body)["error"]["type"] == "server_error"


def test_admission_turns_away_v1_requests_only_while_loading_or_draining() -> None:
    """Loading: 503 not_ready for /v1/ paths, others pass; draining: 503 with Retry-After."""
    loading = ServerState(ServerSettings(served_model_name="m"))
    reply = asyncio.run(_pipeline(_post(b"{}", "/v1/echo"), loading, admission=True))
    assert reply.status == 503 and reply.code() == "not_ready"
    reply = asyncio.run(_pipeline(_post(b"{}", "/echo"), loading, admission=True))
    assert reply.status == 200
    draining = ServerState(ServerSettings(served_model_name="m"), draining=True)
    reply = asyncio.run(_pipeline(_post(b"{}", "/v1/echo"), draining, admission=True))
    assert reply.status == 503 and reply.code() == "draining"
    assert "retry-after" in reply.headers


@pytest.mark.parametrize(
    ("version", "expect", "status", "continued"),
    [
        ("1.1", "100-continue", 200, True),
        ("1.1", "100-Continue", 200, True),
        ("1.1", "something-else", 417, False),
        ("1.0", "100-continue", 200, False),  # HTTP/1.0 has no interim responses
    ],
)
def test_expect_100_continue_is_answered_and_anything_else_is_a_417(
    version: str, expect: str, status: int, continued: bool
) -> None:
    """RFC 9110: 100-continue (any case) gets its interim 100; another expectation a 417."""
    raw = _post(b"{}", extra=f"Expect: {expect}\r\n").replace(
        b"HTTP/1.1", f"HTTP/{version}".encode()
    )
    reply = asyncio.run(_pipeline(raw))
    assert (reply.status, reply.continued) == (status, continued)


def test_expect_100_continue_with_a_content_length_over_the_limit_is_a_413_at_once() -> None:
    """The body would be sent in vain: the 413 comes instead of the 100 Continue."""
    state = ServerState(ServerSettings(served_model_name="m", max_body_bytes=_LIMIT))
    head = "Expect: 100-continue\r\n"
    over = asyncio.run(_pipeline(_post(_padded(_LIMIT + 1), extra=head), state))
    assert (over.status, over.continued, over.code()) == (413, False, "request_too_large")
    ok = asyncio.run(_pipeline(_post(_padded(_LIMIT), extra=head), state))
    assert (ok.status, ok.continued) == (200, True)


def test_the_access_log_size_of_a_continued_response_leaves_out_the_interim_100() -> None:
    """As aiohttp's own expect handler: `%b` counts the response's bytes, not the 100's."""
    sizes: list[int] = []
    raw = _post(b"{}", extra="Expect: 100-continue\r\n")
    ok = asyncio.run(_pipeline(raw, logged_sizes=sizes))
    assert ok.continued and ok.status == 200
    head = "\r\n".join(f"{k}: {v}" for k, v in ok.headers.items())
    assert sizes == [len("HTTP/1.1 200 OK\r\n") + len(head) + 4 + len(ok.body)]


def test_a_request_in_its_handler_has_stopped_its_headers_clock() -> None:
    """connection_middleware marks the request in flight and cancels its header deadline."""
    reply = asyncio.run(_pipeline(_get("/conn")))
    assert json.loads(reply.body) == {"in_request": True, "header_timer": False}


def test_a_body_that_does_not_arrive_in_time_is_a_408_that_says_how_much_did() -> None:
    """3 of 10 declared bytes within the body timeout: a 408 naming both, and the close."""
    head = b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{}}"
    reply = asyncio.run(_pipeline(head))
    assert reply.status == 408 and reply.headers["connection"] == "close"
    message = json.loads(reply.body)["error"]["message"]
    assert message == "request body not received within 0.1s (3 of 10 bytes arrived)"


def test_a_body_aiohttp_cannot_decode_is_a_400_naming_the_parser_s_reason() -> None:
    """Bad gzip: a 400 invalid_body with the decoder's one-line message, and the close."""
    reply = asyncio.run(_pipeline(_post(b"not gzip", extra="Content-Encoding: gzip\r\n")))
    assert (reply.status, reply.code()) == (400, "invalid_body")
    assert reply.headers["connection"] == "close"
    message = json.loads(reply.body)["error"]["message"]
    assert message == "malformed request body: Can not decode content-encoding: gzip"


# --- the listener's connections (listener.py) ------------------------------------------------


def test_sub_second_timeouts_are_valid_limits_and_zero_is_not() -> None:
    """The timeouts must only be positive (the tests and small deployments use fractions)."""
    limits = listener.ConnectionLimits(header_timeout_s=0.5, send_timeout_s=0.5)
    assert (limits.header_timeout_s, limits.send_timeout_s) == (0.5, 0.5)
    for field in ("keepalive_timeout_s", "header_timeout_s", "send_timeout_s"):
        with pytest.raises(ValueError, match=field):
            listener.ConnectionLimits(**{field: 0})


async def _app_listener(limits: listener.ConnectionLimits) -> tuple[Any, listener.Listener, int]:
    """A runner whose app answers GET / with "ok" (through connection_middleware), behind a
    Listener with `limits`: the runner, the listener and its port."""
    from aiohttp import web

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[connection_middleware])
    app.router.add_get("/", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    assert runner.server is not None
    ln = listener.Listener(runner.server, limits)
    return runner, ln, await ln.start("127.0.0.1", 0)


def test_a_request_whose_headers_stall_is_closed_first_or_after_a_kept_alive_one() -> None:
    """The header deadline runs from a request's first byte: for the connection's first request
    and for one after a completed request on the same (kept-alive) connection."""

    async def run() -> list[bytes]:
        limits = listener.ConnectionLimits(header_timeout_s=0.2, keepalive_timeout_s=3600)
        runner, ln, port = await _app_listener(limits)
        got = []
        try:
            for kept_alive in (False, True):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                if kept_alive:
                    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                    await reader.readuntil(b"ok")
                writer.write(b"GET / HTTP/1.1\r\nHo")  # and no more
                # EOF: the server closed it (a generous bound, not a speed target).
                got.append(await asyncio.wait_for(reader.read(), 30.0))
                writer.close()
        finally:
            await ln.close()
            await runner.cleanup()
        return got

    partial_only, after_one = asyncio.run(run())
    assert partial_only == b""
    assert after_one == b""  # its response was read above


def test_a_connection_lost_while_being_set_up_gives_its_slot_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client gone before its transport exists: the slot is released once and the accept
    loop goes on to the next client."""

    async def run() -> tuple[int, int]:
        runner, ln, port = await _app_listener(listener.ConnectionLimits(max_connections=1))
        loop = asyncio.get_running_loop()
        failed: list[int] = []

        async def gone(factory: Any, sock: socket.socket) -> None:
            factory()  # the protocol exists, the transport never will
            failed.append(ln.open)
            raise ConnectionResetError("reset by peer")

        monkeypatch.setattr(loop, "connect_accepted_socket", gone)
        clients = []
        try:
            for _ in range(2):
                c = socket.socket()
                c.setblocking(False)
                await loop.sock_connect(c, ("127.0.0.1", port))
                clients.append(c)
            for _ in range(600):  # the second is accepted only if the first slot came back
                if len(failed) == 2:
                    break
                await asyncio.sleep(0.05)
            return len(failed), ln.open
        finally:
            for c in clients:
                c.close()
            await ln.close()
            await runner.cleanup()

    assert asyncio.run(run()) == (2, 0)


def test_a_bad_body_nobody_read_is_one_quiet_line_naming_the_client(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 405 leaves a bad gzip body unread; aiohttp meets the error discarding it: the one
    WARNING line of a malformed request, with the client's address, not a traceback."""
    raw = _post(b"not gzip", "/conn", extra="Content-Encoding: gzip\r\n")
    with caplog.at_level(logging.DEBUG, logger=http_log.HTTP_LOGGER):
        reply = asyncio.run(_pipeline(raw))
    assert reply.status == 405
    mine = [r for r in caplog.records if r.name == http_log.HTTP_LOGGER]
    assert [(r.levelno, r.exc_info, r.getMessage()) for r in mine] == [
        (
            logging.WARNING,
            None,
            "malformed HTTP request from 127.0.0.1: 400 Can not decode content-encoding: gzip",
        )
    ]
