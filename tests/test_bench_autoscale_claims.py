"""The autoscaling bench's grading: frontiers, serving settings and the claims' verdicts."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from bench.autoscale.frontier import (
    FLOOR,
    Point,
    Run,
    at,
    cheapest_serving,
    cost_claim,
    floor_cost,
    frontier,
    frontier_claim,
    oracle_claim,
    points,
)
from bench.autoscale.traces import BenchTrace, spec
from headroom.operator.simulate.replay import shape_for
from headroom.operator.simulate.sweep import realize
from headroom.operator.simulate.trace import read_trace


def _point(policy: str, target: float, cost: float, seconds: list[float]) -> Point:
    runs = tuple(
        Run(
            limited_seconds=s,
            saturated_seconds=0.0,
            queued_seconds=s,
            preemptions=0,
            gpu_hours=cost,
            actions=1,
            peak_replicas=2,
            rejected=0,
            pod_starts=1,
            cancelled_starts=0,
            trace="t",
            policy=policy,
            target=target,
            seed=i,
        )
        for i, s in enumerate(seconds)
    )
    return Point(policy, target, runs)


def test_serving_needs_the_median_and_the_worst_seed_under_their_bounds() -> None:
    assert _point("h", 0.5, 1.0, [0, 10, 30]).serves
    assert not _point("h", 0.5, 1.0, [0, 31, 31]).serves  # median 31 s
    assert not _point("h", 0.5, 1.0, [0, 0, 121]).serves  # one seed at 121 s
    pts = [_point("h", 0.9, 1.0, [40]), _point("h", 0.7, 2.0, [5]), _point("h", 0.5, 3.0, [0])]
    best = cheapest_serving(pts)
    assert best is not None and best.target == 0.7


def test_the_frontier_keeps_only_settings_that_beat_every_cheaper_one() -> None:
    pts = [
        _point("h", 0.9, 1.0, [100]),
        _point("h", 0.8, 2.0, [150]),  # dearer and worse: off the frontier
        _point("h", 0.7, 3.0, [10]),
    ]
    assert [p.target for p in frontier(pts)] == [0.9, 0.7]
    assert at(frontier(pts), 0.5) == math.inf
    assert at(frontier(pts), 2.5) == 100


def test_cost_claim_compares_cheapest_serving_settings_and_names_the_oracles_reach() -> None:
    head = [_point("headroom", 0.8, 8.0, [0]), _point("headroom", 0.5, 6.0, [50])]
    hpa = [_point("hpa", 0.7, 10.0, [0])]
    ok = cost_claim(head, hpa, "hpa")
    assert ok.ok and "0.80x" in ok.text
    dear = cost_claim([_point("headroom", 0.8, 9.0, [0])], hpa, "hpa")
    assert not dear.ok and "0.90x" in dear.text
    oracle = [_point("oracle", 0.9, 8.8, [0]), _point("oracle", 0.99, 7.0, [200])]
    with_oracle = cost_claim([_point("headroom", 0.8, 9.0, [0])], hpa, "hpa", oracle)
    assert not with_oracle.ok  # context never changes a verdict
    assert "oracle's cheapest serving setting is 0.88x" in with_oracle.text
    assert "even its foresight does not reach" in with_oracle.text
    reachable = cost_claim(head, hpa, "hpa", [_point("oracle", 0.9, 7.0, [0])])
    assert "0.70x" in reachable.text and "does not reach" not in reachable.text


def test_cost_claim_without_a_serving_headroom_setting_is_a_miss() -> None:
    c = cost_claim([_point("headroom", 0.5, 1.0, [40])], [], "hpa")
    assert not c.ok and "no serving setting" in c.text
    c = cost_claim([_point("headroom", 0.5, 1.0, [0])], [_point("hpa", 0.5, 1.0, [900])], "hpa")
    assert c.ok and "has none" in c.text


def test_frontier_claim_misses_where_the_hpa_is_cheaper_and_under_the_ceiling() -> None:
    head = [_point("headroom", 0.5, 5.0, [0])]
    cheap_hpa = [_point("hpa", 0.9, 4.0, [300]), _point("hpa", 0.5, 6.0, [100])]
    c = frontier_claim(head, cheap_hpa, "hpa")
    assert not c.ok and "above at 4.00 GPU-h" in c.text
    over_ceiling = [_point("hpa", 0.9, 4.0, [900]), _point("hpa", 0.5, 6.0, [100])]
    c = frontier_claim(head, over_ceiling, "hpa")
    assert c.ok and "100% below" in c.text


def test_a_frontier_with_nothing_to_beat_is_printed_not_graded() -> None:
    # A trace that never fills its pods: every HPA setting has 0 s, so no frontier can be 30 %
    # below it; matching it is reported, not scored as a miss (nor as a pass).
    idle_hpa = [_point("hpa", 0.9, 1.0, [0]), _point("hpa", 0.5, 2.0, [0])]
    c = frontier_claim([_point("headroom", 0.5, 1.0, [0])], idle_hpa, "hpa")
    assert c.ok and not c.graded and "nothing to be below" in c.text
    # headroom losing seconds where the idle HPA loses none is still a graded miss.
    c = frontier_claim([_point("headroom", 0.5, 1.0, [50])], idle_hpa, "hpa")
    assert not c.ok and c.graded and "above at 1.00 GPU-h" in c.text
    # An HPA with seconds to beat keeps the claim graded.
    c = frontier_claim([_point("headroom", 0.5, 1.0, [0])], [_point("hpa", 0.9, 1.0, [9])], "hpa")
    assert c.ok and c.graded


def test_cost_claim_names_the_clairvoyant_floor_and_says_when_the_bound_is_below_it() -> None:
    head = [_point("headroom", 0.8, 9.0, [0])]
    hpa = [_point("hpa", 0.7, 10.0, [0])]
    reachable = cost_claim(head, hpa, "hpa", floor=6.0)
    assert "clairvoyant floor is 0.600x" in reachable.text
    assert "below even that" not in reachable.text
    beyond = cost_claim(head, hpa, "hpa", floor=8.6)
    assert "clairvoyant floor is 0.860x: the bound is below even that" in beyond.text
    # Just under the bound: printed as itself, not rounded up to it.
    near = cost_claim(head, hpa, "hpa", floor=8.46)
    assert "clairvoyant floor is 0.846x" in near.text and "below even that" not in near.text
    assert not beyond.ok  # context never changes a verdict
    assert "floor" not in cost_claim(head, hpa, "hpa").text
    assert floor_cost([_point(FLOOR, 0.0, 5.0, [30, 30, 30])]) == 5.0 and floor_cost([]) is None
    # A seed whose traffic needs more than max replicas has no floor, so the trace has none.
    unbounded = Point(FLOOR, 0.0, (*_point(FLOOR, 0.0, 5.0, [30]).runs,
                                   *_point(FLOOR, 0.0, math.inf, [30]).runs))  # fmt: skip
    assert floor_cost([unbounded]) is None


def test_the_cli_replays_the_bench_s_realization_of_a_recorded_trace(tmp_path: Path) -> None:
    # `headroom simulate` recommends from the seeded realizations the bench grades on: the same
    # copies of each request, moved by the same jitter, for the same seed and rate.
    path = tmp_path / "t.csv"
    rows = "".join(f"{i * 0.7:.1f},{100 + i},{20 + i % 7}\n" for i in range(200))
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + rows)
    bench = BenchTrace("t", spec("l4-24gb", 4096, 64, 2048), str(path), rate=2.0)
    (run,) = realize(read_trace(path), shape_for(bench.spec), (3,), rate=2.0)
    want = bench.requests(3)
    assert run.trace.arrival.tolist() == want.arrival.tolist()
    assert run.trace.prompt.tolist() == want.prompt.tolist()


def test_points_are_one_policy_on_one_trace_grouped_by_target() -> None:
    a, b = _point("h", 0.7, 1.0, [5, 6]).runs
    other_trace = replace(a, trace="u")
    other_policy = replace(a, policy="hpa")
    c = replace(a, target=0.5, seed=9)
    pts = points([b, other_trace, c, other_policy, a], "t", "h")
    assert [p.target for p in pts] == [0.5, 0.7]
    assert pts[0].runs == (c,) and set(pts[1].runs) == {a, b}


def test_serving_bounds_are_inclusive_at_30_s_median_and_120_s_worst() -> None:
    assert _point("h", 0.5, 1.0, [0, 30, 120]).serves


def test_a_dearer_setting_that_only_ties_a_cheaper_one_is_off_the_frontier() -> None:
    pts = [_point("h", 0.9, 1.0, [100]), _point("h", 0.8, 2.0, [100])]
    assert [p.target for p in frontier(pts)] == [0.9]


def test_cost_claim_at_exactly_the_bound_passes_and_nothing_is_said_to_fall_short() -> None:
    # 0.85 is "<= 0.85x": the bound, the oracle's reach and the floor all at exactly 8.5 / 10.
    head, hpa = [_point("headroom", 0.8, 8.5, [0])], [_point("hpa", 0.7, 10.0, [0])]
    c = cost_claim(head, hpa, "hpa", [_point("oracle", 0.9, 8.5, [0])], floor=8.5)
    assert c.ok and "0.85x (<= 0.85x)" in c.text
    assert "does not reach" not in c.text and "below even that" not in c.text


def test_oracle_claim_compares_with_the_oracle_s_cheapest_zero_second_setting() -> None:
    # A cheaper oracle setting that loses 5 s is not the yardstick while one with 0 s exists.
    oracle = [
        _point("oracle", 0.9, 8.0, [5]),
        _point("oracle", 0.7, 10.0, [0, 0]),
        _point("oracle", 0.5, 12.0, [0]),
    ]
    c = oracle_claim([_point("headroom", 0.8, 12.5, [0])], oracle)
    assert c.ok and "cheapest 0 s 10.00" in c.text and "1.25x" in c.text
    assert not oracle_claim([_point("headroom", 0.8, 12.6, [0])], oracle).ok
    # A 0 s setting means 0 s on every seed: one seed short and it is not one.
    short = [_point("oracle", 0.9, 8.0, [0, 0, 5]), _point("oracle", 0.7, 10.0, [0])]
    assert "cheapest 0 s 10.00" in oracle_claim([_point("headroom", 0.8, 9.0, [0])], short).text


def test_oracle_claim_falls_back_to_the_oracle_s_cheapest_serving_setting() -> None:
    oracle = [_point("oracle", 0.99, 6.0, [50]), _point("oracle", 0.9, 8.0, [5])]
    c = oracle_claim([_point("headroom", 0.8, 10.0, [0])], oracle)
    assert c.ok and "serving (no 0 s setting) 8.00" in c.text
    c = oracle_claim([_point("headroom", 0.8, 10.0, [40])], oracle)
    assert not c.ok and "headroom has no serving setting" in c.text
    c = oracle_claim([_point("headroom", 0.8, 10.0, [0])], [_point("oracle", 0.9, 5.0, [200])])
    assert not c.ok and "no oracle point" in c.text


def test_frontier_claim_ignores_hpa_settings_at_exactly_the_600_s_ceiling() -> None:
    head = [_point("headroom", 0.5, 5.0, [0])]
    hpa = [_point("hpa", 0.9, 4.0, [600]), _point("hpa", 0.5, 6.0, [100])]
    assert frontier_claim(head, hpa, "hpa").ok


def test_frontier_claim_counts_matching_the_hpa_as_at_or_below_it() -> None:
    head = [_point("headroom", 0.5, 1.0, [10]), _point("headroom", 0.4, 2.0, [0])]
    hpa = [_point("hpa", 0.9, 1.0, [10]), _point("hpa", 0.5, 2.0, [5])]
    c = frontier_claim(head, hpa, "hpa")
    assert c.ok and "at or below" in c.text


def test_frontier_claim_needs_at_least_30_percent_below_somewhere() -> None:
    hpa = [_point("hpa", 0.5, 1.0, [10])]
    c = frontier_claim([_point("headroom", 0.5, 1.0, [7])], hpa, "hpa")
    assert c.ok and "30% below at 1.00 GPU-h" in c.text
    assert not frontier_claim([_point("headroom", 0.5, 1.0, [7.1])], hpa, "hpa").ok
    # The gap is named at the cheapest cost where it is largest; an HPA 1 s short still counts.
    hpa = [_point("hpa", 0.5, 1.0, [1]), _point("hpa", 0.4, 2.0, [0.5])]
    c = frontier_claim([_point("headroom", 0.5, 1.0, [0])], hpa, "hpa")
    assert c.ok and "100% below at 1.00 GPU-h" in c.text
