"""Hostile input against a real `headroom serve --model tiny` process over raw sockets: bodies
that used to crash a handler get a 400 in OpenAI's schema, malformed HTTP leaves one quiet log
line, slow or idle clients are cut off by the timeouts, and under a small open-files limit the
connection cap keeps the server answering and its log small (issue 24, section 3)."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from engine_process import ServerProcess

KEY = "k3y"
AUTH = f"Authorization: Bearer {KEY}\r\n".encode()
# Generous bounds for reads that wait on a server-side timeout of 1-2 s: a correctness bound
# (the connection does get closed), not a speed target.
WAIT_S = 60.0


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """Keep-alive long, headers and body short: each timeout can be seen on its own."""
    with ServerProcess(
        "--model", "tiny", "--max-model-len", "512", "--num-blocks", "256",
        "--keepalive-timeout", "60", "--header-timeout", "1", "--body-timeout", "1",
        env={"HEADROOM_API_KEY": KEY},
    ) as srv:  # fmt: skip
        yield srv


def _connect(srv: ServerProcess) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT_S)
    s.settimeout(WAIT_S)
    return s


def _read_to_close(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (fails if it never does)."""
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        except TimeoutError:
            raise AssertionError(f"connection still open after {WAIT_S:.0f}s: {out!r}") from None
        if not chunk:
            return out
        out += chunk


def _exchange(srv: ServerProcess, data: bytes) -> bytes:
    with _connect(srv) as s:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            s.sendall(data)
        return _read_to_close(s)


def _post(srv: ServerProcess, path: str, body: bytes, headers: bytes = AUTH) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n"
    ).encode()
    return _exchange(srv, head + headers + b"\r\n" + body)


def _status_and_json(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


def _log_since(srv: ServerProcess, mark: int) -> list[str]:
    time.sleep(0.2)  # the reader thread copies the server's output line by line
    lines: list[str] = srv.lines[mark:]
    return lines


# ---- inputs that used to be a 500 ---------------------------------------------------------


def test_json_nested_1100_deep_is_a_400_not_a_recursion_error(server: ServerProcess) -> None:
    mark = len(server.lines)
    body = b'{"prompt": ' + b"[" * 1100 + b"]" * 1100 + b"}"
    status, err = _status_and_json(_post(server, "/v1/completions", body))
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["code"] == "invalid_json"
    assert "nested too deeply" in err["error"]["message"]
    assert not any("Traceback" in ln for ln in _log_since(server, mark))


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": [' + b"1" * 5000 + b'], "max_tokens": 1}',
        b'{"prompt": "hi", "max_tokens": ' + b"9" * 4400 + b"}",
    ],
    ids=["token-id", "max_tokens"],
)
def test_an_integer_over_4300_digits_is_a_400_not_a_500(server: ServerProcess, body: bytes) -> None:
    # json.loads raises a plain ValueError (no JSONDecodeError) past Python's int-string limit.
    mark = len(server.lines)
    status, err = _status_and_json(_post(server, "/v1/completions", body))
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["code"] == "invalid_json"
    assert "4300 digits" in err["error"]["message"]
    assert "sys." not in err["error"]["message"]  # nothing the client could act on
    assert not any("Traceback" in ln for ln in _log_since(server, mark))


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\udfff"], "max_tokens": 1}, "prompt[1]"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 1},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}],
                "max_tokens": 1,
            },
            "messages[0].content[0].text",
        ),
    ],
)
def test_a_lone_surrogate_in_a_prompt_or_chat_content_is_a_400_naming_the_field(
    server: ServerProcess, path: str, body: dict[str, Any], field: str
) -> None:
    mark = len(server.lines)
    # json.dumps writes the lone surrogate as the escape "\ud800", as a client would.
    status, err = _status_and_json(_post(server, path, json.dumps(body).encode()))
    assert status == 400, err
    assert err["error"]["param"] == field
    assert err["error"]["code"] == "invalid_unicode"
    assert "lone UTF-16 surrogate" in err["error"]["message"]
    assert not any("Traceback" in ln for ln in _log_since(server, mark))


def test_a_surrogate_pair_is_ordinary_text(server: ServerProcess) -> None:
    body = json.dumps({"prompt": "smile \U0001f600", "max_tokens": 1}).encode()
    assert b"\\ud83d\\ude00" in body  # the escaped pair, as json.dumps sends it
    status, out = _status_and_json(_post(server, "/v1/completions", body))
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] > 0


def test_a_non_utf8_bearer_token_is_a_400(server: ServerProcess) -> None:
    mark = len(server.lines)
    raw = _post(
        server, "/v1/completions", b'{"prompt": "a"}', b"Authorization: Bearer \xff\xfe\r\n"
    )
    status, err = _status_and_json(raw)
    assert status == 400, err
    assert err["error"]["code"] == "invalid_authorization_header"
    assert "UTF-8" in err["error"]["message"]
    assert not any("Traceback" in ln for ln in _log_since(server, mark))


