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
