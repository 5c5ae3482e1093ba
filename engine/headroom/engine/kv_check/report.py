"""kv-check's output: the table, the JSON report and the PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel

from headroom.engine.kv_check.check import ContextResult, caveats, short_context, verdict


class KVCheckReport(BaseModel):
    """Everything `--json` writes."""

    model: str
    kv_cache_dtype: str
    device: str
    model_dtype: str
    num_prompts: int
    depths: list[float]
    contexts: list[ContextResult]
    verdicts: list[str]
    caveats: list[str]
    scales_path: str | None = None


def build_report(
    results: Sequence[ContextResult],
    *,
    model: str,
    kv_cache_dtype: str,
    device: str,
    model_dtype: str,
    num_prompts: int,
    depths: Sequence[float],
    scales_path: str | None,
) -> KVCheckReport:
    quantized = [s.setting for s in results[0].settings[1:]]
    return KVCheckReport(
        model=model,
        kv_cache_dtype=kv_cache_dtype,
        device=device,
        model_dtype=model_dtype,
        num_prompts=num_prompts,
        depths=list(depths),
        contexts=list(results),
        verdicts=[verdict(results, name) for name in quantized],
        caveats=caveats(results),
        scales_path=scales_path,
    )


def table(report: KVCheckReport) -> str:
    """The per-context table and the verdicts, as printed."""
    # The KV column fits the longest setting name ("fp8 (kv_cache_scales.json)"), 16 at least.
    w = max([16] + [len(s.setting) for r in report.contexts for s in r.settings])
    head = f"{'context':>8} {'KV':>{w}} {'top-1':>7} {'KL':>9} {'greedy match':>16} {'needle':>7}"
    lines = [
        f"kv-check: {report.model}, {report.model_dtype} weights on {report.device}, "
        f"{report.num_prompts} prompts x {len(report.depths)} needle depths per context",
        head,
    ]
    for r in report.contexts:
        for s in r.settings:
            if s.setting == "auto":
                top1 = kl = match = "-"
            else:
                top1, kl = f"{s.top1_agreement:.1%}", f"{s.kl_divergence:.2e}"
                match = f"{s.greedy_match_tokens:.1f} ({s.greedy_full_match:.0%} all)"
            lines.append(
                f"{short_context(r.context):>8} {s.setting:>{w}} {top1:>7} {kl:>9} {match:>16} "
                f"{s.needle_score:7.2f}"
            )
    lines.append("")
    lines += [f"verdict: {v}" for v in report.verdicts]
    lines += [f"note: {c}" for c in report.caveats]
    if report.scales_path:
        lines.append(f"calibrated fp8 scales written to {report.scales_path}")
    return "\n".join(lines)


def plot(report: KVCheckReport, path: Path) -> None:
    """Needle score and top-1 agreement against context, one line per KV setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [r.context for r in report.contexts]
    names = [s.setting for s in report.contexts[0].settings]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in names:
        rows = [r.of(name) for r in report.contexts]
        ax1.plot(contexts, [s.needle_score for s in rows], marker="o", label=name)
        if name != "auto":
            ax2.plot(contexts, [s.top1_agreement for s in rows], marker="o", label=name)
    for ax, title in ((ax1, "needle score"), (ax2, "next-token top-1 agreement with auto")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [short_context(c) for c in contexts])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"kv-check: {report.model}, {report.kv_cache_dtype} KV")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
