"""Engine decode tokens/s per attention backend: torch against cuda, and fp8 KV against bf16.

The whole engine (scheduler, model, sampler) decodes `--new-tokens` greedy tokens for each of
`batch` concurrent requests with distinct prompts of `--prompt-len` tokens (prefix caching
off); the clock starts once every prompt is prefilled. Models: `tiny` (the built-in 4-layer
model, head_dim 32) and `llama-1b`, a random-weight Llama of hidden 2048, 16 layers, 32 query /
8 KV heads of 64, intermediate 8192, vocab 32000 (1.1 B parameters), built on the device.
Weights are bf16 on a GPU and fp32 on the CPU. Rows per model and batch: the torch backend,
the cuda backend with bf16 KV (`auto`) and with fp8 KV. The cuda kernels are compiled for
head_dim 64 and 128, so the tiny model's cuda rows say n/a.

Tokens/s have no target (informational); the fp8 / bf16 ratio at each batch is printed. One
row is graded, and only with a GPU: fp8 KV >= 1.7x bf16 KV tokens/s (the kernels' target in
bench.gpu_kernels) through the whole engine on the cuda backend, for the last model named
(llama-1b by default), `--long-batch` requests of `--long-context`-token prompts. fp8 halves
only the KV bytes a step reads, not the weights', so a bandwidth-bound step gains at most
(weights + bf16 KV) / (weights + fp8 KV), printed as the "bytes ceiling": for llama-1b that is
1.52x at 64 x 2k tokens and 1.81x at 256 x 2k, hence the defaults 256 and 2048. Where the
ceiling is under the target (a smaller `--long-batch` or `--long-context`) no engine could
reach it: the row is printed, informational, and says so. Without a GPU (`--device auto` on a
CPU host) only the torch rows run, on the tiny model at small sizes unless asked otherwise,
and the cuda rows say "no GPU"; the 1B model runs on the CPU only when `--models` names it.
Exit 1 on a MISS or a row that raised.

    python -m bench.engine_backends [--device cpu|cuda|auto] [--models tiny,llama-1b]
        [--batches 1,8,64] [--new-tokens N] [--prompt-len N] [--long-batch N] [--long-context N]
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Iterator

import torch

from bench.verdicts import Verdicts, positive_int
from headroom.engine.attention import select_backend
from headroom.engine.config import EngineConfig
from headroom.engine.engine import Engine
from headroom.engine.kernels.compile import HEAD_DIMS
from headroom.engine.model import (
    ByteTokenizer,
    LlamaForCausalLM,
    LoadedModel,
    ModelConfig,
    load_model,
)
from headroom.engine.model.config import RopeConfig
from headroom.engine.model_runner import ModelRunner
from headroom.engine.sampling import SamplingParams
from headroom.engine.scheduler import Scheduler

FP8_SPEEDUP_TARGET = 1.7
BLOCK = 16
ROWS = (("torch", "auto"), ("cuda", "auto"), ("cuda", "fp8"))
_ids = itertools.count()


def llama_1b_config() -> ModelConfig:
    """A Llama-3.2-1B-like shape (untied head, 8k positions) for random weights."""
    return ModelConfig(
        name="llama-1b",
        architecture="LlamaForCausalLM",
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope=RopeConfig(theta=500000.0),
        max_position_embeddings=8192,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=(ByteTokenizer.EOS,),
    )


MODELS = ("tiny", "llama-1b")


def load(name: str, device: torch.device) -> LoadedModel:
    """The model with random weights, built on `device` (bf16 on a GPU, fp32 on the CPU)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "tiny":
        return load_model("tiny", str(dtype).removeprefix("torch."), device)
    if name != "llama-1b":
        raise ValueError(f"unknown model {name!r} ({', '.join(MODELS)})")
    cfg = llama_1b_config()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():  # the tiny model's init: std 1/sqrt(fan_in), norms 1
        for pname, param in model.named_parameters():
            if pname.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                std = 1.0 if "embed_tokens" in pname else param.shape[1] ** -0.5
                param.normal_(0.0, std, generator=gen)
    return LoadedModel(name, cfg, model.eval(), ByteTokenizer(cfg.vocab_size), dtype)


