"""Bearer-token auth for `/v1/*`; the operational endpoints stay open for probes and the sidecar."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from headroom.engine.server.errors import error_response

API_KEY_ENV = "HEADROOM_API_KEY"
PROTECTED_PREFIX = "/v1/"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def key_matches(expected: str, given: str | None) -> bool:
    """Constant-time comparison, so response timing does not leak the key a byte at a time."""
    if given is None:
        return False
    return hmac.compare_digest(expected.encode(), given.encode())


def is_utf8(header: str) -> bool:
    """Whether a header value arrived as UTF-8 (aiohttp keeps other bytes as lone surrogates)."""
    try:
        header.encode()
    except UnicodeEncodeError:
        return False
    return True


def auth_middleware(
    api_key: str,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """A middleware that answers 401 in OpenAI's schema unless the request carries `api_key`."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(PROTECTED_PREFIX) or request.path == PROTECTED_PREFIX[:-1]:
            header = request.headers.get("Authorization")
            if header is not None and not is_utf8(header):
                return error_response(
                    400,
                    "the Authorization header is not valid UTF-8: "
                    "send 'Authorization: Bearer <key>'",
                    code="invalid_authorization_header",
                )
            given = bearer_token(header)
            if not key_matches(api_key, given):
                message = (
                    "missing API key: send 'Authorization: Bearer <key>'"
                    if given is None
                    else "incorrect API key provided"
                )
                return error_response(401, message, code="invalid_api_key")
        return await handler(request)

    return middleware
