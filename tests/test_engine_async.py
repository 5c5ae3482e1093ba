"""AsyncEngine: streaming deltas from the engine thread, rejection before the first yield,
abort on disconnect, and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import pytest

from headroom.engine.async_engine import AsyncEngine, EngineClosed
from headroom.engine.config import EngineConfig
from headroom.engine.engine import Engine
from headroom.engine.errors import RequestRejected
from headroom.engine.outputs import RequestOutput
from headroom.engine.sampling import SamplingParams

CONFIG = EngineConfig(model="tiny", num_blocks=128, max_model_len=512, num_threads=1)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
T = TypeVar("T")


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine.from_config(CONFIG)
    await eng.start()
    yield eng
    await eng.shutdown(grace_s=0)


async def _collect(stream: AsyncIterator[RequestOutput]) -> tuple[list[int], str, RequestOutput]:
    ids: list[int] = []
    text = ""
    last = None
    async for out in stream:
        for c in out.outputs:
            ids.extend(c.token_ids)
            text += c.text
        last = out
    assert last is not None
    return ids, text, last


async def _until(predicate, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def test_concurrent_streams_match_the_sync_engine(engine: AsyncEngine) -> None:
    prompts = [[256, *range(65, 65 + n)] for n in (3, 11, 6)]
    reference = Engine.from_config(CONFIG).generate(prompts, GREEDY)
    results = await asyncio.gather(
        *(_collect(engine.stream(f"r{i}", p, GREEDY)) for i, p in enumerate(prompts))
    )
    for (ids, text, last), ref in zip(results, reference, strict=True):
        assert ids == ref.outputs[0].token_ids
        assert text == ref.outputs[0].text
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert last.first_token_time is not None and last.finished_time is not None
    assert engine.stats().requests_finished_total == 3


async def test_rejection_surfaces_before_the_first_output(engine: AsyncEngine) -> None:
    stream = engine.stream("too-long", [1] * 600, GREEDY)
    with pytest.raises(RequestRejected, match="max_model_len 512"):
        await stream.__anext__()
    with pytest.raises(RequestRejected, match="vocabulary"):
        await engine.stream("bad-ids", [99999], GREEDY).__anext__()
    # The engine keeps serving after rejections.
    ids, _, _ = await _collect(engine.stream("ok", [256, 1, 2], GREEDY))
    assert len(ids) == GREEDY.max_tokens


async def test_closing_the_stream_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stream = engine.stream("leaver", [256, *range(40)], long)
    got = 0
    async for _ in stream:
        got += 1
        if got == 3:
            break
    await stream.aclose()  # what the server does when the client disconnects
    await _until(lambda: engine.stats().kv.used == 0 and engine.stats().requests.running == 0)
    assert engine.engine.num_requests == 0


async def test_abort_from_outside_ends_the_stream(engine: AsyncEngine) -> None:
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stream = engine.stream("victim", [256, 5, 6], long)
    first = await stream.__anext__()
    assert not first.finished
    engine.abort("victim")
    last = first
    async for out in stream:
        last = out
    assert last.finished and last.outputs[0].finish_reason == "abort"
    await _until(lambda: engine.stats().kv.used == 0)


async def test_shutdown_finishes_or_aborts_then_refuses() -> None:
    eng = AsyncEngine.from_config(CONFIG)
    with pytest.raises(EngineClosed):
        await eng.stream("early", [1], GREEDY).__anext__()
    await eng.start()
    short = asyncio.create_task(_collect(eng.stream("short", [256, 1], GREEDY)))
    endless = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
    long_task = asyncio.create_task(_collect(eng.stream("long", [256, 2], endless)))
    await _until(lambda: eng.stats().requests.running == 2)
    await eng.shutdown(grace_s=0.0)
    _, _, short_last = await short
    _, _, long_last = await long_task
    assert short_last.finished and long_last.finished
    assert long_last.outputs[0].finish_reason in ("abort", "length")
    assert not eng.running
    with pytest.raises(EngineClosed):
        await eng.stream("late", [1], GREEDY).__anext__()


# -- a client gone while its request waits for the engine thread -----------------------------


class _StepGate:
    """Holds the engine thread inside `Engine.step` until `release()`: commands sent meanwhile
    queue up, as they do behind a long step of a big batch."""

    def __init__(self, eng: AsyncEngine) -> None:
        self.entered = threading.Event()
        self._open = threading.Event()
        real_step = eng.engine.step

        def gated_step() -> list[RequestOutput]:
            self.entered.set()
            self._open.wait()
            return real_step()

        eng.engine.step = gated_step  # type: ignore[method-assign]

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 60), "the engine never stepped"

    def release(self) -> None:
        self._open.set()


@pytest.fixture
async def gated() -> AsyncIterator[tuple[AsyncEngine, _StepGate]]:
    eng = AsyncEngine.from_config(CONFIG)
    gate = _StepGate(eng)
    await eng.start()
    try:
        yield eng, gate
    finally:
        gate.release()
        await eng.shutdown(grace_s=0)


async def _while_alive(eng: AsyncEngine, awaitable: Awaitable[T], bound_s: float = 60.0) -> T:
    """Await `awaitable`, failing at once if the engine thread dies meanwhile (its streams
    would hang forever); `bound_s` is a correctness bound, not a speed target."""
    task = asyncio.ensure_future(awaitable)
    deadline = asyncio.get_running_loop().time() + bound_s
    while not task.done():
        if not eng.running or asyncio.get_running_loop().time() > deadline:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise AssertionError("the engine thread died" if not eng.running else "no result")
        await asyncio.wait({task}, timeout=0.05)
    return task.result()


async def _cancel_while_queued(eng: AsyncEngine, request_id: str) -> None:
    """Open a stream, let it queue its request behind the held step, then cancel it, as the
    server's handler is cancelled when its client disconnects."""
    task = asyncio.create_task(anext(eng.stream(request_id, [256, 67, 68], GREEDY)))
    await _until(lambda: not eng._commands.empty())  # its request is queued, not yet handled
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_stream_cancelled_while_its_request_is_queued_leaves_the_engine_serving(
    gated: tuple[AsyncEngine, _StepGate],
) -> None:
    eng, gate = gated
    busy = asyncio.create_task(_collect(eng.stream("busy", [256, 65, 66], GREEDY)))
    await gate.wait_entered()
    await _cancel_while_queued(eng, "gone")
    gate.release()
    ids, _, last = await _while_alive(eng, busy)
    assert len(ids) == GREEDY.max_tokens and last.outputs[0].finish_reason == "length"
    assert eng.running, "the engine thread died"
    ids, _, _ = await _while_alive(eng, _collect(eng.stream("after", [256, 69], GREEDY)))
    assert len(ids) == GREEDY.max_tokens
    assert eng.running and eng.health.healthy
    # The cancelled request was never admitted: no blocks, no request, not counted.
    assert eng.engine.num_requests == 0
    assert eng.engine.scheduler.kv.pool.num_used == 0
    stats = eng.stats()
    assert stats.requests_arrived_total == stats.requests_finished_total == 2
    assert stats.kv.used == 0


