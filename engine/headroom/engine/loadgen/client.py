"""The load generator's I/O: streaming requests against an OpenAI-compatible server, a
concurrency schedule of workers, and a sampler of the engine's `/stats` during the run."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Literal

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, field_validator

from headroom.contract.jsonfile import parse_json
from headroom.contract.urls import http_url
from headroom.engine.loadgen.workload import PromptFactory, RequestSpec, WorkloadSpec

Endpoint = Literal["completions", "chat"]


class Target(BaseModel):
    """Where and how to send: `base_url` is the server root (`/v1` is added when missing)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    api_key: str | None = None
    endpoint: Endpoint = "completions"
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)  # OpenAI's range (NaN fails too)
    ignore_eos: bool = True
    timeout_s: float = 600.0

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        return http_url(url)

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    @property
    def api(self) -> str:
        return self.root + "/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class RequestRecord(BaseModel):
    """What one request measured; times are seconds, `start` is relative to the run start."""

    index: int
    start: float
    concurrency: int
    shared_prefix: bool
    ok: bool
    error: str | None = None
    error_message: str | None = None
    status: int | None = None
    # From the stream's `usage` chunk when `usage_reported`; without one (a server that ignores
    # stream_options.include_usage) prompt_tokens is None and output_tokens counts text chunks,
    # an estimate that a server sending several tokens per chunk undercounts.
    prompt_tokens: int | None = None
    output_tokens: int = 0
    usage_reported: bool = False
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    finish_reason: str | None = None


