"""The generated CRD on a real kube-apiserver: structural, defaulted, and every CEL rule refusing
what its Python twin refuses, with the same message."""

from __future__ import annotations

import copy
import json
import re
import time
from typing import Any

import pytest
import yaml

from e2e.cluster.harness import Cluster
from headroom.operator.crd.models import (
    EngineSpec,
    GPUSpec,
    InferenceDeploymentSpec,
    ModelSpec,
    ScalingSpec,
)
from headroom.operator.crd.schema import CRD_NAME, crd_yaml

pytest_plugins = ["e2e.cluster.pytest_plugin"]
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

VALID: dict[str, Any] = {
    "model": {"preset": "llama-3.1-8b"},
    "gpu": {"type": "h100-80gb"},
    "traffic": {"peakConcurrency": 64, "contextTokens": 4096},
}
ARCH = {
    "numLayers": 2, "numAttentionHeads": 4, "numKVHeads": 2, "headDim": 16, "hiddenSize": 64,
    "vocabSize": 256, "parameterCount": 100_000,
}  # fmt: skip

# (id, spec, the rule whose message the API server must answer with)
CEL_CASES = [
    ("preset-or-arch", {**VALID, "model": {"path": "tiny"}}, ModelSpec.__rules__[0]),
    ("preset-and-arch", {**VALID, "model": {"preset": "llama-3.1-8b", "numLayers": 3}},
     ModelSpec.__rules__[1]),
    ("heads-multiple", {**VALID, "model": {**ARCH, "numKVHeads": 3}}, ModelSpec.__rules__[2]),
    ("mla-pair", {**VALID, "model": {**ARCH, "kvLoraRank": 64}}, ModelSpec.__rules__[3]),
    ("sliding-window", {**VALID, "model": {**ARCH, "numSlidingWindowLayers": 2}},
     ModelSpec.__rules__[4]),
    ("gpu-type-or-memory", {**VALID, "gpu": {"countPerPod": 2}}, GPUSpec.__rules__[0]),
    ("tp-divides", {**VALID, "gpu": {"type": "h100", "countPerPod": 4, "tensorParallel": 3}},
     GPUSpec.__rules__[1]),
    ("min-max", {**VALID, "scaling": {"minReplicas": 5, "maxReplicas": 2}},
     ScalingSpec.__rules__[0]),
    ("target-below-scale-out", {**VALID, "scaling": {"targetOccupancy": 0.9}},
     ScalingSpec.__rules__[1]),
    ("hysteresis", {**VALID, "scaling": {"targetOccupancy": 0.3, "scaleInHysteresis": 0.4}},
     ScalingSpec.__rules__[2]),
    ("max-model-len", {**VALID, "engine": {"maxModelLen": 1024}},
     InferenceDeploymentSpec.__rules__[0]),
    ("attention-backend-headroom-only",
     {**VALID, "engine": {"runtime": "vllm", "attentionBackend": "cuda"}}, EngineSpec.__rules__[0]),
    ("vllm-no-int8", {**VALID, "engine": {"runtime": "vllm", "kvCacheDtype": "int8"}},
     EngineSpec.__rules__[1]),
    ("sglang-no-int8", {**VALID, "engine": {"runtime": "sglang", "kvCacheDtype": "int8"}},
     EngineSpec.__rules__[2]),
    ("vllm-block-sizes", {**VALID, "engine": {"runtime": "vllm", "blockSize": 24}},
     EngineSpec.__rules__[3]),
    ("stock-runtime-not-headroom-image",
     {**VALID, "engine": {"runtime": "sglang", "image": "ghcr.io/headroom-dev/headroom:0.1.0"}},
     EngineSpec.__rules__[4]),
]  # fmt: skip

SCHEMA_CASES = [
    ("unknown-preset", {**VALID, "model": {"preset": "llama-9"}}, "Unsupported value"),
    ("scale-out-above-one", {**VALID, "scaling": {"scaleOutOccupancy": 1.5}}, "less than or equal"),
    ("zero-concurrency", {**VALID, "traffic": {"peakConcurrency": 0, "contextTokens": 10}},
     "greater than or equal to 1"),
    ("bad-mode", {**VALID, "scaling": {"mode": "yolo"}}, "Unsupported value"),
    ("bad-runtime", {**VALID, "engine": {"runtime": "tgi"}}, "Unsupported value"),
    ("missing-traffic", {"model": VALID["model"], "gpu": VALID["gpu"]}, "Required value"),
]  # fmt: skip


