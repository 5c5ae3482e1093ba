"""A wall clock that never steps, for timestamps whose differences are durations or rates."""

from __future__ import annotations

import time

# Unix time at import, less the monotonic clock then: readings stay unix seconds, but advance
# with the monotonic clock, so an NTP step between two of them changes no difference.
_OFFSET = time.time() - time.monotonic()


def steady_time() -> float:
    """Unix seconds that advance with `time.monotonic()`: what `time.time()` said at start,
    plus the time elapsed since (an NTP step back 30 s would otherwise make a latency negative,
    or a rate's span 30 s short)."""
    return _OFFSET + time.monotonic()
