"""`Ready` as GitOps tools read it: `kubectl apply && kubectl wait --for=condition=Ready` (and
Flux's or Argo CD's health checks, keyed on Ready and observedGeneration) must wait for the
spec applied. Two ways it passed for a spec that never ran:

- a spec the operator cannot size (Feasible=False) applies nothing, the old Deployment keeps
  running, yet Ready read True for the new generation, off the old Deployment;
- a scaling tick in flight, computed from the object read before a GitOps apply, force-applied
  its Ready=True over the reconcile's Ready=False/ApplyFailed for the new generation, and
  nothing repaired it until the next resync.
"""

from __future__ import annotations

import copy
from typing import Any

import kopf
import pytest
from test_operator_handlers import _IDEP, _deployment_event, _StatusKube
from test_operator_reconcile import INFEASIBLE, NOW, SPEC, FakeSource, created

from headroom.operator.handlers import Context, Options, _reconcile, _tick, owned_deployment
from headroom.operator.kube import KubeError, owner_of
from headroom.operator.readiness import readiness
from headroom.operator.reconcile.loop import apply_failed, reconcile
from headroom.operator.reconcile.sizing import parse
from headroom.operator.scaling.loop import rebase_ready, reconcile_failed
from headroom.operator.status import (
    RECONCILE_MANAGER,
    SCALING_MANAGER,
    get_condition,
    set_condition,
)

RUNNING = "the running Deployment keeps its last feasible configuration"


def ready_of(obj: dict[str, Any]) -> dict[str, Any]:
    ready = get_condition((obj.get("status") or {}).get("conditions"), "Ready")
    assert ready is not None, f"no Ready in {obj.get('status')}"
    return ready


async def stored(replicas: int = 4) -> tuple[_StatusKube, dict[str, Any]]:
    """A reconciled InferenceDeployment (generation 1) whose Deployment runs `replicas` ready
    pods, held by a fake API server whose status applies honour a resourceVersion (the body
    returned is the stored object itself: a tick gets a copy)."""
    base, body = await created(SPEC, replicas=replicas)
    kube = _StatusKube()
    kube.__dict__.update(base.__dict__)
    body["metadata"]["resourceVersion"] = kube._bump()
    kube.objects[_IDEP] = body
    return kube, body


def new_generation(kube: _StatusKube, spec: dict[str, Any]) -> dict[str, Any]:
    """A GitOps apply of `spec`: the stored object's next generation (a copy of it)."""
    obj = kube.objects[_IDEP]
    obj["spec"] = copy.deepcopy(spec)
    obj["metadata"]["generation"] += 1
    obj["metadata"]["resourceVersion"] = kube._bump()
    return copy.deepcopy(obj)


def context(kube: _StatusKube, source: FakeSource, now: float = NOW) -> Context:
    ctx = Context(Options(), kube, source_factory=lambda kind, c: source)  # type: ignore[arg-type,return-value]
    ctx.clock = lambda: now
    return ctx


# ------------------------------------------------------------- 1. an infeasible generation


async def test_an_infeasible_spec_change_is_not_ready_for_its_generation() -> None:
    kube, _ = await stored()
    b2 = new_generation(kube, INFEASIBLE)
    out = reconcile(kube, b2, NOW + 1)
    assert kube.applies == [], "an infeasible spec applies nothing"
    ready = ready_of({"status": out.status})
    # The old Deployment's 4 pods are ready, but they run generation 1's spec.
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == (
        "False",
        "Infeasible",
        2,
    )
    assert ready["message"] == (
        f"the spec cannot be sized (see Feasible); {RUNNING}: 4/4 replicas ready"
    )
    assert out.status["observedGeneration"] == 2
    held = {**b2, "status": {**b2["status"], **out.status}}
    assert reconcile_failed(held), "Ready is the reconcile's to say for this generation"


