"""The benchmark's table, verdicts and markdown page."""

from __future__ import annotations

from collections.abc import Sequence

from bench.autoscale.frontier import (
    FLOOR,
    Run,
    cheapest_serving,
    cheapest_zero,
    cost_claim,
    floor_cost,
    frontier,
    frontier_claim,
    oracle_claim,
    points,
)
from bench.autoscale.run import BASELINES, POLICIES
from bench.autoscale.traces import COST_GRADED, BenchTrace
from bench.verdicts import Verdicts
from headroom.operator.simulate.replay import DT, TICK, shape_for

HEADER = (
    f"{'trace':<12} {'policy':<17} {'target':>6} {'limited s':>9} {'limited':>7} "
    f"{'sat s':>6} {'queued s':>8} {'GPU-h':>6} {'GPU-h':>6} {'preempt':>7} {'peak':>4} "
    f"{'starts':>6} {'cancel':>6} {'serves':>6} {'front':>5}\n"
    f"{'':<12} {'':<17} {'':>6} {'med':>9} {'s max':>7} {'med':>6} {'med':>8} {'med':>6} "
    f"{'max':>6} {'med':>7} {'pods':>4} {'med':>6} {'med':>6} {'':>6} {'':>5}"
)


def setup_lines(
    traces: Sequence[BenchTrace], grid: Sequence[float], seeds: Sequence[int]
) -> list[str]:
    """What was run: each trace's pod, the seeds, the grid."""
    lines = []
    for bt in traces:
        sh = shape_for(bt.spec)
        lines.append(
            f"{bt.name}: {bt.describe}; {bt.spec.model.preset} on {bt.spec.gpu.type} x"
            f"{sh.gpus} per pod: {sh.capacity_blocks:,} KV blocks of {sh.block_size} tokens, max "
            f"{sh.max_num_seqs} seqs, max model len {sh.max_model_len:,}"
        )
    lines += [
        f"pods serve {shape_for(traces[0].spec).pod_start:.0f} s after being asked for; "
        f"decisions every {TICK:.0f} s, simulated in {DT:g} s steps; every policy observes a "
        "600 s warm-up (the trace's opening) and acts on nothing during it",
        f"every (trace, policy, target) on the same {len(seeds)} seeds ({seeds[0]}..{seeds[-1]}); "
        f"targets {grid[0]:.2f}..{grid[-1]:.2f} for every policy (the oracle also 0.96-0.99)",
        "limited s = KV-limited seconds: a pod's cache full or preempting (sat s), or requests "
        "waiting at the door for blocks (queued s); med = median seed, max = worst seed",
        "starts = pods asked for; cancel = of those, removed before they served (median seed)",
        "serves = median limited s <= 30 and worst seed <= 120; front = on the median frontier",
        "floor = the clairvoyant floor, median over the seeds: the fewest GPU-h any policy could "
        "spend leaving at most 30 s short, knowing every request, packing KV perfectly across "
        "pods and releasing them at once (new pods still paid from being asked for); ungraded",
    ]
    return lines


def table(runs: list[Run], traces: Sequence[BenchTrace]) -> str:
    """Every setting of every policy on every trace."""
    lines = [HEADER]
    for bt in traces:
        for label in POLICIES:
            pts = points(runs, bt.name, label)
            front = frontier(pts)
            for p in pts:
                lines.append(
                    f"{bt.name:<12} {label:<17} {p.target:>6.2f} {p.seconds:>9.0f} "
                    f"{p.figure('limited_seconds', 'worst'):>7.0f} "
                    f"{p.figure('saturated_seconds'):>6.0f} {p.figure('queued_seconds'):>8.0f} "
                    f"{p.cost:>6.2f} {p.figure('gpu_hours', 'worst'):>6.2f} "
                    f"{p.figure('preemptions'):>7.0f} {p.figure('peak_replicas', 'worst'):>4.0f} "
                    f"{p.figure('pod_starts'):>6.0f} {p.figure('cancelled_starts'):>6.0f} "
                    f"{'yes' if p.serves else '-':>6} "
                    f"{'*' if any(p is q for q in front) else '':>5}"
                )
        lines.append("")
    return "\n".join(lines).rstrip()


def verdicts(runs: list[Run], traces: Sequence[BenchTrace]) -> tuple[list[str], Verdicts]:
    """The graded claims, trace by trace, and a summary row per trace."""
    v = Verdicts()
    out: list[str] = []
    summary = [
        f"{'trace':<12} {'headroom':>14} {'kv-HPA':>14} {'cpu-HPA':>14} {'oracle 0 s':>14} "
        f"{'vs kv':>6} {'vs cpu':>6} {'vs oracle':>9} {'floor':>6} {'vs floor':>8}"
    ]
    for bt in traces:
        by = {label: points(runs, bt.name, label) for label in POLICIES}
        head = by["headroom"]
        cells = []
        for label in ("headroom", *BASELINES):
            cs = cheapest_serving(by[label])
            cells.append(f"{cs.cost:.2f} @{cs.target:.2f}" if cs else "none")
        o = cheapest_zero(by["oracle"])
        cells.append(f"{o.cost:.2f} @{o.target:.2f}" if o else "none")
        h = cheapest_serving(head)
        ratios = []
        for ref in (cheapest_serving(by[b]) for b in BASELINES):
            ratios.append(f"{h.cost / ref.cost:.2f}x" if h and ref else "-")
        ratios.append(f"{h.cost / o.cost:.2f}x" if h and o else "-")
        floor = floor_cost(points(runs, bt.name, FLOOR))
        ratios.append(f"{floor:.2f}" if floor else "-")
        ratios.append(f"{h.cost / floor:.2f}x" if h and floor else "-")
        summary.append(
            f"{bt.name:<12} {cells[0]:>14} {cells[1]:>14} {cells[2]:>14} {cells[3]:>14} "
            f"{ratios[0]:>6} {ratios[1]:>6} {ratios[2]:>9} {ratios[3]:>6} {ratios[4]:>8}"
        )
        graded = bt.name in COST_GRADED
        for base in BASELINES:
            if graded:
                c = cost_claim(head, by[base], base, by["oracle"], floor)
                out.append(
                    f"{bt.name}: cost vs {base}: {v(c.ok, f'{bt.name} cost vs {base}')}: {c.text}"
                )
            f = frontier_claim(head, by[base], base)
            word = v(f.ok, f"{bt.name} frontier vs {base}", informational=not f.graded)
            out.append(f"{bt.name}: frontier vs {base}: {word}: {f.text}")
        c = oracle_claim(head, by["oracle"])
        word = v(c.ok, f"{bt.name} cost vs oracle", informational=not graded)
        out.append(f"{bt.name}: cost vs the oracle: {word}: {c.text}")
        out.append("")
    return [*summary, "", *out], v


def markdown(
    setup: list[str], table_text: str, verdict_lines: list[str], png: str | None, footer: str
) -> str:
    """The whole report as a page for docs/."""
    out = [
        "# Autoscaling policies: cost against KV-limited seconds",
        "",
        "Written by `python -m bench.autoscale_sim` (the full sweep); `bench/autoscale/` "
        "defines the traces, the baselines and the claims graded, and the simulated world "
        "and the headroom policy are the operator's own (`headroom.operator.simulate`).",
        "",
    ]
    if png:
        out += [f"![frontiers]({png})", ""]
    out += ["```", *setup, "", *verdict_lines, footer, "```", "", "```", table_text, "```", ""]
    return "\n".join(out)
