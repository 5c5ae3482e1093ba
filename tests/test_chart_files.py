"""The Helm chart's files on their own (no helm binary needed): the CRD copy, values.yaml's
documentation and use, and the Grafana dashboard's queries against the metric contract."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from headroom.contract import metric_names

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "headroom"
GENERATED_CRD = REPO / "crds" / "inferencedeployment.yaml"
CHART_CRD = CHART / "crds" / "inferencedeployment.yaml"
DASHBOARD = CHART / "files" / "grafana-dashboard.json"
SCHEMA = CHART / "values.schema.json"
VALUE_REF = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def test_chart_crd_is_the_generated_crd_byte_for_byte() -> None:
    assert CHART_CRD.is_file(), f"{CHART_CRD} is missing"
    assert CHART_CRD.read_bytes() == GENERATED_CRD.read_bytes(), (
        "charts/headroom/crds/inferencedeployment.yaml differs from crds/inferencedeployment.yaml "
        "(`headroom crd`); refresh it: cp crds/inferencedeployment.yaml charts/headroom/crds/"
    )


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "headroom"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    assert chart["appVersion"]


# ---------------------------------------------------------------------------- values.yaml


def _value_lines() -> list[tuple[int, str, list[str], bool]]:
    """(indent, key, comment lines directly above, has inline value) for every mapping key."""
    out: list[tuple[int, str, list[str], bool]] = []
    comments: list[str] = []
    for raw in (CHART / "values.yaml").read_text().splitlines():
        line = raw.rstrip()
        stripped = line.lstrip()
        if not stripped:
            comments = []
            continue
        if stripped.startswith("#"):
            comments.append(stripped)
            continue
        m = re.match(r"^( *)([A-Za-z_][A-Za-z0-9_]*):(.*)$", line)
        if m:
            out.append((len(m.group(1)), m.group(2), comments, bool(m.group(3).strip())))
        comments = []
    return out


def _documented_paths() -> tuple[set[str], set[str]]:
    """(every key path in values.yaml, the paths covered by a `# --` comment on them or above)."""
    paths: set[str] = set()
    documented: set[str] = set()
    stack: list[tuple[int, str, bool]] = []  # indent, key, documented
    for indent, key, comments, _ in _value_lines():
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k, _ in stack] + [key])
        own = any(c.startswith("# --") and len(c) > len("# -- ") for c in comments)
        doc = own or any(d for _, _, d in stack)
        paths.add(path)
        if doc:
            documented.add(path)
        stack.append((indent, key, doc))
    return paths, documented


def test_every_value_is_documented() -> None:
    paths, documented = _documented_paths()
    assert paths, "values.yaml has no keys"
    missing = sorted(p for p in paths if p not in documented and not _has_children(p, paths))
    assert not missing, f"values without a `# --` comment: {missing}"


def _has_children(path: str, paths: set[str]) -> bool:
    return any(p.startswith(path + ".") for p in paths)


def _template_value_refs() -> set[str]:
    refs: set[str] = set()
    for tpl in (CHART / "templates").iterdir():
        refs.update(m.group(1).lstrip(".") for m in VALUE_REF.finditer(tpl.read_text()))
    return refs


def test_templates_only_use_values_that_exist() -> None:
    paths, _ = _documented_paths()
    unknown = sorted(r for r in _template_value_refs() if r not in paths)
    assert not unknown, f"templates reference values missing from values.yaml: {unknown}"


def test_every_value_is_used_by_a_template() -> None:
    paths, _ = _documented_paths()
    refs = _template_value_refs()
    top = {p for p in paths if not _has_children(p, paths)}
    # A leaf is used when a template names it or a map above it (toYaml of a whole map).
    unused = sorted(p for p in top if not any(p == r or p.startswith(r + ".") for r in refs))
    assert not unused, f"values no template reads: {unused}"


# ---------------------------------------------------------------------------- values.schema.json


def _schema() -> dict[str, Any]:
    assert SCHEMA.is_file(), f"{SCHEMA} is missing: bad values would install and crash-loop"
    doc: dict[str, Any] = json.loads(SCHEMA.read_text())
    return doc


def _schema_paths(node: dict[str, Any], prefix: str = "") -> tuple[set[str], set[str]]:
    """(every property path the schema names, the paths of its closed objects)."""
    paths: set[str] = set()
    closed: set[str] = {prefix} if node.get("additionalProperties") is False else set()
    for key, sub in node.get("properties", {}).items():
        path = f"{prefix}.{key}".lstrip(".")
        paths.add(path)
        more, shut = _schema_paths(sub, path)
        paths |= more
        closed |= shut
    return paths, closed


def _property(path: str) -> dict[str, Any]:
    node = _schema()
    for key in path.split("."):
        node = node["properties"][key]
    return node


def test_the_schema_knows_every_value_and_no_other() -> None:
    schema = _schema()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    values, _ = _documented_paths()
    named, closed = _schema_paths(schema)
    # additionalProperties: false refuses any key it does not list: it must list all of them.
    missing = sorted(v for v in values if v not in named and v.rpartition(".")[0] in closed | {""})
    assert not missing, f"values.yaml keys values.schema.json would refuse: {missing}"
    # ... and name none that values.yaml does not document (global: Helm's, for a dependency).
    stale = sorted(p for p in named if p not in values and p != "global")
    assert not stale, f"values.schema.json names values values.yaml lacks: {stale}"
    assert {"", "operator", "image", "metrics.serviceMonitor", "networkPolicy"} <= closed


def test_the_schema_holds_the_operators_limits() -> None:
    assert _property("operator.logFormat")["enum"] == ["json", "text"]
    assert _property("image.pullPolicy")["enum"] == ["Always", "IfNotPresent", "Never"]
    assert _property("operator.replicas")["minimum"] == 1
    # The chart always renders the liveness probe: healthPort 0 ("off") is refused.
    health = _property("operator.healthPort")
    assert (health["minimum"], health["maximum"]) == (1, 65535)
    metrics = _property("operator.metricsPort")
    assert (metrics["minimum"], metrics["maximum"]) == (0, 65535)


def _accepts(check: Any, value: str) -> bool:
    """True when `check` takes `value` (it raises ValueError, pydantic's included, otherwise)."""
    try:
        check(value)
    except ValueError:
        return False
    return True


def _is_a_duration(check: Any, value: str) -> bool:
    """True when `check` takes `value` for a PromQL duration, in its range or not."""
    try:
        check(value)
    except ValueError as exc:
        return "outside" in str(exc)
    return True


URLS = [
    "http://prometheus:9090", "https://p.monitoring.svc", "HTTP://p:9090/x?y#z",
    "http://[::1]:9090", "http://user@p:1", "http://p:65535", "http://10.0.0.1/prom",
    "prometheus:9090", "ftp://p", "http://", "http://:9090", "http://p:0", "http://p:70000",
    "http://p:port", "p", "//p:9090",
]  # fmt: skip
WINDOWS = ["1m", "90s", "2m30s", "1h", "1000ms", "1d", "abc", "1", "m", "1.5m", "-1m", "1M"]
NAMESPACES = ["team-a", "team-*", "!kube-system", "team-[ab]", "team-a,team-b", "Team", "a b"]


def test_the_schema_patterns_agree_with_the_operators_checks() -> None:
    from headroom.contract.urls import http_url
    from headroom.operator.handlers import Options
    from headroom.operator.scaling.metrics_sources import rate_window_seconds

    url = re.compile(_property("operator.prometheusUrl")["pattern"])
    for value in URLS:
        assert bool(url.search(value)) == _accepts(http_url, value), value
    assert url.search(""), "an empty prometheusUrl (none) must pass"
    window = re.compile(_property("operator.prometheusRateWindow")["pattern"])
    for value in WINDOWS:
        # The schema checks the form; the operator's 1s..1h range is its own.
        assert bool(window.search(value)) == _is_a_duration(rate_window_seconds, value), value
    ns = re.compile(_property("operator.watchNamespaces")["items"]["pattern"])
    for value in NAMESPACES:
        assert bool(ns.search(value)) == _accepts(lambda v: Options(namespaces=[v]), value), value


REPOSITORIES = [
    "ghcr.io/headroom-dev/headroom", "registry.example.com:5000/ml/headroom", "headroom",
    "10.0.0.1:5000/a/b_c/d-e", "localhost/x.y", "registry.example.com/headroom:1.0",
    "registry.example.com/Headroom", "registry.example.com//headroom", "registry.example.com/",
    "/headroom", "reg/headroom@sha256", "reg/head room", "reg/-x", "reg:port/x",
]  # fmt: skip
TAGS = ["0.1.0", "v1.2_3", "latest", "_x", ".1", "-1", "a" * 128, "a" * 129, "1:2", "a/b"]


def test_the_image_patterns_agree_with_the_operators_headroom_image_check() -> None:
    # The chart renders --headroom-image=REPOSITORY:TAG: what the schema takes, the operator
    # must take too, or it would exit 2 at every start of an install that succeeded.
    from headroom.operator.handlers import Options

    repo = re.compile(_property("image.repository")["pattern"])
    tag = re.compile(_property("image.tag")["pattern"])
    for value in REPOSITORIES:
        ok = _accepts(lambda v: Options(headroom_image=f"{v}:1"), value)
        assert bool(repo.search(value)) == ok, value
    for value in TAGS:
        ok = _accepts(lambda v: Options(headroom_image=f"reg/headroom:{v}"), value)
        assert bool(tag.search(value)) == ok, value
    assert tag.search(""), "an empty tag (the chart's appVersion) must pass"


# ---------------------------------------------------------------------------- dashboard


def _dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def _exprs() -> list[tuple[str, str]]:
    panels = _dashboard()["panels"]
    assert isinstance(panels, list)
    return [(p["title"], t["expr"]) for p in panels for t in p["targets"]]


def _exported_metric_names() -> set[str]:
    """Metric names the sidecar and the operator export, read from their source."""
    names: set[str] = set()
    for src in (
        REPO / "sidecar" / "headroom" / "sidecar" / "collector.py",
        REPO / "operator" / "headroom" / "operator" / "scaling" / "exporter.py",
    ):
        text = src.read_text()
        names.update(re.findall(r'"(headroom_[a-z_]+)"', text))
        # ... and those it names through the contract's constants (`names_.KV_DEMAND`).
        names.update(getattr(metric_names, c) for c in re.findall(r"names_\.([A-Z_]+)", text))
    return names


def test_dashboard_panels_cover_the_kv_story() -> None:
    exprs = " ".join(e for _, e in _exprs())
    for metric in (
        "headroom_kv_block_occupancy_ratio",
        "headroom_prefix_cache_hits_tokens_total",
        "headroom_kv_saturation_eta_seconds",
        "headroom_desired_replicas",
        "headroom_preemptions_total",
    ):
        assert metric in exprs, f"the dashboard has no panel on {metric}"
    for _, expr in _exprs():
        assert "inferencedeployment" in expr, f"not per InferenceDeployment: {expr}"
    dash = _dashboard()
    templating = dash["templating"]
    assert isinstance(templating, dict)
    assert {v["name"] for v in templating["list"]} >= {"namespace", "inferencedeployment"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_dashboard_metrics_are_exported() -> None:
    exported = _exported_metric_names()
    assert exported, "found no exported metric names in the sidecar/operator sources"
    for title, expr in _exprs():
        for name in re.findall(r"\bheadroom_[a-z_]+", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in exported or base in exported, f"{title}: {name} is not exported"


def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None, (
        "promtool is not installed: make tools installs Debian's prometheus"
    )
    rules = []
    for i, (_, expr) in enumerate(_exprs()):
        # Grafana's variables, as Grafana substitutes them.
        concrete = expr.replace("$__rate_interval", "1m").replace("$namespace", ".*")
        concrete = concrete.replace("$inferencedeployment", ".*")
        assert "$" not in concrete, f"unsubstituted variable in {expr}"
        rules.append({"record": f"headroom:dashboard_panel_{i}", "expr": concrete})
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_readme_says_how_to_free_a_namespace_the_finalizer_holds() -> None:
    readme = (CHART / "README.md").read_text()
    assert "headroom.dev/finalizer" in readme
    # The way out when the operator is gone: remove the finalizer by hand.
    assert "kubectl patch" in readme and '"finalizers": null' in readme
    # e2e/test_uninstall_finalizer.py runs that snippet against a namespace stuck by it.


def test_the_schema_reads_watched_namespaces_as_the_operator_does() -> None:
    """operator.watchNamespaces becomes the operator's --namespace flags: the schema's rule is
    the operator's own expression, so a value helm takes is one the operator starts with."""
    from headroom.operator.handlers import NAMESPACE_PATTERN

    schema = json.loads(SCHEMA.read_text())
    items = schema["properties"]["operator"]["properties"]["watchNamespaces"]["items"]
    assert items["pattern"] == f"^{NAMESPACE_PATTERN.pattern}$"
