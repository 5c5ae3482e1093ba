"""The engine container per runtime: headroom, vLLM and SGLang told the planned pool, their
probes, /dev/shm, images, and the sidecar reading each one's stats."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel
from rendered import containers, flags

from headroom.contract.ports import ENGINE_PORT, ENGINE_STATS_PORT
from headroom.operator.crd.models import (
    HEADROOM_ENGINE_IMAGE,
    HEADROOM_IMAGE,
    RUNTIME_IMAGES,
    InferenceDeploymentSpec,
)
from headroom.operator.reconcile.children import Owner, deployment
from headroom.operator.reconcile.runtimes import (
    DEFAULT_IMAGES,
    RUNTIMES,
    HeadroomImages,
    engine_command,
    sglang_command,
    vllm_command,
)
from headroom.operator.reconcile.sizing import Sizing, SpecError, plan_input, size
from headroom.sidecar.config import SidecarConfig

ROOT = Path(__file__).resolve().parents[1]
VLLM_EXAMPLE = ROOT / "examples" / "llama-3.1-70b-vllm-tp4.yaml"
OWNER = Owner(name="chat", namespace="team-a", uid="1234-abcd")


def spec(engine: dict[str, Any] | None = None, **sections: Any) -> InferenceDeploymentSpec:
    """The 8B model; vLLM and SGLang on two GPUs (tp 2), the single-GPU headroom engine on one."""
    stock = (engine or {}).get("runtime") in ("vllm", "sglang")
    raw: dict[str, Any] = {
        "model": {"preset": "llama-3.1-8b", "path": "/models/l8b"},
        "gpu": {"type": "h100-80gb", **({"countPerPod": 2, "tensorParallel": 2} if stock else {})},
        "traffic": {"peakConcurrency": 400, "contextTokens": 4096},
        "engine": engine or {},
    }
    raw.update(sections)
    return InferenceDeploymentSpec.model_validate(raw)


def pool(s: InferenceDeploymentSpec) -> tuple[Sizing, int, int]:
    sizing = size(s)
    assert sizing.feasible, sizing.reason
    return sizing, sizing.plan.kv_blocks_per_pod, sizing.plan.block_size


# (runtime, engine overrides, flag -> expected value; a callable takes (blocks, block size))
FLAG_TABLE: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("vllm", {}, {
        "--num-gpu-blocks-override": lambda b, k: str(b),
        "--block-size": "16", "--kv-cache-dtype": "auto", "--enable-prefix-caching": True,
        "--tensor-parallel-size": "2", "--pipeline-parallel-size": "1",
        "--max-model-len": "4096", "--max-num-seqs": "256", "--max-num-batched-tokens": "8192",
        "--gpu-memory-utilization": "0.9", "--port": "8000", "--host": "0.0.0.0",
        "--served-model-name": "llama-3.1-8b",
    }),
    ("vllm", {"kvCacheDtype": "fp8", "blockSize": 32, "prefixCaching": False,
              "maxModelLen": 8192, "maxNumSeqs": 64, "maxNumBatchedTokens": 16384,
              "gpuMemoryUtilization": 0.85}, {
        "--num-gpu-blocks-override": lambda b, k: str(b),
        "--block-size": "32", "--kv-cache-dtype": "fp8", "--no-enable-prefix-caching": True,
        "--max-model-len": "8192", "--max-num-seqs": "64", "--max-num-batched-tokens": "16384",
        "--gpu-memory-utilization": "0.85",
    }),
    ("sglang", {}, {
        "--model-path": "/models/l8b", "--served-model-name": "llama-3.1-8b",
        "--host": "0.0.0.0", "--port": "8000", "--tp-size": "2", "--pp-size": "1",
        "--max-total-tokens": lambda b, k: str(b * k), "--page-size": "16",
        "--kv-cache-dtype": "auto", "--context-length": "4103", "--enable-metrics": True,
        "--max-running-requests": "256", "--chunked-prefill-size": "8192",
        "--mem-fraction-static": "0.9",
    }),
    ("sglang", {"kvCacheDtype": "fp8", "blockSize": 64, "prefixCaching": False}, {
        "--max-total-tokens": lambda b, k: str(b * k), "--page-size": "64",
        "--kv-cache-dtype": "fp8_e4m3", "--disable-radix-cache": True,
    }),
    ("headroom", {"kvCacheDtype": "int8", "attentionBackend": "cuda"}, {
        "--num-blocks": lambda b, k: str(b), "--block-size": "16", "--kv-cache-dtype": "int8",
        "--attention-backend": "cuda", "--model": "/models/l8b",
    }),
]  # fmt: skip


@pytest.mark.parametrize(
    ("runtime", "engine", "expected"),
    FLAG_TABLE,
    ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(FLAG_TABLE)],
)
def test_engine_flags_come_from_the_plan(
    runtime: str, engine: dict[str, Any], expected: dict[str, Any]
) -> None:
    s = spec({"runtime": runtime, **engine})
    sizing, blocks, block = pool(s)
    got = flags(engine_command(s, sizing, "chat").args)
    for flag, want in expected.items():
        value = want(blocks, block) if callable(want) else want
        assert got.get(flag) == value, f"{runtime} {flag}: {got.get(flag)!r} != {value!r}"


@pytest.mark.parametrize(
    ("runtime", "command"),
    [
        ("headroom", ["headroom"]),
        ("vllm", ["vllm", "serve", "/models/l8b"]),
        ("sglang", ["python3", "-m", "sglang.launch_server"]),
    ],
)
def test_command_is_spelled_out(runtime: str, command: list[str]) -> None:
    s = spec({"runtime": runtime})
    assert engine_command(s, size(s), "chat").command == command
    assert set(RUNTIMES) == {"headroom", "vllm", "sglang"}


def test_prefix_caching_flag_is_exclusive() -> None:
    for on in (True, False):
        v = vllm_command(*_spec_sizing({"runtime": "vllm", "prefixCaching": on}), "chat").args
        assert ("--enable-prefix-caching" in v) is on
        assert ("--no-enable-prefix-caching" in v) is not on
        g = sglang_command(*_spec_sizing({"runtime": "sglang", "prefixCaching": on}), "chat").args
        assert ("--disable-radix-cache" in g) is not on


def _spec_sizing(engine: dict[str, Any]) -> tuple[InferenceDeploymentSpec, Sizing]:
    s = spec(engine)
    return s, size(s)


@pytest.mark.parametrize(
    ("runtime", "image", "sidecar_image", "source"),
    [
        ("headroom", HEADROOM_ENGINE_IMAGE, HEADROOM_ENGINE_IMAGE, []),
        ("vllm", "vllm/vllm-openai:v0.11.0", HEADROOM_IMAGE, ["--source", "vllm"]),
        ("sglang", "lmsysorg/sglang:v0.5.3", HEADROOM_IMAGE,
         ["--source", "sglang", "--page-size", "16"]),
    ],
)  # fmt: skip
def test_images_and_sidecar_source_follow_the_runtime(
    runtime: str, image: str, sidecar_image: str, source: list[str]
) -> None:
    assert RUNTIME_IMAGES[runtime] == image
    s = spec({"runtime": runtime})
    c = containers(deployment(OWNER, s, size(s), replicas=1))
    assert c["engine"]["image"] == image and c["sidecar"]["image"] == sidecar_image
    args = c["sidecar"]["args"]
    port = 8001 if runtime == "headroom" else 8000  # headroom's stats listener, else the API
    assert args[:3] == ["sidecar", "--engine-url", f"http://127.0.0.1:{port}"]
    got = flags(args)
    assert [a for f in ("--source", "--page-size") if f in got for a in (f, got[f])] == source


def test_explicit_images_win() -> None:
    s = spec({"runtime": "vllm", "image": "registry.local/vllm:v0.11.1",
              "sidecarImage": "registry.local/headroom:0.1.0"})  # fmt: skip
    c = containers(deployment(OWNER, s, size(s), replicas=1))
    assert c["engine"]["image"] == "registry.local/vllm:v0.11.1"
    assert c["sidecar"]["image"] == "registry.local/headroom:0.1.0"
    h = spec({"image": "registry.local/headroom:dev"})
    c = containers(deployment(OWNER, h, size(h), replicas=1))
    assert c["engine"]["image"] == c["sidecar"]["image"] == "registry.local/headroom:dev"


MIRROR = HeadroomImages.derive("registry.example.com:5000/ml/headroom:7.1")


def test_the_operators_headroom_image_is_derived_into_both() -> None:
    assert HeadroomImages.derive(HEADROOM_IMAGE) == DEFAULT_IMAGES == HeadroomImages()
    assert DEFAULT_IMAGES.engine == HEADROOM_ENGINE_IMAGE
    assert (MIRROR.headroom, MIRROR.engine) == (
        "registry.example.com:5000/ml/headroom:7.1",
        "registry.example.com:5000/ml/headroom-engine:7.1",
    )


@pytest.mark.parametrize(
    ("runtime", "engine", "sidecar"),
    [
        ("headroom", MIRROR.engine, MIRROR.engine),
        ("vllm", "vllm/vllm-openai:v0.11.0", MIRROR.headroom),
        ("sglang", "lmsysorg/sglang:v0.5.3", MIRROR.headroom),
    ],
)
def test_pods_run_the_operators_headroom_images(runtime: str, engine: str, sidecar: str) -> None:
    # A user who pushed headroom's images to their own registry and told the operator: no pod
    # may still pull ghcr.io's.
    s = spec({"runtime": runtime})
    c = containers(deployment(OWNER, s, size(s), 1, MIRROR))
    assert (c["engine"]["image"], c["sidecar"]["image"]) == (engine, sidecar)


def test_explicit_images_win_over_the_operators() -> None:
    s = spec({"runtime": "vllm", "sidecarImage": "registry.local/headroom@sha256:" + "a" * 64})
    c = containers(deployment(OWNER, s, size(s), 1, MIRROR))
    assert c["sidecar"]["image"] == "registry.local/headroom@sha256:" + "a" * 64
    h = spec({"image": "registry.local/headroom-engine@sha256:" + "b" * 64})
    c = containers(deployment(OWNER, h, size(h), 1, MIRROR))
    assert c["engine"]["image"] == c["sidecar"]["image"] == h.engine.image
    h = spec({"sidecarImage": "registry.local/headroom:dev"})
    c = containers(deployment(OWNER, h, size(h), 1, MIRROR))
    assert c["engine"]["image"] == MIRROR.engine
    assert c["sidecar"]["image"] == "registry.local/headroom:dev"


@pytest.mark.parametrize(
    ("image", "says"),
    [
        ("registry.example.com/headroom", "has no tag"),
        ("localhost:5000/headroom", "has no tag"),  # a port is no tag
        ("registry.example.com/headroom@sha256:" + "a" * 64, "pinned by digest"),
        ("registry.example.com/headroom:1@sha256:" + "a" * 64, "pinned by digest"),
        ("registry.example.com/headroom:1.0:0.1.0", "not an image reference"),
        ("registry.example.com/Headroom:1", "not an image reference"),
        ("registry.example.com/headroom:", "not an image reference"),
        ("registry.example.com//headroom:1", "not an image reference"),
    ],
)
def test_an_image_the_engines_cannot_be_derived_from_is_refused(image: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        HeadroomImages.derive(image)


@pytest.mark.parametrize(
    ("gpu", "block_size", "runs"),
    [("h200-141gb", 16, 64), ("h200-141gb", 128, 64), ("b200-192gb", 16, 128),
     ("b200-192gb", 64, 128)],
)  # fmt: skip
def test_vllm_plans_mla_with_the_block_size_it_forces(gpu: str, block_size: int, runs: int) -> None:
    # vLLM v0.11.0 sets an MLA model's block size to exactly FlashMLA's 64 (CUTLASS MLA's 128 on
    # Blackwell) and still allocates --num-gpu-blocks-override blocks: planned at 16 tokens, 4x
    # the pool; at 128 on Hopper, half of it (its test is `!= 64`, not a multiple of 64).
    s = spec({"runtime": "vllm", "blockSize": block_size},
             model={"preset": "deepseek-v3", "path": "/models/dsv3"},
             gpu={"type": gpu, "countPerPod": 8})  # fmt: skip
    sizing, blocks, planned = pool(s)
    args = vllm_command(s, sizing, "chat").args
    assert planned == runs and args[args.index("--block-size") + 1] == str(runs)
    assert args[args.index("--num-gpu-blocks-override") + 1] == str(blocks)
    # The pool's bytes are the same: the count follows the block size.
    model = s.model.model_dump(by_alias=True)
    flat = pool(spec({"runtime": "sglang", "blockSize": runs}, model=model,
                     gpu={"type": gpu, "countPerPod": 8}))  # fmt: skip
    assert flat[1] == blocks
    llama = pool(spec({"runtime": "vllm", "blockSize": block_size}))
    assert llama[2] == block_size  # not MLA: the spec's block size


def test_vllm_with_mla_needs_the_gpu_type_to_know_its_block_size() -> None:
    """gpu.memoryGiB alone does not say Hopper or Blackwell (64- or 128-token MLA blocks): the
    override would be twice or half the planned bytes, so the spec is refused; the type beside
    the memory plans Blackwell's 128."""
    model = {"preset": "deepseek-v3", "path": "/models/dsv3"}
    with pytest.raises(SpecError, match=r"needs gpu\.type, not gpu\.memoryGiB alone"):
        size(spec({"runtime": "vllm"}, model=model, gpu={"memoryGiB": 179, "countPerPod": 8}))
    both = spec({"runtime": "vllm"}, model=model,
                gpu={"type": "b200-192gb", "memoryGiB": 179, "countPerPod": 8})  # fmt: skip
    assert pool(both)[2] == 128
    # Neither SGLang (its page size is the spec's) nor a model without MLA needs it.
    assert pool(spec({"runtime": "sglang"}, model=model,
                     gpu={"memoryGiB": 179, "countPerPod": 8}))[2] == 16  # fmt: skip
    assert pool(spec({"runtime": "vllm"}, gpu={"memoryGiB": 80}))[2] == 16


