"""Failure isolation: a step that raises (the model, the block copies, sampling) fails only its
own requests, and a request whose own decoding raises fails alone. Either way the failed
requests are aborted (their blocks freed), every other request goes on, and `step()` raises
`StepFailed` naming them; the next `step()` runs as usual."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from headroom.engine.errors import RequestFailed
from headroom.engine.outputs import RequestOutput

log = logging.getLogger(__name__)


class StepFailed(RuntimeError):
    """Some requests of a step failed and were aborted (blocks freed); `outputs` are the deltas
    of the requests that did progress, `failures` the error of each failed request."""

    def __init__(
        self,
        cause: BaseException,
        failures: dict[str, RequestFailed],
        outputs: list[RequestOutput],
        whole_step: bool,
    ) -> None:
        what = "model step" if whole_step else "decoding"
        super().__init__(
            f"{what} failed for {len(failures)} request(s): {type(cause).__name__}: {cause}"
        )
        self.cause = cause
        self.failures = failures
        self.outputs = outputs
        self.whole_step = whole_step


def fail_requests(
    abort: Callable[[str], RequestOutput | None], request_ids: Iterable[str], exc: BaseException
) -> dict[str, RequestFailed]:
    """Abort `request_ids` with `abort` and say why, one error per request it knew."""
    ids = sorted(set(request_ids))
    log.error(
        "requests failed in the engine",
        extra={"requests": ids, "error": f"{type(exc).__name__}: {exc}"},
    )
    return {rid: RequestFailed(rid, exc) for rid in ids if abort(rid) is not None}
