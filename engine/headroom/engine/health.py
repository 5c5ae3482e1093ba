"""Whether the engine can still serve after model steps have failed.

One failed step is the request's problem: its requests end with an error and the engine goes
on. A run of failures, or one error from the device itself (after an illegal memory access or
a device-side assert the CUDA context is unusable for the life of the process), means the pod
must go: the engine turns unhealthy for good, `/ready` and `/health` answer 503, `/stats`
stops answering (so the sidecar's `headroom_engine_up` reads 0), and Kubernetes restarts it.

A step that never returns (a hung kernel, an NCCL collective waiting on a dead peer) raises
nothing, so the engine thread reports each step it starts and ends here: while one has run
longer than `step_timeout_s` the engine is unhealthy the same way, naming the step. That lasts
only while the step runs; a step that does return ends it.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
import traceback

log = logging.getLogger(__name__)

DEFAULT_MAX_CONSECUTIVE_FAILURES = 3

# Long enough that no legitimate step reaches it: the first step on a GPU compiles its kernels
# (NVRTC) and warms the allocator, and a CPU prefill of a full `max_num_batched_tokens` batch
# through a large model takes minutes. A false positive restarts a healthy pod under load, while
# a late true positive only delays a restart the liveness probe then makes anyway.
DEFAULT_STEP_TIMEOUT_S = 600.0

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


def _check_step_timeout(step_timeout_s: float) -> float:
    if not (math.isfinite(step_timeout_s) and step_timeout_s > 0):
        raise ValueError(f"step_timeout_s must be a positive number, got {step_timeout_s}")
    return step_timeout_s


class EngineHealth:
    """Counts consecutive failed steps and times the running one; thread-safe (the engine
    thread writes, HTTP reads)."""

    def __init__(
        self,
        max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
    ) -> None:
        if max_consecutive_failures < 1:
            raise ValueError(
                f"max_consecutive_failures must be >= 1, got {max_consecutive_failures}"
            )
        self.max_consecutive_failures = max_consecutive_failures
        self._step_timeout_s = _check_step_timeout(step_timeout_s)
        self._lock = threading.Lock()
        self._consecutive = 0
        self._reason: str | None = None
        # (step number, monotonic start, thread) of the running step; one assignment, so a
        # reader on another thread sees a whole tuple without the lock.
        self._step: tuple[int, float, int] | None = None
        self._reported_stuck: int | None = None
        self.failed_steps_total = 0

    @property
    def step_timeout_s(self) -> float:
        return self._step_timeout_s

    @step_timeout_s.setter
    def step_timeout_s(self, value: float) -> None:
        self._step_timeout_s = _check_step_timeout(value)

    @property
    def healthy(self) -> bool:
        return self.reason is None

    @property
    def reason(self) -> str | None:
        """Why the engine is unhealthy; None while it is healthy."""
        return self._reason or self.stuck_step()

    def step_started(self, step: int) -> None:
        """The engine thread begins step number `step`."""
        self._step = (step, time.monotonic(), threading.get_ident())

    def step_ended(self) -> None:
        """The running step returned (or raised): the watchdog stands down."""
        self._step = None

    def stuck_step(self, now: float | None = None) -> str | None:
        """Which step has run past the step timeout, and for how long; None if none has."""
        running = self._step
        if running is None:
            return None
        step, started, thread = running
        elapsed = (time.monotonic() if now is None else now) - started
        if elapsed <= self._step_timeout_s:
            return None
        reason = (
            f"model step {step} stuck: running for {elapsed:.0f} s, over the step timeout of "
            f"{self._step_timeout_s:g} s (a hung kernel or collective?)"
        )
        if self._reported_stuck != step:  # one log line per stuck step, not one per probe
            self._reported_stuck = step
            # Where it is stuck is what a post-mortem needs: the thread's stack, once.
            frame = sys._current_frames().get(thread)
            stack = "".join(traceback.format_stack(frame)) if frame else "(thread gone)\n"
            log.error("engine step watchdog fired", extra={"reason": reason})
            log.error("the stuck step's thread, innermost last:\n%s", stack.rstrip())
        return reason

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