def test_sglang_page_size_matches_the_engine() -> None:
    s = spec({"runtime": "sglang", "blockSize": 32})
    c = containers(deployment(OWNER, s, size(s), replicas=1))
    sidecar, engine = flags(c["sidecar"]["args"]), flags(c["engine"]["args"])
    assert sidecar["--page-size"] == engine["--page-size"] == "32"


@pytest.mark.parametrize(
    ("runtime", "ready"), [("headroom", "/ready"), ("vllm", "/health"), ("sglang", "/health")]
)
@pytest.mark.parametrize(("timeout", "threshold"), [(None, 90), (600, 60), (1805, 181)])
def test_probes_survive_model_load(
    runtime: str, ready: str, timeout: int | None, threshold: int
) -> None:
    engine: dict[str, Any] = {"runtime": runtime}
    if timeout is not None:
        engine["startupTimeoutSeconds"] = timeout
    s = spec(engine)
    e = containers(deployment(OWNER, s, size(s), replicas=1))["engine"]
    startup = e["startupProbe"]
    port = "stats" if runtime == "headroom" else "http"
    assert startup["httpGet"] == {"path": "/health", "port": port}
    assert startup["periodSeconds"] == 10 and startup["failureThreshold"] == threshold
    assert startup["periodSeconds"] * startup["failureThreshold"] >= (timeout or 900)
    assert e["readinessProbe"]["httpGet"]["path"] == ready
    assert e["livenessProbe"]["httpGet"]["path"] == "/health"


