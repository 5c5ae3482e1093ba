"""The verdict's figures at their edges: the seconds the load is read over, the requests a max
model length admits at exactly its length, the replicas a quiet spell leaves, and the paging,
suggestion and YAML text a person reads; and the requests `headroom simulate`'s sweep counts
as refused, and the progress it reports."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import yaml
from test_simulate_profile import HELD, OUTPUT, PROMPT, spec, steady

from headroom.operator.crd.models import ScalingSpec
from headroom.operator.reconcile.sizing import parse
from headroom.operator.simulate import verdict
from headroom.operator.simulate.profile import profile
from headroom.operator.simulate.progress import Progress
from headroom.operator.simulate.replay import shape_for
from headroom.operator.simulate.sweep import realize, sweep
from headroom.operator.simulate.trace import Trace


def _with(trace: Trace, arrival: np.ndarray, output: np.ndarray | None = None) -> Trace:
    """`trace`'s requests at `arrival` (every one PROMPT tokens), with `output` if given."""
    n = len(arrival)
    out = np.full(n, OUTPUT) if output is None else output
    return Trace(trace.name, arrival, np.full(n, PROMPT), out)


def test_the_load_of_a_short_trace_starts_a_quarter_of_the_way_in() -> None:
    # 2 a second for 19.5 s, each 10 s long: the fill-up is capped at a quarter (4.875 s), so
    # seconds 5-19 count, in flight 11, 13, 15, 17, 19 then 20; their p5 is 11 + 0.7 x 2.
    ld = verdict.load(steady(seconds=20.0), 20.0, 10_000.0)
    assert ld.low_tokens == pytest.approx(12.4 * HELD)
    assert (ld.peak_requests, ld.peak_tokens) == (20, pytest.approx(20 * HELD))


def test_the_load_starts_past_the_p99_lifetime_not_the_longest_request_s() -> None:
    # 200 requests of 10 s, the first 20 s: the fill-up is the p99 (10 s), so seconds 10-19,
    # where the long one is in flight with 20 others, count.
    trace = steady(seconds=100.0)
    out = trace.output.copy()
    out[0] = 2 * OUTPUT + 2
    ld = verdict.load(_with(trace, trace.arrival, out), 20.0, 10_000.0)
    assert ld.peak_requests == 21


def test_the_load_counts_the_second_of_a_last_arrival_on_a_whole_second() -> None:
    # Five more requests at exactly 30 s, the last arrival: that second's sample holds them.
    trace = steady(seconds=30.0)
    arrival = np.concatenate([trace.arrival, np.full(5, 30.0)])
    ld = verdict.load(_with(trace, arrival), 20.0, 10_000.0)
    assert ld.peak_requests == 19 + 5


def test_a_request_exactly_the_max_model_length_is_admitted() -> None:
    # The engine refuses a request longer than maxModelLen, not one that fills it.
    trace = steady(seconds=60.0)
    ld = verdict.load(trace, 20.0, 10_000.0, PROMPT + OUTPUT)
    assert ld.refused() == 0
    assert ld.tokens_per_request(PROMPT + OUTPUT) == pytest.approx(HELD)
    assert verdict.maxlen_note(ld, PROMPT + OUTPUT, explicit=True) is None
    assert verdict.load(trace, 20.0, 10_000.0).refused() == 0  # no max length: none refused
    assert verdict.load(trace, 20.0, 10_000.0, PROMPT + OUTPUT - 1).refused() == len(trace)


def test_the_kv_a_request_holds_on_average_is_weighted_by_its_lifetime() -> None:
    # Little's law: a 10 s request holding 1,099 tokens and a 1.01 s one holding 110 average
    # (10 x 1,099 + 1.01 x 110) / 11.01 in flight, not their plain mean.
    trace = Trace("two", np.array([0.25, 0.5]), np.array([1000, 100]), np.array([198, 20]))
    ld = verdict.load(trace, 20.0, 10_000.0)
    assert ld.tokens_per_request() == pytest.approx((10 * 1099 + 1.01 * 110) / 11.01)
    # One request shorter than a second holds its own tokens, not nothing.
    quick = Trace("quick", np.zeros(1), np.array([100]), np.array([10]))
    assert verdict.load(quick, 20.0, 10_000.0).tokens_per_request() == pytest.approx(105.0)


def test_the_paging_advice_states_the_tokens_held_and_the_share_a_block_wastes() -> None:
    a = verdict.paging(verdict.load(steady(), 20.0, 10_000.0), 16, 8192)
    assert f"hold {HELD:,.0f} tokens on average" in a.why
    assert f"at most 15 tokens a sequence ({15 / HELD:.1%})" in a.why
    # Requests shorter than a block: the waste is all of what they hold, and no more.
    tiny = Trace("tiny", np.arange(10.0), np.full(10, 4), np.full(10, 2))
    b = verdict.paging(verdict.load(tiny, 20.0, 10_000.0), 16, 8192)
    assert "hold 5 tokens on average" in b.why and b.why.endswith("(100.0%)")


def test_the_paging_advice_claims_no_average_when_the_max_length_admits_nothing() -> None:
    """Every request longer than engine.maxModelLen: nothing is held, so the advice names no
    average and no waste (it said "hold 1 tokens", "100.0%")."""
    long = Trace("long", np.arange(100.0), np.full(100, 9000), np.full(100, 198))
    a = verdict.paging(verdict.load(long, 20.0, 10_000.0, 4096), 16, 4096)
    assert "admits none of these requests" in a.why
    assert "on average" not in a.why and "%" not in a.why and a.decision == "always"


