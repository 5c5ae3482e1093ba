"""Spec models: defaults, camelCase wire form, and every cross-field rule with its message."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from headroom.operator.crd.models import InferenceDeploymentSpec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

VALID: dict[str, Any] = {
    "model": {"preset": "llama-3.1-8b"},
    "gpu": {"type": "h100-80gb"},
    "traffic": {"peakConcurrency": 200, "contextTokens": 4096},
}
CUSTOM_ARCH = {
    "numLayers": 2,
    "numAttentionHeads": 4,
    "numKVHeads": 2,
    "headDim": 16,
    "hiddenSize": 64,
    "vocabSize": 256,
    "parameterCount": 100_000,
}


def with_(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = copy.deepcopy(base or VALID)
    *parents, leaf = path.split(".")
    node = spec
    for p in parents:
        node = node.setdefault(p, {})
    if value is None:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return spec


INVALID = [
    ("neither-preset-nor-arch", with_("model.preset", None), "either a preset or all of"),
    ("preset-and-arch", with_("model.numLayers", 32), "preset already fixes the architecture"),
    ("heads-not-multiple", {**VALID, "model": {**CUSTOM_ARCH, "numKVHeads": 3}},
     "multiple of model.numKVHeads"),
    ("mla-half", {**VALID, "model": {**CUSTOM_ARCH, "kvLoraRank": 64}}, "both model.kvLoraRank"),
    ("indexer-without-mla", {**VALID, "model": {**CUSTOM_ARCH, "indexHeadDim": 128}},
     "needs model.kvLoraRank"),
    ("preset-and-indexer", with_("model.indexHeadDim", 128), "preset already fixes"),
    ("sliding-without-window", {**VALID, "model": {**CUSTOM_ARCH, "numSlidingWindowLayers": 1}},
     "needs model.slidingWindow"),
    ("gpu-without-type-or-memory", with_("gpu.type", None), "type preset"),
    ("tp-does-not-divide", with_("gpu", {"type": "h100", "countPerPod": 4, "tensorParallel": 3}),
     "must divide gpu.countPerPod"),
    ("headroom-engine-several-gpus", with_("gpu", {"type": "h100", "countPerPod": 2}),
     "the headroom engine runs on one GPU"),
    ("min-above-max", with_("scaling", {"minReplicas": 5, "maxReplicas": 3}),
     "minReplicas must not exceed"),
    ("target-not-below-scale-out", with_("scaling", {"targetOccupancy": 0.96}),
     "must be below scaling.scaleOutOccupancy"),
    ("scale-out-above-one", with_("scaling", {"scaleOutOccupancy": 1.2}), "less than or equal"),
    ("hysteresis-too-big", with_("scaling", {"targetOccupancy": 0.3, "scaleInHysteresis": 0.4}),
     "smaller than scaling.targetOccupancy"),
    # Strict: a target at the scale-out line leaves no room below it, and a hysteresis equal to
    # the target makes the scale-in line zero.
    ("target-equals-scale-out", with_("scaling", {"targetOccupancy": 0.95}),
     "must be below scaling.scaleOutOccupancy"),
    ("hysteresis-equals-target",
     with_("scaling", {"targetOccupancy": 0.3, "scaleInHysteresis": 0.3}),
     "smaller than scaling.targetOccupancy"),
    ("max-model-len-below-context", with_("engine", {"maxModelLen": 1024}),
     "at least traffic.contextTokens"),
    ("unknown-preset", with_("model.preset", "llama-9"), "unknown model"),
    ("unknown-gpu", with_("gpu.type", "h100-90gb"), "unknown GPU 'h100-90gb'"),
    ("unknown-field", with_("engine.blokSize", 16), "Extra inputs"),
    ("bad-kv-dtype", with_("engine.kvCacheDtype", "fp4"), "auto"),
    ("zero-concurrency", with_("traffic.peakConcurrency", 0), "greater than or equal to 1"),
    ("node-selector-key", with_("gpu", {"type": "h100", "nodeSelector": {"gpu type": "h100"}}),
     "key 'gpu type' is not a label key"),
    ("node-selector-value", with_("gpu", {"type": "h100", "nodeSelector": {"a/b": "x y"}}),
     "should match pattern"),
    ("quantity-exponent", with_("engine.memory", "1e1.5"), "should match pattern"),
    ("unknown-runtime", with_("engine.runtime", "tgi"), "'headroom', 'vllm' or 'sglang'"),
    ("vllm-int8-kv", with_("engine", {"runtime": "vllm", "kvCacheDtype": "int8"}),
     "runtime vllm accepts auto or fp8"),
    ("sglang-int8-kv", with_("engine", {"runtime": "sglang", "kvCacheDtype": "int8"}),
     "runtime sglang accepts auto or fp8"),
    ("vllm-attention-backend", with_("engine", {"runtime": "vllm", "attentionBackend": "torch"}),
     "attentionBackend is the headroom engine's own"),
    ("sglang-attention-backend",
     with_("engine", {"runtime": "sglang", "attentionBackend": "cuda"}),
     "attentionBackend is the headroom engine's own"),
    ("vllm-whole-gpu", with_("engine", {"runtime": "vllm", "gpuMemoryUtilization": 1.0}),
     "runtime vllm needs engine.gpuMemoryUtilization below 1.0"),
    ("vllm-block-size", with_("engine", {"runtime": "vllm", "blockSize": 24}),
     "runtime vllm takes engine.blockSize 16, 32, 64 or 128"),
    # vLLM 0.11's attention backends raise "Block size must be a multiple of 16" on SM 8.0+.
    ("vllm-block-size-1", with_("engine", {"runtime": "vllm", "blockSize": 1}),
     "runtime vllm takes engine.blockSize 16, 32, 64 or 128"),
    ("vllm-block-size-8", with_("engine", {"runtime": "vllm", "blockSize": 8}),
     "runtime vllm takes engine.blockSize 16, 32, 64 or 128"),
    ("vllm-batched-below-seqs",
     with_("engine", {"runtime": "vllm", "maxNumBatchedTokens": 256, "maxNumSeqs": 512}),
     "runtime vllm needs engine.maxNumBatchedTokens"),
    ("sglang-chunk-not-page-multiple", with_("engine", {"runtime": "sglang", "blockSize": 48}),
     "runtime sglang needs engine.maxNumBatchedTokens"),
    ("sglang-chunk-1000-page-64",
     with_("engine", {"runtime": "sglang", "blockSize": 64, "maxNumBatchedTokens": 1000}),
     "runtime sglang needs engine.maxNumBatchedTokens"),
    ("memory-not-a-quantity", with_("engine.memory", "lots"), "should match pattern"),
    ("cpu-not-a-quantity", with_("engine.cpu", "four"), "should match pattern"),
    ("memory-negative", with_("engine.memory", "-1Gi"), "should match pattern"),
    ("memory-negative-number", with_("engine.memory", -5), "should match pattern"),
    # The CRD's maxLength for a quantity is 32, and the model's must be the same.
    ("memory-over-32-characters", with_("engine.memory", "1" * 33), "at most 32 characters"),
    ("gpu-resource-memory", with_("gpu.resourceName", "memory"),
     "gpu.resourceName must be an extended resource"),
    ("gpu-resource-cpu", with_("gpu.resourceName", "cpu"),
     "gpu.resourceName must be an extended resource"),
    ("gpu-resource-hugepages", with_("gpu.resourceName", "hugepages-2Mi"),
     "gpu.resourceName must be an extended resource"),
    ("gpu-resource-kubernetes-io", with_("gpu.resourceName", "kubernetes.io/gpu"),
     "gpu.resourceName must be an extended resource"),
    ("gpu-resource-subdomain-kubernetes-io",
     with_("gpu.resourceName", "node.kubernetes.io/gpu"),
     "gpu.resourceName must be an extended resource"),
    ("path-is-a-flag", with_("model.path", "--trust-remote-code"), "should match pattern"),
    ("served-name-is-a-flag", with_("model.servedModelName", "-x"), "should match pattern"),
    ("api-key-secret-without-name", with_("engine.apiKeySecret", {"key": "k"}), "name"),
    ("api-key-secret-bad-name", with_("engine.apiKeySecret", {"name": "Bad_Name"}),
     "should match pattern"),
    ("vllm-headroom-image",
     with_("engine", {"runtime": "vllm", "image": "ghcr.io/headroom-dev/headroom:0.2.0"}),
     "have no vLLM or SGLang server"),
    # The small image (operator and sidecar) has no torch: the headroom engine cannot run in it.
    ("headroom-small-image", with_("engine.image", "ghcr.io/headroom-dev/headroom:0.1.0"),
     "is the small image"),
    # By digest or bare, it is the same image.
    ("headroom-small-image-digest",
     with_("engine.image", "ghcr.io/headroom-dev/headroom@sha256:" + "0" * 64),
     "is the small image"),
    ("headroom-small-image-bare", with_("engine.image", "ghcr.io/headroom-dev/headroom"),
     "is the small image"),
    ("sliding-layers-over-num-layers",
     {**VALID, "model": {**CUSTOM_ARCH, "slidingWindow": 4096, "numSlidingWindowLayers": 3}},
     "cannot exceed model.numLayers"),
    # The Deployment's secretKeyRef refuses these keys, so nothing would deploy.
    ("api-key-secret-key-dot", with_("engine.apiKeySecret", {"name": "keys", "key": "."}),
     "must not be '.' or start with '..'"),
    ("api-key-secret-key-dotdot",
     with_("engine.apiKeySecret", {"name": "keys", "key": "..data"}),
     "must not be '.' or start with '..'"),
    # int-or-string: the API server refuses a fractional number, so the model does too.
    ("cpu-fractional-number", with_("engine.cpu", 1.5), "valid string"),
]  # fmt: skip


def test_minimal_spec_gets_defaults() -> None:
    spec = InferenceDeploymentSpec.model_validate(VALID)
    assert spec.engine.block_size == 16 and spec.engine.kv_cache_dtype == "auto"
    assert spec.scaling.mode == "auto" and spec.scaling.min_replicas == 1
    assert spec.gpu.count_per_pod == 1 and spec.replicas is None


def test_wire_form_is_camel_case_and_round_trips() -> None:
    spec = InferenceDeploymentSpec.model_validate(
        with_(
            "gpu",
            {"type": "h100", "memoryGiB": 79.6, "countPerPod": 2, "tensorParallel": 2},
            with_("engine.runtime", "vllm"),
        )
    )
    wire = spec.wire()
    assert wire["gpu"]["memoryGiB"] == 79.6 and wire["gpu"]["tensorParallel"] == 2
    assert "scaleOutOccupancy" in wire["scaling"] and "preset" in wire["model"]
    assert "numKVHeads" not in wire["model"]  # unset optionals are left out
    assert InferenceDeploymentSpec.model_validate(wire) == spec


def test_custom_architecture_is_valid() -> None:
    spec = InferenceDeploymentSpec.model_validate({**VALID, "model": CUSTOM_ARCH})
    assert spec.model.num_kv_heads == 2


@pytest.mark.parametrize(("raw", "message"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_spec_is_refused_with_a_message(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        InferenceDeploymentSpec.model_validate(raw)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_are_valid_and_feasible(path: Path) -> None:
    from headroom.operator.reconcile.sizing import size

    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "headroom.dev/v1alpha1" and doc["kind"] == "InferenceDeployment"
    spec = InferenceDeploymentSpec.model_validate(doc["spec"])
    sizing = size(spec)
    assert sizing.feasible, sizing.reason
    assert spec.model.preset is not None


def test_the_three_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"llama-3.1-8b-h100.yaml", "llama-3.1-70b-tp4.yaml", "llama-3.1-8b-fp8kv.yaml"} <= names


@pytest.mark.parametrize(
    "engine",
    [
        {"runtime": "vllm", "kvCacheDtype": "fp8", "blockSize": 32},
        # SGLang pages any size, with a chunked prefill a whole number of pages (24 x 341).
        {"runtime": "sglang", "kvCacheDtype": "fp8", "blockSize": 24, "maxNumBatchedTokens": 8184},
        {"runtime": "sglang", "image": "lmsysorg/sglang:v0.5.4"},
        {"runtime": "headroom", "kvCacheDtype": "int8", "attentionBackend": "cuda"},
        {"runtime": "vllm", "maxNumBatchedTokens": 256, "maxNumSeqs": 256},
        {"runtime": "headroom", "maxNumBatchedTokens": 64, "maxNumSeqs": 256, "blockSize": 8},
        {"runtime": "headroom", "image": "ghcr.io/headroom-dev/headroom-engine:0.2.0"},
    ],
    ids=[
        "vllm-fp8",
        "sglang-any-page",
        "sglang-own-image",
        "headroom-int8",
        "vllm-batched-equal-seqs",
        "headroom-any-batch",
        "headroom-engine-image",
    ],
)
def test_runtime_accepts_what_it_runs(engine: dict[str, Any]) -> None:
    spec = InferenceDeploymentSpec.model_validate(with_("engine", engine))
    assert spec.engine.runtime == engine["runtime"]


def test_runtime_defaults_to_headroom_and_image_to_the_runtimes() -> None:
    spec = InferenceDeploymentSpec.model_validate(VALID)
    assert spec.engine.runtime == "headroom" and spec.engine.image is None
    assert spec.engine.startup_timeout_seconds == 900


@pytest.mark.parametrize(
    ("field", "value", "wire"),
    [
        ("memory", "32Gi", "32Gi"), ("memory", "1.5Ti", "1.5Ti"), ("memory", "4e9", "4e9"),
        ("memory", "512M", "512M"), ("cpu", "500m", "500m"), ("cpu", 4, "4"), ("cpu", "2.5", "2.5"),
        ("memory", "1" * 32, "1" * 32),
    ],
)  # fmt: skip
def test_cpu_and_memory_take_kubernetes_quantities(field: str, value: Any, wire: str) -> None:
    spec = InferenceDeploymentSpec.model_validate(with_(f"engine.{field}", value))
    # An integer (YAML `cpu: 4`) is the quantity it spells; the pod gets it as a string.
    assert getattr(spec.engine, field) == wire and spec.wire()["engine"][field] == wire


@pytest.mark.parametrize("name", ["nvidia.com/gpu", "amd.com/gpu", "gpu.intel.com/i915"])
def test_extended_gpu_resources_are_accepted(name: str) -> None:
    spec = InferenceDeploymentSpec.model_validate(with_("gpu.resourceName", name))
    assert spec.gpu.resource_name == name


@pytest.mark.parametrize(
    "path", ["/models/llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "tiny", "/w/a-b c"]
)
def test_model_paths_and_names_that_are_not_flags_are_accepted(path: str) -> None:
    spec = InferenceDeploymentSpec.model_validate(
        with_("model", {"preset": "llama-3.1-8b", "path": path, "servedModelName": "chat-8b"})
    )
    assert spec.model.path == path


def test_api_key_secret_names_a_secret_and_defaults_its_key() -> None:
    spec = InferenceDeploymentSpec.model_validate(with_("engine.apiKeySecret", {"name": "keys"}))
    assert spec.engine.api_key_secret is not None
    assert (spec.engine.api_key_secret.name, spec.engine.api_key_secret.key) == ("keys", "api-key")
    assert spec.wire()["engine"]["apiKeySecret"] == {"name": "keys", "key": "api-key"}
    assert InferenceDeploymentSpec.model_validate(VALID).engine.api_key_secret is None


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("chat", True), ("llama-8b", True), ("a" * 63, True), ("a.b", False), ("a" * 64, False),
        ("x" * 70, False), ("7b-chat", False), ("Chat", False), ("chat-", False), ("", False),
    ],
)  # fmt: skip
def test_resource_names_the_children_can_take(name: str, ok: bool) -> None:
    from headroom.operator.crd.models import NAME_RULE, name_error

    assert (name_error(name) is None) is ok
    if not ok:
        assert name_error(name) == NAME_RULE.message
        assert "metadata.name" in NAME_RULE.message


def test_the_operator_uses_the_contracts_kv_cache_dtype() -> None:
    from typing import get_args

    from headroom.contract.budget import KVCacheDtype
    from headroom.operator.crd import models

    # One name, one meaning: KVCacheDtype is the budget's stored KV element type; the CRD's
    # knob is "auto" or one of those.
    assert models.KVCacheDtype is KVCacheDtype
    choices = set(get_args(models.KVCacheSetting))
    assert "auto" in choices and choices - {"auto"} <= set(get_args(KVCacheDtype))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_put_their_pods_on_their_gpu_type(path: Path) -> None:
    # gpu.type does not steer scheduling (its CRD description says so): the examples show how.
    spec = InferenceDeploymentSpec.model_validate(yaml.safe_load(path.read_text())["spec"])
    assert spec.gpu.type == "h100-80gb"
    assert spec.gpu.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("http://prometheus-operated.monitoring:9090", True),
        ("https://prom.example.com/prometheus/", True),
        ("http://[fd00::1]:9090", True),
        ("http://internal-admin:8080/flush?confirm=yes&x=", False),  # a query bends the path
        ("http://prom:9090/#", False),
        ("http://user:pass@prom:9090", False),
        ("prom:9090", False),
        ("file:///etc/passwd", False),
    ],
)
def test_a_prometheus_url_is_a_base_url_and_nothing_more(url: str, ok: bool) -> None:
    raw = with_("scaling.prometheusURL", url)
    if ok:
        assert InferenceDeploymentSpec.model_validate(raw).scaling.prometheus_url == url
    else:
        with pytest.raises(ValidationError, match="prometheusURL"):
            InferenceDeploymentSpec.model_validate(raw)


def test_sliding_window_layers_may_be_every_layer() -> None:
    """numSlidingWindowLayers equal to numLayers is valid (Mistral-style: every layer slides)."""
    model = {**CUSTOM_ARCH, "slidingWindow": 4096, "numSlidingWindowLayers": 2}
    spec = InferenceDeploymentSpec.model_validate({**VALID, "model": model})
    assert spec.model.num_sliding_window_layers == spec.model.num_layers == 2


@pytest.mark.parametrize("key", ["api-key", ".env", "a..b", "token.txt"])
def test_api_key_secret_keys_with_dots_inside_are_accepted(key: str) -> None:
    """Only '.' and a leading '..' are refused: other dotted keys are valid Secret keys."""
    raw = with_("engine.apiKeySecret", {"name": "keys", "key": key})
    spec = InferenceDeploymentSpec.model_validate(raw)
    assert spec.engine.api_key_secret is not None and spec.engine.api_key_secret.key == key


def test_min_replicas_may_equal_max_replicas() -> None:
    """A fixed size (minReplicas == maxReplicas) is valid: the rule is min <= max, not min < max."""
    spec = InferenceDeploymentSpec.model_validate(
        with_("scaling", {"minReplicas": 3, "maxReplicas": 3})
    )
    assert spec.scaling.min_replicas == spec.scaling.max_replicas == 3
