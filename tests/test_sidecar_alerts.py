"""The shipped alert rules: promtool validates them and runs their unit tests.

Prometheus's own `promtool` (Debian's `prometheus` package, installed by `make tools`) does the
checking, so the rules are judged by the engine that will evaluate them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from synthetic_engine import SyntheticEngine

from headroom.operator.scaling.exporter import OperatorMetrics
from headroom.sidecar.collector import SidecarCollector, make_registry
from headroom.sidecar.config import SidecarConfig
from headroom.sidecar.sources import parse_headroom_stats
from headroom.sidecar.state import PollState

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "charts" / "headroom" / "files" / "headroom-alerts.yaml"
RULE_TESTS = ROOT / "tests" / "prometheus" / "alerts_test.yaml"
RUNBOOK = ROOT / "README.md"
ALERTS = {
    "HeadroomKVSaturationImminent",
    "HeadroomKVSaturated",
    "HeadroomPreempting",
    "HeadroomEngineDown",
    "HeadroomEngineFlapping",
    "HeadroomPrefixCacheIneffective",
    "HeadroomKVPoolBelowPlan",
    "HeadroomAutoscalerStalled",
}
PROMTOOL = shutil.which("promtool")


def _rules() -> list[dict[str, object]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None, (
        "promtool is not installed: make tools installs Debian's prometheus"
    )
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=RULE_TESTS.parent
    )


def test_promtool_check_rules() -> None:
    proc = _promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout


def test_promtool_test_rules() -> None:
    proc = _promtool("test", "rules", str(RULE_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_is_documented_and_unit_tested() -> None:
    rules = _rules()
    assert {r["alert"] for r in rules} == ALERTS
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert tested == ALERTS  # each alert has a test where it actually fires
    runbook = RUNBOOK.read_text()
    for rule in rules:
        annotations = rule["annotations"]
        assert isinstance(annotations, dict)
        assert {"summary", "description", "runbook"} <= set(annotations), rule["alert"]
        anchor = str(annotations["runbook"]).split("#", 1)[1]
        assert anchor == str(rule["alert"]).lower()
        assert re.search(rf"^### {rule['alert']}$", runbook, re.M), f"{rule['alert']} runbook"
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}  # type: ignore[index]


def _exported_sample_names() -> set[str]:
    """Every sample name a sidecar with a busy engine (and a planned pool) exports."""
    cfg = SidecarConfig(engine_url="http://127.0.0.1:1", planned_blocks=1024)
    state = PollState(horizon=61.0)
    eng = SyntheticEngine()
    for t in range(5):
        eng.set_used(10 * t)
        eng.queries_tokens_total += 10
        state.record_success(parse_headroom_stats(eng.body()), float(t))
    text = generate_latest(make_registry(SidecarCollector(state, cfg, lambda: 4.0))).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def _operator_sample_names() -> set[str]:
    """Every sample name the operator exports once a deployment has ticked, and failed."""
    m = OperatorMetrics()
    m.ticked("llm", "chat", 1.0)
    m.due("llm", "chat", 15.0)
    m.failed("llm", "chat", "api")
    m.publish("llm", "chat", "auto", desired=2, current=1)
    m.decided("llm", "chat", "scale-out", "DemandForecast")
    text = generate_latest(m.registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_alerts_use_only_exported_metrics() -> None:
    exported = _exported_sample_names() | _operator_sample_names()
    for rule in _rules():
        used = set(re.findall(r"\bheadroom_[a-z_]+", str(rule["expr"])))
        assert used, rule["alert"]
        assert used <= exported, (rule["alert"], used - exported)
