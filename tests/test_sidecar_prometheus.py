"""A real Prometheus scrapes a real sidecar (`python -m headroom.sidecar`) in front of an engine.

Prometheus is Debian's `/usr/bin/prometheus`, started here on loopback with a free port, a temp
TSDB and a generated config (`scrape_interval: 1s`, the shipped alert rules loaded); it is
stopped in teardown. Assertions go through its HTTP API, as a dashboard or the operator's
Prometheus mode would read the data.

Two engines sit behind the sidecar:
- the real engine with the tiny model, under real requests: `python -m headroom.engine.server`
  as a subprocess;
- the scriptable `SyntheticEngine`, ramping usage so that the forecast and the
  HeadroomKVSaturationImminent rule can be checked end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import ClientSession, ClientTimeout
from aiohttp.test_utils import TestServer
from synthetic_engine import SyntheticEngine
from test_operator_metrics_sources import stop

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "charts" / "headroom" / "files" / "headroom-alerts.yaml"
PROMETHEUS = shutil.which("prometheus")
IDENTITY = {"namespace": "llm", "inferencedeployment": "chat", "pod": "chat-0"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for(
    what: str, probe: Callable[[], Awaitable[Any]], within: float, every: float = 0.25
) -> Any:
    """Poll `probe` until it returns something truthy; fail naming `what` after `within` s."""
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            last = await probe()
            if last:
                return last
        await asyncio.sleep(every)
    raise AssertionError(f"timed out waiting for {what}; last answer: {last!r}")


class Prometheus:
    """A throwaway Prometheus server scraping `targets` (never the system one)."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        assert PROMETHEUS is not None, (
            "prometheus is not installed: make tools installs Debian's prometheus"
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {RULES}\n"
            "scrape_configs:\n  - job_name: headroom-sidecar\n    honor_labels: true\n"
            f"    static_configs:\n      - targets: [{', '.join(repr(t) for t in targets)}]\n"
        )
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        stop(self.proc)
        self.log.close()

    def log_tail(self) -> str:
        return (self.workdir / "prometheus.log").read_text()[-3000:]

    async def wait_ready(self, http: ClientSession) -> None:
        async def ready() -> bool:
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log_tail()}"
            async with http.get(f"{self.url}/-/ready") as resp:
                return resp.status == 200

        await wait_for("prometheus /-/ready", ready, within=60)

    async def api(self, http: ClientSession, path: str, **params: str) -> Any:
        async with http.get(f"{self.url}/api/v1/{path}", params=params) as resp:
            body = await resp.json()
        assert body["status"] == "success", body
        return body["data"]

    async def query(self, http: ClientSession, promql: str) -> list[dict[str, Any]]:
        data = await self.api(http, "query", query=promql)
        assert data["resultType"] == "vector", data
        return list(data["result"])


class Sidecar:
    """`python -m headroom.sidecar` as a subprocess, the way the pod runs it."""

    def __init__(self, workdir: Path, engine_url: str, interval: float) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log_path = workdir / "sidecar.log"
        self.log = self.log_path.open("w")
        flags = [f"--{k}={v}" for k, v in IDENTITY.items()]
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "headroom.sidecar", "--engine-url", engine_url,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--interval", str(interval), "--timeout", str(min(0.8, interval)),
                "--window", "30", "--forecast-window", "15", *flags,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip

    def stop(self) -> None:
        stop(self.proc)
        self.log.close()


@contextlib.asynccontextmanager
async def scraped(
    tmp_path: Path, engine_url: str, interval: float
) -> AsyncIterator[tuple[Prometheus, ClientSession]]:
    """Sidecar in front of `engine_url`, Prometheus scraping it; both stopped afterwards."""
    sidecar = Sidecar(tmp_path, engine_url, interval)
    prom = Prometheus(tmp_path, [sidecar.target])
    try:
        async with ClientSession(timeout=ClientTimeout(total=10)) as http:
            await prom.wait_ready(http)
            yield prom, http
        assert sidecar.proc.poll() is None, "the sidecar exited"
    finally:
        prom.stop()
        sidecar.stop()


