"""The poller against engines that answer what it did not expect: every outcome is counted, the
loop never stops, and an SGLang restart is read with the new server's pool from its first poll.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from synthetic_engine import SyntheticEngine

from headroom.sidecar.config import SidecarConfig
from headroom.sidecar.poller import Poller
from headroom.sidecar.server import build_app
from headroom.sidecar.sources import EngineReading, GarbageError, parse_headroom_stats
from headroom.sidecar.state import PollState, figures

pytestmark = pytest.mark.timeout(60)


@dataclass
class Clock:
    t: float = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Engine:
    """A stand-in engine: each route answers what `routes` holds for it now; `hits` counts."""

    routes: dict[str, Callable[[], bytes]]
    hits: dict[str, int] = field(default_factory=dict)

    def app(self) -> web.Application:
        async def answer(request: web.Request) -> web.Response:
            self.hits[request.path] = self.hits.get(request.path, 0) + 1
            make = self.routes.get(request.path)
            if make is None:
                return web.Response(status=404)
            return web.Response(body=make(), content_type="text/plain")

        app = web.Application()
        app.router.add_get("/{path:.*}", answer)
        return app


@dataclass
class Rig:
    engine: Engine
    poller: Poller
    state: PollState
    cfg: SidecarConfig
    clock: Clock


@contextlib.asynccontextmanager
async def _rig(engine: Engine, **flags: Any) -> AsyncIterator[Rig]:
    async with TestServer(engine.app()) as server, ClientSession() as session:
        cfg = SidecarConfig(engine_url=str(server.make_url("/")), interval=1.0, timeout=1.0,
                            window=30.0, forecast_window=30.0, **flags)  # fmt: skip
        clock = Clock()
        state = PollState(horizon=61.0)
        yield Rig(engine, Poller(cfg, state, session, clock), state, cfg, clock)


# --- a /stats body whose counts are not numbers a float can hold -----------------------------


def _stats_doc() -> dict[str, Any]:
    eng = SyntheticEngine(capacity=100, block_size=16, model="tiny")
    eng.set_used(40)
    eng.observe_ttft(0.02)
    doc: dict[str, Any] = json.loads(eng.body())
    return doc


def _huge_kv(doc: dict[str, Any]) -> dict[str, Any]:
    # adds up (free + used + cached == capacity), so only the size of the numbers is wrong
    kv = {**doc["kv"], "capacity": 10**400, "used": 10**400, "free": 0, "cached": 0}
    return {**doc, "kv": kv}


def _past_2_to_the_53(doc: dict[str, Any]) -> dict[str, Any]:
    # a float would hold it, but not exactly: no pool has 10**18 blocks
    kv = doc["kv"]
    return {**doc, "kv": {**kv, "capacity": 2**60, "free": 2**60 - kv["used"] - kv["cached"]}}


def _huge(*path: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edit(doc: dict[str, Any]) -> dict[str, Any]:
        doc = json.loads(json.dumps(doc))
        inner = doc
        for key in path[:-1]:
            inner = inner[key]
        inner[path[-1]] = 10**400
        return doc

    return edit


def _huge_histogram(doc: dict[str, Any]) -> dict[str, Any]:
    hist = doc["time_to_first_token_seconds"]
    n = len(hist["counts"])
    return {**doc, "time_to_first_token_seconds": {**hist, "counts": [10**400] * n,
                                                   "count": 10**400}}  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (_huge_kv, "kv.capacity"),
        (_past_2_to_the_53, "kv.capacity"),
        (_huge("preemptions_total"), "preemptions_total"),
        (_huge("requests_arrived_total"), "requests_arrived_total"),
        (_huge("prefix_cache", "queries_tokens_total"), "prefix_cache.queries_tokens_total"),
        (_huge("requests", "running"), "requests.running"),
        (_huge_histogram, r"time_to_first_token_seconds\.counts\[0\]"),
    ],
)
def test_counts_beyond_a_floats_reach_are_garbage(
    edit: Callable[[dict[str, Any]], dict[str, Any]], where: str
) -> None:
    """The contract's counts are unbounded ints; a float holds every whole number only up to
    2**53 and none past ~1.8e308 (float() raises OverflowError). No engine counts that far."""
    body = json.dumps(edit(_stats_doc())).encode()
    with pytest.raises(GarbageError, match=f"{where} is not a plausible count"):
        parse_headroom_stats(body)


def test_counts_up_to_2_to_the_53_are_read() -> None:
    doc = _stats_doc()
    doc["preemptions_total"] = 2**53
    assert parse_headroom_stats(json.dumps(doc).encode()).preemptions_total == 2**53


async def test_a_stats_body_with_overflowing_counts_is_garbage_and_polling_goes_on() -> None:
    """The reviewer's case: kv.capacity = kv.used = 10**400. It was read, and integrating the
    used blocks at the next poll raised OverflowError out of poll_once, which ended the poll
    task for good (/healthz 503, engine_up 0 ever after)."""
    body = {"now": json.dumps(_huge_kv(_stats_doc())).encode()}
    async with _rig(Engine({"/stats": lambda: body["now"]})) as rig:
        for t in range(3):
            rig.clock.t = float(t)
            await rig.poller.poll_once()  # never raises
        assert rig.state.errors["garbage"] == 3 and rig.state.errors["internal"] == 0
        assert rig.state.polls_total == 3 and not rig.state.last_poll_ok
        assert rig.state.last_error is not None and "kv.capacity" in rig.state.last_error
        body["now"] = json.dumps(_stats_doc()).encode()
        rig.clock.t = 3.0
        await rig.poller.poll_once()
        assert rig.state.last_poll_ok and rig.state.polls_total == 4
        reading = figures(rig.state, rig.cfg, 3.0).reading
        assert reading is not None and reading.capacity_blocks == 100


async def test_the_sidecar_stays_healthy_against_overflowing_counts() -> None:
    """Over HTTP, as the reviewer saw it: the poll task lives on and /healthz stays 200."""
    body = json.dumps(_huge_kv(_stats_doc())).encode()
    engine = Engine({"/stats": lambda: body})
    async with TestServer(engine.app()) as eng_srv:
        cfg = SidecarConfig(engine_url=str(eng_srv.make_url("/")), interval=0.05, timeout=0.05)
        app = build_app(cfg)
        async with TestServer(app) as sidecar, ClientSession() as http:
            for _ in range(500):  # bounded: until the sidecar has polled a few times
                if engine.hits.get("/stats", 0) >= 4:
                    break
                async with http.get(sidecar.make_url("/healthz")) as resp:
                    await resp.read()
                await asyncio.sleep(0.02)
            async with http.get(sidecar.make_url("/healthz")) as resp:
                assert resp.status == 200
                assert (await resp.json()) == {"status": "ok", "engine_up": False}
            async with http.get(sidecar.make_url("/metrics")) as resp:
                text = await resp.text()
    assert engine.hits["/stats"] >= 4
    assert 'headroom_sidecar_poll_errors_total{reason="garbage"}' in text
    assert 'headroom_sidecar_poll_errors_total{reason="internal"} 0.0' in text


class _StateThatFailsOnce(PollState):
    """A state whose next `record_success` raises: a bug the parser's checks did not catch."""

    fail = 1

    def record_success(self, reading: EngineReading, t: float) -> bool:
        if self.fail:
            self.fail -= 1
            raise OverflowError("int too large to convert to float")
        return super().record_success(reading, t)


