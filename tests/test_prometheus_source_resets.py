"""`metricsSource: prometheus`: the window rates Prometheus gets wrong, the same scrape read by
several decisions, counters that fall when a sidecar restarts, and pods that have exited.

Prometheus' own query engine decides the PromQL cases (promtool, over scripted series); a real
sidecar and a real Prometheus the end-to-end ones; decide() alone the rules it applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from synthetic_engine import SyntheticEngine
from test_operator_metrics_sources import eventually as poll
from test_operator_metrics_sources import free_port, stop
from test_sidecar_vllm import VllmExporter

from headroom.contract import metric_names as m
from headroom.contract.demand import CounterSample, DemandRates
from headroom.operator.handlers import Context, Options
from headroom.operator.scaling.decide import (
    Decision,
    Inputs,
    Memory,
    PodSample,
    PodView,
    Policy,
    decide,
)
from headroom.operator.scaling.loop import views
from headroom.operator.scaling.metrics_sources import (
    PodInfo,
    PrometheusSource,
    ScrapeTarget,
    parse_prometheus,
    pod_info,
    promql,
)
from headroom.operator.status import parse_time

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
TARGET = ScrapeTarget(namespace="llm", name="chat")
SEL = 'namespace="llm",inferencedeployment="chat"'
POLICY = Policy(
    min_replicas=1, max_replicas=10, blocks_per_pod=1000, blocks_per_sequence=100,
    target_occupancy=0.7, scale_out_occupancy=0.85, scale_in_hysteresis=0.1,
    scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=300,
    max_scale_up_pods=8, max_scale_down_pods=2, metrics_max_age_seconds=60,
    startup_grace_seconds=900, warmup_seconds=90, growth_window_seconds=180,
    interval_seconds=15, pod_start_seconds=120, forecast_quantile=0.95, usable_occupancy=1.0,
)  # fmt: skip


def _sample(at: float, counters: CounterSample, demand: DemandRates | None = None) -> PodSample:
    """Steady traffic's pod, read at `at`: 500 of 1,000 blocks held by 10 requests."""
    return PodSample(
        occupancy=0.5, sampled_at=at, running=10, used_blocks=500, capacity_blocks=1000,
        demand=demand, counters=counters,
    )  # fmt: skip


def _decide(
    now: float, sample: PodSample | None, mem: Memory, replicas: int = 1, policy: Policy = POLICY
) -> Decision:
    return decide(Inputs(now, replicas, (PodView("chat-0", True, 0.0, sample=sample),),
                         policy, mem))  # fmt: skip


# ----------------------------------------------------------------------------- decide()


def test_counters_that_fell_within_an_epoch_give_the_pod_no_rate_not_the_window_s() -> None:
    # vLLM's sidecar restarted while vLLM ran: the arrivals it derives start again 50 lower (the
    # client aborts it had counted past), the block-seconds it integrates from zero, in the same
    # epoch. Prometheus' window rate over that fall is a reset to zero: 100,000 requests added.
    t0 = 1_000.0
    before = CounterSample(t0, arrived=100_050, departed=100_000, block_seconds=9e6)
    d1 = _decide(t0, _sample(t0, before, DemandRates(2.0, 2.0, 500.0, 60.0)), Memory())
    assert d1.figures.arrival_rate == 2.0 and d1.figures.demand_blocks == pytest.approx(500)
    fell = CounterSample(t0 + 15, arrived=100_030, departed=100_030, block_seconds=7_500)
    bad_window = DemandRates(1_700.0, 2.0, 500.0, 60.0)
    d2 = _decide(t0 + 15, _sample(t0 + 15, fell, bad_window), d1.memory)
    # no rate: the demand measured last is held over the gap, not 1,700 req/s
    assert d2.figures.arrival_rate is None, d2.message
    assert d2.figures.demand_blocks == pytest.approx(500) and "held" in d2.message
    assert d2.replicas == 1
    # the counters after the fall are the baseline of the next decision's rate
    later = CounterSample(t0 + 30, arrived=100_060, departed=100_060, block_seconds=15_000)
    d3 = _decide(t0 + 30, _sample(t0 + 30, later, bad_window), d2.memory)
    assert d3.figures.arrival_rate == pytest.approx(2.0)
    assert d3.figures.demand_blocks == pytest.approx(500)


