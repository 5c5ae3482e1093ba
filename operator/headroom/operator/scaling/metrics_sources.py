"""Where the scaling loop reads per-pod KV state from: the sidecars directly, or Prometheus.

Both return `{pod name: PodSample}` for the pods they could read; a pod missing from the map
has no usable sample, and `decide()` treats it as silent (never as idle). Parsing is pure and
tested on its own; the fetching is a thin aiohttp shell.
"""

from __future__ import annotations

import asyncio
import fnmatch
import ipaddress
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import aiohttp
from pydantic import ValidationError

from headroom.contract import metric_names as m
from headroom.contract.clock import steady_time
from headroom.contract.demand import CounterSample, DemandRates
from headroom.contract.forecast import MIN_GROWTH_PER_SECOND
from headroom.contract.jsonfile import parse_json
from headroom.contract.ports import SIDECAR_PORT
from headroom.contract.report import SaturationReport
from headroom.operator.scaling.decide import PodSample


class MetricsError(Exception):
    """The source as a whole could not be read (Prometheus down, no URL configured)."""


@dataclass(frozen=True, slots=True)
class PodInfo:
    """What Kubernetes says about one pod of the deployment."""

    name: str
    ip: str | None
    ready: bool
    created_at: float
    terminating: bool = False
    ready_since: float | None = None  # the Ready condition's lastTransitionTime
    exited: bool = False  # phase Succeeded or Failed (an evicted pod): its IP may be reused


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    """The InferenceDeployment being measured."""

    namespace: str
    name: str
    prometheus_url: str | None = None


class MetricsSource(Protocol):
    """Reads per-pod samples for one InferenceDeployment."""

    async def sample(self, target: ScrapeTarget, pods: list[PodInfo]) -> dict[str, PodSample]: ...


# ---------------------------------------------------------------------------- checks

# Occupancy a little over 1 is rounding in an engine's own ratio; far over it is not a KV pool.
_MAX_OCCUPANCY = 1.05
# More requests or blocks than any pod holds (a broken exporter's 1e20): status keeps counts as
# int64, and the whole status write would be refused at every tick.
_MAX_COUNT = 10**12


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


# The sidecar's longest ETA (its slope floor): a longer one is an exporter's, and reads as
# "not growing", as +Inf does (1e32 s overflowed status.kv.eta and refused the status write).
_MAX_ETA_SECONDS = 1.0 / MIN_GROWTH_PER_SECOND
# Cumulative counters: a pool of 10^6 blocks full for 30 years integrates to 10^15 block-s.
_MAX_TOTAL = 1e18
# A rate window longer than a day is no sidecar's (its --window is at most 86,400 s).
_MAX_WINDOW_SECONDS = 86400.0


def _rates_ok(r: DemandRates | None) -> DemandRates | None:
    """Rates over a real window, each finite and within what a pod can do; else none (a NaN
    window turned the forecast's mean to 0, a 1e308 rate raised in the decision)."""
    # 0: a report that named no window (the contract's None).
    if r is None or not 0 <= r.window_seconds <= _MAX_WINDOW_SECONDS:
        return None
    values = (r.arrivals, r.departures, r.block_seconds)
    return r if all(0 <= v <= _MAX_COUNT for v in values) else None


def _counters_ok(c: CounterSample | None) -> CounterSample | None:
    values = (c.t, c.arrived, c.departed, c.block_seconds) if c is not None else ()
    return c if c is not None and all(0 <= v <= _MAX_TOTAL for v in values) else None


def _slack_blocks(capacity: float) -> float:
    """How far used blocks may sit from occupancy x capacity: the rounding share of the pool,
    and at least one block (a pool of 8 blocks moves 12.5 % a block, an engine's ratio may
    count its null block or round, and a pod must not go silent for that)."""
    return max((_MAX_OCCUPANCY - 1) * capacity, 1.0)


