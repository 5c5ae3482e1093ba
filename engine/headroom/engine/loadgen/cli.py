"""`headroom load`: drive an OpenAI-compatible server and report where the KV wall is."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path

import aiohttp
from pydantic import ValidationError

from headroom.contract.cli import fields_as_flags
from headroom.contract.outputs import output_error, write_output
from headroom.engine.loadgen.client import LoadResult, RunState, Target, run_load
from headroom.engine.loadgen.progress import ProgressBar
from headroom.engine.loadgen.stats import records_csv, render_summary, summarize
from headroom.engine.loadgen.workload import LengthDist, WorkloadSpec

DISTS = ["fixed", "uniform", "normal", "exponential"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `headroom load`."""
    p = subparsers.add_parser(
        "load",
        help="load-test an OpenAI-compatible server",
        description="Send streaming requests at a constant or ramped concurrency and report "
        "TTFT, time per output token, throughput, errors and (from the engine's /stats) KV "
        "occupancy, prefix hit ratio and preemptions.",
    )
    add_arguments(p)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `headroom load` (shared with `python -m headroom.engine.loadgen`)."""
    t = p.add_argument_group("target")
    t.add_argument("--url", default="http://127.0.0.1:8000", help="server root (or .../v1)")
    t.add_argument("--model", help="model name (default: the first of /v1/models)")
    t.add_argument("--api-key", default=None, help="bearer token (env HEADROOM_API_KEY)")
    t.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask the server to run every output to max_tokens (vLLM extension)",
    )
    t.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    w = p.add_argument_group("workload")
    bound = w.add_mutually_exclusive_group()
    bound.add_argument("-n", "--num-requests", type=int, help="requests to send (default 100)")
    bound.add_argument("--duration", type=float, help="seconds to keep sending")
    w.add_argument("-c", "--concurrency", type=int, default=8, help="(starting) concurrency")
    w.add_argument("--ramp-to", type=int, help="ramp concurrency linearly up (or down) to this")
    w.add_argument("--ramp-duration", type=float, help="ramp length in s (default: --duration)")
    w.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (mean)")
    w.add_argument("--prompt-len-dist", choices=DISTS, default="fixed")
    w.add_argument("--prompt-len-spread", type=float, default=0.5)
    w.add_argument("--output-len", type=int, default=64, help="output tokens (mean)")
    w.add_argument("--output-len-dist", choices=DISTS, default="fixed")
    w.add_argument("--output-len-spread", type=float, default=0.5)
    w.add_argument("--shared-prefix-fraction", type=float, default=0.0,
                   help="fraction of requests that start with the shared prefix")  # fmt: skip
    w.add_argument("--prefix-len", type=int, default=0, help="shared prefix tokens")
    w.add_argument("--disconnect-fraction", type=float, default=0.0,
                   help="fraction of requests that hang up mid-stream (chaos), each after "
                   "a random number of streamed text chunks (0: on the headers)")  # fmt: skip
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--tokens-per-word", type=float,
                   help="skip calibration and size prompts with this ratio")  # fmt: skip
    o = p.add_argument_group("output")
    o.add_argument("--stats-url", help="engine /stats URL (default: <url>/stats)")
    o.add_argument("--no-stats", action="store_true", help="do not sample /stats")
    o.add_argument("--stats-interval", type=float, default=0.5)
    o.add_argument(
        "--json", type=Path, metavar="FILE", help="write summary + records ('-': stdout)"
    )
    o.add_argument("--csv", type=Path, metavar="FILE", help="write per-request CSV ('-': stdout)")
    o.add_argument("--no-progress", action="store_true")


class FlagError(ValueError):
    """A flag's value that cannot work, named by its flag."""


def _length(kind: str, mean: int, spread: float, which: str) -> LengthDist:
    """One length distribution, its errors named by `--{which}-len...` flags."""
    try:
        return LengthDist(kind=kind, mean=mean, spread=spread)
    except ValidationError as e:
        flags = {"mean": f"--{which}-len", "spread": f"--{which}-len-spread"}
        raise FlagError(
            "; ".join(
                f"{flags.get(str(err['loc'][0]) if err['loc'] else '', f'--{which}-len')}: "
                f"{str(err['msg']).removeprefix('Value error, ')}"
                for err in e.errors(include_url=False)
            )
        ) from None


def _check_positive(args: argparse.Namespace) -> None:
    """Seconds and ratios that must be positive numbers (NaN included in what fails)."""
    for flag, value in (("--timeout", args.timeout), ("--stats-interval", args.stats_interval),
                        ("--tokens-per-word", args.tokens_per_word)):  # fmt: skip
        if value is not None and not (math.isfinite(value) and value > 0):
            raise FlagError(f"{flag}: must be a positive number, got {value:g}")


