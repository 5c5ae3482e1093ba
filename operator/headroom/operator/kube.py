"""The operator's side of the API server: `KubeAPI`, the calls reconcile and the scaling loop
make, and `Kube`, a thin, synchronous REST shell for them (server-side apply, get, list,
discovery).

Built on the `kubernetes` client's authenticated transport (kubeconfig or in-cluster service
account) but speaking plain JSON, so the operator handles manifests as dicts end to end. Calls
block; the kopf handlers run them in worker threads (`asyncio.to_thread`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import kubernetes
import urllib3

from headroom.operator.crd.models import GROUP, KIND, PLURAL, VERSION
from headroom.operator.reconcile.children import FIELD_MANAGER, Owner

log = logging.getLogger("headroom.operator.kube")
T = TypeVar("T")

# Plural names of the kinds the operator touches (no discovery round trip needed for them).
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "Pod"): "pods",
    ("v1", "Service"): "services",
    ("v1", "Event"): "events",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrules",
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): "customresourcedefinitions",
    (f"{GROUP}/{VERSION}", KIND): PLURAL,
}
CLUSTER_SCOPED = {"CustomResourceDefinition", "Namespace"}
TRANSIENT = {0, 409, 429, 500, 502, 503, 504}


class KubeError(Exception):
    """A failed API call, with the server's status code, reason and message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def transient(self) -> bool:
        """Worth retrying: conflicts, throttling, server errors, connection failures."""
        return self.status in TRANSIENT


def object_path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    """The REST path of a collection or an object."""
    try:
        plural = PLURALS[(api_version, kind)]
    except KeyError:
        raise ValueError(f"no plural known for {api_version} {kind}") from None
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace and kind not in CLUSTER_SCOPED:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    return f"{base}/{name}" if name else base


def load_configuration(kubeconfig: str | None = None) -> kubernetes.client.Configuration:
    """Credentials from a kubeconfig file, else in-cluster, else the default kubeconfig."""
    cfg = kubernetes.client.Configuration()
    if kubeconfig:
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)  # type: ignore[no-untyped-call]
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    else:
        kubernetes.config.load_kube_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    return cfg


