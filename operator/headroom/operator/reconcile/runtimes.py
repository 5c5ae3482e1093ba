"""What the engine container runs, per `engine.runtime`: pure functions of the spec and its plan.

Whatever the runtime, the engine is told the pool the budget planned, so `status.budget` is what
runs and the scaling loop's pod capacity is the engine's:

- headroom: `headroom serve --num-blocks <kv_blocks_per_pod>`;
- vllm: `vllm serve <model> --num-gpu-blocks-override <kv_blocks_per_pod>` (vLLM otherwise sizes
  its pool from a memory profile at start, and every pod would differ a little from the plan);
- sglang: `python3 -m sglang.launch_server --max-total-tokens <kv_tokens_per_pod>`, with
  `--page-size` the block size (SGLang counts its pool in tokens; the sidecar reads it back as
  tokens // page size blocks).

The command is spelled out for the stock images rather than left to their entrypoints, which
changed across releases. kvCacheDtype fp8 is vLLM's `fp8` (e4m3 on CUDA) and SGLang's
`fp8_e4m3` (DeepSeek-V3.2's auto too: it is priced as fp8, which SGLang's own auto is not below
SM 10); int8 exists only in headroom's engine, and the CRD refuses it for the others.

Every engine knob the budget reads (block size, KV dtype, prefix caching, max sequences, batched
tokens, max model length, parallelism, memory fraction) is passed, so the engine runs the
arithmetic `status.budget` shows. The API key (`engine.apiKeySecret`) reaches each engine as an
environment variable from the Secret, never as a literal: headroom reads HEADROOM_API_KEY, vLLM
VLLM_API_KEY, and SGLang, which has only `--api-key`, gets `--api-key $(HEADROOM_API_KEY)`, which
the kubelet expands, and `--log-level warning`, below the line where it logs its arguments. All
three guard the OpenAI routes only; /health and /metrics (and headroom's /ready and /stats) stay
open for the probes and the sidecar.

headroom's engine also serves /health, /ready and /stats on a listener of its own
(`--stats-port`, ENGINE_STATS_PORT), which the probes and the sidecar use: on the API's port they
would queue behind API connections at the engine's connection cap. vLLM and SGLang have one port.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from headroom.contract.ports import ENGINE_PORT, ENGINE_STATS_PORT
from headroom.operator.crd.models import (
    HEADROOM_ENGINE_IMAGE,
    HEADROOM_IMAGE,
    RUNTIME_IMAGES,
    InferenceDeploymentSpec,
)
from headroom.operator.reconcile.sizing import Sizing, model_arch, served_model_name

STARTUP_PERIOD_SECONDS = 10
SGLANG_KV_DTYPE = {"auto": "auto", "fp8": "fp8_e4m3"}
# SGLang 0.5.3 serves less than its --context-length: it refuses a prompt + max_new_tokens of
# context_len or more (tokenizer_manager.py), aborts a prompt of context_len - 6 or more
# (tp_worker.py: max_req_input_len = context_len - 1 - 5) and clips the output at
# context_len - 2 - prompt (scheduler.py). This much more serves every request whose prompt +
# max_tokens fits maxModelLen, as vLLM does.
SGLANG_CONTEXT_SLACK = 7
# The environment variable each engine reads its API key from (headroom's is
# headroom.engine.server.auth.API_KEY_ENV; a test keeps them equal). SGLang reads none: its
# --api-key argument names this variable for the kubelet to expand.
API_KEY_ENVS = {
    "headroom": "HEADROOM_API_KEY",
    "vllm": "VLLM_API_KEY",
    "sglang": "HEADROOM_API_KEY",
}
# The sidecar's copy of the key, for engine endpoints behind it (SGLang's server info).
SIDECAR_API_KEY_ENV = "HEADROOM_API_KEY"


@dataclass(frozen=True, slots=True)
class EngineCommand:
    """The engine container's `command` and `args`, and how it says it is ready."""

    command: list[str]
    args: list[str]
    ready_path: str  # readiness probe; liveness and startup probe /health on every runtime
    env: dict[str, str]  # beyond HOME and XDG_CACHE_HOME, which every runtime gets
    api_key_env: str | None = None  # filled from engine.apiKeySecret's Secret key, when set
    # The port of the engine's own listener for /health, /ready and /stats (probes, sidecar);
    # None: those are served on the API's ENGINE_PORT only.
    stats_port: int | None = None


