"""Running the server: listeners first (so `/health` answers while weights load), then the
engine, the budget line, and on SIGTERM/SIGINT a graceful drain that exits 0.

Shutdown order: stop admitting (`/v1/*` -> 503, `/ready` -> 503), let the engine finish or
abort what runs within the grace period (aborted completions end with finish_reason "abort"),
wait for the handlers to write their last bytes, then close the listeners.

Threads Python cannot interrupt are left behind rather than waited for: the model load (a
SIGTERM during it closes the listeners and returns at once) and an engine thread hung in a
step (after the grace period plus a margin, see `AsyncEngine.shutdown`). `serve` lists them
in `left_behind`, so the CLI can end the process without waiting on them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import sys
import threading
from typing import Any, TextIO

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, model_validator

from headroom.engine.async_engine import AsyncEngine
from headroom.engine.attention import BackendUnavailable
from headroom.engine.config import EngineConfig
from headroom.engine.errors import EngineConfigError
from headroom.engine.model.loader import load_failure
from headroom.engine.server.app import ServerSettings, ServerState, create_app
from headroom.engine.server.budget_report import budget_report
from headroom.engine.server.chat_template import (
    ChatTemplate,
    UnusableTemplate,
    serving_chat_template,
)
from headroom.engine.server.http_log import rate_limited_accept_errors
from headroom.engine.server.listener import (
    SEND_TIMEOUT_S,
    ConnectionLimits,
    Listener,
    default_max_connections,
    open_files_limit,
)

log = logging.getLogger("headroom.server")

# Seconds the handlers get, after the engine drained, to write their final chunks.
HANDLER_FLUSH_S = 5.0


# The stats listener's default cap: the kubelet's three probes and the sidecar's poll, with room.
STATS_MAX_CONNECTIONS = 64


class ListenConfig(BaseModel):
    """Where to listen; the stats listener (open /health, /ready, /stats) defaults to the main.
    Timeouts in seconds; `max_connections` per listener, None: derived from the open-files
    limit (see listener.default_max_connections)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    stats_host: str | None = None
    stats_port: int | None = Field(default=None, ge=0, le=65535)
    keepalive_timeout_s: float = Field(default=5.0, gt=0)
    header_timeout_s: float = Field(default=10.0, gt=0)
    send_timeout_s: float = Field(default=SEND_TIMEOUT_S, gt=0)
    max_connections: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> ListenConfig:
        if self.stats_host is not None and self.stats_port is None:
            raise ValueError("stats_host needs stats_port (the separate listener's port)")
        if self.stats_port and self.stats_port == self.port and self._hosts_overlap():
            raise ValueError(
                f"stats_port {self.stats_port} is also --port: the stats listener needs a port "
                "of its own (or leave stats_port out to serve /health /ready /stats on --port)"
            )
        return self

    def _hosts_overlap(self) -> bool:
        """Whether both listeners would bind one address (a wildcard covers every one)."""
        stats = self.stats_host if self.stats_host is not None else self.host
        wildcard = ("", "0.0.0.0", "::")
        return stats == self.host or stats in wildcard or self.host in wildcard

    @property
    def separate_stats(self) -> bool:
        return self.stats_port is not None

    def limits(self) -> ConnectionLimits:
        """The API listener's timeouts and connection cap."""
        # By default a stats listener takes its small share off the open-files limit, not half:
        # only the kubelet and the sidecar connect to it.
        spare = STATS_MAX_CONNECTIONS if self.separate_stats else 0
        cap = self.max_connections or default_max_connections(open_files_limit() - spare)
        return ConnectionLimits(
            keepalive_timeout_s=self.keepalive_timeout_s,
            header_timeout_s=self.header_timeout_s,
            send_timeout_s=self.send_timeout_s,
            max_connections=cap,
        )

    def stats_limits(self) -> ConnectionLimits:
        """The stats listener's: the API's timeouts, and `--max-connections` or a small cap."""
        api = self.limits()
        cap = self.max_connections or min(api.max_connections, STATS_MAX_CONNECTIONS)
        return api.model_copy(update={"max_connections": cap})


