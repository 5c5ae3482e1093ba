"""Cluster.wait against a stand-in kubectl: a status with no conditions yet is waited on."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.cluster.harness import Cluster, CommandError

NO_CONDITIONS = (
    "error: .status.conditions accessor error: <nil> is of the type <nil>, expected []interface{}"
)


def stand_in(tmp_path: Path, fail_times: int, stderr: str) -> Cluster:
    """A cluster whose kubectl fails `fail_times` times with `stderr`, then meets the
    condition; each call's arguments are appended to calls.txt."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        f"if [ \"$(wc -l < {calls})\" -le {fail_times} ]; then echo '{stderr}' >&2; exit 1; fi\n"
        'echo "crd/x condition met"\n'
    )
    kubectl.chmod(0o755)
    env = tmp_path / "cluster.env"
    env.write_text(
        f"HEADROOM_CLUSTER_DIR={tmp_path}\nHEADROOM_CLUSTER_BIN={bin_dir}\n"
        f"KUBECONFIG={tmp_path / 'kubeconfig'}\n"
    )
    return Cluster("stand-in", state_dir=tmp_path).attach(env)


def calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "calls.txt").read_text().splitlines()


def test_a_status_without_conditions_yet_is_waited_on(tmp_path: Path) -> None:
    cluster = stand_in(tmp_path, fail_times=2, stderr=NO_CONDITIONS)
    out = cluster.wait("--for=condition=Established", "crd/x", timeout=30)
    assert out.strip() == "crd/x condition met"
    made = calls(tmp_path)
    assert len(made) == 3
    assert all(c.split()[2:5] == ["wait", "--for=condition=Established", "crd/x"] for c in made)
    assert all("--timeout=" in c for c in made)


def test_any_other_failure_is_raised_at_once(tmp_path: Path) -> None:
    cluster = stand_in(tmp_path, fail_times=5, stderr='Error from server (NotFound): "x"')
    with pytest.raises(CommandError, match="NotFound"):
        cluster.wait("--for=condition=Established", "crd/x", timeout=30)
    assert len(calls(tmp_path)) == 1


def test_conditions_that_never_come_fail_at_the_timeout(tmp_path: Path) -> None:
    cluster = stand_in(tmp_path, fail_times=10_000, stderr=NO_CONDITIONS)
    with pytest.raises(CommandError, match="accessor error"):
        cluster.wait("--for=condition=Established", "crd/x", timeout=1)
    assert len(calls(tmp_path)) >= 2
