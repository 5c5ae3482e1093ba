"""What `headroom profile` and `headroom simulate` print: plain tables a person reads top to
bottom, and the same figures as JSON."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from headroom.operator.simulate.profile import PERCENTILES, Profile
from headroom.operator.simulate.sweep import (
    SERVE_MEDIAN_SECONDS,
    SERVE_WORST_SECONDS,
    Reserve,
    Setting,
    capped,
    floor_median,
    pick,
)
from headroom.operator.simulate.trace import Trace
from headroom.operator.simulate.verdict import LOW_PERCENTILE, Advice, Fit, Load
from headroom.operator.simulate.world import PodShape

WIDTH = 100


def _row(label: str, values: Sequence[str], first: int = 18, width: int = 10) -> str:
    return f"{label:<{first}}" + "".join(f"{v:>{width}}" for v in values)


def _width(rows: Sequence[Sequence[str]], least: int = 10) -> int:
    """A column width for every cell of `rows`: a space at least before the widest, so that
    numbers of ten million and more do not run into each other."""
    return max([least, *(len(v) + 1 for row in rows for v in row)])


def _num(x: float) -> str:
    return f"{x:,.0f}"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s"
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.1f} min"


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def _pods(n: int) -> str:
    return _count(n, "pod")


def trace_line(trace: Trace) -> str:
    """What was read: requests, duration, mean rate."""
    head = f"{trace.name}: {_count(len(trace), 'request')}"
    if trace.duration <= 0:
        return f"{head}, all at one instant"
    per_s = len(trace) / trace.duration
    return f"{head} over {_duration(trace.duration)}, {per_s:.2f} requests/s"


def _wrapped(label: str, text: str, indent: int) -> list[str]:
    return textwrap.wrap(
        text, WIDTH, initial_indent=f"{label:<{indent}}", subsequent_indent=" " * indent
    )


def _whose(ld: Load) -> str:
    """Whose in-flight KV the pods hold: the refused requests hold none."""
    if not ld.refused():
        return "the trace's in-flight KV"
    return f"the in-flight KV of the requests engine.maxModelLen {ld.max_model_len:,} admits"


def profile_text(
    trace: Trace,
    rate: float,
    p: Profile,
    ld: Load,
    f: Fit | None,
    advice: Sequence[Advice],
    spec_yaml: str,
) -> str:
    """The whole `headroom profile` report, the YAML block last."""
    pct = [f"p{q}" for q in PERCENTILES]
    # The max of the same series as the percentiles (the sizing's peak leaves out the opening,
    # which starts empty, and could read below them).
    in_flight = {
        "in flight": [*pct, "max"],
        "requests": [_num(p.concurrency[q]) for q in PERCENTILES] + [_num(p.concurrency_max)],
        "KV tokens": [_num(p.kv_tokens[q]) for q in PERCENTILES] + [_num(p.kv_tokens_max)],
    }
    tokens = {
        "tokens": pct,
        "prompt": [_num(p.prompt[q]) for q in PERCENTILES],
        "output": [_num(p.output[q]) for q in PERCENTILES],
        "prompt + output": [_num(p.context[q]) for q in PERCENTILES],
    }
    # One width for both tables, so that their percentile columns line up.
    width = _width([*in_flight.values(), *tokens.values()])
    lines = [
        trace_line(trace) + ("" if rate == 1 else f" (the trace at x{rate:g} its recorded rate)"),
        f"service: decode {p.decode_tps:g} tokens/s a sequence, prefill {p.prefill_tps:,.0f} "
        "tokens/s, no queueing",
        "",
        *(_row(label, values, width=width) for label, values in in_flight.items()),
        "",
        *(_row(label, values, width=width) for label, values in tokens.items()),
        "",
    ]
    if p.burstiness:
        lines.append(
            _row("arrivals", ["dispersion", "peak/mean"], width=12)
            + "   (dispersion: variance / mean of the"
        )
        aside = ["    arrivals per window, 1 for Poisson)"]
        for i, b in enumerate(p.burstiness):
            values = [f"{b.dispersion:.2f}", f"{b.peak_to_mean:.2f}"]
            lines.append(
                _row(f"per {b.window:g} s", values, width=12) + (aside[i] if i < len(aside) else "")
            )
    else:
        lines.append("arrivals          the trace is shorter than one 1 s window")
    lines.append("")
    if p.ideal_hit_ratio is None:
        lines.append("prefix overlap    unknown: the trace carries no block hashes")
    else:
        # A --rate copy replays each request several times: its copies would hit each other's
        # whole prompts, so the ratio is of the trace as recorded.
        recorded = "" if rate == 1 else ", of the trace as recorded"
        lines += _wrapped(
            "prefix overlap",
            f"ideal hit ratio {p.ideal_hit_ratio:.1%} of prompt tokens (an unlimited cache: an "
            f"upper bound{recorded})",
            18,
        )
        if p.shared_in_flight is not None:
            shared = ", ".join(f"p{q} {v:.1%}" for q, v in p.shared_in_flight.items())
            lines += _wrapped(
                "",
                f"shared in flight: {shared} of the KV requests in flight hold together, "
                "what sharing saves in memory (seconds with two or more in flight)",
                18,
            )
    if f is not None:
        lines += _wrapped(
            "pod",
            f"{f.pod}, {f.tokens_per_pod:,} tokens of KV: at {f.target_occupancy:.0%} occupancy "
            f"{_whose(ld)} needs {_pods(f.min_replicas)} at its p{LOW_PERCENTILE} and "
            f"{_pods(f.peak_replicas)} at its peak",
            18,
        )
    lines += ["", "verdict"]
    for a in advice:
        lines += _wrapped(f"  {a.topic}", f"{a.decision}: {a.why}", 19)
    lines += ["", spec_yaml.rstrip("\n")]
    return "\n".join(lines)


def profile_json(
    p: Profile, ld: Load, f: Fit | None, advice: Sequence[Advice], spec: dict[str, Any], text: str
) -> dict[str, Any]:
    """The profile, the verdict and the suggested spec as one JSON object."""
    out = asdict(p)
    out["burstiness"] = [asdict(b) for b in p.burstiness]
    # The in-flight figures of the requests the max model length admits, as the text sizes.
    out["max_model_len"] = ld.max_model_len
    out["refused_requests"] = ld.refused()
    out["peak_kv_tokens"] = ld.peak_tokens
    out["tokens_per_request_in_flight"] = ld.tokens_per_request(ld.max_model_len)
    out["longest_context"] = ld.longest
    if f is not None:
        out["pod"] = asdict(f)
    out["verdict"] = [asdict(a) for a in advice]
    out["spec"] = spec
    out["spec_yaml"] = text
    return out


FIGURES = (
    ("GPU-h", "gpu_hours", "median", "{:.2f}"),
    ("limited s", "limited_seconds", "median", "{:.0f}"),
    ("worst s", "limited_seconds", "worst", "{:.0f}"),
    ("full s", "saturated_seconds", "median", "{:.0f}"),
    ("queued s", "queued_seconds", "median", "{:.0f}"),
    ("peak pods", "peak_replicas", "worst", "{:.0f}"),
    ("starts", "pod_starts", "median", "{:.0f}"),
    ("cancelled", "cancelled_starts", "median", "{:.0f}"),
    ("refused", "refused", "median", "{:.0f}"),
)


def _figure(s: Setting, attr: str, case: str) -> float:
    return s.median(attr) if case == "median" else s.worst(attr)


def simulate_header(
    trace: Trace,
    rate: float,
    seeds: Sequence[int],
    pod: str,
    shape: PodShape,
    s: Setting,
    replaced: Sequence[str] = (),
) -> list[str]:
    """What was replayed on what, fixed before the table is read; `replaced` names the spec's
    own occupancy settings the sweep did not use ("targetOccupancy 0.5")."""
    pol = s.policy
    instead = f" (not the spec's {' and '.join(replaced)})" if replaced else ""
    return [
        *_wrapped(
            "trace",
            f"{trace_line(trace)}, replayed at x{rate:g} its rate; "
            f"{_count(len(seeds), 'seed')}, each request moved by up to +-5 s",
            8,
        ),
        *_wrapped(
            "pod",
            f"{pod}: {shape.capacity_blocks:,} KV blocks of {shape.block_size} tokens, max "
            f"model length {shape.max_model_len:,}, batch cap {shape.max_num_seqs}; a new pod "
            f"serves {shape.pod_start:g} s after it is asked for; decode {shape.decode_tps:g} "
            f"tokens/s a sequence, prefill {shape.prefill_tps:,.0f} tokens/s",
            8,
        ),
        *_wrapped(
            "policy",
            f"the operator's decide() every {pol.interval_seconds:g} s with the spec's scaling "
            f"(replicas {pol.min_replicas}-{pol.max_replicas}), target occupancy "
            f"{pol.target_occupancy:g} and scale-out line {pol.scale_out_occupancy:g}{instead}; "
            "one row per forecastQuantile",
            8,
        ),
        *_wrapped(
            "serves",
            f"median KV-limited seconds <= {SERVE_MEDIAN_SECONDS:g} and the worst seed's <= "
            f"{SERVE_WORST_SECONDS:g}",
            8,
        ),
    ]


def simulate_table(
    settings: Sequence[Setting], best: Setting | None, legend: bool = True
) -> list[str]:
    """One row per setting: cost against KV-limited time, the cheapest that serves marked (and
    what the columns mean, with `legend`)."""
    head = [name for name, *_ in FIGURES]
    rows = [
        [fmt.format(_figure(s, attr, case)) for _, attr, case, fmt in FIGURES] for s in settings
    ]
    width = _width([head, *rows])
    lines = [_row("quantile", head, first=10, width=width)]
    for s, values in zip(settings, rows, strict=True):
        mark = "  <- pick" if s is best else ("" if s.serves else "  (misses)")
        lines.append(_row(f"{s.quantile:.2f}", values, first=10, width=width) + mark)
    if not legend:
        return lines
    lines += _wrapped(
        "",
        "medians of the seeds. limited s: KV-limited seconds, either full s (a pod's cache full "
        "or preempting) or queued s (requests waiting at the door for blocks); worst s: the worst "
        "seed's; peak pods: the most asked for on any seed; starts: pods asked for; cancelled: of "
        "those, removed before they served (the forecast no longer needed them); refused: longer "
        "than the max model length; pick: the cheapest setting that serves",
        0,
    )
    return lines


def reserve_lines(reserves: Sequence[Reserve]) -> list[str]:
    """Each standing reserve tried after nothing served: a line and its table (the columns of
    the first table, without their legend)."""
    lines: list[str] = []
    for r in reserves:
        verdict = "serves" if r.best is not None else "no setting serves"
        lines += ["", f"with minReplicas {r.min_replicas} (a standing reserve): {verdict}"]
        lines += simulate_table(r.settings, r.best, legend=False)
    return lines


def _deploy(best: Setting, reserve: int | None = None) -> str:
    p, held = best.policy, "" if reserve is None else f"minReplicas: {reserve}, "
    return (
        f"forecastQuantile {best.quantile:.2f}, the cheapest setting that serves "
        f"({best.median('gpu_hours'):.2f} GPU-hours, {best.median('limited_seconds'):.0f} "
        f"KV-limited s median): set scaling.{held}forecastQuantile: {best.quantile:g}, "
        f"targetOccupancy: {p.target_occupancy:g}, scaleOutOccupancy: "
        f"{p.scale_out_occupancy:g} (the policy simulated)"
    )


def simulate_advice(
    settings: Sequence[Setting],
    best: Setting | None,
    floors: Sequence[float] = (),
    reserves: Sequence[Reserve] = (),
) -> list[str]:
    """What to deploy, or why nothing serves (and the standing reserve that does, when one
    was tried), and how far it is from the clairvoyant floor."""
    lines: list[str] = []
    chosen = pick(best, reserves)
    if best is not None:
        lines += _wrapped("deploy", _deploy(best), 8)
    elif chosen is not None:
        n = chosen.policy.min_replicas
        text = (
            f"no setting serves with minReplicas {settings[0].policy.min_replicas}, and one "
            f"does with a standing reserve: with minReplicas {n}, {_deploy(chosen, n)}"
        )
        lines += _wrapped("deploy", text, 8)
    else:
        most = settings[0].policy.max_replicas
        raise_it = f"the highest quantile reached scaling.maxReplicas ({most}): raise it"
        if capped(settings):
            why = raise_it
        elif reserves and capped(reserves[-1].settings):
            why = f"nor with minReplicas up to {reserves[-1].min_replicas}, where {raise_it}"
        elif reserves:
            why = (
                f"nor with minReplicas up to {reserves[-1].min_replicas} (the most pods the "
                "highest quantile asked for): try higher quantiles, or a pod that starts faster "
                "(scaling.podStartSeconds is what the forecast looks ahead)"
            )
        else:
            why = (
                "try higher quantiles, a larger minReplicas for a standing reserve, or a pod "
                "that starts faster (scaling.podStartSeconds is what the forecast looks ahead)"
            )
        lines += _wrapped("deploy", f"no setting serves: {why}", 8)
    floor = floor_median(floors)
    if floor is not None:
        # A floor of 0 (no pod needed at all: minReplicas 0, every request refused) gives no
        # ratio.
        than = (
            f"; the pick costs {chosen.median('gpu_hours') / floor:.2f}x that"
            if chosen is not None and floor > 0
            else ""
        )
        if than and best is None:
            than += f" (a floor at minReplicas {settings[0].policy.min_replicas}: it knows every "
            than += "request, and needs no reserve)"
        lines += _wrapped(
            "floor",
            f"{floor:.2f} GPU-hours (median): the fewest any autoscaler could spend on these "
            f"seeds with at most {SERVE_MEDIAN_SECONDS:g} s short, knowing every request and "
            f"packing KV perfectly across pods{than}",
            8,
        )
    rejected = round(max(s.worst("refused") for s in settings))
    if rejected:
        were = "request was" if rejected == 1 else "requests were"
        lines += _wrapped(
            "note",
            f"up to {rejected:,} {were} refused at the door: longer than the engine's max model "
            "length (engine.maxModelLen)",
            8,
        )
    return lines


def simulate_json(
    trace: Trace,
    rate: float,
    pod: str,
    shape: PodShape,
    settings: Sequence[Setting],
    best: Setting | None,
    floors: Sequence[float] = (),
    reserves: Sequence[Reserve] = (),
) -> dict[str, Any]:
    """Every run of the sweep, each setting's medians and worsts, the pick, the standing
    reserves tried when nothing served, and the clairvoyant floor."""
    return {
        "trace": {"name": trace.name, "requests": len(trace), "duration_s": trace.duration},
        "rate": rate,
        "pod": {"description": pod, **asdict(shape)},
        "serves": {"median_seconds": SERVE_MEDIAN_SECONDS, "worst_seconds": SERVE_WORST_SECONDS},
        "min_replicas": settings[0].policy.min_replicas,
        "settings": _settings_json(settings),
        "cheapest_serving_quantile": None if best is None else best.quantile,
        # What to deploy: the spec's minReplicas at its pick, else the reserve that serves.
        "pick": _pick_json(best, reserves),
        "reserves": [
            {
                "min_replicas": r.min_replicas,
                "settings": _settings_json(r.settings),
                "cheapest_serving_quantile": None if r.best is None else r.best.quantile,
            }
            for r in reserves
        ],
        "clairvoyant_floor": {
            "allowed_seconds": SERVE_MEDIAN_SECONDS,
            "gpu_hours_median": floor_median(floors),
            "gpu_hours": [f if math.isfinite(f) else None for f in floors],
        },
    }


def _settings_json(settings: Sequence[Setting]) -> list[dict[str, Any]]:
    return [
        {
            "forecast_quantile": s.quantile,
            "target_occupancy": s.policy.target_occupancy,
            "scale_out_occupancy": s.policy.scale_out_occupancy,
            "serves": s.serves,
            "median": {a: s.median(a) for _, a, _, _ in FIGURES},
            "worst": {a: s.worst(a) for _, a, _, _ in FIGURES},
            "runs": [
                {"seed": seed, **asdict(r), "refused": n}
                for seed, r, n in zip(s.seeds, s.results, s.refused, strict=True)
            ],
        }
        for s in settings
    ]


def _pick_json(best: Setting | None, reserves: Sequence[Reserve]) -> dict[str, Any] | None:
    chosen = pick(best, reserves)
    if chosen is None:
        return None
    return {"min_replicas": chosen.policy.min_replicas, "forecast_quantile": chosen.quantile}
