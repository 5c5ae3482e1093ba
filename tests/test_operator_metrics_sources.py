"""Metrics sources: parsing alone, then a real sidecar and a real Prometheus end to end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from synthetic_engine import SyntheticEngine

from headroom.contract.demand import CounterSample, DemandRates
from headroom.contract.report import SaturationReport
from headroom.operator.scaling import metrics_sources
from headroom.operator.scaling.decide import PodSample
from headroom.operator.scaling.metrics_sources import (
    MetricsError,
    PodInfo,
    PrometheusSource,
    ScrapeTarget,
    SidecarSource,
    client_session,
    parse_prometheus,
    pod_info,
    promql,
    rate_window_seconds,
    read_capped,
    sample_from_report,
    usable,
)
from headroom.operator.status import parse_time

PROMETHEUS = shutil.which("prometheus")
TARGET = ScrapeTarget(namespace="llm", name="chat")


def report(**kw: Any) -> SaturationReport:
    base: dict[str, Any] = dict(
        time=1000.0, source="headroom", pod="chat-0", namespace="llm", inferencedeployment="chat",
        model="m", engine_up=True, fresh=True, age_seconds=0.5, stale_after_seconds=10,
        last_error=None, occupancy=0.42, used_blocks=420, capacity_blocks=1000, cached_blocks=10,
        block_size=16, bytes_per_token=4096, growth_blocks_per_second=2.0,
        growth_ratio_per_second=0.002, eta_seconds=290.0, forecast_ready=True, forecast_points=9,
        hit_ratio=0.3, prefix_cache_enabled=True, running=7, waiting=2, preemptions_total=5,
        preemption_rate_per_second=0.1, window_seconds=60, forecast_window_seconds=30,
        engine_restarts_total=0,
    )  # fmt: skip
    base.update(kw)
    # Fields the operator does not read get neutral values, so the sidecar may add more.
    for name, info in SaturationReport.model_fields.items():
        if name not in base and info.is_required():
            ann = str(info.annotation)
            base[name] = (
                None if "None" in ann else False if "bool" in ann else 0 if "int" in ann else 0.0
            )
    return SaturationReport(**base)


def test_sample_from_report_keeps_the_figures() -> None:
    s = sample_from_report(report())
    assert s is not None
    assert (s.occupancy, s.used_blocks, s.capacity_blocks, s.waiting) == (0.42, 420, 1000, 2)
    assert s.eta_seconds == 290.0 and s.preemption_rate == 0.1 and s.engine_up
    assert s.sampled_at == 999.5  # the last good poll, not the time of the report
    stale = sample_from_report(report(fresh=False))
    assert stale is not None and not stale.engine_up
    assert sample_from_report(report(occupancy=None)) is None


def test_a_sample_tells_no_forecast_yet_from_not_growing() -> None:
    # The contract's None ETA is "not growing" only when forecast_ready; before the sidecar's
    # forecast is ready (its first polls after a start or restart) it is "no forecast yet".
    pending = usable(sample_from_report(report(eta_seconds=None, forecast_ready=False)))
    flat = usable(sample_from_report(report(eta_seconds=None, forecast_ready=True)))
    assert pending is not None and pending.eta_seconds is None and not pending.forecast_ready
    assert flat is not None and flat.eta_seconds is None and flat.forecast_ready
    # An ETA that is no number is no forecast either, not "not growing".
    for eta in (math.nan, -5.0):
        s = usable(sample_from_report(report(eta_seconds=eta, forecast_ready=True)))
        assert s is not None and s.eta_seconds is None and not s.forecast_ready, eta


def test_figures_no_engine_reports_are_dropped_not_carried_to_status() -> None:
    # An ETA past the sidecar's longest (its slope floor) is "not growing", as +Inf is: 1e32 s
    # overflowed status.kv.eta and the status write failed at every tick. A preemption rate
    # beyond any pod's counts none: two pods' 1e308 summed to inf in the KVSaturated message.
    s = usable(sample_from_report(report(eta_seconds=1e32, preemption_rate_per_second=1e308)))
    assert s is not None and s.eta_seconds is None and s.forecast_ready
    assert s.preemption_rate == 0.0
    longest = usable(sample_from_report(report(eta_seconds=9.9e8, preemption_rate_per_second=3.0)))
    assert longest is not None and longest.eta_seconds == 9.9e8 and longest.preemption_rate == 3.0


def test_blocks_that_contradict_the_occupancy_make_the_pod_silent() -> None:
    # Every source's occupancy is used / capacity: used blocks counted in tokens (16x) were
    # sized on as present KV, 3 -> 11 pods on one answer.
    assert usable(sample_from_report(report(used_blocks=8000, capacity_blocks=1000))) is None
    assert usable(sample_from_report(report(used_blocks=420, capacity_blocks=2))) is None
    near = usable(sample_from_report(report(occupancy=0.42, used_blocks=440)))
    assert near is not None and near.used_blocks == 440  # rounding, not another unit
    assert usable(sample_from_report(report(occupancy=0.42, used_blocks=480))) is None


def test_a_small_pool_may_disagree_by_one_block() -> None:
    """One block of 8 is 12.5 %: an engine whose ratio counts a block the sidecar does not (or
    rounds) must not make its pod silent; two blocks off is another unit, as on a large pool."""
    off_by_one = usable(
        sample_from_report(report(occupancy=3 / 8, used_blocks=4, capacity_blocks=8))
    )
    assert off_by_one is not None and off_by_one.used_blocks == 4
    assert usable(sample_from_report(report(occupancy=3 / 8, used_blocks=2, capacity_blocks=8)))
    assert (
        usable(sample_from_report(report(occupancy=3 / 8, used_blocks=5, capacity_blocks=8)))
        is None
    )


@pytest.mark.parametrize("age", [-1e6, -120.0, math.nan])
def test_an_age_no_sidecar_sends_makes_the_pod_silent(age: float) -> None:
    # A negative age dated the pod's counters in the future, and its rates with them.
    assert sample_from_report(report(age_seconds=age), received_at=5000.0) is None
    assert sample_from_report(report(age_seconds=0.0), received_at=5000.0) is not None


def test_promql_is_one_query_with_every_series_tagged() -> None:
    q = promql(ScrapeTarget(namespace='we"ird', name="chat"))
    assert q.count(" or ") == 16
    assert 'namespace="we\\"ird",inferencedeployment="chat"' in q
    for tag in ("occupancy", "eta", "up", "time", "preempt", "waiting", "capacity",
                "arrivals", "departures", "block_seconds", "arrived_total"):  # fmt: skip
        assert f'"q", "{tag}"' in q


def vec(pod: str, q: str, value: str, ts: float = 100.0) -> dict[str, Any]:
    return {"metric": {"pod": pod, "q": q, "namespace": "llm"}, "value": [ts, value]}


def test_parse_prometheus_vector() -> None:
    doc = {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [
                vec("a", "occupancy", "0.5"), vec("a", "eta", "+Inf"), vec("a", "up", "1"),
                vec("a", "time", "95.5"), vec("a", "hit", "NaN"), vec("a", "waiting", "3"),
                vec("a", "preempt", "0.25"), vec("a", "capacity", "2000"),
                vec("b", "occupancy", "0.9"), vec("b", "eta", "40"), vec("b", "up", "0"),
                vec("c", "eta", "10"),  # no occupancy: not a usable sample
            ],
        },
    }  # fmt: skip
    out = parse_prometheus(doc)
    assert set(out) == {"a", "b"}
    a, b = out["a"], out["b"]
    assert a.eta_seconds is None and a.hit_ratio is None and a.engine_up
    assert (a.waiting, a.preemption_rate, a.capacity_blocks, a.sampled_at) == (3, 0.25, 2000, 95.5)
    assert b.eta_seconds == 40 and not b.engine_up and b.sampled_at == 100.0
    # +Inf: a forecast that says not growing; no ETA series: the sidecar has no forecast yet.
    assert a.forecast_ready and b.forecast_ready
    doc["data"]["result"] = [vec("d", "occupancy", "0.5"), vec("e", "occupancy", "0.5"),
                             vec("e", "eta", "NaN")]  # fmt: skip
    out = parse_prometheus(doc)
    assert not out["d"].forecast_ready and out["d"].eta_seconds is None
    assert not out["e"].forecast_ready and out["e"].eta_seconds is None
    with pytest.raises(MetricsError, match="bad_data"):
        parse_prometheus({"status": "error", "error": "bad_data: parse error"})


def test_pod_info_from_a_pod_object() -> None:
    pod = {
        "metadata": {"name": "p", "creationTimestamp": "2023-11-14T22:13:20Z"},
        "status": {"phase": "Running", "podIP": "10.1.2.3",
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip
    info = pod_info(pod, parse_time)
    assert info == PodInfo("p", "10.1.2.3", True, 1_700_000_000.0, False)
    pod["metadata"]["deletionTimestamp"] = "2023-11-14T22:14:00Z"
    assert pod_info(pod, parse_time).terminating


async def test_sidecar_source_skips_silent_and_broken_pods() -> None:
    async def good(_: web.Request) -> web.Response:
        # One stand-in answers for every pod here: it names none (a sidecar without POD_NAME).
        body = report(pod=None).model_dump_json()
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/saturation", good)
    broken = web.Application()

    async def garbage(_: web.Request) -> web.Response:
        return web.Response(text="{not json")

    broken.router.add_get("/saturation", garbage)
    async with (
        TestServer(app, host="127.0.0.1") as ok,
        TestServer(broken, host="127.0.0.1") as bad,
        aiohttp.ClientSession() as http,
    ):
        src = SidecarSource(http, port=ok.port)
        pods = [
            PodInfo("ready", "127.0.0.1", True, 0.0),
            PodInfo("loading", "127.0.0.1", False, 0.0),
            PodInfo("no-ip", None, True, 0.0),
            PodInfo("draining", "127.0.0.1", False, 0.0, terminating=True),
        ]
        got = await src.sample(TARGET, pods)
        assert sorted(got) == ["draining", "ready"] and got["ready"].occupancy == 0.42
        assert await SidecarSource(http, port=bad.port).sample(TARGET, pods) == {}


async def test_a_pod_on_a_node_whose_clock_is_behind_is_timed_on_the_operator_s_clock() -> None:
    # The report's `time` is the pod's node's clock. A node 10 minutes behind made every
    # sample of its pods older than metricsMaxAgeSeconds (60) for good: scaling held forever.
    async def behind(_: web.Request) -> web.Response:
        r = report(pod=None, time=time.time() - 600, age_seconds=1.5, requests_arrived_total=7,
                   requests_departed_total=5, kv_block_seconds_total=90.0)  # fmt: skip
        return web.Response(body=r.model_dump_json(), content_type="application/json")

    app = web.Application()
    app.router.add_get("/saturation", behind)
    async with TestServer(app, host="127.0.0.1") as srv, aiohttp.ClientSession() as http:
        before = time.time()
        got = await SidecarSource(http, port=srv.port).sample(
            TARGET, [PodInfo("chat-0", "127.0.0.1", True, 0.0)]
        )
        after = time.time()
    s = got["chat-0"]
    assert s.counters is not None
    # Read 1.5 s (the report's age, a length of time) before the answer came.
    assert before - 1.5 <= s.sampled_at <= after - 1.5
    assert abs(s.counters.t - s.sampled_at) < 5  # the steady clock: the same moment


async def test_counters_are_timed_on_a_clock_that_does_not_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The span between two decisions divides the counters' increase: an NTP step of the
    # operator's clock between two polls (back 14 s of a 15 s interval) read steady traffic
    # as 15x, and a step forward cancelled the pods on their way.
    async def ok(_: web.Request) -> web.Response:
        r = report(pod=None, time=time.time(), age_seconds=0.0, requests_arrived_total=7,
                   requests_departed_total=5, kv_block_seconds_total=90.0)  # fmt: skip
        return web.Response(body=r.model_dump_json(), content_type="application/json")

    app = web.Application()
    app.router.add_get("/saturation", ok)
    pods = [PodInfo("chat-0", "127.0.0.1", True, 0.0)]
    async with TestServer(app, host="127.0.0.1") as srv, aiohttp.ClientSession() as http:
        src = SidecarSource(http, port=srv.port)
        first = (await src.sample(TARGET, pods))["chat-0"]
        wall = time.time
        monkeypatch.setattr(metrics_sources.time, "time", lambda: wall() + 600)
        second = (await src.sample(TARGET, pods))["chat-0"]
    assert first.counters is not None and second.counters is not None
    assert second.sampled_at - first.sampled_at > 590  # freshness is the wall clock's
    assert 0 <= second.counters.t - first.counters.t < 60  # the span is not


def test_a_prometheus_sample_is_timed_by_its_age_on_the_operator_s_clock() -> None:
    # Evaluated at 1000 on Prometheus' clock, scraped at 995: 5 s old, whatever Prometheus'
    # clock says against the operator's (90 s behind, every sample read stale for good).
    doc = {
        "status": "success",
        "data": {"resultType": "vector", "result": [
            vec("a", "occupancy", "0.5", 1000.0), vec("a", "up", "1", 1000.0),
            vec("a", "time", "995", 1000.0), vec("a", "arrived_total", "7", 1000.0),
            vec("a", "departed_total", "5", 1000.0), vec("a", "block_seconds_total", "90", 1000.0),
        ]},
    }  # fmt: skip
    a = parse_prometheus(doc, 60.0, received_at=5090.0, steady_at=7090.0)["a"]
    assert a.sampled_at == 5085.0 and a.counters is not None and a.counters.t == 7085.0
    alone = parse_prometheus(doc)["a"]  # without the operator's clocks: Prometheus' own
    assert alone.sampled_at == 995.0 and alone.counters is not None and alone.counters.t == 995.0


async def test_a_sidecar_naming_another_pod_namespace_or_deployment_is_not_this_pods() -> None:
    # An evicted pod's IP goes to a new pod, perhaps another deployment's or another
    # namespace's (the same names there): its KV is not ours.
    answers = iter([report(pod="other-7f9"), report(inferencedeployment="other"),
                    report(namespace="team-b"), report()])  # fmt: skip

    async def reused(_: web.Request) -> web.Response:
        return web.Response(body=next(answers).model_dump_json(), content_type="application/json")

    app = web.Application()
    app.router.add_get("/saturation", reused)
    async with TestServer(app, host="127.0.0.1") as srv, aiohttp.ClientSession() as http:
        src = SidecarSource(http, port=srv.port)
        pod = [PodInfo("chat-0", "127.0.0.1", True, 0.0)]
        assert await src.sample(TARGET, pod) == {}
        assert await src.sample(TARGET, pod) == {}
        assert await src.sample(TARGET, pod) == {}
        assert set(await src.sample(TARGET, pod)) == {"chat-0"}
        # An exited pod (evicted: phase Failed) holds no KV and is not asked at all.
        gone = [PodInfo("chat-0", "127.0.0.1", False, 0.0, terminating=True, exited=True)]
        assert await src.sample(TARGET, gone) == {}


@pytest.mark.parametrize(
    ("field", "value", "kept"),
    [("occupancy", math.nan, False), ("occupancy", math.inf, False), ("occupancy", 7.0, False),
     ("occupancy", -0.1, False), ("hit_ratio", 1e400, True), ("eta_seconds", math.nan, True),
     ("preemption_rate_per_second", math.inf, True), ("growth_blocks_per_second", math.nan, True),
     ("arrival_rate_per_second", math.inf, True), ("arrival_rate_per_second", 1e200, True),
     ("kv_block_seconds_per_second", 1e308, True), ("demand_window_seconds", math.nan, True),
     ("demand_window_seconds", -1.0, True), ("demand_window_seconds", 1e9, True)],
)  # fmt: skip
def test_a_figure_that_is_not_a_number_makes_the_pod_silent_or_drops_the_figure(
    field: str, value: float, kept: bool
) -> None:
    # One pod's NaN raised in the scaling loop (round(NaN)), which stopped scaling the whole
    # deployment; Infinity would have bought pods. A NaN or negative rate window turned the
    # forecast's mean to 0 (a needed scale-out missed), and a 1e308 rate raised in decide().
    extra = {"departure_rate_per_second": 1.0, "kv_block_seconds_per_second": 10.0,
             "arrival_rate_per_second": 1.0}  # fmt: skip
    sample = usable(sample_from_report(report(**{**extra, field: value})))
    assert (sample is not None) == kept
    if sample is not None:
        figures = (sample.occupancy, sample.hit_ratio, sample.eta_seconds,
                   sample.preemption_rate, sample.growth_blocks_per_second)  # fmt: skip
        assert all(x is None or math.isfinite(x) for x in figures)
        if field in {"arrival_rate_per_second", "kv_block_seconds_per_second",
                     "demand_window_seconds"}:  # fmt: skip
            assert sample.demand is None
        else:
            assert sample.demand is not None


@pytest.mark.parametrize("q", ["waiting", "running", "used", "capacity"])
def test_a_count_no_pod_holds_makes_the_pod_silent(q: str) -> None:
    """A broken exporter's 1e20 requests: status keeps counts as int64, and the API server
    refused the whole status write at every tick."""
    doc = {"status": "success", "data": {"resultType": "vector", "result": [
        vec("a", "occupancy", "0.5"), vec("a", q, "1e20"),
        vec("b", "occupancy", "0.5"), vec("b", q, "7"),
    ]}}  # fmt: skip
    out = {pod: usable(s) for pod, s in parse_prometheus(doc).items()}
    assert out.get("a") is None and out["b"] is not None


def test_prometheus_answers_that_are_not_results_are_a_metrics_error_or_skipped() -> None:
    for doc in (None, [], {"status": "success", "data": None}):
        with pytest.raises(MetricsError):
            parse_prometheus(doc)
    odd = {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"pod": "a", "q": "occupancy"}},  # no value
        {"metric": {"pod": "a", "q": "used"}, "value": [100, "+Inf"]},
        {"metric": {"pod": "a", "q": "occupancy"}, "value": [100, "0.5"]},
        {"metric": {"pod": "b", "q": "occupancy"}, "value": [100, "+Inf"]},
        "not a series",
    ]}}  # fmt: skip
    out = parse_prometheus(odd)
    assert set(out) == {"a"} and out["a"].occupancy == 0.5 and out["a"].used_blocks is None


async def test_an_ipv6_pod_ip_is_put_in_brackets() -> None:
    # Unbracketed, aiohttp refused the URL and every pod of an IPv6 cluster read as silent.
    # No connection is made here: the session records the URL and answers nothing.
    asked: list[str] = []

    class Session:
        def get(self, url: str, **_: Any) -> Any:
            asked.append(url)
            raise aiohttp.ClientConnectionError("not connecting in a test")

    src = SidecarSource(Session(), port=9090)  # type: ignore[arg-type]
    pods = [PodInfo("a", "fd00:10:244::5", True, 0.0), PodInfo("b", "10.0.0.7", True, 0.0)]
    assert await src.sample(TARGET, pods) == {}
    assert sorted(asked) == ["http://10.0.0.7:9090/saturation",
                             "http://[fd00:10:244::5]:9090/saturation"]  # fmt: skip


async def test_prometheus_source_without_url_or_server() -> None:
    async with aiohttp.ClientSession() as http:
        with pytest.raises(MetricsError, match="prometheusURL"):
            await PrometheusSource(http).sample(TARGET, [])
        port = free_port()
        with pytest.raises(MetricsError, match="unreachable"):
            await PrometheusSource(http, f"http://127.0.0.1:{port}", timeout=2).sample(TARGET, [])


async def _answering(handler: Any) -> tuple[web.Application, list[str]]:
    """An app answering every GET and POST with `handler`, and the paths it was asked."""
    asked: list[str] = []

    async def any_path(request: web.Request) -> web.StreamResponse:
        asked.append(request.path_qs)
        return await handler(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_path)
    return app, asked


async def test_a_spec_s_prometheus_url_is_asked_only_where_the_operator_allows() -> None:
    # Whoever may create an InferenceDeployment must not pick where the operator sends requests
    # (an internal admin endpoint, a cloud metadata service).
    async def ok(_: web.Request) -> web.Response:
        doc = {"status": "success", "data": {"resultType": "vector", "result": []}}
        return web.json_response(doc)

    app, asked = await _answering(ok)
    async with TestServer(app, host="127.0.0.1") as srv, aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{srv.port}/admin/flush?x="
        spec = ScrapeTarget("llm", "chat", url)
        with pytest.raises(MetricsError, match="--allow-prometheus-url"):
            await PrometheusSource(http, "http://prometheus:9090").sample(spec, [])
        assert asked == []
        allowed = PrometheusSource(http, allowed=(f"http://127.0.0.1:{srv.port}/*",))
        assert await allowed.sample(spec, []) == {}
        assert len(asked) == 1
        # The operator's own is always allowed, named by the spec or not.
        own = PrometheusSource(http, f"http://127.0.0.1:{srv.port}")
        assert await own.sample(ScrapeTarget("llm", "chat", own.default_url), []) == {}


async def test_a_redirect_is_not_followed_and_an_endless_answer_not_read_whole() -> None:
    # A pod's sidecar (its image is the tenant's choice) or a Prometheus may answer anything:
    # a redirect elsewhere, or a body that would exhaust the operator's memory.
    async def redirect(_: web.Request) -> web.Response:
        raise web.HTTPFound("/latest/meta-data/iam/security-credentials/")

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(64):  # 32 MiB in 512 KiB writes, stopped by the reader
            await resp.write(b" " * (512 << 10))
        return resp

    for handler in (redirect, endless):
        app, asked = await _answering(handler)
        async with TestServer(app, host="127.0.0.1") as srv, aiohttp.ClientSession() as http:
            pods = [PodInfo("chat-0", "127.0.0.1", True, 0.0)]
            assert await SidecarSource(http, port=srv.port).sample(TARGET, pods) == {}
            prom = PrometheusSource(http, f"http://127.0.0.1:{srv.port}", timeout=30)
            with pytest.raises(MetricsError, match=r"HTTP 302|over 16,777,216 bytes"):
                await prom.sample(TARGET, pods)
        assert all("meta-data" not in a for a in asked), asked


async def test_a_prometheus_that_hangs_or_nests_too_deep_is_a_metrics_error_that_says_why() -> None:
    # Arrays nested past the JSON parser's recursion limit raise RecursionError, not
    # ValueError: it escaped the tick, which then wrote no status at all.
    async def deep(_: web.Request) -> web.Response:
        return web.Response(text="[" * 100_000, content_type="application/json")

    async def hang(_: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response(text="{}")

    for handler, why in ((deep, "something other than JSON"), (hang, r"no answer in 0\.5 s$")):
        app, _ = await _answering(handler)
        async with TestServer(app, host="127.0.0.1") as srv, aiohttp.ClientSession() as http:
            prom = PrometheusSource(http, f"http://127.0.0.1:{srv.port}", timeout=0.5)
            with pytest.raises(MetricsError, match=why):
                await prom.sample(TARGET, [])


async def test_pods_that_never_answer_do_not_silence_another_deployment_s_pods() -> None:
    # One session serves every deployment's ticks. aiohttp's default pool holds 100
    # connections for all hosts together: 150 pods behind a partition (they accept and never
    # answer, still Ready) held every slot, and a healthy deployment's pod waited out its own
    # timeout behind them and read as silent.
    held: list[asyncio.StreamWriter] = []

    async def accept_and_hang(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)

    async def good(_: web.Request) -> web.Response:
        body = report(pod=None).model_dump_json()
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/saturation", good)
    async with TestServer(app, host="127.0.0.2") as ok:
        hung = await asyncio.start_server(accept_and_hang, "127.0.0.3", ok.port, backlog=512)
        try:
            async with client_session() as http:
                src = SidecarSource(http, port=ok.port, timeout=5.0)
                partitioned = [PodInfo(f"big-{i}", "127.0.0.3", True, 0.0) for i in range(150)]
                big = asyncio.create_task(src.sample(ScrapeTarget("llm", "big"), partitioned))
                while len(held) < 100:  # the old pool's every slot is taken
                    await asyncio.sleep(0.01)
                healthy = await src.sample(TARGET, [PodInfo("chat-0", "127.0.0.2", True, 0.0)])
                assert list(healthy) == ["chat-0"]
                assert not big.done()  # heard while the partitioned pods still hang
                big.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await big
        finally:
            hung.close()
            for w in held:
                w.close()
            await hung.wait_closed()


def test_a_prometheus_error_is_quoted_short_in_status() -> None:
    with pytest.raises(MetricsError) as err:
        parse_prometheus({"status": "error", "error": "x" * 10_000})
    assert len(str(err.value)) < 300


def test_rate_windows_are_promql_durations_within_reason() -> None:
    assert [rate_window_seconds(w) for w in ("1m", "90s", "1m30s", "4m", "1h")] == [
        60, 90, 90, 240, 3600,
    ]  # fmt: skip
    for bad in ("", "60", "1.5m", "m", "500ms", "0s", "2h", "1m 30s"):
        with pytest.raises(ValueError):
            rate_window_seconds(bad)


async def test_prometheus_source_asks_over_its_rate_window_and_says_so_in_the_demand() -> None:
    asked: list[str] = []

    async def query(request: web.Request) -> web.Response:
        asked.append(str((await request.post())["query"]))
        rates = [vec("chat-0", "occupancy", "0.5"), vec("chat-0", "up", "1"),
                 vec("chat-0", "arrivals", "2"), vec("chat-0", "departures", "2"),
                 vec("chat-0", "block_seconds", "50")]  # fmt: skip
        doc = {"status": "success", "data": {"resultType": "vector", "result": rates}}
        return web.Response(text=json.dumps(doc), content_type="application/json")

    app = web.Application()
    app.router.add_post("/api/v1/query", query)
    async with TestServer(app, host="127.0.0.1") as srv, aiohttp.ClientSession() as http:
        src = PrometheusSource(http, f"http://127.0.0.1:{srv.port}", rate_window="4m")
        got = await src.sample(TARGET, [PodInfo("chat-0", "10.0.0.1", True, 0.0)])
    (q,) = asked
    # The four rate() calls and the two resets() of the arrivals guard; the guard's young-series
    # test looks back by the same window.
    assert q.count("[4m])") == 6 and q.count("offset 4m") == 3 and "[1m]" not in q
    demand = got["chat-0"].demand
    assert demand is not None and demand.window_seconds == 240.0  # decide() looks ahead by half


RATES = ("arrivals", "block_seconds", "departures", "preempt")


def _rates_come_back(window: str, scrape: str, tmp_path: Path) -> bool:
    """Whether Prometheus' own engine (promtool) answers `promql()` over `window` with every
    rate series, for a target scraped every `scrape` (the query 30 s after a scrape)."""
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is not installed: make tools installs Debian's"
    labels = 'namespace="llm",inferencedeployment="chat",pod="chat-0"'
    series = [
        {"series": f"{name}{{{labels}}}", "values": values}
        for name, values in (
            ("headroom_engine_up", "1x40"), ("headroom_kv_block_occupancy_ratio", "0.5x40"),
            ("headroom_preemptions_total", "0+5x40"),
            ("headroom_requests_arrived_total", "0+10x40"),
            ("headroom_requests_departed_total", "0+10x40"),
            ("headroom_kv_block_seconds_total", "0+900x40"),
        )
    ]  # fmt: skip
    wanted = " or ".join(f'label_replace(vector(1), "q", "{q}", "", "")' for q in RATES)
    test = {
        "interval": scrape,
        "input_series": series,
        "promql_expr_test": [{
            "expr": f"count by (q) ({promql(TARGET, window)}) and on (q) ({wanted})",
            "eval_time": "10m30s",
            "exp_samples": [{"labels": f'{{q="{q}"}}', "value": 1} for q in RATES],
        }],
    }  # fmt: skip
    path = tmp_path / "rates.yaml"
    path.write_text(json.dumps({"rule_files": [], "evaluation_interval": "1m", "tests": [test]}))
    out = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    return out.returncode == 0


def test_a_rate_window_of_4x_the_scrape_interval_gets_rates_where_1m_gets_none(
    tmp_path: Path,
) -> None:
    # Prometheus' default scrape interval is 60 s: one sample per minute, and rate() needs two
    # inside its window. The default 1m suits 15 s scrapes only; --prometheus-rate-window fixes
    # the rest.
    assert _rates_come_back("1m", "15s", tmp_path)
    assert not _rates_come_back("1m", "60s", tmp_path)
    assert _rates_come_back("4m", "60s", tmp_path)


# ------------------------------------------------------------------- boundaries of usable()


def pod_sample(**kw: Any) -> PodSample:
    """A sample every check passes, with `kw` changed."""
    base: dict[str, Any] = dict(occupancy=0.42, sampled_at=1000.0, used_blocks=420,
                                capacity_blocks=1000)  # fmt: skip
    return PodSample(**{**base, **kw})


def test_an_idle_pod_s_zero_rates_are_demand_and_a_day_s_window_is_a_sidecar_s() -> None:
    """No arrivals over the window is a rate (the idle pod's 0), not a missing one, and the
    sidecar's longest --window (86,400 s) is a window: neither may drop the pod's demand."""
    idle = DemandRates(0.0, 0.0, 0.0, window_seconds=60.0)
    day = DemandRates(1.0, 1.0, 10.0, window_seconds=86400.0)
    for demand in (idle, day):
        s = usable(pod_sample(demand=demand))
        assert s is not None and s.demand == demand, demand
    s = usable(pod_sample(demand=replace(day, window_seconds=86400.5)))
    assert s is not None and s.demand is None


def test_occupancy_a_little_over_full_is_rounding_and_reads_as_full() -> None:
    """Up to 1.05 is an engine's rounding, read as a full pool; past it, or blocks 0.1 off the
    occupancy, is no KV pool and the pod is silent."""
    full = usable(pod_sample(occupancy=1.05, used_blocks=1050))
    assert full is not None and full.occupancy == 1.0 and full.used_blocks == 1050
    assert usable(pod_sample(occupancy=1.2, used_blocks=1200)) is None
    assert usable(pod_sample(occupancy=1.2, used_blocks=None, capacity_blocks=None)) is None
    assert usable(pod_sample(occupancy=0.42, used_blocks=520)) is None


def test_an_eta_of_zero_is_a_forecast_of_a_full_pool_now_not_none() -> None:
    """A pool already at the wall has ETA 0: a forecast (the most urgent one), not "no
    forecast" and not "not growing"."""
    s = usable(pod_sample(eta_seconds=0.0, forecast_ready=True))
    assert s is not None and s.eta_seconds == 0.0 and s.forecast_ready
    soon = usable(pod_sample(eta_seconds=0.5, forecast_ready=True))
    assert soon is not None and soon.eta_seconds == 0.5 and soon.forecast_ready


@pytest.mark.parametrize(("hit", "kept"), [(0.0, 0.0), (0.3, 0.3), (1.0, 1.0), (1.5, None),
                                           (-0.1, None)])  # fmt: skip
def test_a_hit_ratio_is_kept_within_0_to_1(hit: float, kept: float | None) -> None:
    """A prefix-cache hit ratio is a share: 0 and 1 (no hits, all hits) are kept, outside is
    dropped (the pod stays usable)."""
    s = usable(pod_sample(hit_ratio=hit))
    assert s is not None and s.hit_ratio == kept


def test_counters_no_engine_could_reach_are_dropped_and_the_pod_kept() -> None:
    """Cumulative counters from 0 (a fresh engine) to 1e18 are an engine's; past 1e18, or
    below 0, an exporter's: no counters, so no rate from them, but the occupancy still counts."""
    ok = CounterSample(t=1000.0, arrived=7.0, departed=5.0, block_seconds=90.0)
    fresh = replace(ok, arrived=0.0, departed=0.0, block_seconds=0.0)
    for good in (ok, fresh, replace(ok, block_seconds=1e18)):
        s = usable(pod_sample(counters=good))
        assert s is not None and s.counters == good, good
    for bad in (replace(ok, block_seconds=1e19), replace(ok, arrived=-1.0)):
        s = usable(pod_sample(counters=bad))
        assert s is not None and s.counters is None, bad


@pytest.mark.parametrize("at", [math.nan, math.inf])
def test_a_sample_with_no_time_is_no_sample(at: float) -> None:
    """No sample, or one whose time is not a number, is a silent pod (never a crash)."""
    assert usable(None) is None
    assert usable(pod_sample(sampled_at=at)) is None


def test_a_report_without_optional_figures_reads_as_none_and_now() -> None:
    """An engine that exports no queue or preemption figures (the contract's None) reads as
    0 waiting, 0 running, 0 preemptions a second, not as load; no age is a reading at the
    report's time; rates with no window named keep the contract's 0 ("no window")."""
    s = sample_from_report(report(waiting=None, running=None, preemption_rate_per_second=None))
    assert s is not None and (s.waiting, s.running, s.preemption_rate) == (0, 0, 0.0)
    rates = {"arrival_rate_per_second": 1.0, "departure_rate_per_second": 1.0,
             "kv_block_seconds_per_second": 10.0}  # fmt: skip
    s = sample_from_report(report(age_seconds=None, demand_window_seconds=None, **rates))
    assert s is not None and s.sampled_at == 1000.0
    assert s.demand is not None and s.demand.window_seconds == 0.0


async def test_an_answer_of_exactly_the_limit_is_read_whole() -> None:
    """The cap refuses what is past `limit` bytes, not an answer that is exactly that long."""

    class Content:
        async def iter_chunked(self, _: int) -> AsyncIterator[bytes]:
            for chunk in (b"a" * 6, b"b" * 4):
                yield chunk

    class Resp:
        content_length = None
        content = Content()

    assert await read_capped(Resp(), 10) == b"a" * 6 + b"b" * 4  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="over 9 bytes"):
        await read_capped(Resp(), 9)  # type: ignore[arg-type]


