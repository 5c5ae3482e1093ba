"""The poll loop: fetch the engine every `interval`, parse, record into `PollState`.

Every failure is classified and counted, never raised: an unreachable, slow or babbling engine
makes the sidecar report `headroom_engine_up 0`, and the loop carries on. Logs are one line per
change of state (up, down, restart), not one per failed poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from headroom.sidecar.config import SidecarConfig
from headroom.sidecar.sources import (
    EngineReading,
    GarbageError,
    parse_headroom_stats,
    parse_sglang_metrics,
    parse_vllm_metrics,
)
from headroom.sidecar.state import ErrorReason, PollState

log = logging.getLogger("headroom.sidecar")

# A /stats body is a few KiB and a vLLM or SGLang exposition tens of KiB; anything far larger
# is not one.
MAX_BODY_BYTES = 8 * 1024 * 1024


class PollFailed(Exception):
    """A poll that produced no reading, with the reason it is counted under."""

    def __init__(self, reason: ErrorReason, message: str) -> None:
        super().__init__(message)
        self.reason: ErrorReason = reason


def parse_body(source: str, body: bytes, page_size: int = 1) -> EngineReading:
    """Parse a response body for `source`; raises GarbageError."""
    if source == "headroom":
        return parse_headroom_stats(body)
    engine = "SGLang" if source == "sglang" else "vLLM"
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GarbageError(f"{engine} /metrics is not UTF-8: {exc}") from exc
    if source == "sglang":
        return parse_sglang_metrics(text, page_size)
    return parse_vllm_metrics(text)


async def _read_limited(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise PollFailed("garbage", f"body larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class Poller:
    """Polls one engine into a `PollState`."""

    def __init__(
        self,
        cfg: SidecarConfig,
        state: PollState,
        session: aiohttp.ClientSession,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.state = state
        self._session = session
        self._clock = clock

    async def fetch(self) -> EngineReading:
        """One request to the engine; raises PollFailed."""
        try:
            async with asyncio.timeout(self.cfg.timeout):
                async with self._session.get(self.cfg.poll_url) as resp:
                    if resp.status != 200:
                        raise PollFailed("http_status", f"HTTP {resp.status}")
                    body = await _read_limited(resp, MAX_BODY_BYTES)
        except TimeoutError as exc:
            raise PollFailed("timeout", f"no answer within {self.cfg.timeout:g} s") from exc
        except (aiohttp.ClientResponseError, aiohttp.ClientPayloadError) as exc:
            # The engine answered, but not with well-formed HTTP.
            raise PollFailed("garbage", f"{type(exc).__name__}: {exc}") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise PollFailed("unreachable", f"{type(exc).__name__}: {exc}") from exc
        try:
            return parse_body(self.cfg.source, body, self.cfg.page_size)
        except GarbageError as exc:
            raise PollFailed("garbage", str(exc)) from exc

    async def poll_once(self) -> None:
        """Fetch once and record the outcome; never raises (except cancellation)."""
        was_up = self.state.last_poll_ok
        try:
            reading = await self.fetch()
        except PollFailed as exc:
            self.state.record_error(exc.reason, str(exc))
            if was_up or self.state.polls_total == 1:
                log.warning(
                    "event=engine_down url=%s reason=%s detail=%r",
                    self.cfg.poll_url,
                    exc.reason,
                    str(exc),
                )
            return
        except Exception as exc:  # a bug here must not stop the exporter
            self.state.record_error("internal", f"{type(exc).__name__}: {exc}")
            log.exception("event=poll_internal_error url=%s", self.cfg.poll_url)
            return
        restarted = self.state.record_success(reading, self._clock())
        if restarted:
            log.warning(
                "event=engine_restart url=%s instance=%s", self.cfg.poll_url, reading.instance_id
            )
        if not was_up:
            log.info("event=engine_up url=%s model=%s", self.cfg.poll_url, reading.model)

    async def run(self) -> None:
        """Poll forever at a fixed rate; an overrunning poll skips the slots it missed."""
        next_t = self._clock()
        while True:
            await self.poll_once()
            next_t += self.cfg.interval
            now = self._clock()
            if next_t < now:
                next_t = now + self.cfg.interval - (now - next_t) % self.cfg.interval
            await asyncio.sleep(next_t - now)
