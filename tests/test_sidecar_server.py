"""The sidecar over HTTP against a misbehaving engine: it reports, counts, and never exits."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import BaseTestServer, TestServer
from prometheus_client.parser import text_string_to_metric_families
from synthetic_engine import SyntheticEngine

from headroom.contract.report import SaturationReport
from headroom.sidecar.__main__ import main as sidecar_main
from headroom.sidecar.config import SidecarConfig
from headroom.sidecar.server import STATE_KEY, TASK_KEY, build_app
from headroom.sidecar.sources import parse_headroom_stats

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Rig:
    """A sidecar polling a synthetic engine, both in the test's event loop.

    A pause of that loop (a garbage-collection pass of a large test process, a loaded CI
    machine: hundreds of ms) can make any one poll time out or any one reading stale. So a
    test waits, bounded, for a body that shows what it expects and asserts on that same body,
    never on a second read that a pause in between could have made stale."""

    engine: SyntheticEngine
    sidecar: BaseTestServer
    http: ClientSession

    async def metrics(self) -> Samples:
        async with self.http.get(self.sidecar.make_url("/metrics")) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = await resp.text()
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    async def report(self) -> SaturationReport:
        async with self.http.get(self.sidecar.make_url("/saturation")) as resp:
            assert resp.status == 200
            return SaturationReport.model_validate_json(await resp.read())

    async def healthz(self) -> dict[str, Any]:
        async with self.http.get(self.sidecar.make_url("/healthz")) as resp:
            assert resp.status == 200  # the sidecar itself is fine, whatever the engine does
            body: dict[str, Any] = await resp.json()
            return body

    async def until(
        self, cond: Callable[[SaturationReport], bool], within: float = 10.0
    ) -> SaturationReport:
        """Wait (bounded) until the sidecar's report satisfies `cond`; return that report."""
        return await _wait(self.report, cond, "report", within)

    async def metrics_until(self, cond: Callable[[Samples], bool], within: float = 10.0) -> Samples:
        """Wait (bounded) until the sidecar's /metrics satisfies `cond`; return that body."""
        return await _wait(self.metrics, cond, "metrics", within)