def test_rate_windows_are_1s_to_1h_inclusive() -> None:
    """The documented range's both ends are windows; days, weeks and years are over an hour,
    however many."""
    assert (rate_window_seconds("1s"), rate_window_seconds("3600s")) == (1.0, 3600.0)
    for bad in ("1d", "1w", "20000w", "1y", "300y"):
        with pytest.raises(ValueError):
            rate_window_seconds(bad)


def _answer(figures: dict[str, float], at: float = 1000.0) -> dict[str, Any]:
    result = [vec("a", q, str(v), at) for q, v in figures.items()]
    return {"status": "success", "data": {"resultType": "vector", "result": result}}


def test_a_prometheus_pod_without_an_up_series_is_not_up_and_has_no_restarts() -> None:
    """No `up` series is no engine seen up (not up by default), no queue series none queued;
    no restarts series is epoch 0, and one says the epoch; without a rate window named the
    rates are over the default 1m."""
    totals = {"arrived_total": 7.0, "departed_total": 5.0, "block_seconds_total": 90.0}
    rates = {"arrivals": 1.0, "departures": 1.0, "block_seconds": 9.0}
    a = parse_prometheus(_answer({"occupancy": 0.5, **totals, **rates}))["a"]
    assert not a.engine_up and (a.waiting, a.running) == (0, 0)
    assert a.counters is not None and a.counters.epoch == 0
    assert a.demand is not None and a.demand.window_seconds == 60.0
    b = parse_prometheus(_answer({"occupancy": 0.5, "up": 1, "restarts": 2, **totals}))["a"]
    assert b.engine_up and b.counters is not None and b.counters.epoch == 2


