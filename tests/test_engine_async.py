"""AsyncEngine: streaming deltas from the engine thread, rejection before the first yield,
abort on disconnect, and graceful shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from headroom.engine.async_engine import AsyncEngine, EngineClosed
from headroom.engine.config import EngineConfig
from headroom.engine.engine import Engine
from headroom.engine.errors import RequestRejected
from headroom.engine.outputs import RequestOutput
from headroom.engine.sampling import SamplingParams

CONFIG = EngineConfig(model="tiny", num_blocks=128, max_model_len=512, num_threads=1)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


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
