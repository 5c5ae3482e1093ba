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
from test_operator_crd import ARCH, BASE, PREFIX_253

from e2e.cluster.harness import Cluster
from headroom.operator.crd.models import (
    NAME_RULE,
    NODE_SELECTOR_KEY_MESSAGE,
    EngineSpec,
    GPUSpec,
    InferenceDeploymentSpec,
    ModelSpec,
    ScalingSpec,
    SecretKeySelector,
    name_error,
)
from headroom.operator.crd.rules import Rule
from headroom.operator.crd.schema import CRD_NAME, crd_yaml
from headroom.operator.reconcile.sizing import SpecError, size

pytest_plugins = ["e2e.cluster.pytest_plugin"]
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

# The specs the models' own tests start from (tests/test_operator_crd.py).
VALID = BASE
# A DNS subdomain of 244 characters, the longest an extended resource's domain can be.
DOMAIN_244 = ".".join(["a" * 61] + ["b" * 60] * 3)
assert len(DOMAIN_244) == 244


def rule(model: Any, fragment: str) -> Rule:
    """The rule of `model` whose message contains `fragment`."""
    (found,) = [r for r in model.__rules__ if fragment in r.message]
    return found


# (id, spec, the rule whose message the API server must answer with)
CEL_CASES = [
    ("preset-or-arch", {**VALID, "model": {"path": "tiny"}}, rule(ModelSpec, "either a preset")),
    ("preset-and-arch", {**VALID, "model": {"preset": "llama-3.1-8b", "numLayers": 3}},
     rule(ModelSpec, "already fixes")),
    ("heads-multiple", {**VALID, "model": {**ARCH, "numKVHeads": 3}},
     rule(ModelSpec, "multiple of model.numKVHeads")),
    ("mla-pair", {**VALID, "model": {**ARCH, "kvLoraRank": 64}}, rule(ModelSpec, "MLA")),
    ("indexer-needs-mla", {**VALID, "model": {**ARCH, "indexHeadDim": 128}},
     rule(ModelSpec, "indexHeadDim")),
    ("sliding-window", {**VALID, "model": {**ARCH, "numSlidingWindowLayers": 2}},
     rule(ModelSpec, "slidingWindow")),
    ("gpu-type-or-memory", {**VALID, "gpu": {"countPerPod": 2}}, rule(GPUSpec, "type preset")),
    ("tp-divides", {**VALID, "gpu": {"type": "h100", "countPerPod": 4, "tensorParallel": 3}},
     rule(GPUSpec, "must divide")),
    ("headroom-engine-one-gpu", {**VALID, "gpu": {"type": "h100", "countPerPod": 2}},
     rule(InferenceDeploymentSpec, "runs on one GPU")),
    ("headroom-engine-one-gpu-named",
     {**VALID, "gpu": {"type": "h100", "countPerPod": 4, "tensorParallel": 4},
      "engine": {"runtime": "headroom"}},
     rule(InferenceDeploymentSpec, "runs on one GPU")),
    ("gpu-resource-memory", {**VALID, "gpu": {"type": "h100", "resourceName": "memory"}},
     rule(GPUSpec, "extended resource")),
    ("gpu-resource-kubernetes-io",
     {**VALID, "gpu": {"type": "h100", "resourceName": "kubernetes.io/gpu"}},
     rule(GPUSpec, "extended resource")),
    ("gpu-resource-empty-domain-label",
     {**VALID, "gpu": {"type": "h100", "resourceName": "nvidia..com/gpu"}},
     rule(GPUSpec, "extended resource")),
    ("gpu-resource-requests-prefix",
     {**VALID, "gpu": {"type": "h100", "resourceName": "requests.example.com/gpu"}},
     rule(GPUSpec, "extended resource")),
    ("gpu-resource-name-over-63",
     {**VALID, "gpu": {"type": "h100", "resourceName": "example.com/" + "g" * 64}},
     rule(GPUSpec, "extended resource")),
    # Go's `$` is the end of the text; Python's also matches before a final newline.
    ("gpu-resource-trailing-newline",
     {**VALID, "gpu": {"type": "h100", "resourceName": "nvidia.com/gpu\n"}},
     rule(GPUSpec, "extended resource")),
    # `requests.` + the name must be a qualified name: its domain at most 244 characters.
    ("gpu-resource-domain-over-244",
     {**VALID, "gpu": {"type": "h100", "resourceName": DOMAIN_244 + "a/gpu"}},
     rule(GPUSpec, "extended resource")),
    ("api-key-dot-dot", {**VALID, "engine": {"apiKeySecret": {"name": "k", "key": ".."}}},
     rule(SecretKeySelector, "'..'")),
    ("api-key-dot", {**VALID, "engine": {"apiKeySecret": {"name": "k", "key": "."}}},
     rule(SecretKeySelector, "'..'")),
    ("api-key-starts-dot-dot",
     {**VALID, "engine": {"apiKeySecret": {"name": "k", "key": "..data"}}},
     rule(SecretKeySelector, "'..'")),
    ("min-max", {**VALID, "scaling": {"minReplicas": 5, "maxReplicas": 2}},
     rule(ScalingSpec, "minReplicas")),
    ("target-below-scale-out", {**VALID, "scaling": {"targetOccupancy": 0.96}},
     rule(ScalingSpec, "targetOccupancy must be below")),
    ("hysteresis", {**VALID, "scaling": {"targetOccupancy": 0.3, "scaleInHysteresis": 0.4}},
     rule(ScalingSpec, "scaleInHysteresis")),
    # kubectl sends 0 (and 0.0) as an integer, which `minimum: 0.5` compared with int64(0.5) = 0.
    ("forecast-quantile-zero", {**VALID, "scaling": {"forecastQuantile": 0}},
     rule(ScalingSpec, "forecastQuantile")),
    ("forecast-quantile-below-half", {**VALID, "scaling": {"forecastQuantile": 0.3}},
     rule(ScalingSpec, "forecastQuantile")),
    ("max-model-len", {**VALID, "engine": {"maxModelLen": 1024}},
     rule(InferenceDeploymentSpec, "maxModelLen")),
    ("attention-backend-headroom-only",
     {**VALID, "engine": {"runtime": "vllm", "attentionBackend": "cuda"}},
     rule(EngineSpec, "attentionBackend")),
    ("vllm-no-int8", {**VALID, "engine": {"runtime": "vllm", "kvCacheDtype": "int8"}},
     rule(EngineSpec, "runtime vllm accepts")),
    ("sglang-no-int8", {**VALID, "engine": {"runtime": "sglang", "kvCacheDtype": "int8"}},
     rule(EngineSpec, "runtime sglang accepts")),
    ("vllm-whole-gpu", {**VALID, "engine": {"runtime": "vllm", "gpuMemoryUtilization": 1.0}},
     rule(EngineSpec, "below 1.0")),
    ("vllm-block-sizes", {**VALID, "engine": {"runtime": "vllm", "blockSize": 24}},
     rule(EngineSpec, "engine.blockSize 16")),
    ("vllm-block-size-8", {**VALID, "engine": {"runtime": "vllm", "blockSize": 8}},
     rule(EngineSpec, "engine.blockSize 16")),
    ("vllm-batched-below-seqs",
     {**VALID, "engine": {"runtime": "vllm", "maxNumBatchedTokens": 256, "maxNumSeqs": 512}},
     rule(EngineSpec, "runtime vllm needs engine.maxNumBatchedTokens")),
    ("sglang-chunk-not-page-multiple", {**VALID, "engine": {"runtime": "sglang", "blockSize": 48}},
     rule(EngineSpec, "runtime sglang needs")),
    ("stock-runtime-not-headroom-image",
     {**VALID, "engine": {"runtime": "sglang", "image": "ghcr.io/headroom-dev/headroom:0.1.0"}},
     rule(EngineSpec, "no vLLM or SGLang server")),
    ("stock-runtime-not-headroom-engine-image",
     {**VALID, "engine": {"runtime": "vllm",
                          "image": "ghcr.io/headroom-dev/headroom-engine:0.1.0"}},
     rule(EngineSpec, "no vLLM or SGLang server")),
    ("headroom-runtime-not-the-small-image",
     {**VALID, "engine": {"image": "ghcr.io/headroom-dev/headroom:0.1.0"}},
     rule(EngineSpec, "the small image")),
    ("headroom-runtime-not-the-small-image-by-digest",
     {**VALID, "engine": {"image": "ghcr.io/headroom-dev/headroom@sha256:" + "0" * 64}},
     rule(EngineSpec, "the small image")),
    ("headroom-runtime-not-the-small-image-bare",
     {**VALID, "engine": {"image": "ghcr.io/headroom-dev/headroom"}},
     rule(EngineSpec, "the small image")),
    # What the engines cannot run: the operator's sizing refuses these (a SpecError).
    ("stock-runtime-default-path", {**VALID, "engine": {"runtime": "vllm"}},
     rule(InferenceDeploymentSpec, "needs model.path")),
    ("stock-runtime-tiny-path",
     {**VALID, "model": {"preset": "llama-3.1-8b", "path": "tiny"},
      "engine": {"runtime": "sglang"}},
     rule(InferenceDeploymentSpec, "needs model.path")),
    ("headroom-engine-no-mla",
     {**VALID, "model": {**ARCH, "kvLoraRank": 64, "qkRopeHeadDim": 16, "path": "/m"}},
     rule(InferenceDeploymentSpec, "the headroom engine loads")),
    ("headroom-engine-no-gemma-preset",
     {**VALID, "model": {"preset": "gemma-2-9b", "path": "/m"},
      "engine": {"runtime": "headroom"}},
     rule(InferenceDeploymentSpec, "the headroom engine loads")),
    ("headroom-engine-no-fp8-weights",
     {**VALID, "model": {"preset": "llama-3.1-8b", "weightDtype": "fp8", "path": "/m"}},
     rule(InferenceDeploymentSpec, "the headroom engine loads")),
    ("tp-splits-heads",
     {**VALID, "model": {**ARCH, "path": "/m"}, "gpu": {"type": "h100", "countPerPod": 3},
      "engine": {"runtime": "vllm"}},
     rule(InferenceDeploymentSpec, "must divide model.numAttentionHeads")),
    ("tp-splits-kv-heads",
     {**VALID, "model": {**ARCH, "numAttentionHeads": 12, "numKVHeads": 4, "path": "/m"},
      "gpu": {"type": "h100", "countPerPod": 12, "tensorParallel": 6},
      "engine": {"runtime": "sglang"}},
     rule(InferenceDeploymentSpec, "must divide model.numAttentionHeads")),
]  # fmt: skip

