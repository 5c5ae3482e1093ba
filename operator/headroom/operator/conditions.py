"""metav1.Condition bookkeeping: pure functions over the status.conditions list."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from headroom.operator.models import CONDITION_TYPES

Status = Literal["True", "False", "Unknown"]


def rfc3339(ts: float) -> str:
    """Unix seconds as the RFC 3339 UTC form Kubernetes stores (second precision)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> float | None:
    """RFC 3339 back to unix seconds; None when absent or unreadable."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def set_condition(
    conditions: list[dict[str, Any]] | None,
    type_: str,
    status: Status,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: float,
) -> list[dict[str, Any]]:
    """A new list with one condition set; `lastTransitionTime` moves only when status flips."""
    if type_ not in CONDITION_TYPES:
        raise ValueError(f"unknown condition type {type_!r}")
    out: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None
    for cond in conditions or []:
        if cond.get("type") == type_:
            previous = cond
        else:
            out.append(dict(cond))
    changed = previous is None or previous.get("status") != status
    entry: dict[str, Any] = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": rfc3339(now)
        if changed or previous is None
        else previous.get("lastTransitionTime", rfc3339(now)),
    }
    if generation is not None:
        entry["observedGeneration"] = generation
    out.append(entry)
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    out.sort(key=lambda c: order.get(str(c.get("type")), len(order)))
    return out


def get_condition(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    """The condition of this type, if set."""
    for cond in conditions or []:
        if cond.get("type") == type_:
            return cond
    return None
