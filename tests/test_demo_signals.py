"""`make demo` stopped by SIGTERM or SIGHUP (a CI job cancelled, a closed terminal) stops the
engine and the sidecar it started, as Ctrl-C does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(180)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command may hold spaces and parentheses: the fields after the last ')' are fixed.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_stops_the_demo_and_its_children(sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, "scripts/demo.py"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    children: list[int] = []
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:  # up to the point where both helpers run
            seen.append(line)
            if "sidecar polling" in line:
                break
        else:
            pytest.fail("the demo ended before its sidecar ran:\n" + "".join(seen[-40:]))
        children = _children(proc.pid)
        assert len(children) == 2, children  # the engine and the sidecar
        proc.send_signal(sig)
        proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig
        deadline = time.monotonic() + 30
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [c for c in children if _alive(c)], "left running after the demo exited"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for c in children:  # a failed run must not leave them to the next test
            if _alive(c):
                os.kill(c, signal.SIGKILL)