def test_a_scrape_as_old_as_the_query_is_timed_when_the_answer_came() -> None:
    """Scraped at the query's evaluation time: 0 s old, timed at `received_at` itself."""
    doc = _answer({"occupancy": 0.5, "up": 1, "time": 1000.0})
    assert parse_prometheus(doc, 60.0, received_at=5000.0)["a"].sampled_at == 5000.0
    doc = _answer({"occupancy": 0.5, "up": 1, "time": 999.5})
    assert parse_prometheus(doc, 60.0, received_at=5000.0)["a"].sampled_at == 4999.5


def test_the_same_scrape_read_again_gives_the_same_counters_time_included() -> None:
    """`seen`: a scrape read by two decisions keeps its first reading's counters (their time
    on the operator's clock with them), a new scrape gets its own; a pod with no counters is
    remembered with none and does not break the next read."""
    totals = {"arrived_total": 7.0, "departed_total": 5.0, "block_seconds_total": 90.0}
    seen: dict[str, tuple[float, CounterSample]] = {}
    scrape = _answer({"occupancy": 0.5, "up": 1, "time": 995.0, **totals})
    first = parse_prometheus(scrape, 60.0, 5000.0, 7000.0, seen)["a"].counters
    again = parse_prometheus(scrape, 60.0, 5015.0, 7015.0, seen)["a"].counters
    assert first is not None and first.t == 6995.0 and again == first
    assert seen == {"a": (995.0, first)}
    later = _answer({"occupancy": 0.5, "up": 1, "time": 1010.0, **totals}, at=1015.0)
    third = parse_prometheus(later, 60.0, 5030.0, 7030.0, seen)["a"].counters
    assert third is not None and third.t == 7025.0
    bare = _answer({"occupancy": 0.5, "up": 1, "time": 1010.0})
    for _ in range(2):
        got = parse_prometheus(bare, 60.0, 5045.0, 7045.0, seen)
        assert got["a"].counters is None and seen == {}