def headroom_command(spec: InferenceDeploymentSpec, sizing: Sizing, name: str) -> EngineCommand:
    """`headroom serve`: the pool is exactly the planned `kv_blocks_per_pod`."""
    e, p = spec.engine, sizing.plan
    args = [
        "serve",
        "--model",
        spec.model.path,
        "--served-model-name",
        served_model_name(spec, name),
        "--host",
        "0.0.0.0",
        "--port",
        str(ENGINE_PORT),
        # Probes and the sidecar's poll on a listener of their own, never queued behind API
        # connections at --max-connections (see contract.ports).
        "--stats-port",
        str(ENGINE_STATS_PORT),
        # The pool was planned in the GPU's memory; the engine's own default device is the CPU.
        "--device",
        "cuda",
        "--block-size",
        str(e.block_size),
        "--num-blocks",
        str(p.kv_blocks_per_pod),
        "--kv-cache-dtype",
        e.kv_cache_dtype,
        "--max-model-len",
        str(sizing.max_model_len),
        "--max-num-seqs",
        str(e.max_num_seqs),
        "--max-num-batched-tokens",
        str(e.max_num_batched_tokens),
        "--enable-prefix-caching" if e.prefix_caching else "--no-enable-prefix-caching",
        "--attention-backend",
        e.attention_backend,
    ]
    return EngineCommand(
        command=["headroom"], args=args, ready_path="/ready", env={},
        api_key_env=_key_env(spec), stats_port=ENGINE_STATS_PORT,
    )  # fmt: skip


def _key_env(spec: InferenceDeploymentSpec) -> str | None:
    """The variable the engine's API key arrives in, or None without engine.apiKeySecret."""
    return API_KEY_ENVS[spec.engine.runtime] if spec.engine.api_key_secret else None


# A uid without a passwd entry (the pod runs as 10001 on images built for root) makes
# getpass.getuser() raise in torch's compile caches unless USER is set.
_STOCK_ENV = {"USER": "headroom"}


