"""Fault soak: `headroom load` with client hang-ups against a server whose steps fail at random.

Each seed runs one in-process `headroom serve` (tiny model, CPU) whose model forward, sampling
and detokenizer raise at seeded random points, and drives it with the load generator, a share
of whose clients hang up mid-stream. The table gives requests served, errors by type, the
faults injected, and the KV blocks still held once the server is idle: that must be 0, every
error must be one the faults explain, and a request after the soak must succeed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

import headroom.engine.engine as engine_module
from bench.verdicts import Verdicts
from headroom.engine.async_engine import AsyncEngine
from headroom.engine.config import EngineConfig
from headroom.engine.engine import Engine
from headroom.engine.health import EngineHealth
from headroom.engine.loadgen.client import Target, run_load
from headroom.engine.loadgen.workload import LengthDist, WorkloadSpec
from headroom.engine.model.tokenizer import IncrementalDetokenizer
from headroom.engine.server.app import ServerSettings, ServerState, create_app
from headroom.engine.server.runner import attach_engine

# What an injected fault or a hang-up may show a client; anything else is a bug.
EXPLAINED = ("http_500", "stream_error", "client_disconnect")


@dataclass
class Faults:
    """Seeded fault injection into one engine: each hook raises with its own probability."""

    rng: random.Random
    p_forward: float
    p_sample: float
    p_decode: float
    armed: bool = False
    injected: Counter[str] = field(default_factory=Counter)

    def maybe(self, kind: str, p: float) -> None:
        if self.armed and self.rng.random() < p:
            self.injected[kind] += 1
            if kind == "decode":
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected by the soak")
            raise RuntimeError(f"injected {kind} failure")

    def wrap(self, kind: str, p: float, real: Callable[..., Any]) -> Callable[..., Any]:
        def hooked(*args: Any, **kwargs: Any) -> Any:
            self.maybe(kind, p)
            return real(*args, **kwargs)

        return hooked


@contextmanager
def injected(engine: Engine, faults: Faults) -> Iterator[None]:
    """Install the fault hooks on `engine` (and the detokenizer class) for the block's length."""
    runner, real_execute = engine.runner, engine.runner.execute
    # The engine calls sample_rows through its own module's name, so that is where it is hooked.
    real_sample, real_add = engine_module.sample_rows, IncrementalDetokenizer.add  # type: ignore[attr-defined]
    runner.execute = faults.wrap("forward", faults.p_forward, real_execute)  # type: ignore[method-assign]
    engine_module.sample_rows = faults.wrap("sample", faults.p_sample, real_sample)  # type: ignore[attr-defined]
    IncrementalDetokenizer.add = faults.wrap("decode", faults.p_decode, real_add)  # type: ignore[method-assign]
    try:
        yield
    finally:
        runner.execute = real_execute  # type: ignore[method-assign]
        engine_module.sample_rows = real_sample  # type: ignore[attr-defined]
        IncrementalDetokenizer.add = real_add  # type: ignore[method-assign]


@dataclass
class SoakResult:
    seed: int
    requests: int
    ok: int
    errors: Counter[str]
    injected: Counter[str]
    failed_steps: int
    leaked_blocks: int
    healthy: bool
    after_ok: bool
    seconds: float