def _steady(now: float, **glitch: float) -> CounterSample:
    """A day-old engine's counters at `now`: 2 requests a second in and out, 500 blocks held."""
    n = now + 86_400
    c = {"t": now, "arrived": 2 * n, "departed": 2 * n, "block_seconds": 500 * n}
    return CounterSample(**{**c, **glitch})


@pytest.mark.parametrize(
    "glitch",
    [{"arrived": 0.0}, {"arrived": 1.2e11}, {"block_seconds": 0.0}, {"block_seconds": 1e13},
     {"t": 1e6}],
    ids=["arrivals-dip", "arrivals-spike", "block-seconds-dip", "block-seconds-spike",
         "dated-ahead"],
)  # fmt: skip
def test_one_reading_no_pod_could_make_buys_no_pods(glitch: dict[str, float]) -> None:
    # One answer of a broken or hostile exporter: a dip to 0 made the next honest reading count
    # the whole day's counter as arriving in 15 s (11,600 req/s), a spike did so at once, and a
    # reading dated 1e6 s ahead stretched the horizon to 500,000 s: each 1 -> maxReplicas. Now
    # that pod has no rate for a decision or two, and the demand holds.
    t0, mem, seen = 1_000.0, Memory(), []
    for k in range(8):
        now = t0 + 15 * k
        read = _steady(now, **(glitch if k == 3 else {}))
        d = _decide(now, _sample(now, read), mem)
        mem = d.memory
        seen.append((d.replicas, d.figures.demand_blocks, d.figures.forecast))
    assert all(r == 1 for r, _, _ in seen), [d for d in seen]
    assert all(b is None or b == pytest.approx(500) for _, b, _ in seen[1:]), seen
    assert all(fc is None or fc.horizon < 200 for _, _, fc in seen), seen
    assert seen[-1][1] == pytest.approx(500)  # rates again after the glitch


def test_a_reading_dated_ahead_is_not_kept_as_the_baseline_for_minutes() -> None:
    # One reading dated 300 s ahead: older readings after it within the longest tick were taken
    # as an HA pair's older scrape, which kept the future baseline and repeated a rate of
    # 1/21 the real one for 20 decisions. Older by more than a stale sample's age is a new
    # baseline, and the rates come back two decisions later.
    # With metricsMaxAgeSeconds at the CRD's 3,600, the lag an HA pair may have is still
    # capped at a scrape: 1,800 s ahead cost 121 decisions' rates, 580 s ahead 40.
    lenient = replace(POLICY, metrics_max_age_seconds=3600)
    for ahead, policy in ((300, POLICY), (300, lenient), (580, lenient), (1800, lenient)):
        mem, rates = Memory(), []
        for k in range(8):
            now = 1_000.0 + 15 * k
            read = _steady(now, **({"t": now + ahead} if k == 3 else {}))
            d = _decide(now, _sample(now, read), mem, policy=policy)
            mem = d.memory
            rates.append(d.figures.arrival_rate)
        assert rates[5:] == pytest.approx([2.0] * 3), (ahead, rates)


def test_decisions_an_interval_apart_rate_the_counters_however_long_the_interval() -> None:
    # intervalSeconds 900 (the CRD takes up to 3,600): a cap of 600 s on a tick's span gave
    # every decision the window rate, none at all where Prometheus has no window rate.
    slow = replace(POLICY, interval_seconds=900)
    mem, rates = Memory(), []
    for k in range(4):
        now = 1_000.0 + 900 * k
        d = _decide(now, _sample(now, _steady(now)), mem, policy=slow)
        mem = d.memory
        rates.append(d.figures.arrival_rate)
    assert rates[0] is None and rates[1:] == pytest.approx([2.0] * 3), rates


def test_an_ha_prometheus_pairs_older_scrape_repeats_the_last_rate() -> None:
    # Two Prometheus replicas behind one Service scrape 25 s out of phase: a decision can read
    # a scrape older than the last one read. Its counters are honest, only earlier: the last
    # rate stands, the newer baseline stays, and no decision loses its rates.
    mem, rates = Memory(), []
    for k, lag in enumerate((0, 0, 25, 0, 25, 25, 0, 25)):
        now = 1_000.0 + 15 * k
        read = now - lag
        d = _decide(now, _sample(now, _steady(read)), mem)
        mem = d.memory
        rates.append(d.figures.arrival_rate)
    assert rates[0] is None and all(r == pytest.approx(2.0) for r in rates[1:]), rates