async def test_a_reading_the_state_cannot_keep_is_an_internal_error() -> None:
    """poll_once promises every failure is classified and counted, never raised: one raised
    while recording a reading too, not only while fetching it."""
    engine = Engine({"/stats": lambda: SyntheticEngine(capacity=100).body()})
    async with TestServer(engine.app()) as server, ClientSession() as session:
        cfg = SidecarConfig(engine_url=str(server.make_url("/")), interval=1.0, timeout=1.0)
        clock = Clock()
        state = _StateThatFailsOnce(horizon=61.0)
        poller = Poller(cfg, state, session, clock)
        await poller.poll_once()  # does not raise
        assert state.errors["internal"] == 1 and state.polls_total == 1
        assert not state.last_poll_ok and state.last_error is not None
        assert "OverflowError" in state.last_error
        clock.t = 1.0
        await poller.poll_once()  # and the next poll is read as usual
        assert state.last_poll_ok and state.polls_total == 2 and state.errors["internal"] == 1


def test_a_reading_the_state_cannot_keep_leaves_it_as_it_was() -> None:
    """record_success computes before it keeps: a raise leaves no half-recorded poll (a bumped
    epoch, say, with the restart markers not updated)."""
    state = PollState(horizon=61.0)
    good = parse_headroom_stats(SyntheticEngine(capacity=100).body())
    state.record_success(good, 0.0)
    bad = replace(good, used_blocks=10**400)
    state.record_success(bad, 1.0)  # the integral is of the previous reading's blocks
    before = (state.polls_total, state.epoch, state.integrated_block_seconds, len(state.samples))
    with pytest.raises(OverflowError):
        state.record_success(good, 2.0)
    assert (state.polls_total, state.epoch, state.integrated_block_seconds,
            len(state.samples)) == before  # fmt: skip
    assert state.last_reading is bad


