"""The operator's RBAC needs, least privilege, as ClusterRole rules (for the Helm chart).

Every rule says why it is there. The cluster tests run the operator under a ServiceAccount bound
to exactly `cluster_role_rules()`, so a missing verb fails a test rather than a user.
"""

from __future__ import annotations

from typing import Any

from headroom.operator.crd.models import GROUP, PLURAL

Rule = dict[str, Any]

RULES: tuple[tuple[Rule, str], ...] = (
    (
        {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch", "patch"]},
        "watch InferenceDeployments; patch only to add/remove kopf's finalizer (never spec)",
    ),
    (
        {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch"]},
        "write status: budget, conditions, decisions, kopf's progress",
    ),
    (
        {"apiGroups": [GROUP], "resources": [f"{PLURAL}/finalizers"], "verbs": ["update"]},
        "ownerReferences with blockOwnerDeletion (OwnerReferencesPermissionEnforcement)",
    ),
    (
        {
            "apiGroups": ["apps"],
            "resources": ["deployments"],
            "verbs": ["get", "list", "watch", "create", "patch"],
        },
        "server-side apply of the owned Deployment (an apply that creates also needs create); "
        "watch it, to put back what someone else changed or deleted",
    ),
    (
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["patch"]},
        "the scaling loop changes replicas through the scale subresource, nothing else",
    ),
    (
        {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "create", "patch"]},
        "server-side apply of the owned Service",
    ),
    (
        {
            "apiGroups": ["policy"],
            "resources": ["poddisruptionbudgets"],
            "verbs": ["get", "create", "patch"],
        },
        "server-side apply of the owned PodDisruptionBudget",
    ),
    (
        {
            "apiGroups": ["monitoring.coreos.com"],
            "resources": ["servicemonitors", "prometheusrules"],
            "verbs": ["get", "create", "patch"],
        },
        "ServiceMonitor and PrometheusRule, only used when the Prometheus operator is installed",
    ),
    (
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        "the scaling loop reads pod readiness, age and IPs (direct sidecar scrape)",
    ),
    (
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        "Kubernetes Events for sizing and scaling decisions",
    ),
    (
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "verbs": ["list", "watch"],
        },
        "kopf notices the CRD being installed or upgraded after the operator starts",
    ),
    (
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
        "kopf resolves --namespace patterns (globs) to namespaces as they come and go",
    ),
)

PEERING_RULES: tuple[tuple[Rule, str], ...] = (
    (
        {
            "apiGroups": ["kopf.dev"],
            "resources": ["clusterkopfpeerings"],
            "verbs": ["get", "list", "watch", "patch"],
        },
        "only with --peering: kopf's leader election between operator replicas, through one "
        "ClusterKopfPeering (also when the operator watches only some namespaces)",
    ),
)


def cluster_role_rules(peering: bool = False) -> list[Rule]:
    """ClusterRole `rules:` for `headroom operator` (add peering for --peering)."""
    rules = [dict(rule) for rule, _ in RULES]
    if peering:
        rules += [dict(rule) for rule, _ in PEERING_RULES]
    return rules


def cluster_role(name: str = "headroom-operator", peering: bool = False) -> dict[str, Any]:
    """A complete ClusterRole object."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "headroom"}},
        "rules": cluster_role_rules(peering),
    }
