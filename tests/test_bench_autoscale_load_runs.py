"""The autoscaling bench's report on saved runs: it grades them and writes the docs only where
--out says, so a scratch variant's runs cannot overwrite the committed figures."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

import bench.autoscale_sim as sim
from bench.autoscale.frontier import FLOOR, Run

TARGETS = (0.6, 0.9)


SAME: dict[str, Any] = {
    "saturated_seconds": 0.0,
    "preemptions": 0,
    "actions": 2,
    "peak_replicas": 3,
    "pod_starts": 2,
    "cancelled_starts": 1,
}


def _runs() -> list[Run]:
    """Three seeds of every policy on one trace; all but the oracle short (16-48 s at 0.6)."""
    rows = []
    for seed in (1, 2, 3):
        for policy in ("headroom", "kv-threshold-hpa", "cpu-hpa", "oracle", FLOOR):
            for target in (0.0,) if policy == FLOOR else TARGETS:
                short = 0.0 if policy in ("oracle", FLOOR) else 40.0 * (1.0 - target) * seed
                cost = 1.0 + target + 0.1 * seed
                where: dict[str, Any] = {
                    "trace": "mooncake",
                    "policy": policy,
                    "target": target,
                    "seed": seed,
                }
                rows.append(Run(**SAME, **where, limited_seconds=short, queued_seconds=short,
                                gpu_hours=cost, rejected=0))  # fmt: skip
    return rows


@pytest.fixture
def saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(sim, "DOCS", tmp_path / "docs")
    (tmp_path / "docs").mkdir()
    path = tmp_path / "runs.json"
    path.write_text(json.dumps([asdict(r) for r in _runs()]))
    return path


def test_a_report_on_saved_runs_leaves_the_docs_alone(
    saved: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sim.main(["--load-runs", str(saved)])
    out = capsys.readouterr().out
    assert "mooncake: cost vs kv-threshold-hpa" in out
    assert "loaded from runs.json" in out
    assert list(sim.DOCS.iterdir()) == []


def test_a_report_on_saved_runs_writes_where_out_says(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    sim.main(["--load-runs", str(saved), "--out", str(out)])
    assert (out / "autoscale_frontier.md").read_text().count("mooncake") > 0
    assert (out / "autoscale_frontier.png").stat().st_size > 0
    assert list(sim.DOCS.iterdir()) == []


def test_runs_saved_before_pod_starts_were_counted_still_load(
    saved: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = json.loads(saved.read_text())
    for row in rows:
        del row["pod_starts"], row["cancelled_starts"]
    saved.write_text(json.dumps(rows))
    sim.main(["--load-runs", str(saved)])
    assert "mooncake: cost vs kv-threshold-hpa" in capsys.readouterr().out
