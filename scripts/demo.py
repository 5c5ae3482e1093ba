"""`make demo` (`python scripts/demo.py`): the whole loop on one CPU in about a minute.

1. `headroom plan` for two worked examples (what KV arithmetic says about real deployments).
2. `headroom serve` on the built-in tiny model with a deliberately small KV pool.
3. The sidecar polling it, and the operator's scaling decision on the sidecar's report: the
   operator's own `sample_from_report`, `policy_for` (the CRD's scaling defaults) and `decide`.
   A part that fails stops the demo with its error; nothing is skipped.
4. `headroom load` ramping concurrency past what the pool holds.
5. The plan for this pod next to what was measured: peak occupancy, prefix hit ratio,
   preemptions, and the latency at each concurrency step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, TextIO

from headroom.contract.budget import (
    ModelArch,
    Plan,
    PlanInput,
    gpu_preset,
    kv_bytes_per_block,
    model_preset,
    plan,
)
from headroom.contract.plan_cli import render_plan
from headroom.contract.report import SaturationReport
from headroom.engine.loadgen.client import LoadResult, Target, run_load
from headroom.engine.loadgen.progress import ProgressBar
from headroom.engine.loadgen.stats import LoadSummary, render_summary, summarize
from headroom.engine.loadgen.workload import LengthDist, WorkloadSpec
from headroom.engine.model.tiny import tiny_config
from headroom.operator.crd.models import InferenceDeploymentSpec
from headroom.operator.reconcile.sizing import Sizing
from headroom.operator.scaling.decide import Decision, Inputs, Memory, PodView, decide
from headroom.operator.scaling.loop import policy_for
from headroom.operator.scaling.metrics_sources import sample_from_report

# The demo pod: a pool that holds about 7 of the ramp's sequences, so the ramp to 24 hits it.
BLOCK_SIZE = 16
NUM_BLOCKS = 160
MAX_MODEL_LEN = 1024
PROMPT_TOKENS = 96
PREFIX_TOKENS = 128
OUTPUT_TOKENS = 96
SHARED_FRACTION = 0.75
RAMP = (1, 24)
RAMP_SECONDS = 24.0
LOAD_SECONDS = 30.0
# The helpers running now, and the signals received: a signal stops the helpers itself, so the
# demo stops even where the SystemExit it raises is lost (Python only prints an exception
# raised in a finalizer or a weakref callback, and goes on).
_HELPERS: list[subprocess.Popen[str]] = []
_SIGNALLED: list[int] = []
# True while a helper starts: a signal then only records itself and the start, once the helper
# is registered, stops it and exits. Raised inside Popen() it would leave a started process
# that nothing holds. (Blocking signals instead would pass the mask on to the helper.)
_STARTING: list[bool] = [False]

EXAMPLES = (
    ("Llama 3.1 70B on H100 80GB, tp 4", "llama-3.1-70b", "h100-80gb", 4, 128, 4096),
    ("Llama 3.1 8B on L4 24GB", "llama-3.1-8b", "l4-24gb", 1, 64, 8192),
)


def _section(title: str) -> None:
    print(f"\n=== {title} ", "=" * max(0, 74 - len(title)), sep="", flush=True)


def worked_examples() -> None:
    """Print the plan of each worked example."""
    for title, model, gpu_name, tp, conc, ctx in EXAMPLES:
        gpu = gpu_preset(gpu_name)
        inp = PlanInput(
            model=model_preset(model),
            gpu_name=gpu.name,
            gpu_memory_bytes=gpu.memory_bytes,
            tp=tp,
            concurrency=conc,
            context=ctx,
        )
        print(f"\n$ headroom plan --model {model} --gpu {gpu_name} --tp {tp} "
              f"--concurrency {conc} --context {ctx}   # {title}")  # fmt: skip
        print(render_plan(plan(inp)))


def _get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _wait_ready(url: str, proc: subprocess.Popen[str], what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1.0).close()
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise RuntimeError(f"{what} not ready at {url} after {timeout:.0f}s")


@contextlib.contextmanager
def _process(
    args: list[str], env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], TextIO]]:
    """A helper process whose output goes to a temporary log (printed if the step fails)."""
    if _SIGNALLED:  # a signal whose SystemExit was lost: start nothing more
        raise SystemExit(128 + _SIGNALLED[0])
    # Append mode: reading the log moves the offset the process shares, not where it writes.
    with tempfile.TemporaryFile(mode="a+") as log:
        _STARTING[0] = True
        try:
            proc = subprocess.Popen(
                [sys.executable, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
            _HELPERS.append(proc)
        except BaseException:
            _STARTING[0] = False
            raise
        try:
            # Cleared inside the `try`: a signal from here on raises where the cleanup runs.
            _STARTING[0] = False
            if _SIGNALLED:  # it came while the helper started: the cleanup below stops it
                raise SystemExit(128 + _SIGNALLED[0])
            yield proc, log
        except BaseException:
            log.seek(0)
            print(log.read()[-2000:], file=sys.stderr)
            raise
        finally:
            try:
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
            finally:
                # Only once reaped: a signal before this still reaches the helper.
                _HELPERS.remove(proc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _serve(args: list[str]) -> Iterator[tuple[str, list[str]]]:
    """`headroom serve` on a free port, once ready: its URL and the lines it printed by then."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["-m", "headroom.engine.server", "--host", "127.0.0.1", "--port", str(port), *args]
    # One torch thread: on a small shared CPU intra-op threads spin against the load client.
    with _process(argv, {"OMP_NUM_THREADS": "1"}) as (proc, log):
        _wait_ready(url + "/ready", proc, "headroom serve", timeout=180)
        log.seek(0)
        yield url, log.read().splitlines()


