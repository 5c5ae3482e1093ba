"""scripts/device_run.sh, the one script a GPU session runs on a lent machine: it must parse,
and its engine bench must run on a CPU host (the cuda rows say "no GPU"), so the GPU minutes
are not spent finding a typo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("contract", "engine", "sidecar", "operator", ".")


def test_the_device_script_parses() -> None:
    run = subprocess.run(
        ["bash", "-n", str(ROOT / "scripts" / "device_run.sh")], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr


def test_the_engine_backends_bench_prints_its_table_on_the_cpu() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / s) for s in SOURCES)}
    argv = ["--device", "cpu", "--models", "tiny", "--batches", "1", "--new-tokens", "4"]
    run = subprocess.run(
        [sys.executable, "-m", "bench.engine_backends", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line.split() for line in run.stdout.splitlines()]
    torch_row = next(r for r in rows if r[:3] == ["torch", "auto", "1"])
    assert float(torch_row[3]) > 0  # tokens/s
    assert ["cuda", "fp8", "-", "-", "-", "no", "GPU", "(informational)"] in rows
    assert "no GPU (not graded)" in run.stdout
    assert "verdicts: 0 PASS, 0 MISS" in run.stdout
