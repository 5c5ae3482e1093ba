"""Server-sent events as OpenAI streams them: one `data: <json>` event per chunk, then
`data: [DONE]`."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from headroom.engine.server.errors import APIError

log = logging.getLogger("headroom.server")

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    # Reverse proxies (nginx) buffer responses by default, which would hold back every token.
    "X-Accel-Buffering": "no",
}


def encode_event(data: BaseModel | dict[str, Any] | str) -> bytes:
    """One SSE `data:` event; models are dumped without None-valued keys they do not need."""
    if isinstance(data, BaseModel):
        payload = data.model_dump_json()
    elif isinstance(data, dict):
        payload = json.dumps(data, separators=(",", ":"))
    else:
        payload = data
    return f"data: {payload}\n\n".encode()


class ClientDisconnected(ConnectionResetError):
    """The client went away mid-stream; carries the response already sent, to be returned."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected mid-stream")
        self.response = response


class SSEWriter:
    """Streams events on one response. A write to a client that went away raises
    `ClientDisconnected`: the request's generation is aborted as it unwinds, and the error
    middleware hands back the response quietly (a hang-up is not a server error)."""

    def __init__(self, request: web.Request, headers: dict[str, str] | None = None) -> None:
        self._request = request
        self.response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **(headers or {})})
        self._started = self._done_sent = False

    async def start(self) -> None:
        if not self._started:
            await self.response.prepare(self._request)
            self._started = True

    async def send(self, data: BaseModel | dict[str, Any] | str) -> None:
        await self.start()
        try:
            await self.response.write(encode_event(data))
        except ConnectionResetError as e:
            raise ClientDisconnected(self.response) from e

    async def done(self) -> None:
        """Write the `[DONE]` sentinel and finish the response."""
        await self.send("[DONE]")
        self._done_sent = True
        try:
            await self.response.write_eof()
        except ConnectionResetError as e:
            raise ClientDisconnected(self.response) from e

    @contextlib.asynccontextmanager
    async def failures_as_last_event(self) -> AsyncIterator[None]:
        """Around the streaming: a failure once the response has begun ends it (`_end_with`); one
        before is raised, to be the request's own HTTP error; a client gone is raised. The
        caller returns `response` after it, ended either way."""
        try:
            yield
        except Exception as e:
            if not self.response.prepared or isinstance(e, ConnectionResetError):
                raise
            await self._end_with(e)

    async def _end_with(self, exc: Exception) -> None:
        """End the begun stream with `exc` as an OpenAI error event, then `[DONE]` (never a
        second one, and never raising); anything but an `APIError` is logged and said as a
        500. Once begun, an error cannot be a response of its own: its status line would land
        in this one's body, and the client would wait for an end that never comes."""
        error = exc if isinstance(exc, APIError) else None
        if error is None:
            req = self._request
            log.error("unhandled error mid-stream in %s %s", req.method, req.path, exc_info=exc)
            error = APIError(500, "internal server error (see the server log)")
        if error.close:  # as its own response would: a retry must not come back here
            self.response.force_close()
        if self._done_sent:  # the client has its end of the stream already
            return
        try:
            await self.send(error.body())
            await self.done()
        except Exception as again:  # nothing left to tell the client, nor to raise
            log.debug("the stream's error event was not written: %r", again)
