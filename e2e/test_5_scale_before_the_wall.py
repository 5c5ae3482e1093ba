"""Scenario 5: scale before the wall.

A real engine (the built-in tiny model on CPU, a deliberately small KV pool) and its sidecar run
as local processes standing in for the InferenceDeployment's one pod (kwok pods run nothing; the
sidecar carries the kwok pod's name, so the series match the pod the operator sees). Debian's
Prometheus scrapes the sidecar, the load generator ramps concurrency, and the operator, reading
Prometheus, must scale the Deployment out before the engine reports its first preemption. The
lead time (first preemption minus scale-out) is printed, never asserted: it depends on the
machine.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster.harness import Cluster
from e2e.helpers import (
    PROMETHEUS,
    Operator,
    Processes,
    Prometheus,
    Timings,
    free_port,
    headroom_argv,
    headroom_has,
    http_json,
    http_ok,
    processes,
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
RAMP_TO = 24
PROMPT_LEN, OUTPUT_LEN = 64, 448


def _pieces_or_skip() -> None:
    missing = [c for c in NEEDED if not headroom_has(c)]
    if missing:
        pytest.skip(
            f"`headroom {' / '.join(missing)}` not in this build: scenario 5 needs the "
            "engine server, the sidecar and the load generator"
        )
    if not (Path(PROMETHEUS).exists() or shutil.which("prometheus")):
        pytest.skip(f"Prometheus not installed at {PROMETHEUS} (make tools installs it)")


def _scaling_fields() -> set[str]:
    """The spec.scaling fields this build's CRD has."""
    crd = yaml.safe_load((CRDS / "inferencedeployment.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return set(spec["properties"]["scaling"]["properties"])


def _spec(prometheus_url: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"preset": "llama-3.2-1b"},
        "gpu": {"type": "l4-24gb"},
        "traffic": {"peakConcurrency": 4, "contextTokens": 512},
        "scaling": {
            "minReplicas": 1,
            "maxReplicas": 4,
            "metricsSource": "prometheus",
            "prometheusURL": prometheus_url,
            "intervalSeconds": 1,
            "saturationLookaheadSeconds": 60,
            "scaleUpStabilizationSeconds": 0,
            "metricsMaxAgeSeconds": 10,
            # Low thresholds so the occupancy trigger, too, leaves room before the wall.
            "targetOccupancy": 0.45,
            "scaleOutOccupancy": 0.6,
            "scaleInHysteresis": 0.1,
        },
    }
    # The kwok pod became ready seconds ago: let its forecast count at once where the CRD
    # offers the knob (the operator otherwise ignores a fresh pod's slope while it warms up).
    fast = {"warmupSeconds": 5, "growthWindowSeconds": 10}
    spec["scaling"].update({k: v for k, v in fast.items() if k in _scaling_fields()})
    return spec


@dataclass
class Trace:
    """What the test saw, sampled every quarter second, on the wall clock."""

    t0: float = field(default_factory=time.time)
    scaled_at: float | None = None
    scaled_to: int | None = None
    preemptions_at_scale: int | None = None
    occupancy_at_scale: float | None = None
    first_preemption_at: float | None = None
    # (t, used blocks, occupancy, preemptions, replicas, sidecar's eta in seconds or None)
    samples: list[tuple[float, int, float, int, int, float | None]] = field(default_factory=list)

    def rel(self, t: float | None) -> str:
        return "-" if t is None else f"{t - self.t0:6.1f} s"


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


def _start_stand_in(group: Processes, pod: str, ns: str) -> tuple[str, int]:
    """The engine and its sidecar on 127.0.0.1; returns (engine URL, sidecar port)."""
    engine_port, sidecar_port = free_port(), free_port()
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
        lambda: http_ok(f"{url}/ready"), timeout=180, what="engine /ready", alive=engine.check_alive
    )
    sidecar = group.start(
        "sidecar",
        [
            *headroom_argv(),
            "sidecar",
            "--engine-url",
            url,
            "--host",
            "127.0.0.1",
            "--port",
            str(sidecar_port),
            "--interval",
            "0.5",
            "--timeout",
            "0.4",
            "--forecast-window",
            "10",
            "--window",
            "10",
            "--pod",
            pod,
            "--namespace",
            ns,
            "--inferencedeployment",
            NAME,
        ],
    )
    wait_until(
        lambda: http_ok(f"http://127.0.0.1:{sidecar_port}/healthz"),
        timeout=60,
        what="sidecar /healthz",
        alive=sidecar.check_alive,
    )
    return url, sidecar_port


