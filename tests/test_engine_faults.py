"""Fault injection: a failing forward, a failing sample, a failing tokenizer decode and a failing
stream consumer each end only the requests they hit, return every KV block to the pool, and
leave the engine serving; a run of failures (or one device error) turns it unhealthy, which
the server's probes and the sidecar's poll then see."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

import headroom.engine.engine as engine_module
from headroom.engine.async_engine import AsyncEngine, EngineClosed
from headroom.engine.config import EngineConfig
from headroom.engine.engine import Engine, RequestFailed, StepFailed
from headroom.engine.health import EngineHealth, is_device_error
from headroom.engine.model.tokenizer import IncrementalDetokenizer
from headroom.engine.outputs import RequestOutput
from headroom.engine.sampling import SamplingParams
from headroom.engine.server.app import ServerSettings, ServerState, create_app
from headroom.engine.server.runner import attach_engine

CONFIG = EngineConfig(model="tiny", num_blocks=96, max_model_len=512, num_threads=1)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[256, *range(65, 65 + n)] for n in (20, 37, 5)]


def _pool_is_whole(engine: Engine) -> bool:
    pool = engine.scheduler.kv.pool
    return pool.num_used == 0 and pool.num_available == pool.num_blocks


def _fail_once(real: Callable[..., Any], after: int = 0) -> Callable[..., Any]:
    """`real`, except that its call number `after` (0-based) raises."""
    calls = {"n": 0}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == after + 1:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    return wrapper


@pytest.fixture(scope="module")
def reference() -> list[RequestOutput]:
    return Engine.from_config(CONFIG).generate(PROMPTS, GREEDY)


def _drive(engine: Engine) -> tuple[dict[str, list[int]], dict[str, BaseException]]:
    """Step until idle; tokens per request and the failure of each failed request."""
    tokens: dict[str, list[int]] = {}
    failed: dict[str, BaseException] = {}
    while engine.has_unfinished():
        try:
            outs = engine.step()
        except StepFailed as exc:
            failed.update(exc.failures)
            outs = exc.outputs
        for out in outs:
            for c in out.outputs:
                tokens.setdefault(out.request_id, []).extend(c.token_ids)
    return tokens, failed


@pytest.mark.parametrize("where", ["execute", "copy_blocks", "sample"])
def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(
    where: str, monkeypatch: pytest.MonkeyPatch, reference: list[RequestOutput]
) -> None:
    engine = Engine.from_config(CONFIG.model_copy(update={"max_num_seqs": 2}))
    if where == "sample":
        monkeypatch.setattr(engine_module, "sample_rows", _fail_once(engine_module.sample_rows, 3))
    else:
        target = getattr(engine.runner, where)
        monkeypatch.setattr(engine.runner, where, _fail_once(target, 3))
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    tokens, failed = _drive(engine)
    # max_num_seqs 2: the third request was waiting when the step failed, and is served.
    assert set(failed) == {"r0", "r1"}
    assert all(
        isinstance(e, RequestFailed) and "injected failure" in str(e) for e in failed.values()
    )
    assert tokens["r2"] == reference[2].outputs[0].token_ids
    assert _pool_is_whole(engine)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    again = engine.generate([PROMPTS[0]], GREEDY)[0]
    assert again.outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert _pool_is_whole(engine)


def test_a_failing_step_of_an_n_request_frees_every_sibling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine.from_config(CONFIG)
    monkeypatch.setattr(engine_module, "sample_rows", _fail_once(engine_module.sample_rows, 0))
    params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=5, ignore_eos=True)
    engine.add_request("n3", PROMPTS[1], params)
    _, failed = _drive(engine)
    assert set(failed) == {"n3"}
    assert _pool_is_whole(engine)
    out = engine.generate([PROMPTS[1]], params)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 8 for c in out.outputs)


def test_a_failing_decode_fails_that_request_alone(
    monkeypatch: pytest.MonkeyPatch, reference: list[RequestOutput]
) -> None:
    engine = Engine.from_config(CONFIG)
    real_init, real_add = IncrementalDetokenizer.__init__, IncrementalDetokenizer.add
    victim_prompt = PROMPTS[1]
    victims: set[int] = set()
    seen = {"n": 0}

    def init(self: IncrementalDetokenizer, tokenizer: Any, prompt: Sequence[int]) -> None:
        real_init(self, tokenizer, prompt)
        if list(prompt) == victim_prompt:
            victims.add(id(self))

    def add(self: IncrementalDetokenizer, token: int) -> str:
        if id(self) in victims:
            seen["n"] += 1
            if seen["n"] == 4:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_add(self, token)

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", init)
    monkeypatch.setattr(IncrementalDetokenizer, "add", add)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    tokens, failed = _drive(engine)
    assert set(failed) == {"r1"}
    assert "UnicodeDecodeError" in str(failed["r1"])
    for i in (0, 2):
        assert tokens[f"r{i}"] == reference[i].outputs[0].token_ids
    assert _pool_is_whole(engine)
    assert engine.generate([victim_prompt], GREEDY)[0].outputs[0].token_ids[:3]


@pytest.fixture
async def aengine() -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(Engine.from_config(CONFIG), EngineHealth(max_consecutive_failures=2))
    await eng.start()
    yield eng
    await eng.shutdown(grace_s=0)


async def _tokens(stream: AsyncIterator[RequestOutput]) -> list[int]:
    ids: list[int] = []
    async for out in stream:
        for c in out.outputs:
            ids.extend(c.token_ids)
    return ids


async def _until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def test_async_streams_of_a_failed_step_raise_and_others_go_on(
    aengine: AsyncEngine, monkeypatch: pytest.MonkeyPatch, reference: list[RequestOutput]
) -> None:
    runner = aengine.engine.runner
    monkeypatch.setattr(runner, "execute", _fail_once(runner.execute, 2))
    results = await asyncio.gather(
        *(_tokens(aengine.stream(f"a{i}", p, GREEDY)) for i, p in enumerate(PROMPTS)),
        return_exceptions=True,
    )
    assert all(isinstance(r, RequestFailed) for r in results), results
    assert aengine.health.healthy and aengine.health.failed_steps_total == 1
    ids = await _tokens(aengine.stream("after", PROMPTS[0], GREEDY))
    assert ids == reference[0].outputs[0].token_ids
    assert aengine.health.consecutive_failures == 0
    await _until(lambda: _pool_is_whole(aengine.engine))


@pytest.mark.parametrize("close", ["aclosing", "garbage-collected"])
async def test_a_consumer_that_raises_frees_its_blocks(
    aengine: AsyncEngine, close: str, reference: list[RequestOutput]
) -> None:
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def consume() -> None:
        stream = aengine.stream("consumer", PROMPTS[1], long)
        ctx = contextlib.aclosing(stream) if close == "aclosing" else contextlib.nullcontext()
        async with ctx:
            got = 0
            async for _ in stream:
                got += 1
                if got == 3:
                    raise ValueError("the consumer broke")

    with pytest.raises(ValueError, match="consumer broke"):
        await consume()
    gc.collect()  # the unclosed generator's finalizer schedules its aclose() on the loop
    await _until(lambda: aengine.engine.num_requests == 0)
    await _until(lambda: _pool_is_whole(aengine.engine))
    assert await _tokens(aengine.stream("next", PROMPTS[0], GREEDY)) == (
        reference[0].outputs[0].token_ids
    )


async def test_consecutive_failures_make_the_engine_unhealthy(
    aengine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the model is broken")

    monkeypatch.setattr(aengine.engine.runner, "execute", broken)
    for i in range(2):
        with pytest.raises(RequestFailed, match="the model is broken"):
            await _tokens(aengine.stream(f"b{i}", PROMPTS[2], GREEDY))
    assert not aengine.health.healthy
    assert "2 consecutive model steps failed" in (aengine.health.reason or "")
    with pytest.raises(EngineClosed, match="unhealthy"):
        await _tokens(aengine.stream("refused", PROMPTS[2], GREEDY))
    assert _pool_is_whole(aengine.engine)


def test_device_errors_are_recognised() -> None:
    assert is_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_device_error(RuntimeError("CUDA error: device-side assert triggered"))
    wrapped = ValueError("bad")
    wrapped.__cause__ = RuntimeError("cudaErrorLaunchFailure: unspecified launch failure")
    assert is_device_error(wrapped)
    assert not is_device_error(RuntimeError("shape mismatch"))
    health = EngineHealth(max_consecutive_failures=5)
    assert health.record_failure(RuntimeError("CUDA error: an illegal memory access"))
    assert not health.healthy and "device error" in (health.reason or "")


def test_a_run_of_failures_is_consecutive_steps_and_a_success_ends_it() -> None:
    """A success between failures resets the run: only max_consecutive_failures failed steps in
    a row (3 by default) turn the engine unhealthy; the total still counts every one."""
    health = EngineHealth()
    for _ in range(5):
        assert not health.record_failure(RuntimeError("bad batch"))
        assert not health.record_failure(RuntimeError("bad batch"))
        health.record_success()
        assert health.consecutive_failures == 0
    assert health.healthy and health.failed_steps_total == 10
    assert not health.record_failure(RuntimeError("bad batch"))
    assert not health.record_failure(RuntimeError("bad batch"))
    assert health.record_failure(RuntimeError("bad batch"))
    assert "3 consecutive model steps failed" in (health.reason or "")
    assert not health.record_failure(RuntimeError("later"))  # already unhealthy: no new verdict
    assert health.failed_steps_total == 14


def test_max_consecutive_failures_is_at_least_one() -> None:
    """1 is the strictest setting (any failed step restarts the pod); 0 would mean unhealthy
    before any step, so it is refused."""
    health = EngineHealth(max_consecutive_failures=1)
    assert health.record_failure(RuntimeError("bad batch")) and not health.healthy
    with pytest.raises(ValueError, match="max_consecutive_failures"):
        EngineHealth(max_consecutive_failures=0)


def test_a_step_is_stuck_only_once_it_runs_longer_than_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Exactly step_timeout_s of running is not yet stuck; longer is."""
    import headroom.engine.health as health_module

    monkeypatch.setattr(health_module.time, "monotonic", lambda: 1000.0)
    health = EngineHealth(step_timeout_s=60)
    health.step_started(4)
    assert health.stuck_step(now=1060.0) is None and health.healthy
    assert "model step 4 stuck" in (health.stuck_step(now=1060.5) or "")


