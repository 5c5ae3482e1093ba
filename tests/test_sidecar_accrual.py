"""vLLM's and SGLang's arrivals (departed + in flight, a level) kept as a counter across polls."""

from __future__ import annotations

from dataclasses import replace

import pytest
from synthetic_engine import SyntheticEngine

from headroom.sidecar.accrual import ArrivalCounter
from headroom.sidecar.sources import EngineReading, parse_headroom_stats
from headroom.sidecar.vllm_source import parse_vllm_metrics


def _vllm(departed: int, running: int, waiting: int, start: float | None = None) -> EngineReading:
    """What parse_vllm_metrics reads from a server with these counts."""
    text = (
        "vllm:kv_cache_usage_perc 0.5\n"
        f'vllm:request_success_total{{finished_reason="stop"}} {departed}\n'
        f"vllm:num_requests_running {running}\nvllm:num_requests_waiting {waiting}\n"
    )
    if start is not None:
        text += f"process_start_time_seconds {start}\n"
    return parse_vllm_metrics(text)


@pytest.mark.parametrize(
    ("polls", "counted"),
    [
        # (departed, running, waiting) per poll -> the arrivals counter after each
        ([(0, 0, 0), (0, 3, 1), (2, 2, 1), (5, 0, 0)], [0, 4, 5, 5]),
        # a client abort: one request leaves uncounted (running 3 -> 2, no departure); the
        # counter holds instead of falling, then counts the next arrival
        ([(0, 3, 0), (0, 2, 0), (0, 3, 0)], [3, 3, 4]),
        # an abort and an arrival in the same interval hide each other
        ([(10, 4, 0), (10, 4, 0)], [14, 14]),
        # a server that restarted (fewer departures): counting starts again from its level
        ([(50, 2, 0), (1, 1, 0), (2, 1, 0)], [52, 2, 3]),
    ],
)
def test_arrivals_count_the_rises_of_departed_plus_in_flight(
    polls: list[tuple[int, int, int]], counted: list[float]
) -> None:
    arrivals = ArrivalCounter()
    assert [arrivals.apply(_vllm(*poll)).requests_arrived_total for poll in polls] == counted


def test_a_new_instance_id_restarts_the_count() -> None:
    arrivals = ArrivalCounter()
    assert arrivals.apply(_vllm(100, 5, 0, start=1.0)).requests_arrived_total == 105
    # new process, same departures by coincidence: still a restart
    assert arrivals.apply(_vllm(100, 0, 0, start=2.0)).requests_arrived_total == 100


def test_headroom_counts_its_own_arrivals_and_passes_through() -> None:
    eng = SyntheticEngine(capacity=10)
    eng.requests_arrived_total, eng.requests_finished_total = 7, 3
    arrivals = ArrivalCounter()
    reading = parse_headroom_stats(eng.body())
    assert arrivals.apply(reading) is reading
    lower = replace(reading, requests_arrived_total=2.0)  # the engine's word, even if it falls
    assert arrivals.apply(lower).requests_arrived_total == 2.0


def test_a_source_without_arrivals_is_left_as_it_is() -> None:
    reading = parse_vllm_metrics("vllm:kv_cache_usage_perc 0.5\n")
    assert reading.requests_arrived_total is None
    assert ArrivalCounter().apply(reading) is reading


def test_a_fall_under_the_same_instance_id_is_held_not_a_restart() -> None:
    """With an instance id on every reading, only a new id restarts the count: an abort's fall
    under the same id is held, and only the next rise is counted."""
    arrivals = ArrivalCounter()
    counted = [arrivals.apply(_vllm(10, r, 0, start=1.0)).requests_arrived_total for r in (3, 2, 3)]
    assert counted == [13, 13, 14]
