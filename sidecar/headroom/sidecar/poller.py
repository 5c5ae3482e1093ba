"""The poll loop: fetch the engine every `interval`, parse, record into `PollState`.

Every failure is classified and counted, never raised: an unreachable, slow or babbling engine
makes the sidecar report `headroom_engine_up 0`, and the loop carries on. Logs are one line per
change of state (up, down, restart), not one per failed poll.

For an SGLang server whose `/metrics` carries no pool size (0.5.3), the poller also reads its
server-info endpoint, once a minute: the pool does not change while the server runs, and is
read again at once when the server restarts (a new instance may have another pool). A server
that does not answer there still reports occupancy, only without block counts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from headroom.sidecar.accrual import ArrivalCounter
from headroom.sidecar.config import SidecarConfig
from headroom.sidecar.sglang_source import (
    SERVER_INFO_PATHS,
    SglangServerInfo,
    parse_sglang_metrics,
    parse_sglang_server_info,
)
from headroom.sidecar.sources import EngineReading, GarbageError, parse_headroom_stats
from headroom.sidecar.state import ErrorReason, PollState
from headroom.sidecar.vllm_source import parse_vllm_metrics

log = logging.getLogger("headroom.sidecar")

# A /stats body is a few KiB and a vLLM or SGLang exposition tens of KiB; anything far larger
# is not one.
MAX_BODY_BYTES = 8 * 1024 * 1024
# SGLang's server info: read again this often while known, retried this often while not.
SERVER_INFO_REFRESH_S = 60.0
SERVER_INFO_RETRY_S = 10.0


class PollFailed(Exception):
    """A poll that produced no reading, with the reason it is counted under."""

    def __init__(self, reason: ErrorReason, message: str) -> None:
        super().__init__(message)
        self.reason: ErrorReason = reason


def parse_body(
    source: str, body: bytes, page_size: int = 1, server_info: SglangServerInfo | None = None
) -> EngineReading:
    """Parse a response body for `source`; raises GarbageError."""
    if source == "headroom":
        return parse_headroom_stats(body)
    engine = "SGLang" if source == "sglang" else "vLLM"
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GarbageError(f"{engine} /metrics is not UTF-8: {exc}") from exc
    if source == "sglang":
        return parse_sglang_metrics(text, page_size, server_info)
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
        self._arrivals = ArrivalCounter()
        self.server_info: SglangServerInfo | None = None
        self._server_info_due = clock()
        self._server_info_error: str | None = None

    async def _get(self, url: str, guarded: bool = False) -> bytes:
        """One GET within the poll timeout (with the engine's key on a `guarded` route);
        raises PollFailed."""
        key = self.cfg.api_key
        headers = {"Authorization": f"Bearer {key.get_secret_value()}"} if guarded and key else {}
        try:
            async with asyncio.timeout(self.cfg.timeout):
                async with self._session.get(url, headers=headers) as resp:
                    if resp.status != 200:
                        raise PollFailed("http_status", f"HTTP {resp.status}")
                    return await _read_limited(resp, MAX_BODY_BYTES)
        except TimeoutError as exc:
            raise PollFailed("timeout", f"no answer within {self.cfg.timeout:g} s") from exc
        except (aiohttp.ClientResponseError, aiohttp.ClientPayloadError) as exc:
            # The engine answered, but not with well-formed HTTP.
            raise PollFailed("garbage", f"{type(exc).__name__}: {exc}") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise PollFailed("unreachable", f"{type(exc).__name__}: {exc}") from exc

    async def fetch(self) -> EngineReading:
        """One poll of the engine (and, when due, SGLang's server info); raises PollFailed."""
        body = await self._get(self.cfg.poll_url)
        # A release that exports its pool size in /metrics needs no second request.
        if self.cfg.source != "sglang" or b"sglang:max_total_num_tokens" in body:
            return self._parse(body)
        asked = await self._refresh_server_info()
        reading = self._parse(body)
        if asked is not True and self.server_info is not None and self.state.is_restart(reading):
            # The pool known is the dead instance's, and a restarted server may have another
            # (another --max-total-tokens or --mem-fraction-static, or profiled otherwise):
            # read the new one's now. Should it not answer (this poll's refresh failed, or
            # this one does), its blocks are unknown, not the old.
            self.server_info = None
            if asked is None:
                self._server_info_due = self._clock()
                await self._refresh_server_info()
            reading = self._parse(body)
        return reading

    def _parse(self, body: bytes) -> EngineReading:
        try:
            return parse_body(self.cfg.source, body, self.cfg.page_size, self.server_info)
        except GarbageError as exc:
            raise PollFailed("garbage", str(exc)) from exc

    async def _refresh_server_info(self) -> bool | None:
        """Read SGLang's server info when due: None when not due, else whether it was read.
        A failure keeps what was known, and is logged once per change, never counted as a
        failed poll."""
        if self._clock() < self._server_info_due:
            return None
        errors: list[str] = []
        for path in SERVER_INFO_PATHS:
            try:
                self.server_info = parse_sglang_server_info(
                    # SGLang's --api-key guards its server info (not /metrics).
                    await self._get(self.cfg.engine_route(path), guarded=True)
                )
            except (PollFailed, GarbageError) as exc:
                errors.append(f"{path}: {exc}")
                continue
            except Exception as exc:  # the pool size is optional: it must not cost the poll
                errors.append(f"{path}: {type(exc).__name__}: {exc}")
                continue
            errors = []
            break
        error = "; ".join(errors) or None
        retry = SERVER_INFO_RETRY_S if error else SERVER_INFO_REFRESH_S
        self._server_info_due = self._clock() + retry
        if error and error != self._server_info_error:
            log.warning(
                "event=server_info_unavailable url=%s detail=%r (block counts need the pool "
                "size; retrying every %g s)",
                self.cfg.engine_route(""),
                error,
                retry,
            )
        elif not error and self._server_info_error and self.server_info:
            log.info("event=server_info pool_tokens=%s", self.server_info.pool_tokens)
        self._server_info_error = error
        return error is None

    async def poll_once(self) -> None:
        """Fetch once and record the outcome; never raises (except cancellation)."""
        was_up = self.state.last_poll_ok
        try:
            reading = await self.fetch()
            # A reading the state cannot keep (a bug, or a figure the parser let through that
            # it should not have) is an internal error like any other: counted, and polling
            # goes on.
            restarted = self.state.record_success(self._arrivals.apply(reading), self._clock())
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
