"""The operator's API client shell against a scripted HTTP server on 127.0.0.1: the paths, query,
content types and bodies it sends, how it maps answers to KubeError, the retry policy, and the
ClusterRole it needs (the real API server: test_operator_cluster_*)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import kubernetes
import pytest

import headroom.operator.kube as kube_module
from headroom.operator.crd.models import GROUP, KIND, PLURAL, VERSION
from headroom.operator.kube import (
    Kube,
    KubeError,
    _error,
    object_path,
    owner_of,
    owns_field,
    with_retries,
    without_nulls,
)
from headroom.operator.rbac import cluster_role, cluster_role_rules
from headroom.operator.reconcile.children import Owner

API_VERSION = f"{GROUP}/{VERSION}"


class FakeServer:
    """Answers (method, path) from a script (200 `{}` when unscripted) and records requests."""

    def __init__(self) -> None:
        self.replies: dict[tuple[str, str], tuple[int, bytes]] = {}
        self.requests: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                server.requests.append(
                    {
                        "method": self.command,
                        "path": url.path,
                        "query": parse_qsl(url.query),
                        "content_type": self.headers.get("Content-Type"),
                        "body": self.rfile.read(length),
                    }
                )
                status, body = server.replies.get((self.command, url.path), (200, b"{}"))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PATCH = do_DELETE = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]

    def reply(self, method: str, path: str, status: int, body: Any) -> None:
        """Script one answer; a dict or list is sent as JSON, bytes as they are."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.replies[(method, path)] = (status, raw)


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = FakeServer()
    thread = threading.Thread(target=fake.httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        fake.httpd.shutdown()
        fake.httpd.server_close()


def client(port: int, **kwargs: Any) -> Kube:
    cfg = kubernetes.client.Configuration()
    cfg.host = f"http://127.0.0.1:{port}"
    return Kube(cfg, timeout=5.0, **kwargs)


@pytest.fixture
def kube(server: FakeServer) -> Kube:
    return client(server.port)


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


# --- paths ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "path"),
    [
        (("v1", "Pod", "ns", None), "/api/v1/namespaces/ns/pods"),
        (("v1", "Service", "ns", "s"), "/api/v1/namespaces/ns/services/s"),
        (("apps/v1", "Deployment", "ns", "d"), "/apis/apps/v1/namespaces/ns/deployments/d"),
        ((API_VERSION, KIND, "ns", "x"), f"/apis/{API_VERSION}/namespaces/ns/{PLURAL}/x"),
        (
            ("apiextensions.k8s.io/v1", "CustomResourceDefinition", "ns", "c"),
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/c",
        ),
        (("apps/v1", "Deployment", None, None), "/apis/apps/v1/deployments"),
    ],
)
def test_object_paths_core_group_namespaced_and_cluster_scoped(
    args: tuple[str, str, str | None, str | None], path: str
) -> None:
    """Core kinds live under /api, groups under /apis; a CRD ignores the namespace it is given."""
    assert object_path(*args) == path


def test_a_kind_without_a_known_plural_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="no plural known for v1 ConfigMap"):
        object_path("v1", "ConfigMap", "ns", "c")


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [0, 409, 429, 500, 502, 503, 504])
def test_outages_conflicts_and_throttling_are_transient(status: int) -> None:
    """Connection failures (0), conflicts, 429 throttling and 5xx gateways are worth retrying."""
    assert KubeError(status, "X", "m").transient


@pytest.mark.parametrize("status", [400, 401, 403, 404, 410, 422, 501])
def test_client_errors_are_not_transient(status: int) -> None:
    assert not KubeError(status, "X", "m").transient


def test_an_api_status_body_gives_reason_and_message() -> None:
    """The server's Status reason wins over the HTTP reason phrase."""
    body = json.dumps(status_body(422, "Invalid", "spec.x: bad")).encode()
    exc = _error(422, "Unprocessable Entity", body)
    assert (exc.status, exc.reason, exc.message) == (422, "Invalid", "spec.x: bad")
    assert str(exc) == "422 Invalid: spec.x: bad"


