"""`headroom operator --metrics-host/--liveness-host`: the real process listens where it is told
and nowhere else (it bound 0.0.0.0 whatever the flags said)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from e2e.cluster.harness import Cluster

pytest_plugins = ["e2e.cluster.pytest_plugin"]
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(url: str) -> int | None:
    """The HTTP status of a GET, or None when nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except OSError:
        return None


def test_operator_listens_only_on_the_addresses_it_is_given(
    cluster: Cluster, cluster_namespace: str, tmp_path: Path
) -> None:
    metrics, health = _free_port(), _free_port()
    log = (tmp_path / "operator.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "headroom.contract.cli", "operator",
         "--kubeconfig", str(cluster.kubeconfig), "--namespace", cluster_namespace,
         "--metrics-port", str(metrics), "--metrics-host", "127.0.0.2",
         "--liveness-port", str(health), "--liveness-host", "127.0.0.3", "--log-format", "text"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while _status(f"http://127.0.0.3:{health}/healthz") != 200:
            assert proc.poll() is None, (tmp_path / "operator.log").read_text()
            assert time.monotonic() < deadline, "no /healthz on 127.0.0.3"
            time.sleep(0.5)
        assert _status(f"http://127.0.0.2:{metrics}/metrics") == 200
        for port in (metrics, health):
            assert _status(f"http://127.0.0.1:{port}/") is None, f"port {port} on 127.0.0.1"
        assert _status(f"http://127.0.0.2:{health}/healthz") is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