def usable(sample: PodSample | None) -> PodSample | None:
    """`sample` with every figure a decision can use, or None when its occupancy or time is not
    a number: one pod's NaN or 1e400 must make that pod silent, not raise in the loop (which
    would stop scaling the whole deployment) or buy pods."""
    if sample is None or _finite(sample.sampled_at) is None:
        return None
    occ = _finite(sample.occupancy)
    if occ is None or not 0.0 <= occ <= _MAX_OCCUPANCY:
        return None
    blocks = [b for b in (sample.used_blocks, sample.capacity_blocks) if b is not None]
    counts = (*blocks, sample.waiting, sample.running)
    if any(not 0 <= c <= _MAX_COUNT for c in counts):
        return None
    used, capacity = sample.used_blocks, sample.capacity_blocks
    if used is not None and capacity and abs(used - occ * capacity) > _slack_blocks(capacity):
        # Every source's occupancy is used / capacity: blocks that say otherwise (tokens
        # counted as blocks, 16x) are no pool's, and present KV is sized from them.
        return None
    hit = _finite(sample.hit_ratio)
    rate = _finite(sample.preemption_rate)
    eta = _finite(sample.eta_seconds)
    # +Inf is "not growing"; a NaN or negative ETA is no forecast at all (not "not growing").
    raw_eta = sample.eta_seconds
    no_forecast = raw_eta is not None and (math.isnan(raw_eta) or raw_eta < 0)
    return replace(
        sample,
        occupancy=min(occ, 1.0),
        eta_seconds=eta if eta is not None and 0 <= eta <= _MAX_ETA_SECONDS else None,
        forecast_ready=sample.forecast_ready and not no_forecast,
        # More preemptions a second than requests any pod holds is no engine's: none counted
        # (two pods' 1e308 summed to inf in the KVSaturated message).
        preemption_rate=rate if rate is not None and 0 <= rate <= _MAX_COUNT else 0.0,
        hit_ratio=hit if hit is not None and 0.0 <= hit <= 1.0 else None,
        growth_blocks_per_second=_finite(sample.growth_blocks_per_second),
        demand=_rates_ok(sample.demand),
        counters=_counters_ok(sample.counters),
    )


def _host(ip: str) -> str:
    """An IP as a URL's host: an IPv6 address goes in brackets."""
    try:
        return f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    except ValueError:
        return ip


# ---------------------------------------------------------------------------- sidecar


def demand_from_report(report: SaturationReport) -> DemandRates | None:
    """The report's demand rates; None when the source has no demand counters."""
    if (
        report.arrival_rate_per_second is None
        or report.departure_rate_per_second is None
        or report.kv_block_seconds_per_second is None
    ):
        return None
    return DemandRates(
        arrivals=report.arrival_rate_per_second,
        departures=report.departure_rate_per_second,
        block_seconds=report.kv_block_seconds_per_second,
        window_seconds=report.demand_window_seconds or 0.0,
    )


def counters_from_report(
    report: SaturationReport, received_at: float | None = None
) -> CounterSample | None:
    """The report's cumulative demand counters, stamped with the engine's restart epoch (and
    timed as `sample_from_report` times the sample)."""
    if (
        report.requests_arrived_total is None
        or report.requests_departed_total is None
        or report.kv_block_seconds_total is None
    ):
        return None
    return CounterSample(
        t=_reading_time(report, received_at),
        arrived=report.requests_arrived_total,
        departed=report.requests_departed_total,
        block_seconds=report.kv_block_seconds_total,
        epoch=report.engine_restarts_total,
    )


def _reading_time(report: SaturationReport, received_at: float | None) -> float:
    """When the sidecar read the engine, on the operator's clock where `received_at` (when the
    answer came) is given: the report's own `time` is the pod's node's clock, and a node 60 s
    behind would have made every sample of its pods stale for good (`age_seconds` is a length
    of time, the same on both clocks)."""
    return (report.time if received_at is None else received_at) - (report.age_seconds or 0.0)