def test_a_body_that_is_not_json_is_the_message_and_keeps_the_http_reason() -> None:
    exc = _error(502, "Bad Gateway", b"<html>upstream \xff down</html>")
    assert (exc.reason, exc.message) == ("Bad Gateway", "<html>upstream \ufffd down</html>")
    assert _error(500, "", "plain").message == "plain"


def test_no_reason_at_all_is_error_and_a_long_message_is_cut_to_2000() -> None:
    exc = _error(500, "", json.dumps({"message": "x" * 5000}))
    assert exc.reason == "Error"
    assert exc.message == "x" * 2000
    assert _error(500, "R", json.dumps(["a", 1])).message == "['a', 1]"
    assert _error(500, "R", None).message == ""


# --- retries -------------------------------------------------------------------------------------


def failing(*statuses: int, value: str = "ok") -> tuple[list[int], Any]:
    """A call that raises KubeError with each status in turn, then returns `value`."""
    calls: list[int] = []

    def fn() -> str:
        calls.append(len(calls))
        if len(calls) <= len(statuses):
            raise KubeError(statuses[len(calls) - 1], "R", "m")
        return value

    return calls, fn


def test_transient_errors_are_retried_with_doubling_jittered_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Delay k is base * 2**k * (0.5 + jitter), jitter in [0, 1); the next success is returned."""
    jitter = iter([0.0, 0.75, 0.5])
    monkeypatch.setattr(kube_module.random, "random", lambda: next(jitter))
    calls, fn = failing(503, 429, 0)
    delays: list[float] = []
    assert with_retries(fn, attempts=4, base_delay=1.0, sleep=delays.append) == "ok"
    assert len(calls) == 4
    assert delays == [0.5, 2 * 1.25, 4 * 1.0]


def test_by_default_four_attempts_from_a_quarter_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """About 0.25 + 0.5 + 1 s of backoff: an API server outage of a second or two is ridden out."""
    monkeypatch.setattr(kube_module.random, "random", lambda: 0.5)
    calls, fn = failing(*[503] * 10)
    delays: list[float] = []
    with pytest.raises(KubeError):
        with_retries(fn, sleep=delays.append)
    assert len(calls) == 4
    assert delays == [0.25, 0.5, 1.0]


def test_the_last_attempt_raises_without_sleeping() -> None:
    calls, fn = failing(500, 500, 500, 500, 500)
    delays: list[float] = []
    with pytest.raises(KubeError) as err:
        with_retries(fn, attempts=3, sleep=delays.append)
    assert err.value.status == 500
    assert (len(calls), len(delays)) == (3, 2)


def test_a_permanent_error_is_raised_at_once() -> None:
    calls, fn = failing(422)
    delays: list[float] = []
    with pytest.raises(KubeError):
        with_retries(fn, sleep=delays.append)
    assert (len(calls), delays) == (1, [])


def test_conflicts_false_raises_a_409_at_once_but_retries_other_transients() -> None:
    """A failed resourceVersion precondition needs a fresh read, not another try."""
    calls, fn = failing(409)
    with pytest.raises(KubeError):
        with_retries(fn, conflicts=False, sleep=lambda _: None)
    assert len(calls) == 1
    calls, fn = failing(503, 409)
    with pytest.raises(KubeError) as err:
        with_retries(fn, conflicts=False, sleep=lambda _: None)
    assert (err.value.status, len(calls)) == (409, 2)
    calls, fn = failing(409, 409)
    assert with_retries(fn, sleep=lambda _: None) == "ok"


# --- pure helpers --------------------------------------------------------------------------------


def test_without_nulls_drops_none_from_mappings_at_any_depth_but_not_from_lists() -> None:
    value = {"a": None, "b": [{"c": None, "d": 0}, None], "e": {"f": None, "g": False}}
    assert without_nulls(value) == {"b": [{"d": 0}, None], "e": {"g": False}}


def managed(manager: str, operation: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {"manager": manager, "operation": operation, "fieldsV1": fields}


def test_owns_field_needs_the_managers_apply_entry_to_hold_the_whole_path() -> None:
    """Only an Apply entry counts: an Update by the same manager is not field ownership."""
    fields = {"f:spec": {"f:replicas": {}}}
    obj = {
        "metadata": {
            "managedFields": [
                managed("headroom", "Update", fields),
                managed("other", "Apply", fields),
                managed("headroom", "Apply", {"f:spec": {"f:template": {}}}),
            ]
        }
    }
    assert not owns_field(obj, "headroom", ("spec", "replicas"))
    assert owns_field(obj, "headroom", ("spec", "template"))
    assert owns_field(obj, "other", ("spec", "replicas"))
    assert not owns_field({"metadata": {"managedFields": None}}, "other", ("spec",))


def test_owner_of_takes_name_namespace_and_uid() -> None:
    body = {"metadata": {"name": "n", "namespace": "ns", "uid": "u", "generation": 2}}
    assert owner_of(body) == Owner(name="n", namespace="ns", uid="u")


# --- requests against the scripted server --------------------------------------------------------


def test_get_returns_the_object_or_none_when_not_found(server: FakeServer, kube: Kube) -> None:
    path = "/apis/apps/v1/namespaces/ns/deployments/d"
    server.reply("GET", path, 200, {"kind": "Deployment", "metadata": {"name": "d"}})
    assert kube.get("apps/v1", "Deployment", "ns", "d") == {
        "kind": "Deployment",
        "metadata": {"name": "d"},
    }
    server.reply("GET", path, 404, status_body(404, "NotFound", "gone"))
    assert kube.get("apps/v1", "Deployment", "ns", "d") is None


def test_a_non_2xx_answer_is_a_kube_error_with_the_status_fields(
    server: FakeServer, kube: Kube
) -> None:
    path = "/apis/apps/v1/namespaces/ns/deployments/d"
    for code, reason in [(403, "Forbidden"), (500, "InternalError"), (409, "Conflict")]:
        server.reply("GET", path, code, status_body(code, reason, f"m{code}"))
        with pytest.raises(KubeError) as err:
            kube.get("apps/v1", "Deployment", "ns", "d")
        assert (err.value.status, err.value.reason, err.value.message) == (code, reason, f"m{code}")


def test_a_created_answer_is_success(server: FakeServer, kube: Kube) -> None:
    """An apply that creates the object answers 201."""
    server.reply("PATCH", "/api/v1/namespaces/ns/services/s", 201, {"kind": "Service"})
    obj = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "ns"}}
    assert kube.apply(obj) == {"kind": "Service"}


def test_a_non_json_error_keeps_the_http_reason(server: FakeServer, kube: Kube) -> None:
    """A proxy in front of the API server answers in HTML; its status line still names it."""
    server.reply("GET", "/api/v1/namespaces/ns/pods/p", 502, b"<html>bad gateway</html>")
    with pytest.raises(KubeError) as err:
        kube.get("v1", "Pod", "ns", "p")
    assert (err.value.status, err.value.reason) == (502, "Bad Gateway")
    assert err.value.message == "<html>bad gateway</html>"


def test_an_api_exception_from_the_client_maps_like_an_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Client versions that raise for a non-2xx (or for a TLS failure, with no status) map the same,
    and every call carries the 15 s default timeout."""
    kube = Kube(kubernetes.client.Configuration())
    raised: list[kubernetes.client.exceptions.ApiException] = []
    timeouts: list[float] = []

    def call_api(*args: Any, _request_timeout: float) -> Any:
        timeouts.append(_request_timeout)
        raise raised[-1]

    monkeypatch.setattr(kube.api, "call_api", call_api)
    raised.append(kubernetes.client.exceptions.ApiException(status=503, reason="Unavailable"))
    raised[-1].body = b"{}"
    with pytest.raises(KubeError) as err:
        kube.get("v1", "Pod", "ns", "p")
    assert (err.value.status, err.value.reason) == (503, "Unavailable")
    raised.append(kubernetes.client.exceptions.ApiException(reason=None))
    with pytest.raises(KubeError) as err:
        kube.get("v1", "Pod", "ns", "p")
    assert (err.value.status, err.value.reason) == (0, "Error")
    assert err.value.transient
    assert timeouts == [15.0, 15.0]


