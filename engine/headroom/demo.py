"""`make demo` (`python -m headroom.demo`): the whole loop on one CPU in about a minute.

1. `headroom plan` for two worked examples (what KV arithmetic says about real deployments).
2. `headroom serve` on the built-in tiny model with a deliberately small KV pool.
3. The sidecar polling it, and the operator's scaling decision on the sidecar's report
   (each skipped with a note when that part is not installed).
4. `headroom load` ramping concurrency past what the pool holds.
5. The plan for this pod next to what was measured: peak occupancy, prefix hit ratio,
   preemptions, and the latency at each concurrency step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from headroom.engine.budget import Plan, PlanInput, gpu_preset, model_preset, plan
from headroom.engine.loadgen.client import LoadResult, Target, run_load
from headroom.engine.loadgen.progress import ProgressBar
from headroom.engine.loadgen.stats import LoadSummary, render_summary, summarize
from headroom.engine.loadgen.workload import LengthDist, WorkloadSpec
from headroom.engine.server.testing import ServerProcess, free_port

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

EXAMPLES = (
    ("Llama 3.1 70B on H100 80GB, tp 4", "llama-3.1-70b", "h100-80gb", 4, 128, 4096),
    ("Llama 3.1 8B on L4 24GB", "llama-3.1-8b", "l4-24gb", 1, 64, 8192),
)


def _section(title: str) -> None:
    print(f"\n=== {title} ", "=" * max(0, 74 - len(title)), sep="", flush=True)


def _render(p: Plan) -> str:
    try:
        from headroom.engine.plan_cli import render_plan
    except ImportError:
        return p.model_dump_json(indent=2)
    return str(render_plan(p))


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
        print(_render(plan(inp)))


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
def _process(args: list[str]) -> Iterator[subprocess.Popen[str]]:
    """A helper process whose output goes to a temporary log (printed if the step fails)."""
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            yield proc
        except BaseException:
            log.seek(0)
            print(log.read()[-2000:], file=sys.stderr)
            raise
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def pod_plan(peak_concurrency: int) -> Plan | None:
    """The plan for this demo pod: the tiny model, with exactly its KV pool as 'GPU memory'."""
    try:
        from headroom.engine.model.tiny import build_tiny
    except ImportError:
        return None
    from headroom.engine.budget import ModelArch, kv_bytes_per_block

    model, _ = build_tiny()
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    arch = ModelArch(
        name="tiny",
        num_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        num_parameters=params,
        weight_dtype="fp32",
    )
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


def autoscaling_decision(report: dict[str, Any], blocks_per_seq: float) -> str:
    """Feed the sidecar's `/saturation` report into the operator's decide(); a note if absent."""
    try:
        from headroom.operator import decide as d
    except ImportError as e:
        return f"(skipped: headroom.operator.decide not available: {e})"
    try:
        sample = d.PodSample(
            occupancy=float(report.get("occupancy") or 0.0),
            sampled_at=float(report.get("time") or time.time()),
            eta_seconds=report.get("eta_seconds"),
            waiting=int(report.get("waiting") or 0),
            running=int(report.get("running") or 0),
            preemption_rate=float(report.get("preemption_rate_per_second") or 0.0),
            hit_ratio=report.get("hit_ratio"),
            used_blocks=report.get("used_blocks"),
            capacity_blocks=report.get("capacity_blocks"),
            growth_blocks_per_second=report.get("growth_blocks_per_second"),
            engine_up=bool(report.get("engine_up", True)),
        )
        now = time.time()
        pod = d.PodView(name="demo-0", ready=True, created_at=now - 600, sample=sample)
        policy = d.Policy(
            min_replicas=1, max_replicas=8, blocks_per_pod=NUM_BLOCKS,
            blocks_per_sequence=blocks_per_seq, lookahead_seconds=60.0,
        )  # fmt: skip
        dec = d.decide(d.Inputs(now=now, current_replicas=1, pods=(pod,), policy=policy))
    except (AttributeError, TypeError, ValueError) as e:
        return f"(skipped: headroom.operator.decide has a different API: {e})"
    return f"decide(): {dec.action} to {dec.replicas} replicas ({dec.reason}): {dec.message}"


def _sidecar_available() -> bool:
    try:
        import headroom.sidecar.server  # noqa: F401
    except ImportError:
        return False
    return True


async def _ramp(url: str, sidecar_url: str | None) -> tuple[LoadResult, list[dict[str, Any]]]:
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
        while sidecar_url:
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


def closing_table(p: Plan | None, s: LoadSummary) -> str:
    """The plan for this pod next to the measurements."""
    e = s.engine
    rows: list[tuple[str, str]] = []
    if p is not None:
        rows += [
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
        rows.append(("measured", "(engine /stats was not reachable)"))
    rows.append(("TTFT p50 / p99", f"{s.ttft.p50 * 1000:,.0f} / {s.ttft.p99 * 1000:,.0f} ms"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def main() -> int:
    """Run the demo; exit 0 when every step that is installed ran."""
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
    with ServerProcess(*serve_args) as server:
        url = server.url
        for line in server.lines:
            print("  " + line, flush=True)
        budget = next((ln for ln in server.lines if "budget:" in ln), "")

        _section("3. sidecar and autoscaler")
        sidecar_url: str | None = None
        stack = contextlib.ExitStack()
        if _sidecar_available():
            sport = free_port()
            sidecar_url = f"http://127.0.0.1:{sport}"
            side = stack.enter_context(
                _process(["-m", "headroom.sidecar", "--engine-url", url, "--host", "127.0.0.1",
                          "--port", str(sport), "--interval", "0.5",
                          "--timeout", "0.4", "--forecast-window", "10"])
            )  # fmt: skip
            try:
                _wait_ready(sidecar_url + "/saturation", side, "headroom sidecar", timeout=30)
                print(f"  sidecar polling {url}/stats, serving {sidecar_url}/metrics", flush=True)
            except RuntimeError as e:
                print(f"  (sidecar skipped: {e})", flush=True)
                sidecar_url = None
        else:
            print("  (sidecar skipped: headroom.sidecar.server is not installed)", flush=True)

        with stack:
            _section(f"4. headroom load: ramp {RAMP[0]} -> {RAMP[1]} concurrent over "
                     f"{RAMP_SECONDS:.0f}s, {SHARED_FRACTION:.0%} share a "
                     f"{PREFIX_TOKENS}-token system prompt")  # fmt: skip
            result, reports = asyncio.run(_ramp(url, sidecar_url))
            summary = summarize(result)
            print(render_summary(summary), flush=True)

            if reports:
                peak = max(reports, key=lambda r: r.get("occupancy") or 0.0)
                eta = peak.get("eta_seconds")
                print(
                    f"\n  sidecar at the peak: occupancy {(peak.get('occupancy') or 0):.0%}, "
                    f"growth {peak.get('growth_blocks_per_second') or 0:.1f} blocks/s, "
                    f"saturation ETA {'-' if eta is None else f'{eta:.0f}s'}",
                    flush=True,
                )
                blocks_per_seq = (PREFIX_TOKENS + PROMPT_TOKENS + OUTPUT_TOKENS) / BLOCK_SIZE
                print("  " + autoscaling_decision(peak, blocks_per_seq), flush=True)
            elif sidecar_url is None:
                print("\n  (autoscaling decision skipped: no sidecar report)", flush=True)

    _section("5. the plan for this pod, and what the run measured")
    print("  " + budget.strip(), flush=True)
    print(closing_table(pod_plan(RAMP[1]), summary), flush=True)
    print(f"\ndemo finished in {time.monotonic() - t_start:.0f}s", flush=True)
    return 0 if summary.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
