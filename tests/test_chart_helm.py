"""The Helm chart rendered by the real helm: lint, what it renders for which values, RBAC equal to
`headroom.operator.rbac`, the PrometheusRule gate, and `helm template | kubectl apply
--dry-run=server` against the test control plane.

helm and kubectl come from the e2e/cluster build (built once, cached under ~/.cache/headroom).
"""

from __future__ import annotations

import json
import re
import subprocess
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster.harness import BuildError, Cluster, build
from e2e.cluster.pytest_plugin import missing_piece
from headroom.operator.rbac import cluster_role_rules
from headroom.operator.reconcile.children import RUN_AS_USER

pytest_plugins = ["e2e.cluster.pytest_plugin"]

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "headroom"
ALERTS = CHART / "files" / "headroom-alerts.yaml"
DASHBOARD = CHART / "files" / "grafana-dashboard.json"
NAMESPACE = "headroom-system"
CLUSTER_SCOPED = {"customresourcedefinitions", "namespaces", "clusterkopfpeerings"}


@pytest.fixture(scope="module")
def helm() -> Path:
    """The helm binary of the cluster build (no running cluster needed to lint or render)."""
    try:
        result = build()
    except BuildError as exc:
        missing_piece(f"cannot build helm: {exc}")
        raise
    if "helm" in result.failed:
        missing_piece(f"helm failed to build (see {result.bin_dir}/.failed)")
    return result.bin_dir / "helm"


