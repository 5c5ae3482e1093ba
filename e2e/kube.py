"""Kubernetes-side utilities of the e2e scenarios: the examples, conditions, `headroom plan`
for a spec, and `kubectl get` tables."""

from __future__ import annotations

import atexit
import functools
import ipaddress
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from e2e.helpers import REPO, headroom_argv

EXAMPLES_SOURCE = REPO / "examples"
CRDS = REPO / "crds"
SELECTOR_LABEL = "headroom.dev/inferencedeployment"
CHILD_KINDS = ("deployment", "service", "poddisruptionbudget")
# Where the examples' Prometheus is pointed in the scenarios: nothing listens there, so the
# operator's metrics source fails at once, on this machine. The examples name an in-cluster
# Service (`prometheus-operated.monitoring`), whose lookup would leave loopback.
LOOPBACK_PROMETHEUS = "http://127.0.0.1:1"
_PROMETHEUS_LINE = re.compile(r"^([ \t]*prometheusURL:[ \t]*)(\S+)[ \t]*$", re.MULTILINE)


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _urls(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [u for v in node.values() for u in _urls(v)]
    if isinstance(node, list):
        return [u for v in node for u in _urls(v)]
    return [node] if isinstance(node, str) and re.match(r"^[a-z][a-z0-9+.-]*://", node) else []


@functools.cache
def examples_dir() -> Path:
    """examples/ as the scenarios apply it: the same files, each `prometheusURL` that is not
    loopback pointed at LOOPBACK_PROMETHEUS; refuses an example naming any other such URL."""
    out = Path(tempfile.mkdtemp(prefix="headroom-e2e-examples-"))
    atexit.register(shutil.rmtree, out, True)
    for path in sorted(EXAMPLES_SOURCE.glob("*.yaml")):
        text = _PROMETHEUS_LINE.sub(
            lambda m: m.group(0) if _loopback(m.group(2)) else m.group(1) + LOOPBACK_PROMETHEUS,
            path.read_text(),
        )
        off = [u for d in yaml.safe_load_all(text) for u in _urls(d) if not _loopback(u)]
        if off:
            raise AssertionError(f"{path.name} names {off}: the scenarios reach loopback only")
        (out / path.name).write_text(text)
    return out


def example_manifests() -> list[dict[str, Any]]:
    """The InferenceDeployments under examples/ (as `examples_dir()` holds them), in file
    order."""
    docs: list[dict[str, Any]] = []
    for path in sorted(examples_dir().glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    """status.conditions[type=type_] of an object, or None."""
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


def plan_flags(spec: dict[str, Any]) -> list[str]:
    """The `headroom plan` flags for an InferenceDeployment spec, as a user would write them."""
    model, gpu, traffic = spec["model"], spec["gpu"], spec["traffic"]
    engine = spec.get("engine") or {}
    count = int(gpu.get("countPerPod", 1))
    flags = ["--model", model["preset"]]
    if "memoryGiB" in gpu:
        flags += ["--gpu-memory-gib", str(gpu["memoryGiB"])]
    else:
        flags += ["--gpu", gpu["type"]]
    flags += ["--tp", str(gpu.get("tensorParallel", count)), "--gpus-per-pod", str(count)]
    flags += ["--concurrency", str(traffic["peakConcurrency"])]
    flags += ["--context", str(traffic["contextTokens"])]
    flags += ["--kv-dtype", engine.get("kvCacheDtype", "auto")]
    if engine.get("prefixCaching", True):
        flags += ["--prefix-hit", str(traffic.get("prefixHitRatio", 0.0))]
    flags += ["--block-size", str(engine.get("blockSize", 16))]
    flags += ["--gpu-memory-utilization", str(engine.get("gpuMemoryUtilization", 0.9))]
    flags += ["--max-num-seqs", str(engine.get("maxNumSeqs", 256))]
    return flags


def headroom_plan(spec: dict[str, Any]) -> dict[str, Any]:
    """`headroom plan --json` for the spec's inputs (exit 1, infeasible, still prints JSON)."""
    out = subprocess.run(
        [*headroom_argv(), "plan", *plan_flags(spec), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if out.returncode not in (0, 1):
        raise RuntimeError(f"headroom plan failed ({out.returncode}): {out.stderr}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def headroom_plans(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`headroom plan --json` for several specs, run side by side (each is a fresh CLI)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, len(specs))) as pool:
        return list(pool.map(headroom_plan, specs))


def container_arg(deployment: dict[str, Any], container: str, flag: str) -> str | None:
    """The value after `flag` in a container's args of a Deployment's pod template."""
    for c in deployment["spec"]["template"]["spec"]["containers"]:
        if c["name"] == container:
            args = list(c.get("args") or [])
            if flag in args and args.index(flag) + 1 < len(args):
                return str(args[args.index(flag) + 1])
    return None


def pool_flags(spec: dict[str, Any], plan: dict[str, Any]) -> dict[str, str]:
    """The engine flags that carry the planned KV pool and sharding, per `engine.runtime`."""
    runtime = (spec.get("engine") or {}).get("runtime", "headroom")
    blocks, block = int(plan["kv_blocks_per_pod"]), int(plan["block_size"])
    if runtime == "vllm":
        return {
            "--num-gpu-blocks-override": str(blocks),
            "--block-size": str(block),
            "--tensor-parallel-size": str(plan["tp"]),
            "--pipeline-parallel-size": str(plan["pp"]),
        }
    if runtime == "sglang":
        return {
            "--max-total-tokens": str(blocks * block),
            "--page-size": str(block),
            "--tp-size": str(plan["tp"]),
            "--pp-size": str(plan["pp"]),
        }
    return {"--num-blocks": str(blocks), "--block-size": str(block)}


def printer_table(text: str) -> list[dict[str, str]]:
    """Rows of a `kubectl get` table keyed by header, split at the header's column starts."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = lines[0]
    starts = [m.start() for m in _re_columns(header)]
    names = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    rows = []
    for line in lines[1:]:
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        rows.append(dict(zip(names, cells, strict=True)))
    return rows


def _re_columns(header: str) -> Any:
    # Column titles are separated by at least two spaces or start the line ("KV %" is one).
    return re.finditer(r"(?:(?<=\s\s)|^)\S(?:\S| (?! ))*", header)


@dataclass(frozen=True)
class Release:
    """The chart as installed by `helm install`."""

    name: str
    namespace: str
    service_account: str
    cluster_role: str
    install_seconds: float


@dataclass(frozen=True)
class Applied:
    """The examples as applied: manifests, and what `kubectl apply` said."""

    manifests: list[dict[str, Any]]
    crd_output: str
    output: str


def get_obj(cluster: Any, kind: str, name: str = "", namespace: str = "") -> dict[str, Any]:
    """`kubectl get -o json` of one object (or a List when `name` is empty), loosely typed."""
    result: dict[str, Any] = cluster.get(kind, name, namespace=namespace)
    return result
