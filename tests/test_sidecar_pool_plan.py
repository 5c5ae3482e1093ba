"""Plan against running pool: `--planned-blocks` exports `headroom_kv_blocks_planned` beside the
engine's own `headroom_kv_blocks_capacity`, and HeadroomKVPoolBelowPlan compares the two
(promtool checks the rule and runs its unit tests)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from synthetic_engine import SyntheticEngine

from headroom.sidecar.cli import config_from_args, configure_parser, run
from headroom.sidecar.collector import SidecarCollector, make_registry
from headroom.sidecar.config import IdentityLabels, SidecarConfig
from headroom.sidecar.sources import parse_headroom_stats
from headroom.sidecar.state import PollState

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = Path(__file__).parent / "prometheus"
RULE = ROOT / "charts" / "headroom" / "files" / "headroom-alerts.yaml"
RULE_TESTS = PROMETHEUS_DIR / "alerts_test.yaml"
PROMTOOL = shutil.which("promtool")


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(["--engine-url", "http://127.0.0.1:8000", *flags])


def test_planned_blocks_flag_reaches_the_config() -> None:
    assert config_from_args(_args("--planned-blocks", "31526")).planned_blocks == 31526
    assert config_from_args(_args()).planned_blocks is None


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_plan_of_no_blocks_exits_2_naming_the_flag(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(_args("--planned-blocks", value)) == 2
    assert "--planned-blocks: " in capsys.readouterr().err


def test_a_plan_that_is_not_a_number_exits_2() -> None:
    with pytest.raises(SystemExit) as exc:
        _args("--planned-blocks", "lots")
    assert exc.value.code == 2


def _series(planned: int | None) -> dict[str, dict[str, str]]:
    """The sidecar's sample labels by name, for an engine of 1000 blocks."""
    cfg = SidecarConfig(
        engine_url="http://127.0.0.1:1",
        planned_blocks=planned,
        labels=IdentityLabels(namespace="llm", inferencedeployment="chat", pod="chat-0"),
    )
    state = PollState(horizon=61.0)
    state.record_success(parse_headroom_stats(SyntheticEngine(capacity=1000).body()), 0.0)
    text = generate_latest(make_registry(SidecarCollector(state, cfg, lambda: 0.5))).decode()
    return {
        s.name: {**s.labels, "value": str(s.value)}
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_planned_pool_is_exported_beside_the_capacity_with_the_same_labels() -> None:
    series = _series(planned=1024)
    planned, capacity = series["headroom_kv_blocks_planned"], series["headroom_kv_blocks_capacity"]
    assert (planned.pop("value"), capacity.pop("value")) == ("1024.0", "1000.0")
    assert planned == capacity  # the alert divides one by the other, label set by label set


def test_no_plan_no_planned_series() -> None:
    assert "headroom_kv_blocks_planned" not in _series(planned=None)


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None, (
        "promtool is not installed: make tools installs Debian's prometheus"
    )
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=PROMETHEUS_DIR
    )


def test_promtool_accepts_the_rule() -> None:
    proc = _promtool("check", "rules", str(RULE))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_unit_tests_of_the_rule_pass() -> None:
    proc = _promtool("test", "rules", str(RULE_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_rule_uses_only_what_the_sidecar_exports() -> None:
    rules = [r for g in yaml.safe_load(RULE.read_text())["groups"] for r in g["rules"]]
    (rule,) = [r for r in rules if r["alert"] == "HeadroomKVPoolBelowPlan"]
    exported = set(_series(planned=1024))
    assert {"headroom_kv_blocks_capacity", "headroom_kv_blocks_planned"} <= exported
    assert "headroom_kv_blocks_capacity / headroom_kv_blocks_planned" in rule["expr"]