def sample_from_report(
    report: SaturationReport, received_at: float | None = None, steady_at: float | None = None
) -> PodSample | None:
    """A `/saturation` body as a sample; None when it carries no occupancy. `received_at` (the
    wall clock) times the sample, `steady_at` (`steady_time()`, the same moment) its counters:
    a rate's span between two decisions must not move when the operator's clock steps."""
    if report.occupancy is None:
        return None
    age = report.age_seconds
    if age is not None and not (math.isfinite(age) and age >= 0):
        # The sidecar's age is a length of time since its last reading: a negative one (no
        # sidecar sends it) dated the pod's counters in the future, and its rates with them.
        return None
    return PodSample(
        occupancy=report.occupancy,
        sampled_at=_reading_time(report, received_at),
        eta_seconds=report.eta_seconds,
        # The contract's None ETA is "not growing" only with a ready forecast.
        forecast_ready=report.forecast_ready,
        waiting=report.waiting or 0,
        running=report.running or 0,
        preemption_rate=report.preemption_rate_per_second or 0.0,
        hit_ratio=report.hit_ratio,
        used_blocks=report.used_blocks,
        capacity_blocks=report.capacity_blocks,
        growth_blocks_per_second=report.growth_blocks_per_second,
        engine_up=report.engine_up and report.fresh,
        demand=demand_from_report(report),
        counters=counters_from_report(report, received_at if steady_at is None else steady_at),
    )


# What the operator reads of one answer: a pod's sidecar or a Prometheus it was pointed at may be
# anything, and an answer read whole could exhaust the operator (every tenant's scaling with it).
SIDECAR_BODY_LIMIT = 1 << 20  # a /saturation report is a few KiB
PROMETHEUS_BODY_LIMIT = 16 << 20  # 17 series a pod: tens of thousands of series


def client_session() -> aiohttp.ClientSession:
    """The operator's one HTTP session for sidecars and Prometheus, with no cap on connections
    in flight: a tick polls every pod at once, and the hung pods of one deployment (a node
    partitioned away, still Ready for 40 s) must not hold the slots (aiohttp's default is 100
    for all hosts together) that another deployment's pods need to be heard."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of `resp`, refused (ValueError) past `limit` bytes before more is read."""
    if resp.content_length is not None and resp.content_length > limit:
        raise ValueError(f"answer of {resp.content_length:,} bytes (at most {limit:,})")
    body = bytearray()
    async for chunk in resp.content.iter_chunked(64 << 10):
        body += chunk
        if len(body) > limit:
            raise ValueError(f"answer over {limit:,} bytes")
    return bytes(body)


class SidecarSource:
    """GET http://<pod IP>:<sidecar port>/saturation on every ready pod, concurrently."""

    def __init__(
        self, session: aiohttp.ClientSession, port: int = SIDECAR_PORT, timeout: float = 3.0
    ) -> None:
        self.session = session
        self.port = port
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def _one(self, target: ScrapeTarget, pod: PodInfo) -> tuple[str, PodSample | None]:
        assert pod.ip is not None
        url = f"http://{_host(pod.ip)}:{self.port}/saturation"
        try:
            # A redirect would send the operator's request wherever the pod says.
            async with self.session.get(url, timeout=self.timeout, allow_redirects=False) as resp:
                if resp.status != 200:
                    return pod.name, None
                body = await read_capped(resp, SIDECAR_BODY_LIMIT)
            received_at, steady_at = time.time(), steady_time()
            report = SaturationReport.model_validate_json(body)
        except (aiohttp.ClientError, TimeoutError, ValidationError, ValueError, OSError):
            return pod.name, None  # a silent pod: decide() holds rather than guess
        # A pod IP is reused once its pod is gone: a sidecar that names another pod,
        # namespace or deployment is not this pod's.
        named = (
            (report.pod, pod.name),
            (report.namespace, target.namespace),
            (report.inferencedeployment, target.name),
        )
        if any(said is not None and said != want for said, want in named):
            return pod.name, None
        return pod.name, usable(sample_from_report(report, received_at, steady_at))

    async def sample(self, target: ScrapeTarget, pods: list[PodInfo]) -> dict[str, PodSample]:
        """Samples of the ready (and terminating, still draining) pods that answered; a pod
        that has exited (Succeeded, Failed: evicted) holds no KV and is not polled."""
        wanted = [p for p in pods if p.ip and not p.exited and (p.ready or p.terminating)]
        results = await asyncio.gather(*(self._one(target, p) for p in wanted))
        return {name: s for name, s in results if s is not None}


# ---------------------------------------------------------------------------- prometheus

