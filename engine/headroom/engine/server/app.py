"""The aiohttp application: OpenAI-compatible `/v1/*` on top of the async engine, plus the
operational endpoints `/health`, `/ready` and `/stats`.

Request life cycle: the body is read up to `max_body_bytes` (413 beyond), parsed (400 for
malformed JSON), validated by the pydantic models in `protocol` (400 naming the field),
tokenized and checked against `max_model_len` (400 with the numbers), then each prompt becomes
one engine request. Engine outputs are merged into one response or one SSE stream. However
the handler ends (normal finish, error, client disconnect -> handler cancellation), every
engine request it started is aborted unless finished, so its KV blocks return to the pool.

Shutdown (`drain`): new `/v1/*` requests get 503 while the engine finishes or aborts the
running ones within the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from headroom.engine.errors import RequestFailed
from headroom.engine.server.auth import auth_middleware
from headroom.engine.server.chat_template import ChatTemplate, ChatTemplateError
from headroom.engine.server.errors import APIError, from_validation_error
from headroom.engine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    new_id,
    now,
)
from headroom.engine.server.sse import ClientDisconnected, SSEWriter

log = logging.getLogger("headroom.server")

DEFAULT_MAX_BODY_BYTES = 4 * 2**20

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_Req = TypeVar("_Req", bound=BaseModel)


class EngineClient(Protocol):
    """What the server uses of `headroom.engine.async_engine.AsyncEngine`."""

    def stream(self, request_id: str, prompt_token_ids: list[int], params: Any) -> Any: ...

    def abort(self, request_id: str) -> Any: ...

    def stats(self) -> Any: ...


class ServerSettings(BaseModel):
    """The HTTP side of `headroom serve` (the engine has its own `EngineConfig`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str = Field(min_length=1)
    api_key: str | None = None
    max_body_bytes: int = Field(default=DEFAULT_MAX_BODY_BYTES, ge=1024)
    shutdown_grace_s: float = Field(default=30.0, ge=0)


@dataclass
class ServerState:
    """Mutable runtime state shared by handlers: set `engine` once the model is loaded."""

    settings: ServerSettings
    max_model_len: int = 0
    engine: EngineClient | None = None
    tokenizer: Any = None
    chat_template: ChatTemplate | None = None
    sampling_params: Callable[..., Any] | None = None
    rejected_error: type[Exception] = ValueError
    closed_error: type[Exception] = RuntimeError
    draining: bool = False
    load_error: str | None = None
    created: int = field(default_factory=now)
    active: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def unhealthy(self) -> str | None:
        """Why the loaded engine can no longer serve (its thread died, or too many failed
        steps, see headroom.engine.health); None while it can, or while it is loading."""
        if self.engine is None:
            return None
        if not getattr(self.engine, "running", True):
            return "engine loop stopped"
        health = getattr(self.engine, "health", None)
        if health is not None and not health.healthy:
            return f"engine unhealthy: {health.reason}"
        return None

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.unhealthy is None and not self.draining

    def enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no `/v1/*` request is in flight; False on timeout."""
        if self.active == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


STATE_KEY = web.AppKey("headroom_state", ServerState)


def _state(request: web.Request) -> ServerState:
    return request.app[STATE_KEY]


# --- middlewares ---------------------------------------------------------------------------


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as an OpenAI error body, unexpected ones as a logged 500."""
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return APIError(
            e.status, e.reason or "error", code=e.reason.lower().replace(" ", "_")
        ).response()
    except ClientDisconnected as e:
        log.debug("client went away during %s %s", request.method, request.path)
        return e.response
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return APIError(500, "internal server error (see the server log)").response()


@web.middleware
async def admission_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """503 while the model loads or the server drains; counts in-flight API requests."""
    if not request.path.startswith("/v1/"):
        return await handler(request)
    st = _state(request)
    if st.draining:
        raise APIError(503, "server is shutting down; retry on another replica", code="draining")
    if st.engine is None:
        msg = st.load_error or "model is still loading"
        raise APIError(503, msg, code="not_ready")
    if (reason := st.unhealthy) is not None:
        raise APIError(503, f"{reason}; retry on another replica", code="engine_unhealthy")
    st.enter()
    try:
        return await handler(request)
    finally:
        st.leave()


# --- body parsing --------------------------------------------------------------------------


async def read_json(request: web.Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 beyond `limit` bytes, 400 when malformed."""
    too_large = APIError(
        413, f"request body exceeds the limit of {limit} bytes", code="request_too_large"
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return body


async def parse_request(request: web.Request, model: type[_Req]) -> _Req:
    body = await read_json(request, _state(request).settings.max_body_bytes)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from e


# --- engine requests -----------------------------------------------------------------------


async def _maybe_await(value: Any) -> None:
    if inspect.isawaitable(value):
        await value


@dataclass
class _Job:
    index: int
    request_id: str
    prompt_ids: list[int]
    finished: bool = False


class Generation:
    """One HTTP request's engine requests (one per prompt), merged into one event stream of
    `(prompt_index, RequestOutput)`. Use as `async with`: leaving aborts what is unfinished."""

    def __init__(self, st: ServerState, base_id: str, prompts: list[list[int]], params: Any):
        assert st.engine is not None
        self._engine = st.engine
        self._rejected = st.rejected_error
        self._closed = st.closed_error
        self.jobs = [_Job(i, f"{base_id}-{i}", ids) for i, ids in enumerate(prompts)]
        self._params = params
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def _pump(self, job: _Job) -> None:
        try:
            it = self._engine.stream(job.request_id, job.prompt_ids, self._params)
            if inspect.isawaitable(it):
                it = await it
            try:
                async for out in it:
                    if out.finished:
                        job.finished = True
                    await self._queue.put((job.index, out))
            finally:
                aclose = getattr(it, "aclose", None)
                if aclose is not None:
                    await aclose()
            job.finished = True
            await self._queue.put((job.index, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await self._queue.put((job.index, e))

    async def __aenter__(self) -> Generation:
        self._tasks = [asyncio.create_task(self._pump(j)) for j in self.jobs]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for job in self.jobs:
            if not job.finished:
                with contextlib.suppress(Exception):
                    await _maybe_await(self._engine.abort(job.request_id))

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        """Outputs in arrival order until every prompt finished; engine errors are raised
        (a rejected request as a 400)."""
        pending = len(self.jobs)
        while pending:
            index, item = await self._queue.get()
            if item is None:
                pending -= 1
                continue
            if isinstance(item, Exception):
                if isinstance(item, self._rejected):
                    raise APIError(400, str(item), param="max_tokens", code="request_rejected")
                if isinstance(item, self._closed):
                    raise APIError(503, f"{item}; retry on another replica", code="draining")
                if isinstance(item, RequestFailed):
                    raise APIError(500, str(item), code="engine_error")
                if isinstance(item, ValueError):
                    raise APIError(400, str(item), code="invalid_request")
                raise item
            yield index, item


# --- shared request preparation ------------------------------------------------------------


def _check_model(st: ServerState, model: str | None) -> str:
    name = st.settings.served_model_name
    if model is not None and model != name:
        raise APIError(
            404,
            f"the model '{model}' does not exist; this server serves '{name}'",
            param="model",
            code="model_not_found",
        )
    return name


def _check_length(st: ServerState, prompt_len: int, max_tokens: int | None, i: int) -> int:
    """The max_tokens to use; a 400 with both numbers when prompt + output exceed the limit."""
    limit = st.max_model_len
    where = f"prompt {i}" if i else "prompt"
    if prompt_len >= limit:
        raise APIError(
            400,
            f"{where} has {prompt_len} tokens, leaving no room to generate within "
            f"max_model_len {limit}",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise APIError(
            400,
            f"{where} {prompt_len} + max_tokens {max_tokens} = {prompt_len + max_tokens} tokens "
            f"exceeds max_model_len {limit}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def _check_token_ids(st: ServerState, ids: list[int]) -> None:
    vocab = int(getattr(st.tokenizer, "vocab_size", 0) or 0)
    if vocab and any(t >= vocab for t in ids):
        bad = max(ids)
        raise APIError(
            400, f"token id {bad} is out of range for a vocabulary of {vocab}", param="prompt"
        )


def _sampling(
    st: ServerState, req: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> Any:
    assert st.sampling_params is not None
    try:
        return st.sampling_params(
            n=req.n,
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop=req.stop_list,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
        )
    except ValidationError as e:
        raise from_validation_error(e) from e


@dataclass
class _Tally:
    """Per-choice text and finish reasons, and token counts for `usage`."""

    texts: dict[int, list[str]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, choice: int, out: Any) -> None:
        self.texts.setdefault(choice, []).append(out.text or "")
        self.completion_tokens += len(out.token_ids or [])
        if out.finish_reason is not None:
            self.finish[choice] = out.finish_reason


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


# --- handlers ------------------------------------------------------------------------------


async def handle_completions(request: web.Request) -> web.StreamResponse:
    st = _state(request)
    req = await parse_request(request, CompletionRequest)
    model = _check_model(st, req.model)
    prompts: list[list[int]] = []
    max_tokens = req.max_tokens
    for p in req.prompts():
        if isinstance(p, str):
            ids = list(st.tokenizer.encode(p))
        else:
            ids = list(p)
            _check_token_ids(st, ids)
        if not ids:
            raise APIError(400, "prompt is empty", param="prompt")
        prompts.append(ids)
    # One max_tokens for all prompts: with none given, the shortest room left among them.
    resolved = [_check_length(st, len(ids), max_tokens, i) for i, ids in enumerate(prompts)]
    params = _sampling(st, req, min(resolved))
    rid = new_id("cmpl")
    prompt_tokens = sum(len(p) for p in prompts)
    if req.stream:
        return await _stream_completion(
            request, st, rid, model, prompts, params, req, prompt_tokens
        )
    tally = _Tally()
    async with Generation(st, rid, prompts, params) as gen:
        async for i, out in gen.events():
            for c in out.outputs:
                tally.add(i * req.n + c.index, c)
    choices = [
        CompletionChoice(
            index=k, text="".join(tally.texts.get(k, [])), finish_reason=tally.finish.get(k)
        )
        for k in range(len(prompts) * req.n)
    ]
    body = CompletionResponse(
        id=rid, created=now(), model=model, choices=choices,
        usage=_usage(prompt_tokens, tally.completion_tokens),
    )  # fmt: skip
    return web.json_response(body.model_dump())


async def _stream_completion(
    request: web.Request,
    st: ServerState,
    rid: str,
    model: str,
    prompts: list[list[int]],
    params: Any,
    req: CompletionRequest,
    prompt_tokens: int,
) -> web.StreamResponse:
    created = now()
    sse = SSEWriter(request)
    tally = _Tally()
    async with Generation(st, rid, prompts, params) as gen:
        try:
            async for i, out in gen.events():
                for c in out.outputs:
                    k = i * req.n + c.index
                    tally.add(k, c)
                    if not c.text and c.finish_reason is None:
                        continue  # a token whose text is held back (incomplete UTF-8)
                    choice = CompletionChoice(index=k, text=c.text, finish_reason=c.finish_reason)
                    chunk = CompletionResponse(
                        id=rid, created=created, model=model, choices=[choice]
                    )
                    await sse.send(chunk)
        except APIError as e:
            if not sse.response.prepared:
                raise
            await sse.send(e.body())
            await sse.done()
            return sse.response
    usage = _usage(prompt_tokens, tally.completion_tokens)
    final = CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage)
    await sse.send(final)
    await sse.done()
    return sse.response


def _chat_prompt(st: ServerState, req: ChatCompletionRequest) -> list[int]:
    assert st.chat_template is not None
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        for m in req.messages
    ]
    try:
        text = st.chat_template.render(messages, add_generation_prompt=req.add_generation_prompt)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages", code="chat_template_error") from e
    # Templates that write BOS themselves must not get a second one from the tokenizer.
    bos = st.chat_template.bos_token
    add_special = not (bos and text.startswith(bos))
    return list(st.tokenizer.encode(text, add_special_tokens=add_special))


async def handle_chat(request: web.Request) -> web.StreamResponse:
    st = _state(request)
    req = await parse_request(request, ChatCompletionRequest)
    model = _check_model(st, req.model)
    ids = _chat_prompt(st, req)
    max_tokens = _check_length(st, len(ids), req.requested_max_tokens, 0)
    params = _sampling(st, req, max_tokens)
    rid = new_id("chatcmpl")
    if req.stream:
        return await _stream_chat(request, st, rid, model, ids, params, req)
    tally = _Tally()
    async with Generation(st, rid, [ids], params) as gen:
        async for _, out in gen.events():
            for c in out.outputs:
                tally.add(c.index, c)
    choices = [
        ChatChoice(
            index=k,
            message=AssistantMessage(content="".join(tally.texts.get(k, []))),
            finish_reason=tally.finish.get(k),
        )
        for k in range(req.n)
    ]
    body = ChatCompletionResponse(
        id=rid, created=now(), model=model, choices=choices,
        usage=_usage(len(ids), tally.completion_tokens),
    )  # fmt: skip
    return web.json_response(body.model_dump())


async def _stream_chat(
    request: web.Request,
    st: ServerState,
    rid: str,
    model: str,
    ids: list[int],
    params: Any,
    req: ChatCompletionRequest,
) -> web.StreamResponse:
    created = now()
    sse = SSEWriter(request)
    tally = _Tally()

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=rid, created=created, model=model, choices=choices, usage=usage
        )

    async with Generation(st, rid, [ids], params) as gen:
        try:
            opened = False
            async for _, out in gen.events():
                if not opened:
                    # OpenAI opens every choice with an empty assistant delta.
                    await sse.send(chunk([
                        ChatChunkChoice(index=k, delta=ChatDelta(role="assistant", content=""))
                        for k in range(req.n)
                    ]))  # fmt: skip
                    opened = True
                for c in out.outputs:
                    tally.add(c.index, c)
                    if not c.text and c.finish_reason is None:
                        continue
                    delta = ChatDelta(content=c.text) if c.text else ChatDelta()
                    await sse.send(
                        chunk(
                            [
                                ChatChunkChoice(
                                    index=c.index, delta=delta, finish_reason=c.finish_reason
                                )
                            ]
                        )
                    )
        except APIError as e:
            if not sse.response.prepared:
                raise
            await sse.send(e.body())
            await sse.done()
            return sse.response
    await sse.send(chunk([], _usage(len(ids), tally.completion_tokens)))
    await sse.done()
    return sse.response


async def handle_models(request: web.Request) -> web.Response:
    st = _state(request)
    card = ModelCard(
        id=st.settings.served_model_name, created=st.created, max_model_len=st.max_model_len
    )
    return web.json_response(ModelList(data=[card]).model_dump())


async def handle_health(request: web.Request) -> web.Response:
    """Liveness: the process answers (also while the model loads), unless the loaded engine
    can no longer serve: then 503, so the kubelet restarts the container."""
    reason = _state(request).unhealthy
    if reason is not None:
        return web.json_response({"status": "unhealthy", "reason": reason}, status=503)
    return web.json_response({"status": "ok"})


async def handle_ready(request: web.Request) -> web.Response:
    """Readiness: model loaded and KV pool allocated, and not draining."""
    st = _state(request)
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
    """The engine's `StatsSnapshot` (headroom.engine.stats), the sidecar's input."""
    st = _state(request)
    if st.engine is None:
        raise APIError(503, st.load_error or "model is still loading", code="not_ready")
    if (reason := st.unhealthy) is not None:
        # The sidecar reads a failed poll as headroom_engine_up 0: what a dying pod should show.
        raise APIError(503, reason, code="engine_unhealthy")
    snap = st.engine.stats()
    return web.Response(text=snap.model_dump_json(), content_type="application/json")


def add_ops_routes(app: web.Application) -> None:
    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/stats", handle_stats)


def create_app(state: ServerState, *, api: bool = True) -> web.Application:
    """The application; `api=False` builds the open operational listener only."""
    middlewares: list[Any] = [error_middleware]
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
        app.router.add_post("/v1/completions", handle_completions)
        app.router.add_post("/v1/chat/completions", handle_chat)
        app.router.add_get("/v1/models", handle_models)
    return app


def started_at() -> float:
    return time.time()
