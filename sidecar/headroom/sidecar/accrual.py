"""vLLM's and SGLang's arrivals as a counter, kept by the sidecar across its polls.

Neither server counts the requests that reach it. Their parsers read arrivals as departed + in
flight (running + waiting) at one instant: a level that is exact while every request that
leaves is counted as departed, and that falls when one leaves uncounted (vLLM does not count a
request its client aborts in `vllm:request_success_total`). A counter must not fall, so each
poll adds the level's rise and ignores a fall: a request lost that way costs its own arrival
(or the arrivals it hides within the same poll interval), never a reset. After an engine
restart (a new instance id, or fewer departures than before) the counter starts again from the
new server's level. headroom's engine counts its arrivals itself; its readings pass through.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from headroom.sidecar.sources import EngineReading


@dataclass(slots=True)
class ArrivalCounter:
    """The arrivals counter of one sidecar's engine."""

    total: float | None = None
    _level: float | None = None
    _departed: float | None = None
    _instance_id: str | None = None

    def apply(self, reading: EngineReading) -> EngineReading:
        """`reading` with its arrivals level replaced by the counter."""
        level = reading.requests_arrived_total
        if reading.source == "headroom" or level is None:
            return reading
        restarted = (
            None not in (self._instance_id, reading.instance_id)
            and self._instance_id != reading.instance_id
        ) or (
            self._departed is not None
            and reading.requests_departed_total is not None
            and reading.requests_departed_total < self._departed
        )
        if self.total is None or self._level is None or restarted:
            self.total = level
        else:
            self.total += max(level - self._level, 0.0)
        self._level, self._departed = level, reading.requests_departed_total
        self._instance_id = reading.instance_id
        return replace(reading, requests_arrived_total=self.total)