# Each pod's last scrape (its time on Prometheus' clock, the counters read from it), per
# (Prometheus base URL, namespace, InferenceDeployment).
Scrapes = dict[tuple[str, str, str], dict[str, tuple[float, CounterSample]]]


def _young(counter: str) -> str:
    """The series of `counter` that had no value at the rate window's start."""
    return f"({counter}{{%s}} unless {counter}{{%s}} offset {{w}})"


# The window arrival rate, left out (and with it the pod's window demand: `_demand`) where
# rate() gets it wrong:
# - A counter series younger than the window: rate() divides the increase over the samples it
#   has by the whole window, so the first decisions of a new pod, or those after an engine was
#   down for longer than a scrape (the sidecar drops the counters of an engine it cannot read,
#   and their series go stale), read too low by the series' age over the window (0.16 req/s
#   for 2, 4 s into a 1 m window). Prometheus 2.42 has no function for a series' first sample
#   in a window, and a count of samples says nothing without the scrape interval. But a series
#   that had a value at the window's start (`offset`: a sample at most the lookback, 5 min,
#   before it and not marked stale since) has its first sample in the window within a scrape
#   interval of the start, and rate() extrapolates to the start from there. So a series here
#   now with no value then (`unless` matches the same labels) is younger than the window.
#   (One whose scrapes failed from just before the window's start, the stale marker falling
#   just after it, still reads as old: its rate falls short by that gap over the window, for
#   at most a scrape interval's worth of queries.)
# - Arrivals that fell where departures did not: no engine restart (which takes both back to
#   zero, a reset rate() counts right) but a sidecar that restarted while vLLM or SGLang ran.
#   The arrivals it derives for those (`headroom.sidecar.accrual`) start again a little lower,
#   and rate() reads that fall as a reset to zero and adds the whole counter: 1,700 req/s for
#   2 (`resets()` counts the falls rate() corrects for).
_TRUSTED_ARRIVALS = " unless on (pod) ".join(
    (
        f"rate({m.REQUESTS_ARRIVED}{{%s}}[{{w}}])",
        _young(m.REQUESTS_ARRIVED),
        _young(m.REQUESTS_DEPARTED),
        _young(m.KV_BLOCK_SECONDS),
        f"(resets({m.REQUESTS_ARRIVED}{{%s}}[{{w}}]) > resets({m.REQUESTS_DEPARTED}{{%s}}[{{w}}]))",
    )
)

# One instant query per InferenceDeployment: each series is tagged with `q` so that `or`
# (which matches label sets, ignoring the metric name) keeps them all apart. `{w}` is the rate
# window (`--prometheus-rate-window`): rate() needs two samples inside it, so a window shorter
# than about 4x the scrape interval returns no series at all (then a pod's preemption rate
# reads as 0, and its first decision has no demand rates).
_SERIES = (
    ("occupancy", m.KV_OCCUPANCY + "{%s}"),
    ("eta", m.SATURATION_ETA + "{%s}"),
    ("up", m.ENGINE_UP + "{%s}"),
    ("time", f"timestamp({m.ENGINE_UP}{{%s}})"),
    ("hit", m.PREFIX_HIT_RATIO + "{%s}"),
    ("capacity", m.KV_BLOCKS_CAPACITY + "{%s}"),
    ("used", m.KV_BLOCKS + '{%s,state="used"}'),
    ("waiting", m.REQUESTS + '{%s,state="waiting"}'),
    ("running", m.REQUESTS + '{%s,state="running"}'),
    ("preempt", f"rate({m.PREEMPTIONS}{{%s}}[{{w}}])"),
    ("arrivals", _TRUSTED_ARRIVALS),
    ("departures", f"rate({m.REQUESTS_DEPARTED}{{%s}}[{{w}}])"),
    ("block_seconds", f"rate({m.KV_BLOCK_SECONDS}{{%s}}[{{w}}])"),
    ("arrived_total", m.REQUESTS_ARRIVED + "{%s}"),
    ("departed_total", m.REQUESTS_DEPARTED + "{%s}"),
    ("block_seconds_total", m.KV_BLOCK_SECONDS + "{%s}"),
    ("restarts", m.SIDECAR_ENGINE_RESTARTS + "{%s}"),
)
DEFAULT_RATE_WINDOW = "1m"  # the sidecar's own demand window
# PromQL's duration units, largest first, as a range selector accepts them (`1m30s`).
_UNITS = (("y", 365 * 86400.0), ("w", 7 * 86400.0), ("d", 86400.0), ("h", 3600.0),
          ("m", 60.0), ("s", 1.0), ("ms", 0.001))  # fmt: skip
