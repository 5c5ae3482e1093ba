"""What `headroom profile` and `headroom simulate` print, on figures set by hand: the units a
duration is read in, the plural of a count, the mark on each setting's row, the advice where
nothing serves, the ratio to the clairvoyant floor and the note on refused requests."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from headroom.operator.crd.models import InferenceDeploymentSpec
from headroom.operator.reconcile.sizing import Sizing, parse
from headroom.operator.simulate import sweep as sweep_module
from headroom.operator.simulate import verdict
from headroom.operator.simulate.profile import profile
from headroom.operator.simulate.render import (
    profile_json,
    profile_text,
    reserve_lines,
    simulate_advice,
    simulate_header,
    simulate_json,
    simulate_table,
    trace_line,
)
from headroom.operator.simulate.replay import Result, policy_at, shape_for
from headroom.operator.simulate.sweep import (
    Realization,
    Reserve,
    Setting,
    reserve_limit,
    search_reserve,
    with_min_replicas,
)
from headroom.operator.simulate.trace import Trace
from headroom.operator.simulate.verdict import Advice

MAX_REPLICAS = 8


def deployment() -> tuple[InferenceDeploymentSpec, Sizing]:
    parsed = parse(
        {
            "model": {"preset": "llama-3.1-8b"},
            "gpu": {"type": "l4-24gb"},
            "traffic": {"peakConcurrency": 64, "contextTokens": 2048},
            "scaling": {"minReplicas": 1, "maxReplicas": MAX_REPLICAS},
        }
    )
    assert parsed.spec is not None and parsed.sizing is not None, parsed.error
    return parsed.spec, parsed.sizing


def setting(
    q: float,
    limited: list[float],
    gpu_hours: float = 1.0,
    peak: int = 2,
    refused: tuple[int, ...] | None = None,
    min_replicas: int | None = None,
) -> Setting:
    """One setting of `len(limited)` seeds, each seed KV-limited for the seconds given (of the
    spec held at `min_replicas` when given)."""
    spec, sizing = deployment()
    spec = spec if min_replicas is None else with_min_replicas(spec, min_replicas)
    n = len(limited)
    results = tuple(Result(s, 0.0, s, 0, gpu_hours, 1, peak, 0, 2, 0) for s in limited)
    return Setting(
        q, policy_at(spec, q, sizing), tuple(range(1, n + 1)), results, refused or (0,) * n
    )


def spaced(n: int, seconds: float) -> Trace:
    """`n` requests evenly over `seconds`."""
    return Trace("even", np.linspace(0.0, seconds, n), np.full(n, 100), np.full(n, 10))


def joined(lines: list[str]) -> str:
    """The lines as one line of words: the advice wraps at 100 columns."""
    return " ".join(" ".join(lines).split())


# ------------------------------------------------------------------------------- the trace line


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0.5, "0.5 s"),
        (89.5, "89.5 s"),
        (90.0, "1.5 min"),
        (5399.0, "90.0 min"),
        (5400.0, "1.5 h"),
        (1_800_000.0, "500.0 h"),
    ],
)
def test_a_duration_is_seconds_below_90_minutes_below_90_and_hours_from_there(
    seconds: float, shown: str
) -> None:
    """Each unit takes over at 90 of the one below: never `0.0 h` for a short trace."""
    assert f"over {shown}, " in trace_line(spaced(10, seconds))


def test_the_trace_line_counts_in_the_singular_and_gives_the_mean_rate() -> None:
    """One request reads `1 request`, a trace over 100 s its requests per second."""
    one = Trace("one", np.zeros(1), np.full(1, 100), np.full(1, 10))
    assert trace_line(one) == "one: 1 request, all at one instant"
    assert trace_line(spaced(1001, 100.0)) == "even: 1,001 requests over 1.7 min, 10.01 requests/s"


# ----------------------------------------------------------------------------- headroom profile


def test_the_profile_names_a_rate_other_than_1_and_the_ratio_of_the_trace_as_recorded() -> None:
    """At --rate 2 the first line says so and the hit ratio is of the trace as recorded; at 1
    neither is said. The wrapped paragraphs start at their columns."""
    n = 400
    blocks = tuple((i % 4, 100 + i) for i in range(n))
    trace = Trace("t", np.linspace(0.0, 200.0, n), np.full(n, 1024), np.full(n, 50), blocks, 512)
    p = profile(trace)
    ld = verdict.load(trace, 20.0, 10_000.0)
    at_1 = profile_text(trace, 1.0, p, ld, None, (), "")
    at_2 = profile_text(trace, 2.0, p, ld, None, (), "")
    assert "x2 its recorded rate" in at_2.splitlines()[0] and "recorded" not in at_1
    assert "upper bound, of the trace as recorded)" in " ".join(at_2.split())
    # Wrapped beside their label: text from column 18, the verdict's from 19.
    assert "\nprefix overlap    ideal hit ratio " in at_1
    assert "\n" + " " * 18 + "shared in flight: p10 " in at_1
    advice = (Advice("paging", "on", "a reason"),)
    assert "\nverdict\n  paging           on: a reason\n" in profile_text(
        trace, 1.0, p, ld, None, advice, ""
    )


def test_profile_tables_give_labels_18_columns_and_figures_10_aligned_right() -> None:
    """The layout a reader scans down: 18 columns of label, then figures right-aligned in 10
    (12 for the arrivals), and the note on dispersion beside its first two rows only."""
    trace = spaced(3000, 3000.0)
    p = profile(trace)
    ld = verdict.load(trace, 20.0, 10_000.0)
    lines = profile_text(trace, 1.0, p, ld, None, (), "").splitlines()
    assert lines[3:5] == [
        "in flight                p50       p90       p95       p99       max",
        "requests                   1         1         1         1         1",
    ]
    assert lines[12:16] == [
        "arrivals            dispersion   peak/mean   (dispersion: variance / mean of the",
        "per 1 s                   0.00        1.00    arrivals per window, 1 for Poisson)",
        "per 10 s                  0.00        1.00",
        "per 60 s                  0.00        1.00",
    ]


def test_profile_json_has_the_admitted_figures_and_the_pod_only_when_sized() -> None:
    """The JSON carries the load's refused count and the fit only where a pod was sized."""
    trace = Trace("t", np.linspace(0.0, 100.0, 50), np.full(50, 3000), np.full(50, 10))
    ld = verdict.load(trace, 20.0, 10_000.0, 2048)
    out = profile_json(profile(trace), ld, None, (), {"traffic": {}}, "yaml")
    assert out["refused_requests"] == 50 and out["max_model_len"] == 2048
    assert "pod" not in out and out["spec_yaml"] == "yaml"


