"""Errors the engine hands to a request's client (importable without torch)."""

from __future__ import annotations


class RequestFailed(RuntimeError):
    """The engine gave up on a request (its model step or its decoding raised); the request's
    blocks are already freed and the engine goes on serving the others."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(
            f"request {request_id} failed in the engine: {type(cause).__name__}: {cause}"
        )
        self.request_id = request_id
        self.cause = cause
