"""The children of specs the CRD now refuses, applied as they would have been before: the real
API server refuses each for good, and `permanent_apply_error` says so (no retry-forever); the
same children with a valid spec and name apply."""

from __future__ import annotations

from typing import Any

import pytest

from e2e.cluster.harness import Cluster
from headroom.operator.crd.models import InferenceDeploymentSpec
from headroom.operator.kube import Kube, KubeError, load_configuration
from headroom.operator.reconcile.apply_errors import permanent_apply_error
from headroom.operator.reconcile.children import Owner, render
from headroom.operator.reconcile.sizing import size

pytest_plugins = ["e2e.cluster.pytest_plugin"]
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

VALID: dict[str, Any] = {
    "model": {"preset": "llama-3.1-8b", "path": "/models/l8b"},
    "gpu": {"type": "h100-80gb"},
    "traffic": {"peakConcurrency": 64, "contextTokens": 4096},
}


def _kube(cluster: Cluster) -> Kube:
    return Kube(load_configuration(str(cluster.kubeconfig)))


def _apply_all(kube: Kube, objs: list[dict[str, Any]]) -> list[KubeError]:
    errors = []
    for obj in objs:
        try:
            kube.apply(obj)
        except KubeError as exc:
            errors.append(exc)
    return errors


def _spec(gpu: dict[str, Any] | None = None, **engine: Any) -> InferenceDeploymentSpec:
    spec = InferenceDeploymentSpec.model_validate(VALID)
    # What an object stored before the CRD checked quantities holds: no validation on update.
    return spec.model_copy(
        update={"engine": spec.engine.model_copy(update=engine),
                "gpu": spec.gpu.model_copy(update=gpu or {})}
    )  # fmt: skip


@pytest.mark.parametrize("runtime", ["headroom", "vllm", "sglang"])
def test_valid_children_apply(cluster: Cluster, cluster_namespace: str, runtime: str) -> None:
    # With an API key from a Secret, too: env from secretKeyRef, and SGLang's $(VAR) argument.
    raw = {**VALID, "engine": {"runtime": runtime, "apiKeySecret": {"name": "chat-keys"}}}
    spec = InferenceDeploymentSpec.model_validate(raw)
    owner = Owner(f"chat-{runtime}", cluster_namespace, "00000000-0000-0000-0000-000000000001")
    kube = _kube(cluster)
    objs = render(owner, spec, size(spec), 1)
    # What the API server stored (the garbage collector soon removes it: the owner is made up).
    dep = kube.apply(objs[0])
    assert _apply_all(kube, objs[1:]) == []
    (engine,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    refs = [e for e in engine["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert [r["valueFrom"]["secretKeyRef"] for r in refs] == [
        {"name": "chat-keys", "key": "api-key"}
    ]


@pytest.mark.parametrize(
    ("case", "name", "engine"),
    [
        ("memory-lots", "mem", {"memory": "lots"}),
        ("cpu-four", "cpu", {"cpu": "four"}),
        ("dotted-name", "a.b", {}),
        ("seventy-characters", "x" * 70, {}),
        ("quota-prefixed-gpu", "gpu", {"gpu": {"resource_name": "requests.example.com/gpu"}}),
    ],
)
def test_what_the_crd_refuses_now_fails_for_good_on_the_api_server(
    cluster: Cluster, cluster_namespace: str, case: str, name: str, engine: dict[str, Any]
) -> None:
    spec = _spec(**engine)
    owner = Owner(name, cluster_namespace, "00000000-0000-0000-0000-000000000002")
    errors = _apply_all(_kube(cluster), render(owner, spec, size(spec), 1))
    assert errors, f"{case}: every child applied"
    for exc in errors:
        assert permanent_apply_error(exc.status, exc.message), f"{case}: {exc}"


def test_a_deployment_apply_from_a_stale_read_is_refused_not_applied(
    cluster: Cluster, cluster_namespace: str
) -> None:
    # What the reconcile relies on to never undo a scale it did not see: server-side apply
    # takes metadata.resourceVersion as a precondition and answers 409.
    from headroom.operator.reconcile.loop import StaleRead, _apply_read
    from headroom.operator.status import SCALING_MANAGER

    spec = InferenceDeploymentSpec.model_validate(VALID)
    owner = Owner("raced", cluster_namespace, "00000000-0000-0000-0000-000000000003")
    kube = _kube(cluster)
    dep = render(owner, spec, size(spec), 0)[0]
    del dep["metadata"]["ownerReferences"]  # the made-up owner would have it collected
    kube.apply(dep)
    read = kube.get("apps/v1", "Deployment", cluster_namespace, "raced")
    kube.scale(cluster_namespace, "raced", 2, field_manager=SCALING_MANAGER)  # the tick
    with pytest.raises(StaleRead):
        _apply_read(kube, dep, read)
    live = kube.get("apps/v1", "Deployment", cluster_namespace, "raced")
    assert live is not None and live["spec"]["replicas"] == 2
    for _ in range(5):  # the Deployment controller writes status too: read again until it lands
        fresh = kube.get("apps/v1", "Deployment", cluster_namespace, "raced")
        try:
            out = _apply_read(kube, {**dep, "spec": {**dep["spec"], "replicas": 2}}, fresh)
            break
        except StaleRead:
            continue
    else:
        pytest.fail("a fresh read never applied")
    assert out["spec"]["replicas"] == 2


def test_text_outside_the_bmp_applies(cluster: Cluster, cluster_namespace: str) -> None:
    """An emoji in a served model name (the CRD allows it) reaches the Deployment's args and
    the status messages: both applies used to be a 400 from the API server's YAML decoder."""
    raw = {**VALID, "model": {**VALID["model"], "servedModelName": "llama-\U0001f999"}}
    spec = InferenceDeploymentSpec.model_validate(raw)
    owner = Owner("chat-astral", cluster_namespace, "00000000-0000-0000-0000-000000000002")
    kube = _kube(cluster)
    dep = kube.apply(render(owner, spec, size(spec), 1)[0])
    (engine,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    assert "llama-\U0001f999" in engine["args"]
