"""The request pipeline around every handler: OpenAI error bodies for every failure, admission
(503 while loading, draining or unhealthy), and bounded JSON body parsing."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from headroom.engine.errors import RequestRejected
from headroom.engine.server.errors import APIError, from_validation_error, rejected
from headroom.engine.server.sse import ClientDisconnected
from headroom.engine.server.state import state_of

log = logging.getLogger("headroom.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_Req = TypeVar("_Req", bound=BaseModel)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as an OpenAI error body, unexpected ones as a logged 500."""
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except RequestRejected as e:
        return rejected(e).response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return APIError(
            e.status, e.reason or "error", code=e.reason.lower().replace(" ", "_")
        ).response()
    except ClientDisconnected as e:
        log.debug("client went away during %s %s", request.method, request.path)
        return e.response
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return APIError(500, "internal server error (see the server log)").response()


@web.middleware
async def admission_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """503 while the model loads or the server drains; counts in-flight API requests."""
    if not request.path.startswith("/v1/"):
        return await handler(request)
    st = state_of(request)
    if st.draining:
        raise APIError(503, "server is shutting down; retry on another replica", code="draining")
    if st.engine is None:
        msg = st.load_error or "model is still loading"
        raise APIError(503, msg, code="not_ready")
    if (reason := st.unhealthy) is not None:
        raise APIError(503, f"{reason}; retry on another replica", code="engine_unhealthy")
    st.enter()
    try:
        return await handler(request)
    finally:
        st.leave()


# --- body parsing ------------------------------------------------------------------------


async def read_json(request: web.Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 beyond `limit` bytes, 400 when malformed."""
    too_large = APIError(
        413, f"request body exceeds the limit of {limit} bytes", code="request_too_large"
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return body


async def parse_request(request: web.Request, model: type[_Req]) -> _Req:
    body = await read_json(request, state_of(request).settings.max_body_bytes)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from e