async def test_server_maps_failures_and_an_unhealthy_engine_fails_its_probes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = AsyncEngine(Engine.from_config(CONFIG), EngineHealth(max_consecutive_failures=2))
    await engine.start()
    state = ServerState(ServerSettings(served_model_name="tiny"))
    attach_engine(state, engine, CONFIG.model, 512)
    server = TestServer(create_app(state))
    await server.start_server()
    base = str(server.make_url(""))
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    try:
        ok = await client.completions.create(model="tiny", prompt="hi", max_tokens=4)
        assert ok.choices[0].finish_reason == "length"

        real_execute = engine.engine.runner.execute

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the model is broken")

        monkeypatch.setattr(engine.engine.runner, "execute", broken)
        with pytest.raises(openai.InternalServerError, match="the model is broken") as info:
            await client.completions.create(model="tiny", prompt="hi", max_tokens=4)
        assert info.value.code == "engine_error"
        # A stream that already sent tokens ends with an error event, not a cut connection.
        calls = {"n": 0}

        def breaks_later(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] > 2:
                raise RuntimeError("the model is broken")
            return real_execute(*args, **kwargs)

        monkeypatch.setattr(engine.engine.runner, "execute", breaks_later)
        stream = await client.completions.create(
            model="tiny", prompt="hi", max_tokens=8, stream=True
        )
        with pytest.raises(openai.APIError, match="the model is broken"):
            async for _ in stream:
                pass
        assert engine.health.healthy  # one failure after a success: not yet consecutive
        with pytest.raises(openai.InternalServerError):
            await client.completions.create(model="tiny", prompt="hi", max_tokens=4)
        assert not engine.health.healthy
        async with aiohttp.ClientSession() as http:
            for path in ("/ready", "/health", "/stats"):
                async with http.get(base + path) as resp:
                    assert resp.status == 503, path
                    assert "consecutive model steps failed" in await resp.text()
        with pytest.raises(openai.APIStatusError) as refused:
            await client.completions.create(model="tiny", prompt="hi", max_tokens=4)
        assert refused.value.status_code == 503
        # The connection ends with it, so the client's retry reconnects (through the Service,
        # to another replica) instead of coming back to this pod on a kept-alive connection.
        assert refused.value.response.headers.get("Connection") == "close"
        assert refused.value.response.headers.get("Retry-After") == "1"
        assert _pool_is_whole(engine.engine)
    finally:
        await client.close()
        await server.close()
        await engine.shutdown(grace_s=0)


def test_the_soak_bench_leaks_nothing_and_grades_a_leak() -> None:
    """bench/fault_soak.py, short: faults injected, 0 leaked blocks, exit 0; a leak is a MISS."""
    from bench import fault_soak as soak

    result = asyncio.run(soak.soak_one(seed=3, requests=30, concurrency=6, p=0.03))
    assert sum(result.injected.values()) > 0 and result.errors
    assert result.leaked_blocks == 0 and result.after_ok
    assert result.requests == 30
    verdicts = soak.Verdicts()
    verdicts(result.leaked_blocks == 0, "no leak")
    assert verdicts.exit_code() == 0
    verdicts(False, "a leak")
    assert verdicts.exit_code() == 1