# --- an SGLang restart: the server info (pool size) is the new server's ----------------------

LABELS = 'engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"'


@dataclass
class Sglang:
    """An SGLang 0.5.3 server (no pool size in /metrics) whose pool and counters can change."""

    pool: int = 14336
    used: int = 7168
    requests: float = 100.0
    start: float | None = None  # process_start_time_seconds, where exported
    info_up: bool = True

    def metrics(self) -> bytes:
        start = "" if self.start is None else f"process_start_time_seconds {self.start}\n"
        return (
            f"sglang:token_usage{{{LABELS}}} {round(self.used / self.pool, 2)}\n"
            f"sglang:num_used_tokens{{{LABELS}}} {float(self.used)}\n"
            f"sglang:num_running_reqs{{{LABELS}}} 3\n"
            f"sglang:num_queue_reqs{{{LABELS}}} 0\n"
            f'sglang:num_requests_total{{model_name="m"}} {self.requests}\n' + start
        ).encode()

    def info(self) -> bytes:
        if not self.info_up:
            raise web.HTTPServiceUnavailable()
        return json.dumps({"max_total_num_tokens": self.pool, "page_size": 1}).encode()

    def engine(self) -> Engine:
        return Engine({"/metrics": self.metrics, "/get_server_info": self.info})


@pytest.mark.parametrize("marker", ["counters fall", "new process start time"])
async def test_an_sglang_restart_reads_the_new_servers_pool_at_once(marker: str) -> None:
    """The server info is read once a minute (the pool does not change while a server runs),
    but a restarted server may have another pool: it was the dead one's for up to 60 s."""
    sg = Sglang(start=None if marker == "counters fall" else 1000.0)
    async with _rig(sg.engine(), source="sglang") as rig:
        for t in range(10):
            rig.clock.t = float(t)
            await rig.poller.poll_once()
        reading = figures(rig.state, rig.cfg, 9.0).reading
        assert reading is not None and reading.capacity_blocks == 14336
        assert rig.engine.hits["/get_server_info"] == 1  # once, not at every poll

        sg.pool, sg.used, sg.requests = 7168, 6451, 0.0  # restarted with half the pool
        if sg.start is not None:
            sg.start, sg.requests = 2000.0, 100.0  # counters need not fall to tell
        rig.clock.t = 10.0
        await rig.poller.poll_once()
        assert rig.state.restarts_total == 1
        reading = figures(rig.state, rig.cfg, 10.0).reading
        assert reading is not None
        assert (reading.capacity_blocks, reading.used_blocks, reading.free_blocks) == (
            7168, 6451, 717,
        )  # fmt: skip
        assert reading.occupancy == pytest.approx(6451 / 7168, abs=0.005)
        assert rig.engine.hits["/get_server_info"] == 2

        rig.clock.t = 11.0  # and not again until the minute is up
        await rig.poller.poll_once()
        assert rig.engine.hits["/get_server_info"] == 2


