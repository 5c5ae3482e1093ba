"""The aiohttp application's wiring: OpenAI-compatible `/v1/*` (completions.py, chat.py) on top
of the async engine, plus the operational endpoints `/health`, `/ready` and `/stats` here.

Request life cycle: the connection comes through listener.Listener (a cap on open connections,
header, keep-alive and send timeouts; malformed HTTP is a 400 and one log line, see http_log).
`Expect: 100-continue` is answered 401 or 413 at once where the headers already decide
(middleware.expect_handler). The body is read up to `max_body_bytes` (413 beyond) within
`body_timeout_s` (408 after; 400 when it does not decompress), parsed (400 for malformed or
too deeply nested JSON, or text with a lone UTF-16 surrogate, which no tokenizer can encode),
validated by the pydantic models in `protocol` (400 naming the field), tokenized and checked
by the engine's own rules (headroom.engine.validation: a 400 whose `param` names the field and
whose message has the numbers), then each prompt becomes one engine request. Engine outputs
are merged into one response or one SSE stream. However the handler ends (normal finish,
error, client disconnect or a client that stops reading -> handler cancellation), every engine
request it started is aborted unless finished, so its KV blocks return to the pool.

Shutdown (`drain`): new `/v1/*` requests get 503 while the engine finishes or aborts the
running ones within the grace period.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from headroom.engine.server.auth import auth_middleware
from headroom.engine.server.chat import handle_chat
from headroom.engine.server.completions import handle_completions
from headroom.engine.server.errors import APIError
from headroom.engine.server.middleware import (
    admission_middleware,
    connection_middleware,
    error_middleware,
    expect_handler,
)
from headroom.engine.server.protocol import ModelCard, ModelList
from headroom.engine.server.state import (
    DEFAULT_MAX_BODY_BYTES,
    STATE_KEY,
    ServerSettings,
    ServerState,
    state_of,
)

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ServerSettings", "ServerState", "create_app"]


async def handle_models(request: web.Request) -> web.Response:
    st = state_of(request)
    card = ModelCard(
        id=st.settings.served_model_name, created=st.created, max_model_len=st.max_model_len
    )
    return web.json_response(ModelList(data=[card]).model_dump())


async def handle_health(request: web.Request) -> web.Response:
    """Liveness: the process answers (also while the model loads), unless the loaded engine
    can no longer serve: then 503, so the kubelet restarts the container."""
    reason = state_of(request).unhealthy
    if reason is not None:
        return web.json_response({"status": "unhealthy", "reason": reason}, status=503)
    return web.json_response({"status": "ok"})


async def handle_ready(request: web.Request) -> web.Response:
    """Readiness: model loaded and KV pool allocated, and not draining."""
    st = state_of(request)
    if st.ready:
        return web.json_response({"status": "ready", "model": st.settings.served_model_name})
    if st.draining:
        reason = "draining"
    elif st.engine is not None:
        reason = st.unhealthy or "not ready"
    else:
        reason = st.load_error or "loading"
    return web.json_response({"status": "not ready", "reason": reason}, status=503)


async def handle_stats(request: web.Request) -> web.Response:
    """The engine's `StatsSnapshot` (headroom.contract.stats), the sidecar's input."""
    st = state_of(request)
    if st.engine is None:
        raise APIError(503, st.load_error or "model is still loading", code="not_ready")
    if (reason := st.unhealthy) is not None:
        # The sidecar reads a failed poll as headroom_engine_up 0: what a dying pod should show.
        raise APIError(503, reason, code="engine_unhealthy")
    # The name clients send, as vLLM and SGLang name the model in their metrics: the sidecar's
    # `model` label is then the same whatever the runtime (the engine knows its directory's).
    snap = st.engine.stats().model_copy(update={"model": st.settings.served_model_name})
    return web.Response(text=snap.model_dump_json(), content_type="application/json")


def add_ops_routes(app: web.Application) -> None:
    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/stats", handle_stats)


def create_app(state: ServerState, *, api: bool = True) -> web.Application:
    """The application; `api=False` builds the open operational listener only."""
    middlewares: list[Any] = [connection_middleware, error_middleware]
    if api:
        middlewares.append(admission_middleware)
        if state.settings.api_key:
            middlewares.append(auth_middleware(state.settings.api_key))
    # Bodies are read by `read_json` with its own limit; keep aiohttp's above it.
    app = web.Application(
        middlewares=middlewares, client_max_size=state.settings.max_body_bytes * 2
    )
    app[STATE_KEY] = state
    add_ops_routes(app)
    if api:
        app.router.add_post("/v1/completions", handle_completions, expect_handler=expect_handler)
        app.router.add_post("/v1/chat/completions", handle_chat, expect_handler=expect_handler)
        app.router.add_get("/v1/models", handle_models)
    return app
