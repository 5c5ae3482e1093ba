"""What a stream holds while its consumer is behind: deltas carry only what is new (no copy of
the whole text so far on every step), and the outputs not yet taken are folded into one entry,
so a stalled stream holds O(output) bytes, not one delta per step."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

import pytest

from headroom.engine.async_engine import AsyncEngine
from headroom.engine.config import EngineConfig
from headroom.engine.engine import Engine
from headroom.engine.outputs import CompletionOutput, FinishReason, RequestOutput
from headroom.engine.requests import merge
from headroom.engine.sampling import SamplingParams
from headroom.engine.server.generation import Generation
from headroom.engine.server.state import ServerSettings, ServerState

CONFIG = EngineConfig(model="tiny", num_blocks=128, max_model_len=512, num_threads=1)
PROMPT = [256, 72, 105, 33]
STEPS = 40  # the engine steps a stalled consumer misses
SAMPLED = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=STEPS, ignore_eos=True)

Whole = dict[int, tuple[str, list[int], str | None]]


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine.from_config(CONFIG)
    await eng.start()
    yield eng
    await eng.shutdown(grace_s=0)


def _fold(outs: list[RequestOutput]) -> Whole:
    """Each completion's concatenated text, token ids and finish reason."""
    whole: Whole = {}
    for out in outs:
        for c in out.outputs:
            text, ids, _ = whole.get(c.index, ("", [], None))
            whole[c.index] = (text + c.text, ids + c.token_ids, c.finish_reason)
    return whole


async def _until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def _delta(
    index: int, text: str, ids: list[int], finish: FinishReason | None = None
) -> RequestOutput:
    comp = CompletionOutput(index=index, text=text, token_ids=ids, finish_reason=finish)
    return RequestOutput(
        request_id="r", prompt_token_ids=[1], outputs=[comp], arrival_time=0.0,
        finished=finish is not None,
    )  # fmt: skip


# --- cumulative_text ---------------------------------------------------------------------


def test_deltas_carry_no_copy_of_the_text_so_far_and_merged_results_are_unchanged() -> None:
    eng = Engine.from_config(CONFIG)
    reference = eng.generate([PROMPT], SAMPLED)[0]
    eng.add_request("s", PROMPT, SAMPLED)
    deltas: list[RequestOutput] = []
    while eng.has_unfinished():
        deltas.extend(eng.step())
    assert len(deltas) >= STEPS
    for out in deltas:
        for c in out.outputs:
            if c.finish_reason is None:
                assert c.cumulative_text is None, "a delta holds a copy of the whole text"
    # The final output of each completion still names its whole text, as merge() does.
    whole = _fold(deltas)
    finals = {c.index: c for out in deltas for c in out.outputs if c.finish_reason is not None}
    assert {i: c.cumulative_text for i, c in finals.items()} == {
        i: t for i, (t, _, _) in whole.items()
    }
    merged = deltas[0].model_copy(deep=True)
    for out in deltas[1:]:
        merge(merged, out.model_copy(deep=True))
    assert _fold([merged]) == whole == _fold([reference])
    for c in merged.outputs + reference.outputs:
        assert c.cumulative_text == c.text
    assert sorted(whole) == [0, 1] and all(len(ids) == STEPS for _, ids, _ in whole.values())


# --- the stream's backlog ----------------------------------------------------------------


async def test_a_stalled_stream_gets_its_backlog_folded_and_the_same_output(
    engine: AsyncEngine,
) -> None:
    reader = engine.stream("reader", PROMPT, SAMPLED)
    stalled = engine.stream("stalled", PROMPT, SAMPLED)
    first = await stalled.__anext__()  # admitted; then not read for the whole run
    sink = engine._sinks["stalled"]
    read_every_step = [out async for out in reader]
    await _until(lambda: "stalled" not in engine._sinks)  # the engine finished it
    pending = len(sink)
    rest = [out async for out in stalled]
    assert len(rest) <= 2, f"{len(rest)} outputs queued for a stream that read none"
    assert pending == 1
    assert rest[-1].finished and rest[-1].finished_time is not None
    assert _fold([first, *rest]) == _fold(read_every_step)
    whole = _fold(read_every_step)
    assert all(finish == "length" and len(ids) == STEPS for _, ids, finish in whole.values())


async def test_a_slow_http_handler_leaves_a_bounded_backlog(engine: AsyncEngine) -> None:
    st = ServerState(ServerSettings(served_model_name="tiny"), engine=engine)
    async with Generation(st, "cmpl-x", [PROMPT, PROMPT[:2]], [SAMPLED, SAMPLED]) as gen:
        events = gen.events()
        got = [await events.__anext__()]  # the client reads one event, then stalls
        await _until(lambda: engine.stats().requests_finished_total == 2)
        got += [e async for e in events]
    assert len(got) <= 1 + 2 * 3, f"{len(got)} events queued while the client read none"
    for prompt_index in (0, 1):
        whole = _fold([out for i, out in got if i == prompt_index])
        assert sorted(whole) == [0, 1]
        assert all(finish == "length" and len(ids) == STEPS for _, ids, finish in whole.values())


async def test_an_error_after_outputs_is_delivered_after_them() -> None:
    from headroom.engine.async_engine import _Sink

    sink = _Sink(asyncio.get_running_loop())
    sink.put(_delta(1, "a", [1]))
    sink.put(_delta(0, "x", [7]))
    sink.put(_delta(1, "b", [2]))
    sink.put(RuntimeError("step failed"))
    assert len(sink) == 2
    out = await sink.get()
    assert isinstance(out, RequestOutput) and not out.finished
    assert [(c.index, c.text, c.token_ids) for c in out.outputs] == [
        (0, "x", [7]),
        (1, "ab", [1, 2]),
    ]
    err = await sink.get()
    assert isinstance(err, RuntimeError) and len(sink) == 0


async def test_a_waiting_stream_wakes_on_an_output_from_the_engine_thread() -> None:
    from headroom.engine.async_engine import _Sink

    sink = _Sink(asyncio.get_running_loop())
    waiter = asyncio.create_task(sink.get())
    await asyncio.sleep(0.01)
    threading.Thread(target=sink.put, args=(_delta(0, "hi", [5], "stop"),)).start()
    out = await asyncio.wait_for(waiter, 10)
    assert isinstance(out, RequestOutput) and out.finished
    assert out.outputs[0].text == "hi" and out.outputs[0].finish_reason == "stop"