async def test_an_sglang_restart_without_server_info_has_no_block_counts() -> None:
    """Where the restarted server does not answer its server info (yet), its blocks are
    unknown: the dead server's pool is not the new one's. Occupancy is still read."""
    sg = Sglang()
    async with _rig(sg.engine(), source="sglang") as rig:
        await rig.poller.poll_once()
        sg.pool, sg.used, sg.requests, sg.info_up = 7168, 3584, 0.0, False
        rig.clock.t = 1.0
        await rig.poller.poll_once()
        assert rig.state.restarts_total == 1 and rig.state.last_poll_ok
        reading = figures(rig.state, rig.cfg, 1.0).reading
        assert reading is not None and reading.capacity_blocks is None
        assert reading.occupancy == pytest.approx(0.5)
        sg.info_up = True
        rig.clock.t = 11.0  # retried after SERVER_INFO_RETRY_S
        await rig.poller.poll_once()
        reading = figures(rig.state, rig.cfg, 11.0).reading
        assert reading is not None and reading.capacity_blocks == 7168


async def test_an_sglang_restart_after_a_long_outage_forgets_the_dead_servers_pool() -> None:
    """Down for longer than the info refresh period, the restarted server's first poll has its
    info due; when that read fails, the dead server's pool must not be kept."""
    sg, up = Sglang(), {"on": True}
    engine = sg.engine()
    metrics = engine.routes["/metrics"]

    def maybe_metrics() -> bytes:
        if not up["on"]:
            raise web.HTTPServiceUnavailable()
        return metrics()

    engine.routes["/metrics"] = maybe_metrics
    async with _rig(engine, source="sglang") as rig:
        await rig.poller.poll_once()
        up["on"] = False
        for t in range(1, 120):  # two minutes down: the refresh falls due meanwhile
            rig.clock.t = float(t)
            await rig.poller.poll_once()
        assert not rig.state.last_poll_ok
        up["on"] = True
        sg.pool, sg.used, sg.requests, sg.info_up = 7168, 3584, 0.0, False
        for t in (120.0, 125.0):
            rig.clock.t = t
            await rig.poller.poll_once()
            assert rig.state.restarts_total == 1 and rig.state.last_poll_ok
            reading = figures(rig.state, rig.cfg, t).reading
            assert reading is not None and reading.capacity_blocks is None
            assert reading.used_blocks is None and reading.occupancy == pytest.approx(0.5)
        sg.info_up = True
        rig.clock.t = 131.0
        await rig.poller.poll_once()
        reading = figures(rig.state, rig.cfg, 131.0).reading
        assert reading is not None and (reading.capacity_blocks, reading.used_blocks) == (
            7168, 3584,
        )  # fmt: skip


async def test_a_server_info_read_that_raises_costs_only_the_block_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever goes wrong reading the optional server info, /metrics was read: the engine is
    up, and the read is retried later rather than failing every poll."""
    import headroom.sidecar.poller as poller_mod

    def broken(body: bytes) -> None:
        raise ValueError("Forbidden control character")

    monkeypatch.setattr(poller_mod, "parse_sglang_server_info", broken)
    sg = Sglang()
    async with _rig(sg.engine(), source="sglang") as rig:
        for t in range(3):
            rig.clock.t = float(t)
            await rig.poller.poll_once()
        assert rig.state.last_poll_ok and rig.state.errors["internal"] == 0
        reading = figures(rig.state, rig.cfg, 2.0).reading
        assert reading is not None and reading.capacity_blocks is None
        assert rig.engine.hits["/get_server_info"] == 1  # not again before the retry is due


@pytest.mark.parametrize("key", [None, "wrong", "s3cret"])
async def test_sglang_server_info_behind_its_api_key_is_read_with_the_pods_key(
    key: str | None,
) -> None:
    """SGLang's --api-key guards its server info (not /metrics): the operator hands the sidecar
    the engine's key in HEADROOM_API_KEY, and the sidecar must send it there, and only there."""
    sg, auth = Sglang(), {}

    async def route(request: web.Request) -> web.Response:
        auth[request.path] = request.headers.get("Authorization")
        if request.path == "/metrics":
            return web.Response(body=sg.metrics(), content_type="text/plain")
        if request.headers.get("Authorization") != "Bearer s3cret":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.Response(body=sg.info(), content_type="application/json")

    app = web.Application()
    app.router.add_get("/{path:.*}", route)
    async with TestServer(app) as server, ClientSession() as session:
        cfg = SidecarConfig(engine_url=str(server.make_url("/")), source="sglang", api_key=key)
        state = PollState(horizon=61.0)
        await Poller(cfg, state, session, Clock()).poll_once()
        reading = figures(state, cfg, 0.0).reading
    assert reading is not None and state.last_poll_ok
    assert reading.capacity_blocks == (14336 if key == "s3cret" else None)
    assert auth["/get_server_info"] == (f"Bearer {key}" if key else None)
    assert auth["/metrics"] is None  # the key goes only where it is needed
    assert "s3cret" not in repr(cfg)  # and never into a log line of the config