def build_spec(args: argparse.Namespace) -> WorkloadSpec:
    """Validated workload from the flags (raises ValidationError naming the bad field)."""
    num = args.num_requests
    if num is None and args.duration is None:
        num = 100
    return WorkloadSpec(
        num_requests=num,
        duration_s=args.duration,
        concurrency=args.concurrency,
        ramp_to=args.ramp_to,
        ramp_s=args.ramp_duration,
        prompt_len=_length(args.prompt_len_dist, args.prompt_len, args.prompt_len_spread, "prompt"),
        output_len=_length(args.output_len_dist, args.output_len, args.output_len_spread, "output"),
        shared_prefix_fraction=args.shared_prefix_fraction,
        prefix_len=args.prefix_len,
        disconnect_fraction=args.disconnect_fraction,
        seed=args.seed,
    )


def build_target(args: argparse.Namespace) -> Target:
    key = args.api_key or os.environ.get("HEADROOM_API_KEY") or os.environ.get("OPENAI_API_KEY")
    return Target(
        base_url=args.url,
        model=args.model,
        api_key=key,
        endpoint=args.endpoint,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        timeout_s=args.timeout,
    )


def _json_safe(value: object) -> object:
    """`value` with NaN and infinities as null: JSON has no NaN (a run where every request failed
    has no latency percentiles)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _same_output(a: Path, b: Path) -> bool:
    """Whether two output flags name one destination (stdout, or the same file)."""
    if str(a) == "-" or str(b) == "-":
        return str(a) == str(b)
    return a.resolve() == b.resolve()


def _flag_errors(err: ValidationError) -> str:
    flags = {
        "ramp_s": "--ramp-duration",
        "duration_s": "--duration",
        "base_url": "--url",
        "timeout_s": "--timeout",
    }
    parts = []
    for e in err.errors(include_url=False):
        field = ".".join(str(x) for x in e["loc"])
        flag = flags.get(field, "--" + field.replace("_", "-").replace(".mean", "-len")) if field \
            else "workload"  # fmt: skip
        msg = str(e["msg"]).removeprefix("Value error, ")
        if not field:
            # A rule across fields names them as the spec does; the user typed flags.
            msg = fields_as_flags(
                msg, WorkloadSpec.model_fields, lambda f: flags.get(f, "--" + f.replace("_", "-"))
            )
        parts.append(f"{flag}: {msg}")
    return "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    """Entry point of `headroom load`: 0 when every request succeeded, 1 when some failed,
    2 on bad flags or an unreachable server."""
    try:
        _check_positive(args)
        spec = build_spec(args)
        target = build_target(args)
    except ValidationError as e:
        print(f"headroom load: {_flag_errors(e)}", file=sys.stderr)
        return 2
    except FlagError as e:
        print(f"headroom load: {e}", file=sys.stderr)
        return 2
    if args.json is not None and args.csv is not None and _same_output(args.json, args.csv):
        # One would overwrite the other, or both would interleave on stdout.
        print(f"headroom load: --json and --csv both name {args.json}: give each its own",
              file=sys.stderr)  # fmt: skip
        return 2
    for flag, out in (("--json", args.json), ("--csv", args.csv)):
        # Checked before the run: a run is minutes of traffic, lost if it cannot be written.
        bad = output_error(out, flag) if out is not None else None
        if bad is not None:
            print(f"headroom load: {bad}", file=sys.stderr)
            return 2
    stats_url = None if args.no_stats else (args.stats_url or target.root + "/stats")
    bar = ProgressBar(
        total=spec.num_requests, duration=spec.duration_s, enabled=not args.no_progress
    )
    last: list[tuple[RunState, float]] = []

    def on_progress(state: RunState, elapsed: float) -> None:
        last[:] = [(state, elapsed)]
        bar.update(state, elapsed)

    try:
        result: LoadResult = asyncio.run(
            run_load(
                spec,
                target,
                stats_url=stats_url,
                stats_interval_s=args.stats_interval,
                tokens_per_word=args.tokens_per_word,
                on_progress=on_progress,
            )
        )
    except aiohttp.ClientError as e:  # an unusable URL: aiohttp's text is the URL alone
        print(f"headroom load: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError, ValueError) as e:
        print(f"headroom load: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nheadroom load: interrupted", file=sys.stderr)
        return 130
    if last:
        bar.close(*last[0])
    summary = summarize(result)
    to_stdout = str(args.json) == "-" or str(args.csv) == "-"
    report = render_summary(summary)
    if result.stats_error:
        report += f"\n(/stats at {stats_url} not reachable: {result.stats_error})"
    print(f"prompt sizing: {result.tokens_per_word:.2f} tokens per word", file=sys.stderr)
    print(report, file=sys.stderr if to_stdout else sys.stdout)
    if args.json is not None:
        payload = {
            "summary": summary.model_dump(mode="json"),
            "records": [r.model_dump(mode="json") for r in result.records],
            "stats_samples": [s.model_dump(mode="json") for s in result.samples],
        }
        write_output(args.json, json.dumps(_json_safe(payload), indent=2, allow_nan=False) + "\n")
    if args.csv is not None:
        write_output(args.csv, records_csv(result.records))
    if summary.requests == 0:  # --duration shorter than one request: nothing was measured
        print("headroom load: no request was sent", file=sys.stderr)
        return 1
    return 0 if summary.errors == 0 else 1
