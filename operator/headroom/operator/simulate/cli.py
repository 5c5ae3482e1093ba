"""`headroom profile TRACE` and `headroom simulate TRACE --spec FILE`: know your traffic before
you size for it, then replay it through the operator's own `decide()` for your spec.

numpy (and matplotlib for --png) come with the `sim` extra: they load inside the commands, so
`--help` works without them and the umbrella CLI names the extra when they are missing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headroom.contract.outputs import stdout_to_devnull

if TYPE_CHECKING:
    import numpy as np

    from headroom.operator.crd.models import InferenceDeploymentSpec
    from headroom.operator.reconcile.sizing import Parsed, Sizing
    from headroom.operator.scaling.decide import Policy
    from headroom.operator.simulate.progress import Progress
    from headroom.operator.simulate.trace import Trace

FORMATS = ("azure", "mooncake", "csv", "jsonl")  # trace.FORMATS, without importing numpy
DEFAULT_QUANTILES = "0.6,0.8,0.9,0.95"
MAX_SEEDS = 100
# Each copy of a request is an array entry: past this, a big trace would not fit in memory.
MAX_RATE = 100.0


class UsageError(ValueError):
    """A bad argument: exit 2 with the reason."""


def _trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, metavar="TRACE", help="the trace file")
    p.add_argument("--format", choices=FORMATS, help="the trace's format (default: detected)")
    p.add_argument(
        "--rate",
        type=float,
        default=1.0,
        help="replay at this multiple of the recorded rate (default 1)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--progress",
        action="store_true",
        help="show progress on stderr even when it is not a terminal",
    )


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `headroom profile` and `headroom simulate`."""
    formats = (
        "Formats: azure (the Azure LLM inference trace CSV), mooncake (Mooncake's JSON lines), "
        "csv (header arrival_s,prompt_tokens,output_tokens), jsonl (arrival_s, prompt_tokens, "
        "output_tokens, optional prefix_block_ids and prefix_block_tokens)."
    )
    pr = subparsers.add_parser(
        "profile",
        help="profile a request trace: concurrency, lengths, burstiness, prefix overlap",
        description="Profile a request trace: requests and KV in flight, prompt and output "
        "lengths, arrival burstiness, the ideal prefix hit ratio; the decision-matrix verdict "
        "(paging, prefix caching, KV quantization) and spec.traffic / spec.scaling to paste. "
        + formats,
    )
    _trace_arguments(pr)
    pr.add_argument(
        "--decode-tps",
        type=float,
        default=20.0,
        help="decode tokens/s of one sequence (default 20)",
    )
    pr.add_argument(
        "--prefill-tps",
        type=float,
        default=10_000.0,
        help="prefill tokens/s of one sequence (default 10000)",
    )
    pr.add_argument(
        "--block-size", type=int, help="KV block size in tokens (default: the spec's, else 16)"
    )
    pod = pr.add_mutually_exclusive_group()
    pod.add_argument(
        "--spec",
        type=Path,
        metavar="FILE",
        help="an InferenceDeployment (YAML or JSON): size replicas for its pods",
    )
    pod.add_argument("--model", help="a model preset: with --gpu, size replicas for it")
    pr.add_argument("--gpu", help="a GPU preset, with --model")
    pr.set_defaults(func=run_profile)

    si = subparsers.add_parser(
        "simulate",
        help="replay a trace through the operator's decide() for a spec",
        description="Replay a trace through the operator's own decide() on a simulated "
        "deployment of the spec's pods, at several forecast quantiles, and print GPU-hours "
        "against KV-limited seconds with the cheapest setting that serves; when none does, "
        "again at minReplicas one higher, then two, up to the most pods the highest quantile "
        "asked for, until a standing reserve serves (each a whole sweep more). " + formats,
    )
    _trace_arguments(si)
    si.add_argument(
        "--spec",
        type=Path,
        metavar="FILE",
        required=True,
        help="the InferenceDeployment (YAML or JSON, the resource or its spec)",
    )
    si.add_argument(
        "--quantiles",
        default=DEFAULT_QUANTILES,
        help=f"forecastQuantile settings, comma-separated (default {DEFAULT_QUANTILES})",
    )
    si.add_argument(
        "--seeds", type=int, default=3, help="realizations of the trace per setting (default 3)"
    )
    si.add_argument(
        "--png",
        type=Path,
        metavar="OUT.png",
        help="draw the sweep into this file (.png, .svg or .pdf)",
    )
    si.set_defaults(func=run_simulate)