def test_the_sidecar_reads_the_key_the_operator_gives_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from headroom.operator.reconcile.runtimes import SIDECAR_API_KEY_ENV
    from headroom.sidecar.cli import config_from_args, configure_parser
    from headroom.sidecar.config import API_KEY_ENV

    assert API_KEY_ENV == SIDECAR_API_KEY_ENV
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args(["--engine-url", "http://127.0.0.1:1", "--source", "sglang"])
    monkeypatch.setenv(API_KEY_ENV, " s3cret\n")
    key = config_from_args(args).api_key
    assert key is not None and key.get_secret_value() == "s3cret"
    monkeypatch.setenv(API_KEY_ENV, "")
    assert config_from_args(args).api_key is None


async def test_a_restart_with_a_bigger_pool_reads_its_new_pool_at_once() -> None:
    # The first poll after the restart is read against the dead server's pool (used / pool
    # 1.07): that must not be garbage, or the refresh of the pool on a restart never runs and
    # the engine reads as down until the periodic refresh, 60 s later.
    sg = Sglang(start=1000.0)
    async with _rig(sg.engine(), source="sglang") as rig:
        for t in range(10):
            rig.clock.t = float(t)
            await rig.poller.poll_once()
        assert rig.state.last_poll_ok
        sg.pool, sg.used, sg.start = 16384, 15400, 2000.0
        for t in range(10, 12):
            rig.clock.t = float(t)
            await rig.poller.poll_once()
            assert rig.state.last_poll_ok, rig.state.last_error
        reading = figures(rig.state, rig.cfg, 11.0).reading
        assert reading is not None and reading.capacity_blocks == 16384


# --- the loop: a fixed rate, and an overrun skips the slots it missed -------------------------


class _StopLoop(Exception):
    pass


async def test_run_keeps_a_fixed_rate_and_an_overrun_skips_the_slots_it_missed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Polls fall on start + k * interval; one that overruns is followed by a poll at the next
    slot still ahead (no burst to catch up), and one that fills its slot exactly by one at once."""
    import headroom.sidecar.poller as poller_mod

    async with _rig(Engine({})) as rig:
        rig.clock.t = 100.25
        durations = iter([0.25, 2.5, 0.0, 1.0, 0.0])  # interval 1 s
        polled: list[float] = []
        slept: list[float] = []

        async def poll_once() -> None:
            polled.append(rig.clock.t)
            rig.clock.t += next(durations)

        async def sleep(seconds: float) -> None:
            slept.append(seconds)
            rig.clock.t += seconds
            if len(slept) == 5:
                raise _StopLoop

        monkeypatch.setattr(rig.poller, "poll_once", poll_once)
        monkeypatch.setattr(poller_mod, "asyncio", SimpleNamespace(sleep=sleep))
        with pytest.raises(_StopLoop):
            await rig.poller.run()
    assert polled == [100.25, 101.25, 104.25, 105.25, 106.25]
    assert slept == [0.75, 0.5, 1.0, 0.0, 1.0]


async def test_sglang_server_info_is_read_again_once_a_minute() -> None:
    """README: the pool size is read from the server info once a minute while the server runs
    (SERVER_INFO_REFRESH_S), not at every poll nor only on a restart."""
    sg = Sglang()
    async with _rig(sg.engine(), source="sglang") as rig:
        for t in (0.0, 59.0):
            rig.clock.t = t
            await rig.poller.poll_once()
        assert rig.engine.hits["/get_server_info"] == 1
        rig.clock.t = 60.0
        await rig.poller.poll_once()
        assert rig.engine.hits["/get_server_info"] == 2 and rig.state.restarts_total == 0


async def test_a_body_over_the_size_limit_is_garbage(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body of exactly MAX_BODY_BYTES is read; one byte more is garbage, not buffered."""
    import headroom.sidecar.poller as poller_mod

    body = SyntheticEngine(capacity=100).body()
    async with _rig(Engine({"/stats": lambda: body})) as rig:
        monkeypatch.setattr(poller_mod, "MAX_BODY_BYTES", len(body))
        await rig.poller.poll_once()
        assert rig.state.last_poll_ok
        monkeypatch.setattr(poller_mod, "MAX_BODY_BYTES", len(body) - 1)
        rig.clock.t = 1.0
        await rig.poller.poll_once()
        assert rig.state.errors["garbage"] == 1
        assert rig.state.last_error is not None and "body larger than" in rig.state.last_error


