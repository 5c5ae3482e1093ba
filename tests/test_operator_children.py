"""Rendering the children: engine flags from the plan, pod hardening, owner references."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from rendered import containers, flags

from headroom.operator.crd.models import InferenceDeploymentSpec
from headroom.operator.reconcile.children import (
    FIELD_MANAGER,
    SELECTOR_LABEL,
    Owner,
    alert_rules,
    deployment,
    engine_args,
    render,
    selector_string,
)
from headroom.operator.reconcile.sizing import size

OWNER = Owner(name="chat", namespace="team-a", uid="1234-abcd")
ALL_MONITORING = frozenset({"ServiceMonitor", "PrometheusRule"})


def spec(**sections: Any) -> InferenceDeploymentSpec:
    raw: dict[str, Any] = {
        "model": {"preset": "llama-3.1-8b", "path": "/models/l8b", "volumeClaimName": "w"},
        "gpu": {"type": "h100-80gb", "countPerPod": 2, "tensorParallel": 2},
        "traffic": {"peakConcurrency": 400, "contextTokens": 4096},
    }
    raw.update(sections)
    return InferenceDeploymentSpec.model_validate(raw)


def test_engine_allocates_exactly_the_planned_pool() -> None:
    s = spec(engine={"kvCacheDtype": "fp8", "blockSize": 32, "prefixCaching": False})
    sizing = size(s)
    args = engine_args(s, sizing, "chat")
    assert args[0] == "serve"
    f = flags(args)
    assert f["--num-blocks"] == str(sizing.plan.kv_blocks_per_pod)
    assert f["--block-size"] == "32" and f["--kv-cache-dtype"] == "fp8"
    assert f["--max-model-len"] == "4096"  # defaults to traffic.contextTokens
    assert f["--no-enable-prefix-caching"] is True and "--enable-prefix-caching" not in f
    assert f["--model"] == "/models/l8b" and f["--served-model-name"] == "llama-3.1-8b"
    assert (f["--host"], f["--port"]) == ("0.0.0.0", "8000")


def test_pod_requests_gpus_probes_and_runs_hardened() -> None:
    s = spec()
    dep = deployment(OWNER, s, size(s), replicas=3)
    pod = dep["spec"]["template"]["spec"]
    c = containers(dep)
    engine, sidecar = c["engine"], c["sidecar"]
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert "nvidia.com/gpu" not in sidecar["resources"]["requests"]
    assert engine["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    assert engine["startupProbe"]["httpGet"]["path"] == "/health"
    assert pod["securityContext"]["runAsNonRoot"] is True
    for container in (engine, sidecar):
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
        assert sc["capabilities"]["drop"] == ["ALL"] and sc["runAsNonRoot"]
    assert sidecar["args"][:3] == ["sidecar", "--engine-url", "http://127.0.0.1:8000"]
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["HEADROOM_INFERENCEDEPLOYMENT"]["value"] == "chat"
    claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims[0]["persistentVolumeClaim"] == {"claimName": "w", "readOnly": True}
    assert dep["spec"]["replicas"] == 3


def test_advisory_leaves_replicas_out() -> None:
    s = spec(scaling={"mode": "advisory"})
    dep = deployment(OWNER, s, size(s), replicas=None)
    assert "replicas" not in dep["spec"]


@pytest.mark.parametrize(("kinds", "expected"), [
    (frozenset(), ["Deployment", "Service", "PodDisruptionBudget"]),
    (ALL_MONITORING,
     ["Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor", "PrometheusRule"]),
    (frozenset({"ServiceMonitor"}), ["Deployment", "Service", "PodDisruptionBudget",
                                     "ServiceMonitor"]),
])  # fmt: skip
def test_render_children_each_owned(kinds: frozenset[str], expected: list[str]) -> None:
    s = spec()
    objs = render(OWNER, s, size(s), 2, monitoring=kinds)
    assert [o["kind"] for o in objs] == expected
    for obj in objs:
        meta = obj["metadata"]
        assert meta["name"] == "chat" and meta["namespace"] == "team-a"
        (ref,) = meta["ownerReferences"]
        assert ref == {
            "apiVersion": "headroom.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "name": "chat",
            "uid": "1234-abcd",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert meta["labels"][SELECTOR_LABEL] == "chat"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == FIELD_MANAGER


def test_selectors_pick_the_pods() -> None:
    s = spec()
    dep, svc, pdb = render(OWNER, s, size(s), 1)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    for selector in (
        dep["spec"]["selector"]["matchLabels"],
        svc["spec"]["selector"],
        pdb["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= pod_labels.items()
    assert selector_string("chat") == f"{SELECTOR_LABEL}=chat"


def test_rendering_is_deterministic() -> None:
    s = spec()
    assert render(OWNER, s, size(s), 2, monitoring=ALL_MONITORING) == render(
        OWNER, s, size(s), 2, monitoring=ALL_MONITORING
    )


def test_alert_rules_pass_promtool(tmp_path: Path) -> None:
    assert shutil.which("promtool"), (
        "promtool is not installed: make tools installs Debian's prometheus"
    )
    rules = {"groups": [{"name": "headroom", "rules": alert_rules(OWNER, spec())}]}
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    res = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: 4 rules found" in res.stdout
