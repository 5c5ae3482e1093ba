"""The step watchdog: a model step that never returns (a hung kernel or collective) fails the
probes and `/stats` once it runs past the step timeout, and shutdown gives up on the engine
thread after the grace period plus a margin instead of waiting for it forever."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from headroom.engine.async_engine import AsyncEngine, EngineClosed
from headroom.engine.config import EngineConfig
from headroom.engine.engine import Engine
from headroom.engine.health import EngineHealth
from headroom.engine.sampling import SamplingParams
from headroom.engine.server.app import ServerSettings, ServerState, create_app
from headroom.engine.server.runner import attach_engine

CONFIG = EngineConfig(model="tiny", num_blocks=96, max_model_len=512, num_threads=1)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class HangingStep:
    """Wraps `Engine.step`: once `hang()` is called, the next step blocks until `release()`."""

    def __init__(self, engine: Engine) -> None:
        self._real = engine.step
        self._armed = threading.Event()
        self._released = threading.Event()
        self.entered = threading.Event()

    def __call__(self) -> Any:
        if self._armed.is_set():
            self.entered.set()
            self._released.wait()
        return self._real()

    def hang(self) -> None:
        self._armed.set()

    def release(self) -> None:
        self._armed.clear()
        self._released.set()


@pytest.fixture
def engine() -> Iterator[tuple[AsyncEngine, HangingStep]]:
    eng = AsyncEngine(Engine.from_config(CONFIG), EngineHealth(step_timeout_s=0.2))
    hanging = HangingStep(eng.engine)
    eng.engine.step = hanging  # type: ignore[method-assign]
    yield eng, hanging
    hanging.release()  # whatever the test did, let the thread go
    if eng.thread is not None:
        eng.thread.join(10)


async def _drain(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        pass


async def _wait(predicate: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_a_step_stuck_past_the_step_timeout_fails_health_ready_and_stats(
    engine: tuple[AsyncEngine, HangingStep],
) -> None:
    eng, hanging = engine
    await eng.start()
    state = ServerState(ServerSettings(served_model_name="tiny"))
    attach_engine(state, eng, CONFIG.model, 512)
    server = TestServer(create_app(state))
    await server.start_server()
    base = str(server.make_url(""))
    request = None
    try:
        async with aiohttp.ClientSession() as http:

            async def status(path: str) -> int:
                async with http.get(base + path) as resp:
                    return resp.status

            assert [await status(p) for p in ("/health", "/ready", "/stats")] == [200] * 3
            hanging.hang()
            request = asyncio.ensure_future(_drain(eng.stream("r1", [256, 1, 2], GREEDY)))
            await asyncio.to_thread(hanging.entered.wait, 10)

            async def health_fails() -> bool:
                return await status("/health") == 503

            await _wait(health_fails)
            for path in ("/health", "/ready", "/stats"):
                async with http.get(base + path) as resp:
                    assert resp.status == 503, path
                    body = await resp.text()
                    assert "model step" in body and "stuck" in body, (path, body)
            # The snapshot is frozen while the step hangs: not served as if it were current.
            with pytest.raises(EngineClosed, match="stuck"):
                eng.stats()
            with pytest.raises(EngineClosed, match="stuck"):
                await eng.stream("r2", [256, 3], GREEDY).__anext__()

            # The step returns after all: the engine serves again.
            hanging.release()
            await asyncio.wait_for(request, 10)
            assert [await status(p) for p in ("/health", "/ready", "/stats")] == [200] * 3
    finally:
        hanging.release()
        if request is not None:
            request.cancel()
            with contextlib.suppress(BaseException):
                await request
        await server.close()
        await eng.shutdown(grace_s=0)


async def test_shutdown_leaves_a_hung_engine_thread_behind_and_ends_its_streams(
    engine: tuple[AsyncEngine, HangingStep],
) -> None:
    eng, hanging = engine
    await eng.start()
    hanging.hang()
    request = asyncio.ensure_future(_drain(eng.stream("r1", [256, 1, 2], GREEDY)))
    await asyncio.to_thread(hanging.entered.wait, 10)
    try:
        # Without a bound on the wait for the thread, this never returns while the step hangs.
        stopped = await asyncio.wait_for(eng.shutdown(grace_s=0.1, stop_margin_s=0.1), 10)
    except TimeoutError:
        hanging.release()  # before the event loop closes: it would wait for the join
        raise
    assert stopped is False
    thread = eng.thread
    assert thread is not None and thread.is_alive()
    assert thread.daemon  # it cannot hold the process at exit
    with pytest.raises(EngineClosed, match="did not stop"):
        await asyncio.wait_for(request, 10)


def test_the_watchdog_fires_only_past_the_step_timeout_and_stands_down_when_it_returns() -> None:
    health = EngineHealth(step_timeout_s=60)
    health.step_started(7)
    now = time.monotonic()
    assert health.stuck_step(now=now + 30) is None
    assert "model step 7 stuck" in (health.stuck_step(now=now + 61) or "")
    health.step_ended()
    assert health.stuck_step(now=now + 1000) is None
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="step_timeout_s"):
            EngineHealth(step_timeout_s=bad)


def _stuck_in_a_kernel(
    health: EngineHealth, started: threading.Event, done: threading.Event
) -> None:
    health.step_started(3)
    started.set()
    done.wait(30)


def test_the_watchdog_logs_why_and_where_the_step_is_stuck_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One log line with the reason (as serve's format prints it) and one with the stuck
    thread's stack, whatever the number of probes that find it stuck."""
    from headroom.engine.server.log_format import FORMAT, KeyValueFormatter

    health = EngineHealth(step_timeout_s=60)
    started, done = threading.Event(), threading.Event()
    t = threading.Thread(target=_stuck_in_a_kernel, args=(health, started, done))
    t.start()
    try:
        assert started.wait(10)
        with caplog.at_level("ERROR", logger="headroom.engine.health"):
            for _ in range(3):
                assert health.stuck_step(now=time.monotonic() + 61) is not None
    finally:
        done.set()
        t.join()
    lines = [KeyValueFormatter(FORMAT).format(r) for r in caplog.records]
    assert len(lines) == 2, lines
    assert "watchdog fired" in lines[0] and "reason='model step 3 stuck" in lines[0]
    assert "_stuck_in_a_kernel" in lines[1] and "done.wait(30)" in lines[1]