def vllm_command(spec: InferenceDeploymentSpec, sizing: Sizing, name: str) -> EngineCommand:
    """`vllm serve`: `--num-gpu-blocks-override` is the planned `kv_blocks_per_pod`."""
    e, p = spec.engine, sizing.plan
    args = [
        "--host",
        "0.0.0.0",
        "--port",
        str(ENGINE_PORT),
        "--served-model-name",
        served_model_name(spec, name),
        "--num-gpu-blocks-override",
        str(p.kv_blocks_per_pod),
        "--block-size",
        str(p.block_size),  # engine.blockSize, or what vLLM forces for MLA (see sizing)
        "--kv-cache-dtype",
        e.kv_cache_dtype,  # auto | fp8 (the CRD refuses int8)
        "--enable-prefix-caching" if e.prefix_caching else "--no-enable-prefix-caching",
        "--tensor-parallel-size",
        str(p.tp),
        "--pipeline-parallel-size",
        str(p.pp),
        "--max-model-len",
        str(sizing.max_model_len),
        "--max-num-seqs",
        str(e.max_num_seqs),
        "--max-num-batched-tokens",
        str(e.max_num_batched_tokens),
        "--gpu-memory-utilization",
        str(e.gpu_memory_utilization),
    ]
    arch = model_arch(spec.model, sizing.max_model_len)
    if 0 < arch.num_sliding_window_layers < arch.num_layers:
        # With sliding-window and full layers (Gemma 2) vLLM's hybrid KV manager pages them as
        # two groups whose blocks hold half the layers each, so the override's N blocks would
        # be half the planned bytes and each sequence would take blocks in both groups: half
        # the planned sequences. Unified, a block holds every layer, as the plan prices it.
        args.append("--disable-hybrid-kv-cache-manager")
    return EngineCommand(
        command=["vllm", "serve", spec.model.path],
        args=args,
        ready_path="/health",
        env={**_STOCK_ENV, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
        api_key_env=_key_env(spec),
    )


def sglang_context_length(spec: InferenceDeploymentSpec, sizing: Sizing) -> int:
    """`--context-length` for maxModelLen: with SGLang's slack, within the model's positions
    (past them SGLang refuses to start; there the last few tokens of maxModelLen are refused)."""
    limit = model_arch(spec.model, sizing.max_model_len).max_position_embeddings
    return min(sizing.max_model_len + SGLANG_CONTEXT_SLACK, max(limit, sizing.max_model_len))


def sglang_command(spec: InferenceDeploymentSpec, sizing: Sizing, name: str) -> EngineCommand:
    """`sglang.launch_server`: `--max-total-tokens` is the planned pool in tokens (blocks x
    block size), paged by `--page-size` = the block size."""
    e, p = spec.engine, sizing.plan
    args = [
        "--model-path",
        spec.model.path,
        "--served-model-name",
        served_model_name(spec, name),
        "--host",
        "0.0.0.0",
        "--port",
        str(ENGINE_PORT),
        "--tp-size",
        str(p.tp),
        "--pp-size",
        str(p.pp),
        "--max-total-tokens",
        str(p.kv_blocks_per_pod * p.block_size),
        "--page-size",
        str(e.block_size),
        "--kv-cache-dtype",
        # What the plan priced (the CRD refuses int8). DeepSeek-V3.2's auto is priced as fp8,
        # vLLM's choice; SGLang's own auto picks bf16 for it below SM 10 (1,284 B a token and
        # layer against the 788 priced), so it is told fp8.
        SGLANG_KV_DTYPE["fp8" if p.kv_dtype == "fp8" else e.kv_cache_dtype],
        "--context-length",
        str(sglang_context_length(spec, sizing)),
        "--max-running-requests",
        str(e.max_num_seqs),
        "--chunked-prefill-size",
        str(e.max_num_batched_tokens),
        "--mem-fraction-static",
        str(e.gpu_memory_utilization),
        "--enable-metrics",
    ]
    if not e.prefix_caching:
        args.append("--disable-radix-cache")
    key_env = _key_env(spec)
    if key_env:
        # The kubelet expands it from the env. SGLang 0.5.3 logs its whole ServerArgs at info
        # as it starts (entrypoints/engine.py, `logger.info(f"{server_args=}")`), the key in
        # plain text among them: at warning, `kubectl logs` does not show the Secret.
        args += ["--api-key", f"$({key_env})", "--log-level", "warning"]
    return EngineCommand(
        command=["python3", "-m", "sglang.launch_server"],
        args=args,
        ready_path="/health",
        env=dict(_STOCK_ENV),
        api_key_env=key_env,
    )


RUNTIMES: dict[str, Callable[[InferenceDeploymentSpec, Sizing, str], EngineCommand]] = {
    "headroom": headroom_command,
    "vllm": vllm_command,
    "sglang": sglang_command,
}


def engine_command(spec: InferenceDeploymentSpec, sizing: Sizing, name: str) -> EngineCommand:
    """What the engine container runs for the spec's runtime."""
    return RUNTIMES[spec.engine.runtime](spec, sizing, name)


# A reference's tag follows its last ':' after the last '/' (a ':' before that is a registry's
# port: localhost:5000/headroom has no tag). The tag as the distribution spec has it; the
# repository a registry host (and port) or a first path component, then lowercase path
# components (values.schema.json's image.repository pattern is this one; a test keeps them equal).
IMAGE_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
IMAGE_REPOSITORY = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*")


@dataclass(frozen=True, slots=True)
class HeadroomImages:
    """headroom's two images, which the pods run where the spec names none: `headroom` (the
    sidecar of vLLM and SGLang pods) and `headroom-engine` (runtime headroom's engine and
    sidecar). The operator's --headroom-image sets both; the defaults are the pinned releases."""

    headroom: str = HEADROOM_IMAGE
    engine: str = HEADROOM_ENGINE_IMAGE

    @classmethod
    def derive(cls, image: str) -> HeadroomImages:
        """Both from the small image REPO:TAG (the engine's is REPO-engine:TAG, as `make image`
        tags them). ValueError for a reference without a tag or pinned by digest: no digest of
        the engine's image can be derived from the small one's."""
        if "@" in image:
            raise ValueError(
                f"{image!r} is pinned by digest, and the engine's image (REPO-engine) cannot be "
                "derived from a digest: name REPO:TAG here, and set engine.image (and "
                "engine.sidecarImage) on each InferenceDeployment to pin by digest"
            )
        repo, colon, tag = image.rpartition(":")
        if not colon or "/" in tag:
            raise ValueError(
                f"{image!r} has no tag: name it REPO:TAG (e.g. registry.example.com/headroom:"
                "0.1.0); the headroom engine then runs REPO-engine:TAG"
            )
        if not IMAGE_TAG.fullmatch(tag) or not IMAGE_REPOSITORY.fullmatch(repo):
            raise ValueError(f"{image!r} is not an image reference REPO:TAG")
        return cls(headroom=image, engine=f"{repo}-engine:{tag}")


DEFAULT_IMAGES = HeadroomImages()


def engine_image(spec: InferenceDeploymentSpec, images: HeadroomImages = DEFAULT_IMAGES) -> str:
    """engine.image; else headroom-engine (the operator's) for runtime headroom, else the
    stock runtime's pinned image."""
    if spec.engine.image:
        return spec.engine.image
    runtime = spec.engine.runtime
    return images.engine if runtime == "headroom" else RUNTIME_IMAGES[runtime]


def sidecar_image(spec: InferenceDeploymentSpec, images: HeadroomImages = DEFAULT_IMAGES) -> str:
    """engine.sidecarImage; else the engine's image for runtime headroom (headroom-engine holds
    the sidecar too: no second pull), else the small headroom image (the stock images have no
    `headroom sidecar`, and it has no torch): the operator's, from `images`."""
    if spec.engine.sidecar_image:
        return spec.engine.sidecar_image
    if spec.engine.runtime == "headroom":
        return engine_image(spec, images)
    return images.headroom


def sidecar_source_args(spec: InferenceDeploymentSpec) -> list[str]:
    """How the sidecar reads the engine: headroom's /stats, or vLLM's or SGLang's /metrics."""
    runtime = spec.engine.runtime
    if runtime == "vllm":
        return ["--source", "vllm"]
    if runtime == "sglang":
        return ["--source", "sglang", "--page-size", str(spec.engine.block_size)]
    return []


def sidecar_api_key_env(spec: InferenceDeploymentSpec) -> str | None:
    """The variable the sidecar gets the engine's key in: only SGLang guards a route the sidecar
    reads (its server info); headroom's /stats and vLLM's /metrics are open."""
    if spec.engine.api_key_secret and spec.engine.runtime == "sglang":
        return SIDECAR_API_KEY_ENV
    return None


def startup_failure_threshold(spec: InferenceDeploymentSpec) -> int:
    """Startup probe failures allowed: engine.startupTimeoutSeconds at one probe every 10 s."""
    return math.ceil(spec.engine.startup_timeout_seconds / STARTUP_PERIOD_SECONDS)


def needs_shm(spec: InferenceDeploymentSpec, sizing: Sizing) -> bool:
    """Several GPU ranks in the pod (tensor or pipeline parallel) talk through NCCL and
    torch.multiprocessing, which need a /dev/shm larger than the runtime's 64 MiB."""
    return sizing.plan.tp * sizing.plan.pp > 1
