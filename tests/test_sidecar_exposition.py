"""The Prometheus-text helpers under both stock sources: what a usage, a count and a rank are.

`vllm_source` and `sglang_source` are tested against whole expositions; these pin the
boundaries of the shared rules that no whole exposition happens to reach (an idle pool's 0, a
usage rounded past 1, a process id that must not decide which rank is read).
"""

from __future__ import annotations

import math

import pytest

from headroom.sidecar.exposition import (
    MAX_FRACTION,
    all_series,
    count,
    first_histogram,
    first_label_int,
    fraction,
    one_per_pool,
    prometheus_samples,
)
from headroom.sidecar.poller import parse_body
from headroom.sidecar.sources import GarbageError


@pytest.mark.parametrize(
    ("value", "read"),
    [(0.0, 0.0), (0.5, 0.5), (1.0, 1.0), (1.03, 1.0), (MAX_FRACTION, 1.0)],
)
def test_a_usage_from_empty_to_a_rounded_full_pool_is_a_fraction(value: float, read: float) -> None:
    """An idle pool's 0 is a usage; a little over 1 (an engine's rounding) is a full pool."""
    assert fraction(value, "usage") == read


@pytest.mark.parametrize("value", [-0.01, MAX_FRACTION + 0.01, 37.5, math.nan, math.inf])
def test_a_usage_below_zero_or_far_over_one_is_garbage(value: float) -> None:
    """A percent (37.5) read as a share of a pool would be a full pool, and buy pods."""
    with pytest.raises(GarbageError, match="not a fraction"):
        fraction(value, "usage")


def test_zero_is_a_count() -> None:
    """A pool of no tokens yet, or no requests: 0 is a count, as in `total`."""
    assert count(0.0, "tokens") == 0.0
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(GarbageError, match="not a non-negative number"):
            count(bad, "tokens")


def test_the_lowest_rank_is_read_whatever_its_process_id() -> None:
    """SGLang's multiprocess `pid` label orders ranks last: tp_rank 0 with a higher pid than
    tp_rank 1 is still the series read."""
    series = [
        ({"model_name": "m", "tp_rank": "1", "pid": "7"}, 0.9),
        ({"model_name": "m", "tp_rank": "0", "pid": "9"}, 0.4),
    ]
    assert one_per_pool(series) == [({"model_name": "m", "tp_rank": "0", "pid": "9"}, 0.4)]


@pytest.mark.parametrize("sum_line", ["lat_sum 0.0\n", ""])
def test_a_histogram_with_no_time_observed_has_a_zero_sum(sum_line: str) -> None:
    """No observations yet (or no `_sum` series at all): the sum is 0, not made up."""
    text = 'lat_bucket{le="0.1"} 0.0\nlat_bucket{le="+Inf"} 0.0\n' + sum_line
    h = first_histogram(prometheus_samples(text, "test"), ("lat",), all_series)
    assert h is not None and (h.bounds, h.counts, h.count, h.sum) == ((0.1,), (0.0,), 0.0, 0.0)


@pytest.mark.parametrize(
    "value", ["²", "٣", "1²", "9" * 5000], ids=["sup", "arabic", "mixed", "long"]
)
def test_a_label_of_other_digits_than_ascii_is_not_a_number(value: str) -> None:
    """`str.isdigit()` takes "²" (which `int()` refuses) and "٣", and `int()` refuses 5,000
    digits: a label value is a number only in a few ASCII digits, and any other is a name,
    never a crash the poller counts as its own bug."""
    assert first_label_int([({"block_size": value}, 1.0)], "block_size") is None
    pools = one_per_pool([({"tp_rank": value}, 2.0), ({"tp_rank": "1"}, 1.0)])
    assert [labels["tp_rank"] for labels, _ in pools] == ["1"]  # a number sorts first
    body = f'sglang:token_usage{{tp_rank="0"}} 0.5\nsglang:token_usage{{tp_rank="{value}"}} 0.5\n'
    assert parse_body("sglang", body.encode()).occupancy == 0.5
