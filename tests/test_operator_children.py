"""Rendering the children: engine flags from the plan, pod hardening, owner references."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from rendered import containers, flags

from headroom.contract.ports import ENGINE_PORT
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
    assert f["--stats-port"] == "8001"  # probes and the sidecar: a listener of their own


@pytest.mark.parametrize("runtime", ["headroom", "vllm", "sglang"])
@pytest.mark.parametrize("served", [None, "chat-model"])
def test_the_sidecar_labels_its_series_with_the_name_the_engine_serves(
    runtime: str, served: str | None
) -> None:
    # Learnt from the engine, the `model` label was missing from a sidecar restarted while its
    # engine was down: every alert on the pod's series resolved and began again as a new one.
    model = {"preset": "llama-3.1-8b", "path": "/models/l8b", "servedModelName": served}
    own: dict[str, Any] = {  # no preset: the resource's name is served
        "numLayers": 4, "numAttentionHeads": 8, "numKVHeads": 2, "headDim": 64,
        "hiddenSize": 512, "vocabSize": 1000, "parameterCount": 10_000_000,
        "maxPositionEmbeddings": 8192, "path": "/models/m", "servedModelName": served,
    }  # fmt: skip
    for m, default in ((model, "llama-3.1-8b"), (own, OWNER.name)):
        s = spec(engine={"runtime": runtime}, model=m)
        c = containers(deployment(OWNER, s, size(s), replicas=1))
        name = flags(c["engine"]["args"])["--served-model-name"]
        assert name == (served or default)
        assert flags(c["sidecar"]["args"])["--model"] == name


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
    assert sidecar["args"][:3] == ["sidecar", "--engine-url", "http://127.0.0.1:8001"]
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["HEADROOM_INFERENCEDEPLOYMENT"]["value"] == "chat"
    claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims[0]["persistentVolumeClaim"] == {"claimName": "w", "readOnly": True}
    assert dep["spec"]["replicas"] == 3


@pytest.mark.parametrize("runtime", ["headroom", "vllm", "sglang"])
def test_a_removed_pod_serves_until_the_service_forgets_it_then_drains(runtime: str) -> None:
    # Nothing held a terminating pod's containers back from SIGTERM: the engine drained at
    # once, and each request the Service, kube-proxy or an ingress still routed to it in the
    # seconds before its endpoints caught up was refused (503, then connection refused).
    from headroom.engine.async_engine import STOP_MARGIN_S
    from headroom.engine.server.runner import HANDLER_FLUSH_S
    from headroom.engine.server.state import ServerSettings
    from headroom.operator.reconcile.children import PRESTOP_SECONDS

    s = spec(engine={"runtime": runtime})
    dep = deployment(OWNER, s, size(s), replicas=2)
    for c in containers(dep).values():
        assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": PRESTOP_SECONDS}}}
    # The sidecar reports the pod's KV (the operator counts a draining pod's) until the engine
    # is gone, within what is left of the kubelet's deadline.
    wait = float(flags(containers(dep)["sidecar"]["args"])["--shutdown-wait"])
    left = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] - PRESTOP_SECONDS
    assert 0 < wait <= left
    assert PRESTOP_SECONDS >= 5
    # The kubelet's deadline covers the sleep and the headroom engine's worst drain: its grace,
    # the margin for a step in flight, the handlers' flush and the listeners' close.
    grace = ServerSettings.model_fields["shutdown_grace_s"].default
    drain = grace + STOP_MARGIN_S + 2 * HANDLER_FLUSH_S
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= (
        PRESTOP_SECONDS + drain
    )


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
    assert "SUCCESS: 2 rules found" in res.stdout


def _promtool_rule_test(
    tmp_path: Path, s: InferenceDeploymentSpec, cases: list[dict[str, Any]]
) -> None:
    """Run `promtool test rules` on this deployment's alert rules, evaluated every 15 s."""
    assert shutil.which("promtool"), "promtool is not installed: make tools installs it"
    (tmp_path / "rules.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "headroom", "rules": alert_rules(OWNER, s)}]})
    )
    test = {"rule_files": ["rules.yaml"], "evaluation_interval": "15s", "tests": cases}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    res = subprocess.run(
        ["promtool", "test", "rules", "test.yaml"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_saturation_soon_fires_with_the_lookahead_left_on_a_steady_fill(tmp_path: Path) -> None:
    """The alert's forecast must hold for 2 minutes, falling a second a second on a steady fill:
    it fires as the forecast reaches the lookahead (a pod's start), not 2 minutes after."""
    s = spec(scaling={"saturationLookaheadSeconds": 180})
    series = (
        'headroom_kv_saturation_eta_seconds{namespace="team-a",inferencedeployment="chat",'
        'pod="chat-0"}'
    )
    soon = {"severity": "warning", "namespace": "team-a", "inferencedeployment": "chat",
            "pod": "chat-0"}  # fmt: skip
    (rule, _) = alert_rules(OWNER, s)
    said = {  # at 255 s the forecast is 165 s
        k: v.replace("{{ $labels.pod }}", "chat-0").replace(
            "{{ $value | humanizeDuration }}", "2m 45s"
        )
        for k, v in rule["annotations"].items()
    }
    assert "chat-0 is forecast to fill in 2m 45s (lookahead 180s)" in said["summary"]
    _promtool_rule_test(tmp_path, s, [
        {
            "interval": "15s",
            # 420 s at t = 0, a second less each second: 180 s left at t = 240 s.
            "input_series": [{"series": series, "values": "420-15x40"}],
            "alert_rule_test": [
                {"eval_time": "225s", "alertname": "HeadroomKVSaturationSoon",
                 "exp_alerts": []},
                {"eval_time": "255s", "alertname": "HeadroomKVSaturationSoon",
                 "exp_alerts": [{"exp_labels": soon, "exp_annotations": said}]},
            ],
        }
    ])  # fmt: skip


def test_sidecar_down_fires_for_a_sidecar_of_this_deployment_unscraped_for_5_minutes(
    tmp_path: Path,
) -> None:
    """Prometheus's `up` for the ServiceMonitor's targets: a sidecar it cannot scrape exports
    nothing, so without this rule every per-pod alert went quiet for that pod. One in a crash
    loop (scraped a minute in six) fires too; a deleted pod's alert resolves."""

    def up(pod: str, service: str = "chat", ns: str = "team-a", port: str = "metrics") -> str:
        return (f'up{{job="{service}",namespace="{ns}",service="{service}",pod="{pod}",'
                f'endpoint="{port}",container="sidecar",instance="{pod}:9400"}}')  # fmt: skip

    (_, rule) = alert_rules(OWNER, spec())
    said = {k: v.replace("{{ $labels.pod }}", "chat-0") for k, v in rule["annotations"].items()}
    assert said["summary"] == (
        "team-a/chat: Prometheus cannot scrape the headroom sidecar of pod chat-0"
    )

    def fired(pod: str) -> dict[str, Any]:
        labels = {"severity": "warning", "job": "chat", "namespace": "team-a",
                  "service": "chat", "pod": pod, "endpoint": "metrics", "container": "sidecar",
                  "instance": f"{pod}:9400", "inferencedeployment": "chat",
                  "model": "llama-3.1-8b"}  # fmt: skip
        notes = {k: v.replace("{{ $labels.pod }}", pod) for k, v in rule["annotations"].items()}
        return {"exp_labels": labels, "exp_annotations": notes}

    _promtool_rule_test(tmp_path, spec(), [
        {
            "interval": "15s",
            "input_series": [
                {"series": up("chat-0"), "values": "1 1 0x30"},  # down from 30 s
                {"series": up("chat-1"), "values": "1x32"},
                # not this deployment's sidecar: another deployment's, another namespace's
                # deployment of the same name, another port
                {"series": up("other-0", service="other"), "values": "0x32"},
                {"series": up("chat-0", ns="team-b"), "values": "0x32"},
                {"series": up("chat-1", port="http"), "values": "0x32"},
            ],
            "alert_rule_test": [
                {"eval_time": "315s", "alertname": "HeadroomSidecarDown", "exp_alerts": []},
                {"eval_time": "345s", "alertname": "HeadroomSidecarDown",
                 "exp_alerts": [fired("chat-0")]},
            ],
        },
        {
            "interval": "15s",
            "input_series": [
                # up 60 s in every 6 minutes: each run resets `up == 0`'s for:
                {"series": up("chat-2"), "values": "1x3 0x19 1x3 0x19 1x3 0x19 1x3 0x19"},
                # down 8 minutes, then up again: resolved as it answers
                {"series": up("chat-3"), "values": "1x3 0x31 1x40"},
                # down, then deleted (its series goes stale)
                {"series": up("chat-4"), "values": "1x3 0x31 stale"},
            ],
            "alert_rule_test": [
                {"eval_time": "8m", "alertname": "HeadroomSidecarDown",
                 "exp_alerts": [fired("chat-3"), fired("chat-4")]},
                # chat-2's loop held 5 minutes (fired at 12 m); chat-3 answers, chat-4 is gone
                {"eval_time": "13m", "alertname": "HeadroomSidecarDown",
                 "exp_alerts": [fired("chat-2")]},
                {"eval_time": "1095s", "alertname": "HeadroomSidecarDown",  # chat-2 answering
                 "exp_alerts": [fired("chat-2")]},
            ],
        },
    ])  # fmt: skip


@pytest.mark.parametrize("lookahead", [60, 420])
def test_saturation_soon_holds_two_minutes_below_the_lookahead_plus_two(lookahead: int) -> None:
    """The split the steady-fill test relies on, for any lookahead: held 2 minutes, below the
    lookahead plus those 2 minutes (a shorter hold below a lower line passes a single ramp)."""
    (rule, _) = alert_rules(OWNER, spec(scaling={"saturationLookaheadSeconds": lookahead}))
    assert rule["for"] == "120s"
    assert rule["expr"].endswith(f") < {lookahead + 120}"), rule["expr"]


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

# Connections the API listener holds in the overload test: every slot taken.
CAP = 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str, key: str | None = None, timeout: float = 5) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _answer(url: str) -> int | str:
    """The status of a GET with a generous timeout, or why none came."""
    try:
        return _get(url, timeout=30)[0]
    except OSError as exc:
        return f"no answer: {exc!r}"


def _poll(
    url: str,
    proc: subprocess.Popen[bytes],
    log: Path,
    want: Callable[[str], bool] | None = None,
    within: float = 180,
) -> str:
    """The first 200 body from `url` that `want` accepts (bounded, while `proc` runs)."""
    deadline = time.monotonic() + within
    body = ""
    while True:
        assert proc.poll() is None, log.read_text()
        with contextlib.suppress(OSError):
            status, body = _get(url)
            if status == 200 and (want is None or want(body)):
                return body
        assert time.monotonic() < deadline, f"{url}: not ready\n{body}\n{log.read_text()}"
        time.sleep(0.5)


def _engine_up(metrics: str) -> bool:
    """Whether the sidecar's /metrics says the engine is up. The sidecar answers before its
    first poll of the engine has come back, with `headroom_engine_up{...} 0.0`, so a wait for
    the line alone may return that body; one that never reads the engine fails the wait."""
    up = [ln for ln in metrics.splitlines() if ln.startswith("headroom_engine_up{")]
    return bool(up) and up[0].endswith(" 1.0")


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


def _local_ports(container: dict[str, Any]) -> dict[int, int]:
    """A free port here for each of the container's ports (the pod's own may be taken)."""
    return {p["containerPort"]: _free_port() for p in container["ports"]}


def _local_args(args: list[str], local: dict[int, int], **flags: str) -> list[str]:
    """The engine's args with each port it listens on moved to its local one, plus `flags`."""
    out = list(args)
    for flag in ("--port", "--stats-port"):
        if flag in out:
            at = out.index(flag) + 1
            out[at] = str(local[int(out[at])])
    return _with(out, **flags)


def _local_url(url: str, local: dict[int, int]) -> str:
    """A URL at one of the pod's ports, at that port's local stand-in."""
    parts = urllib.parse.urlsplit(url)
    assert parts.port is not None, url
    return parts._replace(netloc=f"127.0.0.1:{local[parts.port]}").geturl()


def _probe_url(container: dict[str, Any], probe: str, local: dict[int, int]) -> str:
    """Where the kubelet would send `probe`, here: its named port resolved, then made local."""
    by_name = {p["name"]: p["containerPort"] for p in container["ports"]}
    get = container[probe]["httpGet"]
    return f"http://127.0.0.1:{local[by_name[get['port']]]}{get['path']}"


def _tiny_pod(**engine: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine and sidecar containers of a rendered headroom pod for the tiny model."""
    s = spec(
        model={"preset": "llama-3.1-8b", "path": "tiny"},
        gpu={"type": "h100-80gb"},
        traffic={"peakConcurrency": 4, "contextTokens": 2048},
        engine=engine,
    )
    c = containers(deployment(OWNER, s, size(s), replicas=1))
    return c["engine"], c["sidecar"]


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`headroom <argv>` with its output in `log`."""
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "headroom.contract.cli", *argv],
                                env={**os.environ, **env}, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip


def _engine_env(engine: dict[str, Any], **extra: str) -> dict[str, str]:
    """The container's literal env (HOME aside: this machine's caches), one torch thread."""
    env = {e["name"]: e["value"] for e in engine["env"] if "value" in e and e["name"] != "HOME"}
    return {"OMP_NUM_THREADS": "1", **env, **extra}


def _sidecar_args(sidecar: dict[str, Any], local: dict[int, int], port: int) -> list[str]:
    """The sidecar's args, polling the engine's local stand-in port."""
    url = sidecar["args"][sidecar["args"].index("--engine-url") + 1]
    return _with(sidecar["args"], engine_url=_local_url(url, local), port=str(port),
                 host="127.0.0.1")  # fmt: skip


def _stop(*procs: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM each in turn; a rendered sidecar waits for its engine (--shutdown-wait)."""
    for proc in procs:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


def test_the_rendered_headroom_pod_guards_its_api_and_still_probes_and_scrapes(
    tmp_path: Path,
) -> None:
    # The engine and sidecar containers' own args, run here on loopback: only what a machine
    # without a GPU cannot take is changed (device, address, ports, a pool in CPU memory).
    engine, sidecar = _tiny_pod(apiKeySecret={"name": "chat-keys"})
    (key_var,) = [e["name"] for e in engine["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    key = "s3cret-key"  # what the kubelet reads from Secret chat-keys
    local, side_port = _local_ports(engine), _free_port()
    args = _local_args(engine["args"], local, host="127.0.0.1", device="cpu", num_blocks="512")
    elog, slog = tmp_path / "engine.log", tmp_path / "sidecar.log"
    eng = _start(args, elog, _engine_env(engine, **{key_var: key}))
    side: subprocess.Popen[bytes] | None = None
    try:
        _poll(_probe_url(engine, "readinessProbe", local), eng, elog)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert _get(_probe_url(engine, probe, local))[0] == 200, probe
        base = f"http://127.0.0.1:{local[ENGINE_PORT]}"
        assert _get(base + "/v1/models")[0] == 401
        assert _get(base + "/v1/models", "wrong")[0] == 401
        assert _get(base + "/v1/models", key)[0] == 200
        pod = {"POD_NAME": "chat-0", "POD_NAMESPACE": "team-a"}
        side = _start(_sidecar_args(sidecar, local, side_port), slog, pod)
        metrics = _poll(
            f"http://127.0.0.1:{side_port}/metrics", side, slog, want=_engine_up, within=60
        )
        up = [ln for ln in metrics.splitlines() if ln.startswith("headroom_engine_up{")]
        assert up and up[0].endswith(" 1.0"), metrics  # it reads /stats without the key
    finally:
        _stop(eng, side)  # as the kubelet's deadline ends them: the sidecar outlasts the engine


def _wait_for_line(log: Path, text: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while text not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"never logged {text!r}:\n{log.read_text()}"
        time.sleep(0.2)


def test_the_rendered_headroom_pod_probes_and_scrapes_past_a_full_api_listener(
    tmp_path: Path,
) -> None:
    # Under overload, long streams hold every API connection slot (--max-connections) and new
    # connections wait in the listen queue: here idle keep-alive connections, which the
    # listener counts the same. The kubelet's probes and the sidecar's poll still get answers,
    # or a pod that is only busy is restarted and its sidecar says the engine is down.
    engine, sidecar = _tiny_pod()
    local, side_port = _local_ports(engine), _free_port()
    args = _local_args(engine["args"], local, host="127.0.0.1", device="cpu", num_blocks="512",
                       max_connections=str(CAP), keepalive_timeout="600")  # fmt: skip
    elog, slog = tmp_path / "engine.log", tmp_path / "sidecar.log"
    eng = _start(args, elog, _engine_env(engine, PYTHONUNBUFFERED="1"))
    side: subprocess.Popen[bytes] | None = None
    api = ("127.0.0.1", local[ENGINE_PORT])
    held: list[socket.socket] = []
    try:
        _poll(f"http://{api[0]}:{api[1]}/health", eng, elog)
        _poll(_probe_url(engine, "readinessProbe", local), eng, elog)
        held = [socket.create_connection(api, timeout=30) for _ in range(CAP)]
        _wait_for_line(elog, "connections open (--max-connections)", eng)
        queued = socket.create_connection(api, timeout=30)  # completes in the listen queue
        held.append(queued)
        queued.sendall(b"GET /health HTTP/1.1\r\nHost: pod\r\nConnection: close\r\n\r\n")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert _answer(_probe_url(engine, probe, local)) == 200, probe
        pod = {"POD_NAME": "chat-0", "POD_NAMESPACE": "team-a"}
        side = _start(_sidecar_args(sidecar, local, side_port), slog, pod)
        metrics = _poll(
            f"http://127.0.0.1:{side_port}/metrics", side, slog, want=_engine_up, within=60
        )
        up = [ln for ln in metrics.splitlines() if ln.startswith("headroom_engine_up{")]
        assert up and up[0].endswith(" 1.0"), metrics
        # The API's own /health waited in the queue all along; a freed slot lets it in.
        assert select.select([queued], [], [], 0)[0] == [], "the API listener was not full"
        held.pop(0).close()
        assert queued.recv(64).startswith(b"HTTP/1.1 200"), elog.read_text()
    finally:
        for sock in held:
            sock.close()
        _stop(eng, side)  # as the kubelet's deadline ends them: the sidecar outlasts the engine
