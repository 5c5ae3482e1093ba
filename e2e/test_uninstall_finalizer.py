"""Uninstalling with InferenceDeployments left: the chart's README says the finalizer then holds
their namespace in Terminating, and gives a way out. Both are checked here on the real control
plane: the operator handles an object (and puts its finalizer on it), then stops, as after
`helm uninstall`; the namespace is deleted; the README's snippet frees it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster.harness import Cluster
from e2e.helpers import Operator, wait_until
from e2e.kube import CRDS, get_obj

README = Path(__file__).resolve().parent.parent / "charts" / "headroom" / "README.md"
FINALIZER = "headroom.dev/finalizer"


def _way_out() -> str:
    """The README's shell snippet that removes the finalizers."""
    section = README.read_text().split("## Uninstalling", 1)[1]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    (snippet,) = [b for b in blocks if '"finalizers": null' in b]
    return snippet


def _namespace_phase(cluster: Cluster, ns: str) -> str | None:
    out = cluster.kubectl("get", "namespace", ns, "-o", "jsonpath={.status.phase}", check=False)
    return out.stdout.strip() if out.returncode == 0 else None


def _deleting(cluster: Cluster, ns: str) -> dict[str, Any] | None:
    meta: dict[str, Any] = get_obj(cluster, "infd", "left", namespace=ns)["metadata"]
    return meta if meta.get("deletionTimestamp") else None


def _finalized(cluster: Cluster, ns: str) -> bool:
    cr = get_obj(cluster, "inferencedeployment", "left", namespace=ns)
    return FINALIZER in cr.get("metadata", {}).get("finalizers", [])


def test_the_readme_way_out_frees_a_namespace_the_finalizer_holds(
    cluster: Cluster, operator: Operator
) -> None:
    cluster.kubectl("apply", "-f", str(CRDS))
    cluster.wait("--for=condition=Established", "crd/inferencedeployments.headroom.dev")
    ns = cluster.create_namespace(f"t-finalizer-{os.getpid() % 10000}")
    cr: dict[str, Any] = {
        "apiVersion": "headroom.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "left", "namespace": ns},
        "spec": {
            "model": {"preset": "llama-3.1-8b"},
            "gpu": {"type": "h100-80gb"},
            "traffic": {"peakConcurrency": 1, "contextTokens": 128},
        },
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(cr))
    wait_until(lambda: _finalized(cluster, ns), timeout=60, what="the operator's finalizer",
               alive=operator.check_alive)  # fmt: skip
    assert operator.proc is not None
    operator.proc.stop()  # gone, as after `helm uninstall`
    try:
        _stuck_then_freed(cluster, ns)
    finally:
        operator.start()


def _stuck_then_freed(cluster: Cluster, ns: str) -> None:
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    wait_until(lambda: _namespace_phase(cluster, ns) == "Terminating", timeout=30,
               what="namespace Terminating")  # fmt: skip
    # The namespace controller deletes the object, and the finalizer holds it, so the namespace
    # stays (the README's claim).
    meta = wait_until(lambda: _deleting(cluster, ns), timeout=60, what="the object deleting")
    assert meta["finalizers"] == [FINALIZER]
    assert _namespace_phase(cluster, ns) == "Terminating"

    snippet = re.sub(r"^NS=\S+", f"NS={ns}", _way_out(), count=1, flags=re.M)
    assert f"NS={ns}" in snippet
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", snippet], env=cluster.env(),
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "inferencedeployment.headroom.dev/left patched" in proc.stdout
    wait_until(lambda: _namespace_phase(cluster, ns) is None, timeout=120,
               what="namespace gone")  # fmt: skip
