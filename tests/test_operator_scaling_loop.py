"""The scaling tick's own arithmetic and wording: the pool check, the decision history, the
Ready rebase after a conflict, and the conditions and fields a tick writes (the tick's flow
against the in-memory API: test_operator_reconcile.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from test_operator_reconcile import NOW, SPEC, FakeSource, cond, created

from headroom.operator.crd.models import CONDITION_TYPES
from headroom.operator.reconcile.sizing import parse
from headroom.operator.scaling.decide import PodSample
from headroom.operator.scaling.loop import last_changes, pool_condition, rebase_ready, tick
from headroom.operator.scaling.metrics_sources import PodInfo, ScrapeTarget

# ----------------------------------------------------------------------------- pure helpers


def _pools(**capacity: int) -> dict[str, PodSample]:
    return {name: PodSample(occupancy=0.5, sampled_at=NOW, capacity_blocks=c)
            for name, c in capacity.items()}  # fmt: skip


def test_a_pool_within_two_percent_of_the_plan_is_the_plan() -> None:
    """Pools round to whole pages: 98 of 100 planned blocks is the plan, 97 is below it."""
    assert pool_condition(_pools(a=98), 100)[:2] == ("True", "PoolAsPlanned")
    assert pool_condition(_pools(a=97), 100)[:2] == ("False", "PoolBelowPlan")


def test_the_pool_condition_is_judged_on_the_smallest_pod() -> None:
    """One small pod among full ones is below plan, and the message names it."""
    status, reason, message = pool_condition(_pools(chat_0=100, chat_1=50, chat_2=100), 100)
    assert (status, reason) == ("False", "PoolBelowPlan")
    assert message.startswith("pod chat_1 runs 50 KV blocks against the 100 planned (50%)")


def test_a_decision_that_changed_nothing_starts_no_stabilization_window() -> None:
    """Only records whose replicas moved are the last scale-up or scale-down."""
    assert last_changes({"lastDecisions": [{"time": "2023-11-14T22:13:20Z", "from": 4, "to": 4}]}
                        ) == (None, None)  # fmt: skip


def _ready(status: str, reason: str, generation: int) -> dict[str, Any]:
    return {"type": "Ready", "status": status, "reason": reason, "message": reason,
            "observedGeneration": generation}  # fmt: skip


def _object(generation: int, *conditions: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"generation": generation}, "status": {"conditions": list(conditions)}}


TICK_STATUS: dict[str, Any] = {
    "desiredReplicas": 5,
    "conditions": [
        {"type": "PoolMatchesPlan", "status": "True"},
        _ready("True", "Available", 1),
        {"type": "KVSaturated", "status": "False"},
        {"type": "ScalingLimited", "status": "False"},
    ],
}


def test_a_newer_generation_keeps_the_ready_it_holds_after_a_conflict() -> None:
    """The tick read the previous spec's Deployment: its Ready must not replace the new one's;
    its own conditions stay, in the CRD's order."""
    held = _ready("False", "Progressing", 2)
    out = rebase_ready(TICK_STATUS, _object(1), _object(2, held))
    assert out["desiredReplicas"] == 5
    pool, _, kv, limited = TICK_STATUS["conditions"]
    assert out["conditions"] == [held, kv, limited, pool]
    assert [c["type"] for c in out["conditions"]] == [t for t in CONDITION_TYPES if t != "Feasible"]


def test_a_reconcile_failure_of_the_same_generation_keeps_its_ready() -> None:
    """Ready=False/ApplyFailed for the generation the tick saw is the reconcile's to say."""
    held = _ready("False", "ApplyFailed", 1)
    out = rebase_ready(TICK_STATUS, _object(1), _object(1, held))
    assert [c for c in out["conditions"] if c["type"] == "Ready"] == [held]
    assert len(out["conditions"]) == 4


def test_the_same_generation_otherwise_takes_the_ticks_ready() -> None:
    """No newer spec, no reconcile failure (or no Ready yet): the tick's status as computed."""
    stale = _ready("False", "Progressing", 1)
    assert rebase_ready(TICK_STATUS, _object(1), _object(1, stale)) is TICK_STATUS
    assert rebase_ready(TICK_STATUS, _object(1), _object(2)) is TICK_STATUS
    old_failure = _ready("False", "ApplyFailed", 0)
    assert rebase_ready(TICK_STATUS, _object(1), _object(1, old_failure)) is TICK_STATUS


