"""Scenario 2: the API server itself rejects bad InferenceDeployments with the CRD's messages
(OpenAPI schema and CEL rules), and accepts an infeasible one that the operator then reports as
Feasible=False with the arithmetic."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from e2e.cluster.harness import Cluster
from e2e.helpers import Operator, wait_until
from e2e.kube import CRDS, condition, get_obj
from headroom.operator.crd.models import NOT_A_FLAG

BASE: dict[str, Any] = {
    "model": {"preset": "llama-3.1-8b"},
    "gpu": {"type": "h100-80gb"},
    "traffic": {"peakConcurrency": 16, "contextTokens": 4096},
}
DELETE = object()

# (id, patch to BASE (DELETE removes a key), a fragment the API server's error must contain,
# whether the fragment is a CEL rule's message from the CRD).
BAD: list[tuple[str, dict[str, Any], str, bool]] = [
    ("no-traffic", {"traffic": DELETE}, "spec.traffic: Required value", False),
    (
        "kv-dtype",
        {"engine": {"kvCacheDtype": "fp4"}},
        'spec.engine.kvCacheDtype: Unsupported value: "fp4"',
        False,
    ),
    (
        "zero-concurrency",
        {"traffic": {"peakConcurrency": 0}},
        "spec.traffic.peakConcurrency in body should be greater than or equal to 1",
        False,
    ),
    (
        "hit-ratio-one",
        {"traffic": {"prefixHitRatio": 1.0}},
        "spec.traffic.prefixHitRatio in body should be less than 1",
        False,
    ),
    ("unknown-preset", {"model": {"preset": "llama-9"}}, 'Unsupported value: "llama-9"', False),
    ("unknown-field", {"gpu": {"flavour": "large"}}, 'unknown field "spec.gpu.flavour"', False),
    (
        "no-model",
        {"model": {"preset": DELETE, "path": "/models/x"}},
        "model needs either a preset or all of numLayers",
        True,
    ),
    (
        "preset-and-arch",
        {"model": {"numLayers": 32}},
        "model.preset already fixes the architecture",
        True,
    ),
    (
        "heads-not-multiple",
        {
            "model": {
                "preset": DELETE,
                "numLayers": 4,
                "numAttentionHeads": 10,
                "numKVHeads": 4,
                "headDim": 64,
                "hiddenSize": 640,
                "vocabSize": 32000,
                "parameterCount": 100000000,
            }
        },
        "model.numAttentionHeads must be a multiple of model.numKVHeads",
        True,
    ),
    ("no-gpu-size", {"gpu": {"type": DELETE}}, "gpu needs a type preset", True),
    (
        "tp-not-dividing",
        {"gpu": {"countPerPod": 4, "tensorParallel": 3}},
        "gpu.tensorParallel must divide gpu.countPerPod",
        True,
    ),
    (
        "min-over-max",
        {"scaling": {"minReplicas": 5, "maxReplicas": 2}},
        "scaling.minReplicas must not exceed scaling.maxReplicas",
        True,
    ),
    (
        "target-over-scale-out",
        {"scaling": {"targetOccupancy": 0.9, "scaleOutOccupancy": 0.8}},
        "scaling.targetOccupancy must be below scaling.scaleOutOccupancy",
        True,
    ),
    (
        "hysteresis-too-big",
        {"scaling": {"targetOccupancy": 0.5, "scaleInHysteresis": 0.6}},
        "scaling.scaleInHysteresis must be smaller than scaling.targetOccupancy",
        True,
    ),
    (
        "max-model-len-short",
        {"engine": {"maxModelLen": 1024}},
        "engine.maxModelLen must be at least traffic.contextTokens",
        True,
    ),
    (
        "unknown-runtime",
        {"engine": {"runtime": "tgi"}},
        'spec.engine.runtime: Unsupported value: "tgi"',
        False,
    ),
    (
        "vllm-int8-kv",
        {"engine": {"runtime": "vllm", "kvCacheDtype": "int8"}},
        "runtime vllm accepts auto or fp8",
        True,
    ),
    (
        "sglang-int8-kv",
        {"engine": {"runtime": "sglang", "kvCacheDtype": "int8"}},
        "runtime sglang accepts auto or fp8",
        True,
    ),
    (
        "vllm-attention-backend",
        {"engine": {"runtime": "vllm", "attentionBackend": "cuda"}},
        "leave it auto with runtime vllm or sglang",
        True,
    ),
    (
        "vllm-block-size",
        {"engine": {"runtime": "vllm", "blockSize": 24}},
        "runtime vllm takes engine.blockSize 16, 32, 64 or 128",
        True,
    ),
    # Issue 22: three specs vLLM 0.11's and SGLang 0.5.3's own code refuse at start, so the pod
    # would crash-loop. vLLM's attention backends need a block size that is a multiple of 16.
    (
        "vllm-block-size-1",
        {"engine": {"runtime": "vllm", "blockSize": 1}},
        "runtime vllm takes engine.blockSize 16, 32, 64 or 128",
        True,
    ),
    (
        "vllm-block-size-8",
        {"engine": {"runtime": "vllm", "blockSize": 8}},
        "runtime vllm takes engine.blockSize 16, 32, 64 or 128",
        True,
    ),
    (
        "vllm-batched-below-seqs",
        {"engine": {"runtime": "vllm", "maxNumBatchedTokens": 256, "maxNumSeqs": 512}},
        "runtime vllm needs engine.maxNumBatchedTokens (vLLM --max-num-batched-tokens) of at "
        "least engine.maxNumSeqs",
        True,
    ),
    (
        "sglang-page-48",
        {"engine": {"runtime": "sglang", "blockSize": 48}},
        "runtime sglang needs engine.maxNumBatchedTokens (SGLang --chunked-prefill-size) to be "
        "a multiple of engine.blockSize",
        True,
    ),
    (
        "sglang-chunk-1000",
        {"engine": {"runtime": "sglang", "blockSize": 64, "maxNumBatchedTokens": 1000}},
        "runtime sglang needs engine.maxNumBatchedTokens (SGLang --chunked-prefill-size) to be "
        "a multiple of engine.blockSize",
        True,
    ),
    # Issue 24: specs that pass the CRD and then can never be applied or run.
    (
        "memory-lots",
        {"engine": {"memory": "lots"}},
        'spec.engine.memory: Invalid value: "lots": spec.engine.memory in body should match',
        False,
    ),
    (
        "cpu-four",
        {"engine": {"cpu": "four"}},
        'spec.engine.cpu: Invalid value: "four": spec.engine.cpu in body should match',
        False,
    ),
    (
        "gpu-resource-memory",
        {"gpu": {"resourceName": "memory"}},
        "gpu.resourceName must be an extended resource",
        True,
    ),
    (
        "gpu-resource-cpu",
        {"gpu": {"resourceName": "cpu"}},
        "gpu.resourceName must be an extended resource",
        True,
    ),
    (
        "path-is-a-flag",
        {"model": {"path": "--trust-remote-code"}},
        f"spec.model.path in body should match '{NOT_A_FLAG}'",
        False,
    ),
    (
        "served-name-is-a-flag",
        {"model": {"servedModelName": "--trust-remote-code"}},
        f"spec.model.servedModelName in body should match '{NOT_A_FLAG}'",
        False,
    ),
    (
        "vllm-headroom-image",
        {"engine": {"runtime": "vllm", "image": "ghcr.io/headroom-dev/headroom:0.1.0"}},
        "which have no vLLM or SGLang server",
        True,
    ),
    (
        "sglang-headroom-engine-image",
        {"engine": {"runtime": "sglang", "image": "ghcr.io/headroom-dev/headroom-engine:0.1.0"}},
        "which have no vLLM or SGLang server",
        True,
    ),
    (
        "headroom-runtime-small-image",
        {"engine": {"image": "ghcr.io/headroom-dev/headroom:0.1.0"}},
        "is the small image (operator and sidecar, no torch)",
        True,
    ),
]


def _patched(patch: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(BASE)

    def merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
        for key, value in src.items():
            if value is DELETE:
                dst.pop(key, None)
            elif isinstance(value, dict):
                merge(dst.setdefault(key, {}), value)
            else:
                dst[key] = value

    merge(spec, patch)
    return spec


def _manifest(name: str, namespace: str, spec: dict[str, Any]) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "headroom.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": spec,
        }
    )


def _crd_messages() -> list[str]:
    """Every x-kubernetes-validations message in the generated CRD."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for rule in node.get("x-kubernetes-validations", []):
                found.append(rule["message"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(yaml.safe_load((CRDS / "inferencedeployment.yaml").read_text()))
    return found


@pytest.fixture(scope="module")
def crd_installed(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", str(CRDS))
    cluster.wait("--for=condition=Established", "crd/inferencedeployments.headroom.dev")


def test_base_spec_is_valid(cluster: Cluster, cluster_namespace: str, crd_installed: None) -> None:
    out = cluster.kubectl(
        "apply", "--dry-run=server", "-f", "-", input=_manifest("ok", cluster_namespace, BASE)
    )
    assert "created (server dry run)" in out.stdout


def test_at_least_ten_bad_specs_are_covered() -> None:
    assert len(BAD) >= 10
    messages = _crd_messages()
    for case, _, fragment, cel in BAD:
        if cel:
            assert any(fragment in m for m in messages), f"{case}: not a CRD message: {fragment}"


@pytest.mark.parametrize(("case", "patch", "fragment", "cel"), BAD, ids=[b[0] for b in BAD])
def test_api_server_rejects_bad_spec(
    cluster: Cluster,
    cluster_namespace: str,
    crd_installed: None,
    case: str,
    patch: dict[str, Any],
    fragment: str,
    cel: bool,
) -> None:
    manifest = _manifest(f"bad-{case}", cluster_namespace, _patched(patch))
    out = cluster.kubectl("apply", "-f", "-", input=manifest, check=False)
    assert out.returncode != 0, f"{case} was accepted:\n{manifest}"
    assert "is invalid" in out.stderr or "strict decoding error" in out.stderr, out.stderr
    assert fragment in out.stderr, f"{case}: expected {fragment!r} in:\n{out.stderr}"
    listed = cluster.kubectl("get", "infd", "-n", cluster_namespace, "-o", "name").stdout
    assert f"bad-{case}" not in listed


# Names the children cannot take: the Service refuses dots, labels stop at 63 characters, and a
# Service name starts with a letter.
BAD_NAMES = [("dotted", "a.b"), ("seventy", "x" * 70), ("digit-first", "7b-chat")]


@pytest.mark.parametrize(("case", "name"), BAD_NAMES, ids=[b[0] for b in BAD_NAMES])
def test_api_server_rejects_names_the_children_cannot_take(
    cluster: Cluster, cluster_namespace: str, crd_installed: None, case: str, name: str
) -> None:
    out = cluster.kubectl(
        "apply", "-f", "-", input=_manifest(name, cluster_namespace, BASE), check=False
    )
    assert out.returncode != 0, f"{case}: {name!r} was accepted"
    assert "metadata.name must be a DNS-1035 label" in out.stderr, out.stderr
    assert any("metadata.name must be a DNS-1035 label" in m for m in _crd_messages())


def test_infeasible_spec_is_accepted_and_reported(
    cluster: Cluster, cluster_namespace: str, crd_installed: None, operator: Operator
) -> None:
    # 70B at bf16 on one 24 GB L4: the weights alone are five times the GPU.
    spec = _patched({"model": {"preset": "llama-3.1-70b"}, "gpu": {"type": "l4-24gb"}})
    cluster.kubectl("apply", "-f", "-", input=_manifest("too-big", cluster_namespace, spec))

    def reported() -> dict[str, Any] | None:
        cr = get_obj(cluster, "inferencedeployment", "too-big", namespace=cluster_namespace)
        cond = condition(cr, "Feasible")
        return cond if cond and cond["status"] == "False" else None

    cond = wait_until(reported, timeout=60, what="Feasible=False", alive=operator.check_alive)
    assert cond["reason"] == "Infeasible"
    assert "weights" in cond["message"] and "GiB" in cond["message"], cond
    cr = get_obj(cluster, "inferencedeployment", "too-big", namespace=cluster_namespace)
    assert cr["status"]["budget"]["feasible"] is False
    assert cr["status"]["budget"]["binding"] == "weights"
    ready = condition(cr, "Ready")
    assert ready is not None and ready["status"] == "False"
    # Nothing to run: no Deployment for an infeasible spec.
    dep = cluster.kubectl("get", "deployment", "too-big", "-n", cluster_namespace, check=False)
    assert dep.returncode != 0
    events = cluster.kubectl(
        "get",
        "events",
        "-n",
        cluster_namespace,
        "--field-selector",
        "involvedObject.name=too-big,reason=Infeasible",
        "-o",
        "name",
    ).stdout
    assert events.strip(), "no Infeasible Event on the InferenceDeployment"