def test_the_same_reading_seen_again_repeats_the_pods_last_rate() -> None:
    t0 = 1_000.0

    def counters(scrape: float, jitter: float = 0.0) -> CounterSample:
        n = scrape - t0 + 1000
        return CounterSample(scrape + jitter, arrived=1.5 * n, departed=1.5 * n,
                             block_seconds=450.0 * n)  # fmt: skip

    mem, rates = Memory(), []
    # A 60 s scrape read by decisions 15 s apart: the same counters, timed alike or a few
    # milliseconds apart (the query's latency), until the next scrape.
    for now, read in ((t0, counters(t0)), (t0 + 15, counters(t0 + 60)),
                      (t0 + 30, counters(t0 + 60)), (t0 + 45, counters(t0 + 60, 0.004)),
                      (t0 + 60, counters(t0 + 60, -0.003)), (t0 + 75, counters(t0 + 120)),
                      (t0 + 90, counters(t0 + 120))):  # fmt: skip
        d = _decide(now, _sample(now, read), mem)
        mem = d.memory
        rates.append(d.figures.arrival_rate)
    # the first reading has no rate (no window rate either); every later one 1.5 req/s
    assert rates[0] is None and rates[1:] == pytest.approx([1.5] * 6), rates
    # the baseline stayed the scrape's first reading: the next scrape's rate spans the 60 s
    assert dict(mem.counters)["chat-0"].t == t0 + 120
    assert dict(mem.rates)["chat-0"].window_seconds == pytest.approx(60.0)


