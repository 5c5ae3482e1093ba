"""Autoscaling policies compared like with like, on synthetic and real traffic.

    .venv/bin/python -m bench.autoscale_sim [--quick] [--workers 2] [--trace FILE [--rate X]]

Replays each trace (bench/autoscale/traces.py: three synthetic shapes, Azure's and Mooncake's
published traces, each with its pod fixed before any result) through the operator's simulated
deployment (`headroom.operator.simulate`) under four policies, each swept over the same target
grid on the same 20 seeds: headroom's own `decide()` on what its sidecars report, a Kubernetes
HPA on KV occupancy (the peers' recipe), an HPA on CPU, and an oracle that knows the future.
Prints every setting, each trace's cheapest serving settings beside the clairvoyant floor (the
fewest GPU-hours any policy could spend), and the graded claims (bench/autoscale/frontier.py);
exits 1 on any MISS. The full sweep writes docs/autoscale_frontier.{md,png}; a report on
saved runs (--load-runs) writes them only where --out says.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from bench.autoscale.frontier import FLOOR, Run
from bench.autoscale.plot import plot
from bench.autoscale.report import markdown, setup_lines, table, verdicts
from bench.autoscale.run import run_all
from bench.autoscale.traces import TRACES, from_file
from headroom.operator.crd.models import InferenceDeploymentSpec

# Fixed before any result was seen (issue 17), the same for every policy.
GRID = tuple(round(0.50 + 0.05 * i, 2) for i in range(10))  # 0.50 .. 0.95
SEEDS = tuple(range(1, 21))
QUICK_GRID = (0.6, 0.75, 0.9, 0.95)
QUICK_SEEDS = (1, 2, 3)
DOCS = Path(__file__).resolve().parent.parent / "docs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"targets {QUICK_GRID}, seeds {QUICK_SEEDS}"
    )
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--only", nargs="*", help="run only these traces (by name)")
    parser.add_argument("--trace", type=Path, help="replay this trace file instead")
    parser.add_argument("--rate", type=float, default=1.0, help="with --trace: rate factor")
    parser.add_argument("--spec", type=Path, help="with --trace: the InferenceDeployment spec "
                        "(YAML or JSON, the spec or the whole resource)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the .md and .png here")
    parser.add_argument("--save-runs", type=Path, help="also write every run as JSON")
    parser.add_argument("--load-runs", type=Path, help="report on saved runs, simulating none "
                        "(writes the .md and .png only with --out)")  # fmt: skip
    args = parser.parse_args(argv)
    grid, seeds = (QUICK_GRID, QUICK_SEEDS) if args.quick else (GRID, SEEDS)
    traces = TRACES
    if args.trace:
        spec = None
        if args.spec:
            import yaml

            doc = yaml.safe_load(args.spec.read_text())
            spec = InferenceDeploymentSpec.model_validate(doc.get("spec", doc))
        traces = (from_file(args.trace, args.rate, spec),)
    elif args.only:
        known = [t.name for t in TRACES]
        unknown = [n for n in args.only if n not in known]
        if unknown:
            parser.error(
                f"--only: no trace named {', '.join(unknown)}; the traces: {', '.join(known)}"
            )
        traces = tuple(t for t in TRACES if t.name in args.only)
    t0 = time.monotonic()
    if args.load_runs:
        # Runs saved before pod starts were counted read as none.
        fresh = {"pod_starts": 0, "cancelled_starts": 0}
        runs = [Run(**{**fresh, **r}) for r in json.loads(args.load_runs.read_text())]
        names = {r.trace for r in runs}
        traces = tuple(t for t in traces if t.name in names)
        seeds = tuple(sorted({r.seed for r in runs}))
        grid = tuple(sorted({r.target for r in runs if r.policy == "headroom"}))
    else:
        runs = run_all(traces, grid, seeds, args.workers)
    if args.save_runs:
        args.save_runs.write_text(json.dumps([asdict(r) for r in runs]))
    setup = setup_lines(traces, grid, seeds)
    text = table(runs, traces)
    lines, v = verdicts(runs, traces)
    how = (
        f"loaded from {args.load_runs.name}" if args.load_runs
        else f"on {args.workers} workers, {time.monotonic() - t0:.0f} s"
    )  # fmt: skip
    floors = sum(r.policy == FLOOR for r in runs)
    footer = f"({len(runs) - floors} simulations and {floors} floors {how})"
    print("\n".join(setup), "", text, "", "\n".join(lines), footer, sep="\n")
    # Only a full simulation rewrites the committed docs by default: saved runs may be a
    # scratch variant's.
    full = not (args.quick or args.trace or args.only or args.load_runs)
    out = args.out or (DOCS if full else None)
    if out is not None:
        png = out / "autoscale_frontier.png"
        plot(runs, traces, png, len(seeds))
        (out / "autoscale_frontier.md").write_text(markdown(setup, text, lines, png.name, footer))
        print(f"wrote {out / 'autoscale_frontier.md'} and {png}")
    return v.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
