"""The operator's own Prometheus metrics (`headroom operator --metrics-port`).

`headroom_desired_replicas` is the one that matters: in advisory mode it is how an HPA or KEDA
that owns scaling consumes headroom's decision (KEDA's prometheus scaler, or an HPA external
metric through prometheus-adapter). The last completed tick's time against the interval says
whether the scaling loop still runs: a loop that fails every tick (the API server refusing, a
bug) changes no other series, and decides nothing (the HeadroomAutoscalerStalled alert).
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from headroom.contract import metric_names as names_

LABELS = ("namespace", "inferencedeployment")
# Where a scaling tick can fail (headroom_scaling_tick_failures_total's `stage`).
TICK_FAILURE_STAGES = ("api", "metrics", "scale", "status", "error")


class OperatorMetrics:
    """Gauges and counters keyed by InferenceDeployment."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.desired_replicas = Gauge(
            "headroom_desired_replicas",
            "Replicas the scaling decision asks for (applied in auto mode, advised otherwise)",
            [*LABELS, "mode"],
            registry=self.registry,
        )
        self.current_replicas = Gauge(
            "headroom_current_replicas",
            "Replicas the owned Deployment asks for",
            LABELS,
            registry=self.registry,
        )
        self.decisions = Counter(
            "headroom_scaling_decisions_total",
            "Scaling decisions that changed (or advised changing) replicas",
            [*LABELS, "action", "reason"],
            registry=self.registry,
        )
        self.reconciles = Counter(
            "headroom_reconciles_total",
            "Reconciliations of InferenceDeployments by result",
            ["result"],
            registry=self.registry,
        )
        self.last_tick = Gauge(
            names_.SCALING_LAST_TICK,
            "Unix time the scaling loop last completed a tick (read its metrics, had its scale "
            "accepted, wrote its status), or started, before its first",
            LABELS,
            registry=self.registry,
        )
        self.interval = Gauge(
            names_.SCALING_INTERVAL,
            "scaling.intervalSeconds: how often a tick is due",
            LABELS,
            registry=self.registry,
        )
        self.tick_failures = Counter(
            names_.SCALING_TICK_FAILURES,
            "Scaling ticks that did not complete, by stage: api (the API server refused or was "
            "unreachable), metrics (the metrics source could not be read), scale (the scale "
            "refused), status (decided, and in auto mode scaled, but its status not written), "
            "error (a bug, logged with its traceback); a tick whose scale was refused and "
            "whose status was not written counts under both",
            [*LABELS, "stage"],
            registry=self.registry,
        )
        # The (action, reason) pairs and failure stages counted per InferenceDeployment, to
        # drop with it.
        self._decided: dict[tuple[str, str], set[tuple[str, str]]] = {}
        self._failed: dict[tuple[str, str], set[str]] = {}

    def decided(self, namespace: str, name: str, action: str, reason: str) -> None:
        """Count one decision that changed (or advised changing) replicas."""
        self._decided.setdefault((namespace, name), set()).add((action, reason))
        self.decisions.labels(namespace, name, action, reason).inc()

    def due(self, namespace: str, name: str, interval: float) -> None:
        """Record the period the next tick is due in (each loop, before its tick), and start
        every stage's failure count at 0, so a rate() sees the first failure of each."""
        self.interval.labels(namespace, name).set(interval)
        stages = self._failed.setdefault((namespace, name), set())
        for stage in TICK_FAILURE_STAGES:
            if stage not in stages:
                stages.add(stage)
                self.tick_failures.labels(namespace, name, stage)

    def ticked(self, namespace: str, name: str, at: float) -> None:
        """Record a completed tick at Unix time `at` (or the loop's start, before its first)."""
        self.last_tick.labels(namespace, name).set(at)

    def failed(self, namespace: str, name: str, stage: str) -> None:
        """Count a tick that did not complete at `stage` (one of TICK_FAILURE_STAGES)."""
        self._failed.setdefault((namespace, name), set()).add(stage)
        self.tick_failures.labels(namespace, name, stage).inc()

    def publish(self, namespace: str, name: str, mode: str, desired: int, current: int) -> None:
        """Record one decision's outcome."""
        for other in ("auto", "advisory"):
            if other != mode:
                with contextlib.suppress(KeyError):
                    self.desired_replicas.remove(namespace, name, other)
        self.desired_replicas.labels(namespace, name, mode).set(desired)
        self.current_replicas.labels(namespace, name).set(current)

    def forget(self, namespace: str, name: str) -> None:
        """Drop the series of a deleted InferenceDeployment."""
        for mode in ("auto", "advisory"):
            with contextlib.suppress(KeyError):
                self.desired_replicas.remove(namespace, name, mode)
        for gauge in (self.current_replicas, self.last_tick, self.interval):
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, name)
        for stage in self._failed.pop((namespace, name), set()):
            with contextlib.suppress(KeyError):
                self.tick_failures.remove(namespace, name, stage)
        for action, reason in self._decided.pop((namespace, name), set()):
            with contextlib.suppress(KeyError):
                self.decisions.remove(namespace, name, action, reason)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose /metrics on `port` from a background thread."""
        start_http_server(port, addr=addr, registry=self.registry)
