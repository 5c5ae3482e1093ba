"""The engine's demand counters (issue 20): arrivals and their prompt tokens, counted once per
accepted API request, departures across finishes, aborts and failures, and the exact integral
of used KV blocks over time, in the engine's snapshot and in `GET /stats`."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from test_kv_model_sim import KVSimulator, sample

from headroom.engine.async_engine import AsyncEngine
from headroom.engine.config import EngineConfig
from headroom.engine.engine import Engine, StepFailed
from headroom.engine.errors import RequestRejected
from headroom.engine.kv_manager import KVManager
from headroom.engine.sampling import SamplingParams
from headroom.engine.scheduler import Scheduler
from headroom.engine.sequence import Sequence
from headroom.engine.server.app import ServerSettings, ServerState, create_app
from headroom.engine.server.runner import attach_engine

CONFIG = EngineConfig(model="tiny", num_blocks=96, max_model_len=512, num_threads=1)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _scheduler(clock: FakeClock, **kw: Any) -> tuple[Scheduler, KVSimulator]:
    cfg = EngineConfig.model_validate(
        {"num_blocks": 16, "block_size": 4, "max_model_len": 64, **kw}
    )
    kv = KVManager(16, 4, None, clock=clock)
    return Scheduler(cfg, kv), KVSimulator(16, 4)


def _step(sched: Scheduler, sim: KVSimulator) -> None:
    out = sched.schedule()
    sched.update(out, {k: sample(v) for k, v in sim.run(out).items()})


def test_a_requests_block_seconds_are_its_blocks_times_the_time_it_held_them() -> None:
    clock = FakeClock()
    sched, sim = _scheduler(clock)
    seq = Sequence("a", list(range(12)), max_tokens=10)  # 3 full blocks, a 4th at decode
    sched.add(seq)
    clock.now += 7.0  # waiting holds no block
    _step(sched, sim)  # prefill: 3 blocks from here
    clock.now += 5.0
    _step(sched, sim)  # the first decode takes a 4th block
    clock.now += 2.0
    assert sched.kv.block_seconds() == pytest.approx(3 * 5.0 + 4 * 2.0)
    clock.now += 1.5
    _step(sched, sim)  # a step with no block change: nothing to tick, nothing lost
    clock.now += 2.5
    sched.finish(seq.seq_id)
    clock.now += 100.0  # an empty pool adds nothing
    assert sched.kv.block_seconds() == pytest.approx(3 * 5.0 + 4 * 6.0)


def test_block_seconds_of_overlapping_requests_add_up_whatever_the_step_cadence() -> None:
    clock = FakeClock()
    sched, sim = _scheduler(clock, max_num_batched_tokens=64)
    a = Sequence("a", list(range(8)), max_tokens=1)  # 2 blocks, done after one step
    b = Sequence("b", list(range(20, 24)), max_tokens=2)  # 1 block, then 2
    sched.add(a)
    sched.add(b)
    _step(sched, sim)  # both prefill; a finishes at its first token
    clock.now += 0.25
    _step(sched, sim)  # b decodes into a 2nd block and finishes
    clock.now += 30.0
    # a's 2 blocks go in the step that took them (no time passes on this clock); b holds 1
    # block for 0.25 s, and its 2nd block is released at the instant it was taken.
    assert sched.kv.block_seconds() == pytest.approx(1 * 0.25)


def test_demand_counters_count_arrivals_once_and_departures_across_aborts_and_failures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine.from_config(CONFIG)
    prompts = [[256, *range(65, 65 + n)] for n in (9, 4, 6)]
    engine.add_request("n3", prompts[0], GREEDY.model_copy(update={"n": 3}))
    with pytest.raises(RequestRejected):
        engine.add_request("too-long", [1] * 600, GREEDY)
    engine.add_request("aborted", prompts[1], GREEDY)
    s = engine.stats()
    assert (s.requests_arrived_total, s.prompt_tokens_arrived_total) == (2, 10 + 5)
    assert s.prompt_tokens_total == s.prompt_tokens_arrived_total
    engine.step()
    engine.abort("aborted")
    while engine.has_unfinished():
        engine.step()
    s = engine.stats()
    assert s.requests_finished_total == 2  # n = 3 is one request, one departure
    engine.add_request("failed", prompts[2], GREEDY)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the model is broken")

    monkeypatch.setattr(engine.runner, "execute", broken)
    with pytest.raises(StepFailed):
        engine.step()
    after = engine.stats()
    assert (after.requests_arrived_total, after.prompt_tokens_arrived_total) == (3, 22)
    assert after.requests_finished_total == 3 and not engine.has_unfinished()
    assert after.kv.used == 0
    # The integral grew while blocks were held and stands still now the pool is empty.
    assert 0 < s.kv_block_seconds_total <= after.kv_block_seconds_total
    assert engine.stats().kv_block_seconds_total == pytest.approx(after.kv_block_seconds_total)


async def test_the_demand_counters_appear_in_get_stats() -> None:
    engine = AsyncEngine(Engine.from_config(CONFIG))
    await engine.start()
    state = ServerState(ServerSettings(served_model_name="tiny"))
    attach_engine(state, engine, CONFIG.model, 512)
    server = TestServer(create_app(state))
    await server.start_server()
    try:
        async for out in engine.stream("r", [256, 65, 66, 67], GREEDY):
            last = out
        assert last.finished
        async with (
            aiohttp.ClientSession() as http,
            http.get(str(server.make_url("/stats"))) as resp,
        ):
            assert resp.status == 200
            body = await resp.json()
        assert body["requests_arrived_total"] == 1
        assert body["prompt_tokens_arrived_total"] == 4
        assert body["requests_finished_total"] == 1
        assert body["kv_block_seconds_total"] > 0
    finally:
        await server.close()
        await engine.shutdown(grace_s=0)