# ---------------------------------------------------------------------------- headroom simulate


def test_the_header_counts_the_seeds_and_gives_the_replica_range() -> None:
    """What was replayed, on what, under which policy, in paragraphs a reader can scan."""
    spec, sizing = deployment()
    lines = simulate_header(spaced(10, 60.0), 2.0, (1,), "pod", shape_for(spec, sizing),
                            setting(0.9, [0.0]))  # fmt: skip
    text = joined(lines)
    # Four paragraphs labelled in 8 columns, each wrapped line's text starting at column 8.
    assert [line[:8] for line in lines if not line.startswith(" ")] == [
        "trace   ",
        "pod     ",
        "policy  ",
        "serves  ",
    ]
    assert all(line[8] != " " for line in lines)
    assert "replayed at x2 its rate; 1 seed, each request" in text
    assert f"(replicas 1-{MAX_REPLICAS})" in text


def test_the_table_marks_the_pick_and_the_settings_that_miss() -> None:
    """One row a setting, figures right-aligned in 10 columns (medians of the seeds, `worst s`
    the worst seed's): the pick reads `<- pick`, a setting that serves but costs more nothing,
    one that misses `(misses)`."""
    miss, pick = setting(0.6, [40.0, 40.0, 100.0]), setting(0.8, [0.0])
    dear = setting(0.95, [0.0], 2.0)
    table = simulate_table([miss, pick, dear], pick)
    head, *rows = table[:4]
    assert head == (
        "quantile       GPU-h limited s   worst s    full s  queued s peak pods    starts "
        "cancelled   refused"
    )
    assert rows == [
        "0.60            1.00        40       100         0        40         2         2         0"
        "         0  (misses)",
        "0.80            1.00         0         0         0         0         2         2         0"
        "         0  <- pick",
        "0.95            2.00         0         0         0         0         2         2         0"
        "         0",
    ]
    assert table[4].startswith("medians of the seeds.")  # the key, wrapped at 100 columns
    assert max(len(line) for line in table[4:]) <= 100


def test_nothing_serves_at_the_replica_cap_says_raise_it() -> None:
    """The highest quantile's worst seed at exactly maxReplicas is capped: the advice is to
    raise it; one pod short of it, to try higher quantiles."""
    capped = simulate_advice([setting(0.6, [99.0]), setting(0.9, [99.0], peak=MAX_REPLICAS)], None)
    assert f"reached scaling.maxReplicas ({MAX_REPLICAS}): raise it" in joined(capped)
    short = simulate_advice([setting(0.9, [99.0], peak=MAX_REPLICAS - 1)], None)
    assert "no setting serves: try higher quantiles" in joined(short)


