"""The objects an InferenceDeployment owns, rendered as plain dicts (pure: no API calls).

A Deployment (engine + sidecar containers, the engine told to allocate exactly the planned KV
pool: headroom's own engine, vLLM or SGLang, see runtimes.py), a Service, a
PodDisruptionBudget, and, when the Prometheus operator's CRDs exist, a ServiceMonitor and a
PrometheusRule. Every object carries a controller owner reference, so deleting the
InferenceDeployment garbage-collects them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headroom.contract.ports import ENGINE_PORT, SIDECAR_PORT
from headroom.operator.crd.models import GROUP, KIND, VERSION, InferenceDeploymentSpec
from headroom.operator.reconcile.runtimes import (
    DEFAULT_IMAGES,
    STARTUP_PERIOD_SECONDS,
    EngineCommand,
    HeadroomImages,
    engine_command,
    engine_image,
    needs_shm,
    sidecar_api_key_env,
    sidecar_image,
    sidecar_source_args,
    startup_failure_threshold,
)
from headroom.operator.reconcile.sizing import Sizing, served_model_name

FIELD_MANAGER = "headroom-operator"
SELECTOR_LABEL = f"{GROUP}/inferencedeployment"
RUN_AS_USER = 10001
MODELS_MOUNT = "/models"
# A terminating pod leaves the Service's endpoints a few seconds after the API marks it: the
# EndpointSlice, then every kube-proxy and ingress, catch up. Its containers get SIGTERM only
# after this preStop sleep, so the requests routed to it meanwhile are still served, where the
# engine, draining at once, refused them (503, then connection refused) on every scale-in.
PRESTOP_SECONDS = 10
# The preStop sleep, then the engine's drain: headroom's lets running requests finish for
# --shutdown-grace (30 s) plus a step margin and the handlers' flush, about 55 s at worst;
# SGLang drains until it is killed. The kubelet kills what is left at this deadline.
TERMINATION_GRACE_SECONDS = PRESTOP_SECONDS + 60


def _lifecycle() -> dict[str, Any]:
    """A container's preStop sleep (a fresh dict each: no two containers share one)."""
    return {"preStop": {"sleep": {"seconds": PRESTOP_SECONDS}}}


@dataclass(frozen=True, slots=True)
class Owner:
    """The InferenceDeployment the children belong to."""

    name: str
    namespace: str
    uid: str


def owner_reference(owner: Owner) -> dict[str, Any]:
    """A controller reference; blockOwnerDeletion makes foreground deletion wait for children."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def selector_labels(name: str) -> dict[str, str]:
    """The labels that pick this deployment's pods."""
    return {SELECTOR_LABEL: name}