LOAD_THREAD = "headroom-load"


def build_engine(config: EngineConfig) -> AsyncEngine:
    """Load the model and allocate the pool (blocking; run it off the event loop)."""
    return AsyncEngine.from_config(config)


async def _load(config: EngineConfig, left_behind: list[threading.Thread]) -> AsyncEngine:
    """`build_engine` on a daemon thread of its own, not `asyncio.to_thread`: a load cut short
    by SIGTERM cannot be interrupted, and the executor's threads are joined by `asyncio.run`
    and at interpreter exit, which would wait out the load. Cancelling this leaves the thread
    loading, listed in `left_behind`."""
    done: concurrent.futures.Future[AsyncEngine] = concurrent.futures.Future()

    def run() -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(build_engine(config))
        except BaseException as e:
            done.set_exception(e)

    thread = threading.Thread(target=run, name=LOAD_THREAD, daemon=True)
    thread.start()
    try:
        # wrap_future hands the result to this loop, and drops it once the loop is closed.
        return await asyncio.wrap_future(done)
    except asyncio.CancelledError:
        left_behind.append(thread)
        raise


async def _unless_stopped(work: asyncio.Future[AsyncEngine], stop: asyncio.Event) -> bool:
    """Wait for `work` or `stop`, whichever comes first; True when `stop` came first (then
    `work` is cancelled)."""
    stopped = asyncio.ensure_future(stop.wait())
    waiting: set[asyncio.Future[Any]] = {work, stopped}
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        stopped.cancel()
    if work.done():
        return False
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    return True


async def _listen(
    runner: web.AppRunner, host: str, port: int, limits: ConnectionLimits, handler_args: Any
) -> tuple[Listener, int]:
    """Serve `runner`'s app on host:port through our accept loop (capped, with timeouts)."""
    assert runner.server is not None
    listener = Listener(runner.server, limits, handler_args)
    return listener, await listener.start(host, port)


def attach_engine(
    state: ServerState,
    engine: AsyncEngine,
    model: str,
    max_model_len: int,
    template: ChatTemplate | None = None,
) -> ChatTemplate:
    """Hand a started engine to the HTTP side: from here on the API serves and `/ready` is 200.
    `template`: the model's chat template when already read (`serve` reads it before the
    weights), else read here."""
    template = template if template is not None else serving_chat_template(model)
    state.tokenizer = engine.tokenizer
    state.max_model_len = max_model_len
    state.chat_template = template
    state.engine = engine
    return template