def test_operator_scales_out_before_the_first_preemption(
    cluster: Cluster,
    cluster_namespace: str,
    operator: Operator,
    log_dir: Path,
    timings: Timings,
) -> None:
    _pieces_or_skip()
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
    cr = {
        "apiVersion": "headroom.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": ns},
        "spec": _spec(prom_url),
    }
    cluster.apply(yaml.safe_dump(cr))
    pod = wait_until(
        lambda: _ready_pod(cluster, ns),
        timeout=120,
        what="the Deployment's kwok pod to be Ready",
        alive=operator.check_alive,
    )
    assert _replicas(cluster, ns) == 1

    engine_url, sidecar_port = _start_stand_in(group, pod, ns)
    prom = Prometheus(group, {"headroom-sidecar": [f"127.0.0.1:{sidecar_port}"]}, port=prom_port)
    prom.wait_ready()
    wait_until(
        prom.targets_up,
        timeout=60,
        what="Prometheus to scrape the sidecar",
        alive=prom.proc.check_alive,
    )

    def reporting() -> bool:
        status = get_obj(cluster, "inferencedeployment", NAME, namespace=ns).get("status") or {}
        kv = status.get("kv") or {}
        return bool(kv.get("podsReporting"))

    wait_until(
        reporting,
        timeout=60,
        what="the operator to read the pod's KV from Prometheus",
        alive=operator.check_alive,
    )
    timings.figure(
        "scenario 5: engine, sidecar and Prometheus reporting", time.monotonic() - t_start
    )

    load = group.start(
        "load",
        [
            *headroom_argv(),
            "load",
            "--url",
            engine_url,
            "--duration",
            str(RAMP_SECONDS + 30),
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
    trace = Trace()
    deadline = time.monotonic() + RAMP_SECONDS + 40
    while time.monotonic() < deadline:
        now = time.time()
        stats = http_json(f"{engine_url}/stats")
        kv = stats["kv"]
        occ = kv["used"] / kv["capacity"]
        preempted = int(stats["preemptions_total"])
        replicas = _replicas(cluster, ns)
        eta = http_json(f"http://127.0.0.1:{sidecar_port}/saturation").get("eta_seconds")
        trace.samples.append((now - trace.t0, kv["used"], occ, preempted, replicas, eta))
        if trace.first_preemption_at is None and preempted > 0:
            trace.first_preemption_at = now
        if trace.scaled_at is None and replicas > 1:
            trace.scaled_at, trace.scaled_to = now, replicas
            trace.preemptions_at_scale, trace.occupancy_at_scale = preempted, occ
        if trace.scaled_at is not None and trace.first_preemption_at is not None:
            break
        if not load.running() and trace.scaled_at is not None:
            break
        time.sleep(0.25)
    load.stop()

    status = get_obj(cluster, "inferencedeployment", NAME, namespace=ns).get("status") or {}
    assert isinstance(status, dict)
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
    if trace.scaled_at is not None:
        timings.figure("scenario 5: load start -> scale-out", trace.scaled_at - trace.t0)
    if trace.scaled_at is not None and trace.first_preemption_at is not None:
        lead = trace.first_preemption_at - trace.scaled_at
        timings.figure("scenario 5: lead time (first preemption - scale-out)", lead)

    assert trace.scaled_at is not None, (
        f"the operator never scaled out during a {RAMP_SECONDS:.0f} s ramp to {RAMP_TO}; "
        f"status: {json.dumps(status.get('kv'))}"
    )
    assert trace.preemptions_at_scale == 0, (
        f"the engine had already preempted {trace.preemptions_at_scale} sequences when the "
        "Deployment scaled out"
    )
    # The decision itself, as recorded: made before the wall, from KV figures.
    decisions = [d for d in status.get("lastDecisions") or [] if d["to"] > d["from"]]
    assert decisions, f"no scale-out in status.lastDecisions: {status.get('lastDecisions')}"
    first = decisions[0]
    assert first["applied"] is True
    assert first["from"] == 1 and first["to"] == trace.scaled_to
    assert first["reason"] in ("SaturationSoon", "HighOccupancy"), first
    inputs = first["inputs"]
    assert inputs["podsReporting"] >= 1 and inputs["readyReplicas"] >= 1, inputs
    assert inputs["meanOccupancy"] is not None and inputs["demandBlocks"] is not None, inputs
    assert not inputs.get("preemptionRatePerSecond"), inputs
    first_event = [e for e in events if e["message"].startswith(f"1 -> {trace.scaled_to}:")]
    assert first_event, f"no ScaledOut Event for 1 -> {trace.scaled_to}: {events}"
    message = first_event[0]["message"]
    assert "demand" in message and "blocks" in message and "ready 1" in message, message


def _print_report(trace: Trace, status: dict[str, Any], events: list[dict[str, Any]]) -> None:
    print("\n[scenario 5]  t (s)  used  occupancy  eta (s)  preemptions  replicas")
    step = max(1, len(trace.samples) // 40)
    for t, used, occ, pre, reps, eta in trace.samples[::step]:
        eta_s = "-" if eta is None else f"{eta:7.1f}"
        print(f"[scenario 5] {t:6.1f}  {used:4d}  {occ:9.0%}  {eta_s:>7}  {pre:11d}  {reps:8d}")
    print(
        f"[scenario 5] scale-out seen at    {trace.rel(trace.scaled_at)} "
        f"(to {trace.scaled_to}, occupancy {trace.occupancy_at_scale or 0:.0%}, "
        f"{trace.preemptions_at_scale} preemptions)"
    )
    print(f"[scenario 5] first preemption at  {trace.rel(trace.first_preemption_at)}")
    if trace.scaled_at is not None and trace.first_preemption_at is not None:
        lead = trace.first_preemption_at - trace.scaled_at
        print(f"[scenario 5] LEAD TIME: scaled out {lead:.1f} s before the first preemption")
    elif trace.scaled_at is not None:
        print("[scenario 5] LEAD TIME: the engine never preempted during the run")
    print("[scenario 5] status.lastDecisions:")
    print(json.dumps(status.get("lastDecisions"), indent=2))
    for ev in events:
        print(f"[scenario 5] Event {ev['reason']}: {ev['message']}")