def test_a_quiet_spell_keeps_min_replicas_below_the_peak_s() -> None:
    # 15 minutes at 8 a second (80 in flight, 4 L4 pods at 85%), then 15 at 0.5 (5 in flight):
    # minReplicas holds the quiet p5, maxReplicas the peak's 4 with room to grow by half.
    busy, quiet = steady(rate=8.0, seconds=900.0), steady(rate=0.5, seconds=900.0)
    trace = _with(busy, np.concatenate([busy.arrival, 900.0 + quiet.arrival]))
    s = spec("l4-24gb")
    sized = parse(s.model_dump(by_alias=True)).sizing
    assert sized is not None
    ld = verdict.load(trace, 20.0, 10_000.0)
    assert ld.low_tokens == pytest.approx(5 * HELD)
    f = verdict.fit(ld, s, sized, 0.85)
    assert (f.min_replicas, f.peak_replicas, f.max_replicas) == (1, 4, 6)


def test_an_empty_trace_suggests_the_crd_s_least_traffic() -> None:
    # No requests: one in flight and a one-token context, the least the CRD takes, not zero.
    empty = Trace("none", np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    doc = verdict.wire(verdict.suggest(profile(empty), None, ScalingSpec(), False))
    assert (doc["traffic"]["peakConcurrency"], doc["traffic"]["contextTokens"]) == (1, 1)


def test_a_context_at_the_engine_s_max_length_is_not_capped() -> None:
    p = profile(steady(seconds=600.0))
    at_cap = verdict.suggest(p, None, ScalingSpec(), False, context_cap=PROMPT + OUTPUT)
    assert at_cap["traffic"][1] == verdict.Entry(
        "contextTokens", PROMPT + OUTPUT, "p95 of prompt + output tokens"
    )
    below = verdict.suggest(p, None, ScalingSpec(), False, context_cap=PROMPT + OUTPUT - 1)
    assert (
        below["traffic"][1].value == PROMPT + OUTPUT - 1 and "capped" in below["traffic"][1].comment
    )


def test_the_yaml_s_comments_line_up_in_one_column() -> None:
    p = profile(steady(seconds=600.0))
    text = verdict.to_yaml(verdict.suggest(p, None, ScalingSpec(), False), [])
    rows = [line for line in text.splitlines() if line.startswith("  ")]
    assert rows and all(line.index(" # ") == 28 for line in rows)
    assert yaml.safe_load(text)["traffic"]["contextTokens"] == PROMPT + OUTPUT


def test_the_suggested_prefix_hit_ratio_is_rounded_down_to_the_percent() -> None:
    # Rounded up, the sizing would count on more sharing than the trace's p10 shows.
    p = replace(profile(steady(seconds=600.0)), ideal_hit_ratio=0.5, shared_in_flight={10: 0.456})
    doc = verdict.wire(verdict.suggest(p, None, ScalingSpec(), False))
    assert doc["traffic"]["prefixHitRatio"] == 0.45


def test_the_max_replicas_comment_names_the_half_it_leaves_to_grow() -> None:
    s = spec("h100-80gb")
    sized = parse(s.model_dump(by_alias=True)).sizing
    assert sized is not None
    f = verdict.fit(verdict.load(steady(), 20.0, 10_000.0), s, sized, 0.85)
    scaling = verdict.suggest(profile(steady()), f, ScalingSpec(), False)["scaling"]
    rows = {e.key: e for e in scaling}
    assert rows["maxReplicas"].comment == "the peak needs 1; room to grow by 50%"


def test_the_max_model_length_note_counts_a_request_exactly_at_the_cap_as_served() -> None:
    # Requests of 60,198 and of exactly 25,904 tokens: the pod's 25,904 serves all but the first.
    trace = steady(seconds=100.0)
    n = len(trace)
    lengths = np.where(np.arange(n) % 4 == 0, 60_000, PROMPT)
    lengths[1] = 25_904 - OUTPUT
    ld = verdict.load(Trace("mixed", trace.arrival, lengths, trace.output), 20.0, 10_000.0)
    note = verdict.maxlen_note(ld, 4096, explicit=False, model_limit=131_072, pod_limit=25_904)
    assert note is not None and f"refuses {n // 4 + 1:,} of these requests" in note
    assert note.endswith(f"(the most this pod's KV holds) would serve all but {n // 4:,}")


class _Seen(Progress):
    """A progress that keeps every update it is given."""

    def __init__(self, enabled: bool) -> None:
        super().__init__(enabled)
        self.updates: list[tuple[str, float, float]] = []

    def update(self, label: str, done: float, total: float) -> None:
        self.updates.append((label, done, total))


def test_the_sweep_refuses_requests_over_the_max_model_length_and_shows_each_replay() -> None:
    # 2,048 tokens is the engine's max model length: a request of 2,000 + 48 is served, one of
    # 2,000 + 100 refused, in every setting's count.
    s = spec("l4-24gb", maxModelLen=2048)
    sized = parse(s.model_dump(by_alias=True)).sizing
    assert sized is not None
    trace = steady(seconds=30.0)
    n = len(trace)
    output = np.full(n, 48)
    output[-1] = 100
    trace = Trace("edge", trace.arrival, np.full(n, 2000), output)
    runs = realize(trace, shape_for(s, sized), (1,), rate=1.0)
    seen = _Seen(enabled=False)
    (setting,) = sweep(runs, s, sized, (0.9,), seen)
    assert setting.refused == (1,)
    # Its progress runs to the realization's last arrival, under one label per replay.
    end = float(runs[0].trace.arrival[-1])
    assert {(label, total) for label, _, total in seen.updates} == {
        ("[1/1] forecastQuantile 0.90, seed 1", end)
    }