async def serve(
    config: EngineConfig,
    settings: ServerSettings,
    listen: ListenConfig,
    *,
    stop: asyncio.Event | None = None,
    out: TextIO | None = None,
    left_behind: list[threading.Thread] | None = None,
) -> int:
    """Run until `stop` is set (or SIGTERM/SIGINT); 0 after a clean drain (or a stop during
    the model load), 1 if the model failed to load or the engine thread hung past the grace
    period, 2 if the KV pool cannot hold one max-length sequence or the model directory's
    tokenizer_config.json (or chat_template.jinja) cannot be read: that is said before any
    listener opens or weight loads. A chat template that does not compile is logged, and chat
    requests get 400 naming it while completions serve (as in transformers and vLLM). Threads
    still running that Python cannot stop (see the module docstring) are appended to
    `left_behind`."""
    out = out or sys.stdout
    stop = stop or asyncio.Event()
    left_behind = left_behind if left_behind is not None else []
    try:
        # Read before the weights: a broken file fails in a second, not after the load.
        template = serving_chat_template(config.model)
    except (OSError, ValueError) as e:
        print(f"headroom serve: --model: {e}", file=sys.stderr, flush=True)
        return 2
    if isinstance(template, UnusableTemplate):
        log.warning("%s: chat requests will get 400, completions serve", template.reason)
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(rate_limited_accept_errors())
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Fails off the main thread (tests run serve() in one); the caller sets `stop` then.
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    state = ServerState(settings, max_model_len=config.max_model_len or 0)
    access_log = logging.getLogger("aiohttp.access") if log.isEnabledFor(logging.DEBUG) else None
    runners: list[web.AppRunner] = []
    listeners: list[Listener] = []
    limits = listen.limits()
    # After a response, aiohttp reads (and drops) an unread body for `lingering_time` so the
    # client sees the response and not a reset; a client gets no longer than for the body.
    linger = min(10.0, settings.body_timeout_s)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # engine requests (see generation.Generation) instead of computing tokens nobody reads.
    main = web.AppRunner(
        create_app(state),
        handler_cancellation=True,
        access_log=access_log,
        shutdown_timeout=HANDLER_FLUSH_S,
    )
    await main.setup()
    runners.append(main)
    listener, port = await _listen(
        main, listen.host, listen.port, limits, {"access_log": access_log, "lingering_time": linger}
    )
    listeners.append(listener)
    # Probes get answers during a load of minutes; "ready" below says when it can serve.
    print(
        f"headroom serve: listening on http://{listen.host}:{port}, loading the model",
        file=out,
        flush=True,
    )
    if listen.separate_stats:
        ops = web.AppRunner(
            create_app(state, api=False), access_log=None, shutdown_timeout=HANDLER_FLUSH_S
        )
        await ops.setup()
        runners.append(ops)
        stats_host = listen.stats_host or listen.host
        assert listen.stats_port is not None
        ops_listener, sport = await _listen(
            ops,
            stats_host,
            listen.stats_port,
            listen.stats_limits(),
            {"access_log": None, "lingering_time": linger},
        )
        listeners.append(ops_listener)
        print(f"headroom serve: /health /ready /stats on http://{stats_host}:{sport}", file=out,
              flush=True)  # fmt: skip
    code = 0
    try:
        loading = asyncio.ensure_future(_load(config, left_behind))
        if await _unless_stopped(loading, stop):
            print("headroom serve: stopped during the model load", file=out, flush=True)
            return 0
        try:
            engine = loading.result()
        except (EngineConfigError, BackendUnavailable) as e:
            state.load_error = str(e)  # a flag the engine cannot run with: exit 2
            print(f"headroom serve: {e}", file=sys.stderr, flush=True)
            return 2
        except Exception as e:
            # A broken checkpoint raises whatever its parser raises (KeyError, SafetensorError,
            # JSONDecodeError): one line naming it, not a traceback.
            log.debug("model load failed", exc_info=True)
            state.load_error = f"model failed to load: {load_failure(e)}"
            print(f"headroom serve: {state.load_error}", file=sys.stderr, flush=True)
            return 1
        report = budget_report(engine.engine)
        print(f"headroom serve: {report.line()}", file=out, flush=True)
        engine.health.step_timeout_s = settings.step_timeout_s
        await engine.start()
        attach_engine(state, engine, config.model, report.max_model_len, template)
        print(
            f"headroom serve: ready, model '{settings.served_model_name}', chat template "
            f"{template.source}",
            file=out,
            flush=True,
        )
        await stop.wait()
        print("headroom serve: shutting down", file=out, flush=True)
        state.draining = True
        if not await engine.shutdown(settings.shutdown_grace_s):
            assert engine.thread is not None
            left_behind.append(engine.thread)
            print(
                "headroom serve: the engine thread is stuck in a model step; exiting without it",
                file=sys.stderr,
                flush=True,
            )
            code = 1
        if not await state.wait_idle(HANDLER_FLUSH_S):
            log.warning("handlers still running after drain: %d", state.active)
    finally:
        state.draining = True
        for ln in listeners:
            await ln.close()
        for r in reversed(runners):
            await r.cleanup()
    print("headroom serve: stopped", file=out, flush=True)
    return code