async def soak_one(seed: int, requests: int, concurrency: int, p: float) -> SoakResult:
    """One seeded soak: serve, load with faults armed, drain, count what is still held."""
    config = EngineConfig(model="tiny", num_blocks=160, max_model_len=512, num_threads=1)
    engine = Engine.from_config(config)
    # Random faults may land back to back; the soak measures recovery, not the restart rule.
    health = EngineHealth(max_consecutive_failures=1_000_000)
    aengine = AsyncEngine(engine, health)
    await aengine.start()
    state = ServerState(ServerSettings(served_model_name="tiny"))
    attach_engine(state, aengine, config.model, engine.max_model_len)
    runner = web.AppRunner(create_app(state), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    target = Target(base_url=f"http://127.0.0.1:{port}", timeout_s=120)
    faults = Faults(random.Random(seed), p_forward=p, p_sample=p / 2, p_decode=p / 20)
    t0 = time.perf_counter()
    try:
        warm = WorkloadSpec(num_requests=2, concurrency=2, output_len=LengthDist(mean=2))
        tpw = (await run_load(warm, target)).tokens_per_word
        spec = WorkloadSpec(
            num_requests=requests,
            concurrency=concurrency,
            prompt_len=LengthDist(kind="uniform", mean=48),
            output_len=LengthDist(kind="uniform", mean=32),
            shared_prefix_fraction=0.3,
            prefix_len=32,
            disconnect_fraction=0.2,
            seed=seed,
        )
        with injected(engine, faults):
            faults.armed = True
            result = await run_load(spec, target, tokens_per_word=tpw)
            faults.armed = False
        deadline = time.monotonic() + 30
        while engine.has_unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        pool = engine.scheduler.kv.pool
        # Free and parked prefix blocks add up to the pool when nothing holds a block.
        leaked = pool.num_blocks - pool.num_free - pool.num_cached
        after = await run_load(WorkloadSpec(num_requests=1, seed=seed), target, tokens_per_word=tpw)
    finally:
        await runner.cleanup()
        await aengine.shutdown(grace_s=0)
    recs = result.records
    return SoakResult(
        seed=seed,
        requests=len(recs),
        ok=sum(r.ok for r in recs),
        errors=Counter(r.error or "unknown" for r in recs if not r.ok),
        injected=faults.injected,
        failed_steps=health.failed_steps_total,
        leaked_blocks=leaked,
        healthy=health.healthy,
        after_ok=all(r.ok for r in after.records),
        seconds=time.perf_counter() - t0,
    )


def _errors(c: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--requests", type=int, default=200, help="requests per seed")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--fault-rate", type=float, default=0.01, help="per-step forward failure p")
    args = ap.parse_args(argv)
    # Each injected fault logs an error in the engine; the table counts them instead.
    logging.getLogger("headroom").setLevel(logging.CRITICAL)
    print(
        f"fault soak: tiny model in-process, {args.requests} requests per seed at concurrency "
        f"{args.concurrency}, 20 % of clients hang up mid-stream; per step p(forward fails) "
        f"{args.fault_rate:g}, p(sample fails) {args.fault_rate / 2:g}, per token p(decode "
        f"fails) {args.fault_rate / 20:g}"
    )
    verdict = Verdicts()
    header = (
        f"{'seed':>4} {'requests':>8} {'served':>6} {'failed steps':>12} {'leaked':>6} "
        f"{'after':>5} {'s':>4}  errors by type / faults injected"
    )
    print(header)
    print("-" * (len(header) + 20))
    totals: Counter[str] = Counter()
    leaked = 0
    for seed in args.seeds:
        r = asyncio.run(soak_one(seed, args.requests, args.concurrency, args.fault_rate))
        unexplained = {k: v for k, v in r.errors.items() if not k.startswith(EXPLAINED)}
        verdict(r.leaked_blocks == 0, f"seed {seed} leaked {r.leaked_blocks} KV blocks")
        verdict(not unexplained, f"seed {seed} errors no fault explains: {unexplained}")
        verdict(r.requests == args.requests, f"seed {seed} lost requests")
        verdict(r.after_ok and r.healthy, f"seed {seed}: the server did not keep serving")
        verdict(sum(r.injected.values()) > 0, f"seed {seed} injected no fault")
        totals.update(r.errors)
        leaked += r.leaked_blocks
        print(
            f"{seed:>4} {r.requests:>8} {r.ok:>6} {r.failed_steps:>12} {r.leaked_blocks:>6} "
            f"{'ok' if r.after_ok else 'FAIL':>5} {r.seconds:>4.0f}  {_errors(r.errors)} / "
            f"{_errors(r.injected)}"
        )
    print(f"\nall seeds: errors {_errors(totals)}; leaked blocks {leaked} (target 0)")
    print()
    return verdict.exit_code()


if __name__ == "__main__":
    sys.exit(main())
