"""The comparison itself: every KV setting on the same prompts at each context length, scored
against the first setting (the auto cache), and the verdict per context."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from pydantic import BaseModel

from headroom.engine.attention import AttentionBackend
from headroom.engine.kv_check import metrics, needle
from headroom.engine.kv_check.prompts import Haystacks
from headroom.engine.kv_check.session import KVSetting, Session
from headroom.engine.model.llama import LlamaForCausalLM
from headroom.engine.model.tokenizer import Tokenizer


class CheckError(ValueError):
    """Settings the check cannot run with (a context too short for its needle)."""


# A quantized setting is safe at a context when its needle score is within NEEDLE_DROP of the
# auto cache's and its next-token top-1 agreement is at least TOP1_MIN.
NEEDLE_DROP = 0.05
TOP1_MIN = 0.90
# Below this the model itself does not retrieve, and the needle score says little.
RELIABLE_NEEDLE = 0.5
# Slack in the threshold comparisons: scores are ratios of counts, so one exactly at a threshold
# (18 of 20 top-1, one needle of 20 lost) passes whatever the float rounding of the ratios.
_EPS = 1e-9

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True, slots=True)
class CheckConfig:
    """What is measured at each context length."""

    contexts: tuple[int, ...]
    num_prompts: int = 4
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    positions: int = 32  # teacher-forced next-token positions per prompt
    greedy_tokens: int = 32
    seed: int = 0


class SettingResult(BaseModel):
    """One KV setting at one context, against the auto cache (the reference row is exact)."""

    setting: str
    kv_dtype: str
    top1_agreement: float
    kl_divergence: float
    greedy_match_tokens: float  # mean tokens matched before the first divergence
    greedy_full_match: float  # fraction of prompts whose whole greedy run matched
    needle_score: float
    needle_trials: int


class ContextResult(BaseModel):
    context: int
    settings: list[SettingResult]

    def of(self, name: str) -> SettingResult:
        return next(s for s in self.settings if s.setting == name)


@dataclass
class _Trial:
    """One setting's raw outputs at one context."""

    logits: list[torch.Tensor]
    greedy: list[list[int]]
    needles: list[bool]


def _needle_parts(
    tokenizer: Tokenizer, hay: Haystacks, context: int, cfg: CheckConfig
) -> list[tuple[needle.Needle, list[int], list[int], int]]:
    """(needle, fact ids, question ids, haystack tokens around them) for every prompt x depth
    at `context`, in that order; `CheckError` when the context cannot hold a needle."""
    parts = []
    for nd in needle.draw_needles(cfg.num_prompts * len(cfg.depths), cfg.seed + context):
        fact = tokenizer.encode(" " + nd.fact + " ", add_special_tokens=False)
        ask = tokenizer.encode(" " + nd.question, add_special_tokens=False)
        room = context - len(fact) - len(ask) - (hay.bos is not None)
        if room < 1:
            raise CheckError(
                f"context {context} is too short for the needle ({len(fact) + len(ask)} "
                "tokens of fact and question)"
            )
        parts.append((nd, fact, ask, room))
    return parts


def check_needles_fit(tokenizer: Tokenizer, hay: Haystacks, cfg: CheckConfig) -> None:
    """`CheckError` when a context of `cfg` is too short for its needles: what `needle_prompts`
    would raise mid-check, found before any model run."""
    for context in cfg.contexts:
        _needle_parts(tokenizer, hay, context, cfg)


def needle_prompts(
    tokenizer: Tokenizer, hay: Haystacks, context: int, cfg: CheckConfig
) -> list[tuple[list[int], needle.Needle, int]]:
    """(prompt ids, needle, tokens to generate) for every prompt x depth at `context`."""
    parts = iter(_needle_parts(tokenizer, hay, context, cfg))
    trials = []
    for i in range(cfg.num_prompts):
        for depth in cfg.depths:
            nd, fact, ask, room = next(parts)
            ids = hay.with_bos(
                needle.insert_at_depth(hay.window(i, room, cfg.num_prompts), fact, ask, depth)
            )
            trials.append((ids, nd, needle_tokens(tokenizer, nd.value)))
    return trials


def needle_tokens(tokenizer: Tokenizer, value: str) -> int:
    """Greedy tokens generated after a needle's question: the value's, and two to see where
    the number ends."""
    return len(tokenizer.encode(" " + value, add_special_tokens=False)) + 2


def longest_needle_tokens(tokenizer: Tokenizer) -> int:
    """The most `needle_tokens` any value can take: what a needle generates past its context."""
    return max(needle_tokens(tokenizer, v) for v in needle.VALUES)


def _run(
    session: Session,
    tokenizer: Tokenizer,
    hay: Haystacks,
    context: int,
    cfg: CheckConfig,
    tick: Callable[[], None],
) -> _Trial:
    body = context - (hay.bos is not None)
    trial = _Trial([], [], [])
    for i in range(cfg.num_prompts):
        tokens = hay.with_bos(hay.window(i, body + cfg.positions, cfg.num_prompts))
        trial.logits.append(session.next_token_logits(tokens, context))
        tick()
        trial.greedy.append(session.greedy(tokens[:context], cfg.greedy_tokens))
        tick()
    for ids, nd, n in needle_prompts(tokenizer, hay, context, cfg):
        text = tokenizer.decode(session.greedy(ids, n))
        trial.needles.append(needle.answered(text, nd.value))
        tick()
    return trial


