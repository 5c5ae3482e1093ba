"""`make demo` stopped by SIGTERM or SIGHUP (a CI job cancelled, a closed terminal) stops the
engine and the sidecar it started, as Ctrl-C does."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

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
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig, "".join(seen[-10:]) + rest[-6000:]
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


@pytest.fixture
def demo(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """scripts/demo.py imported, with no signal received yet."""
    module = importlib.import_module("scripts.demo")
    monkeypatch.setattr(module, "_SIGNALLED", [])
    return module


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("ends", ["returns", "raises"])
def test_a_signal_whose_exit_is_lost_still_stops_the_helpers_and_sets_the_status(
    ends: str, demo: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A signal handled while a finalizer runs raises SystemExit there, where Python prints it
    # and goes on: the demo must not run on with its helpers, nor exit as if nothing happened.
    stopped: list[int] = []

    class Finalized:
        def __del__(self) -> None:
            demo._exit_on_signal(signal.SIGTERM, None)

    def main() -> int:
        with demo._process(["-c", "import time; time.sleep(300)"]) as (proc, _):
            lost = Finalized()
            del lost  # the handler runs in the finalizer, and its SystemExit is dropped
            # Stopped by the handler itself, not by the cleanup after it (_run would take
            # a timeout here for the signal's doing: the figure is checked outside it).
            stopped.append(proc.wait(timeout=30))
            if ends == "raises":  # as a step of the demo would, its helpers gone under it
                raise RuntimeError("headroom sidecar exited with -15")
        with demo._process(["-c", "pass"]):  # the next step starts no helper, and exits
            stopped.append(0)
        return 1

    monkeypatch.setattr(demo, "main", main)
    try:
        status = demo._run()
    except SystemExit as e:  # the next step's start (the demo then exits with it)
        status = e.code
    assert status == 128 + signal.SIGTERM
    assert stopped == [-signal.SIGTERM]
    assert demo._HELPERS == []


def test_a_second_signal_stops_the_helpers_again_without_cutting_the_cleanup_short(
    demo: ModuleType,
) -> None:
    sleeper = ["-c", "import time; time.sleep(300)"]
    with pytest.raises(SystemExit) as exited, demo._process(sleeper) as (proc, _):
        try:
            demo._exit_on_signal(signal.SIGTERM, None)
        finally:  # a second signal while the first one unwinds
            assert proc.wait(timeout=30) == -signal.SIGTERM
            demo._exit_on_signal(signal.SIGHUP, None)
    assert exited.value.code == 128 + signal.SIGTERM  # the first signal's, not the second's
    assert demo._SIGNALLED == [signal.SIGTERM, signal.SIGHUP]
    assert demo._HELPERS == []


def test_an_error_without_a_signal_is_the_demos_own(
    demo: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:

    def main() -> int:
        raise RuntimeError("decide() asked more than 1.5x the plan at the ramp's peak")

    monkeypatch.setattr(demo, "main", main)
    with pytest.raises(RuntimeError, match="asked more than"):
        demo._run()


def test_a_signal_while_a_helper_starts_stops_that_helper_too(
    demo: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The handler raised inside Popen() (the signal landing after the fork, before Popen
    # returned): the process had started, and nothing held it to stop it.
    started: list[subprocess.Popen[str]] = []
    real = subprocess.Popen

    def popen(*args: object, **kwargs: object) -> subprocess.Popen[str]:
        proc = real(*args, **kwargs)  # type: ignore[call-overload]
        started.append(proc)
        demo._exit_on_signal(signal.SIGTERM, None)  # the signal, before Popen() returns
        return proc

    monkeypatch.setattr(demo.subprocess, "Popen", popen)
    try:
        sleeper = ["-c", "import time; time.sleep(300)"]
        with pytest.raises(SystemExit) as exited, demo._process(sleeper):
            pytest.fail("the step ran after the signal")
        assert exited.value.code == 128 + signal.SIGTERM
        ((proc,),) = (started,)
        assert proc.poll() == -signal.SIGTERM  # stopped and reaped by the cleanup
        assert demo._HELPERS == [] and demo._STARTING == [False]
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