class StatsSample(BaseModel):
    """One poll of the engine's `/stats` (only the fields the report needs)."""

    t: float
    concurrency: int
    used: int
    capacity: int
    queries_tokens: int
    hits_tokens: int
    preemptions: int
    running: int
    waiting: int
    # The engine's exact integral of used blocks and the snapshot's own clock: a burst shorter
    # than the poll interval still shows in their difference (None from an older engine).
    block_seconds: float | None = None
    snapshot_time: float | None = None
    # Chosen at engine start: a change means the engine restarted and its counters reset, even
    # when the new ones are already above the old (None from an engine without it).
    instance_id: str | None = None

    @property
    def occupancy(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0


def parse_stats(body: dict[str, Any], t: float, concurrency: int) -> StatsSample:
    """Read the fields of a `/stats` snapshot (schema version 1) the report uses."""
    kv, pc, rq = body["kv"], body["prefix_cache"], body["requests"]
    return StatsSample(
        t=t,
        concurrency=concurrency,
        used=int(kv["used"]),
        capacity=int(kv["capacity"]),
        queries_tokens=int(pc["queries_tokens_total"]),
        hits_tokens=int(pc["hits_tokens_total"]),
        preemptions=int(body["preemptions_total"]),
        running=int(rq["running"]),
        waiting=int(rq["waiting"]),
        # Validated by the model like the rest of the sample; absent from an older engine.
        block_seconds=body.get("kv_block_seconds_total"),
        snapshot_time=body.get("time"),
        instance_id=body.get("instance_id"),
    )


def request_body(target: Target, model: str, req: RequestSpec) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one streaming request."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": target.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True  # vLLM extension: outputs run to max_tokens
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
        return "/chat/completions", body
    body["prompt"] = req.prompt
    return "/completions", body


def _error_name(status: int, body: Any) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    kind = err.get("type") if isinstance(err, dict) else None
    return f"http_{status}" + (f"_{kind}" if kind else "")


def _error_message(body: Any, fallback: str) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return str(err["message"])
    return fallback[:200]


def _chunk_has_token(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


def _parse_chunk(data: bytes) -> dict[str, Any]:
    """One stream event: an object whose `choices` are objects (ValueError for anything else,
    so a garbled stream fails its own request, not the run)."""
    chunk = parse_json(data)
    if not isinstance(chunk, dict):
        raise ValueError(f"a stream event is not a JSON object: {data[:80]!r}")
    choices = chunk.get("choices") or []
    if not isinstance(choices, list) or not all(
        isinstance(c, dict) and isinstance(c.get("delta") or {}, dict) for c in choices
    ):
        raise ValueError(f"a stream event's choices are not a list of objects: {data[:80]!r}")
    return chunk


def _token_count(usage: Any, key: str) -> int:
    """`usage[key]` as a token count (ValueError when missing or not a whole number >= 0)."""
    value = usage.get(key) if isinstance(usage, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"usage.{key} is not a token count: {usage!r}"[:200])
    return value


async def send_request(
    session: aiohttp.ClientSession,
    target: Target,
    model: str,
    req: RequestSpec,
    run_start: float,
    concurrency: int,
) -> RequestRecord:
    """Send one streaming request and time it; never raises for server or network errors."""
    path, body = request_body(target, model, req)
    t0 = time.perf_counter()
    rec = RequestRecord(
        index=req.index,
        start=t0 - run_start,
        concurrency=concurrency,
        shared_prefix=req.shared_prefix,
        ok=False,
    )
    text_chunks = 0
    first: float | None = None
    end = 0.0  # when [DONE] arrived
    usage: tuple[int, int] | None = None  # (prompt, completion) tokens
    chunks, done = 0, False
    try:
        async with session.post(target.api + path, json=body, headers=target.headers()) as resp:
            rec.status = resp.status
            if resp.status != 200:
                text = await resp.text()
                try:
                    err_body: Any = parse_json(text)
                except ValueError:
                    err_body = None
                rec.error = _error_name(resp.status, err_body)
                rec.error_message = _error_message(err_body, text)
                return rec
            if req.disconnect_after == 0:
                # Before the first token: hang up on the headers, with the stream unread.
                rec.error = "client_disconnect"
                rec.error_message = "hung up before the first token, as asked"
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done, end = True, time.perf_counter()
                    break
                chunk = _parse_chunk(data)
                chunks += 1
                if "error" in chunk:
                    rec.error = "stream_error"
                    rec.error_message = _error_message(chunk, str(chunk))
                    return rec
                now = time.perf_counter()
                for choice in chunk.get("choices") or []:
                    if choice.get("finish_reason"):
                        rec.finish_reason = str(choice["finish_reason"])
                if _chunk_has_token(chunk):
                    text_chunks += 1
                    if first is None:
                        first = now
                    if req.disconnect_after is not None and text_chunks >= req.disconnect_after:
                        # Leaving the `async with` closes the connection under the server's
                        # stream. Counted in text chunks, as output_tokens is without usage.
                        rec.error = "client_disconnect"
                        rec.error_message = (
                            f"hung up after {text_chunks} text chunk"
                            f"{'' if text_chunks == 1 else 's'}, as asked"
                        )
                        rec.output_tokens = text_chunks
                        return rec
                if chunk.get("usage"):
                    u = chunk["usage"]
                    usage = (_token_count(u, "prompt_tokens"), _token_count(u, "completion_tokens"))
    except TimeoutError:
        rec.error, rec.error_message = "timeout", f"no answer within {target.timeout_s:g}s"
        return rec
    except aiohttp.ClientError as e:
        rec.error, rec.error_message = type(e).__name__, str(e)[:200]
        return rec
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        rec.error, rec.error_message = "bad_response", str(e)[:200]
        return rec
    if not done:
        # A 200 that is not a finished event stream (a web page on the wrong port, a stream cut
        # off) is not a served request.
        rec.error = "stream_cut" if chunks else "no_stream"
        rec.error_message = (
            f"the stream ended after {chunks} events without [DONE]"
            if chunks
            else "HTTP 200 without an event stream: is this an OpenAI-compatible server?"
        )
        return rec
    rec.ok = True
    rec.e2e_s = end - t0
    rec.usage_reported = usage is not None
    rec.prompt_tokens, rec.output_tokens = usage if usage else (None, text_chunks)
    if first is not None:
        rec.ttft_s = first - t0
        if rec.output_tokens > 1:
            # Time per output token after the first, as vLLM's benchmark_serving defines it:
            # (end to end - TTFT) / (output tokens - 1), the end being [DONE]. Divided by tokens,
            # not chunks, since a chunk may carry several.
            rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)
    return rec


# How long the reachability probe before a run waits: a server that cannot answer a model
# list in this time would not serve the run either.
PROBE_TIMEOUT_S = 30.0


async def resolve_model(session: aiohttp.ClientSession, target: Target) -> str:
    """The model to ask for: `target.model`, else the first one `/v1/models` lists.

    `/v1/models` is asked either way, so an unreachable server fails here, before the run
    (RuntimeError); with `target.model` given its answer is not read."""
    timeout = aiohttp.ClientTimeout(total=min(target.timeout_s, PROBE_TIMEOUT_S))
    try:
        async with session.get(
            target.api + "/models", headers=target.headers(), timeout=timeout
        ) as resp:
            if target.model:
                return target.model
            if resp.status != 200:
                raise RuntimeError(f"GET {target.api}/models answered {resp.status}: give --model")
            try:
                data = await resp.json(content_type=None)
            except ValueError:
                data = None
    except (aiohttp.ClientError, TimeoutError) as e:
        reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise RuntimeError(f"cannot reach {target.api}/models: {reason}"[:300]) from None
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list) or not all(isinstance(m, dict) and "id" in m for m in models):
        raise RuntimeError(f"{target.api}/models is not an OpenAI model list: give --model")
    if not models:
        raise RuntimeError(f"{target.api}/models lists no model: give --model")
    return str(models[0]["id"])