def build_engine(
    loaded: LoadedModel, backend: str, kv: str, device: torch.device, batch: int, max_len: int
) -> Engine:
    """An engine over already loaded weights (what `Engine.from_config` does after loading),
    its pool sized for `batch` sequences of `max_len` tokens, so no admission watermark is
    needed to keep them all running."""
    num_blocks = batch * -(-max_len // BLOCK) + 16
    config = EngineConfig(
        model=loaded.name,
        device=str(device),
        block_size=BLOCK,
        num_blocks=num_blocks,
        max_model_len=max_len,
        max_num_batched_tokens=max(2048, min(16384, batch * max_len)),
        enable_prefix_caching=False,
        watermark=0.0,
        max_num_seqs=max(256, batch),
        kv_cache_dtype=kv,
        attention_backend=backend,
    )
    runner = ModelRunner(
        loaded.model, select_backend(config.attention_backend, device), num_blocks, BLOCK,
        config.kv_cache_dtype, device,
    )  # fmt: skip
    return Engine(config, loaded, runner, Scheduler(config))


def prompt(i: int, n: int) -> list[int]:
    """A distinct byte prompt per request (no two share a first block)."""
    return [ByteTokenizer.BOS, *((i * 7 + j * 13) % 256 for j in range(n - 1))]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_rate(
    engine: Engine, batch: int, prompt_len: int, new_tokens: int
) -> tuple[float, float]:
    """(decode tokens/s, ms per decode step) by wall clock, the prefill steps excluded."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    run = next(_ids)
    for i in range(batch):
        engine.add_request(f"{run}-{i}", prompt(i, prompt_len), params)
    started: set[str] = set()
    while len(started) < batch:  # prompts longer than a step's token budget prefill in chunks
        started.update(o.request_id for o in engine.step())
    device = engine.runner.device
    _sync(device)
    tokens = steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        tokens += sum(len(c.token_ids) for o in outs for c in o.outputs)
        steps += 1
    _sync(device)
    wall = time.perf_counter() - t0
    return tokens / wall, wall / max(steps, 1) * 1e3


def step_bytes(loaded: LoadedModel, kv: str, batch: int, context: int) -> float:
    """Bytes a decode step reads: every weight but the embedding table, and each sequence's KV."""
    cfg, model = loaded.config, loaded.model
    weights = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n
    )
    kv_elem = 1 if kv == "fp8" else torch.finfo(loaded.dtype).bits // 8
    per_token = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * kv_elem
    return float(weights + batch * context * per_token)


def unavailable(name: str, cfg: ModelConfig, backend: str, gpu: bool) -> str | None:
    """Why a (model, backend) row cannot run here, or None."""
    if backend != "cuda":
        return None
    if not gpu:
        return "no GPU"
    if cfg.head_dim not in HEAD_DIMS:
        return f"n/a: head_dim {cfg.head_dim} (cuda kernels: {', '.join(map(str, HEAD_DIMS))})"
    return None


def measure(
    loaded: LoadedModel,
    backend: str,
    kv: str,
    device: torch.device,
    batches: list[int],
    prompt_len: int,
    new_tokens: int,
) -> Iterator[tuple[int, float, float]]:
    """(batch, tokens/s, ms per step) per batch, on one engine sized for the largest batch."""
    engine = build_engine(loaded, backend, kv, device, max(batches), prompt_len + new_tokens)
    try:
        decode_rate(engine, 1, min(prompt_len, 16), min(new_tokens, 4))  # warm-up (kernel builds)
        for batch in batches:
            tok_s, ms = decode_rate(engine, batch, prompt_len, new_tokens)
            yield batch, tok_s, ms
    finally:
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()


def model_table(
    name: str, device: torch.device, args: argparse.Namespace, verdicts: Verdicts
) -> None:
    """One model's table, then its graded fp8 row (GPU only)."""
    t0 = time.perf_counter()
    loaded = load(name, device)
    cfg, gpu = loaded.config, device.type == "cuda"
    params = sum(p.numel() for p in loaded.model.parameters())
    print(
        f"\n{name}: hidden {cfg.hidden_size}, {cfg.num_layers} layers, "
        f"{cfg.num_attention_heads} q / {cfg.num_kv_heads} kv heads of {cfg.head_dim}, "
        f"vocab {cfg.vocab_size}, {params / 1e6:.1f} M parameters, {loaded.dtype}, on {device} "
        f"(built in {time.perf_counter() - t0:.1f} s); prompts {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens each, greedy"
    )
    print(f"{'backend':>8} {'kv':>5} {'batch':>6} {'tokens/s':>10} {'ms/step':>8}  result")
    rates: dict[tuple[str, int], float] = {}
    for backend, kv in ROWS:
        why = unavailable(name, cfg, backend, gpu)
        if why is not None:
            print(f"{backend:>8} {kv:>5} {'-':>6} {'-':>10} {'-':>8}  {why} (informational)")
            continue
        try:
            for batch, tok_s, ms in measure(
                loaded, backend, kv, device, args.batches, args.prompt_len, args.new_tokens
            ):
                note = "(no target)"
                if backend == "cuda":
                    rates[(kv, batch)] = tok_s
                if backend == "cuda" and kv == "fp8" and ("auto", batch) in rates:
                    ratio = tok_s / rates[("auto", batch)]
                    mark = verdicts(
                        ratio >= FP8_SPEEDUP_TARGET, f"{name} fp8/auto b{batch}", informational=True
                    )
                    note = f"fp8 / auto {ratio:.2f}x (>= {FP8_SPEEDUP_TARGET}x) {mark}"
                print(f"{backend:>8} {kv:>5} {batch:>6} {tok_s:10.0f} {ms:8.2f}  {note}")
        except Exception as exc:  # a failing backend is a result: print it, grade it, go on
            verdicts(False, f"{name} {backend}/{kv} raised {type(exc).__name__}")
            print(f"{backend:>8} {kv:>5} {'-':>6} {'-':>10} {'-':>8}  ERROR {exc!r:.300}")
    if name == args.models[-1]:
        fp8_row(loaded, device, args, verdicts)