# ---- malformed HTTP: one quiet line, no traceback -------------------------------------------

MALFORMED = {
    "a 20 KB URL": b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: t\r\n\r\n",
    "Content-Length -5": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: -5\r\n\r\n",
    "Content-Length and Transfer-Encoding": (
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "a 100 KB header": b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"b" * 100_000 + b"\r\n\r\n",
    "10,000 headers": (
        b"GET /health HTTP/1.1\r\nHost: t\r\n"
        + b"".join(b"X-H%d: v\r\n" % i for i in range(10_000))
        + b"\r\n"
    ),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_http_gets_a_400_and_one_quiet_log_line(server: ServerProcess, kind: str) -> None:
    mark = len(server.lines)
    raw = _exchange(server, MALFORMED[kind])
    assert raw.split(b"\r\n", 1)[0].endswith(b"400 Bad Request"), raw[:200]
    lines = [ln for ln in _log_since(server, mark) if ln.strip()]
    assert len(lines) == 1, lines
    assert "WARNING" in lines[0] and "malformed HTTP request from 127.0.0.1: 400" in lines[0]
    assert len(lines[0]) < 400  # the client's bytes are quoted shortened, on one line


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_that_does_not_decompress_is_a_400_and_at_most_one_quiet_log_line(
    server: ServerProcess, encoding: str
) -> None:
    mark = len(server.lines)
    headers = AUTH + f"Content-Encoding: {encoding}\r\n".encode()
    status, err = _status_and_json(_post(server, "/v1/completions", b"0123456789", headers))
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["code"] == "invalid_body"
    assert encoding in err["error"]["message"]
    lines = [ln for ln in _log_since(server, mark) if ln.strip()]
    assert len(lines) <= 1, lines
    assert all("WARNING" in ln for ln in lines), lines


def test_a_401_before_a_malformed_body_is_read_logs_at_most_one_quiet_line(
    server: ServerProcess,
) -> None:
    """aiohttp reads the unread body after the response and meets the bad gzip there."""
    mark = len(server.lines)
    raw = _post(server, "/v1/completions", b"0123456789", b"Content-Encoding: gzip\r\n")
    status, err = _status_and_json(raw)
    assert status == 401, err
    lines = [ln for ln in _log_since(server, mark) if ln.strip()]
    assert len(lines) <= 1, lines
    assert not any("Unhandled exception" in ln or "Traceback" in ln for ln in lines), lines


# ---- Expect: 100-continue, 405 -------------------------------------------------------------

EXPECT = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        (b"Content-Length: 5000000\r\n", 401, "invalid_api_key"),
        (AUTH + b"Content-Length: 5000000000\r\n", 413, "request_too_large"),
    ],
    ids=["no key", "too large"],
)
def test_expect_100_continue_is_refused_before_the_body_is_invited(
    server: ServerProcess, headers: bytes, status: int, code: str
) -> None:
    with _connect(server) as s:
        s.sendall(EXPECT + headers + b"\r\n")
        raw = _read_to_close(s)
    assert not raw.startswith(b"HTTP/1.1 100"), raw[:200]
    got, err = _status_and_json(raw)
    assert got == status, err
    assert err["error"]["code"] == code


def test_expect_100_continue_with_a_good_key_and_size_invites_the_body(
    server: ServerProcess,
) -> None:
    body = b'{"prompt": "a", "max_tokens": 1}'
    head = b"Content-Length: %d\r\nContent-Type: application/json\r\nConnection: close\r\n"
    with _connect(server) as s:
        s.sendall(EXPECT + AUTH + head % len(body) + b"\r\n")
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += s.recv(4096)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        status, out = _status_and_json(_read_to_close(s))
    assert status == 200, out


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [("GET", "/v1/completions", {"POST"}), ("POST", "/health", {"GET", "HEAD"})],
)
def test_a_405_names_the_allowed_methods(
    server: ServerProcess, method: str, path: str, allowed: set[str]
) -> None:
    """RFC 9110 15.5.6: a 405 must carry Allow, also with the OpenAI error body."""
    request = f"{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
    raw = _exchange(server, request.encode() + AUTH + b"Content-Length: 0\r\n\r\n")
    head = raw.partition(b"\r\n\r\n")[0].decode().split("\r\n")
    fields = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in head[1:])}
    status, err = _status_and_json(raw)
    assert status == 405, err
    assert err["error"]["type"] == "invalid_request_error"
    assert set(fields.get("allow", "").split(",")) == allowed, head


# ---- timeouts -------------------------------------------------------------------------------


