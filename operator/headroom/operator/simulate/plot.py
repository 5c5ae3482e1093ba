"""`headroom simulate --png`: GPU-hours against KV-limited seconds, one point per (setting,
seed), each setting's median labelled by its quantile, the service level and the pick."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from headroom.operator.simulate.sweep import (
    SERVE_MEDIAN_SECONDS,
    SERVE_WORST_SECONDS,
    Reserve,
    Setting,
    pick,
    serving,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# Per format (contract.outputs.CHART_SUFFIXES), the metadata that would make the same sweep a
# different file on another day or matplotlib version: the writer's name and the date. Each
# writer refuses the others' keys.
METADATA: dict[str, dict[str, str | None]] = {
    ".png": {"Software": None},
    ".svg": {"Creator": None, "Date": None},
    ".pdf": {"Creator": None, "Producer": None, "CreationDate": None},
}


def draw_floor(ax: Axes, floor: float) -> None:
    """The clairvoyant floor as a dotted vertical line (this plot's and the autoscaling bench's)."""
    label = f"clairvoyant floor ({SERVE_MEDIAN_SECONDS:g} s short)"
    ax.axvline(floor, color="k", ls=":", lw=1, label=label)


def plot(
    settings: Sequence[Setting],
    best: Setting | None,
    title: str,
    path: Path,
    floor: float | None = None,
    reserves: Sequence[Reserve] = (),
) -> None:
    """Draw the sweep into `path` (PNG, SVG or PDF, by its suffix), with the clairvoyant floor
    when given, and the standing reserve that serves among `reserves` (its pick is then the
    star)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.6))
    for s in settings:
        ax.scatter(
            [r.gpu_hours for r in s.results],
            [r.limited_seconds for r in s.results],
            s=10,
            color="C0",
            alpha=0.35,
        )
    xs = [s.median("gpu_hours") for s in settings]
    ys = [s.median("limited_seconds") for s in settings]
    ax.plot(xs, ys, "o-", color="C0", lw=1.2, label="median of the seeds, by forecastQuantile")
    for i, (s, x, y) in enumerate(zip(settings, xs, ys, strict=True)):
        # Alternate above and below: neighbouring settings often cost about the same.
        ax.annotate(
            f"{s.quantile:.2f}",
            (x, y),
            fontsize=7,
            color="C0",
            xytext=(3, 4 if i % 2 == 0 else -10),
            textcoords="offset points",
        )
    reserve = serving(reserves)
    if reserve is not None:
        rx = [s.median("gpu_hours") for s in reserve.settings]
        ry = [s.median("limited_seconds") for s in reserve.settings]
        label = f"with minReplicas {reserve.min_replicas} (a standing reserve)"
        ax.plot(rx, ry, "s--", color="C1", lw=1.0, ms=4, label=label)
        for s, x, y in zip(reserve.settings, rx, ry, strict=True):
            ax.annotate(f"{s.quantile:.2f}", (x, y), fontsize=7, color="C1", xytext=(3, 4),
                        textcoords="offset points")  # fmt: skip
    chosen = pick(best, reserves)
    if chosen is not None:
        ax.scatter(
            [chosen.median("gpu_hours")],
            [chosen.median("limited_seconds")],
            marker="*",
            s=160,
            color="C3",
            zorder=5,
            label="cheapest that serves",
        )
    ax.axhline(
        SERVE_MEDIAN_SECONDS,
        color="0.4",
        ls="--",
        lw=0.8,
        label=f"serves: median <= {SERVE_MEDIAN_SECONDS:g} s",
    )
    ax.axhline(
        SERVE_WORST_SECONDS,
        color="0.6",
        ls=":",
        lw=0.8,
        label=f"and worst seed <= {SERVE_WORST_SECONDS:g} s",
    )
    if floor is not None:
        draw_floor(ax, floor)
    ax.set_yscale("symlog", linthresh=10)
    ax.set_xlabel("GPU-hours")
    ax.set_ylabel("KV-limited seconds")
    ax.set_title(title, fontsize=9)
    ax.grid(True, lw=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    # A fixed salt: the SVG writer's element ids are otherwise random on every run.
    with matplotlib.rc_context({"svg.hashsalt": "headroom"}):
        fig.savefig(path, dpi=90, metadata=METADATA.get(path.suffix.lower(), {}))
    plt.close(fig)