def _run(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(helm), *args], capture_output=True, text=True, timeout=120, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def render(
    helm: Path,
    *sets: str,
    api_versions: tuple[str, ...] = (),
    files: tuple[str, ...] = (),
    release: str = "headroom",
    chart: Path = CHART,
    extra: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """`helm template` of `chart` as `release` with `--set` values and values `files`; the
    objects it renders."""
    args = ["template", release, str(chart), "--namespace", NAMESPACE, *extra]
    for s in sets:
        args += ["--set", s]
    for v in api_versions:
        args += ["--api-versions", v]
    for f in files:
        args += ["-f", f]
    out = _run(helm, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def kinds(objs: list[dict[str, Any]]) -> Counter[str]:
    return Counter(o["kind"] for o in objs)


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def _canon(rules: list[dict[str, Any]]) -> list[str]:
    """Rules as comparable strings (order of rules and of list entries does not matter)."""
    return sorted(
        json.dumps({k: sorted(v) for k, v in r.items() if v}, sort_keys=True) for r in rules
    )


def assert_same_rules(chart: list[dict[str, Any]], operator: list[dict[str, Any]]) -> None:
    """The chart grants exactly what headroom.operator.rbac asks for, and says what differs."""
    ours, theirs = _canon(chart), _canon(operator)
    only_chart = [r for r in ours if r not in theirs]
    only_operator = [r for r in theirs if r not in ours]
    assert ours == theirs, (
        "charts/headroom RBAC and headroom.operator.rbac differ:\n"
        f"  only in the chart: {only_chart}\n  only in rbac.py:   {only_operator}"
    )


# ---------------------------------------------------------------------------- lint and render


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("operator.replicas=2", "operator.peering=headroom"),
        ("operator.watchNamespaces={team-a,team-b}", "operator.prometheusUrl=http://prom:9090"),
        ("serviceAccount.create=false", "serviceAccount.name=robot", "rbac.create=false"),
    ],
    ids=["defaults", "peering", "namespaced", "bring-your-own-sa"],
)
def test_helm_lint_strict(helm: Path, sets: tuple[str, ...]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for s in sets:
        args += ["--set", s]
    out = _run(helm, *args, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


def test_default_render(helm: Path) -> None:
    objs = render(helm)
    assert kinds(objs) == Counter(
        {
            "ServiceAccount": 1,
            "ClusterRole": 1,
            "ClusterRoleBinding": 1,
            "Deployment": 1,
            "Service": 1,
            "ConfigMap": 1,
        }
    )
    for o in objs:
        labels = o["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "headroom"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


def test_every_object_carries_the_chart_labels_and_a_name(helm: Path) -> None:
    """Every object, optional ones too, has the chart's labels and a name from the full name."""
    # Peering, Roles, NetworkPolicy, PrometheusRule and ServiceMonitor rendered as well.
    objs = render(
        helm, "operator.peering=hr", "operator.replicas=2", "operator.watchNamespaces={team-a}",
        "networkPolicy.enabled=true", "metrics.serviceMonitor.enabled=true",
        "prometheusRule.namespace=monitoring", api_versions=("monitoring.coreos.com/v1",),
    )  # fmt: skip
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert set(kinds(objs)) == {
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
        "Deployment", "Service", "ServiceMonitor", "PrometheusRule", "ConfigMap",
        "NetworkPolicy", "ClusterKopfPeering",
    }  # fmt: skip
    for o in objs:
        assert o["metadata"]["labels"] == {
            "helm.sh/chart": f"headroom-{chart['version']}",
            "app.kubernetes.io/name": "headroom",
            "app.kubernetes.io/instance": "headroom",
            "app.kubernetes.io/component": "operator",
            "app.kubernetes.io/version": str(chart["appVersion"]),
            "app.kubernetes.io/managed-by": "Helm",
            "app.kubernetes.io/part-of": "headroom",
        } | ({"grafana_dashboard": "1"} if o["kind"] == "ConfigMap" else {}), o["kind"]
    assert one(objs, "PrometheusRule")["metadata"]["namespace"] == "monitoring"
    # ... and each is named after the full name (the peering object after operator.peering).
    names = {o["kind"]: o["metadata"]["name"] for o in objs}
    assert names == {
        "ServiceAccount": "headroom", "ClusterRole": "headroom", "ClusterRoleBinding": "headroom",
        "Role": "headroom", "RoleBinding": "headroom", "Deployment": "headroom",
        "Service": "headroom-metrics", "ServiceMonitor": "headroom",
        "PrometheusRule": "headroom-alerts", "ConfigMap": "headroom-dashboard",
        "NetworkPolicy": "headroom-inference", "ClusterKopfPeering": "hr",
    }  # fmt: skip


def test_the_operator_pod_selector_is_the_charts_fixed_labels(helm: Path) -> None:
    """The pod selector is fixed: a Deployment's selector is immutable, `helm upgrade` needs it."""
    # The metrics Service and the ServiceMonitor select by the same labels.
    objs = render(helm, "metrics.serviceMonitor.enabled=true",
                  api_versions=("monitoring.coreos.com/v1",))  # fmt: skip
    selector = {
        "app.kubernetes.io/name": "headroom",
        "app.kubernetes.io/instance": "headroom",
        "app.kubernetes.io/component": "operator",
    }
    dep = one(objs, "Deployment")
    assert dep["spec"]["selector"] == {"matchLabels": selector}
    assert dep["spec"]["template"]["metadata"]["labels"] == selector
    assert one(objs, "Service")["spec"]["selector"] == selector
    assert one(objs, "ServiceMonitor")["spec"]["selector"] == {"matchLabels": selector}


def test_operator_deployment_follows_the_values(helm: Path) -> None:
    dep = one(
        render(
            helm,
            "operator.watchNamespaces={team-a,team-b}",
            "operator.prometheusUrl=http://prom.monitoring:9090",
            "operator.allowedPrometheusURLs={http://*.monitoring.svc:9090}",
            "operator.healthPort=9000",
            "image.tag=9.9.9",
        ),
        "Deployment",
    )
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "headroom"
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/headroom-dev/headroom:9.9.9"
    assert c["command"] == ["headroom", "operator"]
    args = c["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args
    assert "--prometheus-url=http://prom.monitoring:9090" in args
    assert "--allow-prometheus-url=http://*.monitoring.svc:9090" in args
    assert "--liveness-port=9000" in args
    # In a pod the kubelet probes, and the Service scrapes, the pod IP: bind all by default.
    assert "--metrics-host=0.0.0.0" in args and "--liveness-host=0.0.0.0" in args
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 9000, "protocol": "TCP"} in c["ports"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["strategy"]["type"] == "Recreate"

    default = one(render(helm), "Deployment")
    (c,) = default["spec"]["template"]["spec"]["containers"]
    assert "--all-namespaces" in c["args"]
    assert c["image"].endswith(
        ":" + yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    )


def test_the_operator_pod_is_locked_down_by_default(helm: Path) -> None:
    """values.yaml's security, probe and resource defaults reach the operator's pod as written."""
    # Non-root with a fixed uid and gid, RuntimeDefault seccomp, no privilege escalation, no
    # capabilities, a read-only root with a writable emptyDir /tmp (Python and kopf want one).
    pod = one(render(helm), "Deployment")["spec"]["template"]["spec"]
    sec = pod["securityContext"]
    assert sec["runAsNonRoot"] is True and sec["seccompProfile"] == {"type": "RuntimeDefault"}
    # The images' own user, as the operator's engine pods run.
    assert sec["runAsUser"] == sec["runAsGroup"] == RUN_AS_USER, sec
    (c,) = pod["containers"]
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert c["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {}}]
    assert c["imagePullPolicy"] == "IfNotPresent"
    assert c["livenessProbe"] == {
        "httpGet": {"path": "/healthz", "port": "health"},
        "initialDelaySeconds": 10,
        "periodSeconds": 20,
        "timeoutSeconds": 5,
    }
    assert c["resources"] == {"requests": {"cpu": "50m", "memory": "128Mi"},
                              "limits": {"memory": "512Mi"}}  # fmt: skip
    dep = one(render(helm, "image.pullPolicy=Always"), "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] == "Always"


def test_bind_addresses_follow_the_values(helm: Path) -> None:
    dep = one(render(helm, "operator.metricsHost=127.0.0.1", "operator.healthHost=::"),
              "Deployment")  # fmt: skip
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--metrics-host=127.0.0.1" in c["args"] and "--liveness-host=::" in c["args"]


def test_the_operator_cli_accepts_the_rendered_flags(helm: Path) -> None:
    from headroom.contract.cli import build_parser

    for sets in [
        (),
        ("operator.peering=p", "operator.replicas=2", "operator.verbose=true"),
        # (healthHost: never loopback, which the kubelet cannot probe; see below.)
        ("operator.metricsHost=::1", "operator.healthHost=::"),
    ]:
        (c,) = one(render(helm, *sets), "Deployment")["spec"]["template"]["spec"]["containers"]
        args = build_parser("operator").parse_args([*c["command"][1:], *c["args"]])
        assert args.command == "operator"


def test_the_pods_run_headroom_images_from_the_operators_registry(helm: Path) -> None:
    # Both images pushed to the user's registry: the operator pulls from there, and so must
    # every pod it creates (REPOSITORY-engine:TAG, REPOSITORY:TAG), not ghcr.io's.
    from headroom.contract.cli import build_parser
    from headroom.operator.handlers import Options

    digest = "sha256:" + "ab" * 32
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for sets, operator, images in [
        ((), f"ghcr.io/headroom-dev/headroom:{app_version}",
         (f"ghcr.io/headroom-dev/headroom:{app_version}",
          f"ghcr.io/headroom-dev/headroom-engine:{app_version}")),
        (("image.repository=registry.example.com:5000/ml/headroom", "image.tag=7.1"),
         "registry.example.com:5000/ml/headroom:7.1",
         ("registry.example.com:5000/ml/headroom:7.1",
          "registry.example.com:5000/ml/headroom-engine:7.1")),
        # The digest pins the operator's own pod only: none can be derived for the engine's.
        (("image.repository=registry.example.com/headroom", f"image.digest={digest}"),
         f"registry.example.com/headroom@{digest}",
         (f"registry.example.com/headroom:{app_version}",
          f"registry.example.com/headroom-engine:{app_version}")),
    ]:  # fmt: skip
        (c,) = one(render(helm, *sets), "Deployment")["spec"]["template"]["spec"]["containers"]
        assert c["image"] == operator
        assert f"--headroom-image={images[0]}" in c["args"], c["args"]
        args = build_parser("operator").parse_args([*c["command"][1:], *c["args"]])
        derived = Options(headroom_image=args.headroom_image).images
        assert (derived.headroom, derived.engine) == images


def test_more_replicas_need_peering(helm: Path) -> None:
    out = _run(helm, "template", "x", str(CHART), "--set", "operator.replicas=2", check=False)
    assert out.returncode != 0
    assert "operator.replicas > 1 needs operator.peering" in out.stderr


def test_peering_renders_the_peering_object_kopf_waits_for(helm: Path) -> None:
    # kopf treats a named peering as mandatory: every replica stays paused until the peering
    # object exists, and the operator peers through one ClusterKopfPeering in every mode.
    assert "ClusterKopfPeering" not in kinds(render(helm))
    for sets in [(), ("operator.watchNamespaces={team-a}",), ("operator.watchNamespaces={t-*}",)]:
        objs = render(helm, "operator.peering=hr", "operator.replicas=2", *sets)
        peering = one(objs, "ClusterKopfPeering")
        assert peering["apiVersion"] == "kopf.dev/v1" and peering["metadata"]["name"] == "hr"
        (c,) = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
        assert "--peering=hr" in c["args"]
        # No --priority: each replica draws its own, so no two tie.
        assert not any(a.startswith("--priority") for a in c["args"])
        # kopf's identity is the pod's name: a container restarted after a kill -9 (an
        # OOMKill) renews its own peering record instead of drawing a new identity that
        # waits behind the dead one's for its 60 s lifetime, half the time, scaling nothing.
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # Its CRD ships in crds/, as the RBAC rule names it.
    crd = yaml.safe_load((CHART / "crds" / "kopf-peering.yaml").read_text())
    assert crd["spec"]["scope"] == "Cluster"
    assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (
        "kopf.dev",
        "ClusterKopfPeering",
    )
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1" and version["served"] and version["storage"]
    (rule,) = [r for r in cluster_role_rules(peering=True) if r["apiGroups"] == ["kopf.dev"]]
    assert rule["resources"] == [crd["spec"]["names"]["plural"]]


def test_the_rate_window_reaches_the_operator(helm: Path) -> None:
    (c,) = one(render(helm), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "--prometheus-rate-window=1m" in c["args"]
    dep = one(render(helm, "operator.prometheusRateWindow=4m"), "Deployment")
    assert "--prometheus-rate-window=4m" in dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_own_service_account_needs_a_name(helm: Path) -> None:
    out = _run(
        helm, "template", "x", str(CHART), "--set", "serviceAccount.create=false", check=False
    )
    assert out.returncode != 0
    assert "serviceAccount.name is required" in out.stderr
    objs = render(helm, "serviceAccount.create=false", "serviceAccount.name=robot")
    assert "ServiceAccount" not in kinds(objs)
    assert one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "robot"
    assert one(objs, "ClusterRoleBinding")["subjects"][0]["name"] == "robot"


# ---------------------------------------------------------------------------- RBAC


@pytest.mark.parametrize("peering", [False, True])
def test_cluster_role_equals_the_operators_rbac(helm: Path, peering: bool) -> None:
    sets = ("operator.peering=headroom",) if peering else ()
    role = one(render(helm, *sets), "ClusterRole")
    assert_same_rules(role["rules"], cluster_role_rules(peering=peering))


def test_named_namespaces_get_roles_and_the_cluster_role_keeps_only_cluster_scope(
    helm: Path,
) -> None:
    objs = render(helm, "operator.watchNamespaces={team-a,team-b}")
    assert kinds(objs)["Role"] == 2 and kinds(objs)["RoleBinding"] == 2
    cluster_rules = one(objs, "ClusterRole")["rules"]
    for rule in cluster_rules:
        assert set(rule["resources"]) <= CLUSTER_SCOPED, rule
    for ns in ("team-a", "team-b"):
        role = next(o for o in objs if o["kind"] == "Role" and o["metadata"]["namespace"] == ns)
        binding = next(
            o for o in objs if o["kind"] == "RoleBinding" and o["metadata"]["namespace"] == ns
        )
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "headroom", "namespace": NAMESPACE}
        ]
        # Together they grant exactly what the operator needs.
        assert_same_rules(cluster_rules + role["rules"], cluster_role_rules())


@pytest.mark.parametrize("entry", ["team-*", "team-a\\,team-b", "team-*\\,!team-x"])
def test_namespace_globs_keep_everything_cluster_wide(helm: Path, entry: str) -> None:
    """A glob, or kopf's pattern of parts joined by ',' (one entry: the exclusion applies), is
    passed to the operator as one --namespace and keeps the rules in the ClusterRole."""
    objs = render(helm, f"operator.watchNamespaces[0]={entry}")
    assert "Role" not in kinds(objs)
    assert_same_rules(one(objs, "ClusterRole")["rules"], cluster_role_rules())
    args = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--namespace={entry.replace(chr(92), '')}" in args


@pytest.mark.parametrize("sets", [(), ("operator.watchNamespaces={a}",), ("operator.peering=p",)])
def test_rbac_never_grants_secrets_or_wildcards(helm: Path, sets: tuple[str, ...]) -> None:
    for obj in render(helm, *sets):
        if obj["kind"] not in ("ClusterRole", "Role"):
            continue
        for rule in obj["rules"]:
            assert "secrets" not in rule["resources"], rule
            assert "configmaps" not in rule["resources"], rule
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], rule
            assert not set(rule["verbs"]) & {"delete", "deletecollection", "escalate", "bind"}


def test_rbac_off_renders_no_rbac(helm: Path) -> None:
    objs = render(helm, "rbac.create=false")
    assert not {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"} & set(kinds(objs))


# ---------------------------------------------------------------------------- monitoring


def test_prometheus_rule_only_where_the_prometheus_operator_is_served(helm: Path) -> None:
    assert "PrometheusRule" not in kinds(render(helm))
    objs = render(
        helm, "prometheusRule.labels.release=kps", api_versions=("monitoring.coreos.com/v1",)
    )
    rule = one(objs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kps"
    # The sidecar's alert file, verbatim: its {{ $labels }} templates are not Helm's.
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    off = render(helm, "prometheusRule.enabled=false", api_versions=("monitoring.coreos.com/v1",))
    assert "PrometheusRule" not in kinds(off)


def test_a_runbook_base_url_gives_every_alert_an_absolute_runbook_url(helm: Path) -> None:
    """The file's runbook links are relative to README.md, which Alertmanager cannot open: with
    runbookBaseURL each alert also gets runbook_url, that URL and its section's anchor."""
    base = "https://git.example.com/headroom/blob/main/README.md"
    monitoring = ("monitoring.coreos.com/v1",)
    objs = render(helm, f"prometheusRule.runbookBaseURL={base}", api_versions=monitoring)
    rules = [r for g in one(objs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    for file_rule, rule in zip(
        [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]],
        rules,
        strict=True,
    ):
        runbook = file_rule["annotations"]["runbook"]
        assert runbook.startswith("README.md#"), runbook
        expected = dict(
            file_rule["annotations"], runbook_url=base + runbook.removeprefix("README.md")
        )
        assert rule["annotations"] == expected, rule["alert"]
    assert len(rules) >= 5


def test_monitoring_defaults_where_the_prometheus_operator_is_served(helm: Path) -> None:
    """Alerts and dashboard on in the release's namespace; ServiceMonitor, NetworkPolicy off."""
    # The operator's ServiceMonitor needs labels matching your Prometheus': off by default.
    objs = render(helm, api_versions=("monitoring.coreos.com/v1",))
    assert kinds(objs)["PrometheusRule"] == 1 and kinds(objs)["ConfigMap"] == 1
    # Both in the release's namespace unless prometheusRule/grafanaDashboard.namespace say.
    for kind in ("PrometheusRule", "ConfigMap"):
        assert one(objs, kind)["metadata"]["namespace"] == NAMESPACE, kind
    assert "ServiceMonitor" not in kinds(objs) and "NetworkPolicy" not in kinds(objs)
    sm = one(render(helm, "metrics.serviceMonitor.enabled=true",
                    api_versions=("monitoring.coreos.com/v1",)), "ServiceMonitor")  # fmt: skip
    assert sm["spec"]["endpoints"][0]["interval"] == "30s"


def test_operator_service_monitor_is_gated_too(helm: Path) -> None:
    on = ("metrics.serviceMonitor.enabled=true",)
    assert "ServiceMonitor" not in kinds(render(helm, *on))
    sm = one(render(helm, *on, api_versions=("monitoring.coreos.com/v1",)), "ServiceMonitor")
    svc = one(render(helm), "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    # headroom_desired_replicas{namespace=<the InferenceDeployment's>}: the dashboard filters
    # on it, and Prometheus would rename it exported_namespace without honorLabels.
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True


def test_dashboard_config_map_embeds_the_dashboard(helm: Path) -> None:
    cm = one(render(helm, "grafanaDashboard.namespace=monitoring"), "ConfigMap")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (body,) = cm["data"].values()
    assert json.loads(body) == json.loads(DASHBOARD.read_text())
    assert "ConfigMap" not in kinds(render(helm, "grafanaDashboard.enabled=false"))


def test_notes_render(cluster: Cluster) -> None:
    out = cluster.helm(
        "install", "headroom", str(CHART), "--dry-run=server", "--namespace", NAMESPACE
    ).stdout
    assert "kubectl get inferencedeployments" in out
    assert "watches InferenceDeployments (headroom.dev/v1alpha1) in every namespace" in out
    # The test cluster runs no Prometheus operator: the notes say where the alerts are instead.
    assert "Alerts: not installed" in out and "headroom-alerts.yaml" in out


# ---------------------------------------------------------------------------- the API server


@pytest.mark.parametrize("namespaced", [False, True], ids=["cluster-wide", "namespaced"])
def test_template_applies_with_server_dry_run(
    cluster: Cluster, cluster_namespace: str, namespaced: bool
) -> None:
    args = ["template", "headroom", str(CHART), "--namespace", cluster_namespace]
    args += ["--include-crds", "--kube-version", cluster.version]
    if namespaced:
        args += ["--set", f"operator.watchNamespaces={{{cluster_namespace}}}"]
    manifest = cluster.helm(*args).stdout
    out = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=manifest)
    applied = out.stdout
    assert "customresourcedefinition.apiextensions.k8s.io/inferencedeployments.headroom.dev" in (
        applied
    )
    for obj in (d for d in yaml.safe_load_all(manifest) if d):
        lower = obj["kind"].lower()
        assert f"{lower}" in applied.lower() and obj["metadata"]["name"] in applied
    assert applied.count("(server dry run)") == len([d for d in yaml.safe_load_all(manifest) if d])


# ---------------------------------------------------------------------------- NetworkPolicy


def test_network_policy_is_off_by_default(helm: Path) -> None:
    assert "NetworkPolicy" not in kinds(render(helm))
    assert "NetworkPolicy" not in kinds(render(helm, "operator.watchNamespaces={team-a}"))


def test_network_policy_needs_namespaces(helm: Path) -> None:
    out = _run(helm, "template", "x", str(CHART), "--set", "networkPolicy.enabled=true",
               check=False)  # fmt: skip
    assert out.returncode != 0
    assert "networkPolicy.namespaces" in out.stderr


def _policies(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["namespace"]: o for o in objs if o["kind"] == "NetworkPolicy"}


def test_network_policy_admits_only_the_gateway_and_the_scrapes(helm: Path) -> None:
    from headroom.contract.ports import ENGINE_PORT, ENGINE_STATS_PORT, SIDECAR_PORT
    from headroom.operator.crd.models import InferenceDeploymentSpec
    from headroom.operator.reconcile.children import Owner, deployment, labels
    from headroom.operator.reconcile.sizing import size

    objs = render(helm, "networkPolicy.enabled=true", "operator.watchNamespaces={team-a,team-b}")
    policies = _policies(objs)
    assert set(policies) == {"team-a", "team-b"}
    spec = policies["team-a"]["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    # It selects every InferenceDeployment's pods, whatever the name, and nothing else.
    selector = spec["podSelector"]
    assert selector["matchLabels"].items() <= labels("any-name").items()
    assert {"key": "headroom.dev/inferencedeployment", "operator": "Exists"} in selector[
        "matchExpressions"
    ]
    # Its named ports are the containers' ports.
    s = InferenceDeploymentSpec.model_validate(
        {"model": {"preset": "llama-3.1-8b"}, "gpu": {"type": "h100"},
         "traffic": {"peakConcurrency": 1, "contextTokens": 128}}
    )  # fmt: skip
    pod = deployment(Owner("x", "team-a", "u"), s, size(s), 1)["spec"]["template"]["spec"]
    ports = {p["name"]: p["containerPort"] for c in pod["containers"] for p in c["ports"]}
    assert ports == {"http": ENGINE_PORT, "stats": ENGINE_STATS_PORT, "metrics": SIDECAR_PORT}
    by_port = {r["ports"][0]["port"]: r["from"] for r in spec["ingress"]}
    # The engine's stats port has no rule: only the kubelet (the node, always admitted) and
    # the sidecar (in the pod, over loopback) use it.
    assert set(by_port) == {"http", "metrics"}
    # The OpenAI API: only the namespace's gateway pods (no namespaceSelector: same namespace).
    assert by_port["http"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "gateway"}}}
    ]
    # The sidecars: the monitoring namespace's Prometheus, and the operator's direct scrape.
    metrics_from = by_port["metrics"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {}} in metrics_from  # fmt: skip
    operator_pod = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    (op,) = [f for f in metrics_from if f["namespaceSelector"]["matchLabels"].get(
        "kubernetes.io/metadata.name") == NAMESPACE]  # fmt: skip
    assert op["podSelector"]["matchLabels"].items() <= operator_pod.items()


def test_network_policy_selectors_follow_the_values(helm: Path) -> None:
    objs = render(
        helm, "networkPolicy.enabled=true", "networkPolicy.namespaces={serving}",
        "networkPolicy.gateway.podSelector.matchLabels.app=envoy",
        "networkPolicy.gateway.namespaceSelector.matchLabels.role=ingress",
        "networkPolicy.monitoring.namespaceSelector.matchLabels.team=obs",
        "networkPolicy.monitoring.podSelector.matchLabels.app=prometheus",
    )  # fmt: skip
    (policy,) = _policies(objs).values()
    assert policy["metadata"]["namespace"] == "serving"
    by_port = {r["ports"][0]["port"]: r["from"] for r in policy["spec"]["ingress"]}
    (gateway,) = by_port["http"]
    assert gateway["podSelector"]["matchLabels"]["app"] == "envoy"
    assert gateway["namespaceSelector"] == {"matchLabels": {"role": "ingress"}}
    # --set merges into the default selector's labels.
    monitoring = {"kubernetes.io/metadata.name": "monitoring", "team": "obs"}
    assert {
        "namespaceSelector": {"matchLabels": monitoring},
        "podSelector": {"matchLabels": {"app": "prometheus"}},
    } in by_port["metrics"]


def test_a_null_monitoring_selector_admits_every_namespace_not_only_its_own(helm: Path) -> None:
    """`namespaceSelector: null` rendered as is means the policy's own namespace to Kubernetes,
    which cuts Prometheus off the sidecars; null is "any", as the pod selectors' is."""
    objs = render(
        helm, "networkPolicy.enabled=true", "networkPolicy.namespaces={serving}",
        "networkPolicy.monitoring.namespaceSelector=null",
    )  # fmt: skip
    (policy,) = _policies(objs).values()
    by_port = {r["ports"][0]["port"]: r["from"] for r in policy["spec"]["ingress"]}
    assert {"namespaceSelector": {}, "podSelector": {}} in by_port["metrics"]


def test_network_policy_applies_with_server_dry_run(
    cluster: Cluster, cluster_namespace: str
) -> None:
    manifest = cluster.helm(
        "template", "headroom", str(CHART), "--namespace", cluster_namespace,
        "--kube-version", cluster.version, "--set", "networkPolicy.enabled=true",
        "--set", f"networkPolicy.namespaces={{{cluster_namespace}}}",
        "--show-only", "templates/networkpolicy.yaml",
    ).stdout  # fmt: skip
    out = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=manifest)
    assert "networkpolicy.networking.k8s.io/headroom-inference created (server dry run)" in (
        out.stdout
    ), out.stdout


@pytest.mark.parametrize("pattern", ["!kube-system", "team-[ab]"])
def test_kopf_namespace_patterns_keep_everything_cluster_wide(helm: Path, pattern: str) -> None:
    # kopf reads `!` (exclude) and `[...]` as patterns: no Role can name such a namespace. (A
    # comma-separated list is a kopf pattern too, but the operator refuses it: see the schema.)
    objs = render(helm, "operator.watchNamespaces[0]=" + pattern)
    assert "Role" not in kinds(objs)
    assert_same_rules(one(objs, "ClusterRole")["rules"], cluster_role_rules())


def test_a_long_release_name_keeps_the_metrics_service_a_dns_label(helm: Path) -> None:
    release = "inference-platform-llm-autoscaler-production-eu1"  # 48 characters, no "headroom"
    (svc,) = [d for d in render(helm, release=release) if d["kind"] == "Service"]
    name = svc["metadata"]["name"]
    assert len(name) <= 63 and name.endswith("-metrics"), name


@pytest.mark.parametrize(("tag", "image"), [("2", ":2"), ("1.10", ":1.10")])
def test_a_numeric_image_tag_is_the_tag(helm: Path, tag: str, image: str) -> None:
    dep = one(render(helm, f"image.tag={tag}"), "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"].endswith(image)


def test_dashboard_labels_can_be_dropped(helm: Path) -> None:
    objs = render(helm, "grafanaDashboard.labels=null")
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"]]
    assert "grafana_dashboard" not in cm["metadata"]["labels"]


# ---------------------------------------------------------------------------- values.schema.json

# Each would install as "deployed" and leave an operator exiting 2 at every start, or fail
# half-way through the install; the schema refuses it first, naming the value.
BAD_VALUES = [
    ("operator.logFormat=xml", "/operator/logFormat"),
    ("prometheusRule.runbookBaseURL=README.md", "/prometheusRule/runbookBaseURL"),
    ("operator.prometheusRateWindow=abc", "/operator/prometheusRateWindow"),
    ("operator.prometheusUrl=prometheus:9090", "/operator/prometheusUrl"),
    ("operator.prometheusUrl=http://prometheus:0", "/operator/prometheusUrl"),
    ("operator.replicas=two", "/operator/replicas"),
    ("operator.replicas=-1", "/operator/replicas"),
    ("operator.healthPort=0", "/operator/healthPort"),
    ("operator.metricsPort=70000", "/operator/metricsPort"),
    ("operator.watchNamespaces[0]=team-a\\,", "/operator/watchNamespaces/0"),
    ("operator.metricsHost=localhost", "/operator/metricsHost"),
    # An address and a port, or colons alone: the operator reads an IP address, nothing else.
    ("operator.metricsHost=0.0.0.0:8080", "/operator/metricsHost"),
    ("operator.metricsHost=:", "/operator/metricsHost"),
    ("operator.healthHost=1:2", "/operator/healthHost"),
    ("operator.healthHost=0.0.0.0:8081", "/operator/healthHost"),
    # A zone belongs to an IPv6 address only, and is never empty or a second one.
    ("operator.metricsHost=10.0.0.1%eth0", "/operator/metricsHost"),
    ("operator.metricsHost=fe80::1%", "/operator/metricsHost"),
    ("operator.healthHost=fe80::1%a%b", "/operator/healthHost"),
    ("operator.healthHost=1:2%eth0", "/operator/healthHost"),
    # Not RFC 1123 subdomains: the API server would refuse the objects named after them.
    ("operator.peering=a..b", "/operator/peering"),
    ("operator.peering=a.-b", "/operator/peering"),
    ("serviceAccount.name=a..b", "/serviceAccount/name"),
    ("serviceAccount.name=a.-b", "/serviceAccount/name"),
    ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
    ("image.digest=sha256:abc", "/image/digest"),
    # A tag in the repository: the operator's --headroom-image would be REPO:1.0:TAG.
    ("image.repository=registry.example.com/headroom:1.0", "/image/repository"),
    ("operator.logformat=text", "logformat"),  # a typo in a key
    (
        "podAnnotations.sidecar\\.istio\\.io/inject=false",
        "/podAnnotations/sidecar.istio.io~1inject",
    ),
]


@pytest.mark.parametrize(("value", "path"), BAD_VALUES, ids=[v for v, _ in BAD_VALUES])
def test_the_schema_refuses_values_the_operator_or_kubernetes_would(
    helm: Path, value: str, path: str
) -> None:
    for args in (["template", "x", str(CHART)], ["lint", "--strict", str(CHART)]):
        out = _run(helm, *args, "--set", value, check=False)
        said = out.stdout + out.stderr
        assert out.returncode != 0, f"helm {args[0]} accepted {value}"
        assert "don't meet the specifications of the schema" in said and path in said, said


# Each value at a bound of what Kubernetes takes (a namespace is a DNS label of at most 63
# characters, a pull secret {name: ...} with a name): the schema takes it, or refuses it at the
# path shown. A string "false" for a switch would be true to the templates.
SCHEMA_BOUNDS: list[tuple[dict[str, Any], str | None]] = [
    ({"imagePullSecrets": [{"name": "r"}]}, None),
    ({"imagePullSecrets": [{"name": ""}]}, "/imagePullSecrets/0/name"),
    ({"imagePullSecrets": [{}]}, "/imagePullSecrets/0"),
    ({"imagePullSecrets": ["regcred"]}, "/imagePullSecrets/0"),
    ({"grafanaDashboard": {"namespace": "a" * 63}}, None),
    ({"grafanaDashboard": {"namespace": "a" * 64}}, "/grafanaDashboard/namespace"),
    ({"prometheusRule": {"namespace": "a" * 64}}, "/prometheusRule/namespace"),
    ({"networkPolicy": {"enabled": True, "namespaces": ["a" * 63]}}, None),
    ({"networkPolicy": {"enabled": True, "namespaces": ["a" * 64]}}, "/networkPolicy/namespaces/0"),
    ({"metrics": {"serviceMonitor": {"interval": ""}}}, "/metrics/serviceMonitor/interval"),
    ({"operator": {"prometheusRateWindow": ""}}, "/operator/prometheusRateWindow"),
    ({"operator": {"healthPort": "8081"}}, "/operator/healthPort"),
    ({"prometheusRule": {"enabled": "false"}}, "/prometheusRule/enabled"),
    ({"grafanaDashboard": {"enabled": "false"}}, "/grafanaDashboard/enabled"),
    *[({"nameOverride": v}, "/nameOverride") for v in ["n", "Y", "off", "On"]],
    # A plain watched namespace gets a Role: one no namespace can be named fails the install,
    # and a name twice renders its Role twice (a real install then fails half-way).
    ({"operator": {"watchNamespaces": ["!a-1", "team-*", "[ab]x", "x?", "t-*,!t-x"]}}, None),
    ({"operator": {"watchNamespaces": ["-a"]}}, "/operator/watchNamespaces/0"),
    ({"operator": {"watchNamespaces": ["a", "team]"]}}, "/operator/watchNamespaces/1"),
    ({"operator": {"watchNamespaces": ["a["]}}, "/operator/watchNamespaces/0"),
    ({"operator": {"watchNamespaces": ["a,"]}}, "/operator/watchNamespaces/0"),
    ({"operator": {"watchNamespaces": ["a", "a"]}}, "/operator/watchNamespaces"),
    ({"networkPolicy": {"enabled": True, "namespaces": ["a", "a"]}}, "/networkPolicy/namespaces"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("values", "path"), SCHEMA_BOUNDS, ids=[json.dumps(v)[:60] for v, _ in SCHEMA_BOUNDS]
)
def test_the_schema_bounds_are_kubernetes_bounds(
    helm: Path, tmp_path: Path, values: dict[str, Any], path: str | None
) -> None:
    """values.schema.json takes each value Kubernetes takes, and refuses the next one."""
    file = _values_file(tmp_path, values)
    if path is None:
        lint = _run(helm, "lint", "--strict", str(CHART), "-f", file, check=False)
        assert lint.returncode == 0, lint.stdout + lint.stderr
        render(helm, files=(file,), release="x")
    else:
        said = _refusal(helm, "-f", file)
        assert "don't meet the specifications of the schema" in said, said
        assert f"at '{path}'" in said, said


# The reviewer's non-default values: every section set, as a real installation would.
REALISTIC_VALUES: dict[str, Any] = {
    "nameOverride": "hrx",
    "fullnameOverride": "a-very-long-full-name-override-for-the-headroom-operator-objects-xyz",
    "image": {"tag": "0.3.0", "pullPolicy": "Always", "digest": "sha256:" + "ab" * 32},
    "imagePullSecrets": [{"name": "regcred"}],
    "operator": {
        "replicas": 2,
        "peering": "stress-peer",
        "watchNamespaces": ["team-a", "inference", "!kube-system"],
        "prometheusUrl": "https://prometheus-operated.monitoring.svc:9090/prom",
        "allowedPrometheusURLs": ["http://*.monitoring.svc:9090"],
        "prometheusRateWindow": "2m30s",
        "metricsPort": 0,
        "metricsHost": "::",
        "healthPort": 9000,
        "healthHost": "10.0.0.1",
        "logFormat": "text",
        "verbose": True,
        "extraArgs": ["--resync-seconds=60"],
        "extraEnv": [{"name": "FOO", "value": "bar"}],
        "resources": {"limits": {"cpu": 1}},
    },
    "metrics": {
        "service": {"enabled": False},
        "serviceMonitor": {"enabled": True, "interval": "1m", "labels": {"release": "kps"}},
    },
    "serviceAccount": {"annotations": {"iam.gke.io/gcp-service-account": "x@y.iam"}},
    "rbac": {"create": True},
    "prometheusRule": {"enabled": False, "namespace": "monitoring", "labels": {"release": "kps"}},
    "grafanaDashboard": {"namespace": "monitoring", "annotations": {"grafana_folder": "LLM"}},
    "networkPolicy": {
        "enabled": True,
        "namespaces": ["inference"],
        "gateway": {"namespaceSelector": {"matchLabels": {"role": "ingress"}}},
    },
    "podLabels": {"team": "ml"},
    "podAnnotations": {"a": "b"},
    "podSecurityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 2000},
    "securityContext": {"readOnlyRootFilesystem": False},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}
    ],
    "affinity": {"nodeAffinity": {}},
    "priorityClassName": "system-cluster-critical",
}


def test_the_schema_accepts_the_defaults_and_a_realistic_values_file(
    helm: Path, tmp_path: Path
) -> None:
    values = _values_file(tmp_path, REALISTIC_VALUES)
    for extra in ([], ["-f", values]):
        lint = _run(helm, "lint", "--strict", str(CHART), *extra, check=False)
        assert lint.returncode == 0, lint.stdout + lint.stderr
    render(helm, release="x")
    dep = one(render(helm, files=(values,), release="x"), "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--prometheus-rate-window=2m30s" in c["args"] and "--log-format=text" in c["args"]
    # Schema-valid values are operator-valid: `headroom operator` parses what was rendered.
    from headroom.contract.cli import build_parser

    assert build_parser("operator").parse_args([*c["command"][1:], *c["args"]])


def test_the_pod_takes_the_scheduling_and_pull_values_as_written(
    helm: Path, tmp_path: Path
) -> None:
    """Pull secrets, scheduling, labels, annotations, env and flags reach the operator's pod."""
    # A private registry's pod without its pull secret never starts; a tainted node's without
    # its toleration never schedules: each must arrive as the values file wrote it.
    values = _values_file(tmp_path, REALISTIC_VALUES)
    pod = one(render(helm, files=(values,), release="x"), "Deployment")["spec"]["template"]
    spec = pod["spec"]
    for key in ("imagePullSecrets", "nodeSelector", "tolerations", "affinity", "priorityClassName"):
        assert spec[key] == REALISTIC_VALUES[key], key
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["metadata"]["annotations"] == REALISTIC_VALUES["podAnnotations"]
    (c,) = spec["containers"]
    assert {"name": "FOO", "value": "bar"} in c["env"]
    assert c["args"][-1] == "--resync-seconds=60"


def test_a_numeric_app_version_stays_a_string(helm: Path, tmp_path: Path) -> None:
    """`helm package --app-version 1.10`: the version label is the string 1.10, not the float."""
    # Unquoted, YAML reads the label as 1.1 (a number), which the API server refuses as a label.
    _run(helm, "package", str(CHART), "--app-version", "1.10", "--destination", str(tmp_path))
    (package,) = tmp_path.glob("headroom-*.tgz")
    objs = render(helm, chart=package)
    for o in objs:
        assert o["metadata"]["labels"]["app.kubernetes.io/version"] == "1.10", o["kind"]
    (c,) = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "ghcr.io/headroom-dev/headroom:1.10"


# ---------------------------------------------------------------------------- NOTES.txt

_NOTES_PROBE = """{{- define "headroom.test.notes" }}
%s
{{- end }}
"""


def _notes(helm: Path, chart: Path) -> str:
    """NOTES.txt of `chart` as `helm install` prints it (on a cluster without the Prometheus
    operator), rendered by `helm template` with no cluster: wrapped in a ConfigMap."""
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "_test_notes.tpl").write_text(_NOTES_PROBE % notes)
    (chart / "templates" / "test-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ include "headroom.test.notes" . | toJson }}}\n'
    )
    out = _run(helm, "template", "notes", str(chart), "--show-only", "templates/test-notes.yaml")
    notes_text: str = yaml.safe_load(out.stdout)["data"]["notes"]
    return notes_text


def test_notes_name_only_what_the_packaged_chart_holds(helm: Path, tmp_path: Path) -> None:
    _run(helm, "package", str(CHART), "--destination", str(tmp_path))
    (package,) = tmp_path.glob("headroom-*.tgz")
    with tarfile.open(package) as tar:
        members = set(tar.getnames())
        tar.extractall(tmp_path / "untar", filter="data")
    assert "headroom/files/headroom-alerts.yaml" in members
    assert not any(m.startswith("headroom/examples/") for m in members)
    notes = _notes(helm, tmp_path / "untar" / "headroom")
    assert "Alerts: not installed" in notes
    # Paths only a git checkout has, or a directory the chart does not ship.
    assert "charts/headroom/" not in notes, notes
    assert "chart's examples/" not in notes, notes
    assert "examples/ directory of the headroom repository" in notes
    # Every chart file the notes name is in the package, and they say how to get at it.
    named = set(re.findall(r"\b((?:files|crds|templates)/[\w./-]+\.(?:yaml|json))", notes))
    assert named, notes
    for path in named:
        assert f"headroom/{path}" in members, f"NOTES name {path}, not in the package"
    assert "helm pull" in notes and "--untar" in notes


# ---------------------------------------------------------------------------- checks beyond types


def _refusal(helm: Path, *args: str, lint: bool = True) -> str:
    """What `helm template` (as `helm install` renders) and, for a value the schema refuses,
    `helm lint --strict` say refusing `args`; each must refuse. (Lint renders with `fail` turned
    into a log line: only the schema fails it.)"""
    said = ""
    cmds = [["template", "x", str(CHART)]] + ([["lint", "--strict", str(CHART)]] if lint else [])
    for cmd in cmds:
        out = _run(helm, *cmd, *args, check=False)
        assert out.returncode != 0, f"helm {cmd[0]} accepted {args}:\n{out.stdout[:2000]}"
        said += out.stdout + out.stderr
    return said


class _QuotedStrings(yaml.SafeDumper):
    """Every string double-quoted: PyYAML leaves some plain (1e3) that helm's YAML reads as a
    number, and the value would then be refused for its type, not for what it says."""


_QuotedStrings.add_representer(
    str, lambda dumper, s: dumper.represent_scalar("tag:yaml.org,2002:str", s, style='"')
)


def _values_file(tmp_path: Path, values: dict[str, Any]) -> str:
    """`values` as a values file, each string reaching helm as that string."""
    path = tmp_path / f"values-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.dump(values, Dumper=_QuotedStrings))
    return str(path)


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    head, _, rest = dotted.partition(".")
    return {head: _nested(rest, value) if rest else value}


@pytest.mark.parametrize(
    ("text", "said", "schema"),
    [
        # YAML reads it as the float 1.1: the digits are gone before the chart sees it.
        ("tag: 1.10", "at '/image/tag'", True),
        # A float is exact below 2**53 only: ...993 would come back as ...992.
        ("tag: 9007199254740993", "Give it as a string", False),
    ],
)
def test_a_numeric_tag_a_float_cannot_hold_is_refused(
    helm: Path, tmp_path: Path, text: str, said: str, schema: bool
) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(f"image:\n  {text}\n")
    for upgrade in ((), ("--is-upgrade",)):
        assert said in _refusal(helm, "-f", str(values), *upgrade, lint=schema)


def _image_and_flag(out: str) -> tuple[str, list[str]]:
    dep = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c["image"], c["args"]


@pytest.mark.parametrize("text", ["1234567", "2", "2.0", "010", "0x10", "1e3"])
def test_a_numeric_tag_is_refused_install_or_upgrade(helm: Path, tmp_path: Path, text: str) -> None:
    # YAML gives the chart a float, which cannot tell 2 from 2.0, 010, 0x10 or 1e3: each would
    # render another image (2.0 as :2, 010 as :8) or the digits helm prints (1.234567e+06).
    # An upgrade is no different: Flux and `helm upgrade -f` give the user's own values.
    values = tmp_path / "values.yaml"
    values.write_text(f"image:\n  tag: {text}\n")
    for upgrade in ((), ("--is-upgrade",)):
        said = _refusal(helm, "-f", str(values), *upgrade, lint=False)
        assert "Give it as a string" in said or "at '/image/tag'" in said, said
    assert "Give it as a string" in _refusal(helm, "--set-json", "image.tag=2", lint=False)


@pytest.mark.parametrize("tag", [1234567, 2, 20240101120000])
def test_a_stored_numeric_tag_is_refused_with_the_flag_that_keeps_it(
    helm: Path, tmp_path: Path, tag: int
) -> None:
    # helm keeps a release's values as JSON: `helm upgrade --reuse-values` of
    # `--set image.tag=2` reads 2.0. It is refused naming --set-string, which keeps the tag.
    stored = tmp_path / "stored.json"  # what helm keeps of `--set image.tag=N`, read back
    stored.write_text(json.dumps({"image": {"tag": float(tag)}}))
    said = _refusal(helm, "--is-upgrade", "-f", str(stored), lint=False)
    assert f"--set-string image.tag={tag} " in said and "--reuse-values" in said, said
    out = _run(helm, "template", "x", str(CHART), "--is-upgrade", "-f", str(stored),
               "--set-string", f"image.tag={tag}").stdout  # fmt: skip
    image, flags = _image_and_flag(out)
    assert image == f"ghcr.io/headroom-dev/headroom:{tag}"
    assert f"--headroom-image=ghcr.io/headroom-dev/headroom:{tag}" in flags
    # A 0 is the appVersion, as `--set image.tag=0` is, so that an upgrade renders the same.
    zero = _run(helm, "template", "x", str(CHART), "--set", "image.tag=0").stdout
    stored_zero = _run(
        helm, "template", "x", str(CHART), "--is-upgrade", "--set-json", "image.tag=0.0"
    ).stdout
    assert _image_and_flag(stored_zero) == _image_and_flag(zero)


@pytest.mark.parametrize("tag", ["1.10", "1234567", "20240101120000", "2", "v1.10"])
def test_a_quoted_numeric_tag_in_a_values_file_is_the_tag(
    helm: Path, tmp_path: Path, tag: str
) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(f'image:\n  tag: "{tag}"\n')
    dep = one(render(helm, files=(str(values),), release="x"), "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"] == f"ghcr.io/headroom-dev/headroom:{tag}"
    assert f"--headroom-image=ghcr.io/headroom-dev/headroom:{tag}" in c["args"]


# Written unquoted into the manifest, each would be read as another type ("true", "1.0", "{a}"),
# add keys to the pod spec (a newline), or name an object the API server refuses.
BAD_NAMES = [
    *[("priorityClassName", v) for v in
      ["true", "yes", "1.0", "1e3", "0x1f", "{a}", "x\n      hostNetwork: true", "a..b", "High"]],
    *[("fullnameOverride", v) for v in
      ["true", "1.0", "{a}", "hr\n  namespace: kube-system", "hr-", "Hr", "a..b", "a_b"]],
    *[("nameOverride", v) for v in
      ["true", "True", "NO", "null", "1.0", "1E3", "0X1F", "123", "{a}",
       "hr\n    evil: injected", "a b", "_hr", "hr.", "x" * 64]],
    *[("operator.peering", v) for v in ["true", "1.0", "a..b", "a.-b"]],
    *[("serviceAccount.name", v) for v in ["no", "1.0", "a..b", "a.-b"]],
]  # fmt: skip


@pytest.mark.parametrize(("key", "value"), BAD_NAMES, ids=[f"{k}={v!r}" for k, v in BAD_NAMES])
def test_the_schema_refuses_names_that_change_type_or_inject_yaml(
    helm: Path, tmp_path: Path, key: str, value: str
) -> None:
    said = _refusal(helm, "-f", _values_file(tmp_path, _nested(key, value)))
    path = "/" + key.replace(".", "/")
    assert "don't meet the specifications of the schema" in said and f"at '{path}'" in said, said


# Names the chart before the schema's name checks installed, which `helm upgrade` must keep
# taking: every object but the metrics Service takes a DNS subdomain, and nameOverride, with
# fullnameOverride set, reaches only the app.kubernetes.io/name label (a label value).
KEPT_NAMES: list[dict[str, Any]] = [
    {"fullnameOverride": "1headroom", "metrics": {"service": {"enabled": False}}},
    {"fullnameOverride": "team.headroom", "metrics": {"service": {"enabled": False}}},
    {"fullnameOverride": "team.headroom", "operator": {"metricsPort": 0}},
    {"fullnameOverride": "headroom", "nameOverride": "Headroom_Operator"},
    {"nameOverride": "ops.v2", "metrics": {"service": {"enabled": False}}},
]


@pytest.mark.parametrize("values", KEPT_NAMES, ids=[json.dumps(v) for v in KEPT_NAMES])
def test_names_the_previous_chart_took_still_render(
    helm: Path, tmp_path: Path, values: dict[str, Any]
) -> None:
    objs = render(helm, files=(_values_file(tmp_path, values),), release="x")
    full = values.get("fullnameOverride") or f"x-{values['nameOverride']}"
    assert one(objs, "Deployment")["metadata"]["name"] == full
    label = values.get("nameOverride", "headroom")
    for o in objs:
        assert o["metadata"]["name"].startswith(full), o["metadata"]["name"]
        assert o["metadata"]["labels"]["app.kubernetes.io/name"] == label


# Schema-valid names Kubernetes refuses for an object the chart renders: refused naming the value
# and the object. The metrics Service is a DNS-1035 label before Kubernetes 1.36 (helm template's
# default is older), a DNS-1123 label from 1.36 on (RelaxedServiceNameValidation).
NAMES_REFUSED_BY_THE_CHART = [
    ({"fullnameOverride": "1headroom"}, (), "fullnameOverride: 1headroom: the metrics Service"),
    ({"fullnameOverride": "team.headroom"}, ("--kube-version", "1.36.0"),
     "fullnameOverride: team.headroom: the metrics Service"),
    ({"nameOverride": "ops.v2"}, (), "nameOverride: ops.v2, after the release name x"),
    ({"nameOverride": "Headroom_Operator"}, (), "the operator's objects would be named "
     "x-Headroom_Operator, which Kubernetes refuses: an object name is a DNS-1123 subdomain"),
    ({"nameOverride": "Headroom_Operator", "metrics": {"service": {"enabled": False}}}, (),
     "nameOverride: Headroom_Operator, after the release name x"),
    # Cut to 63 characters, the name ends on '.'.
    ({"fullnameOverride": "a" * 62 + ".bcd", "metrics": {"service": {"enabled": False}}}, (),
     "the operator's objects would be named " + "a" * 62 + ".,"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("values", "extra", "said"),
    NAMES_REFUSED_BY_THE_CHART,
    ids=[json.dumps(v) + " ".join(e) for v, e, _ in NAMES_REFUSED_BY_THE_CHART],
)
def test_names_kubernetes_would_refuse_are_refused_with_the_value(
    helm: Path, tmp_path: Path, values: dict[str, Any], extra: tuple[str, ...], said: str
) -> None:
    refused = _refusal(helm, "-f", _values_file(tmp_path, values), *extra, lint=False)
    assert said in refused, refused


def test_a_digit_first_metrics_service_from_kubernetes_1_36(helm: Path, tmp_path: Path) -> None:
    values = _values_file(tmp_path, {"fullnameOverride": "1headroom"})
    objs = render(helm, files=(values,), release="x", extra=("--kube-version", "1.36.0"))
    svc = one(objs, "Service")
    assert svc["metadata"]["name"] == "1headroom-metrics"


def test_a_refused_full_name_says_whether_it_was_cut(helm: Path, tmp_path: Path) -> None:
    """fullnameOverride is cut to 63 characters: the refusal says so from 64 on, not at 63."""
    for name, cut in [("1" + "a" * 62, False), ("1" + "a" * 63, True), ("a" * 62 + ".b", True)]:
        values = {"fullnameOverride": name}
        said = _refusal(helm, "-f", _values_file(tmp_path, values), lint=False)
        assert f"fullnameOverride: {name}" in said, said
        assert ("(cut to 63 characters)" in said) == cut, said


def test_the_metrics_service_refusal_names_the_ways_out_that_work(
    helm: Path, tmp_path: Path
) -> None:
    """A full name the metrics Service cannot take: each way out the message names renders."""
    said = _refusal(helm, "--set", "fullnameOverride=1headroom", lint=False)
    ways = ({"metrics": {"service": {"enabled": False}}}, {"operator": {"metricsPort": 0}})
    assert "metrics.service.enabled: false" in said and "operator.metricsPort: 0" in said, said
    for way in ways:
        values = _values_file(tmp_path, {"fullnameOverride": "1headroom", **way})
        objs = render(helm, files=(values,), release="x")
        assert "Service" not in kinds(objs)
        assert one(objs, "Deployment")["metadata"]["name"] == "1headroom"


def test_names_render_as_the_strings_they_are(helm: Path, tmp_path: Path) -> None:
    values = {
        "nameOverride": "2hr",
        "fullnameOverride": "hr-ops",
        "priorityClassName": "high.priority-1",
        "serviceAccount": {"name": "robot.v2"},
        "operator": {"peering": "a.b-c", "replicas": 2},
    }
    objs = render(helm, files=(_values_file(tmp_path, values),), release="x")
    dep = one(objs, "Deployment")
    pod = dep["spec"]["template"]
    assert pod["spec"]["priorityClassName"] == "high.priority-1"
    assert pod["spec"]["serviceAccountName"] == "robot.v2"
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "2hr"
    assert dep["metadata"]["name"] == "hr-ops"
    assert one(objs, "ClusterKopfPeering")["metadata"]["name"] == "a.b-c"
    # Nothing but the keys the chart writes reached the pod spec.
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod["spec"])


def _is_loopback(host: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(host)
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or bool(mapped and mapped.is_loopback)


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "127.1.2.3", "::1", "0:0:0:0:0:0:0:1", "::0:1", "::ffff:127.0.0.1",
     "::FFFF:7f00:1", "::1%lo", "::ffff:127.0.0.1%eth0"],
)  # fmt: skip
def test_a_loopback_health_host_is_refused(helm: Path, host: str) -> None:
    # The kubelet probes /healthz on the pod IP: bound to loopback, the probe never succeeds
    # and the kubelet restarts the operator forever.
    assert _is_loopback(host)
    said = _refusal(helm, "--set", f"operator.healthHost={host}", lint=False)
    assert "operator.healthHost" in said and "loopback" in said, said


def test_the_bind_addresses_the_chart_takes_are_the_operators(helm: Path) -> None:
    from headroom.operator.handlers import Options

    hosts = ["0.0.0.0", "::", "10.0.0.1", "::ffff:10.0.0.1", "fd00::1", "2001:db8::42",
             # An IPv6 address with a zone: pydantic's IPvAnyAddress takes it.
             "fe80::1%eth0", "fe80::1%1", "::ffff:10.0.0.1%net1.2", "FE80::1%Eth_0"]  # fmt: skip
    for host in hosts:
        assert not _is_loopback(host)
        dep = one(render(helm, f"operator.healthHost={host}", f"operator.metricsHost={host}"),
                  "Deployment")  # fmt: skip
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        assert f"--liveness-host={host}" in c["args"] and f"--metrics-host={host}" in c["args"]
        Options(metrics_host=host, liveness_host=host)  # the operator takes them too
    # /metrics may stay on loopback (scraped by nothing, or a sidecar in the pod).
    for host in ["127.0.0.1", "::1"]:
        dep = one(render(helm, f"operator.metricsHost={host}"), "Deployment")
        assert f"--metrics-host={host}" in dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_zoned_ipv6_pattern_takes_what_the_operator_does() -> None:
    # format: ipv6 refuses a zone (fe80::1%eth0), which the operator's IPvAnyAddress takes: the
    # schema's pattern for it must take every IPv6 address, in every spelling, and nothing else.
    import ipaddress
    import random

    from headroom.operator.handlers import Options

    schema = json.loads((CHART / "values.schema.json").read_text())
    (zoned,) = [b["pattern"] for b in schema["definitions"]["bindAddress"]["anyOf"]
                if "pattern" in b]  # fmt: skip
    pattern = re.compile(zoned)

    def operator_takes(host: str) -> bool:
        try:
            Options(metrics_host=host)
            return True
        except ValueError:
            return False

    rng = random.Random(5)
    spellings: set[str] = set()
    for _ in range(300):
        bits = rng.getrandbits(128) & rng.choice([2**128 - 1, 2**64 - 1, 2**32 - 1, 2**16 - 1,
                                                  (2**128 - 1) ^ (2**64 - 1), 0])  # fmt: skip
        addr = ipaddress.IPv6Address(bits)
        groups = addr.exploded.split(":")
        i = rng.randint(0, 8)
        j = rng.randint(i, 8)
        spellings |= {addr.compressed, addr.exploded, addr.compressed.upper(),
                      ":".join(groups[:i]) + "::" + ":".join(groups[j:]),
                      f"::ffff:{ipaddress.IPv4Address(bits & (2**32 - 1))}"}  # fmt: skip
    pieces = ["0", "1", "ffff", "12345", "g", ":", "::", ".", "1.2.3.4", "256.1.1.1", "01.2.3.4"]
    for _ in range(3000):
        spellings.add("".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))))
    for spelling in sorted(spellings):
        for zone in ["%eth0", "%1", "%net1.2_a-b", "%", "%a%b", ""]:
            host = spelling + zone
            ours = pattern.fullmatch(host) is not None
            assert ours == (operator_takes(host) and zone not in ("", "%")), host