def test_a_header_trickled_byte_by_byte_is_cut_off_by_the_header_timeout(
    server: ServerProcess,
) -> None:
    header = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"z" * 200 + b"\r\n\r\n"
    sent = 0
    with _connect(server) as s:
        s.settimeout(0.25)
        deadline = time.monotonic() + WAIT_S
        while sent < len(header) and time.monotonic() < deadline:
            try:
                s.sendall(header[sent : sent + 1])
                sent += 1
                got = s.recv(1024)
            except TimeoutError:
                continue  # still open; next byte
            except (BrokenPipeError, ConnectionResetError):
                break
            assert got == b"", f"a response to a header that never finished: {got!r}"
            break
    assert sent < len(header), "the server waited for the whole trickled header"


def test_a_body_shorter_than_its_content_length_gets_408_and_the_connection_closes(
    server: ServerProcess,
) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        + AUTH
        + b"Content-Length: 100\r\n\r\n"
    )
    raw = _exchange(server, head + b'{"prompt": ')
    status, err = _status_and_json(raw)
    assert status == 408, err
    assert err["error"]["code"] == "request_timeout"
    assert "11 of 100 bytes" in err["error"]["message"]


def test_keep_alive_connections_serve_one_request_after_another(server: ServerProcess) -> None:
    """The header deadline belongs to each request: a pause between two requests on one
    connection (longer than the header timeout, shorter than keep-alive) is fine."""
    request = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
    with _connect(server) as s:
        for _ in range(2):
            s.sendall(request)
            head = b""
            while b"\r\n\r\n" not in head:
                head += s.recv(4096)
            assert head.startswith(b"HTTP/1.1 200"), head
            time.sleep(1.5)


def test_timeout_flags_must_be_positive() -> None:
    from headroom.engine.server.cli import main

    for flag in ("--keepalive-timeout", "--header-timeout", "--body-timeout"):
        assert main(["--model", "tiny", flag, "0"]) == 2


# ---- an open-files limit of 256 and 300 slow clients --------------------------------------


@contextlib.contextmanager
def _limited_server(open_files: int, keepalive_s: float, *args: str) -> Iterator[ServerProcess]:
    """A server whose open-files limit is `open_files` (a child inherits it at fork)."""
    srv = ServerProcess(
        "--model", "tiny", "--max-model-len", "512", "--num-blocks", "64",
        "--keepalive-timeout", str(keepalive_s), *args, wait_ready=False,
    )  # fmt: skip
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, old[1]))
    try:
        srv.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)
    try:
        srv.wait_until_ready()
        yield srv
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            srv.terminate()


def _slow_clients(srv: ServerProcess, n: int) -> list[socket.socket]:
    """`n` connections that each send half a request line and then nothing."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", srv.port))  # completes in the kernel's listen queue
        socks.append(s)
    time.sleep(0.5)
    for s in socks:
        with contextlib.suppress(OSError):
            s.send(b"GET /health HTTP/1.1\r\nHo")
    return socks


def _health_answers(srv: ServerProcess) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(srv.url + "/health", timeout=5) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    return False


@pytest.fixture
def many_files() -> Iterator[None]:
    """This test process opens 300 sockets of its own."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(4096, old[1]) if old[1] != resource.RLIM_INFINITY else 4096
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(old[0], want), old[1]))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, old)


def test_300_slow_clients_under_256_open_files_leave_health_answering(many_files: None) -> None:
    with _limited_server(256, 2) as srv:
        socks = _slow_clients(srv, 300)
        try:
            assert _health_answers(srv), "/health never answered"
            assert srv.proc is not None and srv.proc.poll() is None
        finally:
            for s in socks:
                s.close()
        log = srv.output
    assert "out of system resource" not in log and "Too many open files" not in log, log[-2000:]
    assert "Traceback" not in log, log[-2000:]
    # The cap engaged (the rest waited in the listen queue), and said so once, not per client.
    full = [ln for ln in log.splitlines() if "connections open (--max-connections)" in ln]
    assert 1 <= len(full) <= 3, full


def test_running_out_of_file_descriptors_logs_one_line_not_a_storm(many_files: None) -> None:
    """A cap set above the open-files limit: accept() fails with EMFILE. The log gets a line
    per 10 s (asyncio's own loop wrote tens of thousands of traceback lines a second)."""
    # 128 files and 5 s of keep-alive: the 300 clients are surely all open at once.
    with _limited_server(128, 5, "--max-connections", "1000") as srv:
        socks = _slow_clients(srv, 300)
        try:
            assert _health_answers(srv), "/health never answered"
        finally:
            for s in socks:
                s.close()
        log = srv.output
    emfile = [ln for ln in log.splitlines() if "cannot accept connections" in ln]
    assert 1 <= len(emfile) <= 3, emfile
    assert "Too many open files" in emfile[0]
    assert "out of system resource" not in log and "Traceback" not in log, log[-2000:]
    assert len(log) < 20_000
