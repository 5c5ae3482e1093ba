"""`headroom serve` ends promptly on SIGTERM whatever the engine is doing: during a model load
that takes minutes, and with the engine thread hung in a model step (which the step watchdog
reports on `/health`, `/ready` and `/stats` first)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from engine_process import free_port

from headroom.engine.async_engine import AsyncEngine
from headroom.engine.config import EngineConfig
from headroom.engine.server import runner
from headroom.engine.server.runner import LOAD_THREAD, ListenConfig, serve
from headroom.engine.server.state import ServerSettings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return 0, None


def _until(cond: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


async def test_a_stop_during_the_model_load_returns_without_waiting_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loading = threading.Event()
    release = threading.Event()

    def slow_build(config: EngineConfig) -> AsyncEngine:
        loading.set()
        release.wait()  # a multi-minute checkpoint read, as far as serve can tell
        raise RuntimeError("load released by the test")

    monkeypatch.setattr(runner, "build_engine", slow_build)
    port = free_port()
    stop = asyncio.Event()
    left_behind: list[threading.Thread] = []
    task = asyncio.ensure_future(
        serve(
            EngineConfig(model="tiny"),
            ServerSettings(served_model_name="tiny"),
            ListenConfig(port=port),
            stop=stop,
            out=io.StringIO(),
            left_behind=left_behind,
        )
    )
    try:
        await asyncio.to_thread(loading.wait, 10)
        status, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/ready")
        assert (status, body["reason"]) == (503, "loading")
        stop.set()
        assert await asyncio.wait_for(task, 10) == 0
        # The load goes on in a daemon thread that nothing joins.
        assert [t.name for t in left_behind] == [LOAD_THREAD]
        assert left_behind[0].daemon and left_behind[0].is_alive()
        status, _ = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/health")
        assert status == 0  # the listener is closed
    finally:
        release.set()
        task.cancel()
        for t in left_behind:
            t.join(10)


# `headroom serve` with a hook: HANG_LOAD blocks the model load for good, HANG_STEP blocks
# every model step once that file exists (a stuck kernel or NCCL call, as Python sees it).
_HOOKED_SERVER = """
import os, sys, threading, time
from headroom.engine.engine import Engine
from headroom.engine.server import cli, runner
if os.environ.get("HANG_LOAD"):
    runner.build_engine = lambda config: threading.Event().wait()
_real_step = Engine.step
def step(self):
    while os.path.exists(os.environ.get("HANG_STEP", "/nonexistent")):
        time.sleep(0.05)
    return _real_step(self)
Engine.step = step
sys.exit(cli.main(sys.argv[1:]))
"""


def _start(*flags: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOOKED_SERVER, "--model", "tiny", "--host", "127.0.0.1",
         "--port", str(port), "--num-blocks", "96", "--max-model-len", "512", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
             "PYTHONPATH": os.pathsep.join(
                 [os.path.join(ROOT, d) for d in ("contract", "engine")]
                 + [os.environ.get("PYTHONPATH", "")]), **env},
    )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """SIGTERM, as the kubelet sends; the exit code and the output. A process still there
    after the timeout is killed and fails the test."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"still running after SIGTERM:\n{out}") from None
    return proc.returncode, out


def test_sigterm_during_the_model_load_exits_without_finishing_it() -> None:
    proc, url = _start(env={"HANG_LOAD": "1"})
    try:
        _until(lambda: _get(url + "/ready") == (503, {"status": "not ready", "reason": "loading"}))
        code, out = _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, out
    assert "stopped during the model load" in out


def test_a_hung_step_fails_the_probes_and_sigterm_still_exits(tmp_path: Any) -> None:
    hang = tmp_path / "hang"
    proc, url = _start("--step-timeout", "0.5", "--shutdown-grace", "0",
                       env={"HANG_STEP": str(hang)})  # fmt: skip
    request: threading.Thread | None = None
    try:
        _until(lambda: _get(url + "/ready")[0] == 200)
        hang.touch()
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4}).encode()
        req = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )

        def complete() -> None:
            # The hung request ends with an error when the server goes.
            with contextlib.suppress(OSError):  # HTTPError is one
                urllib.request.urlopen(req, timeout=60).read()

        request = threading.Thread(target=complete, daemon=True)
        request.start()
        _until(lambda: _get(url + "/health")[0] == 503)
        for path in ("/health", "/ready", "/stats"):
            status, answer = _get(url + path)
            assert status == 503, (path, answer)
            assert "model step" in json.dumps(answer) and "stuck" in json.dumps(answer)
        code, out = _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if request is not None:
            request.join(10)
    assert code == 1, out
    assert "engine thread is stuck in a model step" in out