def test_a_connection_failure_is_status_0(server: FakeServer) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(KubeError) as err:
        client(port).get("v1", "Pod", "ns", "p")
    assert (err.value.status, err.value.reason) == (0, "ConnectionError")
    assert err.value.transient


def test_list_sends_the_label_selector_only_when_given(server: FakeServer, kube: Kube) -> None:
    server.reply("GET", "/api/v1/namespaces/ns/pods", 200, {"items": [{"metadata": {"name": "p"}}]})
    assert kube.list("v1", "Pod", "ns", "app=x") == [{"metadata": {"name": "p"}}]
    assert server.requests[-1]["query"] == [("labelSelector", "app=x")]
    server.reply("GET", "/api/v1/namespaces/ns/pods", 200, {"kind": "PodList"})
    assert kube.list("v1", "Pod", "ns") == []
    assert server.requests[-1]["query"] == []


def test_apply_is_a_forced_server_side_apply_with_utf8_text(server: FakeServer, kube: Kube) -> None:
    """The body is UTF-8 JSON, not surrogate pairs, which the server's YAML decoder refuses."""
    obj = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "ns", "annotations": {"note": "ok \U0001f680"}},
    }
    kube.apply(obj, field_manager="me")
    req = server.requests[-1]
    assert (req["method"], req["path"]) == ("PATCH", "/apis/apps/v1/namespaces/ns/deployments/d")
    assert req["query"] == [("fieldManager", "me"), ("force", "true")]
    assert req["content_type"] == "application/apply-patch+yaml"
    assert "\U0001f680".encode() in req["body"]
    assert json.loads(req["body"]) == obj
    kube.apply(obj, field_manager="me", force=False)
    assert server.requests[-1]["query"] == [("fieldManager", "me")]


