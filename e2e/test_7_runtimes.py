"""Scenario 7: stock vLLM and SGLang as the pod's engine.

(a) `kubectl apply` of an InferenceDeployment with `engine.runtime: vllm` (and `sglang`) at
tensor parallel 4 gets a Deployment whose engine container runs the stock server with the
planned pool (`--num-gpu-blocks-override` = status.budget's blocks per pod, or SGLang's
`--max-total-tokens` = blocks x block size) and the TP size, from the runtime's pinned image, with
a sidecar in `--source vllm` / `--source sglang` mode beside it.

(b) The sidecar in vllm (sglang) mode in front of a stand-in server: kwok pods run nothing, so a
small aiohttp app in this test serves the `/metrics` exposition a vLLM (SGLang) server started
with the Deployment's own args would serve (its pool is the `--num-gpu-blocks-override` /
`--max-total-tokens` the operator wrote), with a KV usage gauge that idles, then rises steadily
to full. Prometheus scrapes the sidecar and the operator, reading Prometheus, must scale out on
its forecast of the KV in use (`KVForecast`: the stand-ins serve no request counters to derive
demand from) while the usage is still under the 0.9 `scaleOutOccupancy` line, i.e. before the
fill. The stand-in's usage is a function of time, so
the lead times are exact: they are printed and asserted positive.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from e2e.cluster.harness import Cluster
from e2e.helpers import (
    PROMETHEUS,
    REPO,
    Operator,
    Processes,
    Prometheus,
    Timings,
    free_port,
    http_json,
    processes,
    start_sidecar,
    wait_until,
)
from e2e.kube import CRDS, SELECTOR_LABEL, container_arg, get_obj, headroom_plan, pool_flags

RUNTIMES = ("vllm", "sglang")
IMAGES = {"vllm": "vllm/vllm-openai:v0.11.0", "sglang": "lmsysorg/sglang:v0.5.3"}
COMMANDS = {
    "vllm": ["vllm", "serve", "/models/llama-3.1-70b-instruct"],
    "sglang": ["python3", "-m", "sglang.launch_server"],
}
SIDECAR_SOURCE = {"vllm": ["--source", "vllm"], "sglang": ["--source", "sglang", "--page-size"]}

# (b): the stand-in's KV usage idles at IDLE, then rises linearly to 1.0 over RISE_SECONDS.
IDLE = 0.05
RISE_SECONDS = 100.0
FILL_GRACE_SECONDS = 30.0
SCALE_OUT_OCCUPANCY = 0.9  # the threshold line sits at the fill's edge (as in scenario 5)
TARGET_OCCUPANCY = 0.7
GROWTH_WINDOW_SECONDS = 10
MODEL = "llama-3.2-1b"
SGLANG_SERVER_INFO = REPO / "tests" / "prometheus" / "sglang_server_info_0.5.3.json"


def _manifest(name: str, ns: str, spec: dict[str, Any]) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "headroom.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": ns},
            "spec": spec,
        }
    )


def _deployment(cluster: Cluster, ns: str, name: str, operator: Operator) -> dict[str, Any]:
    def made() -> dict[str, Any] | None:
        obj = get_obj(cluster, "inferencedeployment", name, namespace=ns)
        status, meta = obj.get("status") or {}, obj["metadata"]
        if status.get("observedGeneration") != meta.get("generation") or "budget" not in status:
            return None
        if cluster.kubectl("get", "deployment", name, "-n", ns, check=False).returncode != 0:
            return None
        return get_obj(cluster, "deployment", name, namespace=ns)

    dep: dict[str, Any] = wait_until(
        made, timeout=120, what=f"the operator to deploy {ns}/{name}", alive=operator.check_alive
    )
    return dep


def _containers(dep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}


# ---------------------------------------------------------------------------- (a)


def _tp4_spec(runtime: str) -> dict[str, Any]:
    return {
        "model": {
            "preset": "llama-3.1-70b",
            "path": "/models/llama-3.1-70b-instruct",
            "volumeClaimName": "llama-3.1-70b-weights",
        },
        "gpu": {"type": "h100-80gb", "countPerPod": 4, "tensorParallel": 4},
        "traffic": {"peakConcurrency": 64, "contextTokens": 8192},
        "engine": {"runtime": runtime, "maxModelLen": 16384, "startupTimeoutSeconds": 1200},
        "scaling": {"minReplicas": 1, "maxReplicas": 4},
    }


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_stock_runtime_deployment_carries_the_plan(
    cluster: Cluster, cluster_namespace: str, operator: Operator, runtime: str
) -> None:
    ns, name = cluster_namespace, f"llama-70b-{runtime}"
    cluster.kubectl("apply", "-f", str(CRDS))
    cluster.wait("--for=condition=Established", "crd/inferencedeployments.headroom.dev")
    spec = _tp4_spec(runtime)
    out = cluster.kubectl("apply", "-f", "-", input=_manifest(name, ns, spec)).stdout
    assert f"inferencedeployment.headroom.dev/{name} created" in out, out
    dep = _deployment(cluster, ns, name, operator)
    plan = headroom_plan(spec)
    budget = get_obj(cluster, "inferencedeployment", name, namespace=ns)["status"]["budget"]
    assert budget["kvBlocksPerPod"] == plan["kv_blocks_per_pod"]
    assert budget["tensorParallel"] == 4 and plan["tp"] == 4

    c = _containers(dep)
    engine, sidecar = c["engine"], c["sidecar"]
    print(f"\n[scenario 7] {runtime} engine: {' '.join(engine['command'] + engine['args'])}")
    assert engine["image"] == IMAGES[runtime], engine["image"]
    assert engine["command"] == COMMANDS[runtime]
    for flag, want in pool_flags(spec, plan).items():
        assert container_arg(dep, "engine", flag) == want, (flag, engine["args"])
    assert container_arg(dep, "engine", "--tensor-parallel-size" if runtime == "vllm"
                         else "--tp-size") == "4"  # fmt: skip
    if runtime == "vllm":
        assert container_arg(dep, "engine", "--max-model-len") == "16384"
    else:
        assert container_arg(dep, "engine", "--context-length") == "16391"  # + SGLang's slack
        assert "--enable-metrics" in engine["args"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "4"
    startup = engine["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] == 1200
    assert "/dev/shm" in {m["mountPath"] for m in engine["volumeMounts"]}

    assert sidecar["image"].startswith("ghcr.io/headroom-dev/headroom:"), sidecar["image"]
    want = SIDECAR_SOURCE[runtime] + ([str(plan["block_size"])] if runtime == "sglang" else [])
    args = sidecar["args"]
    assert "--source" in args and args[args.index("--source") :] == want, args


# ---------------------------------------------------------------------------- (b)


class StandIn:
    """What a stock server's `/metrics` says about its KV pool, with a usage that rises on cue.

    The families and labels are those of the pinned releases, rendered by prometheus-client:
    vLLM 0.11 (`vllm:kv_cache_usage_perc`, `vllm:cache_config_info{num_gpu_blocks}`); SGLang
    0.5.3 (`sglang:token_usage`, `sglang:num_used_tokens`, no retraction total: 0.5.3 has only
    the per-log `sglang:num_retracted_reqs` gauge; and no pool size: that is in
    `GET /get_server_info`, served as 0.5.3 shapes it).
    """

    def __init__(self, runtime: str, blocks: int, block_size: int) -> None:
        self.runtime, self.blocks, self.block_size = runtime, blocks, block_size
        self.port = free_port()
        self.started = time.time()
        self.rise_at: float | None = None
        self.server_info_reads = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def usage(self, t: float | None = None) -> float:
        t = time.time() if t is None else t
        if self.rise_at is None or t <= self.rise_at:
            return IDLE
        return min(1.0, IDLE + (1.0 - IDLE) * (t - self.rise_at) / RISE_SECONDS)

    def time_at(self, usage: float) -> float:
        """When the usage reaches `usage` (after the rise started)."""
        assert self.rise_at is not None
        return self.rise_at + (usage - IDLE) / (1.0 - IDLE) * RISE_SECONDS

    def exposition(self) -> bytes:
        reg = CollectorRegistry()
        u = self.usage()
        running = round(u * 64)
        Gauge("process_start_time_seconds", "Start time.", registry=reg).set(self.started)
        if self.runtime == "vllm":
            labels = {"engine": "0", "model_name": MODEL}
            Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                  list(labels), registry=reg).labels(**labels).set(u)  # fmt: skip
            info = {
                "block_size": str(self.block_size),
                "cache_dtype": "auto",
                "enable_prefix_caching": "True",
                "engine": "0",
                "num_gpu_blocks": str(self.blocks),
            }
            Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                  list(info), registry=reg).labels(**info).set(1)  # fmt: skip
            for metric, value in (("running", running), ("waiting", 0)):
                Gauge(f"vllm:num_requests_{metric}", f"Requests {metric}.", list(labels),
                      registry=reg).labels(**labels).set(value)  # fmt: skip
            Counter("vllm:num_preemptions", "Cumulative preemptions.", list(labels),
                    registry=reg).labels(**labels)  # fmt: skip
        else:
            labels = {"model_name": MODEL, "engine_type": "unified", "tp_rank": "0",
                      "pp_rank": "0"}  # fmt: skip
            tokens = self.blocks * self.block_size
            for metric, value in (
                ("token_usage", round(u, 2)),  # SGLang rounds it
                ("num_used_tokens", round(u * tokens)),
                ("num_running_reqs", running),
                ("num_queue_reqs", 0),
                ("num_retracted_reqs", 0),  # per stats log: not read
            ):
                Gauge(f"sglang:{metric}", f"The {metric}.", list(labels),
                      registry=reg).labels(**labels).set(value)  # fmt: skip
        return generate_latest(reg)

    def server_info(self) -> dict[str, Any]:
        """SGLang 0.5.3's `GET /get_server_info`, its pool the `--max-total-tokens` asked."""
        doc: dict[str, Any] = json.loads(SGLANG_SERVER_INFO.read_text())
        tokens = self.blocks * self.block_size
        doc.update(served_model_name=MODEL, page_size=self.block_size,
                   max_total_tokens=tokens, max_total_num_tokens=tokens)  # fmt: skip
        for state in doc["internal_states"]:
            state.update(page_size=self.block_size, max_total_tokens=tokens)
            state["memory_usage"]["token_capacity"] = tokens
        return doc

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.exposition(), content_type="text/plain")

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def _server_info(self, _: web.Request) -> web.Response:
        if self.runtime != "sglang":
            return web.Response(status=404)
        self.server_info_reads += 1
        return web.json_response(self.server_info())

    async def _setup(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/get_server_info", self._server_info)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> StandIn:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._setup(), self._loop).result(timeout=30)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


def _rising_spec(runtime: str, prometheus_url: str) -> dict[str, Any]:
    return {
        "model": {"preset": MODEL, "path": f"/models/{MODEL}"},
        "gpu": {"type": "l4-24gb"},
        "traffic": {"peakConcurrency": 4, "contextTokens": 512},
        "engine": {"runtime": runtime},
        "scaling": {
            "minReplicas": 1,
            "maxReplicas": 4,
            "metricsSource": "prometheus",
            "prometheusURL": prometheus_url,
            "intervalSeconds": 1,
            "scaleUpStabilizationSeconds": 0,
            "metricsMaxAgeSeconds": 10,
            "targetOccupancy": TARGET_OCCUPANCY,
            "scaleOutOccupancy": SCALE_OUT_OCCUPANCY,
            "scaleInHysteresis": 0.1,
            "growthWindowSeconds": GROWTH_WINDOW_SECONDS,
        },
    }


def _ready_pod(cluster: Cluster, ns: str, name: str) -> str | None:
    for pod in get_obj(cluster, "pods", namespace=ns)["items"]:
        labels = pod["metadata"].get("labels") or {}
        conds = (pod.get("status") or {}).get("conditions") or []
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
        if labels.get(SELECTOR_LABEL) == name and ready:
            return str(pod["metadata"]["name"])
    return None


def _unix(rfc3339: str) -> float:
    return datetime.strptime(rfc3339, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


@dataclass
class Seen:
    at: float
    replicas: int
    usage: float


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_sidecar_on_a_stock_server_drives_a_scale_out_before_the_fill(
    cluster: Cluster,
    cluster_namespace: str,
    operator: Operator,
    log_dir: Path,
    timings: Timings,
    runtime: str,
) -> None:
    if not (Path(PROMETHEUS).exists() or shutil.which("prometheus")):
        pytest.fail(f"Prometheus is not installed at {PROMETHEUS} (`make tools` installs it)")
    cluster.kubectl("apply", "-f", str(CRDS))
    with processes(log_dir / f"runtime-{runtime}") as group:
        try:
            _run_rising(cluster, cluster_namespace, operator, group, timings, runtime)
        except BaseException:
            print(group.report())
            raise


def _run_rising(
    cluster: Cluster,
    ns: str,
    operator: Operator,
    group: Processes,
    timings: Timings,
    runtime: str,
) -> None:
    p = f"[scenario 7 {runtime}]"
    name = f"rise-{runtime}"
    t_start = time.monotonic()
    prom_port = free_port()
    cluster.apply(_manifest(name, ns, _rising_spec(runtime, f"http://127.0.0.1:{prom_port}")))
    dep = _deployment(cluster, ns, name, operator)
    # The stand-in is the server these args start: its pool is the one the operator planned.
    block = int(container_arg(dep, "engine", "--block-size" if runtime == "vllm"
                              else "--page-size") or 0)  # fmt: skip
    if runtime == "vllm":
        blocks = int(container_arg(dep, "engine", "--num-gpu-blocks-override") or 0)
    else:
        blocks = int(container_arg(dep, "engine", "--max-total-tokens") or 0) // block
    budget = get_obj(cluster, "inferencedeployment", name, namespace=ns)["status"]["budget"]
    assert blocks == budget["kvBlocksPerPod"] and block == budget["blockSize"], (blocks, budget)
    sidecar_args = _containers(dep)["sidecar"]["args"]
    source = sidecar_args[sidecar_args.index("--source") :]

    pod = wait_until(
        lambda: _ready_pod(cluster, ns, name),
        timeout=180,
        what="the Deployment's kwok pod to be Ready",
        alive=operator.check_alive,
    )
    stand_in = StandIn(runtime, blocks, block).start()
    try:
        # --source (and --page-size) as the operator told the pod's sidecar.
        sidecar, sidecar_port = start_sidecar(
            group, stand_in.url, pod=pod, namespace=ns, inferencedeployment=name, source=source
        )
        sidecar_url = f"http://127.0.0.1:{sidecar_port}"

        def fresh_report() -> dict[str, Any] | None:
            rep: dict[str, Any] = http_json(f"{sidecar_url}/saturation")
            return rep if rep.get("fresh") and rep.get("capacity_blocks") else None

        report = wait_until(fresh_report, timeout=60, what=f"the sidecar to read {runtime}")
        assert report["source"] == runtime and report["capacity_blocks"] == blocks, report
        assert report["occupancy"] == pytest.approx(IDLE, abs=0.01), report
        # 0.5.3's /metrics has no pool size: the sidecar read it from the server info.
        assert (stand_in.server_info_reads > 0) == (runtime == "sglang"), stand_in.server_info_reads

        prom = Prometheus(group, {"headroom-sidecar": [f"127.0.0.1:{sidecar_port}"]},
                          port=prom_port)  # fmt: skip
        prom.wait_ready(timeout=120)
        wait_until(prom.targets_up, timeout=120, what="Prometheus to scrape the sidecar",
                   alive=prom.proc.check_alive)  # fmt: skip

        def status() -> dict[str, Any]:
            st = get_obj(cluster, "inferencedeployment", name, namespace=ns).get("status") or {}
            assert isinstance(st, dict)
            return st

        def replicas() -> int:
            return int(get_obj(cluster, "deployment", name, namespace=ns)["spec"]["replicas"])

        wait_until(
            lambda: bool((status().get("kv") or {}).get("podsReporting")),
            timeout=120,
            what="the operator to read the pod's KV from Prometheus",
            alive=operator.check_alive,
        )
        timings.figure(f"scenario 7 {runtime}: stand-in reporting", time.monotonic() - t_start)
        # Idle first, so the operator's growth window holds flat demand before the rise.
        settle_until = time.monotonic() + GROWTH_WINDOW_SECONDS + 3
        while time.monotonic() < settle_until:
            operator.check_alive()
            time.sleep(1.0)
        assert replicas() == 1, "the operator scaled an idle deployment"

        stand_in.rise_at = time.time()
        t_fill = stand_in.time_at(1.0)
        seen: Seen | None = None
        while time.time() < t_fill + FILL_GRACE_SECONDS:
            for proc in (sidecar, prom.proc):
                proc.check_alive()
            operator.check_alive()
            n = replicas()
            if n > 1:
                seen = Seen(at=time.time(), replicas=n, usage=stand_in.usage())
                break
            time.sleep(0.25)
    finally:
        stand_in.stop()

    st = status()
    ups = [d for d in st.get("lastDecisions") or [] if d["to"] > d["from"]]
    first = ups[0] if ups else None
    print(f"\n{p} pool {blocks} blocks of {block}; usage {IDLE:.0%} -> 100% over "
          f"{RISE_SECONDS:.0f} s")  # fmt: skip
    assert seen is not None, (
        f"the operator never scaled out while the {runtime} stand-in filled; kv: "
        f"{json.dumps(st.get('kv'))}; lastDecisions: {st.get('lastDecisions')}"
    )
    assert first is not None, f"no scale-out in status.lastDecisions: {st.get('lastDecisions')}"
    decided_by = min(seen.at, _unix(first["time"]) + 1.0)
    t_line = stand_in.time_at(SCALE_OUT_OCCUPANCY)
    rel = stand_in.rise_at or 0.0
    print(f"{p} decision {first['from']} -> {first['to']} {first['reason']}: "
          f"{json.dumps(first['inputs'])}")  # fmt: skip
    print(f"{p} decided by {decided_by - rel:.1f} s after the rise began (usage then "
          f"{stand_in.usage(decided_by):.0%}); seen at usage {seen.usage:.0%}")  # fmt: skip
    print(f"{p} LEAD TIME to usage {SCALE_OUT_OCCUPANCY:.0%}: {t_line - decided_by:.1f} s; "
          f"to the fill: {t_fill - decided_by:.1f} s")  # fmt: skip
    timings.figure(f"scenario 7 {runtime}: lead time, decision -> fill", t_fill - decided_by)
    assert first["applied"] is True and first["from"] == 1, first
    assert first["reason"] in ("KVForecast", "DemandForecast"), (
        f"the first scale-out must come from the forecast, not {first['reason']}"
    )
    inputs = first["inputs"]
    assert inputs["forecastBlocks"] is not None and inputs["neededReplicas"] > 1, inputs
    assert inputs["meanOccupancy"] is not None
    assert inputs["meanOccupancy"] < SCALE_OUT_OCCUPANCY, inputs
    assert decided_by < t_line, (
        f"the scale-out was decided {decided_by - t_line:.1f} s after the usage reached "
        f"{SCALE_OUT_OCCUPANCY:.0%}: a threshold autoscaler would have been as early"
    )
    assert seen.usage < 1.0 and decided_by < t_fill
