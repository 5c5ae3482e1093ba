"""kopf's namespace and CRD observers, amended to act on what their watch's own listing shows.

Each observer lists once (namespaces matching `--namespace`; the cluster's resources), then
starts a watch that lists again and ignores that second listing (its events have no type),
taking only the changes that follow. What appeared between the two listings, or while a watch
whose resourceVersion expired was listing again, went unseen until the operator restarted:
 - a matching namespace created then got no watcher: its InferenceDeployments were never
   reconciled, with nothing logged (CI's operator tests hit it);
 - an InferenceDeployment or kopf peering CRD established then was never served.
Here a listed namespace, or a listed CRD of a group the operator serves, reaches kopf's own
processor as a change (both are idempotent for what is already known). Other CRDs are left:
each would cost a discovery scan at every start, which kopf's skip avoids. A namespace deleted
during a relist still keeps its (idle) watcher: the listing's end reaches no processor.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Collection
from types import ModuleType
from typing import Any

log = logging.getLogger("headroom.operator")

_observation: ModuleType | None
try:
    from kopf._core.reactor import observation as _observation
except ImportError:  # another kopf layout: nothing to amend
    _observation = None

Processor = Callable[..., Awaitable[None]]
# kopf's processors (1.45) and the observers that look each up when they start their watch.
NAMESPACES, CRDS = "process_discovered_namespace_event", "process_discovered_resource_event"
OBSERVERS = {NAMESPACES: "namespace_observer", CRDS: "resource_observer"}
ORIGINALS: dict[str, Processor] = {
    name: getattr(_observation, name) for name in OBSERVERS if hasattr(_observation, name)
}
# A listing's event handed on as a change: kopf's processors skip only untyped events.
LISTED_AS = "MODIFIED"


def _amendable() -> bool:
    if _observation is None or len(ORIGINALS) != len(OBSERVERS):
        return False
    for name, observer in OBSERVERS.items():
        code = getattr(getattr(_observation, observer, None), "__code__", None)
        if code is None or name not in code.co_names:  # bound some other way: a patch is inert
            return False
    return True


def _listed_too(original: Processor, wanted: Callable[[dict[str, Any]], bool]) -> Processor:
    @functools.wraps(original)
    async def process(*, raw_event: Any, **kwargs: Any) -> None:
        if raw_event["type"] is None and wanted(raw_event["object"]):
            raw_event = {**raw_event, "type": LISTED_AS}
        await original(raw_event=raw_event, **kwargs)

    return process


def watch_listed(groups: Collection[str]) -> bool:
    """Amend kopf's observers (idempotent); False, with a warning, where this kopf differs."""
    if not _amendable():
        log.warning(
            "this kopf's observers are not the ones amended: a namespace or CRD created while "
            "the operator starts may go unseen until it restarts"
        )
        return False
    assert _observation is not None
    served = frozenset(groups)
    wanted: dict[str, Callable[[dict[str, Any]], bool]] = {
        NAMESPACES: lambda namespace: True,
        CRDS: lambda crd: (crd.get("spec") or {}).get("group") in served,
    }
    for name, listed in wanted.items():
        setattr(_observation, name, _listed_too(ORIGINALS[name], listed))
    return True
