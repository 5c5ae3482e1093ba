"""The memory-versus-concurrency chart of `headroom plan --plot` (matplotlib, PNG)."""

from __future__ import annotations

from pathlib import Path

from headroom.contract.budget.memory import GIB, blocks_for_tokens
from headroom.contract.budget.plan import Plan, PlanInput


def draw_memory_chart(inp: PlanInput, p: Plan, path: Path) -> None:
    """One GPU of one pod: the fixed weights band, KV climbing with concurrency, the ceiling
    and the out-of-memory point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_seq = blocks_for_tokens(p.context, p.block_size) * p.block_size
    per_seq_gib = per_seq * p.kv_bytes_per_token_per_gpu / GIB
    weights = p.weights_bytes_per_gpu / GIB
    reserve = p.activation_reserve_bytes_per_gpu / GIB
    ceiling = inp.gpu_memory_bytes * inp.gpu_memory_utilization / GIB
    physical = inp.gpu_memory_bytes / GIB
    oom = max(0.0, (ceiling - weights - reserve) / per_seq_gib) if per_seq_gib else 0.0
    top = int(max(inp.concurrency, oom, 1) * 1.3) + 1
    xs = list(range(top + 1))
    kv_top = [weights + reserve + x * per_seq_gib for x in xs]

    fig, ax = plt.subplots(figsize=(9, 5.2), dpi=110)
    ax.fill_between(xs, 0, weights, color="#8c8c8c", alpha=0.55, label=f"weights {weights:.1f} GiB")
    ax.fill_between(xs, weights, weights + reserve, color="#c9b458", alpha=0.5,
                    label=f"activations/reserve {reserve:.1f} GiB")  # fmt: skip
    kv_label = f"KV cache ({per_seq_gib * 1024:.0f} MiB per {p.context:,}-token seq)"
    ax.fill_between(xs, weights + reserve, kv_top, color="#3b7dd8", alpha=0.45, label=kv_label)
    ceiling_label = f"usable ceiling {ceiling:.1f} GiB ({inp.gpu_memory_utilization:.0%})"
    ax.axhline(ceiling, color="#d62728", lw=1.6, label=ceiling_label)
    ax.axhline(physical, color="#d62728", lw=0.8, ls=":", label=f"GPU memory {physical:.1f} GiB")
    if 0 < oom <= top:
        ax.axvline(oom, color="#d62728", ls="--", lw=1)
        ax.annotate(f"OOM at {oom:.0f} sequences", xy=(oom, ceiling), xytext=(8, -28),
                    textcoords="offset points", color="#d62728")  # fmt: skip
    ax.axvline(inp.concurrency, color="black", ls="-.", lw=1)
    ax.annotate(f"peak {inp.concurrency}", xy=(inp.concurrency, ceiling * 0.05), xytext=(6, 0),
                textcoords="offset points")  # fmt: skip
    ax.set_xlim(0, top)
    ax.set_ylim(0, max(physical, kv_top[-1] if kv_top[-1] < physical * 1.6 else physical) * 1.08)
    ax.set_xlabel("concurrent sequences on one pod")
    ax.set_ylabel("memory per GPU (GiB)")
    verdict = f"{p.replicas} replicas" if p.feasible else "infeasible"
    ax.set_title(f"{p.model} on {p.gpu} (tp {p.tp}, {p.kv_dtype} KV): {verdict}")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.25)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