# Each as the operator's own range check (rate_window_seconds: 1s..1h) decides it.
RATE_WINDOWS_TAKEN = ["1m", "1h", "90s", "2m30s", "1s", "1000ms", "3600s", "59m60s", "0h60m",
                      "0d1h", "0000001s", "1h0m0s0ms"]  # fmt: skip
RATE_WINDOWS_REFUSED = ["2h", "500ms", "0s", "999ms", "3601s", "1h1ms", "1d", "1w", "1y",
                        "99999999999999999999999ms"]  # fmt: skip


@pytest.mark.parametrize(
    ("window", "taken"),
    [(w, True) for w in RATE_WINDOWS_TAKEN] + [(w, False) for w in RATE_WINDOWS_REFUSED],
)
def test_the_chart_takes_the_rate_windows_the_operator_does(
    helm: Path, window: str, taken: bool
) -> None:
    from headroom.operator.scaling.metrics_sources import rate_window_seconds

    try:
        rate_window_seconds(window)
        operator_takes = True
    except ValueError:
        operator_takes = False
    assert operator_takes == taken, window
    if taken:
        (c,) = one(render(helm, f"operator.prometheusRateWindow={window}"), "Deployment")[
            "spec"]["template"]["spec"]["containers"]  # fmt: skip
        assert f"--prometheus-rate-window={window}" in c["args"]
    else:
        said = _refusal(helm, "--set", f"operator.prometheusRateWindow={window}", lint=False)
        assert f"operator.prometheusRateWindow: {window} is outside 1s..1h" in said, said