def tiny_arch() -> ModelArch:
    """The built-in tiny model's architecture, as the budget model sees it."""
    return tiny_config()


def pod_plan(peak_concurrency: int) -> Plan:
    """The plan for this demo pod: the tiny model, with exactly its KV pool as 'GPU memory'."""
    arch = tiny_arch()
    params = arch.num_parameters
    pool = NUM_BLOCKS * kv_bytes_per_block(arch, BLOCK_SIZE, "fp32")
    inp = PlanInput(
        model=arch,
        gpu_name="demo CPU pod",
        gpu_memory_bytes=params * 4 + pool,
        concurrency=peak_concurrency,
        context=PREFIX_TOKENS + PROMPT_TOKENS + OUTPUT_TOKENS,
        kv_dtype="fp32",
        block_size=BLOCK_SIZE,
        gpu_memory_utilization=1.0,
        activation_reserve_bytes=0,
    )
    return plan(inp)


def demo_spec(peak_concurrency: int) -> InferenceDeploymentSpec:
    """The InferenceDeployment a user would write for this pod (scaling left at the defaults)."""
    arch = tiny_arch()
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {
                "numLayers": arch.num_layers,
                "numAttentionHeads": arch.num_attention_heads,
                "numKVHeads": arch.num_kv_heads,
                "headDim": arch.head_dim,
                "hiddenSize": arch.hidden_size,
                "vocabSize": arch.vocab_size,
                "parameterCount": arch.num_parameters,
            },
            "gpu": {"memoryGiB": 1},
            "engine": {"blockSize": BLOCK_SIZE, "maxModelLen": MAX_MODEL_LEN},
            "traffic": {
                "peakConcurrency": peak_concurrency,
                "contextTokens": PREFIX_TOKENS + PROMPT_TOKENS + OUTPUT_TOKENS,
                "prefixHitRatio": SHARED_FRACTION * PREFIX_TOKENS / (PREFIX_TOKENS + PROMPT_TOKENS),
            },
        }
    )


def autoscaling_decisions(
    reports: list[dict[str, Any]], pod: Plan, peak_concurrency: int
) -> tuple[Decision, dict[str, Any]]:
    """The operator's decisions on the sidecar's `/saturation` reports, one per report, as its
    scaling loop makes them: the same parsing, the policy of a CR with default scaling, and
    `decide()` with the memory one decision hands the next. Returns the decision taken at the
    report with the highest occupancy (the peak of the ramp), and that report."""
    sizing = Sizing(plan=pod, feasible=True, reason=None, max_model_len=MAX_MODEL_LEN)
    policy = policy_for(demo_spec(peak_concurrency), sizing)
    memory = Memory()
    at_peak: tuple[float, Decision, dict[str, Any]] | None = None
    for report in reports:
        sample = sample_from_report(SaturationReport.model_validate(report))
        if sample is None:
            continue
        view = PodView(name="demo-0", ready=True, created_at=sample.sampled_at - 600,
                       sample=sample)  # fmt: skip
        dec = decide(Inputs(sample.sampled_at, 1, (view,), policy, memory))
        memory = dec.memory
        if at_peak is None or sample.occupancy >= at_peak[0]:
            at_peak = (sample.occupancy, dec, report)
    if at_peak is None:
        raise RuntimeError("the sidecar's reports carry no occupancy")
    return at_peak[1], at_peak[2]


