"""Scenario 1: `kubectl apply -f crds/` then the examples; each gets its Deployment, Service and
PodDisruptionBudget, a status.budget equal to `headroom plan` for the same inputs, and
`kubectl get infd` shows the CRD's printer columns."""

from __future__ import annotations

from typing import Any

import yaml

from e2e.cluster.harness import Cluster
from e2e.kube import (
    CHILD_KINDS,
    CRDS,
    SELECTOR_LABEL,
    Applied,
    condition,
    container_arg,
    get_obj,
    headroom_plans,
    pool_flags,
    printer_table,
)

# status.budget field -> `headroom plan --json` field.
BUDGET_VS_PLAN = {
    "feasible": "feasible",
    "binding": "binding",
    "kvCacheDtype": "kv_dtype",
    "blockSize": "block_size",
    "tensorParallel": "tp",
    "pipelineParallel": "pp",
    "gpusPerPod": "gpus_per_pod",
    "weightsBytesPerGpu": "weights_bytes_per_gpu",
    "kvBytesPerToken": "kv_bytes_per_token",
    "kvBytesPerTokenPerGpu": "kv_bytes_per_token_per_gpu",
    "kvBytesPerGpu": "kv_bytes_per_gpu",
    "kvBlocksPerPod": "kv_blocks_per_pod",
    "kvTokensPerPod": "kv_tokens_per_pod",
    "sequencesPerPod": "sequences_per_pod",
    "sizedReplicas": "replicas",
}


def _name_ns(m: dict[str, Any]) -> tuple[str, str]:
    return str(m["metadata"]["name"]), str(m["metadata"]["namespace"])


def test_apply_creates_the_crd_and_every_example(examples: Applied) -> None:
    assert "inferencedeployments.headroom.dev" in examples.crd_output
    assert len(examples.manifests) >= 3, "examples/ should hold at least three deployments"
    for m in examples.manifests:
        name, _ = _name_ns(m)
        assert f"inferencedeployment.headroom.dev/{name}" in examples.output


def test_each_example_owns_a_deployment_service_and_pdb(
    cluster: Cluster, examples: Applied
) -> None:
    for m in examples.manifests:
        name, ns = _name_ns(m)
        cr = get_obj(cluster, "inferencedeployment", name, namespace=ns)
        uid = cr["metadata"]["uid"]
        for kind in CHILD_KINDS:
            items = get_obj(cluster, kind, namespace=ns)["items"]
            mine = [o for o in items if o["metadata"]["labels"].get(SELECTOR_LABEL) == name]
            assert len(mine) == 1, f"{ns}/{name}: expected one {kind}, found {len(mine)}"
            refs = mine[0]["metadata"].get("ownerReferences") or []
            assert [r["uid"] for r in refs if r.get("controller")] == [uid], (
                f"{kind} {name} is not controlled by its InferenceDeployment"
            )


def test_budget_matches_headroom_plan(cluster: Cluster, examples: Applied) -> None:
    plans = headroom_plans([m["spec"] for m in examples.manifests])
    for m, plan in zip(examples.manifests, plans, strict=True):
        name, ns = _name_ns(m)
        cr = get_obj(cluster, "inferencedeployment", name, namespace=ns)
        budget = cr["status"]["budget"]
        for ours, theirs in BUDGET_VS_PLAN.items():
            assert budget.get(ours) == plan[theirs], (
                f"{ns}/{name}: status.budget.{ours} = {budget.get(ours)!r} but headroom plan "
                f"says {theirs} = {plan[theirs]!r}"
            )
        feasible = condition(cr, "Feasible")
        assert feasible is not None and feasible["status"] == "True", feasible

        dep = get_obj(cluster, "deployment", name, namespace=ns)
        # The engine allocates exactly the planned pool, in its runtime's own flags.
        for flag, want in pool_flags(m["spec"], plan).items():
            assert container_arg(dep, "engine", flag) == want, (
                f"{ns}/{name}: engine {flag} is {container_arg(dep, 'engine', flag)!r}, the "
                f"plan says {want}"
            )
        scaling = m["spec"].get("scaling") or {}
        if scaling.get("mode", "auto") == "auto":
            lo, hi = int(scaling.get("minReplicas", 1)), int(scaling.get("maxReplicas", 10))
            want = max(lo, min(hi, int(plan["replicas"])))
            assert dep["spec"]["replicas"] == want, (
                f"{ns}/{name}: Deployment has {dep['spec']['replicas']} replicas, "
                f"plan sizes {plan['replicas']} (bounds [{lo}, {hi}])"
            )
        gpus = str(m["spec"]["gpu"].get("countPerPod", 1))
        engine = next(
            c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"
        )
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == gpus


def test_kubectl_get_infd_shows_the_printer_columns(cluster: Cluster, examples: Applied) -> None:
    crd = yaml.safe_load((CRDS / "inferencedeployment.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    columns = [c["name"].upper() for c in version["additionalPrinterColumns"]]
    namespaces = sorted({_name_ns(m)[1] for m in examples.manifests})
    for ns in namespaces:
        out = cluster.kubectl("get", "infd", "-n", ns).stdout
        print(f"\n$ kubectl get infd -n {ns}\n{out}")
        rows = printer_table(out)
        assert list(rows[0]) == ["NAME", *columns], out
        for row in rows:
            cr = get_obj(cluster, "inferencedeployment", row["NAME"], namespace=ns)
            status = cr.get("status") or {}
            assert isinstance(status, dict)
            ready = condition(cr, "Ready")
            assert row["READY"] == (ready or {}).get("status", ""), row
            assert row["REPLICAS"] == str(status.get("replicas", "")), row
            assert row["DESIRED"] == str(status.get("desiredReplicas", "")), row