async def calibrate_tokens_per_word(
    session: aiohttp.ClientSession, target: Target, model: str
) -> float:
    """Tokens per prompt word on this server, from `usage.prompt_tokens` of two 1-token
    requests of different lengths (the difference cancels BOS and any chat template).
    RuntimeError, naming --tokens-per-word, for an answer without a usable count."""
    counts: list[int] = []
    lengths = (16, 80)
    for n in lengths:
        text = " ".join(["the", "of", "time", "people", "world"][i % 5] for i in range(n))
        body: dict[str, Any] = {"model": model, "max_tokens": 1, "temperature": 0.0}
        if target.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
            path = "/chat/completions"
        else:
            body["prompt"] = text
            path = "/completions"
        async with session.post(target.api + path, json=body, headers=target.headers()) as resp:
            status, raw = resp.status, await resp.text(errors="replace")
        try:
            data: Any = parse_json(raw)
        except ValueError:
            data = None
        usage = data.get("usage") if isinstance(data, dict) else None
        if status != 200:
            raise RuntimeError(
                f"calibration request answered {status}: {_error_message(data, raw)}; "
                "give --tokens-per-word"
            )
        try:
            counts.append(_token_count(usage, "prompt_tokens"))
        except ValueError as e:
            raise RuntimeError(
                f"calibration request: {e} (body {raw[:120]!r}); give --tokens-per-word"
            ) from None
    if counts[1] <= counts[0]:
        raise RuntimeError(
            f"calibration: the {lengths[1]}-word prompt counted {counts[1]} tokens, no more "
            f"than the {lengths[0]}-word prompt's {counts[0]}; give --tokens-per-word"
        )
    return max(0.05, (counts[1] - counts[0]) / (lengths[1] - lengths[0]))


class StatsSampler:
    """Polls `/stats` every `interval_s` while the run lasts; silent when unreachable."""

    def __init__(self, url: str, interval_s: float, concurrency: Callable[[], int]) -> None:
        self.url = url
        self.interval_s = interval_s
        self._concurrency = concurrency
        self.samples: list[StatsSample] = []
        self.last_error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0

    async def _poll_once(self, session: aiohttp.ClientSession) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=max(1.0, self.interval_s * 4))
            async with session.get(self.url, timeout=timeout) as resp:
                if resp.status != 200:
                    self.last_error = f"GET {self.url} answered {resp.status}"
                    return
                body = await resp.json(content_type=None)
            t = time.perf_counter() - self._t0
            self.samples.append(parse_stats(body, t, self._concurrency()))
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as e:
            self.last_error = f"{type(e).__name__}: {e}"[:200]

    async def _loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self._poll_once(session)
            await asyncio.sleep(self.interval_s)

    def start(self, session: aiohttp.ClientSession, t0: float) -> None:
        self._t0 = t0
        self._task = asyncio.create_task(self._loop(session))

    async def stop(self, session: aiohttp.ClientSession) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._poll_once(session)  # the closing counters


