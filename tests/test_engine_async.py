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
import torch

from headroom.engine import engine as engine_module
from headroom.engine.async_engine import AsyncEngine, EngineClosed, _Sink
from headroom.engine.config import EngineConfig
from headroom.engine.engine import Engine
from headroom.engine.errors import EngineConfigError, RequestFailed, RequestRejected
from headroom.engine.health import EngineHealth
from headroom.engine.outputs import RequestOutput
from headroom.engine.requests import Completion, Request
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


# -- pinned by mutation testing --------------------------------------------------------------


async def test_closing_the_stream_early_aborts_its_request(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream closed before its last output aborts the request, rather than letting it run
    on to `max_tokens` with nobody reading."""
    aborted: list[str] = []
    real_abort = engine.engine.abort

    def recording_abort(request_id: str) -> RequestOutput | None:
        aborted.append(request_id)
        return real_abort(request_id)

    monkeypatch.setattr(engine.engine, "abort", recording_abort)
    long = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
    stream = engine.stream("quitter", [256, 7, 8], long)
    assert not (await stream.__anext__()).finished
    await stream.aclose()
    await _until(lambda: aborted == ["quitter"])
    await _until(lambda: engine.stats().kv.used == 0)
    assert engine.stats().generation_tokens_total < long.max_tokens


async def test_shutdown_lets_running_requests_finish_within_the_grace() -> None:
    """`shutdown(grace_s)` refuses new streams at once, lets a running request finish on its
    own, returns as soon as it has (not at the end of the grace), and then reports True."""
    eng = AsyncEngine.from_config(CONFIG)
    await eng.start()
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    task = asyncio.create_task(_collect(eng.stream("graced", [256, 3], long)))
    await _until(lambda: eng.stats().requests.running == 1)
    shutting = asyncio.create_task(eng.shutdown(grace_s=3600.0))
    await asyncio.sleep(0)  # one loop turn: shutdown has begun its grace period
    assert not shutting.done()
    with pytest.raises(EngineClosed):
        await eng.stream("late", [256, 4], GREEDY).__anext__()
    # It returns once the request is done, not at the end of the grace (a correctness bound).
    assert await asyncio.wait_for(shutting, 120) is True
    ids, _, last = await task
    assert last.outputs[0].finish_reason == "length" and len(ids) == long.max_tokens
    assert eng.thread is None and not eng.running


async def test_shutdown_serves_the_requests_waiting_for_kv_too() -> None:
    """A draining pod's queue is served, not turned away: a request admitted but waiting for
    blocks when the drain begins runs once the first frees its blocks, within the grace. Only
    new streams are refused (the server's 503)."""
    eng = AsyncEngine.from_config(
        EngineConfig(model="tiny", num_blocks=4, block_size=16, max_model_len=64, num_threads=1)
    )
    await eng.start()
    both = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # 3 of the 4 blocks
    first = asyncio.create_task(_collect(eng.stream("first", [256, 5], both)))
    await _until(lambda: eng.stats().requests.running == 1)
    queued = asyncio.create_task(_collect(eng.stream("queued", [256, 6], both)))
    await _until(lambda: eng.stats().requests.waiting == 1)
    assert await asyncio.wait_for(eng.shutdown(grace_s=3600.0), 120) is True
    for task in (first, queued):
        ids, _, last = await task
        assert last.outputs[0].finish_reason == "length" and len(ids) == both.max_tokens


async def test_a_stream_is_refused_once_the_engine_thread_has_stopped(
    engine: AsyncEngine,
) -> None:
    """A stream opened after the engine thread ended (still marked accepting) gets
    `EngineClosed` at once instead of queueing a request no thread will ever handle."""
    engine._commands.put(None)  # the thread's stop signal, without shutdown's bookkeeping
    await _until(lambda: not engine.running)
    with pytest.raises(EngineClosed, match="not accepting"):
        await asyncio.wait_for(engine.stream("orphan", [256, 1], GREEDY).__anext__(), 30)


async def test_the_first_entry_wakes_a_stream_waiting_on_an_empty_sink() -> None:
    """An entry put into an empty sink from the engine thread wakes the stream already waiting
    on it: a request whose only output is its last (or an error) must not hang."""
    sink = _Sink(asyncio.get_running_loop())
    getter = asyncio.create_task(sink.get())
    await asyncio.sleep(0)  # one loop turn: the getter is now waiting on the empty sink
    assert not getter.done()
    error = RequestFailed("lonely", RuntimeError("boom"))
    await asyncio.to_thread(sink.put, error)
    assert await asyncio.wait_for(getter, 30) is error


async def test_steps_are_numbered_from_one_for_the_watchdog(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine thread reports steps 1, 2, 3, ... to `health`, whose stuck-step reason names
    the step by that number."""
    started: list[int] = []
    real_started = engine.health.step_started

    def recording_started(step: int) -> None:
        started.append(step)
        real_started(step)

    monkeypatch.setattr(engine.health, "step_started", recording_started)
    await _collect(engine.stream("counted", [256, 1], GREEDY))
    assert len(started) >= GREEDY.max_tokens
    assert started == list(range(1, len(started) + 1))


async def test_aborts_queued_during_a_step_all_take_effect_before_the_next_step(
    engine: AsyncEngine,
) -> None:
    """Every command queued while a step runs is handled before the next step: two aborts
    sent during one step leave no step that runs with only one of them applied."""
    hold, entered, release = threading.Event(), threading.Event(), threading.Event()
    batch_sizes: list[int] = []
    real_step = engine.engine.step

    def held_step() -> list[RequestOutput]:
        batch_sizes.append(engine.engine.num_requests)
        if hold.is_set():
            hold.clear()
            entered.set()
            release.wait()
        return real_step()

    engine.engine.step = held_step  # type: ignore[method-assign]
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    tasks = [asyncio.create_task(_collect(engine.stream(rid, [256, 9, 10], long))) for rid in "ab"]
    await _until(lambda: engine.stats().requests.running == 2)
    hold.set()
    assert await asyncio.to_thread(entered.wait, 60), "the engine never stepped"
    engine.abort("a")
    engine.abort("b")
    release.set()
    for task in tasks:
        _, _, last = await _while_alive(engine, task)
        assert last.outputs[0].finish_reason == "abort"
    await _until(lambda: engine.stats().requests.running == 0)
    assert batch_sizes[-1] == 2, batch_sizes


class _HealthThatRaisesOnTheEngineThread(EngineHealth):
    """Healthy to the event loop, but its check raises on the engine thread: an `_Add` whose
    handling fails outside `Engine.add_request`."""

    @property
    def healthy(self) -> bool:
        if threading.current_thread().name == "headroom-engine":
            raise RuntimeError("broken health check")
        return True


async def test_a_request_whose_command_raises_fails_its_stream_instead_of_hanging() -> None:
    """A submit command that raises on the engine thread ends its stream with that error
    (the thread logs it and goes on); the stream is not left waiting forever."""
    eng = AsyncEngine(Engine.from_config(CONFIG), _HealthThatRaisesOnTheEngineThread())
    await eng.start()
    try:
        with pytest.raises(RuntimeError, match="broken health check"):
            await asyncio.wait_for(eng.stream("doomed", [256, 1], GREEDY).__anext__(), 30)
        assert eng.running
    finally:
        await eng.shutdown(grace_s=0)


async def test_a_failed_decode_is_the_requests_problem_not_a_failed_step(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose decoding raises fails alone, and `health` counts no failed step: the
    forward pass worked, so it is not a step failure towards turning unhealthy."""
    real_on_token = engine.engine._on_token

    def on_token(req: Request, comp: Completion, token: int, now: float) -> None:
        if req.request_id == "undecodable":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        real_on_token(req, comp, token, now)

    monkeypatch.setattr(engine.engine, "_on_token", on_token)
    with pytest.raises(RequestFailed, match="UnicodeDecodeError"):
        await _collect(engine.stream("undecodable", [256, 1], GREEDY))
    assert engine.health.failed_steps_total == 0 and engine.health.consecutive_failures == 0


def test_ttft_and_tpot_are_measured_from_arrival_and_first_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TTFT is first token minus arrival; TPOT is (last - first token) / (tokens - 1), for
    completions of two or more tokens only (a one-token completion has no inter-token time)."""
    ticks = iter(range(10, 1000))
    monkeypatch.setattr(engine_module, "steady_time", lambda: float(next(ticks)))
    eng = Engine.from_config(CONFIG)
    for rid, arrival, max_tokens in (("four", 7.0, 4), ("one", 9.0, 1), ("two", 9.0, 2)):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        eng.add_request(rid, [256, 1, 2], params, arrival_time=arrival)
    while eng.has_unfinished():  # steps at t = 10, 11, 12, 13
        eng.step()
    stats = eng.stats()
    ttft, tpot = stats.time_to_first_token_seconds, stats.time_per_output_token_seconds
    assert (ttft.count, ttft.sum) == (3, pytest.approx(3.0 + 1.0 + 1.0))
    assert (tpot.count, tpot.sum) == (2, pytest.approx((11 - 10) / 1 + (13 - 10) / 3))


def test_kv_cache_memory_bytes_sizes_the_pool_in_whole_blocks_down_to_one() -> None:
    """Without `num_blocks`, the pool is `kv_cache_memory_bytes // bytes per block` whole
    blocks: one block and a bit is a one-block pool, less than one block is refused."""
    per_block = Engine.from_config(CONFIG).bytes_per_token * CONFIG.block_size
    for blocks in (1, 3):
        memory = blocks * per_block + 1
        config = EngineConfig(model="tiny", num_threads=1, kv_cache_memory_bytes=memory)
        assert Engine.from_config(config).config.num_blocks == blocks
    short = EngineConfig(model="tiny", num_threads=1, kv_cache_memory_bytes=per_block - 1)
    with pytest.raises(EngineConfigError, match="holds no block"):
        Engine.from_config(short)


def test_a_pool_too_small_for_max_model_len_names_the_memory_it_needs() -> None:
    """The refusal of an explicit `max_model_len` the pool cannot hold gives the KV memory
    that would: blocks needed (rounded up) times bytes per block."""
    per_block = Engine.from_config(CONFIG).bytes_per_token * CONFIG.block_size
    need = -(-500 // CONFIG.block_size)
    small = EngineConfig(model="tiny", num_threads=1, num_blocks=need - 1, max_model_len=500)
    with pytest.raises(EngineConfigError) as err:
        Engine.from_config(small)
    assert f"--kv-cache-memory to at least {need * per_block:,} bytes" in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without a CUDA GPU")
def test_asking_for_cuda_without_a_gpu_is_refused() -> None:
    """`device="cuda"` on a host where torch sees no GPU is a clear error, not a late one."""
    with pytest.raises(ValueError, match="no CUDA GPU"):
        Engine.from_config(EngineConfig(model="tiny", num_threads=1, device="cuda"))