def fp8_row(
    loaded: LoadedModel, device: torch.device, args: argparse.Namespace, verdicts: Verdicts
) -> None:
    """The graded fp8 / bf16 KV row: cuda backend, `--long-batch` long prompts."""
    name, batch, ctx = loaded.name, args.long_batch, args.long_context
    why = unavailable(name, loaded.config, "cuda", device.type == "cuda")
    head = f"fp8 / bf16 KV tokens/s, cuda backend, {name}, batch {batch}, {ctx}-token prompts:"
    if why is not None:
        print(f"\n{head} {why} (not graded)")
        return
    rates: dict[str, float] = {}
    for kv in ("auto", "fp8"):
        try:
            for _, tok_s, _ in measure(loaded, "cuda", kv, device, [batch], ctx, args.new_tokens):
                rates[kv] = tok_s
        except Exception as exc:
            verdicts(False, f"{name} cuda/{kv} at {ctx} tokens raised {type(exc).__name__}")
            print(f"\n{head} {kv} ERROR {exc!r:.300}")
            return
    avg = ctx + args.new_tokens // 2
    ceiling = step_bytes(loaded, "auto", batch, avg) / step_bytes(loaded, "fp8", batch, avg)
    ratio = rates["fp8"] / rates["auto"]
    # Below the target even in theory: a MISS would grade the sizes asked for, not the engine.
    reachable = ceiling >= FP8_SPEEDUP_TARGET
    mark = verdicts(
        ratio >= FP8_SPEEDUP_TARGET,
        f"{name} fp8/auto at {ctx} tokens {ratio:.2f}x",
        informational=not reachable,
    )
    why = "" if reachable else f" < {FP8_SPEEDUP_TARGET}x: not graded, no engine could reach it"
    print(
        f"\n{head} {rates['fp8']:.0f} / {rates['auto']:.0f} = {ratio:.2f}x "
        f"(target >= {FP8_SPEEDUP_TARGET}x) {mark}; bytes ceiling {ceiling:.2f}x{why}"
    )


def _ints(text: str) -> list[int]:
    """An argparse `type` for a comma list of batch sizes, each at least 1."""
    out = [positive_int(x.strip()) for x in text.split(",") if x.strip()]
    if not out:
        raise argparse.ArgumentTypeError("needs at least one batch size")
    return out


def _models(text: str) -> list[str]:
    """An argparse `type` for a comma list of the models this bench builds."""
    out = [x.strip() for x in text.split(",") if x.strip()]
    known = ", ".join(MODELS)
    for name in out:
        if name not in MODELS:
            raise argparse.ArgumentTypeError(f"unknown model {name!r} (one of {known})")
    if not out:
        raise argparse.ArgumentTypeError(f"needs at least one model ({known})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    ap.add_argument(
        "--models", type=_models, default=None, help="default: tiny,llama-1b (GPU), tiny (CPU)"
    )
    ap.add_argument("--batches", type=_ints, default=None, help="default: 1,8,64 (GPU), 1,8")
    ap.add_argument("--new-tokens", type=positive_int, default=None, help="default: 128 (GPU), 16")
    ap.add_argument("--prompt-len", type=positive_int, default=None, help="default: 128 (GPU), 16")
    ap.add_argument(
        "--long-batch", type=positive_int, default=256, help="the graded fp8 row's batch"
    )
    ap.add_argument(
        "--long-context", type=positive_int, default=2048, help="the graded fp8 row's prompt"
    )
    ap.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads on the CPU")
    args = ap.parse_args(argv)
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA GPU")
    device = torch.device(name)
    gpu = device.type == "cuda"
    args.models = args.models or (["tiny", "llama-1b"] if gpu else ["tiny"])
    args.batches = args.batches or ([1, 8, 64] if gpu else [1, 8])
    args.new_tokens = args.new_tokens or (128 if gpu else 16)
    args.prompt_len = args.prompt_len or (128 if gpu else 16)
    if args.new_tokens < 2 or args.prompt_len < 1:
        ap.error("--new-tokens must be >= 2 and --prompt-len >= 1")
    if not gpu:
        torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name(device) if gpu else "CPU (no GPU: cuda rows skipped)"
    print(f"Engine decode tokens/s per attention backend on {where}; torch {torch.__version__}")
    verdicts = Verdicts()
    for model in args.models:
        model_table(model, device, args, verdicts)
    print()
    return verdicts.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