def test_headroom_probes_and_sidecar_use_the_engine_s_stats_listener() -> None:
    # On the API's port they would wait behind API connections once those reach the engine's
    # --max-connections: the liveness probe would restart a pod that is only busy.
    s = spec()
    c = containers(deployment(OWNER, s, size(s), replicas=1))
    e = c["engine"]
    assert flags(e["args"])["--stats-port"] == str(ENGINE_STATS_PORT) == "8001"
    assert flags(e["args"])["--port"] == str(ENGINE_PORT)
    assert e["ports"] == [
        {"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"},
        {"name": "stats", "containerPort": ENGINE_STATS_PORT, "protocol": "TCP"},
    ]
    for probe, path in (("startupProbe", "/health"), ("livenessProbe", "/health"),
                        ("readinessProbe", "/ready")):  # fmt: skip
        assert e[probe]["httpGet"] == {"path": path, "port": "stats"}, probe
    url = flags(c["sidecar"]["args"])["--engine-url"]
    assert url == f"http://127.0.0.1:{ENGINE_STATS_PORT}"
    # The stats listener serves /stats, the only route the headroom source reads.
    assert SidecarConfig(engine_url=url, source="headroom").poll_url == f"{url}/stats"


@pytest.mark.parametrize("runtime", ["vllm", "sglang"])
def test_stock_engines_keep_one_port_for_probes_and_the_sidecar(runtime: str) -> None:
    s = spec({"runtime": runtime})
    c = containers(deployment(OWNER, s, size(s), replicas=1))
    e = c["engine"]
    assert "--stats-port" not in e["args"]
    assert e["ports"] == [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert e[probe]["httpGet"]["port"] == "http", probe
    assert flags(c["sidecar"]["args"])["--engine-url"] == f"http://127.0.0.1:{ENGINE_PORT}"


SHM_CASES = [
    (runtime, gpu, shm)
    for gpu, shm in [
        ({"type": "h100-80gb"}, False),
        ({"type": "h100-80gb", "countPerPod": 2, "tensorParallel": 2}, True),
        ({"type": "h100-80gb", "countPerPod": 2, "tensorParallel": 1}, True),  # pipeline parallel
    ]
    for runtime in ("headroom", "vllm", "sglang")
    if runtime != "headroom" or not shm  # the headroom engine runs on one GPU
]


@pytest.mark.parametrize(("runtime", "gpu", "shm"), SHM_CASES)
def test_shm_only_with_several_ranks(runtime: str, gpu: dict[str, Any], shm: bool) -> None:
    s = spec({"runtime": runtime}, gpu=gpu)
    dep = deployment(OWNER, s, size(s), replicas=1)
    pod = dep["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"] for m in containers(dep)["engine"]["volumeMounts"]}
    assert ("shm" in volumes) is shm and ("/dev/shm" in mounts) is shm
    if shm:
        assert volumes["shm"]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("runtime", ["vllm", "sglang"])
