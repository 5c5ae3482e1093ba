"""reconcile() and the scaling tick against an in-memory API (the real API: *_cluster_*)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest

from headroom.contract.budget.memory import activation_reserve_bytes
from headroom.contract.budget.presets import gpu_preset, model_preset
from headroom.contract.demand import DemandRates
from headroom.contract.report import SaturationReport
from headroom.operator.kube import KubeError
from headroom.operator.reconcile.children import FIELD_MANAGER, SELECTOR_LABEL
from headroom.operator.reconcile.loop import HANDOFF_MANAGER, apply_failed, reconcile
from headroom.operator.reconcile.sizing import parse
from headroom.operator.scaling.decide import Memory, PodSample
from headroom.operator.scaling.loop import last_changes, tick
from headroom.operator.scaling.metrics_sources import (
    MetricsError,
    PodInfo,
    ScrapeTarget,
    sample_from_report,
    usable,
)
from headroom.operator.status import RECONCILE_MANAGER, SCALING_MANAGER, get_condition

NOW = 1_700_000_000.0


class FakeKube:
    """Enough of the API server: apply merges and tracks who owns spec.replicas; every write
    moves the object's resourceVersion, which an apply may name as its precondition."""

    def __init__(self, monitoring: frozenset[str] = frozenset()) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.applies: list[tuple[str, str, dict[str, Any]]] = []
        self.fail: list[KubeError] = []
        self.fail_kinds: dict[str, KubeError] = {}
        self.forbidden_reads: set[str] = set()  # kinds whose GET is refused (RBAC)
        self.monitoring = monitoring
        self.pods: list[dict[str, Any]] = []
        self.ready = 0
        self.scales: list[tuple[str, int, str]] = []
        self.statuses: list[tuple[str, dict[str, Any]]] = []
        self.version = 0

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Any:
        if kind in self.forbidden_reads:
            raise KubeError(403, "Forbidden", f"cannot get {kind}")
        obj = self.objects.get((kind, namespace or "", name))
        if obj is not None and kind == "Deployment":
            obj = copy.deepcopy(obj)
            obj["status"] = {"readyReplicas": self.ready}
        return obj

    def list(self, api_version: str, kind: str, namespace: str | None, label_selector: str = ""):
        assert kind == "Pod"
        return self.pods

    def served_kinds(self, group_version: str, ttl: float | None = None) -> frozenset[str]:
        return self.monitoring

    def apply(
        self, obj: dict[str, Any], *, field_manager: str = FIELD_MANAGER, force: bool = True
    ) -> dict[str, Any]:
        if self.fail:
            raise self.fail.pop(0)
        if obj["kind"] in self.fail_kinds:
            raise self.fail_kinds[obj["kind"]]
        key = (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        precondition = obj["metadata"].get("resourceVersion")
        if precondition is not None and precondition != self.objects.get(key, {}).get(
            "metadata", {}).get("resourceVersion"):  # fmt: skip
            raise KubeError(409, "Conflict", "the object has been modified; please apply your "
                            "changes to the latest version and try again")  # fmt: skip
        self.applies.append((obj["kind"], field_manager, copy.deepcopy(obj)))
        live = self.objects.setdefault(key, {"metadata": {"managedFields": []}})
        owners = {e["manager"] for e in live["metadata"]["managedFields"] if e.get("replicas")} - {
            field_manager
        }
        spec = obj.get("spec", {})
        live_spec = copy.deepcopy(live.get("spec", {}))
        if "template" in spec:
            live_spec = {**spec, **({"replicas": live_spec["replicas"]} if "replicas" in
                                    live_spec and "replicas" not in spec else {})}  # fmt: skip
        else:
            live_spec.update(spec)
        if obj["kind"] == "Deployment" and "replicas" not in spec and not owners:
            live_spec["replicas"] = 1  # a dropped field goes back to its default
        live.update({k: v for k, v in obj.items() if k not in ("spec", "metadata")})
        live["spec"] = live_spec
        meta = {**live["metadata"], **copy.deepcopy(obj["metadata"])}
        fields = [e for e in live["metadata"]["managedFields"] if e["manager"] != field_manager]
        owned = {"f:spec": {"f:replicas": {}}} if "replicas" in spec else {}
        fields.append(
            {"manager": field_manager, "operation": "Apply", "replicas": bool(owned),
             "fieldsV1": owned}
        )  # fmt: skip
        meta["managedFields"] = fields
        meta["resourceVersion"] = self._bump()
        live["metadata"] = meta
        return self.get("", obj["kind"], key[1], key[2])

    def scale(self, namespace: str, name: str, replicas: int, *, field_manager: str) -> int:
        if self.fail:
            raise self.fail.pop(0)
        self.scales.append((name, replicas, field_manager))
        dep = self.objects[("Deployment", namespace, name)]
        dep["spec"]["replicas"] = replicas
        dep["metadata"]["resourceVersion"] = self._bump()
        return replicas

    def _bump(self) -> str:
        self.version += 1
        return str(self.version)

    def apply_status(
        self,
        owner: Any,
        status: dict[str, Any],
        *,
        field_manager: str,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        self.statuses.append((field_manager, copy.deepcopy(status)))
        return {"status": status}

    def kinds_applied(self) -> list[str]:
        return [k for k, _, _ in self.applies]


def body(spec: dict[str, Any], status: dict[str, Any] | None = None, gen: int = 1) -> dict:
    return {
        "apiVersion": "headroom.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "chat", "namespace": "ns", "uid": "u-1", "generation": gen},
        "spec": spec,
        "status": status or {},
    }


SPEC: dict[str, Any] = {
    "model": {"preset": "llama-3.1-8b"},
    "gpu": {"type": "h100-80gb"},
    "traffic": {"peakConcurrency": 400, "contextTokens": 4096},
}
INFEASIBLE = {**SPEC, "model": {"preset": "llama-3.1-70b"}}


def _blocks_per_pod() -> int:
    """SPEC's pool from the KV arithmetic written out: 90 % of the GPU, less bf16 weights and
    the activation reserve, in blocks of 16 tokens x layers x K and V x kv heads x head dim."""
    arch, gpu = model_preset("llama-3.1-8b"), gpu_preset("h100-80gb")
    usable = int(gpu.memory_bytes * 0.9) - arch.num_parameters * 2 - activation_reserve_bytes(arch)
    return usable // (16 * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * 2)


BLOCKS = _blocks_per_pod()
# 256 blocks hold one 4096-token sequence; 400 sequences at peak.
REPLICAS = -(-400 // (BLOCKS // (4096 // 16)))


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    c = get_condition(status["conditions"], type_)
    assert c is not None, f"no {type_} condition"
    return c


def test_create_applies_owned_children_and_reports_the_budget() -> None:
    kube = FakeKube()
    out = reconcile(kube, body(SPEC), NOW)
    assert kube.kinds_applied() == ["Deployment", "Service", "PodDisruptionBudget"]
    assert {m for _, m, _ in kube.applies} == {FIELD_MANAGER}
    dep = kube.applies[0][2]
    assert REPLICAS == 4
    assert dep["spec"]["replicas"] == REPLICAS
    st = out.status
    assert st["budget"]["kvBlocksPerPod"] == BLOCKS and st["budget"]["sizedReplicas"] == REPLICAS
    assert st["selector"] == f"{SELECTOR_LABEL}=chat" and st["observedGeneration"] == 1
    assert st["desiredReplicas"] == 4 and st["replicas"] == 4
    assert cond(st, "Feasible")["status"] == "True"
    assert cond(st, "Ready")["reason"] == "ReplicasNotReady"
    assert [e.reason for e in out.events] == ["Sized", "Created"]


def test_monitoring_children_only_when_their_crds_exist() -> None:
    kube = FakeKube(monitoring=frozenset({"ServiceMonitor", "PrometheusRule"}))
    reconcile(kube, body(SPEC), NOW)
    assert kube.kinds_applied()[-2:] == ["ServiceMonitor", "PrometheusRule"]


def test_forbidden_monitoring_is_skipped_with_a_warning() -> None:
    kube = FakeKube(monitoring=frozenset({"ServiceMonitor", "PrometheusRule"}))
    kube.fail_kinds["ServiceMonitor"] = KubeError(403, "Forbidden", "no RBAC")
    # The same RBAC refuses reading it: the ownership check before any apply read it and
    # raised, and kopf retried every 5 s with nothing applied and no status.
    kube.forbidden_reads.add("ServiceMonitor")
    out = reconcile(kube, body(SPEC), NOW)
    assert "Deployment" in kube.kinds_applied() and "PrometheusRule" in kube.kinds_applied()
    assert any(e.reason == "MonitoringSkipped" for e in out.events)
    assert cond(out.status, "Feasible")["status"] == "True"


def test_an_infeasible_spec_is_not_ready_on_someone_else_s_deployment() -> None:
    # A user's Deployment holds the name: it runs nothing of this InferenceDeployment's, so
    # kubectl wait --for=condition=Ready must not pass on its 2/2 ready replicas.
    kube = FakeKube()
    kube.objects[("Deployment", "ns", "chat")] = {
        "metadata": {"name": "chat", "namespace": "ns", "labels": {"app": "chat"}},
        "spec": {"replicas": 2},
    }
    kube.ready = 2
    out = reconcile(kube, body(INFEASIBLE), NOW)
    ready = cond(out.status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Infeasible")
    assert ready["message"].startswith("no Deployment: ")
    assert kube.applies == []


def test_infeasible_spec_has_no_deployment_and_a_fix_recovers() -> None:
    kube = FakeKube()
    out = reconcile(kube, body(INFEASIBLE), NOW)
    assert kube.applies == []
    feasible = cond(out.status, "Feasible")
    assert (feasible["status"], feasible["reason"]) == ("False", "Infeasible")
    assert "weights 131.4 GiB/GPU" in feasible["message"]
    assert cond(out.status, "Ready")["reason"] == "Infeasible"
    assert out.status["budget"]["feasible"] is False
    assert [e.type for e in out.events] == ["Warning"]

    fixed = {**INFEASIBLE, "gpu": {"type": "h100-80gb", "countPerPod": 4},
             "model": {"preset": "llama-3.1-70b", "path": "/models/70b"},
             "engine": {"runtime": "sglang"}}  # fmt: skip
    out2 = reconcile(kube, body(fixed, status=out.status, gen=2), NOW + 60)
    assert kube.kinds_applied()[0] == "Deployment"
    feasible2 = cond(out2.status, "Feasible")
    assert feasible2["status"] == "True" and feasible2["observedGeneration"] == 2
    assert feasible2["lastTransitionTime"] != feasible["lastTransitionTime"]


def test_malformed_spec_gets_a_condition_not_an_exception() -> None:
    kube = FakeKube()
    out = reconcile(kube, body({"model": {"preset": "llama-3.1-8b"}, "gpu": "h100"}), NOW)
    assert kube.applies == []
    feasible = cond(out.status, "Feasible")
    assert feasible["reason"] == "InvalidSpec" and feasible["message"].startswith("spec.")
    out = reconcile(kube, body({**SPEC, "scaling": {"minReplicas": 9, "maxReplicas": 2}}), NOW)
    assert "minReplicas must not exceed" in cond(out.status, "Feasible")["message"]


def test_transient_errors_are_retried_and_hard_errors_raise() -> None:
    kube = FakeKube()
    kube.fail = [KubeError(503, "ServiceUnavailable", "etcd"), KubeError(409, "Conflict", "x")]
    reconcile(kube, body(SPEC), NOW)
    assert kube.kinds_applied() == ["Deployment", "Service", "PodDisruptionBudget"]
    kube.fail = [KubeError(422, "Invalid", "spec.template: bad")]
    with pytest.raises(KubeError, match="422"):
        reconcile(kube, body(SPEC), NOW)


def test_reconcile_is_idempotent_and_keeps_the_scaled_replicas() -> None:
    kube = FakeKube()
    reconcile(kube, body(SPEC), NOW)
    kube.objects[("Deployment", "ns", "chat")]["spec"]["replicas"] = 7  # the loop scaled it
    first = copy.deepcopy(kube.applies)
    kube.applies.clear()
    out = reconcile(kube, body(SPEC), NOW)  # an operator restart resumes
    assert kube.applies[0][2]["spec"]["replicas"] == 7
    assert [o for _, _, o in kube.applies][1:] == [o for _, _, o in first][1:]
    assert out.status["desiredReplicas"] == 7
    assert "Created" not in [e.reason for e in out.events]


def test_never_writes_spec() -> None:
    kube = FakeKube()
    for b in (body(SPEC), body(INFEASIBLE), body({"nonsense": 1})):
        out = reconcile(kube, b, NOW)
        assert "spec" not in out.status
    assert "InferenceDeployment" not in kube.kinds_applied()


def test_advisory_hands_replicas_over_instead_of_resetting_them() -> None:
    kube = FakeKube()
    reconcile(kube, body(SPEC), NOW)
    kube.objects[("Deployment", "ns", "chat")]["spec"]["replicas"] = 6
    advisory = {**SPEC, "scaling": {"mode": "advisory"}}
    kube.applies.clear()
    reconcile(kube, body(advisory), NOW)
    assert kube.applies[0][:2] == ("Deployment", HANDOFF_MANAGER)
    assert "replicas" not in kube.applies[1][2]["spec"]
    assert kube.objects[("Deployment", "ns", "chat")]["spec"]["replicas"] == 6
    # An external autoscaler writing /scale (spec.replicas) is followed, within bounds.
    reconcile(kube, body({**advisory, "replicas": 40}), NOW)
    assert kube.objects[("Deployment", "ns", "chat")]["spec"]["replicas"] == 10


# ----------------------------------------------------------------------------- scaling tick


def pods(n_ready: int, n_starting: int = 0) -> list[dict[str, Any]]:
    def one(name: str, ready: bool) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "creationTimestamp": "2023-11-14T22:00:00Z"},
            "status": {
                "phase": "Running" if ready else "Pending",
                "podIP": "10.0.0.1",
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }

    return [one(f"chat-{i}", True) for i in range(n_ready)] + [
        one(f"chat-new-{i}", False) for i in range(n_starting)
    ]


class FakeSource:
    """Every ready pod reports `occupancy`; with `arrivals`, also demand counters' rates (the
    KV held by requests that leave at 1/s per pod: block-seconds per request = used blocks)."""

    def __init__(
        self,
        occupancy: float | None,
        arrivals: float | None = None,
        fail: bool = False,
        capacity: int | None = None,
    ):
        self.occupancy, self.arrivals, self.fail = occupancy, arrivals, fail
        self.capacity = capacity or BLOCKS
        self.seen: list[ScrapeTarget] = []

    async def sample(self, target: ScrapeTarget, pods: list[PodInfo]) -> dict[str, PodSample]:
        self.seen.append(target)
        if self.fail:
            raise MetricsError("Prometheus at http://prom:9090 unreachable: refused")
        if self.occupancy is None:
            return {}
        used = round(self.occupancy * self.capacity)
        demand = None
        if self.arrivals is not None:
            demand = DemandRates(self.arrivals, 1.0, float(used), 60.0)
        return {
            p.name: PodSample(occupancy=self.occupancy, sampled_at=NOW - 1, used_blocks=used,
                              capacity_blocks=self.capacity, hit_ratio=0.4, running=50,
                              demand=demand)
            for p in pods if p.ready
        }  # fmt: skip


async def created(spec: dict[str, Any], replicas: int = 4) -> tuple[FakeKube, dict[str, Any]]:
    kube = FakeKube()
    out = reconcile(kube, body(spec), NOW - 600)
    kube.objects[("Deployment", "ns", "chat")]["spec"]["replicas"] = replicas
    kube.pods = pods(replicas)
    kube.ready = replicas
    kube.applies.clear()
    return kube, body(spec, status=out.status)


async def test_tick_scales_out_on_the_demand_forecast_through_the_scale_subresource() -> None:
    kube, b = await created(SPEC)
    # 60 % occupancy, but twice the requests arrive as leave: demand is 120 % of 4 pods.
    res = await tick(kube, FakeSource(0.6, arrivals=2.0), b, parse(b["spec"]), NOW)
    assert res.decision is not None and res.decision.reason == "DemandForecast"
    assert kube.applies == []  # the Deployment is not re-applied to change its replicas
    assert kube.scales == [("chat", res.decision.replicas, SCALING_MANAGER)]
    assert res.decision.replicas > 4
    st = res.outcome.status
    assert st["desiredReplicas"] == st["replicas"] == res.decision.replicas
    (rec,) = st["lastDecisions"]
    assert rec["from"] == 4 and rec["applied"] and rec["inputs"]["readyReplicas"] == 4
    assert rec["inputs"]["demandBlocks"] == pytest.approx(2 * 4 * round(0.6 * BLOCKS), rel=1e-3)
    assert rec["inputs"]["neededReplicas"] == res.decision.replicas
    assert st["kv"]["occupancyPercent"] == 60 and st["kv"]["hitPercent"] == 40
    assert st["kv"]["arrivalRatePerSecond"] == 8.0 and st["kv"]["horizonSeconds"] > 120
    assert "ScaledOut" in [e.reason for e in res.outcome.events]
    assert cond(st, "KVSaturated")["status"] == "False"


async def test_the_tick_writes_only_its_own_conditions() -> None:
    kube, b = await created(SPEC)
    res = await tick(kube, FakeSource(0.5, arrivals=1.0), b, parse(b["spec"]), NOW)
    mine = {c["type"] for c in res.outcome.status["conditions"]}
    assert mine == {"Ready", "KVSaturated", "ScalingLimited", "PoolMatchesPlan"}
    assert "Feasible" in {c["type"] for c in b["status"]["conditions"]}
    # reconcile's own: Feasible and Ready, never the scaling loop's.
    again = reconcile(kube, b, NOW)
    assert {c["type"] for c in again.status["conditions"]} == {"Feasible", "Ready"}


async def test_tick_in_advisory_mode_publishes_without_touching_replicas() -> None:
    kube, b = await created({**SPEC, "scaling": {"mode": "advisory"}})
    res = await tick(kube, FakeSource(0.95, arrivals=2.0), b, parse(b["spec"]), NOW)
    assert kube.applies == [] and kube.scales == []
    st = res.outcome.status
    assert st["desiredReplicas"] > 4 and st["replicas"] == 4
    assert st["lastDecisions"][-1]["applied"] is False
    assert cond(st, "ScalingLimited")["reason"] == "Advisory"
    assert res.memory.last_up is None  # nothing acted on


async def test_tick_holds_when_metrics_are_missing_and_says_why() -> None:
    kube, b = await created({**SPEC, "scaling": {"metricsSource": "prometheus"}})
    res = await tick(kube, FakeSource(None, fail=True), b, parse(b["spec"]), NOW)
    assert kube.scales == [] and res.outcome.status["desiredReplicas"] == 4
    limited = cond(res.outcome.status, "ScalingLimited")
    assert (limited["status"], limited["reason"]) == ("True", "MetricsUnavailable")
    # Said once, after the hold's lead-in (it was the error twice over).
    assert limited["message"] == (
        "scaling holds while KV metrics are missing or stale: "
        "Prometheus at http://prom:9090 unreachable: refused; holding 4"
    )
    kv = cond(res.outcome.status, "KVSaturated")
    assert (kv["status"], kv["message"]) == (
        "Unknown",
        "Prometheus at http://prom:9090 unreachable: refused; holding 4",
    )
    (ev,) = [e for e in res.outcome.events if e.reason == "MetricsUnavailable"]
    assert ev.message == limited["message"]


async def test_tick_reports_saturation_at_max() -> None:
    kube, b = await created({**SPEC, "scaling": {"maxReplicas": 4}})
    res = await tick(kube, FakeSource(1.0), b, parse(b["spec"]), NOW)
    assert kube.scales == []
    assert cond(res.outcome.status, "ScalingLimited")["reason"] == "AtMaxReplicas"
    assert cond(res.outcome.status, "KVSaturated")["status"] == "True"


class ReportSource:
    """Pod i answers the sidecar's /saturation report `reports[i]` (forecast_ready, eta_seconds),
    read by the sidecar source's own parsing."""

    def __init__(self, reports: list[tuple[bool, float | None]]) -> None:
        self.reports = reports

    async def sample(self, target: ScrapeTarget, pods: list[PodInfo]) -> dict[str, PodSample]:
        out: dict[str, PodSample] = {}
        for p, (ready, eta) in zip([p for p in pods if p.ready], self.reports, strict=False):
            figures: dict[str, Any] = dict(
                time=NOW, source="headroom", pod=p.name, namespace="ns", inferencedeployment="chat",
                engine_up=True, fresh=True, age_seconds=0.5, stale_after_seconds=10.0,
                occupancy=0.42, used_blocks=round(0.42 * BLOCKS), capacity_blocks=BLOCKS,
                running=7, waiting=0, eta_seconds=eta, forecast_ready=ready,
                forecast_points=9 if ready else 1, window_seconds=60.0,
                forecast_window_seconds=30.0, engine_restarts_total=0,
            )  # fmt: skip
            for name, info in SaturationReport.model_fields.items():
                if name not in figures and info.is_required():
                    ann = str(info.annotation)
                    figures[name] = (
                        None if "None" in ann else False if "bool" in ann else 0 if "int" in ann
                        else 0.0
                    )  # fmt: skip
            sample = usable(sample_from_report(SaturationReport(**figures), NOW))
            assert sample is not None
            out[p.name] = sample
        return out


@pytest.mark.parametrize(
    ("reports", "column", "words"),
    [([(False, None)] * 4, "pending", "soonest saturation no forecast yet,"),
     ([(True, None)] * 4, "steady", "soonest saturation not growing,"),
     ([(True, None)] * 3 + [(False, None)], "pending", "soonest saturation no forecast yet,"),
     ([(True, 290.0)] + [(False, None)] * 3, "290s",
      "soonest saturation 290 s (3 pod(s) with no forecast yet),"),
     ([(True, 290.0)] + [(True, None)] * 3, "290s", "soonest saturation 290 s,")],
)  # fmt: skip
async def test_the_eta_is_steady_only_when_every_reporting_pod_has_a_forecast(
    reports: list[tuple[bool, float | None]], column: str, words: str
) -> None:
    # A sidecar with no forecast yet (its first polls after a start or an engine restart)
    # reports eta_seconds None with forecast_ready False: "no forecast yet", not "not growing".
    # The ETA column read "steady" and KVSaturated "not growing" all the same.
    kube, b = await created(SPEC)
    res = await tick(kube, ReportSource(reports), b, parse(b["spec"]), NOW)
    st = res.outcome.status
    assert st["kv"]["podsReporting"] == 4
    assert st["kv"]["eta"] == column
    kv = cond(st, "KVSaturated")
    assert (kv["status"], kv["reason"]) == ("False", "WithinCapacity")
    assert words in kv["message"], kv["message"]


async def test_a_pool_smaller_than_the_plan_is_a_condition_with_both_numbers() -> None:
    kube, b = await created(SPEC)
    res = await tick(kube, FakeSource(0.5, capacity=BLOCKS // 2), b, parse(b["spec"]), NOW)
    pool = cond(res.outcome.status, "PoolMatchesPlan")
    assert (pool["status"], pool["reason"]) == ("False", "PoolBelowPlan")
    assert f"{BLOCKS // 2:,}" in pool["message"] and f"{BLOCKS:,}" in pool["message"]
    res = await tick(kube, FakeSource(0.5), b, parse(b["spec"]), NOW)
    assert cond(res.outcome.status, "PoolMatchesPlan")["status"] == "True"


async def test_tick_leaves_a_missing_deployment_to_reconcile_and_skips_infeasible() -> None:
    kube, b = await created(SPEC)
    del kube.objects[("Deployment", "ns", "chat")]
    res = await tick(kube, FakeSource(0.5), b, parse(b["spec"]), NOW)
    assert kube.applies == [] and kube.scales == [] and res.outcome.status == {}
    res = await tick(kube, FakeSource(0.99), body(INFEASIBLE), parse(body(INFEASIBLE)["spec"]), NOW)
    assert kube.applies == [] and res.outcome.status == {}


def test_last_changes_reads_the_decision_history() -> None:
    status = {
        "lastDecisions": [
            {"time": "2023-11-14T22:13:20Z", "from": 2, "to": 4},
            {"time": "2023-11-14T22:20:00Z", "from": 4, "to": 3},
            {"time": "garbage", "from": 3, "to": 9},
            # An advisory recommendation changed nothing: no window starts from it.
            {"time": "2023-11-14T22:30:00Z", "from": 3, "to": 6, "applied": False},
        ]
    }
    up, down = last_changes(status)
    assert up == 1_700_000_000.0 and down == 1_700_000_400.0


async def test_tick_leaves_a_resource_being_deleted_alone() -> None:
    kube, b = await created(SPEC)
    b["metadata"]["deletionTimestamp"] = "2023-11-14T22:13:20Z"
    res = await tick(kube, FakeSource(0.99), b, parse(b["spec"]), NOW)
    assert kube.scales == [] and res.outcome.status == {}


async def test_the_memory_goes_from_tick_to_tick_and_restarts_from_status() -> None:
    kube, b = await created(SPEC)
    first = await tick(kube, FakeSource(0.5, arrivals=1.0), b, parse(b["spec"]), NOW)
    assert [t for t, _ in first.memory.demand] == [NOW]
    second = await tick(
        kube, FakeSource(0.5, arrivals=1.0), b, parse(b["spec"]), NOW + 15, first.memory
    )
    assert [t for t, _ in second.memory.demand] == [NOW, NOW + 15]
    # A restarted operator has no memory: the last changes come back from status.
    b["status"]["lastDecisions"] = [{"time": "2023-11-14T22:13:20Z", "from": 2, "to": 4}]
    fresh = await tick(kube, FakeSource(0.5, arrivals=1.0), b, parse(b["spec"]), NOW, None)
    assert fresh.memory.last_up == 1_700_000_000.0


async def test_the_learned_pod_start_is_kept_in_status() -> None:
    kube, b = await created(SPEC)
    for p in kube.pods:  # seen loading first: only a start this operator watched is learned
        p["status"]["phase"] = "Pending"
        p["status"]["conditions"][0]["status"] = "False"
    seen = await tick(kube, FakeSource(0.5, arrivals=1.0), b, parse(b["spec"]), NOW - 15, Memory())
    for p in kube.pods:
        p["status"]["phase"] = "Running"
        p["status"]["conditions"][0] |= {"status": "True",
                                         "lastTransitionTime": "2023-11-14T22:03:00Z"}  # fmt: skip
    res = await tick(kube, FakeSource(0.5, arrivals=1.0), b, parse(b["spec"]), NOW, seen.memory)
    # Created 22:00:00, ready 22:03:00.
    assert res.outcome.status["podStartSeconds"] == 180.0
    assert res.outcome.status["podStartsObserved"] == 4


@pytest.mark.parametrize(
    ("scaling", "source"),
    [
        ({"metricsSource": "prometheus"}, lambda: FakeSource(None, fail=True)),  # no metrics
        ({"minReplicas": 6}, lambda: FakeSource(0.5, arrivals=1.0)),  # the spec's bounds
    ],
)
async def test_a_tick_that_learns_nothing_keeps_the_learned_pod_start(
    scaling: dict[str, Any], source: Any
) -> None:
    # The status apply deletes what it leaves out, and after a restart status is the only copy.
    kube, b = await created({**SPEC, "scaling": scaling})
    b["status"] |= {"podStartSeconds": 420.0, "podStartsObserved": 7}
    res = await tick(kube, source(), b, parse(b["spec"]), NOW, None)
    assert res.decision.figures.pod_start_seconds is None
    assert res.outcome.status["podStartSeconds"] == 420.0
    assert res.outcome.status["podStartsObserved"] == 7


def test_an_invalid_child_becomes_a_condition_not_a_retry_loop() -> None:
    exc = KubeError(
        422, "Invalid", 'Service "a.b" is invalid: metadata.name: must not contain dots'
    )
    out = apply_failed(body(SPEC), exc, NOW)
    ready = cond(out.status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ApplyFailed")
    assert "must not contain dots" in ready["message"]
    assert [e.reason for e in out.events] == ["ApplyFailed"]


def test_a_refused_apply_keeps_what_the_last_reconcile_wrote() -> None:
    # Its status is applied under the reconcile's field manager: a field left out is deleted,
    # and an HPA on /scale reads status.selector.
    good = reconcile(FakeKube(), body(SPEC), NOW).status
    exc = KubeError(422, "Invalid", 'Deployment.apps "x" is invalid: nodeSelector: bad value')
    out = apply_failed(body(SPEC, status=good, gen=2), exc, NOW + 60)
    assert {k: v for k, v in good.items() if k not in ("conditions", "observedGeneration")} == {
        k: v for k, v in out.status.items() if k not in ("conditions", "observedGeneration")
    }
    assert out.status["observedGeneration"] == 2 and out.status["selector"]
    assert cond(out.status, "Feasible") == cond(good, "Feasible")
    assert cond(out.status, "Ready")["reason"] == "ApplyFailed"


def test_a_name_the_children_cannot_take_is_refused_before_any_apply() -> None:
    kube = FakeKube()
    b = body(SPEC)
    b["metadata"]["name"] = "a.b"
    out = reconcile(kube, b, NOW)
    assert kube.applies == []
    assert cond(out.status, "Feasible")["reason"] == "InvalidName"


def test_status_managers_are_distinct() -> None:
    assert RECONCILE_MANAGER != SCALING_MANAGER != FIELD_MANAGER


async def test_a_scaling_tick_that_hits_the_api_logs_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from headroom.operator.handlers import Context, Options, _tick

    kube, b = await created(SPEC)

    def down(*args: object) -> None:
        raise KubeError(503, "ServiceUnavailable", "etcd is gone")

    kube.get = down  # type: ignore[method-assign,assignment]

    ctx = Context(Options(), kube, source_factory=lambda kind, c: FakeSource(0.99))  # type: ignore[arg-type,return-value]
    with caplog.at_level("WARNING", logger="headroom.operator"):
        memory = await _tick(ctx, b, parse(b["spec"]), Memory())
    assert memory == Memory()  # nothing decided, nothing forgotten
    (record,) = [r for r in caplog.records if "scaling ns/chat" in r.getMessage()]
    assert "503" in record.getMessage() and record.exc_info is None


async def test_a_reconcile_in_a_namespace_being_deleted_is_quiet_and_final(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The drift watch sees the namespace's deletion remove the Deployment; re-applying it gets
    NamespaceLifecycle's 403. That is no RBAC denial: one info line, no retry, no status."""
    import kopf

    from headroom.operator.handlers import Context, Options, _reconcile

    kube, b = await created(SPEC)
    kube.fail_kinds["Deployment"] = KubeError(
        403, "Forbidden", 'deployments.apps "chat" is forbidden: unable to create new content '
        "in namespace ns because it is being terminated"
    )  # fmt: skip
    ctx = Context(Options(), kube)  # type: ignore[arg-type]
    with caplog.at_level("INFO", logger="headroom.operator"):
        await _reconcile(ctx, b)  # no kopf.TemporaryError: nothing to retry
    assert kube.statuses == []
    lines = [r.getMessage() for r in caplog.records]
    assert any("namespace is being deleted" in m for m in lines), lines
    assert not any("forbidden" in m.lower() or "403" in m for m in lines), lines
    assert all(r.levelname == "INFO" for r in caplog.records)
    # Any other 403 is still a denial, retried and reported.
    kube.fail_kinds["Deployment"] = KubeError(403, "Forbidden", "cannot patch deployments")
    with pytest.raises(kopf.TemporaryError, match="403"):
        await _reconcile(ctx, b)


def _someone_elses(kind: str, **meta: Any) -> dict[str, Any]:
    template = {"spec": {"containers": [{"image": "web"}]}}
    return {
        "kind": kind,
        "metadata": {"name": "chat", "namespace": "ns", "managedFields": [], **meta},
        "spec": {"replicas": 7, "template": template},
    }


@pytest.mark.parametrize(
    ("kind", "meta", "says"),
    [
        ("Deployment", {}, "Deployment chat already exists and is not managed by headroom"),
        ("Service", {"labels": {SELECTOR_LABEL: "chat"}}, "Service chat already exists"),
        ("PodDisruptionBudget",
         {"ownerReferences": [{"kind": "InferenceDeployment", "name": "chat", "uid": "u-0",
                               "controller": True}]},
         "controlled by InferenceDeployment chat (uid u-0)"),
    ],
)  # fmt: skip
def test_a_child_name_someone_else_holds_is_not_taken_over(
    kind: str, meta: dict[str, Any], says: str
) -> None:
    kube = FakeKube()
    theirs = _someone_elses(kind, **meta)
    kube.objects[(kind, "ns", "chat")] = copy.deepcopy(theirs)
    out = reconcile(kube, body(SPEC), NOW)
    assert kube.applies == []  # not even the children whose names were free
    assert kube.objects[(kind, "ns", "chat")] == theirs
    ready = cond(out.status, "Ready")
    assert ready["reason"] == "NameConflict" and says in ready["message"]
    assert cond(out.status, "Feasible")["status"] == "True"
    assert [e.reason for e in out.events] == ["NameConflict"]
    assert out.retry_after is not None and out.retry_after > 0
    # The same conflict on the next try: no second Event.
    again = reconcile(kube, body(SPEC, status=out.status), NOW + 30)
    assert again.events == [] and cond(again.status, "Ready")["reason"] == "NameConflict"
    # Once it is gone, the children are created.
    del kube.objects[(kind, "ns", "chat")]
    done = reconcile(kube, body(SPEC, status=again.status), NOW + 60)
    assert done.retry_after is None
    assert kube.kinds_applied() == ["Deployment", "Service", "PodDisruptionBudget"]


def test_an_orphan_of_an_earlier_inference_deployment_of_the_same_name_is_adopted() -> None:
    kube = FakeKube()
    reconcile(kube, body(SPEC), NOW)
    for obj in kube.objects.values():  # kubectl delete --cascade=orphan drops the references
        obj["metadata"].pop("ownerReferences", None)
    kube.applies.clear()
    b = body(SPEC)
    b["metadata"]["uid"] = "u-2"
    out = reconcile(kube, b, NOW)
    assert out.retry_after is None and cond(out.status, "Ready")["reason"] != "NameConflict"
    dep = kube.objects[("Deployment", "ns", "chat")]
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "u-2"


async def test_the_scaling_tick_never_scales_someone_elses_deployment() -> None:
    kube, b = await created(SPEC)
    del kube.objects[("Deployment", "ns", "chat")]["metadata"]["ownerReferences"]
    kube.objects[("Deployment", "ns", "chat")]["metadata"]["labels"] = {}
    res = await tick(kube, FakeSource(0.95, arrivals=2.0), b, parse(b["spec"]), NOW)
    assert kube.scales == [] and res.decision is None


async def test_a_refused_apply_stays_the_ready_condition_until_a_spec_applies() -> None:
    kube, b = await created(SPEC)
    first = await tick(kube, FakeSource(0.5), b, parse(b["spec"]), NOW)
    assert cond(first.outcome.status, "Ready")["reason"] == "AllReplicasReady"
    status = {**b["status"], **first.outcome.status}
    exc = KubeError(422, "Invalid", 'Deployment.apps "chat" is invalid: bad value')
    refused = apply_failed(body(SPEC, status=status, gen=2), exc, NOW + 1).status
    b2 = body(SPEC, status={**status, **refused}, gen=2)
    later = await tick(kube, FakeSource(0.5), b2, parse(b2["spec"]), NOW + 2)
    # The old Deployment is ready, but this generation's children were refused: Ready is the
    # reconcile's to say, and this loop leaves it out of its apply.
    assert get_condition(later.outcome.status["conditions"], "Ready") is None
    assert later.decision is not None  # the running Deployment is still scaled
    # A later generation that applies: the tick reads Ready off the Deployment again.
    fixed = reconcile(kube, body(SPEC, status=b2["status"], gen=3), NOW + 3).status
    b3 = body(SPEC, status={**b2["status"], **fixed}, gen=3)
    again = await tick(kube, FakeSource(0.5), b3, parse(b3["spec"]), NOW + 4)
    assert cond(again.outcome.status, "Ready")["reason"] == "AllReplicasReady"


async def test_an_infeasible_spec_keeps_replicas_current_and_ready_false_without_scaling() -> None:
    kube, b = await created(SPEC)
    first = await tick(kube, FakeSource(0.5, arrivals=1.0), b, parse(b["spec"]), NOW)
    status = {**b["status"], **first.outcome.status}
    b2 = body(INFEASIBLE, status=status, gen=2)
    kube.ready = 1  # three of the running Deployment's pods are lost
    res = await tick(kube, FakeSource(0.99, arrivals=9.0), b2, parse(b2["spec"]), NOW + 10)
    st = res.outcome.status
    assert kube.scales == [] and res.decision is None
    assert (st["replicas"], st["readyReplicas"]) == (4, 1)
    ready = cond(st, "Ready")
    # Nothing of this generation runs: Ready is False for it, the running Deployment's
    # readiness in the message.
    assert (ready["status"], ready["reason"]) == ("False", "Infeasible")
    assert ready["observedGeneration"] == 2
    assert ready["message"].endswith(
        "the running Deployment keeps its last feasible configuration: 1/4 replicas ready"
    )
    limited = cond(st, "ScalingLimited")
    assert (limited["status"], limited["reason"]) == ("True", "Infeasible")
    assert [e.reason for e in res.outcome.events] == ["ScalingStopped"]
    # What this loop wrote before is carried, not deleted by an apply that left it out.
    for key in ("lastDecisions", "desiredReplicas", "kv"):
        assert st.get(key) == status.get(key), key
    assert cond(st, "KVSaturated") == cond(status, "KVSaturated")


async def test_a_tick_that_ends_after_its_resource_was_deleted_publishes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # kopf stops the daemon, then runs the delete handler (`forget`) without waiting for the
    # tick in flight: a tick that ends afterwards must not bring the series back.
    from prometheus_client import generate_latest

    from headroom.operator import handlers
    from headroom.operator.handlers import Context, Options, _tick

    async def write(*args: object) -> None:  # kopf.event needs a running operator
        return None

    monkeypatch.setattr(handlers, "_write", write)

    class Stopped:
        def __bool__(self) -> bool:
            return True

    kube, b = await created(SPEC)
    ctx = Context(Options(), kube, source_factory=lambda kind, c: FakeSource(0.99))  # type: ignore[arg-type,return-value]
    await _tick(ctx, b, parse(b["spec"]), Memory(), Stopped())  # type: ignore[arg-type]
    assert 'inferencedeployment="chat"' not in generate_latest(ctx.metrics.registry).decode()
    await _tick(ctx, b, parse(b["spec"]), Memory())
    assert 'inferencedeployment="chat"' in generate_latest(ctx.metrics.registry).decode()


async def test_a_scale_between_the_reconciles_read_and_its_apply_is_not_undone() -> None:
    # The scaling daemon and a reconcile run at once, in worker threads: the reconcile reads
    # the Deployment (4 replicas), the tick scales it to 9, then the reconcile applies.
    kube, b = await created(SPEC)
    read = kube.get

    def get(api_version: str, kind: str, namespace: str | None, name: str) -> Any:
        out = read(api_version, kind, namespace, name)
        if kind == "Service" and not kube.scales:  # the ownership check, after the read
            kube.scale("ns", "chat", 9, field_manager=SCALING_MANAGER)
        return out

    kube.get = get  # type: ignore[method-assign]
    edited = body({**SPEC, "engine": {"prefixCaching": False}}, status=b["status"], gen=2)
    out = reconcile(kube, edited, NOW + 1)
    assert kube.objects[("Deployment", "ns", "chat")]["spec"]["replicas"] == 9
    deployments = [o for k, _, o in kube.applies if k == "Deployment"]
    assert [d["spec"]["replicas"] for d in deployments] == [9]
    assert out.status["replicas"] == out.status["desiredReplicas"] == 9


def test_a_deployment_whose_status_keeps_moving_is_still_applied() -> None:
    # Through a rollout the Deployment controller writes status at every turn, which moves the
    # resourceVersion too: the precondition would never hold, and a drift (kubectl set image)
    # would stay undone. After the guarded attempts it is applied from the freshest read.
    kube = FakeKube()
    reconcile(kube, body(SPEC), NOW)
    kube.scale("ns", "chat", 5, field_manager=SCALING_MANAGER)
    dep = kube.objects[("Deployment", "ns", "chat")]
    dep["spec"]["template"]["spec"]["containers"][0]["image"] = "drifted:1"
    read = kube.get

    def get(api_version: str, kind: str, namespace: str | None, name: str) -> Any:
        out = read(api_version, kind, namespace, name)
        if kind == "Service":  # a status write lands between every read and its apply
            dep["metadata"]["resourceVersion"] = kube._bump()
        return out

    kube.get = get  # type: ignore[method-assign]
    kube.applies.clear()
    reconcile(kube, body(SPEC), NOW)
    image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image != "drifted:1" and dep["spec"]["replicas"] == 5  # the scale is kept
    assert [k for k, _, _ in kube.applies].count("Deployment") == 1


async def test_a_refused_scale_is_reported_by_the_tick_not_raised() -> None:
    kube, b = await created(SPEC)
    kube.fail = [KubeError(403, "Forbidden", 'cannot patch resource "deployments/scale"')]
    res = await tick(kube, FakeSource(0.6, arrivals=2.0), b, parse(b["spec"]), NOW)
    assert res.decision is not None and res.decision.replicas > 4 and kube.scales == []
    st = res.outcome.status
    assert st["replicas"] == res.current == 4 and st["desiredReplicas"] == res.decision.replicas
    assert [(e.type, e.reason) for e in res.outcome.events] == [("Warning", "ScaleFailed")]
    assert cond(st, "ScalingLimited")["reason"] == "ScaleFailed"
    assert "lastDecisions" in st and not any(r["applied"] for r in st["lastDecisions"])
    assert res.memory.last_up is None


def _applied(kube: FakeKube, kind: str) -> dict[str, Any]:
    (obj,) = [o for k, _, o in kube.applies if k == kind]
    return obj


def test_a_rollout_or_a_node_drain_takes_one_pod_out_at_most() -> None:
    """A new pod is surged in before an old one leaves, and evictions go one pod at a time."""
    kube = FakeKube()
    reconcile(kube, body(SPEC), NOW)
    strategy = _applied(kube, "Deployment")["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate",
                        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}  # fmt: skip
    assert _applied(kube, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize(("interval", "scrape"), [(5, "5s"), (60, "15s")])
def test_the_sidecars_are_scraped_at_the_decision_period_or_every_15s(
    interval: int, scrape: str
) -> None:
    """The ServiceMonitor scrapes as often as the loop decides, at most 15 s apart, and keeps
    the namespace/pod/inferencedeployment labels the sidecar sets."""
    kube = FakeKube(monitoring=frozenset({"ServiceMonitor"}))
    reconcile(kube, body({**SPEC, "scaling": {"intervalSeconds": interval}}), NOW)
    (endpoint,) = _applied(kube, "ServiceMonitor")["spec"]["endpoints"]
    assert (endpoint["interval"], endpoint["honorLabels"]) == (scrape, True)


def test_the_pod_runs_as_the_image_s_user_without_api_credentials() -> None:
    """The pod runs as the uid the Dockerfile creates, mounts no service account token and no
    service env, and cannot write the model volume."""
    kube = FakeKube()
    model = {"preset": "llama-3.1-8b", "path": "/models/l8b", "volumeClaimName": "w"}
    reconcile(kube, body({**SPEC, "model": model}), NOW)
    pod = _applied(kube, "Deployment")["spec"]["template"]["spec"]
    dockerfile = (Path(__file__).resolve().parents[1] / "Dockerfile").read_text()
    users = set(re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.M))
    assert len(users) == 1, users
    ((uid, gid),) = users
    sc = pod["securityContext"]
    assert (sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"]) == (int(uid), int(gid), int(gid))
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False
    (engine,) = [c for c in pod["containers"] if c["name"] == "engine"]
    (models,) = [m for m in engine["volumeMounts"] if m["name"] == "models"]
    assert models["readOnly"] is True


def test_a_name_conflict_is_looked_at_again_every_30_s() -> None:
    """README: while a child's name is someone else's, the operator looks again every 30 s (no
    watch event says when the object in the way is gone)."""
    kube = FakeKube()
    kube.objects[("Deployment", "ns", "chat")] = _someone_elses("Deployment")
    out = reconcile(kube, body(SPEC), NOW)
    assert out.retry_after == 30.0


@pytest.mark.parametrize(("kind", "status"), [("Service", 403), ("ServiceMonitor", 500)])
def test_a_child_that_cannot_be_read_stops_the_reconcile_before_any_apply(
    kind: str, status: int
) -> None:
    """The ownership check skips one refused read only, of a monitoring kind RBAC denies (its
    apply becomes a warning): any other is raised, nothing applied blind, for kopf to retry."""
    kube = FakeKube(monitoring=frozenset({"ServiceMonitor"}))
    read = kube.get

    def get(api_version: str, kind_: str, namespace: str | None, name: str) -> Any:
        if kind_ == kind:
            raise KubeError(status, "Forbidden" if status == 403 else "InternalError", "no")
        return read(api_version, kind_, namespace, name)

    kube.get = get  # type: ignore[method-assign]
    with pytest.raises(KubeError, match=str(status)):
        reconcile(kube, body(SPEC), NOW)
    assert kube.applies == []


def test_advisory_keeps_the_published_decision_over_sizing_and_spec_replicas() -> None:
    """In advisory mode desiredReplicas is the scaling loop's published decision: a reconcile
    carries it, resetting it neither to the sized count nor to spec.replicas (the HPA's)."""
    kube = FakeKube()
    advisory = {**SPEC, "scaling": {"mode": "advisory"}}
    first = reconcile(kube, body(advisory), NOW)
    assert first.status["desiredReplicas"] == REPLICAS  # nothing decided yet: the sized count
    status = {**first.status, "desiredReplicas": 7}  # the tick decided 7
    out = reconcile(kube, body(advisory, status=status), NOW + 1)
    assert out.status["desiredReplicas"] == 7
    out = reconcile(kube, body({**advisory, "replicas": 6}, status=status), NOW + 2)
    assert (out.status["replicas"], out.status["desiredReplicas"]) == (6, 7)


def test_a_deployment_that_keeps_moving_is_read_three_more_times_at_most() -> None:
    """STALE_READ_ATTEMPTS (3) guarded applies, each after a fresh read, then one without the
    precondition: a rollout's status writes cost a bounded number of round trips."""
    kube = FakeKube()
    reconcile(kube, body(SPEC), NOW)
    dep = kube.objects[("Deployment", "ns", "chat")]
    read = kube.get
    reads: list[str] = []

    def get(api_version: str, kind: str, namespace: str | None, name: str) -> Any:
        if api_version:  # not FakeKube.apply answering with the object
            reads.append(kind)
        out = read(api_version, kind, namespace, name)
        if kind == "Service":  # a status write lands between every read and its apply
            dep["metadata"]["resourceVersion"] = kube._bump()
        return out

    kube.get = get  # type: ignore[method-assign]
    reconcile(kube, body(SPEC), NOW)
    assert reads.count("Deployment") == 1 + 3


def test_a_valid_spec_that_cannot_be_sized_gets_a_condition_not_an_exception() -> None:
    """A spec the schema takes but sizing refuses (vLLM asked to load the headroom engine's
    'tiny' test model) is InvalidSpec with sizing's reason, and nothing is applied."""
    kube = FakeKube()
    spec = {**SPEC, "model": {"preset": "llama-3.1-8b", "path": "tiny"},
            "engine": {"runtime": "vllm"}}  # fmt: skip
    assert parse(spec).spec is not None and parse(spec).sizing is None
    out = reconcile(kube, body(spec), NOW)
    assert kube.applies == []
    feasible = cond(out.status, "Feasible")
    assert (feasible["status"], feasible["reason"]) == ("False", "InvalidSpec")
    assert "cannot load 'tiny'" in feasible["message"]
    assert cond(out.status, "Ready")["reason"] == "InvalidSpec"
    assert [(e.type, e.reason) for e in out.events] == [("Warning", "InvalidSpec")]