SCHEMA_CASES = [
    ("unknown-preset", {**VALID, "model": {"preset": "llama-9"}}, "Unsupported value"),
    ("scale-out-above-one", {**VALID, "scaling": {"scaleOutOccupancy": 1.5}}, "less than or equal"),
    ("zero-concurrency", {**VALID, "traffic": {"peakConcurrency": 0, "contextTokens": 10}},
     "greater than or equal to 1"),
    ("bad-mode", {**VALID, "scaling": {"mode": "yolo"}}, "Unsupported value"),
    ("bad-runtime", {**VALID, "engine": {"runtime": "tgi"}}, "Unsupported value"),
    ("missing-traffic", {"model": VALID["model"], "gpu": VALID["gpu"]}, "Required value"),
    ("memory-not-a-quantity", {**VALID, "engine": {"memory": "lots"}},
     "spec.engine.memory in body should match"),
    ("cpu-not-a-quantity", {**VALID, "engine": {"cpu": "four"}},
     "spec.engine.cpu in body should match"),
    ("memory-negative", {**VALID, "engine": {"memory": -5}}, "greater than or equal to 0"),
    # An exponent of many digits kept kube-apiserver busy for minutes on every Pod.
    ("memory-three-digit-exponent", {**VALID, "engine": {"memory": "1e100"}},
     "spec.engine.memory in body should match"),
    ("cpu-long-negative-exponent", {**VALID, "engine": {"cpu": "1e-99999999"}},
     "spec.engine.cpu in body should match"),
    # A Pod's image may not have whitespace at its ends, a Deployment template's may.
    ("image-trailing-space",
     {**VALID, "engine": {"image": "ghcr.io/headroom-dev/headroom-engine:0.1.0 "}},
     "spec.engine.image in body should match"),
    ("image-nbsp", {**VALID, "engine": {"image": "\u00a0registry.example.com/e:1"}},
     "spec.engine.image in body should match"),
    ("sidecar-image-blank", {**VALID, "engine": {"sidecarImage": " "}},
     "spec.engine.sidecarImage in body should match"),
    ("sidecar-image-newline", {**VALID, "engine": {"sidecarImage": "example.com/s:1\n"}},
     "spec.engine.sidecarImage in body should match"),
    # Kubernetes' quantity takes whole exponents only: the Deployment would be refused.
    ("memory-fractional-exponent", {**VALID, "engine": {"memory": "1e1.5"}},
     "spec.engine.memory in body should match"),
    # nvidia-smi's product name is not a label value (GPU Feature Discovery's is).
    ("node-selector-value-not-a-label",
     {**VALID, "gpu": {"type": "h100", "nodeSelector": {"nvidia.com/gpu.product":
                                                        "NVIDIA H100 80GB HBM3"}}},
     "in body should match"),
    ("path-is-a-flag",
     {**VALID, "model": {"preset": "llama-3.1-8b", "path": "--trust-remote-code"}},
     "spec.model.path in body should match"),
    ("served-name-is-a-flag",
     {**VALID, "model": {"preset": "llama-3.1-8b", "servedModelName": "--x"}},
     "spec.model.servedModelName in body should match"),
    ("api-key-secret-bad-name", {**VALID, "engine": {"apiKeySecret": {"name": "Bad_Name"}}},
     "spec.engine.apiKeySecret.name in body should match"),
    ("served-name-starts-with-tab",
     {**VALID, "model": {"preset": "llama-3.1-8b", "servedModelName": "\tchat"}},
     "spec.model.servedModelName in body should match"),
    ("node-selector-key-not-a-label",
     {**VALID, "gpu": {"type": "h100", "nodeSelector": {"nvidia.com/gpu product": "x"}}},
     NODE_SELECTOR_KEY_MESSAGE),
    ("node-selector-key-trailing-newline",
     {**VALID, "gpu": {"type": "h100", "nodeSelector": {"gpu\n": "h100"}}},
     NODE_SELECTOR_KEY_MESSAGE),
    ("node-selector-key-prefix-over-253",
     {**VALID, "gpu": {"type": "h100", "nodeSelector": {"a" + PREFIX_253 + "/g": "x"}}},
     NODE_SELECTOR_KEY_MESSAGE),
    ("node-selector-over-64",
     {**VALID, "gpu": {"type": "h100", "nodeSelector": {f"k{i}": "v" for i in range(65)}}},
     "must have at most 64 items"),
    ("parameter-count-over-1e15", {**VALID, "model": {**ARCH, "parameterCount": 10**15 + 1}},
     "spec.model.parameterCount in body should be less than or equal to"),
    ("sliding-window-over-1e8", {**VALID, "model": {**ARCH, "slidingWindow": 100_000_001}},
     "spec.model.slidingWindow in body should be less than or equal to 100000000"),
    # The sizing works in bytes: 1e-10 GiB rounded to none.
    ("memory-gib-tiny", {**VALID, "gpu": {"memoryGiB": 1e-10}},
     "spec.gpu.memoryGiB in body should be greater than or equal to 1"),
]  # fmt: skip

