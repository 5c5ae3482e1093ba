"""`headroom plan`: the KV budget of a deployment, as a table, JSON or a chart."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from headroom.contract.budget import (
    GIB,
    GPU_PRESETS,
    MODEL_PRESETS,
    WEIGHT_BYTES,
    Plan,
    PlanInput,
    UnknownPreset,
    from_hf_config,
    gpu_preset,
    model_preset,
    plan,
    tp_split_error,
)
from headroom.contract.outputs import chart_error

# The CRD's gpu.memoryGiB bounds (operator/crd/models.py), so a plan is one the operator takes.
MIN_GPU_MEMORY_GIB = 1
MAX_GPU_MEMORY_GIB = 4096


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `headroom plan`."""
    p = subparsers.add_parser(
        "plan",
        help="size a deployment from KV-cache arithmetic",
        description="Size pods from peak-concurrency KV arithmetic. Models: "
        + ", ".join(sorted(MODEL_PRESETS))
        + ". GPUs: "
        + ", ".join(sorted(GPU_PRESETS))
        + ".",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model preset name")
    src.add_argument("--model-config", type=Path, help="a local Hugging Face config.json or dir")
    p.add_argument("--params", type=float, help="parameter count in billions (--model-config)")
    p.add_argument(
        "--weight-dtype",
        choices=sorted(WEIGHT_BYTES),
        help="what the weights are stored as (default: the preset's, or config.json's "
        "quantization_config and torch_dtype, float32 priced at the 16 bits vLLM serves it in)",
    )
    p.add_argument("--gpu", default="h100-80gb", help="GPU preset (default h100-80gb)")
    p.add_argument("--gpu-memory-gib", type=float, help="GPU memory in GiB, for any other GPU")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--gpus-per-pod", type=int, help="GPUs per pod (default: tp)")
    p.add_argument("--concurrency", type=int, required=True, help="peak concurrent sequences")
    p.add_argument("--context", type=int, required=True, help="tokens per sequence (p95)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "bf16", "fp16", "fp8", "int8"])
    p.add_argument("--prefix-hit", type=float, default=0.0, help="expected prefix hit ratio")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="draw memory vs concurrency")


def _gib(n: int | float) -> str:
    return f"{n / GIB:,.1f} GiB"


def render_plan(p: Plan) -> str:
    """A readable table of the plan and what other KV policies would change."""
    rows = [
        ("model", f"{p.model}  (tp {p.tp}, pp {p.pp}, {p.gpus_per_pod} GPU/pod, {p.gpu})"),
        ("weights / GPU", f"{_gib(p.weights_bytes_per_gpu)}  "
         f"(total {_gib(p.weights_bytes)} = {p.weights_bytes / 1e9:,.1f} GB)"),
        ("KV bytes / token", f"{p.kv_bytes_per_token:,} B ({p.kv_dtype}; "
         f"{p.kv_bytes_per_token_per_gpu:,} B per GPU)"),
        ("KV for the peak", f"{_gib(p.kv_bytes_for_peak)}  "
         f"({p.concurrency} seq x {p.context:,} tokens)"),
        # Each token once, as in the peak's row: where every rank holds a copy (MLA, tp past
        # the KV heads) the GPUs' pools together hold tp copies of the same tokens.
        ("KV capacity / pod", f"{_gib(p.kv_tokens_per_pod * p.kv_bytes_per_token)}  "
         f"({p.kv_blocks_per_pod:,} blocks of {p.block_size} = {p.kv_tokens_per_pod:,} tokens)"),
        ("sequences / pod", f"{p.sequences_per_pod:,} at {p.context:,} tokens"
         + (f", prefix hit {p.prefix_hit:.0%}" if p.prefix_hit else "")),
        ("replicas needed", f"{p.replicas}  ({p.gpus_total} GPUs)" if p.feasible else "-"),
        ("binding constraint", p.binding),
    ]  # fmt: skip
    if not p.feasible:
        rows.append(("INFEASIBLE", p.reason or ""))
    for alt in p.alternatives:
        delta = f"{alt.replicas} replicas" if alt.replicas else "no fit"
        rows.append((f"with {alt.change}", f"{alt.sequences_per_pod:,} sequences / pod -> {delta}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def build_input(args: argparse.Namespace) -> PlanInput:
    """Turn CLI flags into a validated `PlanInput` (raises UnknownPreset / ValidationError)."""
    if args.model_config is not None:
        params = _parameter_count(args.params)
        arch = from_hf_config(args.model_config, params, args.weight_dtype)
    else:
        if args.params is not None:
            # A preset states its own count: ignoring --params priced the preset's weights
            # while the user believed theirs were.
            raise ValueError(
                f"--params goes with --model-config; the preset {args.model!r} states its own "
                "parameter count"
            )
        arch = model_preset(args.model)
        if args.weight_dtype is not None:
            arch = arch.model_copy(update={"weight_dtype": args.weight_dtype})
    if args.tp >= 1 and (split := tp_split_error(arch, args.tp, "--tp")) is not None:
        raise ValueError(split)
    if (pods := _pod_split_error(args.tp, args.gpus_per_pod)) is not None:
        raise ValueError(pods)
    gpu_name, memory = _gpu(args)
    return PlanInput(
        model=arch,
        gpu_name=gpu_name,
        gpu_memory_bytes=memory,
        tp=args.tp,
        gpus_per_pod=args.gpus_per_pod,
        concurrency=args.concurrency,
        context=args.context,
        kv_dtype=args.kv_dtype,
        prefix_hit=args.prefix_hit,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
    )


def _parameter_count(billions: float | None) -> int | None:
    """--params as a parameter count (None: estimate it from config.json)."""
    if billions is None:
        return None
    # NaN fails every comparison: the test is written so that NaN and inf fail it too.
    if not 0 < billions <= 1e6:  # 1e6 billion: arch.MAX_PARAMETERS
        raise ValueError(f"--params must be billions in (0, 1e6], got {billions}")
    count = round(billions * 1e9)
    if count < 1:  # 1e-10 billion is no parameter at all, not a model
        raise ValueError(f"--params must be at least 1e-09 billion (one parameter), got {billions}")
    return count


def _pod_split_error(tp: int, gpus_per_pod: int | None) -> str | None:
    """Why --tp cannot split --gpus-per-pod into pipeline stages (None: it can, or a bound
    check of either flag will name it)."""
    if gpus_per_pod is None or tp < 1 or gpus_per_pod < 1 or gpus_per_pod % tp == 0:
        return None
    return (
        f"--tp {tp} does not divide --gpus-per-pod {gpus_per_pod}: a pod runs "
        "--gpus-per-pod / --tp pipeline stages of --tp GPUs each"
    )


def _gpu(args: argparse.Namespace) -> tuple[str, int]:
    """The GPU's name and bytes: --gpu-memory-gib within the CRD's gpu.memoryGiB bounds, else
    the --gpu preset's."""
    if args.gpu_memory_gib is None:
        gpu = gpu_preset(args.gpu)
        return gpu.name, gpu.memory_bytes
    gib = args.gpu_memory_gib
    # NaN fails every comparison: the test is written so that NaN and inf fail it too. Below
    # 1 GiB the operator refuses the spec, and 1e-12 GiB rounded to a GPU of no bytes.
    if not MIN_GPU_MEMORY_GIB <= gib <= MAX_GPU_MEMORY_GIB:
        raise ValueError(
            f"--gpu-memory-gib must be in [{MIN_GPU_MEMORY_GIB}, {MAX_GPU_MEMORY_GIB}], got {gib}"
        )
    return f"{gib:g} GiB GPU", int(gib * GIB)


# PlanInput's fields that no flag of the same name sets.
_FLAGS = {"gpu_memory_bytes": "--gpu-memory-gib"}


def _validation_message(err: ValidationError) -> str:
    """Each error under the flag the user typed, without pydantic's "Value error, " prefix."""
    parts = []
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        field = ".".join(str(x) for x in e["loc"])
        if not field:  # a check across fields: its message names them
            parts.append(msg)
            continue
        parts.append(f"{_FLAGS.get(field, '--' + field.replace('_', '-'))}: {msg}")
    return "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    """Entry point of `headroom plan`; exit 2 on bad input, 1 when infeasible."""
    try:
        bad_plot = chart_error(args.plot, "--plot") if args.plot is not None else None
        if bad_plot is not None:
            raise ValueError(bad_plot)
        inp = build_input(args)
    except UnknownPreset as e:
        print(f"headroom plan: {e}", file=sys.stderr)
        return 2
    except ValidationError as e:
        print(f"headroom plan: {_validation_message(e)}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:
        print(f"headroom plan: {e}", file=sys.stderr)
        return 2
    result = plan(inp)
    print(result.model_dump_json(indent=2) if args.json else render_plan(result))
    if args.plot is not None:
        from headroom.contract.budget.chart import draw_memory_chart

        draw_memory_chart(inp, result, args.plot)
        print(f"chart written to {args.plot}", file=sys.stderr)
    return 0 if result.feasible else 1