async def test_a_cancelled_stream_never_aborts_another_request_with_its_id(
    gated: tuple[AsyncEngine, _StepGate],
) -> None:
    eng, gate = gated
    first = asyncio.create_task(_collect(eng.stream("same-id", [256, 65, 66], GREEDY)))
    await gate.wait_entered()
    # A second stream reusing the id leaves before its request is handled: its cleanup must
    # not abort the first stream's request.
    await _cancel_while_queued(eng, "same-id")
    gate.release()
    ids, _, last = await _while_alive(eng, first)
    assert last.outputs[0].finish_reason == "length" and len(ids) == GREEDY.max_tokens
    assert eng.running and eng.engine.scheduler.kv.pool.num_used == 0


async def test_a_command_that_raises_does_not_kill_the_engine_thread(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_abort = engine.engine.abort
    calls = 0

    def abort_once_broken(request_id: str) -> RequestOutput | None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("broken abort")
        return real_abort(request_id)

    monkeypatch.setattr(engine.engine, "abort", abort_once_broken)
    with caplog.at_level(logging.ERROR, logger="headroom.engine.async_engine"):
        engine.abort("whoever")
        ids, _, _ = await _while_alive(engine, _collect(engine.stream("next", [256, 1, 2], GREEDY)))
    assert calls >= 1 and len(ids) == GREEDY.max_tokens
    assert engine.running
    assert "engine command failed" in caplog.text