def test_apply_status_patches_the_status_subresource_without_nulls(
    server: FakeServer, kube: Kube
) -> None:
    """With a resourceVersion the apply carries it as a precondition; without, none."""
    owner = Owner(name="x", namespace="ns", uid="u")
    kube.apply_status(owner, {"replicas": 2, "message": None}, field_manager="st")
    req = server.requests[-1]
    assert req["path"] == f"/apis/{API_VERSION}/namespaces/ns/{PLURAL}/x/status"
    assert req["query"] == [("fieldManager", "st"), ("force", "true")]
    assert req["content_type"] == "application/apply-patch+yaml"
    assert json.loads(req["body"]) == {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "x", "namespace": "ns"},
        "status": {"replicas": 2},
    }
    kube.apply_status(owner, {}, field_manager="st", resource_version="7")
    assert json.loads(server.requests[-1]["body"])["metadata"]["resourceVersion"] == "7"


def test_scale_merge_patches_the_scale_subresource_and_returns_what_it_holds(
    server: FakeServer, kube: Kube
) -> None:
    path = "/apis/apps/v1/namespaces/ns/deployments/d/scale"
    server.reply("PATCH", path, 200, {"spec": {"replicas": 3}})
    assert kube.scale("ns", "d", 5, field_manager="sc") == 3
    req = server.requests[-1]
    assert req["content_type"] == "application/merge-patch+json"
    assert req["query"] == [("fieldManager", "sc")]
    assert json.loads(req["body"]) == {"spec": {"replicas": 5}}
    server.reply("PATCH", path, 200, {"spec": {}})
    assert kube.scale("ns", "d", 5, field_manager="sc") == 5