# ----------------------------------------------------------------------------- end to end


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(proc: subprocess.Popen[Any], grace: float = 20.0) -> None:
    """Terminate `proc`, and kill it if it has not gone in `grace` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def eventually(
    what: str, probe: Any, within: float = 60.0, errors: tuple[type[Exception], ...] = ()
) -> Any:
    deadline = time.monotonic() + within
    last = None
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, aiohttp.ClientError, MetricsError, *errors):
            last = await probe()
            if last:
                return last
        await asyncio.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


@contextlib.asynccontextmanager
async def stack(tmp_path: Path, engine_url: str) -> AsyncIterator[tuple[int, str]]:
    """The real sidecar in front of `engine_url`, and a Prometheus scraping it."""
    sc_port, prom_port = free_port(), free_port()
    sc_log = (tmp_path / "sidecar.log").open("w")
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "headroom.sidecar", "--engine-url", engine_url,
         "--host", "127.0.0.1", "--port", str(sc_port), "--interval", "0.25", "--timeout", "0.2",
         "--window", "10", "--forecast-window", "5", "--namespace=llm",
         "--inferencedeployment=chat", "--pod=chat-0"],
        stdout=sc_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n"
        "scrape_configs:\n  - job_name: sidecar\n    honor_labels: true\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{sc_port}']\n"
    )
    prom_log = (tmp_path / "prometheus.log").open("w")
    assert PROMETHEUS is not None, (
        "prometheus is not installed: make tools installs Debian's prometheus"
    )
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
        stdout=prom_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        yield sc_port, f"http://127.0.0.1:{prom_port}"
    finally:
        for proc in (prom, sidecar):
            stop(proc)
        sc_log.close()
        prom_log.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_real_sidecar_and_prometheus_agree(tmp_path: Path) -> None:
    eng = SyntheticEngine(capacity=2000, model="synthetic")
    eng.set_used(500)
    eng.running, eng.waiting = 6, 3

    async def drive() -> None:
        while True:  # ~40 blocks/s towards the wall, a preemption every second
            eng.set_used(eng.used + 10)
            eng.preemptions_total += 1 if int(time.time() * 4) % 4 == 0 else 0
            await asyncio.sleep(0.25)

    async with TestServer(eng.app(), host="127.0.0.1") as engine:
        driver: asyncio.Task[None] | None = None
        try:
            async with stack(tmp_path, str(engine.make_url("/"))) as (sc_port, prom_url):
                pods = [PodInfo("chat-0", "127.0.0.1", True, 0.0)]
                async with aiohttp.ClientSession() as http:
                    direct = SidecarSource(http, port=sc_port)
                    prom = PrometheusSource(http, prom_url)

                    async def stack_up() -> Any:
                        d = (await direct.sample(TARGET, pods)).get("chat-0")
                        p = (await prom.sample(TARGET, pods)).get("chat-0")
                        return d is not None and d.engine_up and p is not None and p.engine_up

                    # The ramp starts once the sidecar and Prometheus answer, so that it has its
                    # ~37 s to the wall however slowly the two processes started.
                    await eventually("the sidecar and Prometheus to see the engine", stack_up)
                    driver = asyncio.create_task(drive())

                    async def direct_ok() -> Any:
                        got = await direct.sample(TARGET, pods)
                        s = got.get("chat-0")
                        # The forecast of the ramp: its first points, beside the flat ones before
                        # it in the sidecar's window, give a far eta (the segmented fit takes the
                        # ramp alone from its fifth point on).
                        ramp = s is not None and s.eta_seconds is not None and s.eta_seconds < 120
                        return s if ramp else None

                    d = await eventually("the sidecar's /saturation with the ramp's forecast",
                                         direct_ok)  # fmt: skip
                    assert d.engine_up and d.capacity_blocks == 2000
                    assert d.eta_seconds is not None and 0 < d.eta_seconds < 120

                    async def prom_ok() -> Any:
                        got = await prom.sample(TARGET, pods)
                        s = got.get("chat-0")
                        return s if s and s.preemption_rate > 0 and s.eta_seconds else None

                    p = await eventually("Prometheus to have rate() and eta", prom_ok, 90)
                    assert p.engine_up and p.capacity_blocks == 2000 and p.waiting == 3
                    assert p.running == 6 and 0.25 < p.occupancy < 1.0
                    assert abs(time.time() - p.sampled_at) < 30
                    assert p.eta_seconds is not None and math.isfinite(p.eta_seconds)
                    # Other deployments' pods are not mixed in.
                    assert await prom.sample(ScrapeTarget("llm", "other"), pods) == {}
        finally:
            if driver is not None:
                driver.cancel()