def test_a_60s_scrape_read_by_15s_decisions_keeps_a_steady_demand_steady() -> None:
    # The reviewer's replay: 4 pods at 1.5 req/s, 300 block-s per request (demand 1,800
    # blocks, 45 % of 4 pods). Decisions read a scrape four times, timed `received_at - (eval
    # time - scrape time)`, which moves by the query's latency; a rate of 0 over those few
    # milliseconds made the demand alternate 1,800 / 0 and the band buy 6 pods.
    pol = replace(POLICY, growth_window_seconds=300, scale_down_stabilization_seconds=None)
    rnd = random.Random(1)
    mem, t0 = Memory(), 1_000_000.0
    demand, wanted = [], []
    for i in range(60):
        now = t0 + 15 * i
        scrape = t0 + 60 * ((15 * i) // 60)
        n = scrape - t0 + 1e4
        c = CounterSample(scrape + rnd.uniform(-0.004, 0.004), 1.5 * n, 1.5 * n, 450 * n)
        window = DemandRates(1.5, 1.5, 450.0, 240.0)
        s = PodSample(occupancy=0.45, sampled_at=scrape, used_blocks=450, capacity_blocks=1000,
                      running=2, demand=window, counters=c)  # fmt: skip
        pods = tuple(PodView(f"p{k}", True, 0.0, sample=s) for k in range(4))
        d = decide(Inputs(now, 4, pods, pol, mem))
        mem = d.memory
        demand.append(d.figures.demand_blocks)
        wanted.append(d.replicas)
    assert demand == pytest.approx([1800.0] * 60, rel=1e-3), demand
    assert set(wanted) == {4}, wanted


# ----------------------------------------------------------------------------- PromQL


def _arrivals_kept(
    tmp_path: Path, series: dict[str, str], at: list[tuple[str, bool]], window: str = "6s"
) -> None:
    """Prometheus' own engine (promtool) evaluates `promql()` over `series` (name: promtool
    values, one sample a second); at each (time, kept) the window arrival rate must be
    present or not. Where it is not, the plain rate() (what the query used to ask) must be
    there, so that the case is one where the old query answered a wrong rate."""
    assert PROMTOOL is not None, "promtool is not installed: make tools installs Debian's"
    labels = f'{SEL},pod="chat-0"'
    arrivals = 'label_replace(vector(1), "q", "arrivals", "", "")'
    exprs = []
    for t, kept in at:
        exprs.append({
            "expr": f"count by (q) ({promql(TARGET, window)}) and on (q) {arrivals}",
            "eval_time": t,
            "exp_samples": [{"labels": '{q="arrivals"}', "value": 1}] if kept else [],
        })  # fmt: skip
        if not kept:
            exprs.append({
                "expr": f"count(rate({m.REQUESTS_ARRIVED}{{{SEL}}}[{window}]))",
                "eval_time": t,
                "exp_samples": [{"labels": "{}", "value": 1}],
            })  # fmt: skip
    test = {
        "interval": "1s",
        "input_series": [{"series": f"{k}{{{labels}}}", "values": v} for k, v in series.items()],
        "promql_expr_test": exprs,
    }
    doc = {"rule_files": [], "evaluation_interval": "1s", "tests": [test]}
    path = tmp_path / "promql.yaml"
    path.write_text(json.dumps(doc))
    out = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


A, D, B = m.REQUESTS_ARRIVED, m.REQUESTS_DEPARTED, m.KV_BLOCK_SECONDS


def test_a_series_younger_than_the_window_has_no_window_rate(tmp_path: Path) -> None:
    # A new pod: its counters appear 8 s in; rate() over 6 s at 12 s divides 4 s of increase
    # by 6 s. From 14 s on the series has a sample at the window's start.
    young = {A: "_x8 0+2x40", D: "_x8 0+2x40", B: "_x8 0+500x40"}
    _arrivals_kept(tmp_path, young, [("12s", False), ("20s", True)])
    # One counter younger than the others is enough.
    _arrivals_kept(tmp_path, {**young, B: "_x11 0+500x40"}, [("14s", False), ("20s", True)])


def test_counters_back_after_a_gap_longer_than_the_window_have_no_window_rate(
    tmp_path: Path,
) -> None:
    # An engine down from 21 s (its sidecar drops the counters, their series go stale), back
    # restarted at 31 s: at 34 s the window holds 3 s of the new series.
    gap = {name: f"0+{v}x20 stale _x9 0+{v}x20" for name, v in ((A, 2), (D, 2), (B, 500))}
    _arrivals_kept(tmp_path, gap, [("15s", True), ("34s", False), ("40s", True)])


def test_arrivals_that_fall_where_departures_do_not_have_no_window_rate(tmp_path: Path) -> None:
    # A vLLM sidecar restarted at 21 s: the arrivals it derives (departed + 10 in flight, kept
    # 50 above that by the aborts it counted past) start again from the level, its
    # block-seconds from zero; vLLM's departures go on. rate() would add 100,052 requests.
    restart = {A: "100060+2x20 100052+2x19", D: "100000+2x40", B: "0+500x20 0+500x19"}
    _arrivals_kept(tmp_path, restart, [("18s", True), ("24s", False), ("26s", False),
                                       ("30s", True)])  # fmt: skip


def test_an_engine_restart_keeps_its_window_rate(tmp_path: Path) -> None:
    # Both counters back to zero: a reset rate() counts right, and the rate stays.
    restart = {A: "0+2x20 0+2x19", D: "0+2x20 0+2x19", B: "0+500x20 0+500x19"}
    _arrivals_kept(tmp_path, restart, [("22s", True), ("24s", True), ("30s", True)])


# ----------------------------------------------------------------------------- the source


def _vector(pod: str, values: dict[str, float], at: float) -> list[dict[str, Any]]:
    """`values` as Prometheus answers `promql()`: one series per figure, evaluated at `at`."""
    labels = {"namespace": "llm", "inferencedeployment": "chat", "pod": pod}
    return [{"metric": {**labels, "q": q}, "value": [at, str(v)]} for q, v in values.items()]


async def test_one_scrape_read_again_gives_the_same_counters_and_the_same_rate() -> None:
    scrape = {"t": time.time() - 12, "arrived": 1000.0}
    # The query's evaluation time against its answer: two slow queries (1.5 s, 1.2 s), past
    # what decide() takes for one reading (MIN_TICK_SPAN_SECONDS).
    lag = iter([0.0, -1.5, 0.0, -1.2, 0.0, 0.0])

    async def query(_req: web.Request) -> web.Response:
        now = time.time() + next(lag)
        n = scrape["arrived"]
        values = {"occupancy": 0.5, "up": 1, "time": scrape["t"], "used": 500, "capacity": 1000,
                  "running": 10, "arrivals": 2, "departures": 2, "block_seconds": 500,
                  "arrived_total": n, "departed_total": n,
                  "block_seconds_total": 250 * n}  # fmt: skip
        doc = {"status": "success", "data": {"resultType": "vector",
                                             "result": _vector("chat-0", values, now)}}  # fmt: skip
        return web.json_response(doc)

    app = web.Application()
    app.router.add_post("/api/v1/query", query)
    pods = [PodInfo("chat-0", "10.0.0.1", True, 0.0)]
    async with TestServer(app, host="127.0.0.1") as srv, aiohttp.ClientSession() as http:
        ctx = Context(Options(prometheus_url=str(srv.make_url(""))), kube=None)  # type: ignore[arg-type]
        ctx.http = http
        mem, got, rates = Memory(), [], []
        for step in range(4):
            if step == 2:  # the next scrape, 10 s after the first: 20 more requests
                scrape.update(t=scrape["t"] + 10, arrived=scrape["arrived"] + 20)
            # A source per decision, as the operator's tick builds it: the memory of scrapes
            # is the operator's, not the source's.
            s = (await ctx.source("prometheus").sample(TARGET, pods))["chat-0"]
            d = _decide(time.time(), s, mem)
            mem = d.memory
            got.append(s.counters)
            rates.append(d.figures.arrival_rate)
            await asyncio.sleep(0.05)
    a, b, c, e = got
    assert a is not None and c is not None
    assert b == a and e == c, (a, b, c, e)  # the same scrape: the same reading, time included
    assert c.t > a.t and c.arrived == a.arrived + 20
    # the window rate first, then 20 requests over the 10 s between scrapes; never 0
    assert rates == pytest.approx([2.0, 2.0, 2.0, 2.0], rel=0.05), rates
    # A deployment's loop that ends takes its scrapes with it; others keep theirs.
    ctx.scrapes[("http://other", "llm", "other")] = {}
    assert any(k[1:] == ("llm", "chat") for k in ctx.scrapes)
    ctx.forget_scrapes("llm", "chat")
    assert list(ctx.scrapes) == [("http://other", "llm", "other")]


async def test_an_exited_pod_is_not_sampled() -> None:
    # An evicted pod (phase Failed) whose last scrape Prometheus still returns: it holds no KV.
    now = time.time()

    def series(pod: str, occ: float, used: int, scraped: float) -> list[dict[str, Any]]:
        values = {"occupancy": occ, "up": 1, "time": scraped, "capacity": 1000, "used": used,
                  "waiting": 0, "running": 4}  # fmt: skip
        return _vector(pod, values, now)

    async def query(_req: web.Request) -> web.Response:
        result = series("chat-a", 0.4, 400, now - 2) + series("chat-b", 0.9, 900, now - 10)
        return web.json_response(
            {"status": "success", "data": {"resultType": "vector", "result": result}}
        )

    def ts(t: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))

    pods = [
        {"metadata": {"name": "chat-a", "creationTimestamp": ts(now - 3600)},
         "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": [
             {"type": "Ready", "status": "True", "lastTransitionTime": ts(now - 3000)}]}},
        {"metadata": {"name": "chat-b", "creationTimestamp": ts(now - 3600)},
         "status": {"phase": "Failed", "reason": "Evicted", "podIP": "10.0.0.2"}},
    ]  # fmt: skip
    infos = [pod_info(p, parse_time) for p in pods]
    assert [i.exited for i in infos] == [False, True]
    app = web.Application()
    app.router.add_post("/api/v1/query", query)
    async with TestServer(app, host="127.0.0.1") as srv, aiohttp.ClientSession() as http:
        samples = await PrometheusSource(http, str(srv.make_url(""))).sample(TARGET, infos)
    assert sorted(samples) == ["chat-a"]
    d = decide(Inputs(time.time(), 1, views(infos, samples), POLICY))
    assert d.replicas == 1 and d.figures.present_blocks == 400, d.message


