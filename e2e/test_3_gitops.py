"""Scenario 3: GitOps behaviour on the examples (as scenario 1 applied them).

Re-applying the same manifests changes nothing: no generation bump and no update of any child,
and `kubectl diff` is clean. A spec change rolls the Deployment. The operator never writes spec
(only kubectl manages it). Deleting the InferenceDeployments garbage-collects their children.
"""

from __future__ import annotations

import copy
import json
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster.harness import Cluster
from e2e.helpers import Operator, wait_until
from e2e.kube import (
    CHILD_KINDS,
    SELECTOR_LABEL,
    Applied,
    container_arg,
    examples_dir,
    get_obj,
    headroom_plan,
    pool_flags,
)

# The kubectl field managers; every other manager (the operator, kopf) must stay off spec.
KUBECTL_MANAGERS = ("kubectl", "kubectl-client-side-apply", "kubectl-create", "kubectl-edit")


def _children(cluster: Cluster, ns: str, name: str) -> dict[str, tuple[Any, ...]]:
    """kind/name -> what a write would change, for every child of one InferenceDeployment:
    generation, spec, labels, and the time of each non-controller field manager's last write.
    Status updates by Kubernetes' own controllers are not writes by the operator."""
    out: dict[str, tuple[Any, ...]] = {}
    for kind in (*CHILD_KINDS, "replicaset"):
        listed = cluster.kubectl("get", kind, "-n", ns, "-o", "json", "--show-managed-fields")
        for obj in json.loads(listed.stdout)["items"]:
            meta = obj["metadata"]
            if (meta.get("labels") or {}).get(SELECTOR_LABEL) != name:
                continue
            writes = sorted(
                (e["manager"], e.get("operation"), e.get("time"))
                for e in meta.get("managedFields") or []
                if e.get("subresource") != "status" and e["manager"] != "kube-controller-manager"
            )
            out[f"{kind}/{meta['name']}"] = (
                meta.get("generation"),
                json.dumps(obj.get("spec"), sort_keys=True),
                json.dumps(meta.get("labels"), sort_keys=True),
                tuple(writes),
            )
    return out


def _gone(cluster: Cluster, ns: str, name: str) -> bool:
    return not _children(cluster, ns, name)


def _targets(examples: Applied) -> list[tuple[str, str]]:
    return [
        (str(m["metadata"]["name"]), str(m["metadata"]["namespace"])) for m in examples.manifests
    ]


def _observed_at(cluster: Cluster, ns: str, name: str) -> str | None:
    status = get_obj(cluster, "inferencedeployment", name, namespace=ns).get("status") or {}
    kv = status.get("kv") or {}
    return kv.get("observedAt")


def test_reapplying_the_same_manifests_changes_nothing(
    cluster: Cluster, examples: Applied, operator: Operator
) -> None:
    targets = _targets(examples)
    before_children = {t: _children(cluster, t[1], t[0]) for t in targets}
    before_gen = {
        t: get_obj(cluster, "inferencedeployment", t[0], namespace=t[1])["metadata"]["generation"]
        for t in targets
    }
    before_tick = {t: _observed_at(cluster, t[1], t[0]) for t in targets}
    out = cluster.kubectl("apply", "-f", str(examples_dir())).stdout
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert lines and all(ln.endswith(" unchanged") for ln in lines), out

    # Let every InferenceDeployment's scaling loop run at least once after the re-apply.
    def ticked(name: str, ns: str) -> bool:
        return _observed_at(cluster, ns, name) != before_tick[(name, ns)]

    for name, ns in targets:
        wait_until(
            partial(ticked, name, ns),
            timeout=90,
            what=f"a scaling tick of {ns}/{name} after the re-apply",
            alive=operator.check_alive,
        )
    for t in targets:
        cr = get_obj(cluster, "inferencedeployment", t[0], namespace=t[1])
        assert cr["metadata"]["generation"] == before_gen[t], f"{t}: generation bumped"
        assert _children(cluster, t[1], t[0]) == before_children[t], (
            f"{t[1]}/{t[0]}: a child changed after re-applying identical manifests"
        )

    # The status the operator keeps writing may race one diff; a real drift shows every time.
    diffs = []
    for _ in range(3):
        diff = cluster.kubectl("diff", "-f", str(examples_dir()), check=False)
        if diff.returncode == 0:
            break
        diffs.append(diff.stdout + diff.stderr)
    else:
        raise AssertionError("kubectl diff is not clean:\n" + "\n----\n".join(diffs))