# (id, spec) both the API server and the operator's models accept.
ACCEPTED_CASES = [
    # The spaces NOT_A_FLAG refuses are spelled out: \s was Unicode to pydantic, ASCII without
    # \v to the API server.
    ("served-name-nbsp-path-vt",
     {**VALID, "model": {"preset": "llama-3.1-8b", "servedModelName": "\u00a0chat",
                         "path": "\vweights"}}),
    ("node-selector-64-keys-prefix-253",
     {**VALID, "gpu": {"type": "h100", "nodeSelector": {
         **{f"k{i}": "v" for i in range(63)}, PREFIX_253 + "/g": "x"}}}),
    ("bounds", {**VALID, "model": {**ARCH, "parameterCount": 10**15, "slidingWindow": 100_000_000},
                "gpu": {"memoryGiB": 1}, "scaling": {"forecastQuantile": 0.5}}),
    ("edges", {**VALID, "engine": {"memory": "1e18", "cpu": "5e-1", "sidecarImage": "",
                                   "apiKeySecret": {"name": "k", "key": ".a..b"}},
               "gpu": {"type": "h100", "resourceName": DOMAIN_244 + "/gpu"}}),
    ("stock-runtime-tp-replicates-kv-heads",
     {**VALID, "model": {**ARCH, "path": "/m"}, "gpu": {"type": "h100", "countPerPod": 4},
      "engine": {"runtime": "vllm"}}),
    # What the headroom engine loads; the same models under a stock runtime.
    ("headroom-engine-loads-qwen-in-fp16",
     {**VALID, "model": {"preset": "qwen2.5-7b", "weightDtype": "fp16", "path": "/m"}}),
    ("stock-runtime-loads-mla-moe-and-fp8",
     {**VALID, "model": {**ARCH, "kvLoraRank": 64, "qkRopeHeadDim": 16, "weightDtype": "int4",
                         "path": "/m"}, "engine": {"runtime": "sglang"}}),
    ("headroom-engine-runs-tiny-sized-as-deepseek", {**VALID, "model": {"preset": "deepseek-v3"}}),
    ("stock-runtime-loads-mixtral", {**VALID, "model": {"preset": "mixtral-8x7b", "path": "/m"},
                                     "engine": {"runtime": "vllm"}}),
    # The engine image shares the small one's prefix; it is not the small image.
    ("headroom-engine-image-by-digest",
     {**VALID, "engine": {"image": "ghcr.io/headroom-dev/headroom-engine@sha256:" + "0" * 64}}),
]  # fmt: skip


