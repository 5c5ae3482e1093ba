"""headroom against a real Hugging Face pipeline on the CPU, side by side in one run.

The same random Llama (hidden 256, 4 layers, 8 query / 2 KV heads of 32, vocab 258, fp32,
transformers' own initialisation) is written once as a Hugging Face directory and loaded by
both; both get the same 32 MiB of KV and one torch thread:
- headroom: `Engine.generate` over the requests (continuous batching, paged KV, 1,024 blocks
  of 16 tokens = 32 MiB);
- transformers: `LlamaForCausalLM.generate` batched as a naive server would, batch 16 from the
  same budget (16 x (512 + 512) tokens of KV), prompts left-padded, each batch decoding until
  its longest output is done; a request's tokens past its own output length are wasted.
"useful slots": the requests' prompt + output positions over the positions computed (HF's
padded batches; headroom's own, plus what it computes again after a preemption, counted from
each step its scheduler plans).
Requests: 256, prompts 64-512 tokens and outputs 32-512 (uniform, seeded), greedy, EOS
ignored. They are served in 4 rounds of 64, each round by both pipelines back to back in
alternating order, and the verdict is on the median of the per-round ratios of useful output
tokens per CPU second (each side runs on one thread, so CPU time is what it costs, and other
jobs on a shared host disturb it far less than wall time; wall-clock tokens/s are printed too).
Target: headroom >= 4x the Hugging Face pipeline. An informational row runs headroom with
prefix caching on and off on requests of which 75 % share a 256-token prefix.
`--device cuda` (or `auto` with a GPU) runs both pipelines on the GPU, same model, fp32 and
the torch attention backend (the cuda kernels need head_dim 64 or 128); there the host's CPU
time is not what a request costs, so the verdict is on wall-clock tokens/s and informational.

    .venv/bin/python -m bench.hf_pipeline [--requests 256] [--rounds 4] [--no-prefix]
        [--device cpu|cuda|auto]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.verdicts import Verdicts, positive_int
from headroom.engine.config import EngineConfig
from headroom.engine.engine import Engine
from headroom.engine.sampling import SamplingParams
from headroom.engine.scheduled import SchedulerOutput

TARGET = 4.0
KV_BYTES = 32 * 1024 * 1024
BLOCK = 16
HF_BATCH = 16
MAX_PROMPT, MAX_OUTPUT = 512, 512
PREFIX_TOKENS, PREFIX_SHARE = 256, 0.75


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    output: int


@dataclass(slots=True)
class Run:
    tokens: int = 0  # useful output tokens
    cpu_s: float = 0.0
    wall_s: float = 0.0
    # Token positions computed: HF's padded batches; headroom's useful ones plus those it
    # computed again after a preemption (recompute), as its scheduler handed them out.
    slots: int = 0
    useful_slots: int = 0  # prompt + output tokens of the requests

    def add(self, other: Run) -> None:
        self.tokens += other.tokens
        self.cpu_s += other.cpu_s
        self.wall_s += other.wall_s
        self.slots += other.slots
        self.useful_slots += other.useful_slots


def write_model(path: Path) -> None:
    """The random Llama as a Hugging Face directory (weights, config, a 258-token tokenizer)."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=258,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_PROMPT + MAX_OUTPUT,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    LlamaForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    vocab = {f"t{i}": i for i in range(256)} | {"<s>": 256, "</s>": 257}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0")).save(str(path / "tokenizer.json"))


def workload(n: int, seed: int, shared_prefix: bool = False) -> list[Request]:
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(PREFIX_TOKENS)]
    out = []
    for _ in range(n):
        plen = rng.randint(64, MAX_PROMPT)
        prompt = [rng.randrange(256) for _ in range(plen)]
        if shared_prefix and plen > PREFIX_TOKENS and rng.random() < PREFIX_SHARE:
            prompt[:PREFIX_TOKENS] = prefix
        out.append(Request(prompt, rng.randint(32, MAX_OUTPUT)))
    return out


class Recompute:
    """Token positions the engine's scheduler hands the model a second time (after a
    preemption freed a sequence's blocks), counted from each step's `SchedulerOutput`."""

    def __init__(self, engine: Engine) -> None:
        self.positions = 0
        self._done: dict[int, int] = {}  # seq_id -> positions computed so far, at most
        self._scheduler = engine.scheduler
        self._schedule = engine.scheduler.schedule

    def _counting(self) -> SchedulerOutput:
        out = self._schedule()
        for e in out.scheduled:
            done = self._done.get(e.seq.seq_id, 0)
            self.positions += max(0, min(e.end, done) - e.start)
            self._done[e.seq.seq_id] = max(done, e.end)
        return out

    def __enter__(self) -> Recompute:
        self._scheduler.schedule = self._counting  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self._scheduler.schedule  # the class's method again


def run_headroom(engine: Engine, reqs: list[Request]) -> Run:
    params = [SamplingParams(temperature=0.0, max_tokens=r.output, ignore_eos=True) for r in reqs]
    with Recompute(engine) as recompute:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        outs = engine.generate([r.prompt for r in reqs], params)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(r.output for r in reqs), "headroom stopped a request early"
    useful = sum(len(r.prompt) + r.output for r in reqs)
    return Run(tokens, cpu, wall, useful + recompute.positions, useful)


