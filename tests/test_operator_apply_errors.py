"""Which failed applies a retry cannot fix: the API server's own answers to objects it refuses,
and the transient ones that must keep being retried."""

from __future__ import annotations

import pytest

from headroom.operator.reconcile.apply_errors import namespace_terminating, permanent_apply_error

# (status, message) pairs as kube-apiserver 1.36 answers a server-side apply (recorded from the
# test control plane; test_operator_cluster_apply_errors.py checks them against the real one).
PERMANENT = [
    (500, "failed to convert new object (ns/x; apps/v1, Kind=Deployment) to proper version: "
          "unable to convert unstructured object to apps/v1, Kind=Deployment: quantities must "
          "match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"),
    (422, 'Service "a.b" is invalid: metadata.name: Invalid value: "a.b": must not contain dots'),
    (422, 'Deployment.apps "x" is invalid: metadata.labels: Invalid value: "xxx": must be no more '
          "than 63 bytes"),
    (400, "the body of the request was in an unknown format"),
]  # fmt: skip
TRANSIENT = [
    (0, "ConnectionError: connection refused"),
    (409, "Operation cannot be fulfilled: the object has been modified"),
    (429, "Too many requests"),
    (500, "Internal error occurred: etcdserver: request timed out"),
    (503, "the server is currently unable to handle the request"),
    (504, "Timeout: request did not complete within the allotted timeout"),
    (403, 'deployments.apps "x" is forbidden: User cannot patch resource'),
    (404, 'namespaces "gone" not found'),
]


@pytest.mark.parametrize(("status", "message"), PERMANENT)
def test_an_invalid_object_is_a_permanent_failure(status: int, message: str) -> None:
    assert permanent_apply_error(status, message)


@pytest.mark.parametrize(("status", "message"), TRANSIENT)
def test_outages_conflicts_and_permissions_stay_retryable(status: int, message: str) -> None:
    # RBAC and a missing namespace are fixed outside the spec, so they keep being retried.
    assert not permanent_apply_error(status, message)


def test_it_takes_the_operators_error_fields() -> None:
    from headroom.operator.kube import KubeError

    status, message = PERMANENT[0]
    exc = KubeError(status, "InternalError", message)
    assert permanent_apply_error(exc.status, exc.message)


# kube-apiserver's NamespaceLifecycle answer to an apply into a namespace being deleted.
TERMINATING = (
    'deployments.apps "r0" is forbidden: unable to create new content in namespace t-1 '
    "because it is being terminated"
)


def test_a_namespace_being_deleted_is_neither_a_denial_nor_an_invalid_object() -> None:
    assert namespace_terminating(403, TERMINATING)
    assert not permanent_apply_error(403, TERMINATING)
    for status, message in TRANSIENT + PERMANENT:
        assert not namespace_terminating(status, message)
