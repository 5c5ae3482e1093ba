"""From an InferenceDeployment spec to the budget model's `PlanInput`, and back to status.

`plan_input()` is the one conversion: status.budget, the engine's `--num-blocks` and the
scaling policy's pod capacity all come from `plan(plan_input(spec))`, the same function
`headroom plan` runs, so the figures a user sees there match what the operator deploys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from headroom.contract.budget import (
    GIB,
    ModelArch,
    Plan,
    PlanInput,
    UnknownPreset,
    blocks_for_tokens,
    gpu_preset,
    model_preset,
    plan,
    tp_split_error,
)
from headroom.contract.budget.presets import HEADROOM_ENGINE_ARCHITECTURES
from headroom.operator.crd.models import (
    HEADROOM_ENGINE_WEIGHT_DTYPES,
    Budget,
    InferenceDeploymentSpec,
    ModelSpec,
    headroom_engine_refusal,
)
from headroom.operator.crd.rules import rule_field


class SpecError(ValueError):
    """The spec passed schema validation but cannot be turned into a plan; `field` is the
    camelCase path below spec of the field to change, where one is to blame."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def max_model_len(spec: InferenceDeploymentSpec) -> int:
    """The longest sequence the engine will accept."""
    return spec.engine.max_model_len or spec.traffic.context_tokens


def served_model_name(spec: InferenceDeploymentSpec, resource_name: str) -> str:
    """What clients send as `model`."""
    return spec.model.served_model_name or spec.model.preset or resource_name