def _labels_ok(series: dict[str, Any], model: str) -> None:
    metric = series["metric"]
    assert {k: metric.get(k) for k in IDENTITY} == IDENTITY, metric
    assert metric.get("model") == model, metric
    assert metric.get("job") == "headroom-sidecar", metric


# -- the real engine -----------------------------------------------------------------------


# Long enough that every scrape during a wave sees the sequences' blocks held.
MAX_TOKENS = 96
SHARED_PREFIX = (
    "You are a helpful assistant for the headroom project. Answer briefly and precisely. "
    "The KV cache holds keys and values of every token of every running sequence. "
)


@contextlib.asynccontextmanager
async def served_engine(
    tmp_path: Path,
) -> AsyncIterator[tuple[str, Callable[[int], Awaitable[None]]]]:
    """`python -m headroom.engine.server --model tiny` as a subprocess; yields its URL and a
    load driver sending real `/v1/completions` requests."""
    port = free_port()
    log = (tmp_path / "engine.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "headroom.engine.server", "--model", "tiny",
         "--host", "127.0.0.1", "--port", str(port),
         "--num-blocks", "192", "--max-model-len", "1024"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with ClientSession(timeout=ClientTimeout(total=120)) as http:

            async def ready() -> bool:
                assert proc.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
                async with http.get(f"{url}/stats") as resp:
                    return resp.status == 200

            await wait_for("engine /stats", ready, within=180, every=0.5)

            async def load(n: int) -> None:
                async def one(i: int) -> None:
                    body = {"model": "tiny", "prompt": f"{SHARED_PREFIX} Question {i}:",
                            "max_tokens": MAX_TOKENS, "ignore_eos": True}  # fmt: skip
                    async with http.post(f"{url}/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()

                await asyncio.gather(*(one(i) for i in range(n)))

            yield url, load
    finally:
        stop(proc, grace=30)
        log.close()


async def test_prometheus_scrapes_sidecar_in_front_of_real_engine(tmp_path: Path) -> None:
    async with (
        served_engine(tmp_path) as (engine_url, load),
        scraped(tmp_path, engine_url, interval=1.0) as (prom, http),
    ):
        # Waves of requests sharing a prefix, for as long as we look: later waves hit the prefix
        # cached by earlier ones, and the hit ratio's window always holds queries.
        async def keep_loading() -> None:
            while True:
                await load(4)

        loader = asyncio.create_task(keep_loading())

        async def up() -> list[dict[str, Any]]:
            return await prom.query(http, "headroom_engine_up == 1")

        await wait_for("headroom_engine_up == 1 in Prometheus", up, within=30)
        names = (
            "headroom_kv_block_occupancy_ratio",
            "headroom_prefix_cache_hit_ratio > 0",  # later waves reuse the cached prefix
            "headroom_kv_saturation_eta_seconds",
            'headroom_time_to_first_token_seconds_bucket{le="+Inf"} > 0',
        )

        async def everything() -> bool:
            missing = [n for n in names if not await prom.query(http, n)]
            assert loader.done() is False or loader.exception() is None, loader.exception()
            return not missing

        try:
            await wait_for("occupancy, hit ratio, eta and TTFT in Prometheus", everything, 90)
        finally:
            loader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loader
        occ = await prom.query(http, "headroom_kv_block_occupancy_ratio")
        hit = await prom.query(http, "headroom_prefix_cache_hit_ratio")
        eta = await prom.query(http, "headroom_kv_saturation_eta_seconds")
        # The engine's exact integral: the tiny model's requests can start and finish between
        # two polls, so a sampled used-blocks gauge may read 0 at every scrape.
        busiest = await prom.query(http, "headroom_kv_block_seconds_total")
        queried = await prom.query(http, "headroom_prefix_cache_queries_tokens_total")
        ttft = await prom.query(http, 'headroom_time_to_first_token_seconds_bucket{le="+Inf"}')
        rules = await prom.api(http, "rules")

    for series in (*occ, *hit, *eta):
        _labels_ok(series, model="tiny")
    assert 0.0 <= float(occ[0]["value"][1]) <= 1.0
    assert 0.0 < float(hit[0]["value"][1]) <= 1.0
    value = float(eta[0]["value"][1])
    assert value >= 0.0  # +Inf when not growing
    assert float(busiest[0]["value"][1]) > 0  # the load really occupied blocks (block-seconds)
    assert float(queried[0]["value"][1]) > 0
    assert float(ttft[0]["value"][1]) > 0  # first tokens were observed
    health = {r["name"]: r["health"] for g in rules["groups"] for r in g["rules"]}
    shipped = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert set(health) == shipped and set(health.values()) == {"ok"}, health


# -- the synthetic ramp --------------------------------------------------------------------


@pytest.fixture
def ramp() -> Iterator[SyntheticEngine]:
    eng = SyntheticEngine(capacity=4000, model="synthetic")
    eng.set_used(1000)
    eng.running = 4
    yield eng


async def test_prometheus_sees_forecast_and_pending_alert_on_a_ramp(
    tmp_path: Path, ramp: SyntheticEngine
) -> None:
    async def drive() -> None:
        # ~60 blocks/s from 1000 of 4000: about 50 s to the wall, so eta < 120 s.
        while True:
            ramp.set_used(ramp.used + 6)
            ramp.queries_tokens_total += 100
            ramp.hits_tokens_total += 30
            ramp.observe_ttft(0.02)
            await asyncio.sleep(0.1)

    async with TestServer(ramp.app(), host="127.0.0.1") as engine:
        driver: asyncio.Task[None] | None = None
        try:
            async with scraped(tmp_path, str(engine.make_url("/")), interval=0.5) as (prom, http):

                async def up() -> list[dict[str, Any]]:
                    return await prom.query(http, "headroom_engine_up == 1")

                # The ramp starts once Prometheus has the sidecar's series, so that it has its
                # ~50 s to the wall however slowly the sidecar and Prometheus started.
                await wait_for("headroom_engine_up == 1 in Prometheus", up, within=60)
                driver = asyncio.create_task(drive())

                async def eta() -> list[dict[str, Any]]:
                    return await prom.query(http, "headroom_kv_saturation_eta_seconds < 120")

                # The forecast of the ramp: its first points, beside the flat ones before it in
                # the sidecar's window, give a far eta (the segmented fit takes the ramp alone
                # from its fifth point on).
                eta_series = await wait_for("the ramp's eta (< 120 s) in Prometheus", eta, 60)
                occ = await prom.query(http, "headroom_kv_block_occupancy_ratio")
                hit = await prom.query(http, "headroom_prefix_cache_hit_ratio")
                cap = await prom.query(http, "headroom_kv_blocks_capacity")
                blocks = await prom.query(http, "headroom_kv_blocks")

                async def pending() -> list[dict[str, Any]]:
                    alerts = (await prom.api(http, "alerts"))["alerts"]
                    return [a for a in alerts if a["labels"]["alertname"] ==
                            "HeadroomKVSaturationImminent"]  # fmt: skip

                alerts = await wait_for("HeadroomKVSaturationImminent", pending, within=30)
        finally:
            if driver is not None:
                driver.cancel()

    for series in (*eta_series, *occ, *hit):
        _labels_ok(series, model="synthetic")
    assert 0.0 < float(eta_series[0]["value"][1]) < 120.0
    assert 0.25 <= float(occ[0]["value"][1]) < 1.0
    assert float(hit[0]["value"][1]) == pytest.approx(0.3, abs=1e-6)
    assert float(cap[0]["value"][1]) == 4000
    assert {b["metric"]["state"] for b in blocks} == {"free", "used", "cached"}
    alert = alerts[0]
    assert alert["state"] in {"pending", "firing"}
    assert {k: alert["labels"][k] for k in IDENTITY} == IDENTITY
    assert alert["labels"]["severity"] == "warning"