def test_delete_is_background_and_false_when_already_gone(server: FakeServer, kube: Kube) -> None:
    path = "/api/v1/namespaces/ns/services/s"
    assert kube.delete("v1", "Service", "ns", "s") is True
    assert json.loads(server.requests[-1]["body"]) == {"propagationPolicy": "Background"}
    server.reply("DELETE", path, 404, status_body(404, "NotFound", "gone"))
    assert kube.delete("v1", "Service", "ns", "s") is False
    server.reply("DELETE", path, 403, status_body(403, "Forbidden", "no"))
    with pytest.raises(KubeError):
        kube.delete("v1", "Service", "ns", "s")


def test_served_kinds_are_cached_for_a_minute_by_default(
    server: FakeServer, kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A minute of discovery cache: a CRD installed later is seen within it, at 60 s exactly."""
    now = [1000.0]
    monkeypatch.setattr(kube_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    kube.served_kinds("apps/v1")
    now[0] = 1059.9
    kube.served_kinds("apps/v1")
    assert len(server.requests) == 1
    now[0] = 1060.0
    kube.served_kinds("apps/v1")
    assert len(server.requests) == 2


def test_served_kinds_skips_subresources_and_caches_for_the_ttl(server: FakeServer) -> None:
    kube = client(server.port, discovery_ttl=3600.0)
    resources = [
        {"name": "servicemonitors", "kind": "ServiceMonitor"},
        {"name": "servicemonitors/status", "kind": "ServiceMonitor"},
        {"name": "prometheusrules", "kind": "PrometheusRule"},
        {"name": "thing/scale", "kind": "Scale"},
    ]
    server.reply("GET", "/apis/monitoring.coreos.com/v1", 200, {"resources": resources})
    kinds = kube.served_kinds("monitoring.coreos.com/v1")
    assert kinds == {"ServiceMonitor", "PrometheusRule"}
    assert kube.served_kinds("monitoring.coreos.com/v1") == kinds
    assert len(server.requests) == 1
    assert kube.served_kinds("monitoring.coreos.com/v1", ttl=0.0) == kinds
    assert len(server.requests) == 2
    assert kube.served_kinds("v1") == frozenset()
    assert server.requests[-1]["path"] == "/api/v1"


@pytest.mark.parametrize(("code", "served"), [(404, True), (503, True), (403, False)])
def test_served_kinds_of_an_absent_group_is_empty_and_a_denial_raises(
    server: FakeServer, kube: Kube, code: int, served: bool
) -> None:
    """404 (no such group) and 503 (an aggregated API that is down) mean nothing is served."""
    server.reply("GET", "/apis/x.io/v1", code, status_body(code, "R", "m"))
    if served:
        assert kube.served_kinds("x.io/v1") == frozenset()
    else:
        with pytest.raises(KubeError):
            kube.served_kinds("x.io/v1")


# --- RBAC ----------------------------------------------------------------------------------------


def test_the_cluster_role_grants_peering_only_when_asked() -> None:
    """Leader election between replicas is the one extra rule; a single operator never has it."""
    role = cluster_role()
    assert role["apiVersion"] == "rbac.authorization.k8s.io/v1"
    assert role["metadata"]["name"] == "headroom-operator"
    assert role["rules"] == cluster_role_rules()
    assert not any("kopf.dev" in rule["apiGroups"] for rule in role["rules"])
    peering = cluster_role("other", peering=True)
    assert peering["metadata"]["name"] == "other"
    assert peering["rules"][: len(role["rules"])] == role["rules"]
    assert [rule["apiGroups"] for rule in peering["rules"][len(role["rules"]) :]] == [["kopf.dev"]]