def test_a_standing_reserve_that_serves_is_what_to_deploy_and_priced_against_the_floor() -> None:
    """Nothing serves at the spec's minReplicas, and the reserve search found one that does:
    the advice names its minReplicas and quantile, and the floor prices that pick."""
    base = [setting(0.6, [99.0], peak=4), setting(0.9, [60.0], peak=4)]
    tried = (
        Reserve(2, (setting(0.6, [80.0], min_replicas=2), setting(0.9, [45.0], min_replicas=2))),
        Reserve(3, (setting(0.6, [50.0], min_replicas=3),
                    setting(0.9, [10.0], gpu_hours=3.0, min_replicas=3))),
    )  # fmt: skip
    text = joined(simulate_advice(base, None, (1.5, 1.5), tried))
    assert "no setting serves with minReplicas 1, and one does with a standing reserve" in text
    assert "with minReplicas 3, forecastQuantile 0.90, the cheapest setting that serves" in text
    assert "set scaling.minReplicas: 3, forecastQuantile: 0.9," in text
    assert "the pick costs 2.00x that (a floor at minReplicas 1: it knows every request" in text
    lines = reserve_lines(tried)
    assert "with minReplicas 2 (a standing reserve): no setting serves" in lines
    assert "with minReplicas 3 (a standing reserve): serves" in lines
    assert [line.split()[0] for line in lines if line.endswith("<- pick")] == ["0.90"]
    assert not any(line.startswith("medians of the seeds") for line in lines)


def test_a_reserve_search_that_found_none_says_how_far_it_went() -> None:
    """Every reserve up to the limit tried and none serves: the advice says up to which, and
    does not suggest a reserve again."""
    base = [setting(0.9, [99.0], peak=3)]
    tried = (Reserve(2, (setting(0.9, [70.0], min_replicas=2),)),
             Reserve(3, (setting(0.9, [40.0], min_replicas=3),)))  # fmt: skip
    text = joined(simulate_advice(base, None, (), tried))
    assert "no setting serves: nor with minReplicas up to 3" in text
    assert "standing reserve" not in text and "the pick costs" not in text


def test_the_reserve_search_goes_up_to_the_most_pods_asked_for_and_not_at_the_cap() -> None:
    """The limit is the highest quantile's worst peak; at maxReplicas there is no search
    (minReplicas itself): more pods, not a reserve, are missing. A spec already at its
    maxReplicas, or whose quantiles never grew past minReplicas, has none either."""
    spec, _ = deployment()
    assert spec.scaling.min_replicas == 1 and spec.scaling.max_replicas == MAX_REPLICAS
    assert reserve_limit([setting(0.6, [99.0], peak=7), setting(0.9, [99.0], peak=5)], spec) == 5
    assert reserve_limit([setting(0.9, [99.0], peak=MAX_REPLICAS)], spec) == 1
    assert reserve_limit([setting(0.9, [99.0], peak=0)], spec) == 1
    three = with_min_replicas(spec, 3)
    assert reserve_limit([setting(0.9, [99.0], peak=2, min_replicas=3)], three) == 3
    full = with_min_replicas(spec, MAX_REPLICAS)
    low = setting(0.9, [99.0], peak=MAX_REPLICAS, min_replicas=MAX_REPLICAS)
    assert reserve_limit([low], full) == MAX_REPLICAS
    for n in (0, MAX_REPLICAS + 1):
        with pytest.raises(ValueError, match=f"minReplicas {n} is outside \\[1, {MAX_REPLICAS}\\]"):
            with_min_replicas(spec, n)


def stub_sweep(
    monkeypatch: pytest.MonkeyPatch, outcome: Callable[[int], Setting]
) -> list[tuple[int, list[int]]]:
    """The sweep replaced by one setting per reserve, `outcome(minReplicas)`; returns each
    call's (minReplicas, the realizations' opening pods)."""
    swept: list[tuple[int, list[int]]] = []

    def fake(
        runs: Sequence[Realization],
        held: InferenceDeploymentSpec,
        _sizing: Sizing,
        _quantiles: Sequence[float],
        _progress: object = None,
        label: str = "",
    ) -> tuple[Setting, ...]:
        n = held.scaling.min_replicas
        swept.append((n, [r.start for r in runs]))
        assert label == f"minReplicas {n}, "
        return (outcome(n),)

    monkeypatch.setattr(sweep_module, "sweep", fake)
    return swept


