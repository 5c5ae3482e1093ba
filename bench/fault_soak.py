"""Fault soak: `headroom load` with client hang-ups against a server whose steps fail at random.

Each seed runs one in-process `headroom serve` (tiny model, CPU) whose model forward, sampling
and detokenizer raise at seeded random points, and drives it with the load generator, a share
of whose clients hang up mid-stream. The table gives requests served, errors by type, the
faults injected, and the KV blocks still held once the server is idle: that must be 0, every
error must be one the faults explain, and a request after the soak must succeed. An error is
explained only by its injected cause: a hang-up the load generator asked for, or a 500 /
stream error event whose message is the engine's "request ID failed in the engine: " and the
injected exception (a 500 of any other cause counts as unexplained); and no kind of fault may
fail more requests than it can (a failed step fails at most the requests in flight, a failed
decode its own request).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

import headroom.engine.engine as engine_module
from bench.verdicts import Verdicts, positive_int
from headroom.engine.async_engine import AsyncEngine
from headroom.engine.config import EngineConfig
from headroom.engine.engine import Engine
from headroom.engine.health import EngineHealth
from headroom.engine.loadgen.client import RequestRecord, Target, run_load
from headroom.engine.loadgen.workload import LengthDist, WorkloadSpec
from headroom.engine.model.tokenizer import IncrementalDetokenizer
from headroom.engine.server.app import ServerSettings, ServerState, create_app
from headroom.engine.server.runner import attach_engine

# Faults that fail a whole step (every request in it), and the one that fails one request.
WHOLE_STEP = ("forward", "sample")
FAULT_KINDS = (*WHOLE_STEP, "decode")


def fault_exception(kind: str) -> Exception:
    """The exception the soak raises for a fault of `kind`."""
    if kind == "decode":
        return UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected by the soak")
    return RuntimeError(f"injected {kind} failure")


def fault_signature(kind: str) -> str:
    """How a request failed by a fault of `kind` reads to its client: the server answers a
    `RequestFailed` with a 500 (or a stream error event) whose message is
    "request ID failed in the engine: TYPE: MESSAGE" (code engine_error); the load generator
    keeps that message (RequestRecord.error_message), not the code."""
    exc = fault_exception(kind)
    return f" failed in the engine: {type(exc).__name__}: {exc}"


def explained_by(error: str | None, message: str | None) -> str | None:
    """The injected fault that explains one failed request: a `FAULT_KINDS` kind, or
    "disconnect" for a hang-up the load generator was asked for; None when nothing injected
    explains it (a server error without the fault's signature is a bug, not a fault)."""
    if error == "client_disconnect":
        return "disconnect"
    if error is None or message is None:
        return None
    if not (error.startswith("http_500") or error == "stream_error"):
        return None
    if not message.startswith("request "):
        return None
    return next((k for k in FAULT_KINDS if message.endswith(fault_signature(k))), None)


def classify(records: Iterable[RequestRecord]) -> tuple[Counter[str], Counter[str]]:
    """The failed requests by the fault that explains each, and those no fault explains (by
    their error name)."""
    explained: Counter[str] = Counter()
    unexplained: Counter[str] = Counter()
    for r in records:
        if r.ok:
            continue
        kind = explained_by(r.error, r.error_message)
        if kind is None:
            unexplained[r.error or "unknown"] += 1
        else:
            explained[kind] += 1
    return explained, unexplained


def over_bound(explained: Counter[str], injected: Counter[str], concurrency: int) -> list[str]:
    """Kinds with more failed requests than their faults can fail: a whole-step fault fails at
    most the `concurrency` requests in flight, a decode fault its own request."""
    return [
        f"{k} {explained[k]} > {injected[k]} x {concurrency if k in WHOLE_STEP else 1}"
        for k in FAULT_KINDS
        if explained[k] > injected[k] * (concurrency if k in WHOLE_STEP else 1)
    ]


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
            raise fault_exception(kind)

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
    explained: Counter[str]
    unexplained: Counter[str]
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
    explained, unexplained = classify(recs)
    return SoakResult(
        seed=seed,
        requests=len(recs),
        ok=sum(r.ok for r in recs),
        errors=Counter(r.error or "unknown" for r in recs if not r.ok),
        explained=explained,
        unexplained=unexplained,
        injected=faults.injected,
        failed_steps=health.failed_steps_total,
        leaked_blocks=leaked,
        healthy=health.healthy,
        after_ok=all(r.ok for r in after.records),
        seconds=time.perf_counter() - t0,
    )


def _errors(c: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "-"


def probability(text: str) -> float:
    """An argparse `type` for the fault rate: a probability p with 0 < p <= 1 (at 0 no fault
    is injected and the soak has nothing to grade)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a probability in (0, 1], got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--requests", type=positive_int, default=200, help="requests per seed")
    ap.add_argument("--concurrency", type=positive_int, default=8)
    ap.add_argument(
        "--fault-rate", type=probability, default=0.01, help="per-step forward failure p"
    )
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
        f"{'after':>5} {'s':>4} {'unexplained':>11}  errors by type / faults injected"
    )
    print(header)
    print("-" * (len(header) + 20))
    totals: Counter[str] = Counter()
    leaked = unexplained_total = 0
    for seed in args.seeds:
        r = asyncio.run(soak_one(seed, args.requests, args.concurrency, args.fault_rate))
        unexplained = dict(r.unexplained)
        excess = over_bound(r.explained, r.injected, args.concurrency)
        verdict(r.leaked_blocks == 0, f"seed {seed} leaked {r.leaked_blocks} KV blocks")
        verdict(not unexplained, f"seed {seed} errors no fault explains: {unexplained}")
        verdict(not excess, f"seed {seed} more failures than its faults can cause: {excess}")
        verdict(r.requests == args.requests, f"seed {seed} lost requests")
        verdict(r.after_ok and r.healthy, f"seed {seed}: the server did not keep serving")
        verdict(sum(r.injected.values()) > 0, f"seed {seed} injected no fault")
        totals.update(r.errors)
        leaked += r.leaked_blocks
        unexplained_total += sum(r.unexplained.values())
        print(
            f"{seed:>4} {r.requests:>8} {r.ok:>6} {r.failed_steps:>12} {r.leaked_blocks:>6} "
            f"{'ok' if r.after_ok else 'FAIL':>5} {r.seconds:>4.0f} "
            f"{sum(r.unexplained.values()):>11}  {_errors(r.errors)} / "
            f"{_errors(r.injected)}"
        )
    print(
        f"\nall seeds: errors {_errors(totals)}; unexplained {unexplained_total} (target 0); "
        f"leaked blocks {leaked} (target 0)"
    )
    print()
    return verdict.exit_code()


if __name__ == "__main__":
    sys.exit(main())
