"""The frontiers as a PNG: one panel per trace, every policy's settings and median frontier."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.autoscale.frontier import FLOOR, Run, cheapest_zero, floor_cost, frontier, points
from bench.autoscale.run import POLICIES
from bench.autoscale.traces import BenchTrace
from headroom.operator.simulate.plot import draw_floor

COLORS = {"headroom": "C0", "kv-threshold-hpa": "C1", "cpu-hpa": "C2", "oracle": "0.4"}


def plot(runs: list[Run], traces: Sequence[BenchTrace], path: Path, seeds: int) -> None:
    """Draw the medians of each setting, each policy's frontier, the oracle's cheapest 0 s and
    the clairvoyant floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(traces), figsize=(4.6 * len(traces), 4.4), squeeze=False)
    for col, bt in enumerate(traces):
        ax = axes[0, col]
        for label in POLICIES:
            pts = points(runs, bt.name, label)
            if not pts:
                continue
            ax.scatter([p.cost for p in pts], [p.seconds for p in pts], s=12,
                       color=COLORS[label], alpha=0.5)  # fmt: skip
            front = frontier(pts)
            fx, fy = [p.cost for p in front], [p.seconds for p in front]
            ax.step([*fx, max(p.cost for p in pts)], [*fy, fy[-1]], where="post",
                    color=COLORS[label], label=label, lw=1.4)  # fmt: skip
            if label == "headroom":
                for p in pts:
                    ax.annotate(f"{p.target:.2f}", (p.cost, p.seconds), fontsize=6,
                                color=COLORS[label], xytext=(2, 2),
                                textcoords="offset points")  # fmt: skip
        oracle = cheapest_zero(points(runs, bt.name, "oracle"))
        if oracle:
            ax.scatter([oracle.cost], [0], marker="*", s=120, color="k", zorder=5,
                       label="oracle, cheapest 0 s")  # fmt: skip
        floor = floor_cost(points(runs, bt.name, FLOOR))
        if floor is not None:
            draw_floor(ax, floor)
        ax.set_yscale("symlog", linthresh=10)
        ax.set_title(f"{bt.name} (median of {seeds} seeds)", fontsize=9)
        ax.set_xlabel("GPU-hours")
        ax.set_ylabel("KV-limited seconds")
        ax.grid(True, lw=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)