def manifest(name: str, spec: dict[str, Any]) -> str:
    return yaml.safe_dump(
        {"apiVersion": "headroom.dev/v1alpha1", "kind": "InferenceDeployment",
         "metadata": {"name": name}, "spec": spec}
    )  # fmt: skip


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> Cluster:
    cluster.apply(crd_yaml())
    cluster.wait("--for=condition=Established", f"crd/{CRD_NAME}", timeout=60)
    return cluster


def create(cluster: Cluster, ns: str, name: str, spec: dict[str, Any], dry_run: bool = False):
    args = ["create", "-n", ns, "-f", "-"] + (["--dry-run=server"] if dry_run else [])
    deadline = time.monotonic() + 30
    while True:
        proc = cluster.kubectl(*args, input=manifest(name, spec), check=False)
        # A new CRD reaches kubectl's discovery a moment after it is Established.
        if "ensure CRDs are installed" not in proc.stderr or time.monotonic() > deadline:
            return proc
        time.sleep(0.5)


def test_valid_object_is_accepted_and_defaulted(crd: Cluster, cluster_namespace: str) -> None:
    proc = create(crd, cluster_namespace, "ok", VALID)
    assert proc.returncode == 0, proc.stderr
    obj = crd.get("infd", "ok", namespace=cluster_namespace)
    spec = obj["spec"]
    assert isinstance(spec, dict)
    assert spec["engine"]["blockSize"] == 16 and spec["engine"]["kvCacheDtype"] == "auto"
    assert spec["scaling"]["mode"] == "auto" and spec["scaling"]["targetOccupancy"] == 0.7
    assert spec["gpu"]["countPerPod"] == 1 and spec["model"]["path"] == "tiny"
    assert spec["engine"]["runtime"] == "headroom" and "image" not in spec["engine"]
    # What the API server stored, the operator's models read back to the same values.
    parsed = InferenceDeploymentSpec.model_validate(spec)
    assert parsed == InferenceDeploymentSpec.model_validate(VALID)
    custom = create(crd, cluster_namespace, "custom", {**VALID, "model": ARCH})
    assert custom.returncode == 0, custom.stderr


@pytest.mark.parametrize(
    ("spec", "rule"), [c[1:] for c in CEL_CASES], ids=[c[0] for c in CEL_CASES]
)
def test_each_cel_rule_refuses_with_its_message(
    crd: Cluster, cluster_namespace: str, spec: dict[str, Any], rule: Any
) -> None:
    proc = create(crd, cluster_namespace, "bad", spec, dry_run=True)
    assert proc.returncode != 0, f"accepted: {spec}"
    assert rule.message in proc.stderr, proc.stderr
    # The operator's own validation refuses the same object for the same reason.
    with pytest.raises(ValueError, match=re.escape(rule.message)):
        InferenceDeploymentSpec.model_validate(copy.deepcopy(spec))


@pytest.mark.parametrize(
    ("spec", "message"), [c[1:] for c in SCHEMA_CASES], ids=[c[0] for c in SCHEMA_CASES]
)
def test_schema_enums_and_ranges(
    crd: Cluster, cluster_namespace: str, spec: dict[str, Any], message: str
) -> None:
    proc = create(crd, cluster_namespace, "bad", spec, dry_run=True)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_unknown_fields_are_pruned_or_refused(crd: Cluster, cluster_namespace: str) -> None:
    spec = copy.deepcopy(VALID)
    spec["engine"] = {"blokSize": 32}
    proc = create(crd, cluster_namespace, "typo", spec, dry_run=True)
    # kubectl validates fields strictly by default: a typo is refused, not silently dropped.
    assert proc.returncode != 0 and "blokSize" in proc.stderr, proc.stderr


def test_names_columns_and_scale_subresource(crd: Cluster, cluster_namespace: str) -> None:
    # /scale reads spec.replicas, which an external autoscaler owns in advisory mode.
    spec = {**VALID, "replicas": 2, "scaling": {"mode": "advisory"}}
    assert create(crd, cluster_namespace, "cols", spec).returncode == 0
    header = crd.kubectl("get", "infd", "-n", cluster_namespace).stdout.splitlines()[0].split()
    assert header[:2] == ["NAME", "READY"]
    for column in ("REPLICAS", "DESIRED", "KV", "HIT", "ETA", "AGE"):
        assert column in header
    listed = crd.kubectl("get", "headroom", "-n", cluster_namespace, "-o", "name").stdout
    assert "inferencedeployment.headroom.dev/cols" in listed  # the category
    raw = crd.kubectl(
        "get", "--raw",
        f"/apis/headroom.dev/v1alpha1/namespaces/{cluster_namespace}/inferencedeployments/cols/scale",
    ).stdout  # fmt: skip
    scale = json.loads(raw)
    assert scale["kind"] == "Scale" and scale["apiVersion"] == "autoscaling/v1"
    assert scale["spec"]["replicas"] == 2
