"""The request pipeline around every handler: OpenAI error bodies for every failure, admission
(503 while loading, draining or unhealthy), `Expect: 100-continue` answered only once the
key and size checks pass, and bounded JSON body parsing (size, time, nesting, and text that
is valid Unicode)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import HttpVersion11, hdrs, web
from pydantic import BaseModel, ValidationError

from headroom.engine.errors import RequestRejected
from headroom.engine.server.auth import auth_middleware
from headroom.engine.server.errors import (
    APIError,
    from_validation_error,
    json_path,
    rejected,
    retry_elsewhere,
)
from headroom.engine.server.http_log import one_line
from headroom.engine.server.listener import ConnectionHandler
from headroom.engine.server.sse import ClientDisconnected
from headroom.engine.server.state import state_of

log = logging.getLogger("headroom.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_Req = TypeVar("_Req", bound=BaseModel)
# An HTTPException's headers that describe its own text body, not the JSON one replacing it.
_BODY_HEADERS = frozenset({"content-type", "content-length", "content-encoding"})


@web.middleware
async def connection_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Tells the connection that a request's headers are in (their deadline stops) and when the
    handler is done (the next request's headers get a deadline of their own)."""
    proto = request.protocol
    if not isinstance(proto, ConnectionHandler):  # e.g. aiohttp's test server
        return await handler(request)
    proto.request_started()
    try:
        return await handler(request)
    finally:
        proto.request_finished()


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
        # Headers that belong to the status (a 405's Allow) survive the new body.
        kept = {k: v for k, v in e.headers.items() if k.lower() not in _BODY_HEADERS}
        return APIError(
            e.status, e.reason or "error", code=e.reason.lower().replace(" ", "_"), headers=kept
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
    """503 while the model loads, the server drains or the engine is unhealthy (the last two
    also close the connection: see errors.retry_elsewhere); counts in-flight API requests."""
    if not request.path.startswith("/v1/"):
        return await handler(request)
    st = state_of(request)
    if st.draining:
        raise retry_elsewhere("server is shutting down")
    if st.engine is None:
        msg = st.load_error or "model is still loading"
        raise APIError(503, msg, code="not_ready")
    if (reason := st.unhealthy) is not None:
        # Until the kubelet restarts the pod, a retry on this connection would come back here.
        raise retry_elsewhere(reason, code="engine_unhealthy")
    st.enter()
    try:
        return await handler(request)
    finally:
        st.leave()


# What `_admitted` hands back, so the expect handler can tell the auth middleware let it by.
_ADMITTED = web.StreamResponse(status=100)


async def _admitted(_: web.Request) -> web.StreamResponse:
    return _ADMITTED


async def expect_handler(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue` (curl sends it for bodies over 1 MiB): a request refused for its
    headers alone (no or a wrong API key, a Content-Length over the limit) gets its 401 or 413
    now, before it is invited to send a body it would send in vain. aiohttp calls this before
    the middlewares; None goes on to them."""
    if request.version != HttpVersion11:
        return None  # HTTP/1.0 has no 100 Continue
    expect = request.headers.get(hdrs.EXPECT, "")
    if expect.lower() != "100-continue":
        return APIError(
            417, f"unsupported Expect header: {expect!r}", code="expectation_failed", close=True
        ).response()
    settings = state_of(request).settings
    refusal: web.StreamResponse | None = None
    if settings.api_key:
        # The auth middleware itself decides, so the two answers cannot drift apart.
        answer = await auth_middleware(settings.api_key)(request, _admitted)
        refusal = None if answer is _ADMITTED else answer
    if refusal is None and (request.content_length or 0) > settings.max_body_bytes:
        refusal = _too_large(settings.max_body_bytes).response()
    if refusal is not None:
        # The client may send the body anyway or not at all: no next request can follow.
        refusal.force_close()
        return refusal
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # as aiohttp's default: the 100 is not the response's size
    return None


# --- body parsing ------------------------------------------------------------------------


# A UTF-16 surrogate escape, or the UTF-8-style bytes of one (json.loads decodes bytes with
# "surrogatepass"): only a body that has one can decode to a string with a lone surrogate.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
# After decoding, a valid pair is one code point: any surrogate left is a lone one.
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(body: Any) -> tuple[str, int, str] | None:
    """The first string (or key) in a decoded JSON value with a lone UTF-16 surrogate, which no
    tokenizer can encode: (its path like `messages[0].content`, the index, the code point)."""
    stack: list[tuple[tuple[int | str, ...], Any]] = [((), body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if m := _SURROGATE.search(value):
                return json_path(path), m.start(), m.group()
        elif isinstance(value, dict):
            for k, v in reversed(value.items()):
                stack.append(((*path, k), v))
                stack.append((path, k))  # a bad key is reported at its object
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(value))))
    return None


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"request body exceeds the limit of {limit} bytes", code="request_too_large"
    )


async def _read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    too_large = _too_large(limit)
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_chunked(64 * 1024):
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        expected = "" if request.content_length is None else f" of {request.content_length}"
        raise APIError(
            408,
            f"request body not received within {timeout_s:g}s ({size}{expected} bytes arrived)",
            code="request_timeout",
            close=True,
        ) from None
    except web.RequestPayloadError as e:
        raise _bad_body(request, e) from None
    return b"".join(chunks)


def _bad_body(request: web.Request, exc: web.RequestPayloadError) -> APIError:
    """A 400 for a body aiohttp could not decode (bad gzip or deflate, broken chunk framing):
    the client's fault, not a 500 with a traceback."""
    cause = exc.__cause__
    reason = one_line(getattr(cause, "message", None) or str(cause or exc))
    # Not logged here: after the response aiohttp reads the rest of the body, meets the same
    # error, and listener.ConnectionHandler writes its one rate-limited line, as it does for
    # a body nobody read (a 401).
    log.debug("malformed request body from %s: %s", request.remote, reason)
    # The parser is past the point of a clean next request on this connection: close it.
    return APIError(400, f"malformed request body: {reason}", code="invalid_body", close=True)


async def read_json(request: web.Request, limit: int, timeout_s: float = 30.0) -> dict[str, Any]:
    """The request body as a JSON object: 413 beyond `limit` bytes, 408 when it takes over
    `timeout_s` seconds to arrive, 400 when malformed, too deeply nested or not valid Unicode."""
    raw = await _read_body(request, limit, timeout_s)
    try:
        body = json.loads(raw)
    except RecursionError:
        # The C decoder recurses once per level; Python's recursion limit is its bound.
        raise APIError(
            400, "malformed JSON body: arrays or objects nested too deeply", code="invalid_json"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from e
    except ValueError as e:
        # An integer literal longer than Python's int-conversion limit (4300 digits): its
        # own message names a Python setting the client cannot change.
        raise APIError(
            400, "malformed JSON body: an integer with more than 4300 digits", code="invalid_json"
        ) from e
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    if _MAYBE_SURROGATE.search(raw) and (bad := lone_surrogate(body)) is not None:
        where, index, char = bad
        raise APIError(
            400,
            f"field '{where}' has a lone UTF-16 surrogate ({char!r} at index {index}): text "
            "must be valid Unicode (a surrogate only as half of a pair)",
            param=where or None,
            code="invalid_unicode",
        )
    return body


async def parse_request(request: web.Request, model: type[_Req]) -> _Req:
    settings = state_of(request).settings
    body = await read_json(request, settings.max_body_bytes, settings.body_timeout_s)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from e
