"""kopf's namespace observer, made to watch a matching namespace it first sees in a listing.

With `--namespace` patterns kopf lists the namespaces once, then starts a watch that lists them
again and ignores that second listing (its events have no type), taking only later ADDED
events. A namespace created between the two listings (while the operator starts, or while a
watch whose resourceVersion expired lists again) matched the patterns yet got no watcher until
the operator restarted: its InferenceDeployments were never reconciled, with nothing logged.
Revising the set on listed namespaces too is idempotent for those already known.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

log = logging.getLogger("headroom.operator")

_observation: ModuleType | None
try:
    from kopf._core.reactor import observation as _observation
except ImportError:  # another kopf layout: nothing to amend
    _observation = None
# The processor kopf's namespace_observer binds when it starts its watch (kopf 1.37 to 1.45).
PROCESSOR = "process_discovered_namespace_event"


async def _process_namespace_event(
    *, raw_event: Any, namespaces: Any, insights: Any, **_: Any
) -> None:
    assert _observation is not None
    async with insights.revised:
        _observation.revise_namespaces(
            raw_events=[raw_event], insights=insights, namespaces=namespaces
        )
        insights.revised.notify_all()


def watch_listed_namespaces() -> bool:
    """Make kopf's namespace watch take namespaces from its own listing; False if it cannot."""
    if _observation is None or not all(
        hasattr(_observation, name) for name in (PROCESSOR, "revise_namespaces")
    ):
        log.warning(
            "this kopf's namespace observer is not the one amended: a namespace created while "
            "the operator starts may go unwatched until it restarts"
        )
        return False
    setattr(_observation, PROCESSOR, _process_namespace_event)
    return True