def test_the_health_and_metrics_ports_must_differ(helm: Path) -> None:
    # The operator binds each on its own port: the second bind fails and the operator exits.
    for sets in [("operator.healthPort=8080",), ("operator.metricsPort=9000",
                 "operator.healthPort=9000")]:  # fmt: skip
        said = _refusal(helm, *[a for s in sets for a in ("--set", s)], lint=False)
        assert "operator.healthPort and operator.metricsPort are both" in said, said
    # /metrics off: the health port may be any.
    (c,) = one(render(helm, "operator.metricsPort=0", "operator.healthPort=8080"), "Deployment")[
        "spec"]["template"]["spec"]["containers"]  # fmt: skip
    assert [p["containerPort"] for p in c["ports"]] == [8080]


@pytest.mark.parametrize(
    "key", ["app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"]
)
def test_pod_labels_cannot_repeat_the_selector_labels(helm: Path, key: str) -> None:
    # A second key in the pod's labels: the API server refuses the Deployment.
    said = _refusal(helm, "--set", "podLabels." + key.replace(".", "\\.") + "=other", lint=False)
    assert f"podLabels: {key} is one of the operator pod's selector labels" in said, said


def test_a_null_gateway_selector_selects_every_pod(helm: Path, tmp_path: Path) -> None:
    values = {"networkPolicy": {"enabled": True, "namespaces": ["team-a"],
                                "gateway": {"podSelector": None}}}  # fmt: skip
    objs = render(helm, files=(_values_file(tmp_path, values),), release="x")
    (policy,) = [d for d in objs if d["kind"] == "NetworkPolicy"]
    by_port = {r["ports"][0]["port"]: r["from"] for r in policy["spec"]["ingress"]}
    assert by_port["http"] == [{"podSelector": {}}]