class RunState(BaseModel):
    """Live counters for the progress display."""

    started: int = 0
    done: int = 0
    errors: int = 0
    in_flight: int = 0
    concurrency: int = 0
    output_tokens: int = 0


class LoadResult(BaseModel):
    model: str
    tokens_per_word: float
    duration_s: float
    records: list[RequestRecord]
    samples: list[StatsSample]
    stats_error: str | None = None


async def run_load(
    spec: WorkloadSpec,
    target: Target,
    *,
    stats_url: str | None = None,
    stats_interval_s: float = 0.5,
    tokens_per_word: float | None = None,
    on_progress: Callable[[RunState, float], None] | None = None,
) -> LoadResult:
    """Run the whole workload and return every request's record and the /stats samples.

    Workers 0..max_concurrency-1 each loop "take the next request, send it, wait for the
    answer"; worker i only takes a request while the schedule's concurrency exceeds i, so the
    number in flight follows the ramp.
    """
    timeout = aiohttp.ClientTimeout(total=target.timeout_s)
    connector = aiohttp.TCPConnector(limit=spec.max_concurrency + 4)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = await resolve_model(session, target)
        if tokens_per_word is None:
            tokens_per_word = await calibrate_tokens_per_word(session, target, model)
        factory = PromptFactory(spec, tokens_per_word)
        state = RunState()
        records: list[RequestRecord] = []
        t0 = time.perf_counter()

        def elapsed() -> float:
            return time.perf_counter() - t0

        def current() -> int:
            return spec.concurrency_at(elapsed())

        sampler = StatsSampler(stats_url, stats_interval_s, current) if stats_url else None
        if sampler is not None:
            sampler.start(session, t0)
        next_index = 0

        def take() -> RequestSpec | None:
            nonlocal next_index
            if spec.num_requests is not None and next_index >= spec.num_requests:
                return None
            if spec.duration_s is not None and elapsed() >= spec.duration_s:
                return None
            req = factory.make(next_index)
            next_index += 1
            return req

        async def worker(i: int) -> None:
            while True:
                while current() <= i:
                    if take_done():
                        return
                    await asyncio.sleep(0.02)
                req = take()
                if req is None:
                    return
                state.started += 1
                state.in_flight += 1
                rec = await send_request(session, target, model, req, t0, current())
                state.in_flight -= 1
                state.done += 1
                state.errors += 0 if rec.ok else 1
                state.output_tokens += rec.output_tokens
                records.append(rec)

        def take_done() -> bool:
            if spec.num_requests is not None:
                return next_index >= spec.num_requests
            return spec.duration_s is not None and elapsed() >= spec.duration_s

        async def progress() -> None:
            while True:
                state.concurrency = current()
                if on_progress is not None:
                    on_progress(state, elapsed())
                await asyncio.sleep(0.1)

        ticker = asyncio.create_task(progress())
        try:
            await asyncio.gather(*(worker(i) for i in range(spec.max_concurrency)))
        finally:
            ticker.cancel()
        duration = elapsed()
        state.concurrency = current()
        if on_progress is not None:
            on_progress(state, duration)
        if sampler is not None:
            await sampler.stop(session)
    records.sort(key=lambda r: r.index)
    return LoadResult(
        model=model,
        tokens_per_word=tokens_per_word,
        duration_s=duration,
        records=records,
        samples=sampler.samples if sampler else [],
        stats_error=(sampler.last_error if sampler and not sampler.samples else None),
    )
