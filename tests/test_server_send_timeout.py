"""Clients that stop reading a response: once the socket's buffers are full, a write that
cannot go on within the listener's send timeout aborts the connection, which frees its slot
and, for a completion, aborts the engine request and frees its KV blocks."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from headroom.engine.async_engine import AsyncEngine
from headroom.engine.config import EngineConfig
from headroom.engine.server import listener
from headroom.engine.server.app import ServerSettings, ServerState, create_app
from headroom.engine.server.runner import attach_engine

CONFIG = EngineConfig(model="tiny", num_blocks=1024, max_model_len=2048, num_threads=1)
# A correctness bound (the connection does get closed), not a speed target.
WAIT_S = 60.0


async def _until(what: str, predicate: Callable[[], bool]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"not within {WAIT_S:.0f}s: {what}")
        await asyncio.sleep(0.05)


async def _non_reader(port: int, request: bytes) -> socket.socket:
    """A client with a tiny receive buffer that sends `request` and never reads."""
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.setblocking(False)
    await asyncio.get_running_loop().sock_connect(c, ("127.0.0.1", port))
    await asyncio.get_running_loop().sock_sendall(c, request)
    return c


async def _serve(
    app: web.Application, send_timeout_s: float
) -> tuple[web.AppRunner, listener.Listener, int]:
    # As in runner.serve: a client that goes away cancels its handler.
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    assert runner.server is not None
    limits = listener.ConnectionLimits(send_timeout_s=send_timeout_s, keepalive_timeout_s=60)
    ln = listener.Listener(runner.server, limits)
    port = await ln.start("127.0.0.1", 0)
    # Accepted sockets inherit it: the buffers fill after kilobytes, not megabytes.
    assert ln.sock is not None
    ln.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return runner, ln, port


async def test_a_response_body_the_client_never_reads_closes_the_connection() -> None:
    cancelled = asyncio.Event()

    async def big(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        try:
            for _ in range(256):  # 64 MiB: far more than the socket buffers hold
                await resp.write(b"x" * 2**18)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return resp

    app = web.Application()
    app.router.add_get("/big", big)
    runner, ln, port = await _serve(app, send_timeout_s=0.5)
    try:
        c = await _non_reader(port, b"GET /big HTTP/1.1\r\nHost: t\r\n\r\n")
        await _until("the connection was accepted", lambda: ln.open == 1)
        await _until("the stalled connection was closed", lambda: ln.open == 0)
        await _until("the handler was cancelled", cancelled.is_set)
        c.close()
    finally:
        await ln.close()
        await runner.cleanup()


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine.from_config(CONFIG)
    await eng.start()
    yield eng
    await eng.shutdown(grace_s=0)


async def test_a_stream_the_client_stops_reading_is_aborted_and_frees_its_blocks(
    engine: AsyncEngine,
) -> None:
    state = ServerState(ServerSettings(served_model_name="tiny"))
    attach_engine(state, engine, CONFIG.model, CONFIG.max_model_len or 0)
    runner, ln, port = await _serve(create_app(state), send_timeout_s=0.5)
    assert engine.stats().kv.used == 0
    body = json.dumps(
        {"prompt": "x", "max_tokens": 1500, "n": 8, "stream": True, "ignore_eos": True,
         "temperature": 0}
    ).encode()  # fmt: skip
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    try:
        c = await _non_reader(port, head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await _until("the request holds blocks", lambda: engine.stats().kv.used > 0)
        await _until("the stalled connection was closed", lambda: ln.open == 0)
        await _until(
            "the request was aborted and its blocks freed",
            lambda: (s := engine.stats()).requests.running == 0 and s.kv.used == 0,
        )
        c.close()
    finally:
        await ln.close()
        await runner.cleanup()
