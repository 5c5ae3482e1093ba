"""Whether a failed apply of a child can succeed on retry (pure: status code and message in).

An object the API server refuses as invalid is refused again on every retry until the spec
changes: report it as a condition and wait for the next spec change instead of retrying it every
few seconds forever. kube-apiserver answers most invalid objects with 422 (a Service named
`a.b`, a label over 63 bytes) or 400, but a value the typed conversion cannot parse (a memory of
"lots") comes back as 500 "failed to convert new object ... unable to convert unstructured
object", which is no outage. Conflicts, throttling, outages, RBAC (403) and a missing namespace
(404) are fixed elsewhere and stay retryable.

One 403 is neither: the namespace is being deleted, and its lifecycle admission refuses every
new object in it. The children go with the namespace; there is nothing to apply or retry.
"""

from __future__ import annotations

INVALID_STATUSES = frozenset({400, 422})
# The 500s that are the object's fault: its conversion to the typed object failed.
_CONVERSION_FAILURES = ("failed to convert new object", "unable to convert unstructured object")


def permanent_apply_error(status: int, message: str) -> bool:
    """True when the API server refused the object itself, so a retry of the same object fails."""
    if status in INVALID_STATUSES:
        return True
    return status == 500 and any(m in message for m in _CONVERSION_FAILURES)


# NamespaceLifecycle's answer to a create in a namespace being deleted (a 403 with this text).
_TERMINATING = "because it is being terminated"


def namespace_terminating(status: int, message: str) -> bool:
    """True when the apply was refused because its namespace is being deleted."""
    return status == 403 and _TERMINATING in message