def test_stock_runtimes_run_hardened_with_writable_caches(runtime: str) -> None:
    s = spec({"runtime": runtime})
    e = containers(deployment(OWNER, s, size(s), replicas=1))["engine"]
    env = {v["name"]: v["value"] for v in e["env"]}
    assert env["HOME"] == "/tmp" and env["XDG_CACHE_HOME"] == "/tmp/.cache"
    assert env["USER"]  # getpass works for a uid without a passwd entry
    sc = e["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]


@pytest.mark.parametrize("runtime", ["vllm", "sglang"])
def test_stock_runtime_cannot_load_the_tiny_model(runtime: str) -> None:
    s = spec({"runtime": runtime}, model={"preset": "llama-3.1-8b"})
    with pytest.raises(SpecError, match=f"runtime {runtime} cannot load 'tiny'"):
        size(s)


def test_vllm_example_renders_tp4_with_the_planned_pool() -> None:
    doc = yaml.safe_load(VLLM_EXAMPLE.read_text())
    s = InferenceDeploymentSpec.model_validate(doc["spec"])
    assert s.engine.runtime == "vllm" and s.engine.image is None
    sizing, blocks, block = pool(s)
    owner = Owner(name=doc["metadata"]["name"], namespace=doc["metadata"]["namespace"], uid="u")
    dep = deployment(owner, s, sizing, replicas=sizing.replicas)
    c = containers(dep)
    engine = c["engine"]
    assert engine["image"] == "vllm/vllm-openai:v0.11.0"
    assert engine["command"] == ["vllm", "serve", "/models/llama-3.1-70b-instruct"]
    f = flags(engine["args"])
    assert f["--num-gpu-blocks-override"] == str(blocks) and block == 16
    assert blocks == 31_526  # `headroom plan ... --tp 4 --gpu-memory-utilization 0.92`
    assert f["--tensor-parallel-size"] == "4" and f["--pipeline-parallel-size"] == "1"
    assert f["--block-size"] == "16" and f["--kv-cache-dtype"] == "auto"
    assert f["--max-model-len"] == "16384" and f["--gpu-memory-utilization"] == "0.92"
    assert f["--served-model-name"] == "llama-3.1-70b"
    assert f["--enable-prefix-caching"] is True
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert engine["startupProbe"]["failureThreshold"] * 10 == 1800
    assert "/dev/shm" in {m["mountPath"] for m in engine["volumeMounts"]}
    sidecar = flags(c["sidecar"]["args"])
    assert sidecar["--source"] == "vllm" and sidecar["--planned-blocks"] == str(blocks)
    assert c["sidecar"]["image"] == HEADROOM_IMAGE
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["headroom.dev/kv-blocks"] == str(blocks)


# ---------------------------------------------------------------------------- knobs reach the pod


class _Reads:
    """Wraps a spec and records every field `plan_input()` reads, as dotted paths."""

    def __init__(self, obj: Any, path: str, seen: set[str]) -> None:
        self._obj, self._path, self._seen = obj, path, seen

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._obj, name)
        path = f"{self._path}.{name}".lstrip(".")
        if isinstance(value, BaseModel):
            return _Reads(value, path, self._seen)
        self._seen.add(path)
        return value