async def test_no_writer_turns_an_infeasible_generation_ready_and_the_fix_does(
    posted: list[tuple[str, str, str]],
) -> None:
    kube, b = await stored(replicas=2)
    source = FakeSource(0.5)
    ctx = context(kube, source)
    memo = kopf.Memo(ctx=ctx)
    watch: Any = owned_deployment
    await _tick(ctx, copy.deepcopy(b), parse(b["spec"]), None)
    assert ready_of(kube.objects[_IDEP])["status"] == "True"
    await watch(event=_deployment_event(kube), memo=memo)  # first sight

    # The GitOps commit that cannot fit: the reconcile writes Ready=False for it.
    kube.applies.clear()
    b2 = new_generation(kube, INFEASIBLE)
    await _reconcile(ctx, b2)
    assert kube.applies == []
    ready = ready_of(kube.objects[_IDEP])
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == (
        "False",
        "Infeasible",
        2,
    )
    assert ready["message"].endswith(f"{RUNNING}: 2/2 replicas ready")

    # The Deployment's readiness moves (a pod lost, then back): the watch leaves Ready alone.
    for ready_pods in (1, 2):
        kube.ready = ready_pods
        await watch(event=_deployment_event(kube), memo=memo)
        assert ready_of(kube.objects[_IDEP])["status"] == "False", ready_pods
    assert readiness(kube.objects[_IDEP], _deployment_event(kube)["object"], NOW) is None

    # A scaling tick of the infeasible generation: Ready stays False, the message current.
    kube.ready = 1
    now = copy.deepcopy(kube.objects[_IDEP])
    await _tick(ctx, now, parse(now["spec"]), None)
    ready = ready_of(kube.objects[_IDEP])
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == (
        "False",
        "Infeasible",
        2,
    )
    assert ready["message"].endswith(f"{RUNNING}: 1/2 replicas ready")
    assert kube.scales == [], "the infeasible spec's Deployment is not scaled"

    # The fix (a feasible generation) brings Ready back, from its own Deployment.
    kube.ready = 2
    b3 = new_generation(kube, SPEC)
    await _reconcile(ctx, b3)
    ready = ready_of(kube.objects[_IDEP])
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == (
        "True",
        "AllReplicasReady",
        3,
    )
    now = copy.deepcopy(kube.objects[_IDEP])
    await _tick(ctx, now, parse(now["spec"]), None)
    ready = ready_of(kube.objects[_IDEP])
    assert (ready["status"], ready["observedGeneration"]) == ("True", 3)


async def test_a_tick_in_flight_does_not_make_an_infeasible_generation_ready(
    posted: list[tuple[str, str, str]],
) -> None:
    """The tick read generation 1 (feasible, ready); the infeasible generation 2 is reconciled
    while it scrapes. Its Ready, read off the old Deployment, must not land over the
    reconcile's."""
    kube, b = await stored()
    ctx: Context

    class Racing(FakeSource):
        async def sample(self, target: Any, infos: Any) -> Any:
            await _reconcile(ctx, new_generation(kube, INFEASIBLE))
            return await super().sample(target, infos)

    ctx = context(kube, Racing(0.5))
    await _tick(ctx, copy.deepcopy(b), parse(b["spec"]), None)
    obj = kube.objects[_IDEP]
    ready = ready_of(obj)
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == (
        "False",
        "Infeasible",
        2,
    ), ready
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"] == 2


# ------------------------------------------------------- 2. a tick in flight vs ApplyFailed


async def test_a_tick_in_flight_keeps_the_reconciles_apply_failed(
    posted: list[tuple[str, str, str]],
) -> None:
    """A GitOps apply lands while a tick scrapes; the API server refuses its Deployment
    (ApplyFailed for generation 2). The tick, computed from generation 1's object, wrote
    Ready=True over it: kubectl wait and Flux/Argo health passed, until the next resync."""
    kube, b = await stored()
    refused = KubeError(422, "Invalid", 'deployments.apps "chat" is forbidden: policy')
    written: dict[str, Any] = {}
    image_spec = {**SPEC, "engine": {"image": "forbidden.example/engine:1"}}

    class Racing(FakeSource):
        async def sample(self, target: Any, infos: Any) -> Any:
            if not written:
                b2 = new_generation(kube, image_spec)
                out = apply_failed(b2, refused, NOW + 0.5)
                kube.apply_status(owner_of(b2), out.status, field_manager=RECONCILE_MANAGER)
                written.update(ready_of(kube.objects[_IDEP]))
            return await super().sample(target, infos)

    ctx = context(kube, Racing(0.6, arrivals=3.0))
    await _tick(ctx, copy.deepcopy(b), parse(b["spec"]), None)
    obj = kube.objects[_IDEP]
    assert (written["status"], written["reason"], written["observedGeneration"]) == (
        "False",
        "ApplyFailed",
        2,
    )
    # The tick's apply carried the reconcile's Ready as it stands (co-owned, not replaced).
    assert ready_of(obj) == written
    (_, status) = [s for s in kube.statuses if s[0] == SCALING_MANAGER][-1]
    assert get_condition(status["conditions"], "Ready") == written
    # The rest of the tick landed: its scale is recorded, its Event posted.
    assert kube.scales and obj["status"]["lastDecisions"][-1]["applied"] is True
    assert obj["status"]["lastDecisions"][-1]["to"] == kube.scales[-1][1]
    assert ("Normal", "ScaledOut") in [(t, r) for t, r, _ in posted]
    # Neither the Deployment's watch nor the next tick turns it back to True.
    memo = kopf.Memo(ctx=ctx)
    watch: Any = owned_deployment
    await watch(event=_deployment_event(kube), memo=memo)
    kube.ready = 3
    await watch(event=_deployment_event(kube), memo=memo)
    assert ready_of(kube.objects[_IDEP]) == written
    ctx.clock = lambda: NOW + 60
    now = copy.deepcopy(kube.objects[_IDEP])
    await _tick(ctx, now, parse(now["spec"]), None)
    assert ready_of(kube.objects[_IDEP]) == written


