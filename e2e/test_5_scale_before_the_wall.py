"""Scenario 5: scale before the wall, on the demand signal.

A real engine (the built-in tiny model on CPU, a deliberately small KV pool) and its sidecar run
as local processes standing in for the InferenceDeployment's one pod (kwok pods run nothing; the
sidecar carries the kwok pod's name, so the series match the pod the operator sees). Debian's
Prometheus scrapes the sidecar, the load generator ramps concurrency, and the operator, reading
Prometheus, must scale the Deployment out before the engine hits the wall.

What makes this a test of the demand signal and not of a threshold: scaleOutOccupancy is 0.9,
so the occupancy trigger alone would fire only at the wall's edge. The scenario requires the
first scale-out to be a `DemandForecast` decision (the engine's arrivals x block-seconds per
request, Little's law, forecast over the pod start time), made while the mean occupancy the
operator read was still below 0.9 and the demand it read was above the KV in use, and decided
before the engine's own occupancy first reached 0.9, before its KV pool was first full and before
its first preemption, all measured on one timeline that a thread samples from the engine four
times a second. The lead times are printed; the assertion is that they are positive (their size
depends on the machine).

The operator fits the demand trend over `growthWindowSeconds` of decisions; the scenario
shortens it to 10 s, as it decides every second.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster.harness import Cluster
from e2e.helpers import (
    PROMETHEUS,
    Operator,
    Proc,
    Processes,
    Prometheus,
    Timings,
    free_port,
    headroom_argv,
    headroom_help_error,
    http_json,
    http_ok,
    processes,
    start_sidecar,
    wait_until,
)
from e2e.kube import CRDS, SELECTOR_LABEL, get_obj

NAME = "wall"
NEEDED = ("serve", "sidecar", "load")
# The stand-in pod's KV pool: 256 blocks of 16 tokens hold eight 512-token sequences, so a ramp
# to 24 concurrent requests reaches the wall in well under a minute on two cores, with KV use
# growing steadily enough for the sidecar's forecast to see it coming.
NUM_BLOCKS = int(os.environ.get("HEADROOM_E2E_WALL_BLOCKS", "256"))
RAMP_SECONDS = float(os.environ.get("HEADROOM_E2E_WALL_RAMP", "60"))
# How long past the ramp the scenario waits for the wall (a slow, busy machine fills later).
WALL_GRACE_SECONDS = float(os.environ.get("HEADROOM_E2E_WALL_GRACE", "120"))
RAMP_TO = 24
PROMPT_LEN, OUTPUT_LEN = 64, 448
# The threshold trigger sits at the wall's edge: a scale-out before it is the forecast's doing.
SCALE_OUT_OCCUPANCY = 0.9
TARGET_OCCUPANCY = 0.7
# Decisions every second: fit the demand trend over the last 10 of them.
GROWTH_WINDOW_SECONDS = 10
SAMPLE_SECONDS = 0.25

assert SCALE_OUT_OCCUPANCY >= 0.9, "below 0.9 a threshold autoscaler would pass this scenario"


def _require_pieces() -> None:
    """The engine server, sidecar and load generator are this project's; Prometheus is a tool
    `make tools` installs. A missing one is a broken checkout: fail, never skip."""
    errors = [e for c in NEEDED if (e := headroom_help_error(c))]
    if errors:
        pytest.fail(
            "scenario 5 needs `headroom serve`, `headroom sidecar` and `headroom load`:\n"
            + "\n".join(errors),
            pytrace=False,
        )
    if not (Path(PROMETHEUS).exists() or shutil.which("prometheus")):
        pytest.fail(
            f"Prometheus is not installed at {PROMETHEUS} (`make tools` installs it)",
            pytrace=False,
        )


def _spec(prometheus_url: str) -> dict[str, Any]:
    return {
        "model": {"preset": "llama-3.2-1b"},
        "gpu": {"type": "l4-24gb"},
        "traffic": {"peakConcurrency": 4, "contextTokens": 512},
        "scaling": {
            "minReplicas": 1,
            "maxReplicas": 4,
            "metricsSource": "prometheus",
            "prometheusURL": prometheus_url,
            "intervalSeconds": 1,
            "scaleUpStabilizationSeconds": 0,
            "metricsMaxAgeSeconds": 10,
            "targetOccupancy": TARGET_OCCUPANCY,
            "scaleOutOccupancy": SCALE_OUT_OCCUPANCY,
            "scaleInHysteresis": 0.1,
            "growthWindowSeconds": GROWTH_WINDOW_SECONDS,
        },
    }


@dataclass(frozen=True)
class Sample:
    """One reading of the engine's /stats and the sidecar's /saturation (t: unix seconds)."""

    t: float
    used: int
    capacity: int
    preemptions: int
    running: int
    waiting: int
    eta: float | None

    @property
    def occupancy(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0


@dataclass
class Sampler:
    """Reads the engine and sidecar every `interval` seconds on a thread, into one timeline."""

    engine_url: str
    sidecar_url: str
    interval: float = SAMPLE_SECONDS
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    last_error: str = ""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="wall-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def read(self) -> Sample:
        t = time.time()
        stats = http_json(f"{self.engine_url}/stats", timeout=5.0)
        sat = http_json(f"{self.sidecar_url}/saturation", timeout=5.0)
        kv, req = stats["kv"], stats.get("requests") or {}
        return Sample(
            t=t,
            used=int(kv["used"]),
            capacity=int(kv["capacity"]),
            preemptions=int(stats["preemptions_total"]),
            running=int(req.get("running", 0)),
            waiting=int(req.get("waiting", 0)),
            eta=sat.get("eta_seconds"),
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.read())
            except Exception as exc:  # a busy engine may miss a read; the timeline has a gap
                self.errors += 1
                self.last_error = repr(exc)
            self._stop.wait(self.interval)

    def first(self, pred: Callable[[Sample], bool]) -> Sample | None:
        return next((s for s in list(self.samples) if pred(s)), None)


@dataclass
class Trace:
    """What the scenario saw, on the wall clock; t0 is the load generator's start."""

    t0: float
    sampler: Sampler
    scaled_seen_at: float | None = None  # first `kubectl get` showing replicas > 1
    scaled_to: int | None = None
    at_scale: Sample | None = None  # the engine read right after that
    decision: dict[str, Any] | None = None  # the first scale-out of status.lastDecisions
    decision_time: float | None = None  # its recorded time (whole seconds, rounded down)

    @property
    def decided_by(self) -> float | None:
        """The latest the decision can have been made: its recorded second's end, or when the
        scale-out was first seen, whichever is earlier."""
        bounds = [t for t in (self.scaled_seen_at,) if t is not None]
        if self.decision_time is not None:
            bounds.append(self.decision_time + 1.0)
        return min(bounds) if bounds else None

    def over_line(self) -> Sample | None:
        return self.sampler.first(lambda s: s.occupancy >= SCALE_OUT_OCCUPANCY)

    def full(self) -> Sample | None:
        return self.sampler.first(lambda s: s.used >= s.capacity)

    def first_preemption(self) -> Sample | None:
        return self.sampler.first(lambda s: s.preemptions > 0)

    def wall(self) -> Sample | None:
        """The wall: the pool first full or the first preemption, whichever came first."""
        hits = [s for s in (self.full(), self.first_preemption()) if s is not None]
        return min(hits, key=lambda s: s.t) if hits else None

    def lead(self, event: Sample | None) -> float | None:
        decided = self.decided_by
        return None if event is None or decided is None else event.t - decided

    def rel(self, t: float | None) -> str:
        return "     -" if t is None else f"{t - self.t0:6.1f}"