def _plan_input_reads(s: InferenceDeploymentSpec) -> set[str]:
    seen: set[str] = set()
    plan_input(_Reads(s, "", seen))  # type: ignore[arg-type]
    return seen


# Every engine knob the budget reads from the spec, the value the table sets, and the flag that
# carries it into each runtime's engine (flag, value as rendered). `None`: the pool flag the plan
# fixes carries it (the engine is handed the planned pool and needs no flag of its own).
POOL_FLAG = {"headroom": "--num-blocks", "vllm": "--num-gpu-blocks-override",
             "sglang": "--max-total-tokens"}  # fmt: skip
KNOBS: list[tuple[str, dict[str, Any], dict[str, tuple[str, Any] | None]]] = [
    ("engine.block_size", {"engine": {"blockSize": 32}}, {
        "headroom": ("--block-size", "32"), "vllm": ("--block-size", "32"),
        "sglang": ("--page-size", "32")}),
    ("engine.kv_cache_dtype", {"engine": {"kvCacheDtype": "fp8"}}, {
        "headroom": ("--kv-cache-dtype", "fp8"), "vllm": ("--kv-cache-dtype", "fp8"),
        "sglang": ("--kv-cache-dtype", "fp8_e4m3")}),
    ("engine.prefix_caching", {"engine": {"prefixCaching": False}}, {
        "headroom": ("--no-enable-prefix-caching", True),
        "vllm": ("--no-enable-prefix-caching", True), "sglang": ("--disable-radix-cache", True)}),
    ("engine.max_num_seqs", {"engine": {"maxNumSeqs": 64}}, {
        "headroom": ("--max-num-seqs", "64"), "vllm": ("--max-num-seqs", "64"),
        "sglang": ("--max-running-requests", "64")}),
    ("engine.max_num_batched_tokens", {"engine": {"maxNumBatchedTokens": 4096}}, {
        "headroom": ("--max-num-batched-tokens", "4096"),
        "vllm": ("--max-num-batched-tokens", "4096"),
        "sglang": ("--chunked-prefill-size", "4096")}),
    ("engine.gpu_memory_utilization", {"engine": {"gpuMemoryUtilization": 0.8}}, {
        "headroom": None, "vllm": ("--gpu-memory-utilization", "0.8"),
        "sglang": ("--mem-fraction-static", "0.8")}),
    ("engine.max_model_len", {"engine": {"maxModelLen": 8192}}, {
        "headroom": ("--max-model-len", "8192"), "vllm": ("--max-model-len", "8192"),
        "sglang": ("--context-length", "8199")}),  # SGLang serves 7 tokens less
    ("gpu.tensor_parallel", {"gpu": {"type": "h100-80gb", "countPerPod": 4, "tensorParallel": 4}}, {
        "headroom": ("--tensor-parallel-size", "4"), "vllm": ("--tensor-parallel-size", "4"),
        "sglang": ("--tp-size", "4")}),
    ("gpu.count_per_pod", {"gpu": {"type": "h100-80gb", "countPerPod": 2, "tensorParallel": 1}}, {
        "headroom": ("--pipeline-parallel-size", "2"), "vllm": ("--pipeline-parallel-size", "2"),
        "sglang": ("--pp-size", "2")}),
]  # fmt: skip
# What the budget reads that no engine is told: the GPU's memory and the traffic, which size the
# pool (each runtime's pool flag is checked against the plan below) and the replica count.
# engine.runtime picks the engine itself (and, for vLLM with an MLA model, the block size).
SIZING_ONLY = {"gpu.memory_gib", "gpu.type", "traffic.peak_concurrency",
               "traffic.context_tokens", "traffic.prefix_hit_ratio", "engine.runtime"}  # fmt: skip


