"""Errors the engine hands to a request's client (importable without torch)."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request that can never be served. `param` names the request field at fault
    (`prompt`, `max_tokens`, ...), `code` the rule it broke; the server maps both to the
    OpenAI error body as they are."""

    def __init__(self, reason: str, *, param: str | None = None, code: str = "invalid_request"):
        super().__init__(reason)
        self.reason = reason
        self.param = param
        self.code = code


class EngineConfigError(ValueError):
    """A setting the engine cannot start with (a pool that holds no block, a length past the
    model's): a bad flag, not a bad model."""


class RequestFailed(RuntimeError):
    """The engine gave up on a request (its model step or its decoding raised); the request's
    blocks are already freed and the engine goes on serving the others."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(
            f"request {request_id} failed in the engine: {type(cause).__name__}: {cause}"
        )
        self.request_id = request_id
        self.cause = cause
