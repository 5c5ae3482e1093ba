"""What a trace's profile means for a deployment: the decision-matrix verdict (paging always;
prefix caching when prompts really overlap; KV quantization only if still memory-bound, and only
after `headroom kv-check`), the pods a given pod needs for the trace, and the `spec.traffic` and
`spec.scaling` to paste. Pure functions of the profile, the in-flight load and the plan.

Pods are counted on the KV the requests hold in flight with no prefix sharing, as the simulator
(`world.py`) holds it, at the scaling policy's target occupancy; a request longer than the max
model length holds none (the engine refuses it at the door).
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from dataclasses import dataclass

import numpy as np

from headroom.contract.budget import Plan, plan
from headroom.operator.crd.models import InferenceDeploymentSpec, ScalingSpec
from headroom.operator.reconcile.sizing import Sizing, plan_input
from headroom.operator.scaling.decide import pods_holding
from headroom.operator.simulate.profile import (
    PREFIX_WORTHWHILE,
    SHARED_PERCENTILES,
    Profile,
    in_flight,
)
from headroom.operator.simulate.trace import Trace

LOW_PERCENTILE = 5  # minReplicas holds this percentile of the in-flight KV
GROWTH = 1.5  # maxReplicas: the trace's peak, with room to grow by half
MAX_REPLICAS = 10_000  # the CRD's bound on min/maxReplicas
YAML_COMMENT_COLUMN = 28


@dataclass(frozen=True)
class Load:
    """The in-flight figures the verdict needs, from past the first requests' fill-up to the
    last arrival (the empty start and the drain after it are not traffic)."""

    low_tokens: float  # LOW_PERCENTILE of the KV tokens in flight
    peak_tokens: float
    peak_requests: int
    longest: int  # the longest prompt + output
    contexts: np.ndarray  # prompt + output of every request
    lifetimes: np.ndarray  # seconds each request is in flight
    held: np.ndarray  # KV tokens each holds over its life, on average
    # The max model length the in-flight figures admit at (None: every request).
    max_model_len: int | None = None

    def refused(self) -> int:
        """Requests the max model length turns away, left out of the in-flight figures."""
        return 0 if self.max_model_len is None else int((self.contexts > self.max_model_len).sum())

    def tokens_per_request(self, max_model_len: int | None = None) -> float:
        """KV tokens an in-flight request holds on average (Little's law: weighted by its
        lifetime), over the requests a max model length admits."""
        ok = self.contexts <= (max_model_len or self.longest)
        life = float(self.lifetimes[ok].sum())
        return float((self.lifetimes[ok] * self.held[ok]).sum()) / life if life > 0 else 0.0


@dataclass(frozen=True)
class Fit:
    """The pods one pod shape needs for the trace."""

    pod: str
    tokens_per_pod: int
    target_occupancy: float
    kv_dtype: str
    min_replicas: int
    peak_replicas: int
    max_replicas: int
    batch_replicas: int  # pods the engine's batch cap (maxNumSeqs) alone needs at the peak
    peak_replicas_fp8: int | None  # None when the KV is already 8-bit


@dataclass(frozen=True)
class Advice:
    """One line of the decision matrix."""

    topic: str
    decision: str
    why: str


@dataclass(frozen=True)
class Entry:
    """One suggested field, with the comment that says where its value comes from."""

    key: str
    value: int | float | str
    comment: str


def _admitted_in_flight(
    trace: Trace, ok: np.ndarray, decode_tps: float, prefill_tps: float
) -> tuple[np.ndarray, np.ndarray]:
    """`in_flight` of the requests `ok` marks, on the whole trace's seconds (a refused request
    holds no KV: the engine turns it away at the door)."""
    count, tokens = in_flight(trace, decode_tps, prefill_tps)
    if ok.all():
        return count, tokens
    kept = Trace(trace.name, trace.arrival[ok], trace.prompt[ok], trace.output[ok])
    c, k = in_flight(kept, decode_tps, prefill_tps) if ok.any() else (np.zeros(0), np.zeros(0))
    # Its arrivals are the trace's, so its seconds are too; it ends no later than the trace.
    return np.pad(c, (0, len(count) - len(c))), np.pad(k, (0, len(tokens) - len(k)))


def load(
    trace: Trace, decode_tps: float, prefill_tps: float, max_model_len: int | None = None
) -> Load:
    """The in-flight load of `trace` under the given service rates: the figures that size pods
    count only the requests `max_model_len` admits."""
    contexts = trace.prompt + trace.output
    ok = contexts <= max_model_len if max_model_len else np.ones(len(trace), dtype=bool)
    count, tokens = _admitted_in_flight(trace, ok, decode_tps, prefill_tps)
    life = trace.prompt / prefill_tps + trace.output / decode_tps
    warm = min(float(np.percentile(life, 99)), trace.duration / 4)
    t = np.arange(len(count), dtype=float)
    inside = (t >= warm) & (t <= max(trace.duration, warm))
    if not inside.any():
        # Arrivals within one second fall between two whole-second samples: keep those up to
        # the first after the last arrival, which holds every request that has not ended.
        inside = t <= math.ceil(trace.duration)
    c, k = count[inside], tokens[inside]
    return Load(
        low_tokens=float(np.percentile(k, LOW_PERCENTILE)),
        peak_tokens=float(k.max()),
        peak_requests=int(c.max()),
        longest=int(contexts.max()),
        contexts=contexts,
        lifetimes=life,
        held=trace.prompt + trace.output / 2,  # in_flight()'s measure of what a request holds
        max_model_len=max_model_len or None,
    )


def describe(p: Plan) -> str:
    """The pod in a few words: model, GPUs, parallelism, KV precision."""
    return f"{p.model} on {p.gpus_per_pod}x {p.gpu} (tp {p.tp}, {p.kv_dtype} KV)"


def pod_context(spec: InferenceDeploymentSpec, p: Plan) -> int:
    """The longest sequence one pod's KV pool holds: every block a sequence may take (vLLM
    keeps one as its null block)."""
    return max(0, p.kv_blocks_per_pod - plan_input(spec).reserved_blocks) * p.block_size


def _pods(tokens: float, per_pod: int, target: float) -> int:
    # As decide() counts them: a near-zero targetOccupancy asks for the most pods, not inf.
    return max(1, pods_holding(tokens, per_pod * target))


def fit(ld: Load, spec: InferenceDeploymentSpec, sizing: Sizing, target: float) -> Fit:
    """The pods of `spec`'s shape that hold the trace's in-flight KV at `target` occupancy."""
    p = sizing.plan
    per_pod = max(1, p.kv_tokens_per_pod)
    peak = _pods(ld.peak_tokens, per_pod, target)
    low = min(peak, _pods(ld.low_tokens, per_pod, target))
    fp8 = None
    if p.kv_dtype not in ("fp8", "int8"):
        alt = plan(plan_input(spec).model_copy(update={"kv_dtype": "fp8"}))
        fp8 = _pods(ld.peak_tokens, max(1, alt.kv_tokens_per_pod), target)
    return Fit(
        pod=describe(p),
        tokens_per_pod=per_pod,
        target_occupancy=target,
        kv_dtype=p.kv_dtype,
        min_replicas=min(MAX_REPLICAS, low),
        peak_replicas=peak,
        max_replicas=min(MAX_REPLICAS, max(low, math.ceil(GROWTH * peak))),
        batch_replicas=max(1, math.ceil(ld.peak_requests / spec.engine.max_num_seqs)),
        peak_replicas_fp8=fp8,
    )


def paging(
    ld: Load, block_size: int, max_model_len: int | None, model_limit: int | None = None
) -> Advice:
    """Paging, always: what a contiguous max-length reservation would waste on this trace (at
    the spec's engine.maxModelLen, else the longest request the model takes)."""
    if max_model_len:
        mml, source = max_model_len, "engine.maxModelLen"
    elif model_limit is not None and model_limit < ld.longest:
        mml, source = model_limit, "the model's limit"
    else:
        mml, source = ld.longest, "the longest request"
    reserves = (
        f"a contiguous cache reserves the max model length ({mml:,} tokens, {source}) for "
        "every sequence"
    )
    held = ld.tokens_per_request(mml)
    if held <= 0:
        # Nothing admitted holds anything: there is no average to compare the reservation to.
        why = (
            f"{reserves}; at that length it admits none of these requests, so this trace cannot "
            "say how much of it would sit unused"
        )
        return Advice("paging", "always", why)
    gap = max(0.0, 1 - held / mml)
    return Advice(
        "paging",
        "always",
        f"{reserves}; those it admits hold {held:,.0f} tokens on average in flight, so "
        f"{gap:.0%} of it would sit reserved and unused. Paged {block_size}-token blocks "
        f"waste at most {block_size - 1} tokens a sequence "
        f"({min(1.0, (block_size - 1) / held):.1%})",
    )


def prefix_caching(profile: Profile) -> Advice:
    """Prefix caching when the trace's prompts really overlap."""
    hit = profile.ideal_hit_ratio
    if hit is None:
        return Advice(
            "prefix caching",
            "unknown",
            "the trace carries no block hashes, so its prompts' overlap cannot be measured: "
            "size with traffic.prefixHitRatio 0, and read headroom_prefix_cache_hit_ratio once "
            "it serves (the HeadroomPrefixCacheIneffective alert says when it buys little)",
        )
    if hit >= PREFIX_WORTHWHILE:
        return Advice(
            "prefix caching",
            "on (engine.prefixCaching: true)",
            f"an unlimited cache would find {hit:.0%} of prompt tokens already cached (at or "
            f"above {PREFIX_WORTHWHILE:.0%}, where it pays); a real one finds less, as its size "
            "and evictions allow",
        )
    return Advice(
        "prefix caching",
        "buys little",
        f"an unlimited cache would find only {hit:.1%} of prompt tokens already cached (below "
        f"{PREFIX_WORTHWHILE:.0%}): do not count on it when sizing",
    )


def quantization(f: Fit | None) -> Advice:
    """KV quantization only if the deployment is still memory-bound, after validation."""
    validate = (
        "`headroom kv-check` has compared it with the full-precision cache on your own "
        "long-context prompts"
    )
    if f is None:
        return Advice(
            "KV quantization",
            "not sized",
            "whether the KV still binds depends on the pod: pass --model and --gpu, or --spec. "
            f"If it does after paging and prefix caching, turn on fp8 KV only after {validate}",
        )
    if f.peak_replicas_fp8 is None:
        return Advice(
            "KV quantization",
            f"already {f.kv_dtype}",
            f"keep it only if {validate}",
        )
    if f.peak_replicas <= 1:
        return Advice(
            "KV quantization",
            "not needed",
            f"one pod of {f.pod} holds the peak in-flight KV at {f.target_occupancy:.0%} "
            "occupancy: the KV does not bind, and quantizing it would only cost accuracy",
        )
    if f.batch_replicas >= f.peak_replicas:
        return Advice(
            "KV quantization",
            "buys nothing",
            f"the batch cap (engine.maxNumSeqs) needs {f.batch_replicas} pods at the peak, as "
            f"many as the KV does ({f.peak_replicas}): a smaller KV would not remove a pod",
        )
    return Advice(
        "KV quantization",
        "only after validation",
        f"still memory-bound: the peak in-flight KV needs {f.peak_replicas} pods of {f.pod}, "
        f"fp8 KV would need {f.peak_replicas_fp8}. Set engine.kvCacheDtype: fp8 only after "
        f"{validate}",
    )


def verdict(
    profile: Profile,
    ld: Load,
    f: Fit | None,
    block_size: int,
    max_model_len: int | None,
    model_limit: int | None = None,
) -> tuple[Advice, ...]:
    """The decision matrix, in the order a person acts on it."""
    return (
        paging(ld, block_size, max_model_len, model_limit),
        prefix_caching(profile),
        quantization(f),
    )


def suggest(
    profile: Profile,
    f: Fit | None,
    scaling: ScalingSpec,
    from_spec: bool,
    context_cap: int | None = None,
) -> dict[str, tuple[Entry, ...]]:
    """spec.traffic and spec.scaling for the trace (min/max replicas only with a pod).
    `context_cap`: the longest context the engine takes (the spec's maxModelLen, else the
    model's): a contextTokens above it is a spec the CRD or the sizing refuses."""
    hit = profile.ideal_hit_ratio
    context = max(1, math.ceil(profile.context[95]))
    context_entry = Entry("contextTokens", context, "p95 of prompt + output tokens")
    if context_cap is not None and context > context_cap:
        context_entry = Entry(
            "contextTokens",
            context_cap,
            f"p95 of prompt + output is {context:,}: capped at the engine's max length "
            f"{context_cap:,} (longer requests are refused)",
        )
    traffic = [
        Entry(
            "peakConcurrency",
            max(1, math.ceil(profile.concurrency[99])),
            "p99 of requests in flight, rounded up",
        ),
        context_entry,
    ]
    shared = profile.shared_in_flight
    if hit is None or shared is None:
        traffic.append(Entry("prefixHitRatio", 0.0, "unknown: the trace has no block hashes"))
    else:
        # The sizing stores this share of each sequence once for all in flight: only blocks
        # requests in flight hold together save memory. A hit on a block of a request that
        # has finished saves its prefill, and then the block is held again like any other.
        low = SHARED_PERCENTILES[0]
        traffic.append(
            Entry(
                "prefixHitRatio",
                min(0.99, math.floor(shared[low] * 100 + 1e-9) / 100),
                f"p{low} of the KV requests in flight share (the {hit:.0%} ideal hit ratio "
                "saves prefill, not memory)",
            )
        )
    whose = "your spec's" if from_spec else "the CRD default"
    rows: list[Entry] = []
    if f is not None:
        rows += [
            Entry(
                "minReplicas",
                f.min_replicas,
                f"p{LOW_PERCENTILE} of in-flight KV: the quiet hours",
            ),
            Entry(
                "maxReplicas",
                f.max_replicas,
                f"the peak needs {f.peak_replicas}; room to grow by {GROWTH - 1:.0%}",
            ),
        ]
    rows += [
        Entry(
            "targetOccupancy",
            scaling.target_occupancy,
            f"{whose}: KV share the forecast demand may fill",
        ),
        Entry(
            "forecastQuantile",
            scaling.forecast_quantile,
            f"{whose}: forecast band sized for; `headroom simulate` tunes it",
        ),
    ]
    if from_spec:
        # Pasted, this block replaces the spec's whole scaling section: what it leaves out
        # would fall back to the CRD defaults, which the fields it keeps may contradict
        # (targetOccupancy 0.96 needs the spec's scaleOutOccupancy above it).
        shown = {e.key for e in rows}
        for name, field in ScalingSpec.model_fields.items():
            key = field.alias or name
            value = getattr(scaling, name)
            if name in scaling.model_fields_set and key not in shown and value is not None:
                rows.append(Entry(key, value, "your spec's"))
    return {"traffic": tuple(traffic), "scaling": tuple(rows)}


def wire(suggestion: dict[str, tuple[Entry, ...]]) -> dict[str, dict[str, int | float | str]]:
    """The suggestion as the spec's fields."""
    return {section: {e.key: e.value for e in rows} for section, rows in suggestion.items()}


def maxlen_note(
    ld: Load,
    max_model_len: int,
    explicit: bool,
    model_limit: int | None = None,
    pod_limit: int | None = None,
) -> str | None:
    """What the max model length refuses of this trace, if anything (`explicit`: the spec sets
    engine.maxModelLen, else it defaults to traffic.contextTokens; `model_limit`: the model's
    max_position_embeddings, `pod_limit`: the longest sequence the pod's KV holds, when the pod
    is known): a maxModelLen it advises is one the sizing accepts."""
    refused = int((ld.contexts > max_model_len).sum())
    if not refused:
        return None
    what = (
        f"engine.maxModelLen {max_model_len:,}"
        if explicit
        else f"engine.maxModelLen (it defaults to traffic.contextTokens, {max_model_len:,})"
    )
    share = refused / len(ld.contexts)
    note = (
        f"{what} refuses {refused:,} of these requests ({share:.1%}, up to {ld.longest:,} tokens)"
    )
    limits = [(n, why) for n, why in ((model_limit, "model"), (pod_limit, "pod")) if n is not None]
    if not limits or ld.longest <= min(n for n, _ in limits):
        return f"{note}: set engine.maxModelLen: {ld.longest} to serve them"
    cap, why = min(limits, key=lambda x: x[0])
    if max_model_len >= cap:
        if why == "model":
            return f"{note}: the model takes at most {cap:,} tokens"
        return f"{note}: this pod's KV holds at most {cap:,} tokens a sequence"
    source = "the model's limit" if why == "model" else "the most this pod's KV holds"
    beyond = int((ld.contexts > cap).sum())
    return f"{note}: engine.maxModelLen: {cap} ({source}) would serve all but {beyond:,}"


def _scalar(value: int | float | str) -> str:
    """A value as YAML reads it back exactly: a float in full (0.99999 rounded to 1.0 is a
    targetOccupancy the CRD refuses), a word plain, anything else quoted."""
    if isinstance(value, str):
        return value if re.fullmatch(r"[a-z][A-Za-z0-9-]*", value) else json.dumps(value)
    return str(value) if isinstance(value, int) else repr(float(value))


def to_yaml(suggestion: dict[str, tuple[Entry, ...]], notes: list[str]) -> str:
    """The suggestion as YAML to paste under `spec:`, each value with its comment."""
    lines = ["# spec.traffic and spec.scaling: paste under spec: of your InferenceDeployment"]
    for n in notes:
        lines += textwrap.wrap(n, 96, initial_indent="# ", subsequent_indent="#   ")
    for section, rows in suggestion.items():
        lines.append(f"{section}:")
        for e in rows:
            text = f"  {e.key}: {_scalar(e.value)}"
            lines.append(f"{text:<{YAML_COMMENT_COLUMN}} # {e.comment}")
    return "\n".join(lines) + "\n"