def test_the_knob_table_covers_every_field_the_budget_reads() -> None:
    s = spec({"maxModelLen": 8192})
    # The model's architecture sizes the pool too; the engine reads it from the weights.
    reads = {r for r in _plan_input_reads(s) if not r.startswith("model.")}
    knobs = {k for k, _, _ in KNOBS}
    # prefix_caching is read only when traffic.prefixHitRatio is set; max_model_len via sizing.
    assert reads - SIZING_ONLY <= knobs, f"knobs without a row: {reads - SIZING_ONLY - knobs}"
    assert knobs - reads <= {"engine.prefix_caching", "engine.max_model_len"}


def _headroom_serve_args(args: list[str]) -> argparse.Namespace:
    """`headroom serve`'s own parser over the rendered args (what the container runs)."""
    from headroom.contract.cli import build_parser

    return build_parser("serve").parse_args(args)


KNOB_CASES = [
    pytest.param(runtime, knob, patch, carried, id=f"{knob}-{runtime}")
    for knob, patch, carried in KNOBS
    for runtime in ("headroom", "vllm", "sglang")
    # The headroom engine's parallelism knobs are refused by the spec (test below).
    if not (runtime == "headroom" and knob.startswith("gpu."))
]  # fmt: skip


@pytest.mark.parametrize(("knob", "patch"), [(k, p) for k, p, _ in KNOBS if k.startswith("gpu.")])
def test_the_spec_refuses_several_gpus_for_the_single_gpu_headroom_engine(
    knob: str, patch: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match="the headroom engine runs on one GPU"):
        spec({"runtime": "headroom"}, gpu=patch["gpu"])
    spec({"runtime": "vllm"}, gpu=patch["gpu"])  # the same GPUs for a stock engine are fine


@pytest.mark.parametrize(("runtime", "knob", "patch", "carried"), KNOB_CASES)
def test_every_budget_knob_reaches_the_engine(
    runtime: str, knob: str, patch: dict[str, Any], carried: dict[str, Any]
) -> None:
    raw = {**patch, "engine": {"runtime": runtime, **patch.get("engine", {})}}
    gpu = raw.pop("gpu", {"type": "h100-80gb"})
    s = spec(raw["engine"], gpu=gpu)
    sizing = size(s)
    args = engine_command(s, sizing, "chat").args
    got = flags(args)
    plan = sizing.plan
    pool = plan.kv_blocks_per_pod * (plan.block_size if runtime == "sglang" else 1)
    assert got[POOL_FLAG[runtime]] == str(pool), "the planned pool"
    want = carried[runtime]
    if want is not None:
        flag, value = want
        assert got.get(flag) == value, f"{runtime}: {knob} -> {flag} {got.get(flag)!r}"
    if runtime == "headroom":
        # The engine's own parser reads the same values back (no flag it does not know).
        ns = _headroom_serve_args(args)
        assert ns.num_blocks == plan.kv_blocks_per_pod and ns.block_size == s.engine.block_size
        assert ns.max_num_batched_tokens == s.engine.max_num_batched_tokens
        assert ns.max_num_seqs == s.engine.max_num_seqs
        assert ns.max_model_len == sizing.max_model_len
        assert ns.kv_cache_dtype == s.engine.kv_cache_dtype
        assert ns.enable_prefix_caching is s.engine.prefix_caching


def test_the_headroom_engine_runs_on_the_pods_gpu() -> None:
    s = spec({"runtime": "headroom"}, gpu={"type": "h100-80gb"})
    assert _headroom_serve_args(engine_command(s, size(s), "chat").args).device == "cuda"


