"""Sidecar benchmark: /metrics render time, CPU use at 1 s polling, forecast accuracy.

    .venv/bin/python -m bench.sidecar [--cpu-seconds 20] [--seeds 20]

1. Render: `generate_latest` on the sidecar's registry with a full window of samples and both
   latency histograms, for a headroom and a vLLM source (target: p99 <= 5 ms).
2. CPU: two real sidecars (`python -m headroom.sidecar`, headroom and vLLM source) poll an
   engine every 1 s and are scraped every 1 s; their CPU time is read from /proc
   (target: <= 2 % of one core).
3. Forecast accuracy on synthetic ramps: the sidecar's own pipeline (parse, PollState,
   figures) on simulated clocks; error = |predicted - actual| / actual time to saturation, where
   "actual" is when the simulated series really first reaches 100 %. The plain least-squares
   fit over the window is shown beside the shipped segmented fit (target: worst error <= 20 %
   once 10 s of data exist).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from aiohttp import ClientSession, web
from prometheus_client import generate_latest

from bench.verdicts import Verdicts, positive_int
from headroom.contract.forecast import forecast_saturation
from headroom.sidecar.collector import SidecarCollector, make_registry
from headroom.sidecar.config import SidecarConfig
from headroom.sidecar.sources import parse_headroom_stats
from headroom.sidecar.state import PollState, figures
from headroom.sidecar.vllm_source import parse_vllm_metrics

ROOT = Path(__file__).resolve().parent.parent
# The scriptable /stats engine is a test double: it lives with the tests.
sys.path.insert(0, str(ROOT / "tests"))
from synthetic_engine import SyntheticEngine  # noqa: E402

VLLM_TEXT = (ROOT / "tests" / "prometheus" / "vllm_metrics_dp2.txt").read_text()
RENDER_TARGET_MS = 5.0
CPU_TARGET_PCT = 2.0
ERROR_TARGET = 0.20


# -- 1. render -----------------------------------------------------------------------------


def _busy_engine() -> SyntheticEngine:
    eng = SyntheticEngine(capacity=8192, model="meta-llama/Llama-3.1-8B-Instruct")
    eng.running, eng.waiting = 48, 3
    rng = random.Random(1)
    for _ in range(500):
        eng.observe_ttft(rng.expovariate(4.0))
    return eng


def render_bench(renders: int) -> list[tuple[str, int, float, float, float]]:
    cfg = SidecarConfig(engine_url="http://127.0.0.1:1")
    rows = []
    for source in ("headroom", "vllm"):
        state = PollState(horizon=cfg.window + cfg.interval)
        eng = _busy_engine()
        for t in range(61):  # a full 60 s window at 1 s polling
            eng.set_used(2000 + 10 * t)
            eng.queries_tokens_total += 4096
            eng.hits_tokens_total += 1024
            reading = (
                parse_headroom_stats(eng.body())
                if source == "headroom"
                else parse_vllm_metrics(VLLM_TEXT)
            )
            state.record_success(reading, float(t))
        registry = make_registry(SidecarCollector(state, cfg, lambda: 60.0))
        text = generate_latest(registry)
        series = sum(1 for line in text.decode().splitlines() if line and not line.startswith("#"))
        wall, cpu = [], []
        for _ in range(renders):
            t0, c0 = time.perf_counter(), time.thread_time()
            generate_latest(registry)
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.thread_time() - c0) * 1e3)
        wall.sort()
        cpu.sort()
        p99 = int(0.99 * renders)
        rows.append((source, series, statistics.median(wall), wall[p99], cpu[p99]))
    return rows


# -- 2. CPU ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


async def cpu_bench(measure_s: float, warmup_s: float = 3.0) -> list[tuple[str, float, float]]:
    eng = _busy_engine()

    async def vllm_metrics(_: web.Request) -> web.Response:
        return web.Response(text=VLLM_TEXT, content_type="text/plain")

    app = eng.app()
    app.router.add_get("/metrics", vllm_metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    engine_port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", engine_port).start()
    sidecars: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    try:
        for source in ("headroom", "vllm"):
            port = _free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "headroom.sidecar", "--source", source,
                 "--engine-url", f"http://127.0.0.1:{engine_port}", "--host", "127.0.0.1",
                 "--port", str(port), "--interval", "1"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            sidecars[source] = (proc, port)
        async with ClientSession() as http:

            async def scrape_all() -> None:
                for _, port in sidecars.values():
                    try:
                        async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                            await resp.read()
                    except OSError:
                        pass  # still starting

            # Warm-up: until every sidecar is up and reading its engine, then a little more, so
            # that interpreter start and imports are not counted.
            deadline = time.monotonic() + 120
            pending = set(sidecars)
            while pending:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sidecars {sorted(pending)} never reported the engine up")
                for source in list(pending):
                    try:
                        url = f"http://127.0.0.1:{sidecars[source][1]}/saturation"
                        async with http.get(url) as resp:
                            if (await resp.json())["fresh"]:
                                pending.discard(source)
                    except OSError:
                        pass
                await asyncio.sleep(0.5)
            for _ in range(int(warmup_s)):
                await scrape_all()
                await asyncio.sleep(1.0)
            start = {s: _cpu_seconds(p.pid) for s, (p, _) in sidecars.items()}
            wall0 = time.monotonic()
            tick = 0
            while time.monotonic() - wall0 < measure_s:
                tick += 1
                eng.set_used(2000 + 10 * tick)  # the engine's state moves, as a real one does
                await scrape_all()
                await asyncio.sleep(1.0)
            wall = time.monotonic() - wall0
            used = {s: _cpu_seconds(p.pid) - start[s] for s, (p, _) in sidecars.items()}
        for proc, _ in sidecars.values():
            if proc.poll() is not None:
                raise RuntimeError("a sidecar exited during the CPU benchmark")
        return [(s, used[s], wall) for s in sidecars]
    finally:
        for proc, _ in sidecars.values():
            proc.terminate()
            proc.wait(timeout=20)
        await runner.cleanup()


# -- 3. forecast accuracy ------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    describe: str
    flat_s: int  # seconds of flat usage the sidecar has already seen before the ramp
    trend: Callable[[float], float]  # noise-free occupancy at second t of the ramp
    growth: float  # the trend's mean growth, occupancy per second
    noise_sd: float  # sample-to-sample noise (requests finishing, prefills), occupancy


SCENARIOS = [
    Scenario("steady", "0.5 %/s from 20 %, noise sd 0.3 %", 0,
             lambda t: 0.20 + 0.005 * t, 0.005, 0.003),
    Scenario("fast", "2 %/s from 30 %, noise sd 0.5 %", 0,
             lambda t: 0.30 + 0.02 * t, 0.02, 0.005),
    Scenario("bursty", "+4 % prefill burst every 4 s (1 %/s) from 25 %, noise sd 0.2 %", 0,
             lambda t: 0.25 + 0.04 * (t // 4), 0.01, 0.002),
    Scenario("spike", "60 s flat at 30 %, then 1 %/s, noise sd 0.3 %", 60,
             lambda t: 0.30 + 0.01 * t, 0.01, 0.003),
    Scenario("steady-noisy", "0.5 %/s from 20 %, noise sd 1 % (stress)", 0,
             lambda t: 0.20 + 0.005 * t, 0.005, 0.01),
    Scenario("spike-noisy", "60 s flat at 40 %, then 0.7 %/s, noise sd 1 % (stress)", 60,
             lambda t: 0.40 + 0.007 * t, 0.007, 0.01),
]  # fmt: skip
CHECKPOINTS_S = (10, 20, 30)
CAPACITY = 8192


def _saturation_time(trend: Callable[[float], float]) -> float:
    """When the noise-free ramp reaches 100 %, to 10 ms."""
    t = 0.0
    while trend(t) < 1.0:
        t += 0.01
        if t > 100_000:
            raise RuntimeError("ramp never saturates")
    return t


def _run_scenario(sc: Scenario, seed: int) -> dict[int, tuple[float, float | None, float | None]]:
    """For each checkpoint (seconds of ramp data): (actual, plain eta, shipped eta)."""
    rng = random.Random(seed)

    def noisy(y: float) -> float:
        return min(max(y + rng.gauss(0.0, sc.noise_sd), 0.0), 1.0)

    wall = _saturation_time(sc.trend)
    cfg = SidecarConfig(engine_url="http://127.0.0.1:1")
    state = PollState(horizon=cfg.window + cfg.interval)
    eng = SyntheticEngine(capacity=CAPACITY)
    out = {}
    for i in range(sc.flat_s + max(CHECKPOINTS_S) + 1):
        ramp_s = i - sc.flat_s
        occ = noisy(sc.trend(max(ramp_s, 0)))
        eng.set_used(round(occ * CAPACITY))
        state.record_success(parse_headroom_stats(eng.body()), float(i))
        if ramp_s in CHECKPOINTS_S and ramp_s < wall:
            fig = figures(state, cfg, now=float(i))
            window = [(s.t, s.occupancy) for s in state.samples if s.t >= i - cfg.forecast_window]
            plain = forecast_saturation(window, cfg.min_forecast_points, segmented=False)
            out[ramp_s] = (wall - ramp_s, plain.eta_seconds, fig.eta_seconds)
    return out


def _noise_floor(sc: Scenario, data_s: int) -> float:
    """2 sigma relative error of any least-squares slope from data_s + 1 points at 1 s."""
    m = data_s + 1
    sxx = m * (m * m - 1) / 12
    return 2 * sc.noise_sd / (sc.growth * math.sqrt(sxx))


def _err(pred: float | None, actual: float) -> float:
    if pred is None or not math.isfinite(pred):
        return math.inf
    return abs(pred - actual) / actual


@dataclass(frozen=True)
class AccuracyRow:
    scenario: str
    data_s: int
    actual_s: float
    floor: float
    plain_median: float
    plain_worst: float
    shipped_median: float
    shipped_worst: float


def accuracy_bench(seeds: int) -> list[AccuracyRow]:
    rows = []
    for sc in SCENARIOS:
        per_cp: dict[int, list[tuple[float, float | None, float | None]]] = {}
        for seed in range(seeds):
            for cp, v in _run_scenario(sc, seed).items():
                per_cp.setdefault(cp, []).append(v)
        for cp in CHECKPOINTS_S:
            runs = per_cp.get(cp)
            if not runs:
                continue
            plain = [_err(p, a) for a, p, _ in runs]
            shipped = [_err(s, a) for a, _, s in runs]
            rows.append(
                AccuracyRow(sc.name, cp, runs[0][0], _noise_floor(sc, cp),
                            statistics.median(plain), max(plain),
                            statistics.median(shipped), max(shipped))
            )  # fmt: skip
    return rows


def _pct(x: float) -> str:
    return "inf" if math.isinf(x) else f"{100 * x:.1f} %"


def positive_seconds(text: str) -> float:
    """An argparse `type` for a measurement length: a finite number of seconds above 0 (none
    would measure nothing and grade it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cpu-seconds", type=positive_seconds, default=20.0, help="CPU measurement length"
    )
    ap.add_argument(
        "--seeds", type=positive_int, default=20, help="random series per ramp scenario"
    )
    ap.add_argument("--renders", type=positive_int, default=2000, help="/metrics renders timed")
    args = ap.parse_args(argv)

    print(
        f"headroom sidecar benchmark — {os.cpu_count()} CPU cores, Python "
        f"{platform.python_version()}, prometheus-client {version('prometheus-client')}, "
        f"aiohttp {version('aiohttp')}"
    )
    verdict = Verdicts()

    print(
        f"\n/metrics render: generate_latest, {args.renders} renders, full 60 s window; wall time"
        " and this thread's CPU time\n(the wall p99 includes time descheduled by other processes)"
    )
    print(
        f"{'source':<10}{'series':>7}{'median wall ms':>16}{'p99 wall ms':>13}{'p99 cpu ms':>12}"
        f"   {'target':<16}result"
    )
    for source, series, med, p99_wall, p99_cpu in render_bench(args.renders):
        good = p99_cpu <= RENDER_TARGET_MS and med <= RENDER_TARGET_MS
        result = verdict(good, f"{source} /metrics render time")
        print(
            f"{source:<10}{series:>7}{med:>16.3f}{p99_wall:>13.3f}{p99_cpu:>12.3f}"
            f"   {'p99 cpu <= 5 ms':<16}{result}"
        )

    print(f"\nsidecar CPU at 1 s polling, scraped every 1 s ({args.cpu_seconds:g} s measured)")
    print(f"{'source':<10}{'cpu s':>8}{'wall s':>9}{'% of a core':>13}   {'target':<12}result")
    for source, cpu, wall in asyncio.run(cpu_bench(args.cpu_seconds)):
        pct = 100 * cpu / wall
        result = verdict(pct <= CPU_TARGET_PCT, f"{source} sidecar CPU")
        print(f"{source:<10}{cpu:>8.2f}{wall:>9.1f}{pct:>12.2f} %   {'<= 2 %':<12}{result}")

    print(
        f"\nforecast accuracy on synthetic ramps: {args.seeds} seeds each, 1 s polling, "
        "30 s forecast window;"
        "\nerror = |predicted - actual| / actual seconds to saturation (median / worst);"
        "\n2σ floor = twice the relative standard error of any least-squares slope from that"
        " much data at that noise"
    )
    print(
        f"{'scenario':<14}{'data s':>6}{'actual s':>9}{'2σ floor':>10}{'plain OLS':>20}"
        f"{'segmented (shipped)':>22}   {'target':<14}result"
    )
    noise_bound = []
    for r in accuracy_bench(args.seeds):
        # Where the 2σ floor itself exceeds the target no least-squares fit can meet it: the
        # row is shown, marked informational, and not graded.
        below_floor = r.floor > ERROR_TARGET
        if below_floor:
            noise_bound.append(f"{r.scenario} at {r.data_s} s")
        result = verdict(
            r.shipped_worst <= ERROR_TARGET,
            f"{r.scenario} forecast error at {r.data_s} s",
            informational=below_floor,
        )
        plain = f"{_pct(r.plain_median)} / {_pct(r.plain_worst)}"
        shipped = f"{_pct(r.shipped_median)} / {_pct(r.shipped_worst)}"
        print(
            f"{r.scenario:<14}{r.data_s:>6}{r.actual_s:>9.1f}{_pct(r.floor):>10}{plain:>20}"
            f"{shipped:>22}   {'worst <= 20 %':<14}{result}"
        )
    print("\nscenarios:")
    for sc in SCENARIOS:
        print(f"  {sc.name:<14}{sc.describe}")
    if noise_bound:
        print(
            f"\nnot graded: {', '.join(noise_bound)}, where the 2σ noise floor itself is over"
            " 20 %: no least-squares fit can meet the target there"
        )
    print()
    return verdict.exit_code()


if __name__ == "__main__":
    sys.exit(main())
