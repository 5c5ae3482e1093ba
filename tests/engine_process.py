"""Run `headroom serve` as a subprocess (tests and benchmarks): start it on a free port,
wait for `/ready`, keep its output, and stop it with SIGTERM like Kubernetes does."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import TracebackType

import aiohttp


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m headroom.engine.server --port <free> *args` as a context manager.

    `torch_threads` (default 1) sets OMP_NUM_THREADS for the server unless `env` sets it: on
    a small shared CPU, torch's intra-op threads spin against each other and against the
    client, and the small matrices of test models gain nothing from them.
    """

    def __init__(
        self,
        *args: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 180.0,
        wait_ready: bool = True,
        torch_threads: int | None = 1,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--host", "127.0.0.1", "--port", str(self.port), *args]
        threads = {"OMP_NUM_THREADS": str(torch_threads)} if torch_threads else {}
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **threads, **(env or {})}
        self.ready_timeout_s = ready_timeout_s
        self.wait_ready = wait_ready
        self.lines: list[str] = []
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def start(self) -> ServerProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "headroom.engine.server", *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if self.wait_ready:
            self.wait_until_ready()
        return self

    def wait_until_ready(self) -> None:
        """Poll `/ready`; raise with the server's output if it exits or never gets ready."""
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.wait(5)
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} before ready:\n{self.output}"
                )
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {self.ready_timeout_s:.0f}s:\n{self.output}")

    def wait(self, timeout_s: float) -> int:
        """Wait for exit (and for its output to be read); the exit code."""
        assert self.proc is not None
        code = self.proc.wait(timeout=timeout_s)
        if self._reader is not None:
            self._reader.join(timeout=5)
        return code

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait; SIGKILL if it does not exit in time. The exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.wait(10)

    def __enter__(self) -> ServerProcess:
        try:
            return self.start()
        except BaseException:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.terminate()


async def held_stream(
    session: aiohttp.ClientSession, completions_url: str
) -> tuple[aiohttp.ClientResponse, list[bytes], asyncio.Task[None]]:
    """A long streaming completion in flight on the tiny model (it holds KV blocks until it
    ends): its response, the lines read so far, and the task reading them."""
    hold = await session.post(completions_url, json={
        "model": "tiny", "prompt": "long", "max_tokens": 4000, "stream": True,
        "ignore_eos": True})  # fmt: skip
    assert hold.status == 200
    streamed: list[bytes] = []

    async def read_hold() -> None:
        async for line in hold.content:
            streamed.append(line)

    return hold, streamed, asyncio.create_task(read_hold())