# ---------------------------------------------------------------------------- API key


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize(
    ("runtime", "engine_env"),
    [("headroom", "HEADROOM_API_KEY"), ("vllm", "VLLM_API_KEY"), ("sglang", "HEADROOM_API_KEY")],
)
def test_api_key_reaches_the_engine_from_the_secret_never_as_a_literal(
    runtime: str, engine_env: str
) -> None:
    s = spec({"runtime": runtime, "apiKeySecret": {"name": "chat-keys", "key": "openai"}})
    c = containers(deployment(OWNER, s, size(s), replicas=1))
    engine = c["engine"]
    ref = {"secretKeyRef": {"name": "chat-keys", "key": "openai"}}
    assert _env(engine)[engine_env]["valueFrom"] == ref
    args = engine["args"]
    if runtime == "sglang":
        # SGLang reads its key from --api-key only: the kubelet expands $(VAR) from the env, so
        # the pod spec holds a reference, not the key.
        assert flags(args)["--api-key"] == f"$({engine_env})"
        # SGLang 0.5.3 logs its ServerArgs, the expanded key among them, at info as it starts.
        assert flags(args)["--log-level"] == "warning"
    else:
        assert "--api-key" not in args  # vLLM reads VLLM_API_KEY, headroom HEADROOM_API_KEY
    for value in (*args, *engine["command"]):
        assert "chat-keys" not in value and "openai" not in value
    # Probes stay open: none is under a path the engines guard (/v1).
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert not engine[probe]["httpGet"]["path"].startswith("/v1")
    sidecar_env = _env(c["sidecar"])
    if runtime == "sglang":
        # SGLang guards everything but /health and /metrics, its server info among it.
        assert sidecar_env["HEADROOM_API_KEY"]["valueFrom"] == ref
    else:
        assert "HEADROOM_API_KEY" not in sidecar_env  # /stats and vLLM's /metrics are open


def test_headroom_engine_reads_the_env_var_the_pod_sets() -> None:
    from headroom.engine.server.auth import API_KEY_ENV, PROTECTED_PREFIX
    from headroom.operator.reconcile.runtimes import API_KEY_ENVS

    assert API_KEY_ENVS["headroom"] == API_KEY_ENV
    s = spec({"apiKeySecret": {"name": "k"}})
    e = containers(deployment(OWNER, s, size(s), replicas=1))["engine"]
    assert not e["readinessProbe"]["httpGet"]["path"].startswith(PROTECTED_PREFIX)


def test_no_secret_no_key_env() -> None:
    for runtime in ("headroom", "vllm", "sglang"):
        s = spec({"runtime": runtime})
        c = containers(deployment(OWNER, s, size(s), replicas=1))
        for container in c.values():
            assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in container["env"])
        assert "--api-key" not in c["engine"]["args"]


# ---------------------------------------------------------------------------- sidecar


@pytest.mark.parametrize("runtime", ["headroom", "vllm", "sglang"])
def test_sidecar_is_told_the_planned_pool(runtime: str) -> None:
    from headroom.contract.cli import build_parser

    s = spec({"runtime": runtime})
    sizing = size(s)
    sidecar = containers(deployment(OWNER, s, sizing, replicas=1))["sidecar"]
    assert sidecar["command"] == ["headroom"]
    # The sidecar's own parser takes every rendered flag.
    args = build_parser("sidecar").parse_args(sidecar["args"])
    assert args.planned_blocks == sizing.plan.kv_blocks_per_pod
    assert args.source == runtime


def test_vllm_is_planned_without_its_null_block() -> None:
    # vLLM's BlockPool keeps block 0 of --num-gpu-blocks-override N: sequences get N - 1. A pool
    # of exactly one maxModelLen sequence's blocks cannot schedule it on vLLM, but can on SGLang.
    need = 131072 // 16

    def sizing(runtime: str, gib: float) -> Sizing:
        return size(spec({"runtime": runtime, "prefixCaching": False},
                         gpu={"memoryGiB": gib},
                         traffic={"peakConcurrency": 4, "contextTokens": 131072}))  # fmt: skip

    lo, hi = 16.0, 64.0  # the least memory whose pool holds `need` blocks
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if sizing("sglang", mid).plan.kv_blocks_per_pod >= need else (mid, hi)
    exact = sizing("sglang", hi)
    assert exact.plan.kv_blocks_per_pod == need and exact.feasible
    assert exact.plan.sequences_per_pod == 1
    on_vllm = sizing("vllm", hi)
    assert on_vllm.plan.kv_blocks_per_pod == need
    assert not on_vllm.feasible and "of them the engine's own" in (on_vllm.reason or "")
    assert plan_input(spec({"runtime": "vllm"})).reserved_blocks == 1
    assert plan_input(spec({"runtime": "headroom"})).reserved_blocks == 0


@pytest.mark.parametrize(
    ("preset", "unified"), [("gemma-2-27b", True), ("llama-3.1-8b", False), ("mistral-7b", False)]
)
def test_vllm_pages_a_hybrid_model_as_the_plan_prices_it(preset: str, unified: bool) -> None:
    # Gemma 2's sliding-window and full layers would be two vLLM KV groups whose blocks hold half
    # the layers: the override's N blocks were half the planned bytes, and each sequence took
    # blocks in both groups. Unified, one block holds every layer. Mistral (every layer sliding)
    # and Llama (none) are one group already.
    s = spec({"runtime": "vllm"}, model={"preset": preset, "path": "/models/m"},
             gpu={"type": "h100-80gb", "countPerPod": 2, "tensorParallel": 2})  # fmt: skip
    args = vllm_command(s, size(s), "chat").args
    assert ("--disable-hybrid-kv-cache-manager" in args) is unified


