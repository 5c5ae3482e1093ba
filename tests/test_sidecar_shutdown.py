"""The sidecar's exit: with `--shutdown-wait`, on SIGTERM or SIGINT (the kubelet's, to the
engine and the sidecar at once) it goes on polling and serving while the engine drains, so the
operator still reads the KV a terminating pod holds, and exits 0 once the engine's port refuses
connections; an engine already gone, a second signal or the wait running out ends it at once,
and without the flag it exits at once as before."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from engine_process import ServerProcess, free_port, held_stream

from headroom.sidecar.__main__ import main as sidecar_main

# Every wait below ends here, with a message, should the product be wrong.
DEADLINE_S = 30.0


class Sidecar:
    """`python -m headroom.sidecar` on a free port, its stderr kept."""

    def __init__(self, engine_url: str, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--engine-url", engine_url, "--host", "127.0.0.1", "--port", str(self.port),
                     "--interval", "0.5", "--timeout", "0.4", "--pod", "pod-a", "--namespace",
                     "ns", "--log-level", "INFO", *flags]  # fmt: skip
        self.lines: list[str] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        async for line in self.proc.stderr:
            self.lines.append(line.decode(errors="replace").rstrip("\n"))

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "headroom.sidecar", *self.args, stderr=asyncio.subprocess.PIPE
        )
        self._reader = asyncio.create_task(self._read())
        deadline = time.monotonic() + DEADLINE_S
        while await self.get("/healthz") is None:
            assert self.proc.returncode is None, f"the sidecar exited:\n{self.stderr}"
            assert time.monotonic() < deadline, f"the sidecar never served:\n{self.stderr}"
            await asyncio.sleep(0.05)

    async def get(self, path: str) -> tuple[int, Any] | None:
        """(status, JSON body), or None when the sidecar does not answer."""
        try:
            async with self.http.get(self.url + path) as r:
                return r.status, await r.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def exit_code(self, what: str) -> int:
        """Its exit code, waited for up to DEADLINE_S; `what` says what it should exit after."""
        assert self.proc is not None
        try:
            async with asyncio.timeout(DEADLINE_S):
                code = await self.proc.wait()
        except TimeoutError:
            raise AssertionError(
                f"the sidecar still runs {DEADLINE_S:g} s after {what}:\n{self.stderr}"
            ) from None
        if self._reader is not None:
            await self._reader
        return code

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await self._reader
        await self.http.close()


@contextlib.asynccontextmanager
async def sidecar(engine_url: str, *flags: str) -> AsyncIterator[Sidecar]:
    side = Sidecar(engine_url, *flags)
    try:
        await side.start()
        yield side
    finally:
        await side.close()


@contextlib.asynccontextmanager
async def listening_engine() -> AsyncIterator[str]:
    """A port that accepts connections and never answers: an engine that is still there."""

    writers: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for w in writers:
            w.close()
        await server.wait_closed()


async def test_the_sidecar_reports_a_draining_engine_and_exits_after_it() -> None:
    stats_port = free_port()
    engine = ServerProcess("--model", "tiny", "--max-model-len", "4096", "--num-blocks", "512",
                           "--stats-host", "127.0.0.1", "--stats-port", str(stats_port),
                           "--shutdown-grace", "120")  # fmt: skip
    with engine:
        assert engine.proc is not None
        async with (
            sidecar(f"http://127.0.0.1:{stats_port}", "--shutdown-wait", "60") as side,
            aiohttp.ClientSession() as client,
        ):
            # A request in flight, as on a pod a scale-in removes; it holds KV blocks.
            hold, _, reader = await held_stream(client, engine.url + "/v1/completions")
            deadline = time.monotonic() + DEADLINE_S
            while not ((got := await side.get("/saturation")) and (got[1]["running"] or 0) > 0):
                assert time.monotonic() < deadline, f"the sidecar never saw the request: {got}"
                await asyncio.sleep(0.05)

            # The kubelet: SIGTERM to every container at the same moment.
            t_term = time.time()
            engine.proc.send_signal(signal.SIGTERM)
            side.signal(signal.SIGTERM)

            # What the operator reads of the terminating pod: a reading the sidecar polled
            # after the SIGTERM, with the blocks the engine still holds.
            deadline = time.monotonic() + DEADLINE_S
            report: dict[str, Any] | None = None
            while True:
                assert side.proc is not None and side.proc.returncode is None, (
                    f"the sidecar exited while the engine drained:\n{side.stderr}"
                )
                assert engine.proc.poll() is None, "the engine ended its drain early"
                got = await side.get("/saturation")
                assert got is not None, f"the sidecar stopped answering:\n{side.stderr}"
                status, report = got
                assert status == 200, report
                polled_at = report["time"] - (report["age_seconds"] or 0)
                if report["engine_up"] and report["fresh"] and polled_at > t_term + 0.5:
                    break
                assert time.monotonic() < deadline, f"no reading after SIGTERM: {report}"
                await asyncio.sleep(0.1)
            async with client.get(f"http://127.0.0.1:{stats_port}/stats") as r:
                stats = await r.json()
            assert stats["requests"]["running"] >= 1  # still draining
            assert report["used_blocks"] > 0 and report["running"] >= 1, report
            assert not reader.done(), "the in-flight request ended during the drain"

            # The request ends (its client hangs up), the engine's drain with it: the engine
            # exits, and the sidecar after it.
            reader.cancel()
            hold.close()
            assert await asyncio.to_thread(engine.wait, DEADLINE_S) == 0
            assert await side.exit_code("its engine exited") == 0, side.stderr


async def test_an_engine_already_gone_at_sigterm_ends_the_sidecar_at_once() -> None:
    async with sidecar(f"http://127.0.0.1:{free_port()}", "--shutdown-wait", "600") as side:
        side.signal(signal.SIGTERM)
        assert await side.exit_code("SIGTERM with no engine listening") == 0, side.stderr


@pytest.mark.parametrize(
    ("first", "second"), [("SIGTERM", "SIGTERM"), ("SIGINT", "SIGINT"), ("SIGTERM", "SIGINT")]
)
async def test_a_second_signal_ends_the_wait_at_once(first: str, second: str) -> None:
    async with listening_engine() as url, sidecar(url, "--shutdown-wait", "600") as side:
        side.signal(getattr(signal, first))
        deadline = time.monotonic() + DEADLINE_S
        while "event=shutdown_wait " not in side.stderr:
            assert time.monotonic() < deadline, f"no wait after {first}:\n{side.stderr}"
            await asyncio.sleep(0.05)
        # The engine still listens: the sidecar still serves.
        assert await side.get("/healthz") is not None, side.stderr
        assert side.proc is not None and side.proc.returncode is None
        side.signal(getattr(signal, second))
        assert await side.exit_code(f"{first} then {second}") == 0, side.stderr
    assert "event=shutdown_wait_over" not in side.stderr


async def test_without_shutdown_wait_a_signal_ends_the_sidecar_at_once() -> None:
    async with listening_engine() as url, sidecar(url) as side:
        side.signal(signal.SIGTERM)
        assert await side.exit_code("SIGTERM, with no --shutdown-wait") == 0, side.stderr
    assert "event=shutdown_wait" not in side.stderr


async def test_shutdown_wait_bounds_the_wait_for_an_engine_that_stays() -> None:
    async with listening_engine() as url, sidecar(url, "--shutdown-wait", "0.5") as side:
        side.signal(signal.SIGTERM)
        assert await side.exit_code("its --shutdown-wait of 0.5 s") == 0, side.stderr
    assert "event=shutdown_wait_over" in side.stderr


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_shutdown_wait_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert sidecar_main(["--engine-url", "http://127.0.0.1:1", "--shutdown-wait", value]) == 2
    assert "--shutdown-wait" in capsys.readouterr().err