# ----------------------------------------------------------------------------- the tick


class PreemptingSource(FakeSource):
    """FakeSource whose pods also report `rate` preemptions per second."""

    def __init__(self, occupancy: float, rate: float) -> None:
        super().__init__(occupancy)
        self.rate = rate

    async def sample(self, target: ScrapeTarget, pods: list[PodInfo]) -> dict[str, PodSample]:
        got = await super().sample(target, pods)
        return {n: dataclasses.replace(s, preemption_rate=self.rate) for n, s in got.items()}


async def test_a_saturated_pool_is_cache_full_until_it_preempts() -> None:
    """KVSaturated's reason: CacheFull with no preemption, Preempting at any rate above 0."""
    kube, b = await created({**SPEC, "scaling": {"maxReplicas": 4}})
    for rate, reason in [(0.0, "CacheFull"), (0.1, "Preempting")]:
        res = await tick(kube, PreemptingSource(1.0, rate), b, parse(b["spec"]), NOW)
        kv = cond(res.outcome.status, "KVSaturated")
        assert (kv["status"], kv["reason"]) == ("True", reason)


async def test_idle_pods_read_zero_percent_not_a_missing_figure() -> None:
    """An occupancy of 0 is a figure: the message says 0%, as it would for no figure."""
    kube, b = await created(SPEC)
    res = await tick(kube, FakeSource(0.0), b, parse(b["spec"]), NOW)
    kv = cond(res.outcome.status, "KVSaturated")
    assert kv["reason"] == "WithinCapacity"
    assert kv["message"].startswith("mean occupancy 0%, max 0%,"), kv["message"]


async def test_advice_is_counted_from_the_deployments_wanted_replicas() -> None:
    """`current` is the Deployment's spec.replicas, not its ready count; advice says so in an
    Advised Event."""
    kube, b = await created({**SPEC, "scaling": {"mode": "advisory"}})
    kube.ready = 3  # one pod of 4 not ready yet
    res = await tick(kube, FakeSource(0.95, arrivals=2.0), b, parse(b["spec"]), NOW)
    st = res.outcome.status
    want = st["desiredReplicas"]
    assert want > 4 and st["replicas"] == 4 and st["lastDecisions"][-1]["from"] == 4
    (advised,) = [e for e in res.outcome.events if e.reason == "Advised"]
    assert advised.message.startswith(f"advisory: 4 -> {want}: ")


async def test_an_applied_scale_leaves_scaling_within_limits() -> None:
    """Auto mode: a scale the tick made is no Advisory limit."""
    kube, b = await created(SPEC)
    res = await tick(kube, FakeSource(0.6, arrivals=2.0), b, parse(b["spec"]), NOW)
    assert kube.scales
    limited = cond(res.outcome.status, "ScalingLimited")
    assert (limited["status"], limited["reason"]) == ("False", "WithinLimits")


async def test_the_specs_pod_start_is_not_published_as_learned() -> None:
    """With no start watched and none in status, the horizon's pod start is the spec's: no
    podStartSeconds in status claims it was learned."""
    kube, b = await created(SPEC)
    res = await tick(kube, FakeSource(0.5, arrivals=1.0), b, parse(b["spec"]), NOW)
    assert res.decision is not None and res.decision.figures.pod_start_seconds is not None
    assert "podStartSeconds" not in res.outcome.status
    assert "podStartsObserved" not in res.outcome.status


async def test_a_learned_pod_start_is_written_to_a_tenth_of_a_second() -> None:
    """The learned start from status goes back rounded to 0.1 s with its count kept."""
    kube, b = await created(SPEC)
    b["status"] |= {"podStartSeconds": 420.24, "podStartsObserved": 7}
    res = await tick(kube, FakeSource(0.5, arrivals=1.0), b, parse(b["spec"]), NOW)
    assert res.outcome.status["podStartSeconds"] == 420.2
    assert res.outcome.status["podStartsObserved"] == 7