@pytest.mark.parametrize("runtime", ["headroom", "vllm", "sglang"])
def test_every_cache_the_engine_writes_is_on_a_writable_mount(runtime: str) -> None:
    # The root filesystem is read-only: the headroom engine writes its compiled CUDA kernels
    # under $HEADROOM_CACHE, which the image sets under /home (on the read-only root), so a GPU
    # pod could compile but never load a kernel.
    s = spec({"runtime": runtime})
    e = containers(deployment(OWNER, s, size(s), replicas=1))["engine"]
    env = {v["name"]: v.get("value") for v in e["env"]}
    writable = [m["mountPath"] for m in e["volumeMounts"] if not m.get("readOnly")]
    for var in ("HOME", "XDG_CACHE_HOME", "HEADROOM_CACHE"):
        assert any(env[var] == w or env[var].startswith(w + "/") for w in writable), var
    assert e["securityContext"]["readOnlyRootFilesystem"]


def test_sglang_s_context_length_serves_max_model_len_within_the_model_s_positions() -> None:
    # SGLang 0.5.3 refuses a prompt + max_new_tokens of --context-length or more and aborts a
    # prompt of context_length - 6: 7 more tokens serve what vLLM serves at maxModelLen. Past
    # the model's max_position_embeddings SGLang would not start: capped there.
    from headroom.operator.reconcile.runtimes import SGLANG_CONTEXT_SLACK, sglang_context_length
    from headroom.operator.reconcile.sizing import parse

    def length(max_model_len: int) -> int:
        p = parse({"model": {"preset": "llama-3.1-8b", "path": "/m"}, "gpu": {"type": "h100-80gb"},
                   "traffic": {"peakConcurrency": 64, "contextTokens": 4096},
                   "engine": {"runtime": "sglang", "maxModelLen": max_model_len}})  # fmt: skip
        assert p.spec is not None and p.sizing is not None, p.error
        return sglang_context_length(p.spec, p.sizing)

    assert length(8192) == 8192 + SGLANG_CONTEXT_SLACK == 8199
    assert length(131_072) == length(131_070) == 131_072  # llama-3.1-8b's positions


@pytest.mark.parametrize(("setting", "flag"), [("auto", "fp8_e4m3"), ("fp8", "fp8_e4m3")])
def test_sglang_runs_deepseek_v32_in_the_kv_dtype_it_was_priced_at(setting: str, flag: str) -> None:
    """V3.2's auto is priced as fp8 (vLLM's fp8_ds_mla, 788 B a token and layer); SGLang's own
    auto caches it in bf16 below SM 10 (1,284 B), so its pool would not hold what was planned:
    SGLang is told fp8. A model without the indexer keeps auto."""
    v32 = {
        "numLayers": 61, "numAttentionHeads": 128, "numKVHeads": 128, "headDim": 192,
        "hiddenSize": 7168, "vocabSize": 129280, "parameterCount": 671_000_000_000,
        "maxPositionEmbeddings": 163840, "kvLoraRank": 512, "qkRopeHeadDim": 64,
        "indexHeadDim": 128, "weightDtype": "fp8", "path": "/models/v32",
    }  # fmt: skip
    s = spec(
        {"runtime": "sglang", "kvCacheDtype": setting},
        model=v32,
        gpu={"type": "h200-141gb", "countPerPod": 8},
    )
    sizing = size(s)
    assert sizing.plan.kv_bytes_per_token == 61 * 788
    args = sglang_command(s, sizing, "v32").args
    assert args[args.index("--kv-cache-dtype") + 1] == flag
    plain = spec({"runtime": "sglang"})
    args = sglang_command(plain, size(plain), "chat").args
    assert args[args.index("--kv-cache-dtype") + 1] == "auto"


@pytest.mark.parametrize(("sliding", "unified"), [(0, False), (1, True), (3, True), (4, False)])
def test_vllm_unifies_any_mix_of_sliding_and_full_layers(sliding: int, unified: bool) -> None:
    """Even one sliding-window layer among full ones (or one full among sliding) makes vLLM two
    KV groups; only all of one kind is a single group already."""
    model: dict[str, Any] = {
        "numLayers": 4, "numAttentionHeads": 8, "numKVHeads": 2, "headDim": 64,
        "hiddenSize": 512, "vocabSize": 1000, "parameterCount": 10_000_000,
        "maxPositionEmbeddings": 8192, "path": "/models/m",
    }  # fmt: skip
    if sliding:
        model |= {"slidingWindow": 1024, "numSlidingWindowLayers": sliding}
    s = spec({"runtime": "vllm"}, model=model)
    args = vllm_command(s, size(s), "chat").args
    assert ("--disable-hybrid-kv-cache-manager" in args) is unified