def _unix(rfc3339: str) -> float:
    """Kubernetes' second-precision UTC time as unix seconds."""
    return datetime.strptime(rfc3339, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def _replicas(cluster: Cluster, ns: str) -> int:
    dep = get_obj(cluster, "deployment", NAME, namespace=ns)
    return int(dep["spec"]["replicas"])


def _ready_pod(cluster: Cluster, ns: str) -> str | None:
    pods = get_obj(cluster, "pods", namespace=ns)["items"]
    assert isinstance(pods, list)
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        conds = (pod.get("status") or {}).get("conditions") or []
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
        if labels.get(SELECTOR_LABEL) == NAME and ready:
            return str(pod["metadata"]["name"])
    return None


def _start_stand_in(group: Processes, pod: str, ns: str) -> tuple[str, int, list[Proc]]:
    """The engine and its sidecar on 127.0.0.1; returns (engine URL, sidecar port, procs)."""
    engine_port = free_port()
    engine = group.start(
        "engine",
        [
            *headroom_argv(),
            "serve",
            "--model",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(engine_port),
            "--num-blocks",
            str(NUM_BLOCKS),
            "--block-size",
            "16",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "64",
        ],
    )
    url = f"http://127.0.0.1:{engine_port}"
    wait_until(
        lambda: http_ok(f"{url}/ready"), timeout=300, what="engine /ready", alive=engine.check_alive
    )
    sidecar, sidecar_port = start_sidecar(
        group, url, pod=pod, namespace=ns, inferencedeployment=NAME
    )
    return url, sidecar_port, [engine, sidecar]


def test_operator_scales_out_on_the_forecast_before_the_wall(
    cluster: Cluster,
    cluster_namespace: str,
    operator: Operator,
    log_dir: Path,
    timings: Timings,
) -> None:
    _require_pieces()
    ns = cluster_namespace
    cluster.kubectl("apply", "-f", str(CRDS))
    with processes(log_dir / "wall") as group:
        try:
            _run(cluster, ns, operator, group, timings)
        except BaseException:
            print(group.report())
            raise


def _run(
    cluster: Cluster,
    ns: str,
    operator: Operator,
    group: Processes,
    timings: Timings,
) -> None:
    t_start = time.monotonic()
    # The CR first, naming Prometheus' future URL, so that the kwok pod exists and its name is
    # known before the sidecar (which labels its series with it) starts.
    prom_port = free_port()
    prom_url = f"http://127.0.0.1:{prom_port}"
    spec = _spec(prom_url)
    cr = {
        "apiVersion": "headroom.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": ns},
        "spec": spec,
    }
    cluster.apply(yaml.safe_dump(cr))
    # The API server kept the knobs (a field the CRD lacks would be pruned without a word).
    stored = get_obj(cluster, "inferencedeployment", NAME, namespace=ns)["spec"]["scaling"]
    for key in ("growthWindowSeconds", "scaleOutOccupancy"):
        assert stored.get(key) == spec["scaling"][key], (key, stored)
    pod = wait_until(
        lambda: _ready_pod(cluster, ns),
        timeout=180,
        what="the Deployment's kwok pod to be Ready",
        alive=operator.check_alive,
    )
    assert _replicas(cluster, ns) == 1

    engine_url, sidecar_port, stand_in = _start_stand_in(group, pod, ns)
    prom = Prometheus(group, {"headroom-sidecar": [f"127.0.0.1:{sidecar_port}"]}, port=prom_port)
    prom.wait_ready(timeout=120)
    wait_until(
        prom.targets_up,
        timeout=120,
        what="Prometheus to scrape the sidecar",
        alive=prom.proc.check_alive,
    )

    def kv_status() -> dict[str, Any]:
        status = get_obj(cluster, "inferencedeployment", NAME, namespace=ns).get("status") or {}
        return status.get("kv") or {}

    def reporting() -> bool:
        return bool(kv_status().get("podsReporting"))

    wait_until(
        reporting,
        timeout=120,
        what="the operator to read the pod's KV from Prometheus",
        alive=operator.check_alive,
    )
    timings.figure(
        "scenario 5: engine, sidecar and Prometheus reporting", time.monotonic() - t_start
    )
    # An idle deployment first: the operator's growth confirmation looks back over its last
    # growthWindowSeconds of decisions, so let it fill with the flat, idle demand before the
    # ramp (otherwise the ramp's first seconds are the only history it confirms against).
    # One decision may miss the pod: a sidecar poll that overruns its 0.4 s timeout on a slow,
    # loaded machine leaves one scrape without the KV series, and Prometheus without them for a
    # scrape interval (1 s, which can span two decisions). Three decisions in a row without the
    # pod, or more than a quarter of them, mean the operator lost its figures.
    settle_until = time.monotonic() + GROWTH_WINDOW_SECONDS + 3
    decisions: dict[str, bool] = {}  # by status.kv.observedAt: whether the pod reported
    missed_in_a_row, last_seen = 0, None
    tick = 0
    while time.monotonic() < settle_until:
        operator.check_alive()
        kv = kv_status()
        at = kv.get("observedAt") or f"tick {tick}"  # each read a decision should it lack one
        tick += 1
        if at != last_seen:
            decisions[at] = bool(kv.get("podsReporting"))
            missed_in_a_row = 0 if decisions[at] else missed_in_a_row + 1
            last_seen = at
        assert missed_in_a_row < 3, (
            f"the operator lost the pod's KV figures while the deployment idled: {decisions}"
        )
        time.sleep(1.0)
    missed = sum(not ok for ok in decisions.values())
    assert 4 * missed <= len(decisions), (
        f"the operator missed the pod's KV figures in {missed} of {len(decisions)} decisions "
        f"while the deployment idled: {decisions}"
    )
    assert _replicas(cluster, ns) == 1, "the operator scaled an idle deployment"

    sampler = Sampler(engine_url, f"http://127.0.0.1:{sidecar_port}").start()
    load = group.start(
        "load",
        [
            *headroom_argv(),
            "load",
            "--url",
            engine_url,
            "--duration",
            str(RAMP_SECONDS + WALL_GRACE_SECONDS),
            "--concurrency",
            "1",
            "--ramp-to",
            str(RAMP_TO),
            "--ramp-duration",
            str(RAMP_SECONDS),
            "--prompt-len",
            str(PROMPT_LEN),
            "--output-len",
            str(OUTPUT_LEN),
            "--no-progress",
        ],
    )
    trace = Trace(t0=time.time(), sampler=sampler)
    deadline = time.monotonic() + RAMP_SECONDS + WALL_GRACE_SECONDS
    try:
        while time.monotonic() < deadline:
            for proc in (*stand_in, prom.proc):
                proc.check_alive()
            operator.check_alive()
            if trace.scaled_seen_at is None:
                replicas = _replicas(cluster, ns)
                if replicas > 1:
                    trace.scaled_seen_at, trace.scaled_to = time.time(), replicas
                    trace.at_scale = sampler.read()
            if trace.scaled_seen_at is not None and trace.first_preemption() is not None:
                break
            if not load.running():
                break
            time.sleep(0.25)
    finally:
        load.stop()
        sampler.stop()

    status = get_obj(cluster, "inferencedeployment", NAME, namespace=ns).get("status") or {}
    assert isinstance(status, dict)
    ups = [d for d in status.get("lastDecisions") or [] if d["to"] > d["from"]]
    if ups:
        trace.decision = ups[0]
        trace.decision_time = _unix(ups[0]["time"])
    events = json.loads(
        cluster.kubectl(
            "get",
            "events",
            "-n",
            ns,
            "--field-selector",
            f"involvedObject.name={NAME},reason=ScaledOut",
            "-o",
            "json",
        ).stdout
    )["items"]
    _print_report(trace, status, events)
    if trace.scaled_seen_at is not None:
        timings.figure("scenario 5: load start -> scale-out seen", trace.scaled_seen_at - trace.t0)
    for what, event in (
        (f"occupancy {SCALE_OUT_OCCUPANCY:.0%}", trace.over_line()),
        ("the wall (pool full or first preemption)", trace.wall()),
        ("first preemption", trace.first_preemption()),
    ):
        lead = trace.lead(event)
        if lead is not None:
            timings.figure(f"scenario 5: lead time, scale-out decision -> {what}", lead)

    # 1. It scaled out, before any preemption, and the run did reach the wall.
    assert trace.scaled_seen_at is not None and trace.at_scale is not None, (
        f"the operator never scaled out during a {RAMP_SECONDS:.0f} s ramp to {RAMP_TO}; "
        f"status: {json.dumps(status.get('kv'))}; lastDecisions: {status.get('lastDecisions')}"
    )
    assert trace.at_scale.preemptions == 0, (
        f"the engine had already preempted {trace.at_scale.preemptions} sequences when the "
        "Deployment scaled out"
    )
    wall, first_preemption = trace.wall(), trace.first_preemption()
    assert first_preemption is not None, (
        f"the engine never preempted in {RAMP_SECONDS + WALL_GRACE_SECONDS:.0f} s of load "
        f"({len(sampler.samples)} samples, {sampler.errors} failed reads: "
        f"{sampler.last_error}): the scenario never reached the wall it is about"
    )
    assert wall is not None

    # 2. The decision, as recorded: the forecast's, from KV figures, below the threshold line.
    first = trace.decision
    assert first is not None, f"no scale-out in status.lastDecisions: {status.get('lastDecisions')}"
    assert first["applied"] is True
    assert first["from"] == 1 and first["to"] == trace.scaled_to, first
    assert first["reason"] == "DemandForecast", (
        f"the first scale-out must come from the demand signal, not {first['reason']}: {first}"
    )
    inputs = first["inputs"]
    assert inputs["podsReporting"] >= 1 and inputs["readyReplicas"] >= 1, inputs
    assert inputs["demandBlocks"] is not None and inputs["presentBlocks"] is not None, inputs
    # The demand is the counters' (Little's law), not the KV in use standing in for it, and the
    # forecast over the horizon asked for more than the KV in use. The demand itself need not
    # exceed the KV in use at this one decision: over a 1 s period it counts whole arrivals (one
    # run read 2 req/s, 134 blocks, against 136 in use, and its band made the call).
    assert "req/s x" in first["message"] and "block-s per request" in first["message"], first
    upper = inputs["forecastBlocks"] + inputs["forecastBandBlocks"]
    assert upper > inputs["presentBlocks"], (
        f"the forecast did not reach past the KV in use at the scale-out: {inputs}"
    )
    assert inputs["meanOccupancy"] is not None, inputs
    assert inputs["meanOccupancy"] < SCALE_OUT_OCCUPANCY, (
        f"the operator read occupancy {inputs['meanOccupancy']:.0%} at the decision: the "
        f"{SCALE_OUT_OCCUPANCY:.0%} threshold alone would have scaled out too"
    )
    assert not inputs.get("preemptionRatePerSecond"), inputs

    # 3. The lead times, measured on the engine's own timeline against the latest moment the
    #    decision can have been made: positive before the line and before the wall.
    over_line = trace.over_line()
    lead_line = trace.lead(over_line)
    assert lead_line is None or lead_line > 0, (
        f"the engine's occupancy reached {SCALE_OUT_OCCUPANCY:.0%} {-lead_line:.1f} s before the "
        "scale-out decision: a threshold autoscaler would have been as early"
    )
    lead_wall = trace.lead(wall)
    assert lead_wall is not None and lead_wall > 0, (
        f"the scale-out was decided {-(lead_wall or 0):.1f} s after the engine hit the wall"
    )

    first_event = [e for e in events if e["message"].startswith(f"1 -> {trace.scaled_to}:")]
    assert first_event, f"no ScaledOut Event for 1 -> {trace.scaled_to}: {events}"
    message = first_event[0]["message"]
    assert "demand" in message and "blocks" in message and "ready 1" in message, message


