"""Cumulative counters kept from falling within one engine's life, as Prometheus needs them.

Under one engine instance a counter read from a sum over data-parallel pools falls when a pool's
series is missing from a poll, and stays lower when a pool is gone or restarted on its own.
Prometheus reads any fall as a reset and counts the whole value again (a false
HeadroomPreempting, arrivals for a Prometheus-fed autoscaler), and a window that skips the fall
counts the climb back as new. So a fall is held at the last value for up to `HOLD_POLLS` polls
(a pool back within them adds only its growth), and a sum still lower after them is taken as
the new base: counting goes on from there, offset so it never falls. A pool that comes back
after that adds its whole count again, as it did before this hold; holding per pool would not.
Only an engine that reports an instance id can be held throughout: without one (SGLang, vLLM's
multiprocess metrics) a fall of the counters that mark a restart (`state._COUNTERS`) cannot be
told from a restart, and is one; the other counters are held as above.
"""

from __future__ import annotations

from dataclasses import dataclass

# Polls a fall is held before the lower sum stands (3 s at the default --interval).
HOLD_POLLS = 3


@dataclass(frozen=True, slots=True)
class Held:
    """One counter as exported: its value, the offset added to what is read, polls held."""

    value: float
    offset: float = 0.0
    held_polls: int = 0

    def step(self, read: float) -> Held:
        """The counter after a poll that read `read` under the same engine instance."""
        value = read + self.offset
        if value >= self.value:
            return Held(value, self.offset)
        if self.held_polls < HOLD_POLLS:
            return Held(self.value, self.offset, self.held_polls + 1)
        return Held(self.value, self.value - read)  # the lower sum stands: count on from here