def test_an_upgrade_reusing_a_numeric_tag_says_how_to_keep_it(
    cluster: Cluster, cluster_namespace: str
) -> None:
    # helm stores a release's values as JSON: `--set image.tag=2` (an int64) comes back as the
    # float 2.0 to `helm upgrade --reuse-values`, which cannot tell it from 2.0 or 010. The
    # upgrade is refused naming --set-string, and with it keeps the image.
    release = "reuse-tag"
    common = ("--namespace", cluster_namespace, "--skip-crds")
    try:
        cluster.helm("install", release, str(CHART), *common, "--set", "image.tag=2")
        for reuse in ("--reuse-values", "--reset-then-reuse-values"):
            out = cluster.helm("upgrade", release, str(CHART), *common, reuse,
                               "--set", "operator.logFormat=text", check=False)  # fmt: skip
            assert out.returncode != 0 and "--set-string image.tag=" in out.stderr, out.stderr
        out = cluster.helm("upgrade", release, str(CHART), *common, "--reuse-values",
                           "--set-string", "image.tag=2", "--set", "operator.logFormat=text",
                           check=False)  # fmt: skip
        assert out.returncode == 0, f"helm upgrade: {out.stdout}{out.stderr}"
        manifest = cluster.helm("get", "manifest", release, "--namespace", cluster_namespace)
        image, flags = _image_and_flag(manifest.stdout)
        assert image == "ghcr.io/headroom-dev/headroom:2", image
        assert "--headroom-image=ghcr.io/headroom-dev/headroom:2" in flags
        assert "--log-format=text" in flags
    finally:
        cluster.helm("uninstall", release, "--namespace", cluster_namespace, check=False)


