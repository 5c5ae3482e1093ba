"""The operator's own metrics: what an HPA or KEDA reads of a decision, and what a deleted
InferenceDeployment leaves behind."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from headroom.operator.scaling.exporter import OperatorMetrics


def value(m: OperatorMetrics, name: str, **labels: str) -> float | None:
    """One sample of `m`'s registry (None when the series is not there)."""
    return m.registry.get_sample_value(name, labels)


def test_desired_and_current_replicas_are_published_apart_to_the_registry_given() -> None:
    """Desired is the decision, current what the Deployment asks for: an advisory consumer
    reads the first, a dashboard sets it against the second. A mode switch leaves one desired
    series, so a consumer never reads a stale advice beside the new one."""
    registry = CollectorRegistry()
    m = OperatorMetrics(registry)
    assert m.registry is registry
    m.publish("ns", "chat", "advisory", desired=5, current=3)
    chat = {"namespace": "ns", "inferencedeployment": "chat"}
    assert value(m, "headroom_desired_replicas", mode="advisory", **chat) == 5
    assert value(m, "headroom_current_replicas", **chat) == 3
    m.publish("ns", "chat", "advisory", desired=4, current=5)
    assert value(m, "headroom_desired_replicas", mode="advisory", **chat) == 4
    assert value(m, "headroom_current_replicas", **chat) == 5
    m.publish("ns", "chat", "auto", desired=6, current=5)
    assert value(m, "headroom_desired_replicas", mode="advisory", **chat) is None
    assert value(m, "headroom_desired_replicas", mode="auto", **chat) == 6


def test_decisions_count_per_deployment_and_forget_drops_only_its_own() -> None:
    """Each decision counts once for its own deployment; a deleted deployment's series go (the
    same name in another namespace stays), and forgetting it again raises nothing."""
    m = OperatorMetrics()
    for ns in ("a", "b"):
        m.publish(ns, "chat", "auto", desired=2, current=2)
        m.decided(ns, "chat", "scale-out", "KVSaturated")
    m.decided("a", "chat", "scale-out", "KVSaturated")
    labels = {"inferencedeployment": "chat", "action": "scale-out", "reason": "KVSaturated"}
    decisions = "headroom_scaling_decisions_total"
    assert value(m, decisions, namespace="a", **labels) == 2
    assert value(m, decisions, namespace="b", **labels) == 1
    m.forget("a", "chat")
    m.forget("a", "chat")
    a = {"namespace": "a", "inferencedeployment": "chat"}
    b = {"namespace": "b", "inferencedeployment": "chat"}
    assert value(m, decisions, namespace="a", **labels) is None
    assert value(m, "headroom_desired_replicas", mode="auto", **a) is None
    assert value(m, "headroom_current_replicas", **a) is None
    assert value(m, decisions, namespace="b", **labels) == 1
    assert value(m, "headroom_desired_replicas", mode="auto", **b) == 2
    assert value(m, "headroom_current_replicas", **b) == 2


def test_tick_series_are_per_deployment_and_forget_drops_only_its_own() -> None:
    """The stall alert's series: a completed tick moves the time, a failure counts its stage
    and leaves the time; forgetting one deployment leaves the same name in another namespace."""
    m = OperatorMetrics()
    for ns in ("a", "b"):
        m.ticked(ns, "chat", at=100.0)
        m.due(ns, "chat", interval=15.0)
        m.failed(ns, "chat", "api")
    m.failed("a", "chat", "status")
    m.ticked("a", "chat", at=130.0)
    m.due("a", "chat", interval=30.0)
    a = {"namespace": "a", "inferencedeployment": "chat"}
    b = {"namespace": "b", "inferencedeployment": "chat"}
    failures = "headroom_scaling_tick_failures_total"
    assert value(m, "headroom_scaling_last_tick_timestamp_seconds", **a) == 130.0
    assert value(m, "headroom_scaling_interval_seconds", **a) == 30.0
    assert value(m, "headroom_scaling_last_tick_timestamp_seconds", **b) == 100.0
    assert (
        value(m, failures, stage="status", **a) == 1 and value(m, failures, stage="api", **b) == 1
    )
    m.forget("a", "chat")
    for name in (
        "headroom_scaling_last_tick_timestamp_seconds",
        "headroom_scaling_interval_seconds",
    ):
        assert value(m, name, **a) is None and value(m, name, **b) is not None
    assert (
        value(m, failures, stage="api", **a) is None
        and value(m, failures, stage="status", **a) is None
    )
    assert value(m, failures, stage="api", **b) == 1
