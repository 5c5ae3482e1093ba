"""The sidecar's HTTP side: `/metrics`, `/saturation`, `/healthz`, and the poll task under it.

`/healthz` reports on the sidecar, not the engine: a sidecar whose engine is down is healthy
(it is correctly exporting `headroom_engine_up 0`), and restarting it would lose the window.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web
from prometheus_client.exposition import generate_latest

from headroom.sidecar.collector import SidecarCollector, make_registry
from headroom.sidecar.config import SidecarConfig
from headroom.sidecar.poller import Poller
from headroom.sidecar.saturation import build_report
from headroom.sidecar.state import PollState, figures

log = logging.getLogger("headroom.sidecar")

# The classic text format every Prometheus 2.x parses; what generate_latest writes for our names.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

STATE_KEY = web.AppKey("state", PollState)
CONFIG_KEY = web.AppKey("config", SidecarConfig)
TASK_KEY = web.AppKey("poll_task", asyncio.Task[None])


def build_app(
    cfg: SidecarConfig,
    clock: Callable[[], float] = time.monotonic,
    listening: asyncio.Event | None = None,
) -> web.Application:
    """The sidecar as an aiohttp application; the poll loop runs for the app's lifetime, from
    when `listening` is set if one is given."""
    state = PollState(horizon=max(cfg.window, cfg.forecast_window) + cfg.interval)
    registry = make_registry(SidecarCollector(state, cfg, clock))
    app = web.Application()
    app[STATE_KEY] = state
    app[CONFIG_KEY] = cfg

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": METRICS_CONTENT_TYPE}
        )

    async def saturation(_: web.Request) -> web.Response:
        report = build_report(figures(state, cfg, clock()), cfg)
        return web.Response(body=report.model_dump_json(), content_type="application/json")

    async def healthz(_: web.Request) -> web.Response:
        task = app.get(TASK_KEY)
        alive = task is not None and not task.done()
        body = {"status": "ok" if alive else "poll loop stopped", "engine_up": state.last_poll_ok}
        return web.json_response(body, status=200 if alive else 503)

    async def poll_loop(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=None)  # the poller applies its own per-poll deadline
        async with aiohttp.ClientSession(timeout=timeout) as session:
            poller = Poller(cfg, state, session, clock)

            async def run() -> None:
                if listening is not None:
                    await listening.wait()
                await poller.run()

            app[TASK_KEY] = asyncio.create_task(run(), name="headroom-sidecar-poll")
            yield
            app[TASK_KEY].cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await app[TASK_KEY]

    app.cleanup_ctx.append(poll_loop)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/saturation", saturation)
    app.router.add_get("/healthz", healthz)
    return app


async def serve(cfg: SidecarConfig, stop: asyncio.Event | None = None) -> None:
    """Run the sidecar until `stop` is set (or forever)."""
    # Polling starts once the port is ours: a sidecar that cannot listen exits with that
    # reason alone, not after an engine_down from a poll it had no business making.
    listening = asyncio.Event()
    runner = web.AppRunner(build_app(cfg, listening=listening), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, cfg.host, cfg.port).start()
        listening.set()
        log.info(
            "event=sidecar_listening host=%s port=%d engine=%s source=%s",
            cfg.host,
            cfg.port,
            cfg.poll_url,
            cfg.source,
        )
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()
