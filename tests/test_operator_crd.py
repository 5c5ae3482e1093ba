"""The CRD: generated from the pydantic models, structural, and committed as generated."""

from __future__ import annotations

import io
import re
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from headroom.operator.__main__ import main as operator_main
from headroom.operator.crd.models import (
    MAX_NODE_SELECTOR,
    NAME_RULE,
    NODE_SELECTOR_KEY_RULE,
    QUANTITY_PATTERN,
    EngineSpec,
    GPUSpec,
    InferenceDeploymentSpec,
    KVStatus,
    ModelSpec,
    ScalingSpec,
    TrafficSpec,
    name_error,
)
from headroom.operator.crd.rules import Rule
from headroom.operator.crd.schema import crd, crd_yaml, spec_schema, status_schema
from headroom.operator.reconcile.sizing import SpecError, size

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "crds" / "inferencedeployment.yaml"


def walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path or ".", node)]
    for name, sub in node.get("properties", {}).items():
        out += walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_committed_crd_matches_generated() -> None:
    assert COMMITTED.read_text() == crd_yaml(), (
        "crds/inferencedeployment.yaml is out of date with headroom.operator.crd.models: "
        "run `make crd`"
    )


def test_headroom_crd_prints_the_same_yaml() -> None:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert operator_main(["crd"]) == 0
    assert buf.getvalue() == crd_yaml()
    assert yaml.safe_load(buf.getvalue()) == crd()


@pytest.mark.parametrize("schema", [spec_schema(), status_schema()], ids=["spec", "status"])
def test_schema_is_structural(schema: dict[str, Any]) -> None:
    for path, node in walk(schema):
        if node.get("x-kubernetes-int-or-string"):
            # The one union a structural schema allows, exactly in this form.
            assert "type" not in node, path
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            node = {k: v for k, v in node.items() if k != "anyOf"}
        else:
            assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        for banned in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "title", "const"):
            assert banned not in node, f"{path} has {banned}"
        assert node.get("additionalProperties", {}) is not False, path
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if key in node:
                assert isinstance(node[key], bool), f"{path}.{key} must be boolean in OpenAPI v3"
        if node.get("type") == "array":
            assert "items" in node, path
        assert "default" not in node or node["default"] is not None, path


def _defaults(schema: dict[str, Any]) -> dict[str, Any]:
    return {name: sub["default"] for name, sub in schema["properties"].items() if "default" in sub}


@pytest.mark.parametrize("section", ["engine", "scaling", "gpu", "traffic", "model"])
def test_schema_defaults_equal_pydantic_defaults(section: str) -> None:
    model = {
        "engine": EngineSpec,
        "scaling": ScalingSpec,
        "gpu": GPUSpec,
        "traffic": TrafficSpec,
        "model": ModelSpec,
    }[section]
    schema = spec_schema()["properties"][section]
    for alias, default in _defaults(schema).items():
        field = next(f for f in model.model_fields.values() if f.alias == alias)
        assert field.default == default, f"{section}.{alias}"


def test_omitted_sections_get_defaults_from_the_api_server() -> None:
    props = spec_schema()["properties"]
    assert props["engine"]["default"] == EngineSpec().wire()
    assert props["scaling"]["default"] == ScalingSpec().wire()
    assert props["scaling"]["default"]["minReplicas"] == 1
    assert set(spec_schema()["required"]) == {"model", "gpu", "traffic"}


def test_every_python_rule_is_a_cel_rule_with_its_message() -> None:
    schema = spec_schema()
    by_section = {
        "model": ModelSpec,
        "engine": EngineSpec,
        "gpu": GPUSpec,
        "scaling": ScalingSpec,
    }
    for section, model in by_section.items():
        cel = schema["properties"][section]["x-kubernetes-validations"]
        assert [(c["rule"], c["message"]) for c in cel] == [
            (r.cel, r.message) for r in model.__rules__
        ]
    top = schema["x-kubernetes-validations"]
    assert [c["rule"] for c in top] == [r.cel for r in InferenceDeploymentSpec.__rules__]
    root = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert root["x-kubernetes-validations"] == [
        {"rule": f"oldSelf.hasValue() || ({NAME_RULE.cel})", "optionalOldSelf": True,
         "message": NAME_RULE.message}
    ]  # fmt: skip