def model_arch(model: ModelSpec, fallback_context: int) -> ModelArch:
    """The architecture record of a preset, or of the spec's architecture fields."""
    if model.preset is not None:
        try:
            arch = model_preset(model.preset)
        except UnknownPreset as exc:
            raise SpecError(str(exc), "model.preset") from None
        if model.weight_dtype is not None and model.weight_dtype != arch.weight_dtype:
            arch = arch.model_copy(update={"weight_dtype": model.weight_dtype})
        return arch
    try:
        return ModelArch(
            name=model.served_model_name or "custom",
            num_layers=model.num_layers,  # the rules guarantee these are set
            num_attention_heads=model.num_attention_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            hidden_size=model.hidden_size,
            intermediate_size=model.intermediate_size,
            vocab_size=model.vocab_size,
            # Without a stated limit the model is assumed to take what the engine is given.
            max_position_embeddings=model.max_position_embeddings or fallback_context,
            num_parameters=model.parameter_count,
            weight_dtype=model.weight_dtype or "bf16",
            kv_lora_rank=model.kv_lora_rank,
            qk_rope_head_dim=model.qk_rope_head_dim,
            indexer_head_dim=model.index_head_dim,
            sliding_window=model.sliding_window,
            num_sliding_window_layers=model.num_sliding_window_layers or 0,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise SpecError(f"model architecture: {where}: {first['msg']}", "model") from None


# vLLM runs an MLA model (DeepSeek V2/V3) on FlashMLA with 64-token blocks, and on Blackwell on
# CUTLASS MLA with 128: v0.11.0 sets any other --block-size to exactly that (`!= 64`, not a
# multiple: vllm/platforms/cuda.py, check_and_update_config; 128 on Hopper became 64) and then
# still allocates the --num-gpu-blocks-override it was given, at the forced size. The plan and
# the flag use that size.
VLLM_MLA_BLOCK_SIZE = 64
VLLM_MLA_BLOCK_SIZE_BLACKWELL = 128
_BLACKWELL_GPUS = frozenset({"b200-192gb"})


def _engine_block_size(spec: InferenceDeploymentSpec, arch: ModelArch) -> int:
    """The KV block size the engine will run: engine.blockSize, except where vLLM forces its
    own (MLA models). The plan carries it; everything else reads `plan.block_size`."""
    size = spec.engine.block_size
    if spec.engine.runtime != "vllm" or arch.kv_lora_rank is None:
        return size
    if spec.gpu.type is None:
        # Priced in the wrong size, --num-gpu-blocks-override would allocate half or twice the
        # planned bytes: the GPU's generation must be known.
        raise SpecError(
            "engine.runtime vllm with an MLA model (DeepSeek V2/V3, model.kvLoraRank) needs "
            "gpu.type, not gpu.memoryGiB alone: vLLM runs MLA's KV in blocks of "
            f"{VLLM_MLA_BLOCK_SIZE} tokens before Blackwell and {VLLM_MLA_BLOCK_SIZE_BLACKWELL} "
            "on it, and the plan prices the size it runs: name b200-192gb for any Blackwell GPU, "
            "h100-80gb or h200-141gb for Hopper, with gpu.memoryGiB beside it for the memory",
            "gpu.memoryGiB",
        )
    try:
        blackwell = gpu_preset(spec.gpu.type).name in _BLACKWELL_GPUS
    except UnknownPreset:
        blackwell = False
    return VLLM_MLA_BLOCK_SIZE_BLACKWELL if blackwell else VLLM_MLA_BLOCK_SIZE


def plan_input(spec: InferenceDeploymentSpec) -> PlanInput:
    """The budget model's input for this spec (pure; raises SpecError on a bad combination)."""
    gpu = spec.gpu
    if gpu.memory_gib is not None:
        memory = int(gpu.memory_gib * GIB)
        gpu_name = gpu.type or f"{gpu.memory_gib:g}GiB"
    else:
        assert gpu.type is not None  # the rules require a type or memoryGiB
        try:
            preset = gpu_preset(gpu.type)
        except UnknownPreset as exc:
            raise SpecError(str(exc), "gpu.type") from None
        memory, gpu_name = preset.memory_bytes, preset.name
    kv_dtype = spec.engine.kv_cache_dtype
    arch = model_arch(spec.model, max_model_len(spec))
    try:
        return PlanInput(
            model=arch,
            gpu_name=gpu_name,
            gpu_memory_bytes=memory,
            tp=gpu.tensor_parallel or gpu.count_per_pod,
            gpus_per_pod=gpu.count_per_pod,
            concurrency=spec.traffic.peak_concurrency,
            context=spec.traffic.context_tokens,
            kv_dtype=kv_dtype,
            prefix_hit=spec.traffic.prefix_hit_ratio if spec.engine.prefix_caching else 0.0,
            block_size=_engine_block_size(spec, arch),
            gpu_memory_utilization=spec.engine.gpu_memory_utilization,
            max_num_seqs=spec.engine.max_num_seqs,
            max_num_batched_tokens=spec.engine.max_num_batched_tokens,
            # vLLM's BlockPool keeps block 0 as its null block (`free_block_queue.popleft()`):
            # of --num-gpu-blocks-override N, sequences get N - 1.
            reserved_blocks=1 if spec.engine.runtime == "vllm" else 0,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise SpecError(f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None


@dataclass(frozen=True, slots=True)
class Sizing:
    """The plan plus the operator's own feasibility verdict (which also checks maxModelLen)."""

    plan: Plan
    feasible: bool
    reason: str | None
    max_model_len: int

    @property
    def replicas(self) -> int:
        """Pods the peak needs (1 when infeasible, so callers need not special-case)."""
        return self.plan.replicas or 1


def size(spec: InferenceDeploymentSpec) -> Sizing:
    """Plan the deployment and decide whether the engine can start with this spec."""
    if spec.engine.runtime != "headroom" and spec.model.path == "tiny":
        raise SpecError(
            f"engine.runtime {spec.engine.runtime} cannot load 'tiny', the headroom engine's "
            "built-in test model: set model.path to a weights directory (or a Hugging Face id)",
            "model.path",
        )
    if (refused := headroom_engine_refusal(spec)) is not None:
        field, why = refused
        raise SpecError(
            f"the headroom engine cannot load this model: {why}; it loads "
            f"{', '.join(HEADROOM_ENGINE_ARCHITECTURES)} checkpoints in "
            f"{', '.join(HEADROOM_ENGINE_WEIGHT_DTYPES)}: set engine.runtime vllm or sglang",
            field,
        )
    inp = plan_input(spec)
    if (heads := tp_split_error(inp.model, inp.tp, "gpu.tensorParallel")) is not None:
        raise SpecError(
            heads, "gpu.tensorParallel" if spec.gpu.tensor_parallel else "gpu.countPerPod"
        )
    result = plan(inp)
    mml = max_model_len(spec)
    reason = result.reason
    if reason is not None and spec.engine.runtime == "headroom" and result.binding != "context":
        # The spec holds it to one GPU a pod: more GPUs is a runtime change (none lifts a
        # context past the model's positions).
        reason += (
            "; the headroom engine runs on one GPU: several GPUs per pod need engine.runtime "
            "vllm or sglang"
        )
    if result.feasible:
        arch = inp.model
        need_blocks = blocks_for_tokens(mml, result.block_size)
        if mml > arch.max_position_embeddings:
            reason = (
                f"engine.maxModelLen {mml} exceeds {arch.name}'s max_position_embeddings "
                f"{arch.max_position_embeddings}"
            )
        elif result.kv_blocks_per_pod - inp.reserved_blocks < need_blocks:
            need = need_blocks * result.block_size * result.kv_bytes_per_token_per_gpu
            reason = (
                f"one {mml}-token sequence (engine.maxModelLen) needs {need / GIB:.2f} GiB of "
                f"KV per GPU but only {result.kv_bytes_per_gpu / GIB:.2f} GiB is left after "
                f"weights {result.weights_bytes_per_gpu / GIB:.1f} GiB and reserve "
                f"{result.activation_reserve_bytes_per_gpu / GIB:.1f} GiB; lower maxModelLen "
                f"or add GPUs per pod"
            )
            if inp.reserved_blocks:
                reason += (
                    f" ({result.kv_blocks_per_pod:,} blocks, {inp.reserved_blocks} of them the "
                    "engine's own)"
                )
    return Sizing(plan=result, feasible=reason is None, reason=reason, max_model_len=mml)


def budget(sizing: Sizing) -> Budget:
    """status.budget for a sizing."""
    p = sizing.plan
    return Budget(
        feasible=sizing.feasible,
        binding=p.binding,
        reason=sizing.reason,
        kv_cache_dtype=p.kv_dtype,
        block_size=p.block_size,
        tensor_parallel=p.tp,
        pipeline_parallel=p.pp,
        gpus_per_pod=p.gpus_per_pod,
        weights_bytes_per_gpu=p.weights_bytes_per_gpu,
        kv_bytes_per_token=p.kv_bytes_per_token,
        kv_bytes_per_token_per_gpu=p.kv_bytes_per_token_per_gpu,
        kv_bytes_per_gpu=p.kv_bytes_per_gpu,
        kv_blocks_per_pod=p.kv_blocks_per_pod,
        kv_tokens_per_pod=p.kv_tokens_per_pod,
        sequences_per_pod=p.sequences_per_pod,
        sized_replicas=p.replicas if sizing.feasible else None,
    )


def summary(sizing: Sizing) -> str:
    """One line a person reads in `kubectl describe`: the arithmetic behind the pod count."""
    p = sizing.plan
    if not sizing.feasible:
        return f"{p.model} on {p.gpus_per_pod}x {p.gpu} (tp {p.tp}): {sizing.reason}"
    return (
        f"{p.model} on {p.gpus_per_pod}x {p.gpu} (tp {p.tp}, {p.kv_dtype} KV): "
        f"{p.kv_bytes_per_token_per_gpu:,} B/token/GPU, {p.kv_bytes_per_gpu / GIB:.1f} GiB KV "
        f"per GPU = {p.kv_blocks_per_pod:,} blocks of {p.block_size} tokens per pod, "
        f"{p.sequences_per_pod} sequences of {p.context:,} tokens; peak {p.concurrency} needs "
        f"{p.replicas} pod(s) (binding: {p.binding})"
    )


def blocks_per_sequence(spec: InferenceDeploymentSpec, block_size: int) -> float:
    """KV blocks one more p95 request will claim (its shared prefix stored once), in blocks of
    `block_size` tokens (the plan's)."""
    blocks = blocks_for_tokens(spec.traffic.context_tokens, block_size)
    hit = spec.traffic.prefix_hit_ratio if spec.engine.prefix_caching else 0.0
    return max(1.0, blocks * (1.0 - hit))


@dataclass(frozen=True, slots=True)
class Parsed:
    """A validated spec and its sizing, or why there is none."""

    spec: InferenceDeploymentSpec | None
    sizing: Sizing | None
    error: str | None
    # The camelCase path below spec of the field the error is about, () where none is.
    field: tuple[str, ...] = ()


def parse(raw_spec: dict[str, Any] | None) -> Parsed:
    """Validate the spec and size it; a bad spec gives `error`, never an exception."""
    try:
        spec = InferenceDeploymentSpec.model_validate(raw_spec or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = tuple(str(x) for x in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        where = f"spec.{'.'.join(loc)}" if loc else "spec"
        return Parsed(None, None, f"{where}: {msg}", loc + rule_field(msg))
    try:
        sizing = size(spec)
    except SpecError as exc:
        return Parsed(spec, None, f"spec: {exc}", tuple(exc.field.split(".")) if exc.field else ())
    return Parsed(spec, sizing, None)