def _score(setting: KVSetting, trial: _Trial, ref: _Trial) -> SettingResult:
    top1 = [metrics.top1_agreement(a, b) for a, b in zip(ref.logits, trial.logits, strict=True)]
    kl = [metrics.kl_divergence(a, b) for a, b in zip(ref.logits, trial.logits, strict=True)]
    match = [metrics.matched_prefix(a, b) for a, b in zip(ref.greedy, trial.greedy, strict=True)]
    full = [m == len(g) for m, g in zip(match, ref.greedy, strict=True)]
    return SettingResult(
        setting=setting.name,
        kv_dtype=setting.kv_dtype,
        top1_agreement=metrics.mean(top1),
        kl_divergence=metrics.mean(kl),
        greedy_match_tokens=metrics.mean([float(m) for m in match]),
        greedy_full_match=metrics.mean([float(f) for f in full]),
        needle_score=metrics.mean([float(x) for x in trial.needles]),
        needle_trials=len(trial.needles),
    )


def run_check(
    model: LlamaForCausalLM,
    tokenizer: Tokenizer,
    backend: AttentionBackend,
    device: torch.device,
    settings: Sequence[KVSetting],
    hay: Haystacks,
    cfg: CheckConfig,
    progress: Progress | None = None,
) -> list[ContextResult]:
    """Run every setting (the first is the reference) at every context of `cfg`."""
    per_run = cfg.num_prompts * (2 + len(cfg.depths))
    total = per_run * len(settings) * len(cfg.contexts)
    done = 0
    results = []
    for context in cfg.contexts:
        ref: _Trial | None = None
        rows = []
        for setting in settings:
            label = f"context {context}, {setting.name}"

            def tick(label: str = label) -> None:
                nonlocal done
                done += 1
                if progress is not None:
                    progress(done, total, label)

            session = Session(model, backend, setting, device)
            trial = _run(session, tokenizer, hay, context, cfg, tick)
            ref = ref or trial
            rows.append(_score(setting, trial, ref))
        results.append(ContextResult(context=context, settings=rows))
    return results


def short_context(n: int) -> str:
    """1024 -> "1k", 16384 -> "16k", 1000 -> "1000"."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _needle_ok(row: SettingResult, ref: SettingResult) -> bool:
    return row.needle_score >= ref.needle_score - NEEDLE_DROP - _EPS


def _top1_ok(row: SettingResult) -> bool:
    return row.top1_agreement >= TOP1_MIN - _EPS


def is_safe(row: SettingResult, ref: SettingResult) -> bool:
    """The verdict rule: needle within NEEDLE_DROP of the reference and top-1 >= TOP1_MIN."""
    return _needle_ok(row, ref) and _top1_ok(row)


def all_safe(results: Sequence[ContextResult], setting: str, reference: str = "auto") -> bool:
    """Whether `setting` is safe at every context checked (the exit status's rule)."""
    return all(is_safe(r.of(setting), r.of(reference)) for r in results)


def _percent(x: float) -> str:
    """A whole percent as such (50%), else one decimal rounded down (89.96% is 89.9%): a value
    under a threshold never prints as the threshold."""
    if abs(x * 100 - round(x * 100)) < 1e-6:
        return f"{round(x * 100)}%"
    return f"{math.floor(x * 1000 + 1e-9) / 10:.1f}%"


def _why(row: SettingResult, ref: SettingResult) -> str:
    parts = []
    if not _needle_ok(row, ref):
        parts.append(
            f"the needle score drops from {ref.needle_score:.2f} to {row.needle_score:.2f}"
        )
    if not _top1_ok(row):
        parts.append(f"top-1 agreement is {_percent(row.top1_agreement)} (< {TOP1_MIN:.0%})")
    return " and ".join(parts)


def verdict(results: Sequence[ContextResult], setting: str, reference: str = "auto") -> str:
    """One sentence: up to which context `setting` is safe, and what breaks after it."""
    ordered = sorted(results, key=lambda r: r.context)
    safe_upto: int | None = None
    for r in ordered:
        row, ref = r.of(setting), r.of(reference)
        if not is_safe(row, ref):
            at = short_context(r.context)
            head = (
                f"{setting} safe up to {short_context(safe_upto)}; at {at} "
                if safe_upto is not None
                else f"{setting} not safe at {at}: "
            )
            return head + _why(row, ref)
        safe_upto = r.context
    last = ordered[-1]
    row, ref = last.of(setting), last.of(reference)
    return (
        f"{setting} safe at every context checked (up to {short_context(last.context)}): "
        f"needle score {row.needle_score:.2f} vs {ref.needle_score:.2f} with the auto cache, "
        f"top-1 agreement {row.top1_agreement:.0%}"
    )


def caveats(results: Sequence[ContextResult], reference: str = "auto") -> list[str]:
    """Contexts where the model itself does not retrieve, so the needle proves little."""
    out = []
    for r in results:
        ref = r.of(reference)
        if ref.needle_score < RELIABLE_NEEDLE:
            out.append(
                f"at {short_context(r.context)} the model retrieves poorly even with the auto "
                f"cache (needle {ref.needle_score:.2f}), so the needle score there says little"
            )
    return out
