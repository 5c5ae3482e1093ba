"""Fixtures of the end-to-end scenarios: the chart installed with helm, the operator running as a
local process with the chart's ServiceAccount credentials, the examples applied, and a timing
table of every scenario at the end of the run.

The control plane comes from e2e/cluster (the session-scoped ``cluster`` fixture). The operator
is a real `headroom operator` process on this machine (kwok pods run nothing), authenticated
with a token of the ServiceAccount `helm install` created, so every scenario also exercises the
chart's RBAC.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from e2e.cluster.harness import Cluster  # noqa: E402
from e2e.helpers import Operator, Processes, Timings, table_of, wait_until  # noqa: E402
from e2e.kube import CRDS, Applied, Release, example_manifests, examples_dir, get_obj  # noqa: E402, get_obj

pytest_plugins = ["e2e.cluster.pytest_plugin"]

CHART = REPO / "charts" / "headroom"
RELEASE = "headroom"
RELEASE_NAMESPACE = "headroom-system"

_timings = Timings()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every e2e test needs the real control plane."""
    here = Path(__file__).resolve().parent
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(here):
            item.add_marker(pytest.mark.cluster)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    t0 = time.monotonic()
    yield
    _timings.phases.append((item.nodeid.removeprefix("e2e/"), time.monotonic() - t0))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    table = _timings.table()
    if table:
        terminalreporter.section("headroom e2e timings")
        terminalreporter.write_line(table)
        terminalreporter.section("headroom e2e timings per scenario")
        terminalreporter.write_line(_timings.by_prefix())
    if _timings.figures:
        terminalreporter.section("headroom e2e measured inside the scenarios")
        terminalreporter.write_line(table_of(_timings.figures, total=False))


@pytest.fixture(scope="session")
def timings() -> Timings:
    """The session's timing table; scenarios add their own phases."""
    return _timings


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the local processes of the session write their logs."""
    return tmp_path_factory.mktemp("e2e-logs")


@pytest.fixture(scope="session")
def release(cluster: Cluster, timings: Timings) -> Iterator[Release]:
    """`helm install` the chart (CRDs included) into headroom-system; uninstalled at the end."""
    t0 = time.monotonic()
    with timings.phase("setup: helm install charts/headroom"):
        cluster.helm(
            "install",
            RELEASE,
            str(CHART),
            "--namespace",
            RELEASE_NAMESPACE,
            "--create-namespace",
            "--wait",
            "--timeout",
            "180s",
        )
    yield Release(
        name=RELEASE,
        namespace=RELEASE_NAMESPACE,
        service_account=RELEASE,
        cluster_role=RELEASE,
        install_seconds=time.monotonic() - t0,
    )
    cluster.helm("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, check=False)


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster: Cluster, release: Release) -> Path:
    """A kubeconfig holding a token of the chart's ServiceAccount (never the admin's)."""
    return cluster.sa_kubeconfig(release.namespace, release.service_account, create=False)


@pytest.fixture(scope="session")
def operator(operator_kubeconfig: Path, log_dir: Path, timings: Timings) -> Iterator[Operator]:
    """One operator for the session (scenario 4 restarts it); stopped at the end."""
    group = Processes(log_dir)
    op = Operator(group, operator_kubeconfig)
    try:
        with timings.phase("setup: start headroom operator"):
            op.start()
        yield op
    finally:
        group.stop_all()


@pytest.fixture(scope="session")
def examples(cluster: Cluster, operator: Operator, timings: Timings) -> Applied:
    """`kubectl apply -f crds/` then `kubectl apply -f examples/`, waited until reconciled."""
    manifests = example_manifests()
    namespaces = sorted({str(m["metadata"]["namespace"]) for m in manifests})
    with timings.phase("setup: apply crds/ and examples/"):
        for ns in namespaces:
            if cluster.kubectl("get", "namespace", ns, check=False).returncode != 0:
                cluster.create_namespace(ns)
        crd_out = cluster.kubectl("apply", "-f", str(CRDS)).stdout
        cluster.wait(
            "--for=condition=Established", "crd/inferencedeployments.headroom.dev", timeout=60
        )
        out = cluster.kubectl("apply", "-f", str(examples_dir())).stdout
        for m in manifests:
            name, ns = str(m["metadata"]["name"]), str(m["metadata"]["namespace"])
            wait_until(
                partial(reconciled, cluster, ns, name),
                timeout=120,
                what=f"the operator to reconcile {ns}/{name}",
                alive=operator.check_alive,
            )
    return Applied(manifests, crd_out, out)


def reconciled(cluster: Cluster, ns: str, name: str) -> bool:
    """The operator has seen the current generation, sized it and created its Deployment."""
    obj = get_obj(cluster, "inferencedeployment", name, namespace=ns)
    status = obj.get("status") or {}
    meta = obj["metadata"]
    assert isinstance(status, dict) and isinstance(meta, dict)
    if status.get("observedGeneration") != meta.get("generation") or "budget" not in status:
        return False
    return cluster.kubectl("get", "deployment", name, "-n", ns, check=False).returncode == 0