def selector_string(name: str) -> str:
    """status.selector, the form /scale and `kubectl get -l` take."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def labels(name: str, component: str = "inference") -> dict[str, str]:
    """Recommended labels plus the selector label."""
    return {
        "app.kubernetes.io/name": "headroom",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        **selector_labels(name),
    }


def _meta(owner: Owner, name: str | None = None) -> dict[str, Any]:
    return {
        "name": name or owner.name,
        "namespace": owner.namespace,
        "labels": labels(owner.name),
        "ownerReferences": [owner_reference(owner)],
    }


def engine_args(spec: InferenceDeploymentSpec, sizing: Sizing, resource_name: str) -> list[str]:
    """The engine container's args for the spec's runtime (the pool is the planned one)."""
    return engine_command(spec, sizing, resource_name).args


_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "runAsUser": RUN_AS_USER,
    "capabilities": {"drop": ["ALL"]},
}


def engine_ports(run: EngineCommand) -> list[dict[str, Any]]:
    """The engine container's ports: the API, and headroom's separate stats listener."""
    ports: list[dict[str, Any]] = [
        {"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}
    ]
    if run.stats_port is not None:
        ports.append({"name": "stats", "containerPort": run.stats_port, "protocol": "TCP"})
    return ports


def probe_port(run: EngineCommand) -> str:
    """The named port the kubelet probes: a stats listener's, where the engine has one, so a
    full API connection table cannot fail the probes of a pod that is only busy."""
    return "stats" if run.stats_port is not None else "http"


def sidecar_engine_url(run: EngineCommand) -> str:
    """What the sidecar polls: the engine's stats listener where it has one (its /stats is
    all the headroom source reads), else the API port (vLLM's /metrics, SGLang's routes)."""
    return f"http://127.0.0.1:{run.stats_port if run.stats_port is not None else ENGINE_PORT}"


def _engine_container(
    spec: InferenceDeploymentSpec, sizing: Sizing, run: EngineCommand, images: HeadroomImages
) -> dict[str, Any]:
    gpus = str(spec.gpu.count_per_pod)
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    if needs_shm(spec, sizing):
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    if spec.model.volume_claim_name:
        mounts.append({"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True})
    env = [
        # The root filesystem is read-only: caches (torch, Triton, Hugging Face) go to /tmp.
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        # headroom's compiled CUDA kernels: the image's own cache dir is on the read-only root.
        {"name": "HEADROOM_CACHE", "value": "/tmp/.cache/headroom"},
    ]
    env += [{"name": k, "value": v} for k, v in run.env.items()]
    if run.api_key_env:
        env.append(_secret_env(run.api_key_env, spec))
    return {
        "name": "engine",
        "image": engine_image(spec, images),
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": run.command,
        "args": run.args,
        "env": env,
        "ports": engine_ports(run),
        "resources": {
            "requests": {
                "cpu": spec.engine.cpu,
                "memory": spec.engine.memory,
                spec.gpu.resource_name: gpus,
            },
            "limits": {"memory": spec.engine.memory, spec.gpu.resource_name: gpus},
        },
        # Loading weights can take minutes; the startup probe holds liveness off until then
        # (engine.startupTimeoutSeconds in all).
        "startupProbe": {
            "httpGet": {"path": "/health", "port": probe_port(run)},
            "periodSeconds": STARTUP_PERIOD_SECONDS,
            "failureThreshold": startup_failure_threshold(spec),
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": probe_port(run)},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "readinessProbe": {
            "httpGet": {"path": run.ready_path, "port": probe_port(run)},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
        "lifecycle": _lifecycle(),
        "securityContext": dict(_CONTAINER_SECURITY),
        "volumeMounts": mounts,
    }


def _secret_env(var: str, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """`var` from engine.apiKeySecret: the kubelet reads the Secret, the operator never does."""
    ref = spec.engine.api_key_secret
    assert ref is not None
    return {"name": var, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def _sidecar_container(
    spec: InferenceDeploymentSpec,
    sizing: Sizing,
    name: str,
    run: EngineCommand,
    images: HeadroomImages,
) -> dict[str, Any]:
    def field(path: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}

    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": field("metadata.name")},
        {"name": "POD_NAMESPACE", "valueFrom": field("metadata.namespace")},
        {"name": "HEADROOM_INFERENCEDEPLOYMENT", "value": name},
        {"name": "HOME", "value": "/tmp"},
    ]
    key_env = sidecar_api_key_env(spec)
    if key_env:
        env.append(_secret_env(key_env, spec))
    return {
        "name": "sidecar",
        "image": sidecar_image(spec, images),
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["headroom"],
        "args": [
            "sidecar",
            "--engine-url",
            sidecar_engine_url(run),
            "--port",
            str(SIDECAR_PORT),
            # The name clients send, which the engine reports too: set from the start, the
            # `model` label stays the same across a sidecar restarted while its engine is down
            # (learnt from the engine, it was missing until the engine answered: the alerts on
            # the pod's series resolved and began again as new ones).
            "--model",
            served_model_name(spec, name),
            # The plan, so a running pool smaller than planned can be seen and alerted on.
            "--planned-blocks",
            str(sizing.plan.kv_blocks_per_pod),
            # At its stop signal, report on until the engine's port refuses (its drain ends).
            "--shutdown-wait",
            str(TERMINATION_GRACE_SECONDS - PRESTOP_SECONDS),
            *sidecar_source_args(spec),
        ],
        "env": env,
        "ports": [{"name": "metrics", "containerPort": SIDECAR_PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"memory": "256Mi"},
        },
        "livenessProbe": {"tcpSocket": {"port": "metrics"}, "periodSeconds": 20},
        # It keeps reporting while the engine drains: the operator counts a terminating pod's KV.
        "lifecycle": _lifecycle(),
        "securityContext": dict(_CONTAINER_SECURITY),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }


def deployment(
    owner: Owner,
    spec: InferenceDeploymentSpec,
    sizing: Sizing,
    replicas: int | None,
    images: HeadroomImages = DEFAULT_IMAGES,
) -> dict[str, Any]:
    """The Deployment; `replicas=None` leaves the field to another owner (advisory mode).
    `images`: headroom's images (the operator's --headroom-image) where the spec names none."""
    run = engine_command(spec, sizing, owner.name)  # the engine's, and where its sidecar polls
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    if needs_shm(spec, sizing):
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}})
    if spec.model.volume_claim_name:
        volumes.append(
            {
                "name": "models",
                "persistentVolumeClaim": {
                    "claimName": spec.model.volume_claim_name,
                    "readOnly": True,
                },
            }
        )
    pod_spec: dict[str, Any] = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "containers": [
            _engine_container(spec, sizing, run, images),
            _sidecar_container(spec, sizing, owner.name, run, images),
        ],
        "volumes": volumes,
        "tolerations": [
            {"key": spec.gpu.resource_name, "operator": "Exists", "effect": "NoSchedule"}
        ],
    }
    if spec.gpu.node_selector:
        pod_spec["nodeSelector"] = dict(spec.gpu.node_selector)
    dep_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(owner.name)},
        # Never drop below the current capacity during a rollout: KV capacity is the product.
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        },
        "template": {
            "metadata": {
                "labels": labels(owner.name),
                "annotations": {
                    "kubectl.kubernetes.io/default-container": "engine",
                    f"{GROUP}/kv-blocks": str(sizing.plan.kv_blocks_per_pod),
                },
            },
            "spec": pod_spec,
        },
    }
    if replicas is not None:
        dep_spec = {"replicas": replicas, **dep_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner),
        "spec": dep_spec,
    }


def service(owner: Owner) -> dict[str, Any]:
    """A ClusterIP Service for the OpenAI API and the sidecar's metrics."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner.name),
            "ports": [
                {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"},
                {
                    "name": "metrics",
                    "port": SIDECAR_PORT,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    }


def pod_disruption_budget(owner: Owner) -> dict[str, Any]:
    """Voluntary evictions (node drains) take one pod at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner.name)}},
    }


def service_monitor(owner: Owner, interval_seconds: int) -> dict[str, Any]:
    """Prometheus operator scrape config for the sidecars."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta(owner),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name)},
            "namespaceSelector": {"matchNames": [owner.namespace]},
            "endpoints": [
                {
                    "port": "metrics",
                    "path": "/metrics",
                    "interval": f"{min(interval_seconds, 15)}s",
                    # The sidecar sets namespace/pod/inferencedeployment itself; keep them.
                    "honorLabels": True,
                }
            ],
        },
    }


