"""Whether an existing object may be applied over as this InferenceDeployment's child (pure).

Server-side apply with `force` takes every field it sets from whoever held it, so applying the
children over a same-named Deployment or Service that someone else made would silently replace
their workload. An object is ours to apply when its controller reference names this
InferenceDeployment (same uid), or when it has no controller and carries the labels the
operator puts on its children: an orphan left by `kubectl delete --cascade=orphan` of an earlier
InferenceDeployment of the same name, adopted the way a Deployment adopts its ReplicaSets.
"""

from __future__ import annotations

from typing import Any

from headroom.operator.reconcile.children import FIELD_MANAGER, SELECTOR_LABEL, Owner


def controller_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The object's controller owner reference, if any."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), None)


def conflict(kind: str, live: dict[str, Any] | None, owner: Owner) -> str | None:
    """Why `live`, the object of `kind` already stored under a child's name, is not ours to
    apply over or scale; None when it is (or when there is none)."""
    if live is None:
        return None
    meta = live.get("metadata", {})
    what = f"{kind} {meta.get('name', owner.name)}"
    ref = controller_of(live)
    if ref is not None:
        if ref.get("uid") == owner.uid:
            return None
        return (
            f"{what} already exists and is controlled by {ref.get('kind')} {ref.get('name')} "
            f"(uid {ref.get('uid')}); delete it or give this InferenceDeployment another name"
        )
    labels = meta.get("labels") or {}
    if (
        labels.get(SELECTOR_LABEL) == owner.name
        and labels.get("app.kubernetes.io/managed-by") == FIELD_MANAGER
    ):
        return None
    return (
        f"{what} already exists and is not managed by headroom; delete it or give this "
        "InferenceDeployment another name (headroom does not take over objects it did not create)"
    )
