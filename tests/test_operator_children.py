"""Rendering the children: engine flags from the plan, pod hardening, owner references."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
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

ROOT = Path(__file__).resolve().parents[1]
OWNER = Owner(name="chat", namespace="team-a", uid="1234-abcd")
ALL_MONITORING = frozenset({"ServiceMonitor", "PrometheusRule"})


def spec(**sections: Any) -> InferenceDeploymentSpec:
    raw: dict[str, Any] = {
        "model": {"preset": "llama-3.1-8b", "path": "/models/l8b", "volumeClaimName": "w"},
        "gpu": {"type": "h100-80gb"},
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
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    tp2 = spec(gpu={"type": "h100-80gb", "countPerPod": 2, "tensorParallel": 2},
               engine={"runtime": "vllm"})  # fmt: skip
    res = containers(deployment(OWNER, tp2, size(tp2), replicas=3))["engine"]["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "2"
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
    assert "SUCCESS: 1 rules found" in res.stdout


def test_no_alert_is_both_the_charts_and_a_deployments() -> None:
    # The chart's PrometheusRule and each deployment's would fire the same alert twice.
    chart = yaml.safe_load((ROOT / "charts/headroom/files/headroom-alerts.yaml").read_text())
    shared = {r["alert"] for g in chart["groups"] for r in g["rules"]}
    mine = {r["alert"] for r in alert_rules(OWNER, spec())}
    assert mine and not mine & shared, mine & shared


def test_gpu_type_leaves_scheduling_to_the_node_selector() -> None:
    # A decision, not an omission: GPU labels differ between clusters (GPU Feature Discovery,
    # cloud providers), and a required affinity on a label the nodes lack would leave every pod
    # Pending. The CRD's gpu.type description sends users to gpu.nodeSelector.
    s = spec()
    pod = deployment(OWNER, s, size(s), replicas=1)["spec"]["template"]["spec"]
    assert "affinity" not in pod and "nodeSelector" not in pod
    s = spec(gpu={"type": "l4-24gb", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"}})
    pod = deployment(OWNER, s, size(s), replicas=1)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert "affinity" not in pod


# ---------------------------------------------------------------------------- the pod, run here


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str, key: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _poll(url: str, proc: subprocess.Popen[bytes], log: Path, want: str = "") -> str:
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, log.read_text()
        with contextlib.suppress(OSError):
            status, body = _get(url)
            if status == 200 and want in body:
                return body
        assert time.monotonic() < deadline, f"{url}: not ready\n{log.read_text()}"
        time.sleep(0.5)


def _with(args: list[str], **flags: str) -> list[str]:
    """`args` with some `--flag value` pairs replaced (or added)."""
    out = list(args)
    for flag, value in flags.items():
        name = "--" + flag.replace("_", "-")
        if name in out:
            out[out.index(name) + 1] = value
        else:
            out += [name, value]
    return out


def test_the_rendered_headroom_pod_guards_its_api_and_still_probes_and_scrapes(
    tmp_path: Path,
) -> None:
    # The engine and sidecar containers' own args, run here on loopback: only what a machine
    # without a GPU cannot take is changed (device, address, a pool that fits in CPU memory).
    s = spec(
        model={"preset": "llama-3.1-8b", "path": "tiny"},
        gpu={"type": "h100-80gb"},
        traffic={"peakConcurrency": 4, "contextTokens": 2048},
        engine={"apiKeySecret": {"name": "chat-keys"}},
    )
    c = containers(deployment(OWNER, s, size(s), replicas=1))
    engine, sidecar = c["engine"], c["sidecar"]
    (key_var,) = [e["name"] for e in engine["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    key = "s3cret-key"  # what the kubelet reads from Secret chat-keys
    port, side_port = _free_port(), _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", key_var: key}
    env.update(
        {e["name"]: e["value"] for e in engine["env"] if "value" in e and e["name"] != "HOME"}
    )
    args = _with(engine["args"], host="127.0.0.1", port=str(port), device="cpu", num_blocks="512")
    elog, slog = tmp_path / "engine.log", tmp_path / "sidecar.log"
    with elog.open("w") as eout, slog.open("w") as sout:
        eng = subprocess.Popen([sys.executable, "-m", "headroom.contract.cli", *args],
                               env=env, stdout=eout, stderr=subprocess.STDOUT)  # fmt: skip
        side: subprocess.Popen[bytes] | None = None
        try:
            base = f"http://127.0.0.1:{port}"
            _poll(base + engine["readinessProbe"]["httpGet"]["path"], eng, elog)
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert _get(base + engine[probe]["httpGet"]["path"])[0] == 200, probe
            assert _get(base + "/v1/models")[0] == 401
            assert _get(base + "/v1/models", "wrong")[0] == 401
            assert _get(base + "/v1/models", key)[0] == 200
            side_args = _with(sidecar["args"], engine_url=base, port=str(side_port),
                              host="127.0.0.1")  # fmt: skip
            side = subprocess.Popen([sys.executable, "-m", "headroom.contract.cli", *side_args],
                                    env={**os.environ, "POD_NAME": "chat-0",
                                         "POD_NAMESPACE": "team-a"},
                                    stdout=sout, stderr=subprocess.STDOUT)  # fmt: skip
            metrics = _poll(f"http://127.0.0.1:{side_port}/metrics", side, slog,
                            want="headroom_engine_up{")  # fmt: skip
            up = [ln for ln in metrics.splitlines() if ln.startswith("headroom_engine_up{")]
            assert up and up[0].endswith(" 1.0"), metrics  # it reads /stats without the key
        finally:
            for proc in (side, eng):
                if proc is not None:
                    proc.terminate()
                    proc.wait(timeout=60)
