"""scripts/tools.sh on machines that lack one tool or another, with apt-get, systemctl and pkill
as logging stubs: it installs what is missing and stops only the service it installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = ("prometheus", "promtool", "openssl", "curl", "g++")


def _run(tmp_path: Path, present: set[str]) -> list[str]:
    stubs, log = tmp_path / "bin", tmp_path / "calls.log"
    stubs.mkdir()
    for real in ("dirname",):
        found = shutil.which(real)
        assert found is not None
        (stubs / real).symlink_to(found)
    logging = f'#!/bin/sh\necho "${{0##*/}} $*" >> {log}\n'
    for name in ("apt-get", "systemctl", "pkill", "sudo", *sorted(present)):
        (stubs / name).write_text(logging)
        (stubs / name).chmod(0o755)
    # id: root, and the package's `prometheus` system user exists.
    (stubs / "id").write_text("#!/bin/sh\necho 0\n")
    (stubs / "id").chmod(0o755)
    bash = shutil.which("bash")
    assert bash is not None
    subprocess.run([bash, str(REPO / "scripts" / "tools.sh")], env={"PATH": str(stubs)},
                   check=True, capture_output=True)  # fmt: skip
    return [line for line in log.read_text().splitlines() if not line.startswith(TOOLS)]


@pytest.mark.skipif(shutil.which("dirname") is None, reason="needs coreutils")
def test_a_missing_compiler_leaves_the_hosts_prometheus_alone(tmp_path: Path) -> None:
    # It used to stop (systemctl disable --now) and pkill -x every Prometheus, a concurrent
    # clone's test servers included, whatever tool was missing.
    calls = _run(tmp_path, set(TOOLS) - {"g++"})
    assert any(c.startswith("apt-get") and c.endswith("g++") for c in calls), calls
    assert not [c for c in calls if c.startswith(("systemctl", "pkill"))], calls


@pytest.mark.skipif(shutil.which("dirname") is None, reason="needs coreutils")
def test_installing_prometheus_stops_only_the_packages_own_daemon(tmp_path: Path) -> None:
    calls = _run(tmp_path, set(TOOLS) - {"prometheus", "promtool"})
    assert "systemctl disable --now prometheus" in calls
    assert "pkill -u prometheus -x prometheus" in calls  # its system user's, never ours
    assert any("DPkg::Lock::Timeout" in c for c in calls if c.startswith("apt-get"))