def _positive(value: float, flag: str) -> float:
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"{flag} must be a positive number, got {value:g}")
    return value


def _rate(value: float) -> float:
    _positive(value, "--rate")
    if value > MAX_RATE:
        raise UsageError(f"--rate must be at most {MAX_RATE:g}, got {value:g}")
    return value


def quantiles(text: str) -> tuple[float, ...]:
    """--quantiles: distinct numbers in [0.5, 0.99], ascending."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--quantiles must be numbers separated by commas, got {text!r}") from None
    if not values:
        raise UsageError("--quantiles needs at least one number")
    for q in values:
        if not 0.5 <= q <= 0.99:
            raise UsageError(
                f"--quantiles: {q:g} is outside [0.5, 0.99] (scaling.forecastQuantile's range)"
            )
    return tuple(sorted(set(values)))


def _occupancy_replaced(spec: InferenceDeploymentSpec, policy: Policy) -> list[str]:
    """The spec's occupancy settings, stated or its defaults, that the sweep replaced
    ("targetOccupancy 0.5", "default scaleOutOccupancy 0.95"): it turns forecastQuantile alone,
    at the occupancy its band is sized for."""
    scaling = spec.scaling
    pairs = (
        ("target_occupancy", "targetOccupancy", policy.target_occupancy),
        ("scale_out_occupancy", "scaleOutOccupancy", policy.scale_out_occupancy),
    )
    return [
        f"{'' if field in scaling.model_fields_set else 'default '}{name} "
        f"{getattr(scaling, field):g}"
        for field, name, used in pairs
        if getattr(scaling, field) != used
    ]


def _progress(args: argparse.Namespace) -> Progress:
    from headroom.operator.simulate.progress import Progress

    return Progress(enabled=bool(args.progress) or sys.stderr.isatty())


def _read(args: argparse.Namespace, progress: Progress) -> Trace:
    from headroom.operator.simulate.trace import read_trace

    label = f"reading {args.trace.name}"
    progress.start(label)
    trace = read_trace(
        args.trace, args.format, lambda done, total: progress.update(label, done, total)
    )
    progress.done(f"read {len(trace):,} requests from {args.trace.name}")
    return trace


def _fail(command: str, message: str) -> int:
    print(f"headroom {command}: {message}", file=sys.stderr)
    return 2


def _emit(text: str) -> None:
    """Print the report; a reader that stops early (`| head`) ends it quietly."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        stdout_to_devnull()  # the work goes on (a PNG to write), silently


def run_profile(args: argparse.Namespace) -> int:
    """Entry point of `headroom profile`; exit 2 on a bad file or argument."""
    from headroom.operator.simulate.specfile import SpecFileError
    from headroom.operator.simulate.trace import TraceError

    try:
        return _profile(args)
    except (UsageError, TraceError, SpecFileError) as exc:
        return _fail("profile", str(exc))


def _what_fits(spec: InferenceDeploymentSpec, sizing: Sizing, contexts: np.ndarray) -> str:
    """The longest sequence the pod holds, and what a maxModelLen there refuses of the trace;
    empty where the pod holds none (its weights do not fit)."""
    from headroom.operator.reconcile.sizing import plan_input
    from headroom.operator.simulate.verdict import pod_context

    most = min(pod_context(spec, sizing.plan), plan_input(spec).model.max_position_embeddings)
    if most <= 0:
        return ""
    share = float((contexts > most).mean())
    return (
        f"; this pod holds at most {most:,} tokens a sequence: a --spec with engine.maxModelLen: "
        f"{most} sizes for the requests up to it (it refuses {share:.1%} of these), else give "
        "the pod more GPU memory"
    )


