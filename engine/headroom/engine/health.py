"""Whether the engine can still serve after model steps have failed.

One failed step is the request's problem: its requests end with an error and the engine goes
on. A run of failures, or one error from the device itself (after an illegal memory access or
a device-side assert the CUDA context is unusable for the life of the process), means the pod
must go: the engine turns unhealthy for good, `/ready` and `/health` answer 503, `/stats`
stops answering (so the sidecar's `headroom_engine_up` reads 0), and Kubernetes restarts it.
"""

from __future__ import annotations

import threading

DEFAULT_MAX_CONSECUTIVE_FAILURES = 3

# Messages of torch and CuPy errors that poison the CUDA context, not just one launch.
_DEVICE_MARKERS = (
    "cuda error",
    "cudaerror",
    "cuda_error",
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
    "cublas_status_execution_failed",
    "nccl error",
)
_DEVICE_ERROR_TYPES = ("CUDARuntimeError", "CUDADriverError", "AcceleratorError")


def is_device_error(exc: BaseException) -> bool:
    """True for an error of the GPU itself, after which no later step can be trusted."""
    for e in _chain(exc):
        if type(e).__name__ in _DEVICE_ERROR_TYPES:
            return True
        text = str(e).lower()
        if any(marker in text for marker in _DEVICE_MARKERS):
            return True
    return False


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


class EngineHealth:
    """Counts consecutive failed steps; thread-safe (the engine thread writes, HTTP reads)."""

    def __init__(self, max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES) -> None:
        if max_consecutive_failures < 1:
            raise ValueError(
                f"max_consecutive_failures must be >= 1, got {max_consecutive_failures}"
            )
        self.max_consecutive_failures = max_consecutive_failures
        self._lock = threading.Lock()
        self._consecutive = 0
        self._reason: str | None = None
        self.failed_steps_total = 0

    @property
    def healthy(self) -> bool:
        return self._reason is None

    @property
    def reason(self) -> str | None:
        """Why the engine is unhealthy; None while it is healthy."""
        return self._reason

    @property
    def consecutive_failures(self) -> int:
        return self._consecutive

    def record_success(self) -> None:
        with self._lock:
            self._consecutive = 0

    def record_failure(self, exc: BaseException) -> bool:
        """Count a failed step; True when this failure made the engine unhealthy."""
        with self._lock:
            self.failed_steps_total += 1
            self._consecutive += 1
            if self._reason is not None:
                return False
            if is_device_error(exc):
                self._reason = f"device error in a model step: {type(exc).__name__}: {exc}"
            elif self._consecutive >= self.max_consecutive_failures:
                self._reason = (
                    f"{self._consecutive} consecutive model steps failed; last: "
                    f"{type(exc).__name__}: {exc}"
                )
            else:
                return False
            return True
