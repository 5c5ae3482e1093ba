"""The CRD: generated from the pydantic models, structural, and committed as generated."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from headroom.operator.__main__ import main as operator_main
from headroom.operator.crd.models import (
    NAME_RULE,
    QUANTITY_PATTERN,
    EngineSpec,
    GPUSpec,
    InferenceDeploymentSpec,
    ModelSpec,
    ScalingSpec,
    TrafficSpec,
)
from headroom.operator.crd.schema import crd, crd_yaml, spec_schema, status_schema

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
        {"rule": NAME_RULE.cel, "message": NAME_RULE.message}
    ]


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