_DURATION = re.compile("".join(rf"(?:(\d+){u})?" for u, _ in _UNITS))
MIN_RATE_WINDOW_SECONDS, MAX_RATE_WINDOW_SECONDS = 1.0, 3600.0


def rate_window_seconds(window: str) -> float:
    """A PromQL duration (`1m`, `90s`, `1m30s`) in seconds; ValueError when it is none, or
    outside 1 s to 1 h (a longer window averages away the ramps the loop exists to catch)."""
    match = _DURATION.fullmatch(window)
    if not window or match is None:
        raise ValueError(f"{window!r} is not a PromQL duration such as 1m, 90s or 2m30s")
    seconds = sum(int(n) * f for n, (_, f) in zip(match.groups(), _UNITS, strict=True) if n)
    if not MIN_RATE_WINDOW_SECONDS <= seconds <= MAX_RATE_WINDOW_SECONDS:
        raise ValueError(f"{window} is outside 1s..1h")
    return seconds


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def promql(target: ScrapeTarget, rate_window: str = DEFAULT_RATE_WINDOW) -> str:
    """The PromQL that fetches every per-pod figure of one InferenceDeployment, its rates over
    `rate_window`."""
    sel = f'namespace="{_quote(target.namespace)}",inferencedeployment="{_quote(target.name)}"'
    parts = [
        f'label_replace({expr.replace("%s", sel).replace("{w}", rate_window)}, "q", "{q}", "", "")'
        for q, expr in _SERIES
    ]
    return " or ".join(parts)


def _value(raw: str) -> float:
    return float(raw)  # Prometheus sends "+Inf", "NaN" as strings float() understands


def _point(series: Any) -> tuple[str, str, float, float] | None:
    """(pod, q, time, value) of one result series, or None when it is not one of ours."""
    if not isinstance(series, dict) or not isinstance(series.get("metric"), dict):
        return None
    pod, q = series["metric"].get("pod"), series["metric"].get("q")
    value = series.get("value")
    if not pod or not q or not isinstance(value, list) or len(value) != 2:
        return None
    try:
        return str(pod), str(q), float(value[0]), _value(value[1])
    except (TypeError, ValueError):
        return None


