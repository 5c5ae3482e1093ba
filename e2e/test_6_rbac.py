"""Scenario 6: RBAC. The operator of every scenario ran with nothing but a token of the chart's
ServiceAccount; here we check that identity, that it is denied Secrets (and anything it does not
manage), and that it never hit a Forbidden while doing its work. Named `test_6` so it runs after
scenarios 1-5 and judges the operator's whole log."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from e2e.cluster.harness import Cluster
from e2e.helpers import Operator
from e2e.kube import Release


def _sa_user(release: Release) -> str:
    return f"system:serviceaccount:{release.namespace}:{release.service_account}"


def test_helm_install_deployed_the_release(cluster: Cluster, release: Release) -> None:
    status = cluster.helm("status", release.name, "--namespace", release.namespace).stdout
    assert "STATUS: deployed" in status
    cluster.kubectl("get", "serviceaccount", release.service_account, "-n", release.namespace)
    cluster.kubectl("get", "clusterrole", release.cluster_role)
    cluster.kubectl("get", "clusterrolebinding", release.cluster_role)
    cluster.kubectl("get", "crd", "inferencedeployments.headroom.dev")
    cluster.wait("--for=condition=Available", "deployment", release.name, "-n", release.namespace)


def test_the_operator_authenticates_as_the_chart_service_account(
    cluster: Cluster, release: Release, operator: Operator, operator_kubeconfig: Path
) -> None:
    config = yaml.safe_load(operator_kubeconfig.read_text())
    (user,) = config["users"]
    assert set(user["user"]) == {"token"}, "the operator must hold only the SA token"
    who = cluster.kubectl("auth", "whoami", "-o", "yaml", kubeconfig=operator_kubeconfig).stdout
    assert yaml.safe_load(who)["status"]["userInfo"]["username"] == _sa_user(release)
    assert operator.proc is not None
    assert f"--kubeconfig {operator_kubeconfig}" in " ".join(operator.proc.argv)


@pytest.mark.parametrize(
    ("verb", "resource", "allowed"),
    [
        ("get", "secrets", False),
        ("list", "secrets", False),
        ("watch", "secrets", False),
        ("get", "configmaps", False),
        ("create", "pods", False),
        ("delete", "deployments.apps", False),
        ("patch", "deployments.apps", True),
        ("patch", "inferencedeployments.headroom.dev/status", True),
        ("list", "pods", True),
        ("create", "events", True),
        ("create", "clusterrolebindings.rbac.authorization.k8s.io", False),
    ],
)
def test_service_account_permissions(
    cluster: Cluster,
    release: Release,
    operator_kubeconfig: Path,
    verb: str,
    resource: str,
    allowed: bool,
) -> None:
    res, _, sub = resource.partition("/")
    args = ["auth", "can-i", verb, res, "--all-namespaces"]
    if sub:
        args += ["--subresource", sub]
    out = cluster.kubectl(*args, kubeconfig=operator_kubeconfig, check=False)
    assert out.stdout.strip() == ("yes" if allowed else "no"), (verb, resource, out)


def test_reading_secrets_is_denied_by_the_api_server(
    cluster: Cluster, release: Release, operator_kubeconfig: Path
) -> None:
    out = cluster.kubectl(
        "get", "secrets", "-n", release.namespace, kubeconfig=operator_kubeconfig, check=False
    )
    assert out.returncode != 0
    assert "Forbidden" in out.stderr and _sa_user(release) in out.stderr, out.stderr


# A denial names its reason (the API server's 403s all say Forbidden) or its status as a status:
# a bare 403 has also been a port's digits (40311) and a figure ("demand 403 blocks").
_DENIAL = re.compile(r"forbidden|\(403\)|\b(?:http|status|code)[\s:=]*403\b", re.IGNORECASE)
# Not RBAC: NamespaceLifecycle refuses every write into a namespace being deleted with a 403
# too (the operator's `namespace_terminating`), and kopf's own Event posts meet it when a test's
# namespace goes while a handler still runs.
_TERMINATING = "because it is being terminated"


def _denials(logs: str) -> list[str]:
    return [ln for ln in logs.splitlines() if _DENIAL.search(ln) and _TERMINATING not in ln]


def test_denials_are_rbac_403s_not_ports_figures_or_a_namespace_going() -> None:
    assert _DENIAL.search("(403) Reason: Forbidden")
    assert _DENIAL.search("403 Forbidden: deployments.apps is forbidden")
    assert _DENIAL.search("HTTP 403 on PATCH")
    assert _DENIAL.search("status=403")
    assert not _DENIAL.search("Connect call failed ('127.0.0.1', 40311)")
    assert not _DENIAL.search("Cannot connect to host 127.0.0.1:4031")
    assert not _DENIAL.search("ScaledOut: 2 -> 3: demand 403 blocks (6.00 req/s x 67 block-s)")
    denied = 'deployments.apps "x" is forbidden: User "system:serviceaccount:h:op" cannot patch'
    lifecycle = (
        'POST .../events -> APIForbiddenError(\'events "kopf-event-" is forbidden: unable to '
        "create new content in namespace t-1 because it is being terminated', status=403)"
    )
    assert _denials(f"{denied}\n{lifecycle}\nScaledOut: demand 403 blocks") == [denied]


def test_the_operator_was_never_forbidden(operator: Operator) -> None:
    logs = operator.logs()
    assert logs.strip(), "the operator wrote no log at all"
    bad = _denials(logs)
    assert not bad, "the operator hit RBAC denials:\n" + "\n".join(bad[:20])