# ----------------------------------------------------------------------------- end to end


async def eventually(what: str, probe: Any, within: float = 60.0) -> Any:
    """Until `probe` answers: a Prometheus answer without the series yet is not one either."""
    return await poll(what, probe, within, errors=(KeyError, ValueError))


def _sidecar(engine_url: str, port: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "headroom.sidecar", "--engine-url", engine_url, *extra,
         "--host", "127.0.0.1", "--port", str(port), "--interval", "0.25", "--timeout", "0.2",
         "--window", "10", "--forecast-window", "5", "--namespace=llm",
         "--inferencedeployment=chat", "--pod=chat-0"],
        stdout=log.open("a"), stderr=subprocess.STDOUT,
    )  # fmt: skip


@contextlib.contextmanager
def _prometheus(tmp_path: Path, target_port: int, scrape: str) -> Iterator[str]:
    assert PROMETHEUS is not None, "prometheus is not installed: make tools installs Debian's"
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"global:\n  scrape_interval: {scrape}\n  scrape_timeout: 900ms\n"
        "scrape_configs:\n  - job_name: sidecar\n    honor_labels: true\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n"
    )
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=(tmp_path / "prometheus.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


async def _query(http: aiohttp.ClientSession, prom: str, query: str, at: float) -> Any:
    async with http.post(f"{prom}/api/v1/query", data={"query": query, "time": f"{at:.3f}"}) as r:
        doc = await r.json()
    assert doc.get("status") == "success", doc
    return doc


async def _raw(
    http: aiohttp.ClientSession, prom: str, metric: str, at: float, span: str = "5m"
) -> list[tuple[float, float]]:
    """The samples Prometheus holds of `metric` for the pod over `span` before `at`."""
    doc = await _query(http, prom, f'{metric}{{{SEL},pod="chat-0"}}[{span}]', at)
    return [(float(t), float(v)) for s in doc["data"]["result"] for t, v in s["values"]]


async def _sample_at(
    http: aiohttp.ClientSession, prom: str, at: float, window: str, seconds: float
) -> PodSample | None:
    """What the Prometheus source reads of the pod when it asks at `at` (on Prometheus' clock:
    its counters timed by their scrape)."""
    return parse_prometheus(await _query(http, prom, promql(TARGET, window), at), seconds).get(
        "chat-0"
    )


@contextlib.asynccontextmanager
async def _serving(app: web.Application) -> AsyncIterator[str]:
    async with TestServer(app, host="127.0.0.1") as srv:
        yield str(srv.make_url("/"))


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_vllm_sidecar_restart_is_no_rate_not_a_counter_reset(tmp_path: Path) -> None:
    # vLLM has served 100,000 requests; 50 of the 60 in flight are then aborted by their clients
    # (vLLM counts no departure for them), so the arrivals the sidecar derives stand 50 above
    # departed + in flight. Its restart starts them again from that level.
    window, seconds = "6s", 6.0
    ex = VllmExporter("m", engines=1, num_gpu_blocks=2000, version="0.11.0")
    ex.success.labels("m", "0", "stop").inc(100_000)
    ex.set_usage(0, 0.25)
    ex.running.labels("m", "0").set(60)

    async def metrics(_req: web.Request) -> web.Response:
        return web.Response(body=ex.text().encode(), content_type="text/plain")

    async def drive() -> None:
        while True:  # one leaves, one arrives: 2 req/s, running unchanged
            ex.finish(0, generated=10)
            await asyncio.sleep(0.5)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    port = free_port()
    log = tmp_path / "sidecar.log"
    async with _serving(app) as url, aiohttp.ClientSession() as http:
        sidecar = _sidecar(url, port, log, "--source", "vllm")
        driver = asyncio.create_task(drive())
        try:
            with _prometheus(tmp_path, port, "1s") as prom:

                async def counted() -> Any:
                    raw = await _raw(http, prom, A, time.time())
                    return raw if raw and raw[-1][1] >= 100_060 else None

                first = (await eventually("the sidecar's arrivals in Prometheus", counted))[0][0]
                ex.running.labels("m", "0").set(10)  # the 50 aborts
                await asyncio.sleep(max(0.0, first + seconds + 3 - time.time()))
                steady = time.time()
                stop(sidecar)
                sidecar = _sidecar(url, port, log, "--source", "vllm")

                async def fell() -> Any:
                    raw = await _raw(http, prom, A, time.time(), "30s")
                    falls = [t for (_, a), (t, b) in itertools.pairwise(raw) if b < a]
                    return falls[0] if falls else None

                fall = await eventually("the restarted sidecar's lower arrivals", fell)
                await asyncio.sleep(max(0.0, fall + seconds + 3 - time.time()))

                # A series younger than the window has no window rate yet (a new pod).
                young = await _sample_at(http, prom, first + 2, window, seconds)
                assert young is not None and young.demand is None, young
                # (2 s before the restart: a scrape the restart failed marks the series stale
                # from its start, up to a scrape interval before it)
                before = await _sample_at(http, prom, steady - 2, window, seconds)
                assert before is not None and before.demand is not None, before
                assert 0 < before.demand.arrivals < 50, before.demand
                # While the window holds both sides of the fall, no window rate: rate() reads
                # the fall as a reset and adds 100,000 requests. (Where a scrape failed during
                # the restart, a window that starts in that gap holds the new sidecar's samples
                # alone: a rate over them, short of the window by at most the gap.)
                raw = await _raw(http, prom, A, fall + seconds, "60s")
                old = [t for t, _ in raw if t < fall]
                spanned = 0
                for k in range(1, int(seconds)):
                    s = await _sample_at(http, prom, fall + k, window, seconds)
                    assert s is not None, k
                    if any(t > fall + k - seconds for t in old):
                        assert s.demand is None, (k, s)
                        spanned += 1
                    else:
                        assert s.demand is None or s.demand.arrivals < 50, (k, s)
                assert spanned, f"no window held both sides of the fall: {raw}"
                after = await _sample_at(http, prom, fall + seconds + 2, window, seconds)
                assert after is not None and after.demand is not None, after
                assert 0 < after.demand.arrivals < 50, after.demand

                # Decisions every 2 s through the restart never see more than the 2 req/s.
                mem, rates, at = Memory(), [], steady - 8
                while at <= fall + seconds + 2:
                    # none while the sidecar was down: a silent pod
                    s = await _sample_at(http, prom, at, window, seconds)
                    d = _decide(at, s, mem, replicas=2)
                    mem = d.memory
                    rates.append(d.figures.arrival_rate)
                    at += 2
                assert all(r is None or r < 50 for r in rates), rates
                assert rates[-1] is not None and rates[-1] > 0, rates
        finally:
            driver.cancel()
            stop(sidecar)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_decisions_faster_than_the_scrape_keep_each_scrapes_rate(tmp_path: Path) -> None:
    # Prometheus scrapes every 3 s, the operator decides about every 0.7 s: several decisions
    # read one scrape (the README's 60 s scrape with 15 s decisions, faster).
    eng = SyntheticEngine(capacity=1000, model="synthetic")
    eng.set_used(500)
    eng.running = 10

    async def drive() -> None:
        while True:  # 2 req/s in and out, 500 blocks held
            eng.requests_arrived_total += 1
            eng.requests_finished_total += 1
            eng.kv_block_seconds_total += 500 * 0.5
            await asyncio.sleep(0.5)

    port = free_port()
    pods = [PodInfo("chat-0", "127.0.0.1", True, 0.0)]
    async with _serving(eng.app()) as url, aiohttp.ClientSession() as http:
        sidecar = _sidecar(url, port, tmp_path / "sidecar.log")
        driver = asyncio.create_task(drive())
        try:
            with _prometheus(tmp_path, port, "3s") as prom:
                src = PrometheusSource(http, prom, rate_window="12s")

                async def counters() -> Any:
                    s = (await src.sample(TARGET, pods)).get("chat-0")
                    return s if s is not None and s.counters is not None else None

                await eventually("the pod's counters in Prometheus", counters)
                mem = Memory()
                readings: list[CounterSample] = []
                rates: list[float | None] = []
                deadline = time.monotonic() + 90

                def repeats() -> int:
                    pairs = itertools.pairwise(readings)
                    return sum(1 for a, b in pairs if b.arrived == a.arrived)

                while len({c.arrived for c in readings}) < 4 or repeats() < 3:
                    assert time.monotonic() < deadline, (
                        f"no 4 scrapes and 3 repeated reads in 90 s: {readings}"
                    )
                    s = (await src.sample(TARGET, pods)).get("chat-0")
                    assert s is not None and s.counters is not None
                    d = _decide(time.time(), s, mem)
                    mem = d.memory
                    readings.append(s.counters)
                    rates.append(d.figures.arrival_rate)
                    await asyncio.sleep(0.7)
        finally:
            driver.cancel()
            stop(sidecar)
    for a, b in itertools.pairwise(readings):
        # the engine's counters move every 0.5 s: equal counters are one scrape read again
        if b.arrived == a.arrived:
            assert b == a, (a, b)
        else:
            assert b.t > a.t and b.arrived > a.arrived, (a, b)
    # Once a rate is measured, each decision has one: never 0 over the milliseconds between
    # two reads of one scrape.
    assert any(r is not None for r in rates), rates
    measured = rates[next(i for i, r in enumerate(rates) if r is not None) :]
    assert all(r is not None and r > 0 for r in measured), rates