def parse_prometheus(
    doc: Any,
    window_seconds: float = 60.0,
    received_at: float | None = None,
    steady_at: float | None = None,
    seen: dict[str, tuple[float, CounterSample]] | None = None,
) -> dict[str, PodSample]:
    """An `/api/v1/query` response for `promql()` as samples keyed by pod (`window_seconds`:
    the rate window the query used); raises MetricsError when it is not a vector answer at all
    (a series that is malformed is skipped). With `received_at` (and `steady_at`, see
    `sample_from_report`) a sample is timed on the operator's clocks, its age the query's
    evaluation time less its scrape time; else on Prometheus' clock.

    `seen` (each pod's last scrape time, on Prometheus' clock, and the counters read from it)
    is read, then replaced by this answer's: a pod answered from the same scrape as before gets
    the same counters, time included. Prometheus answers with a target's last scrape until the
    next one (a 60 s scrape is read by four 15 s decisions); timed afresh at each query, by an
    age that moves with the query's latency, one scrape would be two readings a few
    milliseconds apart, and the rate between them 0. `decide` repeats a pod's last rate for a
    reading it has seen."""
    if not isinstance(doc, dict):
        raise MetricsError(f"Prometheus answered {type(doc).__name__}, not a query result")
    if doc.get("status") != "success":
        # Quoted short: the answer of a Prometheus is not to be copied whole into status.
        error = str(doc.get("error", "unknown error"))
        raise MetricsError(
            f"Prometheus query failed: {error[:200]}{'...' if len(error) > 200 else ''}"
        )
    data = doc.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector":
        got = data.get("resultType") if isinstance(data, dict) else data
        raise MetricsError(f"expected a vector result, got {got}")
    result = data.get("result")
    per_pod: dict[str, dict[str, float]] = {}
    for series in result if isinstance(result, list) else []:
        point = _point(series)
        if point is None:
            continue
        pod, q, ts, value = point
        fig = per_pod.setdefault(pod, {})
        fig[q] = value
        fig.setdefault("_ts", ts)
    out: dict[str, PodSample] = {}
    scrapes: dict[str, tuple[float, CounterSample]] = {}
    for pod, fig in per_pod.items():
        occ = fig.get("occupancy")
        if occ is None:
            continue

        def count(key: str, fig: dict[str, float] = fig) -> int | None:
            v = fig.get(key)
            return None if v is None or not math.isfinite(v) else round(v)

        # The scrape time of the sample, so a target Prometheus lost shows up as stale: on
        # Prometheus' clock an age, on the operator's when it is given (a Prometheus node 90 s
        # behind made every sample stale for good).
        scraped = fig.get("time", fig["_ts"])
        at = steady = scraped
        if received_at is not None and math.isfinite(scraped):
            age = max(0.0, fig["_ts"] - scraped)
            at = received_at - age
            steady = (received_at if steady_at is None else steady_at) - age
        counters = _counters(fig, steady)
        if counters is not None and "time" in fig:
            before = (seen or {}).get(pod)
            if (
                before is not None
                and before[0] == scraped
                and replace(before[1], t=steady) == counters
            ):
                counters = before[1]
            scrapes[pod] = (scraped, counters)
        sample = usable(PodSample(
            occupancy=occ,
            sampled_at=at,
            eta_seconds=fig.get("eta"),  # usable() drops NaN and +Inf (not growing)
            # The sidecar exports the ETA gauge only once its forecast is ready (+Inf when not
            # growing; README, "Where the figures come from"): no series is no forecast yet.
            forecast_ready="eta" in fig,
            waiting=count("waiting") or 0,
            running=count("running") or 0,
            preemption_rate=fig.get("preempt", 0.0),
            hit_ratio=fig.get("hit"),
            used_blocks=count("used"),
            capacity_blocks=count("capacity"),
            engine_up=fig.get("up", 0.0) >= 1.0,
            demand=_demand(fig, window_seconds),
            counters=counters,
        ))  # fmt: skip
        if sample is not None:
            out[pod] = sample
    if seen is not None:
        seen.clear()
        seen.update(scrapes)
    return out


def _counters(fig: dict[str, float], t: float) -> CounterSample | None:
    values = [fig.get(k) for k in ("arrived_total", "departed_total", "block_seconds_total")]
    if any(v is None for v in values):  # usable() refuses what is not a number
        return None
    arrived, departed, block_seconds = (float(v) for v in values if v is not None)
    restarts = fig.get("restarts", 0.0)
    return CounterSample(
        t=t,
        arrived=arrived,
        departed=departed,
        block_seconds=block_seconds,
        epoch=int(restarts) if math.isfinite(restarts) else 0,
    )


def _demand(fig: dict[str, float], window_seconds: float) -> DemandRates | None:
    values = [fig.get(k) for k in ("arrivals", "departures", "block_seconds")]
    if any(v is None for v in values):  # usable() refuses what is not a number
        return None
    arrivals, departures, block_seconds = (float(v) for v in values if v is not None)
    # The window the rates average over: decide() looks ahead by half of it.
    return DemandRates(arrivals, departures, block_seconds, window_seconds=window_seconds)