async def test_a_tick_that_keeps_meeting_newer_objects_still_records_its_decision(
    posted: list[tuple[str, str, str]],
) -> None:
    """Two conflicts in a row: the third apply goes without the precondition (the scale is
    made, its record must not be lost), its Ready still rebased on the latest read."""
    kube, b = await stored()
    refused = KubeError(422, "Invalid", "refused")
    versions: list[str | None] = []
    real_apply = _StatusKube.apply_status

    def others_write_first(owner: Any, status: dict[str, Any], *, field_manager: str,
                           resource_version: str | None = None) -> dict[str, Any]:  # fmt: skip
        if field_manager == SCALING_MANAGER:
            versions.append(resource_version)
            if len(versions) == 1:  # the Deployment's watch writes (same generation)
                kube.objects[_IDEP]["metadata"]["resourceVersion"] = kube._bump()
            elif len(versions) == 2:  # a GitOps apply refused by the API server
                b2 = new_generation(kube, {**SPEC, "engine": {"image": "x.example/e:1"}})
                out = apply_failed(b2, refused, NOW + 1)
                real_apply(kube, owner, out.status, field_manager=RECONCILE_MANAGER)
        return real_apply(kube, owner, status, field_manager=field_manager,
                          resource_version=resource_version)  # fmt: skip

    kube.apply_status = others_write_first  # type: ignore[method-assign]
    ctx = context(kube, FakeSource(0.6, arrivals=3.0))
    read = copy.deepcopy(b)
    await _tick(ctx, read, parse(read["spec"]), None)
    assert versions[0] == read["metadata"]["resourceVersion"]
    assert versions[1] is not None and versions[1] != versions[0]
    assert versions[2:] == [None], versions
    obj = kube.objects[_IDEP]
    ready = ready_of(obj)
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == (
        "False",
        "ApplyFailed",
        2,
    )
    assert kube.scales and obj["status"]["lastDecisions"][-1]["to"] == kube.scales[-1][1]
    assert [r for _, r, _ in posted].count("ScaledOut") == 1


def _body(generation: int, ready: tuple[str, str], ready_generation: int) -> dict[str, Any]:
    conditions = set_condition([], "Ready", *ready, "m", generation=ready_generation, now=1.0)
    return {"metadata": {"generation": generation}, "status": {"conditions": conditions}}


@pytest.mark.parametrize(
    ("fresh", "carried"),
    [
        # The same generation, Ready the Deployment's: the tick's own (rechecked after).
        (_body(1, ("False", "ReplicasNotReady"), 1), False),
        # The reconcile says the current generation's children are not applied.
        (_body(2, ("False", "ApplyFailed"), 2), True),
        (_body(2, ("False", "Infeasible"), 2), True),
        (_body(1, ("False", "NameConflict"), 1), True),
        # A newer generation: the tick never read its Deployment.
        (_body(2, ("False", "RollingOut"), 2), True),
        (_body(2, ("True", "AllReplicasReady"), 1), True),
    ],
    ids=["same-generation", "apply-failed", "infeasible", "name-conflict", "newer-generation",
         "newer-generation-not-reconciled"],
)  # fmt: skip
def test_a_conflicting_tick_rebases_ready_on_the_object_it_met(
    fresh: dict[str, Any], carried: bool
) -> None:
    computed_from = _body(1, ("True", "AllReplicasReady"), 1)
    mine = set_condition([], "KVSaturated", "False", "WithinCapacity", "ok", generation=1,
                         now=2.0)  # fmt: skip
    mine = set_condition(mine, "Ready", "True", "AllReplicasReady", "4/4", generation=1, now=2.0)
    status = {"lastDecisions": [{"to": 5}], "conditions": mine}
    out = rebase_ready(status, computed_from, fresh)
    want = ready_of(fresh) if carried else get_condition(mine, "Ready")
    assert get_condition(out["conditions"], "Ready") == want
    assert get_condition(out["conditions"], "KVSaturated") == get_condition(mine, "KVSaturated")
    assert out["lastDecisions"] == [{"to": 5}]
    assert [c["type"] for c in out["conditions"]] == ["Ready", "KVSaturated"]


async def test_a_tick_without_a_conflict_writes_once_on_the_version_it_read() -> None:
    kube, b = await stored()
    seen: list[tuple[str, str | None]] = []
    real_apply = kube.apply_status

    def record(owner: Any, status: dict[str, Any], *, field_manager: str,
               resource_version: str | None = None) -> dict[str, Any]:  # fmt: skip
        seen.append((field_manager, resource_version))
        return real_apply(owner, status, field_manager=field_manager,
                          resource_version=resource_version)  # fmt: skip

    kube.apply_status = record  # type: ignore[method-assign]
    read = copy.deepcopy(b)
    await _tick(context(kube, FakeSource(0.5)), read, parse(read["spec"]), None)
    assert [v for m, v in seen if m == SCALING_MANAGER] == [read["metadata"]["resourceVersion"]]
    assert ready_of(kube.objects[_IDEP])["status"] == "True"