def manifest(name: str, spec: dict[str, Any]) -> str:
    # JSON, as a client sends it: PyYAML leaves "1e100" unquoted (a string in YAML 1.1), and
    # kubectl's YAML reads it as a number.
    return json.dumps(
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
    assert spec["scaling"]["mode"] == "auto" and spec["scaling"]["targetOccupancy"] == 0.85
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
    # The operator's own validation refuses the same object for the same reason; a rule about
    # what the engines run, when it sizes the object.
    if rule.in_model:
        with pytest.raises(ValueError, match=re.escape(rule.message)):
            InferenceDeploymentSpec.model_validate(copy.deepcopy(spec))
    else:
        parsed = InferenceDeploymentSpec.model_validate(copy.deepcopy(spec))
        assert not rule.check(parsed)
        with pytest.raises(SpecError):
            size(parsed)


def test_every_rule_has_a_case() -> None:
    covered = {id(r) for _, _, r in CEL_CASES}
    for model in (
        ModelSpec,
        GPUSpec,
        EngineSpec,
        ScalingSpec,
        InferenceDeploymentSpec,
        SecretKeySelector,
    ):
        for r in model.__rules__:
            assert id(r) in covered, f"{model.__name__}: no case for {r.message!r}"


@pytest.mark.parametrize(
    ("spec", "message"), [c[1:] for c in SCHEMA_CASES], ids=[c[0] for c in SCHEMA_CASES]
)
def test_schema_enums_and_ranges(
    crd: Cluster, cluster_namespace: str, spec: dict[str, Any], message: str
) -> None:
    proc = create(crd, cluster_namespace, "bad", spec, dry_run=True)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    # The pydantic models carry the same patterns and ranges.
    with pytest.raises(ValueError):
        InferenceDeploymentSpec.model_validate(copy.deepcopy(spec))


@pytest.mark.parametrize("spec", [c[1] for c in ACCEPTED_CASES], ids=[c[0] for c in ACCEPTED_CASES])
def test_what_the_api_server_accepts_the_operator_accepts(
    crd: Cluster, cluster_namespace: str, spec: dict[str, Any]
) -> None:
    proc = create(crd, cluster_namespace, "fine", spec, dry_run=True)
    assert proc.returncode == 0, proc.stderr
    parsed = InferenceDeploymentSpec.model_validate(copy.deepcopy(spec))
    size(parsed)  # nor does the sizing refuse it


@pytest.mark.parametrize("name", ["a.b", "x" * 70, "7b-chat"])
def test_names_the_children_cannot_take_are_refused(
    crd: Cluster, cluster_namespace: str, name: str
) -> None:
    proc = create(crd, cluster_namespace, name, VALID, dry_run=True)
    assert proc.returncode != 0 and NAME_RULE.message in proc.stderr, proc.stderr
    assert name_error(name) == NAME_RULE.message


def test_names_the_children_can_take_are_accepted(crd: Cluster, cluster_namespace: str) -> None:
    for name in ("a" * 63, "llama-8b"):
        proc = create(crd, cluster_namespace, name, VALID, dry_run=True)
        assert proc.returncode == 0, proc.stderr
        assert name_error(name) is None


def test_quantities_as_numbers_and_strings_are_accepted(
    crd: Cluster, cluster_namespace: str
) -> None:
    spec = {**VALID, "engine": {"cpu": 4, "memory": "1.5Ti"}}
    proc = create(crd, cluster_namespace, "quantities", spec)
    assert proc.returncode == 0, proc.stderr
    stored = crd.get("infd", "quantities", namespace=cluster_namespace)["spec"]
    assert isinstance(stored, dict)
    assert stored["engine"]["cpu"] == 4 and stored["engine"]["memory"] == "1.5Ti"
    engine = InferenceDeploymentSpec.model_validate(stored).engine
    assert (engine.cpu, engine.memory) == ("4", "1.5Ti")


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


def test_an_object_stored_before_the_name_rule_takes_status_and_loses_its_finalizer(
    crd: Cluster, cluster_namespace: str
) -> None:
    """The name rule sits at the root, which every write changes (status, finalizers): checked
    at each, an object stored before the rule (the operator reports it InvalidName) could get
    no status, and once deleted it stayed Terminating. It is checked on create only."""
    from headroom.operator.kube import Kube, load_configuration
    from headroom.operator.reconcile.children import Owner

    old = yaml.safe_load(crd_yaml())
    del old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    name, ns = "legacy.name", cluster_namespace
    try:
        crd.apply([old])
        deadline = time.monotonic() + 30
        # Until the API server has the rule-free schema (it serves the old one a moment longer).
        while (proc := create(crd, ns, name, VALID)).returncode != 0:
            assert time.monotonic() < deadline, proc.stderr
            time.sleep(0.5)
        crd.apply(crd_yaml())
        deadline = time.monotonic() + 30
        while create(crd, ns, "another.name", VALID, dry_run=True).returncode == 0:
            assert time.monotonic() < deadline, "the rule never came back"
            time.sleep(0.5)
        kube = Kube(load_configuration(str(crd.kubeconfig)))
        cond = {"type": "Ready", "status": "False", "reason": "InvalidName", "message": "x",
                "lastTransitionTime": "2026-12-05T00:00:00Z"}  # fmt: skip
        kube.apply_status(Owner(name, ns, ""), {"conditions": [cond]}, field_manager="t")
        stored = crd.get("infd", name, namespace=ns)
        assert stored["status"]["conditions"][0]["reason"] == "InvalidName"  # type: ignore[index]
        patch = json.dumps({"metadata": {"finalizers": ["headroom.dev/finalizer"]}})
        crd.kubectl("patch", "infd", name, "-n", ns, "--type=merge", "-p", patch)
        crd.kubectl("delete", "infd", name, "-n", ns, "--wait=false")
        crd.kubectl("patch", "infd", name, "-n", ns, "--type=merge",
                    "-p", '{"metadata":{"finalizers":null}}')  # fmt: skip
        crd.kubectl("wait", "--for=delete", f"infd/{name}", "-n", ns, "--timeout=30s")
    finally:
        crd.apply(crd_yaml())
        crd.kubectl("patch", "infd", name, "-n", ns, "--type=merge",
                    "-p", '{"metadata":{"finalizers":null}}', check=False)  # fmt: skip
        crd.kubectl("delete", "infd", name, "-n", ns, "--ignore-not-found", check=False)


def test_an_upgraded_crd_applies_over_the_old_one_and_ratchets_its_new_rules(
    crd: Cluster, cluster_namespace: str
) -> None:
    """What the README tells a user upgrading: the new CRD applied server-side over the one an
    older release installed, and an object stored before a new pattern still takes updates that
    leave that field alone (validation ratcheting); changing the field checks it."""
    old = yaml.safe_load(crd_yaml())
    scaling = old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["scaling"]["properties"]
    del scaling["prometheusURL"]["pattern"]  # the CRD before the pattern
    name, ns = "ratcheted", cluster_namespace
    bent = "http://admin.internal:8080/flush?x="
    try:
        crd.apply([old])
        deadline = time.monotonic() + 30
        spec = {**VALID, "scaling": {"metricsSource": "prometheus", "prometheusURL": bent}}
        while (proc := create(crd, ns, name, spec)).returncode != 0:
            assert time.monotonic() < deadline, proc.stderr
            time.sleep(0.5)
        new = crd.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                          input=crd_yaml())  # fmt: skip
        assert "serverside-applied" in new.stdout, new.stdout + new.stderr
        deadline = time.monotonic() + 30
        while create(crd, ns, "another", spec, dry_run=True).returncode == 0:
            assert time.monotonic() < deadline, "the pattern never came"
            time.sleep(0.5)
        grow = json.dumps({"spec": {"scaling": {"maxReplicas": 7}}})
        assert crd.kubectl("patch", "infd", name, "-n", ns, "--type=merge", "-p", grow,
                           check=False).returncode == 0  # fmt: skip
        other = json.dumps({"spec": {"scaling": {"prometheusURL": bent + "y"}}})
        refused = crd.kubectl("patch", "infd", name, "-n", ns, "--type=merge", "-p", other,
                              check=False)  # fmt: skip
        assert refused.returncode != 0 and "prometheusURL" in refused.stderr, refused.stderr
    finally:
        crd.apply(crd_yaml())
        crd.kubectl("delete", "infd", name, "-n", ns, "--ignore-not-found", check=False)