def in_flight(report: dict[str, Any]) -> int:
    """The sequences the engine held at that report: running plus waiting."""
    return int(report.get("running") or 0) + int(report.get("waiting") or 0)


async def _ramp(url: str, sidecar_url: str) -> tuple[LoadResult, list[dict[str, Any]]]:
    spec = WorkloadSpec(
        duration_s=LOAD_SECONDS,
        concurrency=RAMP[0],
        ramp_to=RAMP[1],
        ramp_s=RAMP_SECONDS,
        prompt_len=LengthDist(kind="uniform", mean=PROMPT_TOKENS, spread=0.5),
        output_len=LengthDist(mean=OUTPUT_TOKENS),
        shared_prefix_fraction=SHARED_FRACTION,
        prefix_len=PREFIX_TOKENS,
        seed=7,
    )
    bar = ProgressBar(duration=spec.duration_s, line_interval_s=4.0)
    reports: list[dict[str, Any]] = []

    async def watch_sidecar() -> None:
        while True:
            with contextlib.suppress(OSError, ValueError):
                reports.append(await asyncio.to_thread(_get_json, sidecar_url + "/saturation"))
            await asyncio.sleep(1.0)

    watcher = asyncio.create_task(watch_sidecar())
    try:
        result = await run_load(
            spec,
            Target(base_url=url, timeout_s=300),
            stats_url=url + "/stats",
            stats_interval_s=0.25,
            tokens_per_word=None,
            on_progress=bar.update,
        )
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    return result, reports


