"""The engine container per runtime: headroom, vLLM and SGLang told the planned pool, their
probes, /dev/shm, images, and the sidecar reading each one's stats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from rendered import containers, flags

from headroom.operator.crd.models import HEADROOM_IMAGE, RUNTIME_IMAGES, InferenceDeploymentSpec
from headroom.operator.reconcile.children import Owner, deployment
from headroom.operator.reconcile.runtimes import (
    RUNTIMES,
    engine_command,
    sglang_command,
    vllm_command,
)
from headroom.operator.reconcile.sizing import Sizing, SpecError, size

ROOT = Path(__file__).resolve().parents[1]
VLLM_EXAMPLE = ROOT / "examples" / "llama-3.1-70b-vllm-tp4.yaml"
OWNER = Owner(name="chat", namespace="team-a", uid="1234-abcd")


def spec(engine: dict[str, Any] | None = None, **sections: Any) -> InferenceDeploymentSpec:
    raw: dict[str, Any] = {
        "model": {"preset": "llama-3.1-8b", "path": "/models/l8b"},
        "gpu": {"type": "h100-80gb", "countPerPod": 2, "tensorParallel": 2},
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
        "--kv-cache-dtype": "auto", "--context-length": "4096", "--enable-metrics": True,
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
        ("headroom", HEADROOM_IMAGE, HEADROOM_IMAGE, []),
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
    assert args[:3] == ["sidecar", "--engine-url", "http://127.0.0.1:8000"]
    assert args[5:] == source


def test_explicit_images_win() -> None:
    s = spec({"runtime": "vllm", "image": "registry.local/vllm:v0.11.1",
              "sidecarImage": "registry.local/headroom:0.1.0"})  # fmt: skip
    c = containers(deployment(OWNER, s, size(s), replicas=1))
    assert c["engine"]["image"] == "registry.local/vllm:v0.11.1"
    assert c["sidecar"]["image"] == "registry.local/headroom:0.1.0"
    h = spec({"image": "registry.local/headroom:dev"})
    c = containers(deployment(OWNER, h, size(h), replicas=1))
    assert c["engine"]["image"] == c["sidecar"]["image"] == "registry.local/headroom:dev"


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
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] == 10 and startup["failureThreshold"] == threshold
    assert startup["periodSeconds"] * startup["failureThreshold"] >= (timeout or 900)
    assert e["readinessProbe"]["httpGet"]["path"] == ready
    assert e["livenessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("runtime", ["headroom", "vllm", "sglang"])
@pytest.mark.parametrize(("gpu", "shm"), [
    ({"type": "h100-80gb"}, False),
    ({"type": "h100-80gb", "countPerPod": 2, "tensorParallel": 2}, True),
    ({"type": "h100-80gb", "countPerPod": 2, "tensorParallel": 1}, True),  # pipeline parallel
])  # fmt: skip
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
    assert c["sidecar"]["args"][-2:] == ["--source", "vllm"]
    assert c["sidecar"]["image"] == HEADROOM_IMAGE
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["headroom.dev/kv-blocks"] == str(blocks)