@pytest.mark.parametrize("field", ["cpu", "memory"])
def test_cpu_and_memory_are_quantities_in_the_crd(field: str) -> None:
    node = spec_schema()["properties"]["engine"]["properties"][field]
    assert node["x-kubernetes-int-or-string"] is True
    assert node["pattern"] == QUANTITY_PATTERN and node["minimum"] == 0


def test_gpu_type_says_it_does_not_steer_scheduling() -> None:
    gpu = spec_schema()["properties"]["gpu"]["properties"]
    assert "does not steer scheduling" in gpu["type"]["description"]
    assert "gpu.nodeSelector" in gpu["type"]["description"]
    assert "gpu.type" in gpu["nodeSelector"]["description"]


def test_names_subresources_and_columns() -> None:
    spec = crd()["spec"]
    assert spec["group"] == "headroom.dev" and spec["scope"] == "Namespaced"
    assert spec["names"]["shortNames"] == ["infd"] and spec["names"]["categories"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["storage"] and version["served"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Replicas", "Desired", "KV %", "Hit %", "ETA", "Age"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for column in version["additionalPrinterColumns"]:
        parts = column["jsonPath"].split(".")
        if parts[1] == "status" and "[" not in column["jsonPath"]:
            node = status[parts[2].split("[")[0]]
            for part in parts[3:]:
                node = node["properties"][part]
    conditions = status["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert status["kopf"]["x-kubernetes-preserve-unknown-fields"] is True


def test_presets_and_enums_come_from_the_budget_model() -> None:
    from headroom.contract.budget import GPU_PRESETS, MODEL_PRESETS

    props = spec_schema()["properties"]
    assert set(props["model"]["properties"]["preset"]["enum"]) == set(MODEL_PRESETS)
    assert set(GPU_PRESETS) <= set(props["gpu"]["properties"]["type"]["enum"])
    assert props["engine"]["properties"]["kvCacheDtype"]["enum"] == ["auto", "fp8", "int8"]
    assert props["scaling"]["properties"]["mode"]["enum"] == ["auto", "advisory"]
    scale_out = props["scaling"]["properties"]["scaleOutOccupancy"]
    assert scale_out["maximum"] == 1.0 and "exclusiveMaximum" not in scale_out


def _numbers(schema: dict[str, Any]) -> list[tuple[str, str, float]]:
    return [
        (path, key, node[key])
        for path, node in walk(schema)
        for key in ("minimum", "maximum")
        if key in node
    ]


def test_every_numeric_bound_is_whole() -> None:
    # The API server checks an integer against int64(bound): `minimum: 0.5` let 0 through. A
    # fractional bound is a CEL rule (scaling.forecastQuantile's).
    for path, key, bound in _numbers(spec_schema()):
        assert float(bound).is_integer(), f"{path}.{key} {bound} is fractional"


def test_patterns_use_no_class_the_two_regex_engines_read_differently() -> None:
    # The API server's Go RE2 reads \s, \d, \w and \b as ASCII, pydantic's Rust regex as Unicode.
    text = crd_yaml()
    for escape in ("\\s", "\\S", "\\d", "\\D", "\\w", "\\W", "\\b", "\\B"):
        assert escape not in text, escape


# ModelSpec's architecture fields and the budget's ModelArch, whose bounds they must not exceed.
ARCH_FIELDS = {
    "num_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "num_kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "parameter_count": "num_parameters",
    "kv_lora_rank": "kv_lora_rank",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "index_head_dim": "indexer_head_dim",
    "sliding_window": "sliding_window",
    "num_sliding_window_layers": "num_sliding_window_layers",
}


@pytest.mark.parametrize(("field", "arch_field"), ARCH_FIELDS.items(), ids=list(ARCH_FIELDS))
def test_architecture_bounds_are_the_budget_models(field: str, arch_field: str) -> None:
    from headroom.contract.budget.arch import ModelArch

    def bounds(info: Any) -> dict[str, Any]:
        return {k: getattr(m, k) for m in info.metadata for k in ("ge", "le") if hasattr(m, k)}

    assert bounds(ModelSpec.model_fields[field]) == bounds(ModelArch.model_fields[arch_field])


BASE: dict[str, Any] = {
    "model": {"preset": "llama-3.1-8b"},
    "gpu": {"type": "h100-80gb"},
    "traffic": {"peakConcurrency": 64, "contextTokens": 4096},
}
ARCH = {
    "numLayers": 2, "numAttentionHeads": 4, "numKVHeads": 2, "headDim": 16, "hiddenSize": 64,
    "vocabSize": 256, "parameterCount": 100_000,
}  # fmt: skip

PREFIX_253 = "a" * 61 + "." + ".".join(["b" * 63] * 3)  # a DNS subdomain, the longest
assert len(PREFIX_253) == 253
# The longest domain an extended resource name can have (`requests.` + it is a qualified name).
DOMAIN_244 = ".".join(["a" * 61] + ["b" * 60] * 3)
assert len(DOMAIN_244) == 244

# (id, spec, what the error says) the operator's models refuse; the API server refuses them too
# (tests/test_operator_cluster_crd.py).
MODEL_REFUSES = [
    # Python's `$` matches before a final newline; the API server's does not.
    ("node-selector-key-trailing-newline",
     {**BASE, "gpu": {"type": "h100", "nodeSelector": {"gpu\n": "h100"}}}, "not a label key"),
    ("node-selector-key-prefix-over-253",
     {**BASE, "gpu": {"type": "h100", "nodeSelector": {"a" + PREFIX_253 + "/g": "x"}}},
     "not a label key"),
    ("node-selector-over-64",
     {**BASE, "gpu": {"type": "h100", "nodeSelector": {f"k{i}": "v" for i in range(65)}}},
     "at most 64 items"),
    ("gpu-resource-trailing-newline",
     {**BASE, "gpu": {"type": "h100", "resourceName": "nvidia.com/gpu\n"}}, "extended resource"),
    ("gpu-resource-domain-over-244",
     {**BASE, "gpu": {"type": "h100", "resourceName": DOMAIN_244 + "a/gpu"}}, "extended resource"),
    ("parameter-count-over-1e15", {**BASE, "model": {**ARCH, "parameterCount": 10**15 + 1}},
     "less than or equal to 1000000000000000"),
    ("sliding-window-over-1e8", {**BASE, "model": {**ARCH, "slidingWindow": 100_000_001}},
     "less than or equal to 100000000"),
    # Rounded to 0 bytes of GPU memory.
    ("memory-gib-tiny", {**BASE, "gpu": {"memoryGiB": 1e-10}}, "greater than or equal to 1"),
    ("memory-gib-below-one", {**BASE, "gpu": {"memoryGiB": 0.5}}, "greater than or equal to 1"),
    ("forecast-quantile-zero", {**BASE, "scaling": {"forecastQuantile": 0}},
     "forecastQuantile must be at least 0.5"),
    ("forecast-quantile-below-half", {**BASE, "scaling": {"forecastQuantile": 0.49}},
     "forecastQuantile must be at least 0.5"),
    ("served-name-starts-with-tab",
     {**BASE, "model": {"preset": "llama-3.1-8b", "servedModelName": "\tchat"}},
     "should match pattern"),
]  # fmt: skip

# (id, spec) both accept: the same explicit space class on both sides (Go's \s has neither \v
# nor the Unicode spaces), and the bounds themselves.
MODEL_ACCEPTS = [
    ("served-name-nbsp-and-path-vt",
     {**BASE, "model": {"preset": "llama-3.1-8b", "servedModelName": "\u00a0chat",
                        "path": "\vweights"}}),
    ("node-selector-64-keys-prefix-253",
     {**BASE, "gpu": {"type": "h100", "nodeSelector": {
         **{f"k{i}": "v" for i in range(63)}, PREFIX_253 + "/g": "x"}}}),
    ("bounds", {**BASE, "model": {**ARCH, "parameterCount": 10**15, "slidingWindow": 100_000_000},
                "gpu": {"memoryGiB": 1}, "scaling": {"forecastQuantile": 0.5}}),
    ("gpu-resource-domain-244",
     {**BASE, "gpu": {"type": "h100", "resourceName": DOMAIN_244 + "/gpu"}}),
    ("max-model-len-equals-context", {**BASE, "engine": {"maxModelLen": 4096}}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "message"), [c[1:] for c in MODEL_REFUSES], ids=[c[0] for c in MODEL_REFUSES]
)
def test_the_models_refuse(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        InferenceDeploymentSpec.model_validate(spec)


@pytest.mark.parametrize("spec", [c[1] for c in MODEL_ACCEPTS], ids=[c[0] for c in MODEL_ACCEPTS])
def test_the_models_accept(spec: dict[str, Any]) -> None:
    InferenceDeploymentSpec.model_validate(spec)


@pytest.mark.parametrize("name", ["chat\n", "a\n", "llama-8b\n"])
def test_a_name_with_a_trailing_newline_is_refused(name: str) -> None:
    assert name_error(name) == NAME_RULE.message


def test_node_selector_is_bounded_in_the_crd_as_in_the_model() -> None:
    node = spec_schema()["properties"]["gpu"]["properties"]["nodeSelector"]
    assert node["maxProperties"] == MAX_NODE_SELECTOR
    assert node["x-kubernetes-validations"] == [NODE_SELECTOR_KEY_RULE]


def rule(model: Any, fragment: str) -> Rule:
    """The rule of `model` whose message contains `fragment`."""
    found: Rule
    (found,) = [r for r in model.__rules__ if fragment in r.message]
    return found


# (id, spec, the rule): what the engines cannot run, refused by the API server's CEL rule and by
# the operator's sizing (a SpecError), not its model.
SIZING_CASES = [
    ("vllm-default-path", {**BASE, "engine": {"runtime": "vllm"}},
     rule(InferenceDeploymentSpec, "needs model.path")),
    ("sglang-tiny-path", {**BASE, "model": {"preset": "llama-3.1-8b", "path": "tiny"},
                          "engine": {"runtime": "sglang"}},
     rule(InferenceDeploymentSpec, "needs model.path")),
    ("headroom-engine-mla",
     {**BASE, "model": {**ARCH, "kvLoraRank": 64, "qkRopeHeadDim": 16, "path": "/m"}},
     rule(InferenceDeploymentSpec, "the headroom engine loads")),
    ("headroom-engine-deepseek-preset",
     {**BASE, "model": {"preset": "deepseek-v3", "path": "/m"}, "gpu": {"type": "b200"}},
     rule(InferenceDeploymentSpec, "the headroom engine loads")),
    ("headroom-engine-mixtral-preset",
     {**BASE, "model": {"preset": "mixtral-8x7b", "path": "/m"}, "gpu": {"type": "h200"},
      "engine": {"runtime": "headroom"}},
     rule(InferenceDeploymentSpec, "the headroom engine loads")),
    ("headroom-engine-int4-weights",
     {**BASE, "model": {"preset": "llama-3.1-8b", "weightDtype": "int4", "path": "/m"}},
     rule(InferenceDeploymentSpec, "the headroom engine loads")),
    ("tp-does-not-divide-heads",
     {**BASE, "model": {**ARCH, "path": "/m"}, "gpu": {"type": "h100", "countPerPod": 3},
      "engine": {"runtime": "vllm"}},
     rule(InferenceDeploymentSpec, "must divide model.numAttentionHeads")),
    ("tp-neither-divides-nor-multiplies-kv-heads",
     {**BASE, "model": {**ARCH, "numAttentionHeads": 12, "numKVHeads": 4, "path": "/m"},
      "gpu": {"type": "h100", "countPerPod": 12, "tensorParallel": 6},
      "engine": {"runtime": "sglang"}},
     rule(InferenceDeploymentSpec, "must divide model.numAttentionHeads")),
]  # fmt: skip
SIZING_OK = [
    ("vllm-with-path", {**BASE, "model": {"preset": "llama-3.1-8b", "path": "/m"},
                        "engine": {"runtime": "vllm"}}),
    ("headroom-engine-llama-fp32", {**BASE, "model": {**ARCH, "weightDtype": "fp32"}}),
    # 'tiny' is the engine's built-in model whatever the preset: the preset only sizes it.
    ("headroom-engine-tiny-sized-as-gemma", {**BASE, "model": {"preset": "gemma-2-9b"}}),
    ("headroom-engine-tiny-sized-as-mla",
     {**BASE, "model": {**ARCH, "kvLoraRank": 64, "qkRopeHeadDim": 16, "weightDtype": "fp8"}}),
    ("headroom-engine-mistral-preset", {**BASE, "model": {"preset": "mistral-7b", "path": "/m"}}),
    ("sglang-gemma-preset", {**BASE, "model": {"preset": "gemma-2-9b", "path": "/m"},
                             "engine": {"runtime": "sglang"}}),
    ("vllm-fp8-weights", {**BASE, "model": {"preset": "llama-3.1-8b", "weightDtype": "fp8",
                                            "path": "/m"}, "engine": {"runtime": "vllm"}}),
    ("tp-replicates-kv-heads",
     {**BASE, "model": {**ARCH, "path": "/m"}, "gpu": {"type": "h100", "countPerPod": 4},
      "engine": {"runtime": "vllm"}}),
    ("tp-splits-kv-heads",
     {**BASE, "model": {**ARCH, "numAttentionHeads": 8, "numKVHeads": 4, "path": "/m"},
      "gpu": {"type": "h100", "countPerPod": 2}, "engine": {"runtime": "vllm"}}),
    ("mla-tp", {**BASE, "model": {**ARCH, "numAttentionHeads": 8, "numKVHeads": 8,
                                  "kvLoraRank": 64, "qkRopeHeadDim": 16, "path": "/m"},
                "gpu": {"type": "h100", "countPerPod": 8}, "engine": {"runtime": "vllm"}}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "the_rule"), [c[1:] for c in SIZING_CASES], ids=[c[0] for c in SIZING_CASES]
)
def test_what_the_engines_cannot_run_is_refused_by_sizing(
    spec: dict[str, Any], the_rule: Rule
) -> None:
    parsed = InferenceDeploymentSpec.model_validate(spec)  # not the model's to refuse
    assert not the_rule.in_model and not the_rule.check(parsed)
    with pytest.raises(SpecError):
        size(parsed)


@pytest.mark.parametrize("spec", [c[1] for c in SIZING_OK], ids=[c[0] for c in SIZING_OK])
def test_what_the_engines_can_run_passes_the_sizing_rules(spec: dict[str, Any]) -> None:
    parsed = InferenceDeploymentSpec.model_validate(spec)
    assert all(r.check(parsed) for r in InferenceDeploymentSpec.__rules__)
    size(parsed)


def test_every_sizing_rule_has_a_case() -> None:
    covered = {id(c[2]) for c in SIZING_CASES}
    for model in (ModelSpec, GPUSpec, EngineSpec, ScalingSpec, InferenceDeploymentSpec):
        for r in model.__rules__:
            assert r.in_model or id(r) in covered, r.message


def test_a_status_merge_patch_uses_the_crds_names_and_nulls_what_is_unset() -> None:
    """status.kv is written as a merge patch: camelCase keys the status schema knows (the API
    server prunes any other), and null for an unset field so a stale value is deleted."""
    patch = KVStatus(occupancy=0.5, eta_seconds=30).merge_patch()
    props = status_schema()["properties"]["kv"]["properties"]
    assert set(patch) == set(props)
    assert patch["occupancy"] == 0.5 and patch["etaSeconds"] == 30
    assert "hitRatio" in patch and patch["hitRatio"] is None


def test_every_rule_message_is_unique() -> None:
    """rule_field finds a refusal's field by its message: two rules with one message would
    place one of them at the other's field."""
    from headroom.operator.crd.rules import CRDModel, rule_field

    stack, messages = list(CRDModel.__subclasses__()), []
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        messages += [r.message for r in cls.__rules__]
    assert len(messages) > 20 and len(set(messages)) == len(messages)
    assert rule_field(rule(InferenceDeploymentSpec, "maxModelLen").message) == (
        "engine",
        "maxModelLen",
    )
    assert rule_field("no rule says this") == ()