def test_the_reserve_search_goes_on_past_a_reserve_that_misses_and_stops_at_one_that_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """minReplicas 2 misses, 3 serves: 4 is never swept. Each sweep gets the spec at its
    minReplicas and realizations opening with at least that many pods."""
    spec, sizing = deployment()
    swept = stub_sweep(
        monkeypatch,
        lambda n: setting(0.9, [10.0 if n >= 3 else 99.0], peak=n + 1, min_replicas=n),
    )
    runs = [Realization(1, spaced(10, 60.0), 1), Realization(2, spaced(10, 60.0), 4)]
    got = search_reserve(runs, spec, sizing, (0.9,), limit=6)
    assert [r.min_replicas for r in got] == [2, 3] and got[-1].best is not None
    assert swept == [(2, [2, 4]), (3, [3, 4])]


def test_the_reserve_search_stops_where_a_reserve_reaches_max_replicas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reserve whose highest quantile asked for maxReplicas ends the search, and the advice
    is to raise maxReplicas, not to try higher quantiles."""
    spec, sizing = deployment()
    stub_sweep(
        monkeypatch,
        lambda n: setting(0.9, [99.0], peak=MAX_REPLICAS if n == 3 else 4, min_replicas=n),
    )
    got = search_reserve([Realization(1, spaced(10, 60.0), 1)], spec, sizing, (0.9,), limit=6)
    assert [r.min_replicas for r in got] == [2, 3] and got[-1].best is None
    text = joined(simulate_advice([setting(0.9, [99.0], peak=5)], None, (), got))
    assert "nor with minReplicas up to 3, where the highest quantile reached" in text
    assert f"scaling.maxReplicas ({MAX_REPLICAS}): raise it" in text


def test_the_advice_prices_the_pick_against_a_floor_above_zero_only() -> None:
    """The pick's GPU-hours over the floor's median, as `Nx that`; a floor of 0 gives no ratio
    and floors with an infinite seed give no floor line at all."""
    pick = setting(0.9, [0.0, 10.0], gpu_hours=3.0)
    lines = simulate_advice([pick], pick, (1.0, 2.0))
    assert [line[:8] for line in lines if not line.startswith(" ")] == ["deploy  ", "floor   "]
    assert all(line[8] != " " for line in lines)  # each wrapped line's text from column 8
    text = joined(lines)
    assert "deploy forecastQuantile 0.90, the cheapest setting that serves (3.00 GPU-hours" in text
    assert "floor 1.50 GPU-hours (median)" in text and "the pick costs 2.00x that" in text
    zero = joined(simulate_advice([pick], pick, (0.0, 0.0)))
    assert "floor 0.00 GPU-hours" in zero and "the pick costs" not in zero
    assert "floor" not in joined(simulate_advice([pick], pick, (1.0, math.inf)))


@pytest.mark.parametrize(
    ("refused", "note"),
    [
        ((0, 0), None),
        ((1, 0), "up to 1 request was refused at the door"),
        ((1, 2), "up to 2 requests were refused at the door"),
    ],
)
def test_the_note_gives_the_most_requests_any_seed_refused(
    refused: tuple[int, int], note: str | None
) -> None:
    """Over every setting and seed: the most any one refused, labelled `note`."""
    none = setting(0.6, [0.0, 0.0])
    lines = simulate_advice([none, setting(0.9, [0.0, 0.0], refused=refused), none], None)
    assert ("refused at the door" in joined(lines)) == (note is not None)
    assert note is None or f"note    {note}" in "\n".join(lines)


def test_simulate_json_has_every_run_and_a_null_for_a_seed_without_a_floor() -> None:
    """Each seed's run with its refused count; a seed with no floor is null, and so the median."""
    spec, sizing = deployment()
    s = setting(0.9, [0.0, 50.0], refused=(0, 3))
    out = simulate_json(spaced(10, 60.0), 1.0, "pod", shape_for(spec, sizing), [s], None,
                        (1.0, math.inf))  # fmt: skip
    (row,) = out["settings"]
    assert [(run["seed"], run["refused"]) for run in row["runs"]] == [(1, 0), (2, 3)]
    assert row["worst"]["limited_seconds"] == 50.0 and row["median"]["refused"] == 1.5
    assert out["cheapest_serving_quantile"] is None
    assert out["clairvoyant_floor"]["gpu_hours"] == [1.0, None]
    assert out["clairvoyant_floor"]["gpu_hours_median"] is None