def _pasted(
    base: dict[str, Any], block: dict[str, dict[str, Any]], label: str, contexts: np.ndarray
) -> Parsed:
    """`base` with the suggested block pasted under spec: (it replaces traffic and scaling),
    sized as simulate and the operator size it; a UsageError naming what fits if they refuse it."""
    from headroom.operator.reconcile.sizing import parse

    built = parse({**base, **block})
    if built.spec is not None and built.sizing is not None and built.sizing.feasible:
        return built
    if built.spec is None or built.sizing is None:
        raise UsageError(f"{label}: {built.error}")
    fits = _what_fits(built.spec, built.sizing, contexts)
    if not fits:  # no context would fit: the weights alone do not
        raise UsageError(f"{label}: {built.sizing.reason}")
    context = block["traffic"]["contextTokens"]
    raise UsageError(
        f"{label}: the trace's traffic.contextTokens {context} does not fit: "
        f"{built.sizing.reason}{fits}"
    )


def _profile(args: argparse.Namespace) -> int:
    from headroom.contract.budget import UnknownPreset, model_preset
    from headroom.operator.crd.models import ScalingSpec
    from headroom.operator.reconcile.sizing import plan_input
    from headroom.operator.simulate import render, verdict
    from headroom.operator.simulate.profile import profile
    from headroom.operator.simulate.specfile import read_spec
    from headroom.operator.simulate.sweep import JITTER_SECONDS
    from headroom.operator.simulate.trace import MAX_TRACE_SECONDS, scaled

    _rate(args.rate)
    _positive(args.decode_tps, "--decode-tps")
    _positive(args.prefill_tps, "--prefill-tps")
    if args.block_size is not None and not 1 <= args.block_size <= 1024:
        raise UsageError(f"--block-size must be in [1, 1024], got {args.block_size}")
    if (args.model is None) != (args.gpu is None):
        raise UsageError("--model and --gpu go together (or pass --spec)")
    sf = read_spec(args.spec) if args.spec is not None else None
    progress = _progress(args)
    recorded = trace = _read(args, progress)
    if args.rate != 1.0:
        trace = scaled(trace, args.rate, 1, JITTER_SECONDS)
    # The profile keeps a count per second until the last request ends: a decode rate of 1e-9
    # tokens/s would make that a terabyte.
    longest = float((trace.prompt / args.prefill_tps + trace.output / args.decode_tps).max())
    if longest > MAX_TRACE_SECONDS:
        raise UsageError(
            f"--decode-tps {args.decode_tps:g} / --prefill-tps {args.prefill_tps:g} make a request "
            f"last {longest / 86_400:,.0f} days (at most {MAX_TRACE_SECONDS // 86_400})"
        )
    progress.start(f"profiling {len(trace):,} requests")
    # The ideal hit ratio of the trace as recorded: a scaled copy's copies share whole prompts.
    p = profile(trace, args.decode_tps, args.prefill_tps, recorded=recorded)
    contexts = trace.prompt + trace.output

    spec = sf.spec if sf is not None else None
    sizing = sf.sizing if sf is not None else None
    block_size = args.block_size or (spec.engine.block_size if spec else 16)
    scaling = spec.scaling if spec is not None else ScalingSpec()
    base: dict[str, Any] = sf.raw if sf is not None else {}
    label = str(args.spec)
    if args.model is not None:
        # Capped at the model's limit, as a --spec's pod caps it below: a p95 context past it
        # is a spec the sizing refuses (parse() names an unknown preset itself).
        try:
            limit: int | None = model_preset(args.model).max_position_embeddings
        except UnknownPreset:
            limit = None
        base = {
            "model": {"preset": args.model},
            "gpu": {"type": args.gpu},
            "engine": {"blockSize": block_size},
        }
        label = f"--model {args.model} --gpu {args.gpu}"
    else:
        limit = plan_input(spec).model.max_position_embeddings if spec is not None else None
    explicit_mml = sf.spec.engine.max_model_len if sf is not None else None
    caps = [c for c in (explicit_mml, limit) if c is not None]
    cap = min(caps) if caps else None
    # The context first: the pods are sized for the requests the max model length it sets
    # admits (a refused request holds no KV), on a pod that holds it.
    draft = verdict.wire(verdict.suggest(p, None, scaling, sf is not None, cap))
    if sf is not None or args.model is not None:
        built = _pasted(base, draft, label, contexts)
        if args.model is not None:  # the pod is the one --model/--gpu build
            spec, sizing = built.spec, built.sizing
    mml = explicit_mml or int(draft["traffic"]["contextTokens"])
    ld = verdict.load(trace, args.decode_tps, args.prefill_tps, mml if spec is not None else None)
    progress.done(f"profiled {len(trace):,} requests")
    f = None
    pod_limit = None
    if spec is not None and sizing is not None:
        f = verdict.fit(ld, spec, sizing, scaling.target_occupancy)
        pod_limit = verdict.pod_context(spec, sizing.plan)
    advice = verdict.verdict(p, ld, f, block_size, explicit_mml, limit)
    suggestion = verdict.suggest(p, f, scaling, sf is not None, cap)
    wired = verdict.wire(suggestion)
    if spec is not None:
        _pasted(base, wired, label, contexts)  # the replica counts too: all of it must apply
    note = verdict.maxlen_note(ld, mml, explicit_mml is not None, limit, pod_limit)
    text = verdict.to_yaml(suggestion, [note] if note else [])
    if args.json:
        _emit(json.dumps(render.profile_json(p, ld, f, advice, wired, text), indent=2))
    else:
        _emit(render.profile_text(trace, args.rate, p, ld, f, advice, text))
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    """Entry point of `headroom simulate`; exit 2 on a bad file or argument."""
    from headroom.operator.simulate.specfile import SpecFileError
    from headroom.operator.simulate.trace import TraceError

    try:
        return _simulate(args)
    except (UsageError, TraceError, SpecFileError) as exc:
        return _fail("simulate", str(exc))


