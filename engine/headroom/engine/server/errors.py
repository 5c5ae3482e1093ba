"""Errors in OpenAI's schema: one exception type the handlers raise, and its HTTP rendering."""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from headroom.engine.errors import RequestRejected
from headroom.engine.server.protocol import ErrorInfo, ErrorResponse

# OpenAI's `type` for each status; the official client picks its exception class from the status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    417: "invalid_request_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error a handler turns into an OpenAI error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        close: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.close = close  # end the connection after this response (the request is unfinished)
        self.headers = headers or {}  # e.g. a 405's Allow, which RFC 9110 requires

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message,
                type=_TYPES.get(self.status, "server_error"),
                param=self.param,
                code=self.code,
            )
        )

    def response(self) -> web.Response:
        resp = web.json_response(
            self.body().model_dump(), status=self.status, headers=self.headers or None
        )
        if self.close:
            resp.force_close()
        return resp


#: Seconds a 503 that sends the client elsewhere asks it to wait before its retry
#: (`Retry-After`, which the openai client honours): time for the retry's new connection to
#: reach a replica the Service still routes to.
RETRY_ELSEWHERE_AFTER_S = 1


def retry_elsewhere(message: str, code: str = "draining") -> APIError:
    """The 503 of a replica that cannot serve and will not soon (shutting down, its engine
    closed or unhealthy): the connection ends after it (`Connection: close`; an unread request
    body is still read first, so the client sees the 503 and not a reset), so a retry connects
    anew, through the Service, to another replica. On a kept-alive connection, which conntrack
    pins to this pod, every retry would come back here until the pod is gone."""
    return APIError(
        503,
        f"{message}; retry on another replica",
        code=code,
        close=True,
        headers={"Retry-After": str(RETRY_ELSEWHERE_AFTER_S)},
    )


def json_path(loc: tuple[int | str, ...]) -> str:
    """A location as a client writes it: `messages[0].content`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


# Union branches add a type tag to `loc` (`str`, `list[int]`, `TextPart`); field names are
# snake_case, so these are told apart by shape.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\]|[A-Z]\w*)$")


def _first_field_error(err: ValidationError) -> tuple[str, dict[str, Any]]:
    # A union field reports one error per branch; the branch that got furthest (longest loc)
    # is the one the client meant. Model-level validators (loc == ()) carry their own message.
    errors = err.errors(include_url=False)
    e = max(errors, key=lambda x: len(x["loc"]))
    loc = tuple(x for x in e["loc"] if not (isinstance(x, str) and _TYPE_TAG.match(x)))
    return json_path(loc), dict(e)


def from_validation_error(err: ValidationError) -> APIError:
    """A 400 whose message and `param` name the offending field."""
    field, e = _first_field_error(err)
    if e["type"] == "extra_forbidden":
        return APIError(400, f"unknown field '{field}'", param=field, code="unknown_field")
    if e["type"] == "missing":
        return APIError(400, f"missing required field '{field}'", param=field, code="missing")
    msg = str(e["msg"]).removeprefix("Value error, ")
    if not field:
        return APIError(400, msg, code="invalid_value")
    value = e.get("input")
    shown = f" (got {value!r})" if isinstance(value, int | float | str | bool) else ""
    return APIError(400, f"field '{field}': {msg}{shown}", param=field, code="invalid_value")


def rejected(exc: RequestRejected) -> APIError:
    """The one mapping of the engine's validation errors: a 400 with the engine's field and code."""
    return APIError(400, exc.reason, param=exc.param, code=exc.code)


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> web.Response:
    """Shorthand for `APIError(...).response()`."""
    return APIError(status, message, param=param, code=code).response()