# How long HeadroomKVSaturationSoon's forecast must hold before it fires.
SOON_FOR_S = 120


# How long Prometheus must fail to scrape a sidecar before HeadroomSidecarDown fires: longer
# than a sidecar's restart after its liveness probe fails (3 probes 20 s apart, then a start).
SIDECAR_DOWN_FOR_S = 300


def alert_rules(owner: Owner, spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    """The alerts only this deployment can set: its saturation lookahead, and a sidecar its
    ServiceMonitor's scrape cannot reach. The per-pod alerts every deployment shares (cache
    full, preempting, engine down, pool below plan) are the chart's rule file's, once; rendered
    here too, each would fire twice under one name."""
    sel = f'namespace="{owner.namespace}",inferencedeployment="{owner.name}"'
    # The labels Prometheus gives the ServiceMonitor's targets (the sidecar sets none on `up`).
    scraped = f'namespace="{owner.namespace}",service="{owner.name}",endpoint="metrics"'
    lookahead = spec.scaling.saturation_lookahead_seconds
    target = f"{owner.namespace}/{owner.name}"
    return [
        {
            "alert": "HeadroomKVSaturationSoon",
            # The forecast must hold for SOON_FOR_S before the alert fires, and on a steady fill
            # it falls a second a second meanwhile: the threshold counts that time in, so the
            # alert fires with the lookahead left (a pod's start), not the lookahead less 2 min.
            "expr": f"min by (namespace, inferencedeployment, pod) "
            f"(headroom_kv_saturation_eta_seconds{{{sel}}}) < {lookahead + SOON_FOR_S}",
            "for": f"{SOON_FOR_S}s",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": f"{target}: pod {{{{ $labels.pod }}}} is forecast to fill in "
                f"{{{{ $value | humanizeDuration }}}} (lookahead {lookahead}s)",
                "description": "Pod {{ $labels.pod }} saturates in {{ $value | humanizeDuration }}"
                " at the current growth (this InferenceDeployment's "
                "scaling.saturationLookaheadSeconds).",
                "runbook": "README.md#headroomkvsaturationsoon",
            },
        },
        {
            "alert": "HeadroomSidecarDown",
            # A sidecar Prometheus cannot scrape exports nothing, not even the engine_up of
            # HeadroomEngineDown: every per-pod alert goes quiet for the pod, so this one says.
            # One in a crash loop answers a scrape or two between restarts, each resetting the
            # `for:`: scraped less than a quarter of 15 minutes counts as down too, while the
            # pod is still a target (a deleted pod's `up` goes stale and the alert resolves).
            "expr": f"up{{{scraped}}} == 0 or "
            f"(avg_over_time(up{{{scraped}}}[15m]) < 0.25 and up{{{scraped}}})",
            "for": f"{SIDECAR_DOWN_FOR_S}s",
            # The labels the sidecar's own series carry, for routes and inhibitions on them.
            "labels": {
                "severity": "warning",
                "inferencedeployment": owner.name,
                "model": served_model_name(spec, owner.name),
            },
            "annotations": {
                "summary": f"{target}: Prometheus cannot scrape the headroom sidecar of pod "
                "{{ $labels.pod }}",
                "description": f"For {SIDECAR_DOWN_FOR_S // 60} minutes Prometheus has failed "
                "to scrape the headroom sidecar of pod {{ $labels.pod }}, or scraped it less "
                "than a quarter of the last 15 minutes (a sidecar in a crash loop): it has few "
                "or none of the pod's KV metrics, so the KV-cache alerts cannot fire for it.",
                "runbook": "README.md#headroomsidecardown",
            },
        },
    ]


def prometheus_rule(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The alerts as a PrometheusRule."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": _meta(owner),
        "spec": {"groups": [{"name": f"headroom.{owner.namespace}.{owner.name}",
                             "rules": alert_rules(owner, spec)}]},
    }  # fmt: skip


def render(
    owner: Owner,
    spec: InferenceDeploymentSpec,
    sizing: Sizing,
    replicas: int | None,
    *,
    monitoring: frozenset[str] = frozenset(),
    images: HeadroomImages = DEFAULT_IMAGES,
) -> list[dict[str, Any]]:
    """All children in apply order; `monitoring` names the Prometheus operator kinds that
    exist in the cluster (ServiceMonitor, PrometheusRule), and only those are rendered;
    `images` the headroom images the pods run where the spec names none."""
    objs = [
        deployment(owner, spec, sizing, replicas, images),
        service(owner),
        pod_disruption_budget(owner),
    ]
    if "ServiceMonitor" in monitoring:
        objs.append(service_monitor(owner, spec.scaling.interval_seconds))
    if "PrometheusRule" in monitoring:
        objs.append(prometheus_rule(owner, spec))
    return objs