async def _wait(
    read: Callable[[], Awaitable[T]], cond: Callable[[T], bool], what: str, within: float
) -> T:
    deadline = asyncio.get_running_loop().time() + within
    while not cond(got := await read()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not reached in {within:g} s; last {what}: {got}")
        await asyncio.sleep(0.02)
    return got


async def next_poll(served: Callable[[], int], within: float = 10.0) -> None:
    """Wait (bounded) until an engine stand-in that counts its /metrics requests in `served`
    has served one more: a poll that read whatever the test set before this call."""
    before = served()
    deadline = asyncio.get_running_loop().time() + within
    while served() == before:
        assert asyncio.get_running_loop().time() < deadline, f"no poll of the engine in {within} s"
        await asyncio.sleep(0.005)


async def scrape_when_up(
    http: ClientSession, sidecar: BaseTestServer, within: float = 10.0
) -> tuple[str, dict[str, Any]]:
    """The sidecar's /metrics text and /saturation report, read (bounded) until the metrics say
    the engine is up and the report read right after says fresh: a test asserts on these two,
    never on a read a pause of its process could have left stale."""

    async def read() -> tuple[str, dict[str, Any]]:
        async with http.get(sidecar.make_url("/metrics")) as resp:
            assert resp.status == 200
            text = await resp.text()
        async with http.get(sidecar.make_url("/saturation")) as resp:
            assert resp.status == 200
            report: dict[str, Any] = await resp.json()
        return text, report

    def up(got: tuple[str, dict[str, Any]]) -> bool:
        text, report = got
        engine_up = [
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "headroom_engine_up"
        ]
        return engine_up == [1.0] and report["fresh"] is True

    return await _wait(read, up, "/metrics and /saturation", within)


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    for (n, lbls), v in samples.items():
        if n == name and set(labels.items()) <= lbls:
            return v
    return None


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    engine = SyntheticEngine(capacity=1000, model="tiny", slow_seconds=1.0)
    async with TestServer(engine.app()) as eng_srv:
        # Polls 0.2 s apart, each given 0.2 s: none of these tests needs them any shorter.
        cfg = SidecarConfig(
            engine_url=str(eng_srv.make_url("/")), interval=0.2, timeout=0.2,
            window=5.0, forecast_window=5.0,
        )  # fmt: skip
        async with TestServer(build_app(cfg)) as sidecar, ClientSession() as http:
            yield Rig(engine, sidecar, http)


def _up_with_forecast(m: Samples) -> bool:
    return (
        _value(m, "headroom_engine_up", model="tiny") == 1.0
        and _value(m, "headroom_kv_saturation_eta_seconds") is not None
    )


async def test_healthy_engine(rig: Rig) -> None:
    rig.engine.set_used(250)
    m = await rig.metrics_until(_up_with_forecast)
    assert _value(m, "headroom_kv_block_occupancy_ratio") == pytest.approx(0.25)
    assert _value(m, "headroom_kv_blocks", state="used") == 250
    assert _value(m, "headroom_kv_saturation_eta_seconds") == float("inf")
    report = await rig.until(lambda r: r.fresh and r.forecast_ready)
    assert report.engine_up and report.occupancy == pytest.approx(0.25)
    assert report.used_blocks == 250 and report.capacity_blocks == 1000
    assert report.eta_seconds is None  # not growing
    await _wait(rig.healthz, lambda h: h["engine_up"] is True, "/healthz", 10.0)


async def test_growing_usage_gives_a_finite_eta(rig: Rig) -> None:
    await rig.until(lambda r: r.fresh)
    for step in range(30):
        rig.engine.set_used(100 + 10 * step)
        await asyncio.sleep(0.03)
    report = await rig.until(lambda r: r.fresh and r.forecast_ready)
    assert report.growth_blocks_per_second is not None and report.growth_blocks_per_second > 0
    assert report.eta_seconds is not None and report.eta_seconds > 0


@pytest.mark.parametrize(
    ("behaviour", "reason"),
    [
        ("slow", "timeout"),
        ("garbage", "garbage"),
        ("bad_version", "garbage"),
        ("http_500", "http_status"),
    ],
)
async def test_faults_mark_the_engine_down_then_recover(
    rig: Rig, behaviour: str, reason: str
) -> None:
    rig.engine.set_used(400)
    await rig.until(lambda r: r.fresh)
    rig.engine.behaviour = behaviour  # type: ignore[assignment]
    # Down for this fault's reason (a pause could first time out a poll the engine answered).
    report = await rig.until(
        lambda r: not r.engine_up and r.last_error is not None and r.last_error.startswith(reason)
    )
    assert not report.fresh and report.occupancy is None and report.eta_seconds is None
    m = await rig.metrics()  # the fault goes on: no pause can bring the engine back up
    assert _value(m, "headroom_engine_up") == 0.0
    assert _value(m, "headroom_sidecar_poll_errors_total", reason=reason) >= 1  # type: ignore[operator]
    assert _value(m, "headroom_kv_block_occupancy_ratio") is None  # no stale value as fresh
    assert _value(m, "headroom_kv_blocks", state="used") is None
    await rig.healthz()  # the sidecar itself is fine
    rig.engine.behaviour = "ok"
    m = await rig.metrics_until(lambda m: _value(m, "headroom_engine_up") == 1.0)
    assert _value(m, "headroom_kv_block_occupancy_ratio") == pytest.approx(0.4)


async def test_unreachable_engine() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the sidecar polls: nothing listens
    cfg = SidecarConfig(engine_url=f"http://127.0.0.1:{port}", interval=0.05, timeout=0.05)
    async with TestServer(build_app(cfg)) as sidecar, ClientSession() as http:
        rig = Rig(SyntheticEngine(), sidecar, http)
        await rig.until(lambda r: r.last_error is not None)
        m = await rig.metrics()
        assert _value(m, "headroom_engine_up") == 0.0
        assert _value(m, "headroom_sidecar_poll_errors_total", reason="unreachable") >= 1  # type: ignore[operator]
        report = await rig.report()
        assert report.model is None and not report.engine_up


async def test_engine_restart_resets_forecast_and_counts(rig: Rig) -> None:
    rig.engine.queries_tokens_total = 1000
    for step in range(10):
        rig.engine.set_used(500 + 20 * step)
        await asyncio.sleep(0.03)
    await rig.until(lambda r: r.forecast_ready)
    rig.engine.restart()
    report = await rig.until(lambda r: r.engine_restarts_total == 1 and r.fresh)
    assert report.used_blocks == 0
    m = await rig.metrics_until(lambda m: _value(m, "headroom_engine_up") == 1.0)
    assert _value(m, "headroom_sidecar_engine_restarts_total") == 1.0
    assert _value(m, "headroom_prefix_cache_queries_tokens_total") == 0.0  # the engine's reset


async def test_healthz_fails_once_the_poll_loop_has_stopped() -> None:
    """/healthz is the sidecar's own liveness: a dead poll loop answers 503 so the kubelet
    restarts a sidecar that would otherwise export a stale engine for good."""
    cfg = SidecarConfig(engine_url="http://127.0.0.1:1", interval=0.2, timeout=0.2)
    async with TestServer(build_app(cfg)) as sidecar, ClientSession() as http:
        async with http.get(sidecar.make_url("/healthz")) as resp:
            assert resp.status == 200
            assert (await resp.json())["status"] == "ok"
        task = sidecar.app[TASK_KEY]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with http.get(sidecar.make_url("/healthz")) as resp:
            assert resp.status == 503
            assert (await resp.json()) == {"status": "poll loop stopped", "engine_up": False}


async def test_the_app_keeps_the_history_its_longer_window_needs() -> None:
    """The kept samples cover the longer of the two windows: a hit ratio over a 10 s window
    counts the hits of its first seconds, though the forecast window is only 4 s."""
    clock = [0.0]
    engine = SyntheticEngine(capacity=100)
    async with TestServer(engine.app()) as eng_srv:
        cfg = SidecarConfig(
            engine_url=str(eng_srv.make_url("/")), interval=1.0, timeout=0.5,
            window=10.0, forecast_window=4.0,
        )  # fmt: skip
        app = build_app(cfg, clock=lambda: clock[0])
        state = app[STATE_KEY]
        for t in range(21):  # polls 1 s apart on the fake clock, recorded as the poller does
            engine.queries_tokens_total = 10 * t
            engine.hits_tokens_total = 10 * min(max(t - 10, 0), 5)  # hits from t=10 to t=15
            state.record_success(parse_headroom_stats(engine.body()), float(t))
        clock[0] = 20.0  # the poll loop's own polls read the same counters, at t=20
        async with TestServer(app) as sidecar, ClientSession() as http:
            report = await Rig(engine, sidecar, http).until(lambda r: r.fresh)
    assert report.hit_ratio == pytest.approx(0.5)  # 50 of the 100 tokens asked since t=10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        # Each error names the flag the user typed, a rule across flags too.
        (["--engine-url", "localhost:8000"], "--engine-url must be http(s)://HOST:PORT"),
        (["--engine-url", "http://127.0.0.1:99999"], "--engine-url must be http(s)"),
        (
            ["--engine-url", "http://x:1", "--interval", "1", "--timeout", "2"],
            "--timeout (2.0 s) must not exceed --interval (1.0 s)",
        ),
        (["--engine-url", "http://x:1", "--window", "0"], "--window: Input should be greater"),
        (["--engine-url", "http://x:1", "--page-size", "0"], "--page-size: Input should be"),
        # An endless window would keep every sample, and each scrape would walk them all.
        (["--engine-url", "http://x:1", "--window", "inf"], "finite"),
        (["--engine-url", "http://x:1", "--forecast-window", "1e308"], "--forecast-window: "),
        # Too short to hold the polls a forecast or a rate needs: they would never be exported.
        (["--engine-url", "http://x:1", "--forecast-window", "0.5"], "must hold 3 polls"),
        (["--engine-url", "http://x:1", "--window", "0.5"], "at least one --interval (1 s)"),
        (["--engine-url", "http://x:1", "--port", "70000"], "--port: "),
        (["--engine-url", "http://x:1", "--source", "tgi"], "invalid choice"),
    ],
)
def test_cli_rejects_bad_flags(
    flags: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = sidecar_main(flags)
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    assert code == 2
    assert complaint in capsys.readouterr().err


def test_a_key_no_header_can_carry_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A multi-line Secret: aiohttp would refuse the header at every poll, and the engine
    would read as down for good; the sidecar says so at start instead."""
    monkeypatch.setenv("HEADROOM_API_KEY", "a\rb\n")
    assert sidecar_main(["--engine-url", "http://x:1", "--source", "sglang"]) == 2
    err = capsys.readouterr().err
    assert "control character" in err and "a\rb" not in err


async def test_python_m_headroom_sidecar_serves_metrics() -> None:
    engine = SyntheticEngine(capacity=64, model="tiny")
    engine.set_used(16)
    port = _free_port()
    async with TestServer(engine.app()) as eng_srv:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "headroom.sidecar", "--engine-url", str(eng_srv.make_url("/")),
            "--host", "127.0.0.1", "--port", str(port), "--interval", "0.1", "--timeout", "0.1",
            "--pod", "p-0", "--namespace", "ns",
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            async with ClientSession() as http:
                text = ""
                deadline = asyncio.get_running_loop().time() + 20
                while "headroom_kv_block_occupancy_ratio" not in text:
                    assert proc.returncode is None, "sidecar exited"
                    assert asyncio.get_running_loop().time() < deadline, text
                    try:
                        async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                            text = await resp.text()
                    except OSError:
                        pass
                    await asyncio.sleep(0.1)
            line = next(x for x in text.splitlines() if x.startswith("headroom_kv_block_occ"))
            assert line == (
                'headroom_kv_block_occupancy_ratio{model="tiny",namespace="ns",pod="p-0"} 0.25'
            )
        finally:
            proc.terminate()
            await proc.wait()
    assert proc.returncode == 0  # clean shutdown on SIGTERM


async def test_serve_polls_once_it_listens() -> None:
    """`serve` polls once it listens (the engine shows up in /healthz), and `stop` ends it with
    the port released. That it does not poll before (a port taken) is the CLI test's."""
    from engine_process import free_port

    from headroom.sidecar.server import serve

    engine = SyntheticEngine(capacity=1000, model="tiny")
    engine.set_used(100)
    async with TestServer(engine.app()) as eng_srv, ClientSession() as http:
        port = free_port()
        cfg = SidecarConfig(
            engine_url=str(eng_srv.make_url("/")), host="127.0.0.1", port=port,
            interval=0.2, timeout=0.2,
        )  # fmt: skip
        stop = asyncio.Event()
        task = asyncio.create_task(serve(cfg, stop))
        url = f"http://127.0.0.1:{port}/healthz"

        async def health() -> dict[str, Any]:
            try:
                async with http.get(url) as resp:
                    return dict(await resp.json())
            except OSError:  # not listening yet
                return {}

        body = await _wait(health, lambda b: b.get("engine_up") is True, "/healthz", 10.0)
        assert body["status"] == "ok"
        stop.set()
        await asyncio.wait_for(task, 10.0)
    with socket.socket() as again:  # released (its closed connections may linger in TIME_WAIT)
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
        again.listen()