def _simulate(args: argparse.Namespace) -> int:
    from headroom.operator.simulate import render, sweep
    from headroom.operator.simulate.replay import shape_for
    from headroom.operator.simulate.specfile import read_spec
    from headroom.operator.simulate.verdict import describe

    _rate(args.rate)
    qs = quantiles(args.quantiles)
    if not 1 <= args.seeds <= MAX_SEEDS:
        raise UsageError(f"--seeds must be in [1, {MAX_SEEDS}], got {args.seeds}")
    if args.png is not None:
        from headroom.contract.outputs import chart_error

        bad = chart_error(args.png, "--png")
        if bad is not None:
            raise UsageError(bad)
        import matplotlib  # noqa: F401  (missing: exit 2 naming the extra, before the replays)
    sf = read_spec(args.spec)
    try:
        sweep.policies(sf.spec, sf.sizing, qs)
    except ValueError as exc:
        raise UsageError(f"{args.spec}: the spec's scaling makes no policy: {exc}") from None
    progress = _progress(args)
    trace = _read(args, progress)
    seeds = tuple(range(1, args.seeds + 1))
    shape = shape_for(sf.spec, sf.sizing)
    scaling = sf.spec.scaling
    runs = sweep.realize(
        trace, shape, seeds, args.rate, (scaling.min_replicas, scaling.max_replicas)
    )
    settings = sweep.sweep(runs, sf.spec, sf.sizing, qs, progress)
    best = sweep.cheapest_serving(settings)
    reserves: tuple[sweep.Reserve, ...] = ()
    if best is None:
        # A ramp faster than a pod starts is served by pods already there: find the fewest.
        limit = sweep.reserve_limit(settings, sf.spec)
        reserves = sweep.search_reserve(runs, sf.spec, sf.sizing, qs, limit, progress)
    floors = sweep.floors(runs, sf.spec, sf.sizing)
    pod = describe(sf.sizing.plan)
    out: dict[str, Any] | None = None
    if args.json:
        out = render.simulate_json(trace, args.rate, pod, shape, settings, best, floors, reserves)
    else:
        replaced = _occupancy_replaced(sf.spec, settings[0].policy)
        lines = render.simulate_header(trace, args.rate, seeds, pod, shape, settings[0], replaced)
        lines += [
            "",
            *render.simulate_table(settings, best),
            *render.reserve_lines(reserves),
            "",
            *render.simulate_advice(settings, best, floors, reserves),
        ]
        _emit("\n".join(lines))
    if args.png is not None:
        from headroom.operator.simulate.plot import plot

        title = f"{trace.name} x{args.rate:g} on {pod}, {len(seeds)} seeds"
        plot(settings, best, title, args.png, sweep.floor_median(floors), reserves)
        if out is not None:
            out["png"] = str(args.png)
        else:
            _emit(f"wrote {args.png}")
    if out is not None:
        _emit(json.dumps(out, indent=2))
    return 0
