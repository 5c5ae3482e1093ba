"""`AsyncEngine`: the engine's step loop on one background thread, streamed to asyncio.

Torch on the CPU would block the event loop for a whole step, so every `Engine` call happens
on the engine thread; the event loop only exchanges commands and outputs with it.

    engine = AsyncEngine.from_config(EngineConfig(model="tiny"))
    await engine.start()
    try:
        async for out in engine.stream("req-1", prompt_ids, SamplingParams(max_tokens=32)):
            ...  # RequestOutput deltas; the last one has finished=True
    except RequestRejected as exc:  # raised before the first output: map to HTTP 400
        ...
    await engine.shutdown(grace_s=10)

- `stream(request_id, prompt_token_ids, params)` is an async generator of deltas; the deltas
  a slow consumer has not taken yet are folded into one (see `_Sink`), so what waits for it
  stays bounded by the output's size, not its number of steps. The request is
  submitted on the first `__anext__`, which raises `RequestRejected` (bad request: too long,
  token ids outside the vocabulary, duplicate id) or `EngineClosed` (shutting down: HTTP 503)
  before anything is yielded. Closing the generator early (client disconnect, `aclose()`,
  task cancellation) aborts the request, which frees its KV blocks; closed while the request
  still waits for the engine thread, it is never admitted at all.
- `abort(request_id)` may be called from any thread; the stream then ends with a final output
  whose unfinished completions carry `finish_reason="abort"`.
- `stats()` returns the snapshot published after the latest step (no waiting on the thread),
  or raises `EngineClosed` while a step is stuck: that snapshot is frozen, not current.
- `shutdown(grace_s)` stops admitting, lets running requests finish for up to `grace_s`
  seconds, aborts the rest and stops the thread. A thread still inside a step
  `STOP_MARGIN_S` after that is left behind (it is a daemon thread): shutdown returns False.
- A failed step ends only its own requests' streams, with `RequestFailed`; the engine goes on.
  `health` (see `headroom.engine.health`) turns unhealthy after a run of failed steps, one
  device error, or while a step runs past its step timeout: new requests then get
  `EngineClosed`, and the server's probes fail.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from headroom.contract.stats import StatsSnapshot
from headroom.engine.config import EngineConfig
from headroom.engine.engine import Engine, StepFailed
from headroom.engine.errors import RequestFailed, RequestRejected
from headroom.engine.health import EngineHealth
from headroom.engine.model.tokenizer import Tokenizer
from headroom.engine.outputs import CompletionOutput, RequestOutput
from headroom.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

# Seconds `shutdown` waits, after the grace period, for the thread to finish its current step
# and abort what is left. A step normally takes far less, so a thread still busy then is
# most likely hung (in a kernel or a collective): Python cannot interrupt it, and waiting
# longer only ends in the kubelet's SIGKILL. Grace 30 + 10 + the handlers' 5 s flush stays
# inside the 60 s the operator's rendered pod leaves after its preStop sleep.
STOP_MARGIN_S = 10.0


class EngineClosed(RuntimeError):
    """The engine is shutting down or stopped and takes no new requests."""


@dataclass(slots=True)
class _Backlog:
    """A request's outputs not yet taken by its stream, folded into one delta. Texts are kept
    as pieces, joined once when taken: folding never copies the text so far."""

    head: RequestOutput
    by_index: dict[int, CompletionOutput] = field(default_factory=dict)
    pieces: dict[int, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for c in self.head.outputs:
            self.by_index[c.index] = c
            self.pieces[c.index] = [c.text]

    def fold(self, delta: RequestOutput) -> None:
        """Append a later delta of the same request (its outputs are this backlog's now)."""
        head = self.head
        for c in delta.outputs:
            prev = self.by_index.get(c.index)
            if prev is None:
                head.outputs.append(c)
                self.by_index[c.index] = c
                self.pieces[c.index] = [c.text]
                continue
            self.pieces[c.index].append(c.text)
            prev.token_ids.extend(c.token_ids)
            prev.cumulative_text = c.cumulative_text
            prev.finish_reason = c.finish_reason
            prev.stop_reason = c.stop_reason
        head.finished = delta.finished
        head.first_token_time = delta.first_token_time
        head.finished_time = delta.finished_time
        head.num_cached_tokens = delta.num_cached_tokens

    def take(self) -> RequestOutput:
        """The folded delta, completions in index order as the engine lists them."""
        for c in self.head.outputs:
            c.text = "".join(self.pieces[c.index])
        self.head.outputs.sort(key=lambda c: c.index)
        return self.head


class _Sink:
    """A stream's mailbox: the engine thread puts, the stream's loop gets. Consecutive outputs
    are folded into one entry while the consumer is behind, so a stalled stream holds O(output)
    bytes rather than one delta per step; an error is an entry of its own, kept in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: deque[_Backlog | BaseException] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Queue `item` from any thread; never blocks beyond a fold."""
        with self._lock:
            was_empty = not self._items
            last = self._items[-1] if self._items else None
            if isinstance(item, BaseException):
                self._items.append(item)
            elif isinstance(last, _Backlog):
                last.fold(item)
            else:
                self._items.append(_Backlog(item))
        # Only an empty sink can have a waiter; a non-empty one was already signalled.
        if was_empty:
            # RuntimeError: the consumer's loop is closed, so nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._ready.set)

    async def get(self) -> RequestOutput | BaseException:
        """The next entry, waiting for one; on the sink's loop only."""
        while True:
            with self._lock:
                if self._items:
                    item = self._items.popleft()
                    break
                # Cleared under the lock: a put after this sees an empty sink and signals.
                self._ready.clear()
            await self._ready.wait()
        # Taken off the sink, the backlog is the consumer's alone: join outside the lock.
        return item if isinstance(item, BaseException) else item.take()


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: _Sink
    done: concurrent.futures.Future[None]


@dataclass(slots=True)
class _Abort:
    request_id: str
    # From a stream's cleanup: abort only while this sink is the request's, so a stream whose
    # request never got in (cancelled while queued, rejected as a duplicate id) cannot abort
    # another stream's request of the same id. None (`abort()`): whatever has that id.
    sink: _Sink | None = None


@dataclass(slots=True)
class _AbortAll:
    pass


_Command = _Add | _Abort | _AbortAll


class AsyncEngine:
    """Owns an `Engine` and the single thread allowed to drive it."""

    def __init__(self, engine: Engine, health: EngineHealth | None = None) -> None:
        self.engine = engine
        self.health = health or EngineHealth()
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stopped = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._steps = 0
        self._stats = engine.stats()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Build the engine (loads the model, allocates KV) without starting the thread."""
        return cls(Engine.from_config(config))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_request(
        self, prompt_token_ids: list[int], max_tokens: int | None, *, where: str = "prompt"
    ) -> int:
        """`Engine.check_request`: the engine's own validation, callable from any thread (it
        reads only the model's fixed limits)."""
        return self.engine.check_request(prompt_token_ids, max_tokens, where=where)

    async def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="headroom-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def thread(self) -> threading.Thread | None:
        """The engine thread: None before `start` and after a shutdown that stopped it."""
        return self._thread

    async def stream(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request and yield its `RequestOutput` deltas until it finishes."""
        if not self.health.healthy:
            raise EngineClosed(f"the engine is unhealthy: {self.health.reason}")
        if not self._accepting or not self.running:
            raise EngineClosed("the engine is not accepting requests")
        sink = _Sink(asyncio.get_running_loop())
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._send(_Add(request_id, list(prompt_token_ids), params, sink, done))
        finished = False
        try:
            try:
                await asyncio.wrap_future(done)  # RequestRejected / EngineClosed surface here
            except Exception:
                finished = True  # never admitted: nothing to abort
                raise
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._send(_Abort(request_id, sink))

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the next step."""
        self._send(_Abort(request_id))

    def stats(self) -> StatsSnapshot:
        """The latest published snapshot, stamped with the current time (between steps nothing
        changes); `EngineClosed` while a step is stuck, since the snapshot is then frozen."""
        stuck = self.health.stuck_step()
        if stuck is not None:
            raise EngineClosed(f"the engine is unhealthy: {stuck}")
        return self._stats.model_copy(update={"time": time.time()})

    async def shutdown(self, grace_s: float = 10.0, stop_margin_s: float = STOP_MARGIN_S) -> bool:
        """Stop admitting, wait up to `grace_s` for running requests, abort the rest, stop.

        False when the thread is still in a step `stop_margin_s` after the grace period: it is
        left running (a daemon thread, so it does not hold the process), since no Python call
        can interrupt a hung kernel."""
        self._accepting = False
        thread = self._thread
        if thread is None:
            return True
        deadline = time.monotonic() + max(0.0, grace_s)
        # A stuck step finishes nothing: waiting out the grace for it is time lost.
        while (
            not self._idle.is_set()
            and self.health.stuck_step() is None
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.01)
        self._send(_AbortAll())
        self._commands.put(None)
        # Polled, not `to_thread(thread.join)`: a join on an executor thread outlives a timeout
        # and holds up the interpreter's exit.
        stop_by = time.monotonic() + max(0.0, stop_margin_s)
        while thread.is_alive() and time.monotonic() < stop_by:
            await asyncio.sleep(0.01)
        if thread.is_alive():
            reason = self.health.stuck_step() or "still in a model step"
            log.error("engine thread did not stop; leaving it behind", extra={"reason": reason})
            # Its streams would wait for outputs that never come: end them here instead. The
            # thread, stuck in the step, is not touching the sinks.
            error = EngineClosed(f"the engine thread did not stop: {reason}")
            for sink in list(self._sinks.values()):
                sink.put(error)
            return False
        self._thread = None
        return True

    # -- the engine thread ------------------------------------------------------------------

    def _send(self, command: _Command) -> None:
        self._commands.put(command)

    def _run(self) -> None:
        engine = self.engine
        while True:
            block = not engine.has_unfinished()
            try:
                command = self._commands.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                command = None
                stop = False
            else:
                stop = command is None
                if command is not None:
                    self._handle_safely(command)
                    # Drain every queued command before the next step.
                    while True:
                        try:
                            nxt = self._commands.get_nowait()
                        except queue.Empty:
                            break
                        if nxt is None:
                            stop = True
                            break
                        self._handle_safely(nxt)
            if stop:
                self._abort_all()
                self._publish()
                self._idle.set()
                return
            if engine.has_unfinished():
                self._idle.clear()
                self._steps += 1
                self.health.step_started(self._steps)
                try:
                    outputs = engine.step()
                except StepFailed as exc:
                    # Health first: a client told of its failure then sees it counted.
                    outputs = exc.outputs
                    if exc.whole_step:
                        self._record_failure(exc.cause)
                    else:
                        self.health.record_success()
                    self._fail(exc.failures)
                except Exception as exc:  # never let one bad step kill the thread
                    log.exception("engine step failed; aborting in-flight requests")
                    self._record_failure(exc)
                    self._fail_all(exc)
                    outputs = []
                else:
                    self.health.record_success()
                finally:
                    self.health.step_ended()
                # Publish first: a consumer that sees a final output also sees it counted.
                self._publish()
                for out in outputs:
                    self._deliver(out)
            else:
                self._publish()
            if not engine.has_unfinished():
                self._idle.set()

    def _handle_safely(self, command: _Command) -> None:
        """`_handle`, except that a command that raises is logged and dropped: one bad command
        must not kill the engine thread (a dead thread fails every stream and every probe)."""
        try:
            self._handle(command)
        except Exception as exc:
            log.exception("engine command failed", extra={"command": type(command).__name__})
            if isinstance(command, _Add) and not command.done.done():
                # The stream is still waiting on it: tell it rather than leave it hanging.
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    command.done.set_exception(exc)

    def _handle(self, command: _Command) -> None:
        engine = self.engine
        if isinstance(command, _Add):
            # A stream closed while its request was queued (client gone) cancelled `done`:
            # skip the request, admitting nothing. Once running, `done` can no longer be
            # cancelled, so the results below always land; a stream closed from now on sends
            # an abort, which the queue delivers after this add.
            if not command.done.set_running_or_notify_cancel():
                return
            if not self._accepting:
                command.done.set_exception(EngineClosed("the engine is shutting down"))
                return
            if not self.health.healthy:
                reason = f"the engine is unhealthy: {self.health.reason}"
                command.done.set_exception(EngineClosed(reason))
                return
            try:
                engine.add_request(command.request_id, command.prompt_token_ids, command.params)
            except Exception as exc:
                command.done.set_exception(exc)
                return
            self._sinks[command.request_id] = command.sink
            self._idle.clear()
            command.done.set_result(None)
        elif isinstance(command, _Abort):
            if command.sink is not None:
                target = self._sinks.get(command.request_id)
                if target is not command.sink:
                    return  # that stream's request is not (or no longer) in the engine
            out = engine.abort(command.request_id)
            if out is not None:
                self._publish()
                self._deliver(out)
        else:
            self._abort_all()

    def _abort_all(self) -> None:
        for request_id in list(self._sinks):
            out = self.engine.abort(request_id)
            if out is not None:
                self._deliver(out)
            self._sinks.pop(request_id, None)

    def _record_failure(self, exc: BaseException) -> None:
        if self.health.record_failure(exc):
            log.error(
                "engine unhealthy; refusing new requests", extra={"reason": self.health.reason}
            )

    def _fail(self, failures: dict[str, RequestFailed]) -> None:
        for request_id, error in failures.items():
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink.put(error)

    def _fail_all(self, exc: Exception) -> None:
        failures = {}
        for request_id in list(self._sinks):
            self.engine.abort(request_id)
            failures[request_id] = RequestFailed(request_id, exc)
        self._fail(failures)

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return
        if out.finished:
            del self._sinks[out.request_id]
        sink.put(out)

    def _publish(self) -> None:
        try:
            self._stats = self.engine.stats()
        except Exception:
            log.exception("stats snapshot failed")


__all__ = ["AsyncEngine", "EngineClosed", "RequestFailed", "RequestRejected"]