def _server_dry_run(cluster: Cluster, namespace: str, values_file: str) -> None:
    """Render the chart with `values_file` for the cluster's version; the API server takes
    every object it renders (a server-side dry run)."""
    manifest = cluster.helm(
        "template", "headroom", str(CHART), "--namespace", namespace,
        "--kube-version", cluster.version, "-f", values_file,
    ).stdout  # fmt: skip
    objs = [d for d in yaml.safe_load_all(manifest) if d]
    out = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=manifest, check=False)
    assert out.returncode == 0, f"{values_file}: {out.stdout}{out.stderr}"
    assert out.stdout.count("(server dry run)") == len(objs), out.stdout


def test_names_the_chart_takes_apply_with_server_dry_run(
    cluster: Cluster, cluster_namespace: str, tmp_path: Path
) -> None:
    # The relaxed names render, and the cluster's API server takes every object named after
    # them: a digit-first metrics Service too, from Kubernetes 1.36 (RelaxedServiceNameValidation).
    cases: list[dict[str, Any]] = [*KEPT_NAMES, {"fullnameOverride": "1headroom"},
                                   {"operator": {"metricsHost": "fe80::1%eth0"}}]  # fmt: skip
    for values in cases:
        _server_dry_run(cluster, cluster_namespace, _values_file(tmp_path, values))


def test_edge_values_apply_with_server_dry_run(
    cluster: Cluster, cluster_namespace: str, tmp_path: Path
) -> None:
    # What the schema and the checks above let through, the API server takes.
    values = {
        "nameOverride": "2hr",
        "fullnameOverride": "hr-ops",
        "priorityClassName": "system-cluster-critical",
        "serviceAccount": {"name": "robot.v2"},
        "image": {"tag": "1.10"},
        "podLabels": {"team": "ml"},
        "operator": {"metricsHost": "::1", "healthHost": "::", "metricsPort": 9000,
                     "healthPort": 9001, "prometheusRateWindow": "1h",
                     "watchNamespaces": [cluster_namespace]},
        "networkPolicy": {"enabled": True, "gateway": {"podSelector": None}},
    }  # fmt: skip
    _server_dry_run(cluster, cluster_namespace, _values_file(tmp_path, values))