def test_a_status_apply_read_at_a_stale_version_is_refused(
    crd: Cluster, cluster_namespace: str
) -> None:
    """The watch's readiness write carries the resourceVersion it read: a reconcile or a tick
    that wrote in between must win, not be overwritten from an older read."""
    from headroom.operator.kube import Kube, KubeError, load_configuration, owner_of

    ns = cluster_namespace
    crd.apply([{"apiVersion": "headroom.dev/v1alpha1", "kind": "InferenceDeployment",
                "metadata": {"name": "stale", "namespace": ns}, "spec": BASE}])  # fmt: skip
    kube = Kube(load_configuration(str(crd.kubeconfig)))
    body = kube.get("headroom.dev/v1alpha1", "InferenceDeployment", ns, "stale")
    assert body is not None
    version = body["metadata"]["resourceVersion"]
    kube.apply_status(owner_of(body), {"replicas": 1}, field_manager="first",
                      resource_version=version)  # fmt: skip
    with pytest.raises(KubeError) as refused:
        kube.apply_status(owner_of(body), {"replicas": 2}, field_manager="second",
                          resource_version=version)  # fmt: skip
    assert refused.value.status == 409
    after = kube.get("headroom.dev/v1alpha1", "InferenceDeployment", ns, "stale")
    assert after is not None and after["status"]["replicas"] == 1