@pytest.mark.parametrize("source", ["sglang", "vllm", "headroom"])
async def test_server_info_is_asked_only_of_an_sglang_without_its_pool_in_metrics(
    source: str,
) -> None:
    """A release that exports `sglang:max_total_num_tokens` needs no second request, and
    neither does any other source: one GET per poll, to the poll URL only."""
    sg = Sglang()
    pool = f"sglang:max_total_num_tokens{{{LABELS}}} {sg.pool}\n".encode()
    engine = Engine({
        "/metrics": (lambda: sg.metrics() + pool) if source == "sglang"
        else lambda: b"vllm:kv_cache_usage_perc 0.5\n",
        "/stats": SyntheticEngine(capacity=100).body,
        "/get_server_info": sg.info,
        "/server_info": sg.info,
    })  # fmt: skip
    async with _rig(engine, source=source) as rig:
        await rig.poller.poll_once()
        assert rig.state.last_poll_ok, rig.state.last_error
        reading = figures(rig.state, rig.cfg, 0.0).reading
        assert reading is not None and reading.source == source
    assert sum(engine.hits.values()) == 1
    assert "/get_server_info" not in engine.hits and "/server_info" not in engine.hits


def _events(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage().split()[0] for r in caplog.records if r.name == "headroom.sidecar"]


async def test_the_poller_logs_a_change_of_state_once_not_every_poll(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Module docstring: one log line per change of state (down, up), not one per failed poll;
    the very first poll failing is a change too."""
    body = SyntheticEngine(capacity=100).body()
    up = {"on": False}

    def stats() -> bytes:
        if not up["on"]:
            raise web.HTTPServiceUnavailable()
        return body

    caplog.set_level("INFO", logger="headroom.sidecar")
    logged: list[list[str]] = []
    async with _rig(Engine({"/stats": stats})) as rig:
        for t, on in enumerate([False, False, True, True, False, False]):
            up["on"], rig.clock.t = on, float(t)
            caplog.clear()
            await rig.poller.poll_once()
            logged.append(_events(caplog))
    down, up_ = ["event=engine_down"], ["event=engine_up"]
    assert logged == [down, [], up_, [], down, []]


async def test_sglang_server_info_logs_its_loss_and_its_return_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The optional server info: one line when it cannot be read, one when it is read again,
    and nothing for the retries or refreshes in between."""
    sg = Sglang(info_up=False)
    caplog.set_level("INFO", logger="headroom.sidecar")
    async with _rig(sg.engine(), source="sglang") as rig:
        for t, info_up in [(0.0, False), (10.0, False), (20.0, True), (80.0, True)]:
            sg.info_up, rig.clock.t = info_up, t
            await rig.poller.poll_once()
        assert rig.engine.hits["/get_server_info"] == 4
    assert _events(caplog) == [
        "event=server_info_unavailable", "event=engine_up", "event=server_info",
    ]  # fmt: skip