class PrometheusSource:
    """Instant queries against Prometheus' HTTP API (`/api/v1/query`)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        default_url: str | None = None,
        timeout: float = 5.0,
        rate_window: str = DEFAULT_RATE_WINDOW,
        allowed: tuple[str, ...] = (),
        scrapes: Scrapes | None = None,
    ) -> None:
        self.session = session
        self.default_url = default_url
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.rate_window = rate_window
        self.window_seconds = rate_window_seconds(rate_window)
        self.allowed = allowed
        # Each pod's last scrape (see `parse_prometheus`), per Prometheus and deployment. The
        # operator builds a source per tick, so it passes its own, kept across ticks.
        self._seen: Scrapes = {} if scrapes is None else scrapes

    def base_url(self, target: ScrapeTarget) -> str:
        """The Prometheus to ask for `target`: its spec's, if this operator allows that one,
        else the operator's own (MetricsError when there is none, or the spec's is not allowed:
        whoever may create an InferenceDeployment must not choose where the operator sends
        requests)."""
        own = target.prometheus_url
        if own and own != self.default_url:
            if not any(fnmatch.fnmatchcase(own, glob) for glob in self.allowed):
                raise MetricsError(
                    f"scaling.prometheusURL {own} is not one this operator may query: start it "
                    "with --allow-prometheus-url (the chart's operator.allowedPrometheusURLs) "
                    "matching it, or leave the field out to use its --prometheus-url"
                )
            return own
        if not self.default_url:
            raise MetricsError(
                "scaling.metricsSource is prometheus but neither scaling.prometheusURL nor the "
                "operator's --prometheus-url is set"
            )
        return self.default_url

    async def sample(self, target: ScrapeTarget, pods: list[PodInfo]) -> dict[str, PodSample]:
        """Samples for the pods Prometheus has series for, restricted to `pods`, less those
        that have exited (Succeeded, Failed: evicted): they hold no KV, and Prometheus returns
        their last scrape until it marks it stale, up to a scrape interval later."""
        base = self.base_url(target)
        url = base.rstrip("/") + "/api/v1/query"
        try:
            async with self.session.post(
                url,
                data={"query": promql(target, self.rate_window)},
                timeout=self.timeout,
                allow_redirects=False,
            ) as resp:
                body = await read_capped(resp, PROMETHEUS_BODY_LIMIT)
                status = resp.status
            received_at, steady_at = time.time(), steady_time()
        except TimeoutError:
            # str(TimeoutError()) is empty: say what ran out.
            raise MetricsError(
                f"Prometheus at {base} unreachable: no answer in {self.timeout.total:g} s"
            ) from None
        except (aiohttp.ClientError, ValueError, OSError) as exc:
            raise MetricsError(f"Prometheus at {base} unreachable: {exc}") from None
        try:
            doc = parse_json(body)
        except ValueError:
            doc = None
        if status != 200 and not isinstance(doc, dict):  # its API answers errors in JSON
            raise MetricsError(f"Prometheus at {base} answered HTTP {status}")
        if doc is None:
            raise MetricsError(f"Prometheus at {base} answered something other than JSON")
        seen = self._seen.setdefault((base, target.namespace, target.name), {})
        samples = parse_prometheus(doc, self.window_seconds, received_at, steady_at, seen)
        names = {p.name for p in pods if not p.exited}
        return {k: v for k, v in samples.items() if k in names}


def pod_info(pod: dict[str, Any], parse_time: Any) -> PodInfo:
    """A Pod object as PodInfo (`parse_time` turns an RFC 3339 string into unix seconds)."""
    meta = pod.get("metadata", {})
    status = pod.get("status", {}) or {}
    ready_cond: dict[str, Any] = next(
        (c for c in status.get("conditions", []) or [] if c.get("type") == "Ready"), {}
    )
    ready = ready_cond.get("status") == "True"
    exited = status.get("phase") in ("Succeeded", "Failed")
    return PodInfo(
        name=meta.get("name", ""),
        ip=status.get("podIP"),
        ready=ready and status.get("phase") == "Running",
        created_at=parse_time(meta.get("creationTimestamp")) or 0.0,
        terminating=meta.get("deletionTimestamp") is not None or exited,
        ready_since=parse_time(ready_cond.get("lastTransitionTime")) if ready else None,
        exited=exited,
    )


def pod_infos(pods: Iterable[dict[str, Any]], parse_time: Any) -> list[PodInfo]:
    """All pods as PodInfo, sorted by name for determinism."""
    return sorted((pod_info(p, parse_time) for p in pods), key=lambda p: p.name)
