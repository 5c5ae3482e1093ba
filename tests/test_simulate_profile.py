"""`profile()` and the verdict on traces whose answers are known: requests in flight by Little's
law, burstiness by construction, and a suggested spec the operator's models accept."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import yaml

from headroom.operator.crd.models import InferenceDeploymentSpec, ScalingSpec
from headroom.operator.reconcile.sizing import parse
from headroom.operator.simulate import verdict
from headroom.operator.simulate.profile import (
    PREFIX_WORTHWHILE,
    Burstiness,
    burstiness,
    ideal_hit_ratio,
    in_flight,
    profile,
    shared_in_flight,
)
from headroom.operator.simulate.render import profile_text
from headroom.operator.simulate.trace import Trace, scaled

PROMPT, OUTPUT = 1000, 198  # at 10,000 and 20 tokens/s: 0.1 s of prefill + 9.9 s of decode
LIFETIME = 10.0
HELD = PROMPT + OUTPUT / 2  # what in_flight() counts a request as holding


def steady(rate: float = 2.0, seconds: float = 7200.0, prompt: int = PROMPT) -> Trace:
    """Exactly `rate` requests a second, off the whole seconds the profile samples at."""
    n = int(seconds * rate)
    t = 0.25 + np.arange(n) / rate
    return Trace("steady", t - t[0], np.full(n, prompt), np.full(n, OUTPUT))


def spec(gpu: str = "l4-24gb", **engine: object) -> InferenceDeploymentSpec:
    parsed = parse(
        {
            "model": {"preset": "llama-3.1-8b"},
            "gpu": {"type": gpu},
            "traffic": {"peakConcurrency": 64, "contextTokens": 2048},
            "engine": engine,
        }
    )
    assert parsed.spec is not None, parsed.error
    return parsed.spec


def test_requests_in_flight_at_2_per_second_for_10_seconds_are_littles_20() -> None:
    p = profile(steady(), decode_tps=20.0, prefill_tps=10_000.0)
    assert all(p.concurrency[q] == 2.0 * LIFETIME for q in (50, 90, 95, 99))
    assert p.kv_tokens[50] == pytest.approx(2.0 * LIFETIME * HELD)
    assert p.rate == pytest.approx(2.0, rel=1e-3)


def test_poisson_arrivals_average_littles_law_in_flight() -> None:
    rng = np.random.default_rng(7)
    n = 20_000
    t = np.cumsum(rng.exponential(1 / 3.0, n))
    out = rng.integers(20, 400, n)
    trace = Trace("poisson", t - t[0], np.full(n, 500), out)
    count, _ = in_flight(trace, decode_tps=20.0, prefill_tps=10_000.0)
    mean_life = float(np.mean(500 / 10_000 + out / 20.0))
    inside = count[100 : int(trace.duration) - 100]
    assert inside.mean() == pytest.approx(3.0 * mean_life, rel=0.03)


def test_even_arrivals_are_not_bursty_and_a_partial_last_window_is_no_burst() -> None:
    trace = steady(rate=2.0, seconds=130.0)  # 60 s windows: two whole ones and 10 s over
    for window in (1.0, 10.0, 60.0):
        b = burstiness(trace, window)
        assert b.dispersion == pytest.approx(0.0) and b.peak_to_mean == pytest.approx(1.0)


def test_bursts_raise_dispersion_and_peak_to_mean() -> None:
    quiet = np.arange(0, 600, 1.0)
    burst = 300 + np.arange(0, 10, 0.1)  # 100 extra requests in 10 s
    t = np.sort(np.concatenate([quiet, burst]))
    b = burstiness(Trace("burst", t, np.full(len(t), 10), np.full(len(t), 10)), 10.0)
    assert b.dispersion > 5 and b.peak_to_mean == pytest.approx(110 / (700 / 60), rel=0.01)


def test_paging_is_always_advised_with_the_gap_a_contiguous_cache_would_waste() -> None:
    ld = verdict.load(steady(), 20.0, 10_000.0)
    a = verdict.paging(ld, 16, 8192)
    assert a.decision == "always"
    assert f"{1 - HELD / 8192:.0%} of it would sit reserved" in a.why
    assert "at most 15 tokens a sequence" in a.why


@pytest.mark.parametrize(
    ("hit", "decision"),
    [
        (None, "unknown"),
        (PREFIX_WORTHWHILE - 0.01, "buys little"),
        (PREFIX_WORTHWHILE, "on (engine.prefixCaching: true)"),
        (0.65, "on (engine.prefixCaching: true)"),
    ],
)
def test_prefix_caching_is_advised_only_when_overlap_is_real(
    hit: float | None, decision: str
) -> None:
    p = replace(profile(steady(seconds=60.0)), ideal_hit_ratio=hit)
    assert verdict.prefix_caching(p).decision == decision


def test_kv_quantization_without_a_pod_says_to_size_it_and_to_validate_with_kv_check() -> None:
    a = verdict.quantization(None)
    assert a.decision == "not sized" and "headroom kv-check" in a.why and "--spec" in a.why


def test_a_trace_one_pod_holds_needs_no_kv_quantization() -> None:
    s = spec("h100-80gb")
    sized = parse(s.model_dump(by_alias=True)).sizing
    assert sized is not None
    f = verdict.fit(verdict.load(steady(), 20.0, 10_000.0), s, sized, 0.85)
    assert f.peak_replicas == 1 and f.min_replicas == 1
    assert verdict.quantization(f).decision == "not needed"


def test_a_memory_bound_trace_gets_kv_quantization_only_after_kv_check() -> None:
    s = spec("l4-24gb")
    sized = parse(s.model_dump(by_alias=True)).sizing
    assert sized is not None
    ld = verdict.load(steady(rate=8.0, seconds=1800.0), 20.0, 10_000.0)
    f = verdict.fit(ld, s, sized, 0.85)
    per_pod = sized.plan.kv_tokens_per_pod
    assert f.peak_replicas == math.ceil(8.0 * LIFETIME * HELD / (per_pod * 0.85))
    assert f.peak_replicas_fp8 is not None and f.peak_replicas_fp8 < f.peak_replicas
    a = verdict.quantization(f)
    assert a.decision == "only after validation"
    assert "headroom kv-check" in a.why and f"fp8 KV would need {f.peak_replicas_fp8}" in a.why


def test_a_pod_already_on_fp8_kv_is_told_to_keep_it_only_if_kv_check_passed() -> None:
    s = spec("l4-24gb", kvCacheDtype="fp8")
    sized = parse(s.model_dump(by_alias=True)).sizing
    assert sized is not None
    f = verdict.fit(verdict.load(steady(rate=8.0, seconds=600.0), 20.0, 10_000.0), s, sized, 0.85)
    a = verdict.quantization(f)
    assert a.decision == "already fp8" and "headroom kv-check" in a.why


def test_the_suggested_spec_parses_as_yaml_and_validates_against_the_operator_models() -> None:
    trace = steady(rate=8.0, seconds=1800.0)
    p = replace(profile(trace), ideal_hit_ratio=0.4567, shared_in_flight={10: 0.29, 50: 0.4})
    s = spec("l4-24gb")
    sized = parse(s.model_dump(by_alias=True)).sizing
    assert sized is not None
    f = verdict.fit(verdict.load(trace, 20.0, 10_000.0), s, sized, 0.85)
    text = verdict.to_yaml(verdict.suggest(p, f, ScalingSpec(), False), ["a note"])
    doc = yaml.safe_load(text)
    assert doc["traffic"] == {
        "peakConcurrency": math.ceil(p.concurrency[99]),
        "contextTokens": PROMPT + OUTPUT,
        "prefixHitRatio": 0.29,  # p10 of what is shared in flight (0.29 * 100 is 28.999...)
    }
    assert doc["scaling"]["minReplicas"] == f.min_replicas
    assert doc["scaling"]["maxReplicas"] == f.max_replicas >= f.peak_replicas
    assert doc["scaling"]["targetOccupancy"] == ScalingSpec().target_occupancy
    assert doc["scaling"]["forecastQuantile"] == ScalingSpec().forecast_quantile
    full = InferenceDeploymentSpec.model_validate(
        {"model": {"preset": "llama-3.1-8b"}, "gpu": {"type": "l4-24gb"}, **doc}
    )
    assert full.traffic.prefix_hit_ratio == 0.29
    assert "the 46% ideal hit ratio saves prefill, not memory" in text


def test_without_a_pod_the_suggestion_leaves_replicas_out_and_still_validates() -> None:
    p = replace(profile(steady(seconds=600.0)), ideal_hit_ratio=0.9999,
                shared_in_flight={10: 0.9999})  # fmt: skip
    doc = yaml.safe_load(verdict.to_yaml(verdict.suggest(p, None, ScalingSpec(), False), []))
    assert "minReplicas" not in doc["scaling"] and "maxReplicas" not in doc["scaling"]
    assert doc["traffic"]["prefixHitRatio"] == 0.99  # the CRD takes < 1
    InferenceDeploymentSpec.model_validate(
        {"model": {"preset": "llama-3.1-8b"}, "gpu": {"type": "h100-80gb"}, **doc}
    )


def test_the_max_model_length_note_counts_the_requests_it_refuses() -> None:
    trace = steady(seconds=100.0)
    long = Trace(
        "mixed", trace.arrival, np.where(np.arange(len(trace)) % 4 == 0, 9000, PROMPT), trace.output
    )
    ld = verdict.load(long, 20.0, 10_000.0)
    note = verdict.maxlen_note(ld, 4096, explicit=False)
    assert note is not None and f"refuses {len(trace) // 4:,} of these requests" in note
    assert f"set engine.maxModelLen: {9000 + OUTPUT}" in note
    assert verdict.maxlen_note(ld, 9000 + OUTPUT, explicit=True) is None
    capped = verdict.maxlen_note(ld, 4096, explicit=True, model_limit=8192)
    assert capped is not None and "the model's limit" in capped


def test_the_in_flight_max_is_of_the_same_series_as_its_percentiles() -> None:
    # 100 requests at once at the opening, then a trickle: the table's max is not below p99.
    arrival = np.concatenate([np.zeros(100), np.arange(1.0, 600.0)])
    n = len(arrival)
    trace = Trace("burst", arrival, np.full(n, 100), np.full(n, 400))
    p = profile(trace)
    assert p.concurrency_max >= p.concurrency[99]
    assert p.kv_tokens_max >= p.kv_tokens[99]


def test_a_trace_within_one_second_keeps_a_sample_for_its_load() -> None:
    # Both arrivals fall between the whole-second samples past the fill-up: the load keeps the
    # samples up to the first after the last arrival instead of none.
    trace = Trace("blink", np.array([0.0, 0.5]), np.full(2, 100), np.full(2, 10))
    ld = verdict.load(trace, 20.0, 10_000.0)
    assert ld.peak_requests == 1 and ld.peak_tokens == pytest.approx(105.0)
    assert 0 < ld.low_tokens <= ld.peak_tokens


def test_a_trace_at_one_instant_has_no_rate() -> None:
    trace = Trace("once", np.zeros(3), np.full(3, 100), np.full(3, 10))
    p = profile(trace)
    assert p.duration == 0.0 and p.rate is None
    assert profile(steady(seconds=60.0)).rate == pytest.approx(2.0, rel=0.02)


def test_the_ideal_hit_ratio_of_a_scaled_trace_is_the_recorded_trace_s() -> None:
    # Every prompt distinct: nothing to hit. Copies of it at x3 repeat each prompt three times.
    n = 300
    blocks = tuple((2 * i, 2 * i + 1) for i in range(n))
    trace = Trace("distinct", np.arange(n, dtype=float), np.full(n, 1024), np.full(n, 10), blocks)
    copies = scaled(trace, 3.0, seed=1, jitter_seconds=5.0)
    assert ideal_hit_ratio(trace) == 0.0 and ideal_hit_ratio(copies) == pytest.approx(2 / 3)
    assert profile(copies, recorded=trace).ideal_hit_ratio == 0.0


def _blocks(trace: Trace, ids: list[tuple[int, ...]]) -> Trace:
    return Trace(trace.name, trace.arrival, trace.prompt, trace.output, tuple(ids))


def test_a_system_prompt_every_request_in_flight_holds_is_shared_in_flight() -> None:
    # 20 in flight, each 1,000-token prompt two blocks (512 + 488 tokens): the first the same
    # for all, held once for the 20.
    trace = steady(seconds=600.0)
    shared = shared_in_flight(_blocks(trace, [(0, 1 + i) for i in range(len(trace))]), 20, 1e4)
    assert shared is not None
    n = 2.0 * LIFETIME
    assert np.median(shared) == pytest.approx((n - 1) * 512 / (n * HELD))


def test_a_conversation_s_earlier_turns_are_hits_but_not_shared_in_flight() -> None:
    # Two conversations side by side, each turn repeating its whole history 20 s after the last
    # (done 10 s after it started): every block but the new one is a hit, none is shared.
    turns = 30
    arrival = np.repeat(np.arange(turns) * 20.0, 2) + np.tile([0.25, 0.5], turns)
    ids = [tuple(range(c * 1000, c * 1000 + t + 1)) for t in range(turns) for c in (0, 1)]
    prompt = np.array([512 * len(b) for b in ids])
    trace = Trace("chat", arrival, prompt, np.full(len(ids), OUTPUT), tuple(ids))
    assert ideal_hit_ratio(trace) > 0.9
    shared = shared_in_flight(trace, 20, 1e4)
    assert shared is not None and len(shared) > 0 and shared.max() == 0.0
    p = profile(trace)
    doc = yaml.safe_load(verdict.to_yaml(verdict.suggest(p, None, ScalingSpec(), False), []))
    assert doc["traffic"]["prefixHitRatio"] == 0.0  # the sizing stores it once for all in flight


def test_a_scaled_trace_s_copies_do_not_share_in_flight_what_the_recorded_trace_does_not() -> None:
    n = 300
    blocks = tuple((2 * i, 2 * i + 1) for i in range(n))
    trace = Trace("distinct", np.arange(n, dtype=float), np.full(n, 1024), np.full(n, 10), blocks)
    copies = scaled(trace, 3.0, seed=1, jitter_seconds=5.0)
    assert profile(copies, recorded=trace).shared_in_flight == dict.fromkeys((10, 50, 90), 0.0)


def test_a_spec_s_scaling_fields_come_with_the_block_that_replaces_its_scaling() -> None:
    # Pasted, the block replaces the section: without the spec's scaleOutOccupancy the CRD's
    # default 0.95 is below the kept targetOccupancy, and 0.99999 must not print as 1.0.
    scaling = ScalingSpec.model_validate(
        {
            "targetOccupancy": 0.99999,
            "scaleOutOccupancy": 1.0,
            "mode": "advisory",
            "intervalSeconds": 30,
        }
    )
    p = profile(steady(seconds=600.0))
    doc = yaml.safe_load(verdict.to_yaml(verdict.suggest(p, None, scaling, True), []))
    assert doc["scaling"] == {
        "targetOccupancy": 0.99999,
        "forecastQuantile": 0.95,
        "mode": "advisory",
        "scaleOutOccupancy": 1.0,
        "intervalSeconds": 30,
    }
    ScalingSpec.model_validate(doc["scaling"], strict=True)


def test_burstiness_needs_ten_whole_windows_and_a_short_trace_reads_in_seconds() -> None:
    # 90 of 100 requests in the first 5 s of 100: one 60 s window would read as regular (0.00).
    arrival = np.sort(np.concatenate([np.linspace(0, 5, 90), np.linspace(5, 100, 10)]))
    trace = Trace("front", arrival, np.full(100, 100), np.full(100, 10))
    assert [b.window for b in profile(trace).burstiness] == [1.0, 10.0]
    blink = Trace("blink", np.array([0.0, 1.5]), np.full(2, 100), np.full(2, 10))
    text = profile_text(blink, 1.0, profile(blink), verdict.load(blink, 20, 1e4), None, (), "")
    assert "over 1.5 s" in text


def test_pods_are_sized_for_the_requests_the_max_model_length_admits() -> None:
    # Every fourth request is 9,000-token long: a max model length of 4,096 refuses them, and a
    # refused request holds no KV, so the pods are those of the others alone.
    trace = steady(rate=8.0, seconds=1800.0)
    long = np.where(np.arange(len(trace)) % 4 == 0, 9000, PROMPT)
    mixed = Trace("mixed", trace.arrival, long, trace.output)
    ok = long + OUTPUT <= 4096
    admitted = Trace("admitted", trace.arrival[ok], long[ok], trace.output[ok])
    s = spec("l4-24gb")
    sized = parse(s.model_dump(by_alias=True)).sizing
    assert sized is not None
    ld = verdict.load(mixed, 20.0, 10_000.0, 4096)
    want = verdict.fit(verdict.load(admitted, 20.0, 10_000.0), s, sized, 0.85)
    got = verdict.fit(ld, s, sized, 0.85)
    assert (
        got.peak_replicas
        == want.peak_replicas
        < verdict.fit(verdict.load(mixed, 20.0, 10_000.0), s, sized, 0.85).peak_replicas
    )
    assert (got.min_replicas, got.max_replicas) == (want.min_replicas, want.max_replicas)
    assert ld.refused() == len(trace) - int(ok.sum())
    # The note still counts what it refuses, and the paging advice its own admitted ones.
    note = verdict.maxlen_note(ld, 4096, explicit=True)
    assert note is not None and f"refuses {ld.refused():,} of these requests" in note
    text = profile_text(mixed, 1.0, profile(mixed), ld, got, (), "")
    assert "the in-flight KV of the requests engine.maxModelLen 4,096 admits needs" in text


def test_a_trace_the_max_model_length_refuses_whole_needs_one_pod() -> None:
    trace = steady(seconds=60.0, prompt=9000)
    s = spec("h100-80gb")
    sized = parse(s.model_dump(by_alias=True)).sizing
    assert sized is not None
    f = verdict.fit(verdict.load(trace, 20.0, 10_000.0, 4096), s, sized, 0.85)
    assert (f.min_replicas, f.peak_replicas, f.batch_replicas) == (1, 1, 1)


def test_the_max_model_length_note_advises_no_length_the_pod_cannot_hold() -> None:
    trace = steady(seconds=100.0)
    lengths = np.where(np.arange(len(trace)) % 4 == 0, 60_000, PROMPT)
    ld = verdict.load(Trace("mixed", trace.arrival, lengths, trace.output), 20.0, 10_000.0)
    # The model takes 131,072 tokens, the pod's KV 25,904: the advice stops at the pod's.
    note = verdict.maxlen_note(ld, 4096, explicit=False, model_limit=131_072, pod_limit=25_904)
    assert note is not None and "engine.maxModelLen: 25904 (the most this pod's KV holds)" in note
    assert "60198" not in note
    full = verdict.maxlen_note(ld, 25_904, explicit=True, model_limit=131_072, pod_limit=25_904)
    assert full is not None and full.endswith(
        "this pod's KV holds at most 25,904 tokens a sequence"
    )
    roomy = verdict.maxlen_note(ld, 4096, explicit=False, model_limit=131_072, pod_limit=447_280)
    assert roomy is not None and roomy.endswith("set engine.maxModelLen: 60198 to serve them")


def test_the_pod_context_is_the_longest_sequence_the_sizing_accepts() -> None:
    base = {"model": {"preset": "llama-3.1-8b", "path": "/m"}, "gpu": {"type": "l4-24gb"}}
    # vLLM keeps one block of the pool for itself: the longest sequence is a block shorter.
    for engine in ({}, {"runtime": "vllm", "blockSize": 32}):
        first = parse(
            {**base, "engine": engine, "traffic": {"peakConcurrency": 1, "contextTokens": 1000}}
        )
        assert first.spec is not None and first.sizing is not None
        most = verdict.pod_context(first.spec, first.sizing.plan)
        for context, feasible in ((most, True), (most + 1, False)):
            traffic = {"peakConcurrency": 1, "contextTokens": context}
            sized = parse({**base, "engine": engine, "traffic": traffic}).sizing
            assert sized is not None and sized.feasible is feasible, (engine, context)


def test_profile_columns_are_as_wide_as_their_widest_number() -> None:
    # 2,000 requests of 9,000,000 tokens in flight together: tens of billions of KV tokens.
    n = 2000
    trace = Trace("huge", np.linspace(0, 30, n), np.full(n, 9_000_000), np.full(n, 1000))
    p = profile(trace)
    text = profile_text(trace, 1.0, p, verdict.load(trace, 20.0, 10_000.0), None, (), "")
    rows = {line[:18].strip(): line[18:].split() for line in text.splitlines()[:12]}
    assert len(rows["KV tokens"]) == 5 and len(rows["prompt + output"]) == 4, rows
    assert rows["KV tokens"][-1] == f"{p.kv_tokens_max:,.0f}"
    header, kv = (line for line in text.splitlines() if line.startswith(("in flight", "KV tok")))
    assert len(header) == len(kv)  # the header's labels stay over their columns


def _five() -> Trace:
    """Five requests whose every figure is worked out by hand below (512-token blocks: request
    0 holds blocks 1 (512) and 2 (488), request 1 blocks 1 and 3 (88), request 2 blocks 4-7,
    request 3 block 4 again, request 4 none)."""
    return Trace(
        "five",
        np.array([0.0, 0.5, 1.2, 3.0, 3.1]),
        np.array([1000, 600, 2000, 512, 300]),
        np.array([40, 20, 100, 10, 60]),
        ((1, 2), (1, 3), (4, 5, 6, 7), (4,), ()),
    )


def test_a_five_request_trace_s_in_flight_series_is_the_one_worked_out_by_hand() -> None:
    # Ends at 2.1, 1.56, 6.4, 3.5512 and 6.13 s; each holds prompt + output / 2 (1020, 610,
    # 2050, 517, 330). Sampled at whole seconds until two past the last end.
    count, tokens = in_flight(_five(), decode_tps=20.0, prefill_tps=10_000.0)
    assert count.tolist() == [1, 2, 2, 2, 2, 2, 2, 0, 0]
    assert tokens.tolist() == pytest.approx([1020, 1630, 3070, 2567, 2380, 2380, 2380, 0, 0])
    # Every other second at a step of 2 s: the same instants, the same requests.
    count2, tokens2 = in_flight(_five(), 20.0, 10_000.0, step=2.0)
    assert count2.tolist() == [1, 2, 2, 2, 0, 0]
    assert tokens2.tolist() == pytest.approx([1020, 3070, 2380, 2380, 0, 0])
    # Requests over within their second (at 0.2 and 2.7 s) still end two samples past the last.
    quick = Trace("quick", np.array([0.0, 2.5]), np.full(2, 100), np.full(2, 2))
    assert in_flight(quick, 20.0, 10_000.0)[0].tolist() == [1, 0, 0, 0, 0]


def test_a_five_request_trace_s_profile_is_the_one_worked_out_by_hand() -> None:
    p = profile(_five())
    assert (p.decode_tps, p.prefill_tps) == (20.0, 10_000.0)  # the CLI's defaults
    assert (p.requests, p.duration, p.rate) == (5, 3.1, pytest.approx(5 / 3.1))
    assert p.concurrency == dict.fromkeys((50, 90, 95, 99), 2.0) and p.concurrency_max == 2
    # Tokens sorted: 0, 0, 1020, 1630, 2380 x3, 2567, 3070; p90 is 2567 + 0.2 x 503.
    assert p.kv_tokens[50] == 2380.0 and p.kv_tokens[90] == pytest.approx(2667.6)
    assert p.kv_tokens_max == 3070.0
    assert p.prompt[50] == 600.0 and p.prompt[90] == pytest.approx(1600.0)
    assert p.output[50] == 40.0 and p.context[95] == pytest.approx(1888.0)
    # Hits: block 1 (512 tokens) for request 1, block 4 (512) for request 3; of 4,412 tokens.
    assert p.ideal_hit_ratio == pytest.approx(1024 / 4412)
    assert p.burstiness == ()  # 3.1 s: not ten whole windows of any size


def test_a_five_request_trace_s_shared_in_flight_is_the_one_worked_out_by_hand() -> None:
    # Seconds 1-6 have two in flight: at 1 requests 0 and 1 share block 1 (512 of 1,630
    # tokens), at 3 requests 2 and 3 share block 4 (512 of 2,567); the others share nothing.
    shared = shared_in_flight(_five(), 20.0, 10_000.0)
    assert shared is not None
    assert shared.tolist() == pytest.approx([512 / 1630, 0, 512 / 2567, 0, 0, 0])
    two = shared_in_flight(_five(), 20.0, 10_000.0, step=2.0)  # seconds 2, 4 and 6
    assert two is not None and two.tolist() == [0, 0, 0]
    p = profile(_five())
    # Sorted 0 x4, 512 / 2567, 512 / 1630: p10 and p50 are 0, p90 halfway between the two.
    assert p.shared_in_flight == {
        10: 0.0,
        50: 0.0,
        90: pytest.approx((512 / 2567 + 512 / 1630) / 2),
    }


def test_burstiness_of_counts_worked_out_by_hand_leaves_out_the_partial_last_window() -> None:
    # Ten whole 1 s windows hold 3, 0, 1, 0, 2, 0, 0, 4, 0, 0 arrivals (mean 1, variance 2);
    # the arrival at 10.5 s is in a partial eleventh window, left out.
    arrival = np.array([0.0, 0.3, 0.6, 2.5, 4.1, 4.9, 7.0, 7.2, 7.4, 7.99, 10.5])
    trace = Trace("hand", arrival, np.full(11, 10), np.full(11, 10))
    one = burstiness(trace, 1.0)
    assert (one.window, one.dispersion, one.peak_to_mean) == (1.0, 2.0, 4.0)
    # Five whole 2 s windows hold 3, 1, 2, 4, 0 (mean 2, variance 2).
    two = burstiness(trace, 2.0)
    assert (two.dispersion, two.peak_to_mean) == (pytest.approx(1.0), 2.0)
    # A window longer than the trace: the one partial window is all there is (even, 10 in it).
    assert burstiness(trace, 20.0) == Burstiness(20.0, 0.0, 1.0)
    assert profile(trace).burstiness == (one,)  # 10.5 s: ten whole 1 s windows, not 10 s ones
    # The README's three windows, 60 s from ten minutes on.
    assert [b.window for b in profile(steady(seconds=601.0)).burstiness] == [1.0, 10.0, 60.0]


@pytest.mark.parametrize(("hit", "decision"), [(0.099, "buys little"), (0.10, "on")])
def test_prefix_caching_pays_from_the_10_percent_ideal_hit_ratio_the_readme_documents(
    hit: float, decision: str
) -> None:
    p = replace(profile(steady(seconds=60.0)), ideal_hit_ratio=hit)
    advice = verdict.prefix_caching(p)
    assert advice.decision.startswith(decision) and "10%" in advice.why


def test_an_empty_trace_profiles_as_zeros_not_an_error() -> None:
    # The readers refuse an empty file, but profile() and burstiness() guard for none: no NaN.
    empty = Trace("none", np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    p = profile(empty)
    assert (p.requests, p.rate, p.concurrency_max, p.kv_tokens_max) == (0, None, 0, 0.0)
    assert p.concurrency == dict.fromkeys((50, 90, 95, 99), 0.0)
    assert p.prompt == p.output == p.context == dict.fromkeys((50, 90, 95, 99), 0.0)
    assert burstiness(empty, 1.0) == Burstiness(1.0, 0.0, 0.0)


def test_a_repeated_partial_last_block_hits_and_is_shared_with_its_own_tokens_only() -> None:
    # Three 600-token prompts, blocks 512 + 88, the same all: the second and third find all 600
    # cached; the third, alone in flight from 5 s, shares nothing (and its seconds are not counted).
    arrival = np.array([0.0, 0.5, 5.0])
    same = Trace("same", arrival, np.full(3, 600), np.full(3, 40), ((1, 2),) * 3)
    assert ideal_hit_ratio(same) == pytest.approx(1200 / 1800)
    shared = shared_in_flight(same, 20.0, 10_000.0)  # at 1 and 2 s, two hold 620 tokens each
    assert shared is not None and shared.tolist() == pytest.approx([600 / 1240] * 2)
    one = Trace("one", np.zeros(1), np.full(1, 100), np.full(1, 1), ((9,),))
    assert ideal_hit_ratio(one) == 0.0  # one block id, never seen before: no hit, not unknown


def test_a_trace_within_one_second_has_a_rate() -> None:
    # Only a trace at one instant has none, not one shorter than a second.
    blink = Trace("blink", np.array([0.0, 0.5]), np.full(2, 100), np.full(2, 10))
    assert profile(blink).rate is not None