def closing_table(p: Plan, s: LoadSummary) -> str:
    """The plan for this pod next to the measurements."""
    e = s.engine
    rows: list[tuple[str, str]] = [
        ("planned KV pool", f"{p.kv_blocks_per_pod:,} blocks = {p.kv_tokens_per_pod:,} tokens "
                            f"({p.kv_bytes_per_gpu / 2**20:.1f} MiB, "
                            f"{p.kv_bytes_per_token:,} B/token)"),
        ("planned sequences/pod", f"{p.sequences_per_pod} at {p.context} tokens "
                                  "(no prefix sharing)"),
        ("replicas for the peak", f"{p.replicas} for {p.concurrency} concurrent sequences"),
    ]  # fmt: skip
    if e is not None:
        hit = "-" if e.hit_ratio is None else f"{e.hit_ratio:.1%}"
        rows += [
            ("measured peak occupancy", f"{e.peak_occupancy:.1%} ({e.peak_used_blocks}/"
                                        f"{e.capacity_blocks} blocks)"),
            ("measured prefix hit ratio", f"{hit} of prompt tokens"),
            ("measured preemptions", f"{e.preemptions} (peak waiting {e.peak_waiting})"),
        ]  # fmt: skip
    else:
        raise RuntimeError("the engine's /stats was not reachable during the load")
    rows.append(("TTFT p50 / p99", f"{s.ttft.p50 * 1000:,.0f} / {s.ttft.p99 * 1000:,.0f} ms"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def main() -> int:
    """Run the demo; exit 0 when every step ran and the load saw no errors."""
    t_start = time.monotonic()
    _section("1. headroom plan: two worked examples")
    worked_examples()

    _section("2. headroom serve --model tiny (a small KV pool, on purpose)")
    serve_args = [
        "--model", "tiny", "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS),
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "1024",
        "--shutdown-grace", "5",
    ]  # fmt: skip
    print("$ headroom serve " + " ".join(serve_args), flush=True)
    with _serve(serve_args) as (url, lines):
        for line in lines:
            print("  " + line, flush=True)
        budget = next((ln for ln in lines if "budget:" in ln), "")
        pod = pod_plan(RAMP[1])

        _section("3. sidecar and autoscaler")
        sport = _free_port()
        sidecar_url = f"http://127.0.0.1:{sport}"
        with _process(["-m", "headroom.sidecar", "--engine-url", url, "--host", "127.0.0.1",
                       "--port", str(sport), "--interval", "0.5",
                       "--timeout", "0.4", "--forecast-window", "10"]) as (side, _):  # fmt: skip
            _wait_ready(sidecar_url + "/saturation", side, "headroom sidecar", timeout=30)
            print(f"  sidecar polling {url}/stats, serving {sidecar_url}/metrics", flush=True)
            _section(f"4. headroom load: ramp {RAMP[0]} -> {RAMP[1]} concurrent over "
                     f"{RAMP_SECONDS:.0f}s, {SHARED_FRACTION:.0%} share a "
                     f"{PREFIX_TOKENS}-token system prompt")  # fmt: skip
            result, reports = asyncio.run(_ramp(url, sidecar_url))
            summary = summarize(result)
            print(render_summary(summary), flush=True)

            if not reports:
                raise RuntimeError(f"the sidecar at {sidecar_url} answered no /saturation poll")
            dec, peak = autoscaling_decisions(reports, pod, RAMP[1])
            eta = peak.get("eta_seconds")
            demand = peak.get("kv_demand_blocks")
            print(
                f"\n  sidecar at the peak: occupancy {(peak.get('occupancy') or 0):.0%}, "
                f"{in_flight(peak)} sequences in flight, demand "
                f"{'-' if demand is None else f'{demand:.0f} blocks'}, "
                f"saturation ETA {'-' if eta is None else f'{eta:.0f}s'}",
                flush=True,
            )
            print(f"  decide(): {dec.action} to {dec.replicas} replicas ({dec.reason}): "
                  f"{dec.message}", flush=True)  # fmt: skip
            planned = pod_plan(max(1, in_flight(peak))).replicas or 1
            verdict = "PASS" if dec.replicas <= 1.5 * planned else "MISS"
            print(f"  the plan for those {in_flight(peak)} sequences: {planned} replica(s); "
                  f"decide() asked {dec.replicas} = {dec.replicas / planned:.2f}x "
                  f"(<= 1.5x: {verdict})", flush=True)  # fmt: skip
            if verdict == "MISS":
                raise RuntimeError("decide() asked more than 1.5x the plan at the ramp's peak")

    _section("5. the plan for this pod, and what the run measured")
    print("  " + budget.strip(), flush=True)
    print(closing_table(pod, summary), flush=True)
    print(f"\ndemo finished in {time.monotonic() - t_start:.0f}s", flush=True)
    return 0 if summary.errors == 0 else 1


def _exit_on_signal(signum: int, _frame: object) -> None:
    """SIGTERM or SIGHUP unwinds like Ctrl-C, so the engine and the sidecar are stopped."""
    first = not _SIGNALLED
    _SIGNALLED.append(signum)
    for proc in list(_HELPERS):
        proc.send_signal(signal.SIGTERM)  # a no-op on one that has exited
    if first and not _STARTING[0]:
        # A second signal only stops the helpers again: raised during the unwinding, it would
        # cut short the cleanup (the wait before a helper is killed) and change the status.
        raise SystemExit(128 + signum)


def _run() -> int:
    """main(), with the exit status a signal asks for however the demo unwound from it."""
    try:
        status = main()
    except Exception:
        if not _SIGNALLED:
            raise
        # The helpers stopped under a step that was running: its error is most likely the
        # signal's doing, but it is shown whole in case it is not.
        print(f"stopped by signal {_SIGNALLED[0]}; the step that was running raised:",
              file=sys.stderr)  # fmt: skip
        traceback.print_exc()
        return 128 + _SIGNALLED[0]
    # A signal whose SystemExit was lost: the demo went on, on stopped helpers, and returned.
    return 128 + _SIGNALLED[0] if _SIGNALLED else status


if __name__ == "__main__":
    # The default action would end this process at once and leave both children running.
    for _sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, _exit_on_signal)
    sys.exit(_run())
