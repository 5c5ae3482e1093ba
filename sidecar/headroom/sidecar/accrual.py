"""vLLM's and SGLang's arrivals as a counter, kept by the sidecar across its polls.

Neither server counts the requests that reach it. Their parsers read arrivals as departed + in
flight (running + waiting) at one instant: a level that is exact while every request that
leaves is counted as departed, and that falls when one leaves uncounted (vLLM does not count a
request its client aborts in `vllm:request_success_total`). A counter must not fall, so each
poll adds the level's rise and ignores a fall: a request lost that way costs its own arrival
(or the arrivals it hides within the same poll interval), never a reset. After an engine
restart (a new instance id; without ids, fewer departures than before) the counter starts again
from the new server's level. Fewer departures under the same id are a data-parallel rank's
series missing from the sum: the counter holds for up to `HOLD_POLLS` polls, so the rank's
return adds nothing, then counts on from the lower sum (`headroom.sidecar.monotonic`).
headroom's engine counts its arrivals itself; its readings pass through.

A sidecar that restarts while the server runs starts again from the level too: below what it
exported before by the requests lost that way, which neither server exports where a new sidecar
could read them. vLLM counts a client's abort in no series (vllm-project/vllm#55634 on 0.10.1,
#31503 on 0.13): its front end drops the request before the stats that feed
`vllm:request_success_total`, whose `finished_reason="abort"` series (read with the others)
stays at 0 for them. SGLang counts its aborts in `sglang:num_aborted_requests_total`, but its
arrivals are estimated in `state._sglang_demand`, not here. Prometheus reads such a fall as a
counter reset: the operator's Prometheus source leaves out a window's arrival rate where the
arrivals fell and the departures did not, and a decision that sees the counters fall gives the
pod no rate (`headroom.operator.scaling.decide`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from headroom.sidecar.monotonic import HOLD_POLLS
from headroom.sidecar.sources import EngineReading


@dataclass(slots=True)
class ArrivalCounter:
    """The arrivals counter of one sidecar's engine."""

    total: float | None = None
    _level: float | None = None
    _departed: float | None = None
    _instance_id: str | None = None
    _held_polls: int = 0

    def apply(self, reading: EngineReading) -> EngineReading:
        """`reading` with its arrivals level replaced by the counter."""
        level = reading.requests_arrived_total
        if reading.source == "headroom" or level is None:
            return reading
        fell = (
            self._departed is not None
            and reading.requests_departed_total is not None
            and reading.requests_departed_total < self._departed
        )
        if None not in (self._instance_id, reading.instance_id):
            restarted = self._instance_id != reading.instance_id
        else:
            restarted = fell
        if self.total is None or self._level is None or restarted:
            self.total = level
        elif fell and self._held_polls < HOLD_POLLS:
            self._held_polls += 1  # the level and departures before the gap stay the base
            return replace(reading, requests_arrived_total=self.total)
        elif not fell:
            self.total += max(level - self._level, 0.0)
        self._held_polls = 0
        self._level, self._departed = level, reading.requests_departed_total
        self._instance_id = reading.instance_id
        return replace(reading, requests_arrived_total=self.total)
