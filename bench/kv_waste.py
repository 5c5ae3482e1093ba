"""KV memory wasted: contiguous max_model_len reservation versus the paged block pool.

Both serve the same synthetic ShareGPT-like trace from the same fixed KV budget, one step at a
time (a step prefills newly admitted prompts and decodes one token for every running
sequence), with the whole trace queued at t=0 so the budget, not the arrival rate, is what
binds. Waste is 1 - (tokens whose KV is stored) / (token slots reserved), averaged over every
step; peak concurrency is the most sequences running at once.

- naive: a request is admitted only when max_model_len free slots remain and holds them until
  it finishes (what a contiguous-KV server must do without knowing the output length).
- paged: the real `headroom.engine.scheduler.Scheduler` (blocks of 16 tokens, chunked prefill,
  preemption by recompute), with a stand-in model that returns a token per sampling sequence.

Run: .venv/bin/python -m bench.kv_waste [--requests N] [--seed S]
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass

from bench.verdicts import Verdicts, positive_int
from headroom.engine.config import EngineConfig
from headroom.engine.scheduler import Scheduler
from headroom.engine.sequence import Sequence

# The vLLM paper's ShareGPT figures (Kwon et al. 2023, section 6.1): mean input 161.31 tokens,
# mean output 337.99 tokens. Lengths are log-normal with those means and sigma 1.0.
PROMPT_MEAN, OUTPUT_MEAN, SIGMA = 161.31, 337.99, 1.0
MAX_MODEL_LEN = 2048  # OPT-13B's context in the same paper
BLOCK_SIZE = 16
KV_BLOCKS = 2048  # 32,768 token slots: e.g. 4 GiB of Llama-3.1-8B bf16 KV (128 KiB/token)
MAX_NUM_SEQS = 1024  # high enough that the KV budget, not this cap, binds
MAX_BATCHED_TOKENS = 8192

TARGET_PAGED_WASTE = 0.04
NAIVE_BAND = (0.60, 0.80)
TARGET_RATIO = 3.0
WATERMARKS = (0.0, 0.01, 0.05, 0.1)


@dataclass(frozen=True, slots=True)
class Request:
    prompt_len: int
    output_len: int


def lognormal_len(rng: random.Random, mean: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - SIGMA**2 / 2
    return max(lo, min(hi, round(rng.lognormvariate(mu, SIGMA))))


def make_trace(n: int, seed: int) -> list[Request]:
    """ShareGPT-like lengths, clipped so that prompt + output fits max_model_len."""
    rng = random.Random(seed)
    trace = []
    for _ in range(n):
        prompt = lognormal_len(rng, PROMPT_MEAN, 1, MAX_MODEL_LEN - 1)
        output = lognormal_len(rng, OUTPUT_MEAN, 1, MAX_MODEL_LEN - prompt)
        trace.append(Request(prompt, output))
    return trace


@dataclass(slots=True)
class Result:
    waste: float
    peak_concurrency: int
    mean_concurrency: float
    steps: int
    preemptions: int
    recomputed: float  # share of all computed tokens that preemption made the model redo
    seconds: float


def run_naive(trace: list[Request]) -> Result:
    """Contiguous reservation of max_model_len per request."""
    t0 = time.perf_counter()
    capacity = KV_BLOCKS * BLOCK_SIZE
    queue = list(reversed(trace))
    running: list[list[int]] = []  # [stored tokens, tokens still to generate]
    waste_sum = conc_sum = 0.0
    steps = peak = 0
    while queue or running:
        while queue and (len(running) + 1) * MAX_MODEL_LEN <= capacity:
            r = queue.pop()
            running.append([r.prompt_len, r.output_len])  # prefill stores the prompt's KV
        for s in running:
            s[1] -= 1  # one token sampled per step; its KV is stored when it is fed back
        stored = sum(s[0] for s in running)
        waste_sum += 1 - stored / (len(running) * MAX_MODEL_LEN)
        conc_sum += len(running)
        peak = max(peak, len(running))
        steps += 1
        running = [s for s in running if s[1] > 0]
        for s in running:
            s[0] += 1
    return Result(
        waste_sum / steps, peak, conc_sum / steps, steps, 0, 0.0, time.perf_counter() - t0
    )


def run_paged(trace: list[Request], seed: int, watermark: float = 0.01) -> Result:
    """The real scheduler over the block pool."""
    t0 = time.perf_counter()
    cfg = EngineConfig(
        num_blocks=KV_BLOCKS,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        enable_prefix_caching=False,  # the trace shares no prefix; measure the pool alone
        watermark=watermark,
    )
    sched = Scheduler(cfg)
    rng = random.Random(seed)
    for i, r in enumerate(trace):
        prompt = [rng.randrange(32000) for _ in range(r.prompt_len)]
        sched.add(Sequence(f"r{i}", prompt, r.output_len))
    waste_sum = conc_sum = 0.0
    steps = peak = computed = 0
    while sched.has_unfinished():
        out = sched.schedule()
        computed += out.num_batched_tokens
        sched.update(out, {e.seq.seq_id: 0 for e in out.scheduled if e.sample})
        # Measured after the step, like the naive side: KV stored vs slots held by blocks.
        stored = sum(s.num_computed_tokens for s in sched.running)
        reserved = sched.kv.pool.num_used * BLOCK_SIZE
        if reserved:
            waste_sum += 1 - stored / reserved
        conc_sum += len(out.scheduled)
        peak = max(peak, len(out.scheduled))
        steps += 1
    needed = sum(r.prompt_len + r.output_len - 1 for r in trace)  # the last token is not fed
    return Result(
        waste_sum / steps,
        peak,
        conc_sum / steps,
        steps,
        sched.preemptions_total,
        1 - needed / computed,
        time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=positive_int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    trace = make_trace(args.requests, args.seed)
    prompts = [r.prompt_len for r in trace]
    outputs = [r.output_len for r in trace]
    naive = run_naive(trace)
    paged = run_paged(trace, args.seed)
    ratio = paged.peak_concurrency / naive.peak_concurrency
    verdict = Verdicts()

    print(
        f"trace: {len(trace)} requests, all queued at t=0; prompt log-normal(mean "
        f"{PROMPT_MEAN}, sigma {SIGMA}) -> mean {sum(prompts) / len(prompts):.0f}, "
        f"max {max(prompts)}; output log-normal(mean {OUTPUT_MEAN}, sigma {SIGMA}) -> mean "
        f"{sum(outputs) / len(outputs):.0f}, max {max(outputs)}; seed {args.seed}"
    )
    print(
        f"budget: {KV_BLOCKS} blocks x {BLOCK_SIZE} tokens = {KV_BLOCKS * BLOCK_SIZE} token "
        f"slots; max_model_len {MAX_MODEL_LEN}; paged max_num_seqs {MAX_NUM_SEQS}, "
        f"{MAX_BATCHED_TOKENS} tokens/step, prefix caching off"
    )
    print()
    header = f"{'':<30}{'naive contiguous':>18}{'paged blocks':>16}   target"
    print(header)
    print("-" * len(header) + "-" * 18)
    lo, hi = NAIVE_BAND
    paged_waste = verdict(paged.waste <= TARGET_PAGED_WASTE, "paged KV waste")
    naive_waste = verdict(lo <= naive.waste <= hi, "naive baseline waste in its band")
    conc = verdict(ratio >= TARGET_RATIO, "peak concurrency ratio")
    print(
        f"{'KV wasted (% of reserved)':<30}{naive.waste:>17.1%}{paged.waste:>16.1%}   "
        f"paged <= {TARGET_PAGED_WASTE:.0%}: {paged_waste}; "
        f"naive in {lo:.0%}-{hi:.0%}: {naive_waste}"
    )
    print(
        f"{'peak admitted concurrency':<30}{naive.peak_concurrency:>18}"
        f"{paged.peak_concurrency:>16}   ratio {ratio:.1f}x >= {TARGET_RATIO:.0f}x: "
        f"{conc}"
    )
    print(f"{'mean concurrency':<30}{naive.mean_concurrency:>18.1f}{paged.mean_concurrency:>16.1f}")
    print(f"{'steps to drain the trace':<30}{naive.steps:>18}{paged.steps:>16}")
    print(f"{'preemptions (recompute)':<30}{naive.preemptions:>18}{paged.preemptions:>16}")
    print(f"{'tokens recomputed':<30}{naive.recomputed:>18.1%}{paged.recomputed:>16.1%}")
    print(f"{'simulation wall time (s)':<30}{naive.seconds:>18.2f}{paged.seconds:>16.2f}")
    mean_ratio = paged.mean_concurrency / naive.mean_concurrency
    print(
        f"mean-concurrency ratio {mean_ratio:.1f}x (the peak is the t=0 burst of prompts; "
        f"the mean is what the budget sustains)"
    )

    print()
    print("paged admission watermark (fraction of blocks kept free), same trace and budget:")
    header = (
        f"{'watermark':>10}{'waste':>8}{'peak conc':>11}{'mean conc':>11}{'steps':>8}"
        f"{'preemptions':>13}{'recomputed':>12}"
    )
    print(header)
    print("-" * len(header))
    for wm in WATERMARKS:
        r = paged if wm == 0.01 else run_paged(trace, args.seed, watermark=wm)
        print(
            f"{wm:>10.2f}{r.waste:>8.1%}{r.peak_concurrency:>11}{r.mean_concurrency:>11.1f}"
            f"{r.steps:>8}{r.preemptions:>13}{r.recomputed:>12.1%}"
        )
    print()
    return verdict.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