class Kube:
    """JSON over the API server, with server-side apply under headroom's field manager."""

    def __init__(
        self,
        configuration: kubernetes.client.Configuration,
        timeout: float = 15.0,
        discovery_ttl: float = 60.0,
    ) -> None:
        self.configuration = configuration
        self.api = kubernetes.client.ApiClient(configuration)
        self.timeout = timeout
        self.discovery_ttl = discovery_ttl
        self._discovery: dict[str, tuple[float, frozenset[str]]] = {}
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, kubeconfig: str | None = None) -> Kube:
        """A client for the cluster named by `kubeconfig` (or in-cluster)."""
        return cls(load_configuration(kubeconfig))

    def request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        """One API call; returns the decoded JSON body, raises KubeError on non-2xx."""
        headers = {"Accept": "application/json", "Content-Type": content_type}
        if content_type.endswith("yaml") and body is not None and not isinstance(body, bytes):
            # As UTF-8 text: the client's own json.dumps escapes a character outside the BMP
            # (an emoji in a message) as a surrogate pair, which JSON allows and the API
            # server's YAML decoder refuses (400 for the whole apply).
            body = json.dumps(body, ensure_ascii=False).encode()
        req = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            resp = self.api.call_api(*req, _request_timeout=self.timeout)
            data = resp.read()  # type: ignore[no-untyped-call]
        except kubernetes.client.exceptions.ApiException as exc:
            raise _error(exc.status or 0, exc.reason or "", exc.body) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeError(0, "ConnectionError", str(exc)) from None
        if not 200 <= resp.status <= 299:
            raise _error(resp.status, resp.reason or "", data)
        return json.loads(data) if data else None

    def get(
        self, api_version: str, kind: str, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            obj: dict[str, Any] = self.request(
                "GET", object_path(api_version, kind, namespace, name)
            )
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        return obj

    def list(
        self, api_version: str, kind: str, namespace: str | None, label_selector: str = ""
    ) -> list[dict[str, Any]]:
        """Objects of a kind in a namespace, optionally filtered by labels."""
        query = [("labelSelector", label_selector)] if label_selector else []
        out = self.request("GET", object_path(api_version, kind, namespace), query=query)
        items: list[dict[str, Any]] = out.get("items", [])
        return items

    def apply(
        self, obj: dict[str, Any], *, field_manager: str = FIELD_MANAGER, force: bool = True
    ) -> dict[str, Any]:
        """Server-side apply: the fields in `obj` become owned by `field_manager`."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        query = [("fieldManager", field_manager)]
        if force:
            query.append(("force", "true"))
        out: dict[str, Any] = self.request(
            "PATCH", path, query=query, body=obj, content_type="application/apply-patch+yaml"
        )
        return out

    def apply_status(
        self,
        owner: Owner,
        status: dict[str, Any],
        *,
        field_manager: str,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        """Server-side apply of an InferenceDeployment's status subresource: `field_manager`
        owns exactly the fields in `status` (conditions are a list keyed by type). With
        `resource_version`, a 409 if the object changed since it was read at that version."""
        metadata = {"name": owner.name, "namespace": owner.namespace}
        if resource_version is not None:
            metadata["resourceVersion"] = resource_version
        obj = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "metadata": metadata,
            # An apply has no null: a field left out is a field this manager no longer owns.
            "status": without_nulls(status),
        }
        path = object_path(f"{GROUP}/{VERSION}", KIND, owner.namespace, owner.name) + "/status"
        query = [("fieldManager", field_manager), ("force", "true")]
        out: dict[str, Any] = self.request(
            "PATCH", path, query=query, body=obj, content_type="application/apply-patch+yaml"
        )
        return out

    def scale(self, namespace: str, name: str, replicas: int, *, field_manager: str) -> int:
        """Set a Deployment's replicas through its scale subresource; returns what it holds."""
        path = object_path("apps/v1", "Deployment", namespace, name) + "/scale"
        out = self.request(
            "PATCH",
            path,
            query=[("fieldManager", field_manager)],
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        )
        return int(out.get("spec", {}).get("replicas", replicas))

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        """Delete with background propagation; False when it was already gone."""
        try:
            self.request(
                "DELETE",
                object_path(api_version, kind, namespace, name),
                body={"propagationPolicy": "Background"},
            )
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def served_kinds(self, group_version: str, ttl: float | None = None) -> frozenset[str]:
        """Kinds the API server serves for a group/version (empty when absent); cached."""
        ttl = self.discovery_ttl if ttl is None else ttl
        now = time.monotonic()
        with self._lock:
            hit = self._discovery.get(group_version)
            if hit and now - hit[0] < ttl:
                return hit[1]
        path = f"/apis/{group_version}" if "/" in group_version else f"/api/{group_version}"
        try:
            doc = self.request("GET", path)
            kinds = frozenset(
                r["kind"] for r in doc.get("resources", []) if "/" not in r.get("name", "/")
            )
        except KubeError as exc:
            if exc.status not in (404, 503):
                raise
            kinds = frozenset()
        with self._lock:
            self._discovery[group_version] = (now, kinds)
        return kinds


def _error(status: int, reason: str, body: Any) -> KubeError:
    message = ""
    if isinstance(body, bytes | str):
        try:
            doc = json.loads(body)
            message = doc.get("message", "") if isinstance(doc, dict) else str(doc)
            reason = doc.get("reason", reason) if isinstance(doc, dict) else reason
        except ValueError:
            message = body.decode(errors="replace") if isinstance(body, bytes) else body
    return KubeError(status, reason or "Error", message[:2000])


def with_retries(
    fn: Callable[[], T],
    *,
    attempts: int = 4,
    base_delay: float = 0.25,
    sleep: Callable[[float], None] = time.sleep,
    conflicts: bool = True,
) -> T:
    """Call `fn`, retrying transient KubeErrors with exponential backoff and jitter.
    `conflicts=False` raises a 409 at once: a write whose resourceVersion precondition failed
    fails again until the caller reads the object anew."""
    for attempt in range(attempts):
        try:
            return fn()
        except KubeError as exc:
            retry = exc.transient and (conflicts or exc.status != 409)
            if not retry or attempt == attempts - 1:
                raise
            delay = base_delay * 2**attempt * (0.5 + random.random())
            log.debug("transient API error, retrying", extra={"error": str(exc), "delay": delay})
            sleep(delay)
    raise AssertionError("unreachable")


def without_nulls(value: Any) -> Any:
    """`value` with every None dropped from its mappings, however deep."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def owns_field(obj: dict[str, Any], manager: str, path: tuple[str, ...]) -> bool:
    """Whether `manager` holds `path` (e.g. ("spec", "replicas")) through server-side apply."""
    for entry in obj.get("metadata", {}).get("managedFields", []) or []:
        if entry.get("manager") != manager or entry.get("operation") != "Apply":
            continue
        node = entry.get("fieldsV1", {})
        for part in path:
            node = node.get(f"f:{part}")
            if node is None:
                break
        else:
            return True
    return False


class KubeAPI(Protocol):
    """The calls reconcile and the scaling loop make (apply.Kube, or a fake in tests)."""

    def get(
        self, api_version: str, kind: str, namespace: str | None, name: str
    ) -> dict[str, Any] | None: ...

    def list(
        self, api_version: str, kind: str, namespace: str | None, label_selector: str = ""
    ) -> list[dict[str, Any]]: ...

    def apply(
        self, obj: dict[str, Any], *, field_manager: str = FIELD_MANAGER, force: bool = True
    ) -> dict[str, Any]: ...

    def served_kinds(self, group_version: str, ttl: float | None = None) -> frozenset[str]: ...

    def apply_status(
        self,
        owner: Owner,
        status: dict[str, Any],
        *,
        field_manager: str,
        resource_version: str | None = None,
    ) -> dict[str, Any]: ...

    def scale(self, namespace: str, name: str, replicas: int, *, field_manager: str) -> int: ...


def owner_of(body: dict[str, Any]) -> Owner:
    """The owner record of an InferenceDeployment body."""
    meta = body["metadata"]
    return Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