def run_hf(model: torch.nn.Module, reqs: list[Request]) -> Run:
    run = Run()
    device = next(model.parameters()).device
    for b0 in range(0, len(reqs), HF_BATCH):
        batch = reqs[b0 : b0 + HF_BATCH]
        width = max(len(r.prompt) for r in batch)
        new = max(r.output for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt) :] = 1
        cpu0, wall0 = time.process_time(), time.perf_counter()
        with torch.inference_mode():
            out = model.generate(  # type: ignore[operator]
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        if out.is_cuda:
            torch.cuda.synchronize()
        run.cpu_s += time.process_time() - cpu0
        run.wall_s += time.perf_counter() - wall0
        assert out.shape[1] == width + new
        run.tokens += sum(r.output for r in batch)  # what each request asked for
        run.slots += len(batch) * (width + new)
        run.useful_slots += sum(len(r.prompt) + r.output for r in batch)
    return run


def engine_for(path: Path, prefix_caching: bool = True, device: str = "cpu") -> Engine:
    return Engine.from_config(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device=device,
            num_blocks=KV_BYTES // (2 * 4 * 2 * 32 * 4 * BLOCK),  # 2 KiB per fp32 token
            max_model_len=MAX_PROMPT + MAX_OUTPUT,
            attention_backend="torch",
            enable_prefix_caching=prefix_caching,
            num_threads=1,
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=positive_int, default=256)
    ap.add_argument("--rounds", type=positive_int, default=4)
    ap.add_argument("--no-prefix", action="store_true", help="skip the prefix-caching row")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu")
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = device == "cuda"
    torch.set_num_threads(1)
    from transformers import LlamaForCausalLM

    verdict = Verdicts()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "random-llama"
        write_model(path)
        hf = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
        hf.generation_config.eos_token_id = None  # ignore EOS, as headroom's requests do
        engine = engine_for(path, device=device)
        assert engine.runner.caches[0].key.dtype == torch.float32
        reqs = workload(args.requests, seed=1)
        warm = workload(4, seed=2)
        run_headroom(engine, warm)
        run_hf(hf, warm)
        per_round = -(-len(reqs) // args.rounds)
        totals = {"headroom": Run(), "hf": Run()}
        ratios, wall_ratios = [], []
        for r in range(args.rounds):
            chunk = reqs[r * per_round : (r + 1) * per_round]
            if not chunk:
                break
            order = ("hf", "headroom") if r % 2 == 0 else ("headroom", "hf")
            got: dict[str, Run] = {}
            for name in order:
                print(f"round {r + 1}/{args.rounds}: {name} ...", file=sys.stderr)
                got[name] = run_headroom(engine, chunk) if name == "headroom" else run_hf(hf, chunk)
                totals[name].add(got[name])
            h, f = got["headroom"], got["hf"]
            ratios.append((h.tokens / h.cpu_s) / (f.tokens / f.cpu_s))
            wall_ratios.append((h.tokens / h.wall_s) / (f.tokens / f.wall_s))
        ratio = statistics.median(wall_ratios if gpu else ratios)
        prefix_rows: list[tuple[str, float, float]] = []
        if not args.no_prefix:
            shared = workload(min(args.requests, 128), seed=3, shared_prefix=True)
            for on in (False, True):
                print(f"prefix caching {'on' if on else 'off'} ...", file=sys.stderr)
                run = run_headroom(engine_for(path, on, device), shared)
                prefix_rows.append((f"headroom, prefix caching {'on' if on else 'off'}",
                                    run.tokens / run.cpu_s, run.tokens / run.wall_s))  # fmt: skip

    h, f = totals["headroom"], totals["hf"]
    print(
        f"headroom vs transformers generate: random Llama 256x4 (8/2 heads of 32), fp32, "
        f"1 thread each, {KV_BYTES // 2**20} MiB of KV each, {len(reqs)} requests "
        f"(prompts 64-{MAX_PROMPT}, outputs 32-{MAX_OUTPUT}) in {len(ratios)} interleaved rounds"
        + (f", on {torch.cuda.get_device_name()}" if gpu else "")
    )
    print(f"{'pipeline':<36} {'tok/CPU-s':>10} {'tok/s wall':>11} {'useful slots':>13}")
    print(f"{'headroom (continuous batching)':<36} {h.tokens / h.cpu_s:10.0f} "
          f"{h.tokens / h.wall_s:11.0f} {h.useful_slots / h.slots:12.0%}")  # fmt: skip
    print(f"{'transformers generate, batch ' + str(HF_BATCH) + ' padded':<36} "
          f"{f.tokens / f.cpu_s:10.0f} {f.tokens / f.wall_s:11.0f} "
          f"{f.useful_slots / f.slots:12.0%}")  # fmt: skip
    print(f"useful slots: prompt + output positions of the requests / positions computed "
          f"(transformers: its padded batches; headroom: {h.slots - h.useful_slots:,} positions "
          f"computed again after preemptions, counted from its scheduler's steps)")  # fmt: skip
    result = verdict(ratio >= TARGET, f"headroom / HF is {ratio:.2f}x", informational=gpu)
    print(
        f"ratio headroom / HF (median of rounds, {'wall' if gpu else 'CPU'} time): {ratio:.2f}x  "
        f"target >= {TARGET:g}x  {result}"
    )
    print(f"  per round: {' '.join(f'{x:.2f}' for x in ratios)} (CPU); "
          f"{' '.join(f'{x:.2f}' for x in wall_ratios)} (wall)")  # fmt: skip
    if prefix_rows:
        (_, off_cpu, off_wall), (_, on_cpu, on_wall) = prefix_rows
        print(
            f"prefix caching on / off, {PREFIX_SHARE:.0%} of prompts sharing a "
            f"{PREFIX_TOKENS}-token prefix: {on_cpu / off_cpu:.2f}x tok/CPU-s "
            f"({on_cpu:.0f} / {off_cpu:.0f}), {on_wall / off_wall:.2f}x wall (informational)"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"ratio": ratio, "rounds": ratios, "wall_rounds": wall_ratios}) + "\n"
        )
    print()
    return verdict.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