def _print_report(trace: Trace, status: dict[str, Any], events: list[dict[str, Any]]) -> None:
    p = "[scenario 5]"
    samples = list(trace.sampler.samples)
    marks: list[tuple[float, str]] = []
    if trace.decision_time is not None and trace.decision is not None:
        d = trace.decision
        marks.append(
            (trace.decision_time, f"DECISION {d['from']} -> {d['to']} {d['reason']} (whole s)")
        )
    if trace.scaled_seen_at is not None:
        marks.append((trace.scaled_seen_at, f"replicas {trace.scaled_to} seen on the Deployment"))
    for label, s in (
        (f"engine occupancy first >= {SCALE_OUT_OCCUPANCY:.0%}", trace.over_line()),
        ("KV pool first full", trace.full()),
        ("FIRST PREEMPTION", trace.first_preemption()),
    ):
        if s is not None:
            marks.append((s.t, label))
    print(f"\n{p} timeline (t from the load start; engine sampled every {SAMPLE_SECONDS} s)")
    print(f"{p}  t (s)  used  occupancy  eta (s)  running  waiting  preemptions")
    step = max(1, len(samples) // 60)
    rows: list[tuple[float, str]] = [
        (
            s.t,
            f"{s.used:4d}  {s.occupancy:9.0%}  "
            f"{'-' if s.eta is None else f'{s.eta:7.1f}':>7}  {s.running:7d}  {s.waiting:7d}  "
            f"{s.preemptions:11d}",
        )
        for s in samples[::step]
    ]
    rows += [(t, f"<-- {label}") for t, label in marks]
    for t, text in sorted(rows, key=lambda r: r[0]):
        print(f"{p} {trace.rel(t)}  {text}")
    if trace.at_scale is not None:
        a = trace.at_scale
        print(
            f"{p} at the scale-out: occupancy {a.occupancy:.0%} ({a.used}/{a.capacity} blocks), "
            f"{a.running} running, {a.preemptions} preemptions"
        )
    print(
        f"{p} decided by {trace.rel(trace.decided_by)} s (the recorded second's end or when seen)"
    )
    for label, event in (
        (f"occupancy {SCALE_OUT_OCCUPANCY:.0%}", trace.over_line()),
        ("the wall (pool full or first preemption)", trace.wall()),
        ("first preemption", trace.first_preemption()),
    ):
        lead = trace.lead(event)
        text = "never reached" if event is None else f"{lead:.1f} s" if lead is not None else "-"
        print(f"{p} LEAD TIME, scale-out decision -> {label}: {text}")
    if trace.sampler.errors:
        print(f"{p} {trace.sampler.errors} engine reads failed; last: {trace.sampler.last_error}")
    print(f"{p} status.lastDecisions:")
    print(json.dumps(status.get("lastDecisions"), indent=2))
    for ev in sorted(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or ""):
        print(f"{p} Event {ev['reason']}: {ev['message']}")