def test_the_operator_never_writes_spec(cluster: Cluster, examples: Applied) -> None:
    for m in examples.manifests:
        name, ns = str(m["metadata"]["name"]), str(m["metadata"]["namespace"])
        cr = cluster.kubectl("get", "infd", name, "-n", ns, "-o", "json", "--show-managed-fields")
        obj = json.loads(cr.stdout)
        for entry in obj["metadata"].get("managedFields") or []:
            fields = entry.get("fieldsV1") or {}
            if entry.get("subresource") == "status":
                continue
            if "f:spec" in fields:
                assert entry["manager"].startswith(KUBECTL_MANAGERS), (
                    f"{ns}/{name}: {entry['manager']} manages spec fields: {fields['f:spec']}"
                )
        _assert_subset(m["spec"], obj["spec"], f"{ns}/{name}.spec")


def _assert_subset(want: Any, have: Any, where: str) -> None:
    """Everything the manifest says is in the live object unchanged (defaults may be added)."""
    if isinstance(want, dict):
        assert isinstance(have, dict), f"{where}: {have!r}"
        for key, value in want.items():
            assert key in have, f"{where}.{key} is gone"
            _assert_subset(value, have[key], f"{where}.{key}")
    else:
        assert want == have, f"{where}: applied {want!r}, live {have!r}"


def test_a_spec_change_rolls_the_deployment(
    cluster: Cluster, examples: Applied, operator: Operator, tmp_path: Path
) -> None:
    manifest = next(
        m for m in examples.manifests if (m["spec"].get("scaling") or {}).get("mode") != "advisory"
    )
    name, ns = str(manifest["metadata"]["name"]), str(manifest["metadata"]["namespace"])
    before = get_obj(cluster, "deployment", name, namespace=ns)
    before_rs = {k for k in _children(cluster, ns, name) if k.startswith("replicaset/")}
    old_block = int((manifest["spec"].get("engine") or {}).get("blockSize", 16))
    edited = copy.deepcopy(manifest)
    edited["spec"].setdefault("engine", {})["blockSize"] = old_block * 2
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(edited))
    assert "configured" in cluster.kubectl("apply", "-f", str(path)).stdout

    def rolled() -> dict[str, Any] | None:
        dep = get_obj(cluster, "deployment", name, namespace=ns)
        meta, st = dep["metadata"], dep.get("status") or {}
        if meta["generation"] == before["metadata"]["generation"]:
            return None
        if st.get("observedGeneration") != meta["generation"]:
            return None
        return dep

    dep = wait_until(rolled, timeout=60, what=f"{ns}/{name} to roll", alive=operator.check_alive)
    plan = headroom_plan(edited["spec"])
    assert plan["block_size"] == old_block * 2
    # The block size and the pool it sizes, in the flags of the example's own runtime.
    for flag, want in pool_flags(edited["spec"], plan).items():
        assert container_arg(dep, "engine", flag) == want, (flag, want)
    after_rs = {k for k in _children(cluster, ns, name) if k.startswith("replicaset/")}
    assert len(after_rs - before_rs) == 1, f"expected one new ReplicaSet: {before_rs} -> {after_rs}"
    budget = get_obj(cluster, "inferencedeployment", name, namespace=ns)["status"]["budget"]
    assert budget["blockSize"] == old_block * 2
    assert budget["kvBlocksPerPod"] == plan["kv_blocks_per_pod"]
    # Back to what git says, so the examples end as they started.
    cluster.kubectl("apply", "-f", str(examples_dir()))


def test_deleting_the_resource_garbage_collects_its_children(
    cluster: Cluster, examples: Applied, operator: Operator
) -> None:
    targets = _targets(examples)
    assert all(_children(cluster, ns, name) for name, ns in targets)
    cluster.kubectl(
        "delete", "-f", str(examples_dir()), "--wait=true", "--timeout=90s", timeout=120
    )
    for name, ns in targets:
        wait_until(
            partial(_gone, cluster, ns, name),
            timeout=90,
            what=f"the garbage collector to remove the children of {ns}/{name}",
            alive=operator.check_alive,
        )
        gone = cluster.kubectl("get", "infd", name, "-n", ns, check=False)
        assert gone.returncode != 0 and "NotFound" in gone.stderr
