"""What the completion and chat handlers share: one HTTP request's engine requests merged
into one event stream (aborted when the handler leaves), and the request preparation both do:
the model name, the engine's validation, sampling parameters and usage."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import ValidationError

from headroom.engine.async_engine import EngineClosed
from headroom.engine.errors import RequestFailed, RequestRejected
from headroom.engine.outputs import CompletionOutput, RequestOutput
from headroom.engine.sampling import SamplingParams
from headroom.engine.server.errors import (
    APIError,
    from_validation_error,
    rejected,
    retry_elsewhere,
)
from headroom.engine.server.protocol import ChatCompletionRequest, CompletionRequest, Usage
from headroom.engine.server.state import SamplingDefaults, ServerState
from headroom.engine.validation import resolve_max_tokens


@dataclass
class _Job:
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    finished: bool = False


class Generation:
    """One HTTP request's engine requests (one per prompt, each with its own parameters: its
    own output budget), merged into one event stream of `(prompt_index, RequestOutput)`. Use as
    `async with`: leaving aborts what is unfinished."""

    def __init__(
        self,
        st: ServerState,
        base_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
    ) -> None:
        assert st.engine is not None and len(params) == len(prompts)
        self._engine = st.engine
        defaults = st.settings.sampling_defaults
        self.jobs = [
            _Job(i, f"{base_id}-{i}", ids, with_model_defaults(p, defaults))
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
        ]
        # Bounded: a pump waits here while the client reads slowly, and the engine folds what
        # it produces meanwhile into one delta (`AsyncEngine`), instead of one entry per step.
        self._queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue(
            maxsize=1
        )
        self._tasks: list[asyncio.Task[None]] = []

    async def _pump(self, job: _Job) -> None:
        try:
            stream = self._engine.stream(job.request_id, job.prompt_ids, job.params)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    if out.finished:
                        job.finished = True
                    await self._queue.put((job.index, out))
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
                    self._engine.abort(job.request_id)

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs in arrival order until every prompt finished; engine errors are raised
        (a rejected request as a 400)."""
        pending = len(self.jobs)
        while pending:
            index, item = await self._queue.get()
            if item is None:
                pending -= 1
                continue
            if isinstance(item, Exception):
                if isinstance(item, RequestRejected):
                    raise rejected(item)
                if isinstance(item, EngineClosed):
                    raise retry_elsewhere(str(item))
                if isinstance(item, RequestFailed):
                    raise APIError(500, str(item), code="engine_error")
                if isinstance(item, ValueError):
                    raise APIError(400, str(item), code="invalid_request")
                raise item
            yield index, item


# --- shared request preparation ----------------------------------------------------------


def check_model(st: ServerState, model: str | None) -> str:
    """The served model's name; 404 for any other."""
    name = st.settings.served_model_name
    if model is not None and model != name:
        raise APIError(
            404,
            f"the model '{model}' does not exist; this server serves '{name}'",
            param="model",
            code="model_not_found",
        )
    return name


def check_prompts(
    st: ServerState,
    prompts: list[list[int]],
    max_tokens: int | None,
    *,
    prompt_field: str = "prompt",
    max_tokens_field: str = "max_tokens",
) -> list[int]:
    """Each prompt's output budget, by the engine's own rules (`RequestRejected` names the
    field as the request sent it); with no max_tokens given, all the room that prompt leaves,
    as vLLM does per prompt (not the least room among them)."""
    assert st.engine is not None
    engine = st.engine
    budgets = []
    for i, ids in enumerate(prompts):
        where = f"prompt {i}" if i else "prompt"
        # The length rules first with the request's own field names (chat's `messages` and
        # `max_completion_tokens`), which the engine's check cannot know; then the engine's
        # whole check (empty prompt, vocabulary), whose budget is the same.
        resolve_max_tokens(
            len(ids), max_tokens, engine.max_model_len, where=where,
            prompt_param=prompt_field, max_tokens_param=max_tokens_field,
        )  # fmt: skip
        budgets.append(engine.check_request(ids, max_tokens, where=where))
    return budgets


# The request fields a model's generation_config.json gives defaults for.
MODEL_DEFAULTED = ("temperature", "top_p", "top_k")


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, budgets: list[int]
) -> list[SamplingParams]:
    """The request's sampling fields as the engine's `SamplingParams`, one per prompt with that
    prompt's output budget (400 naming a bad field). `temperature`, `top_p` and `top_k` are
    passed only when the request gave them (null is leaving them out): the others stay unset
    (not in the params' `model_fields_set`) for `with_model_defaults` to fill with the model's
    defaults, which `Generation` does with the server's."""
    given = {name: getattr(req, name) for name in MODEL_DEFAULTED if name in req.model_fields_set}
    try:
        params = SamplingParams(
            n=req.n,
            max_tokens=budgets[0],
            **given,
            seed=req.seed,
            stop=req.stop_list,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
        )
    except ValidationError as e:
        raise from_validation_error(e) from e
    # The other budgets passed the same rules in `check_prompts` (each at least 1).
    return [params] + [params.model_copy(update={"max_tokens": b}) for b in budgets[1:]]


def with_model_defaults(params: SamplingParams, defaults: SamplingDefaults) -> SamplingParams:
    """`params` with the model's sampling defaults (`--generation-config auto`) in the fields
    the request left unset, as vLLM applies its generation-config defaults; a value the
    request gave always stays. The defaults are within `SamplingParams`' bounds (the loader
    keeps only such values), so the copy needs no new validation."""
    missing = {k: v for k, v in defaults.given().items() if k not in params.model_fields_set}
    return params.model_copy(update=missing) if missing else params


@dataclass
class Tally:
    """Per-choice text and finish reasons, and token counts for `usage`."""

    texts: dict[int, list[str]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, choice: int, out: CompletionOutput) -> None:
        self.texts.setdefault(choice, []).append(out.text or "")
        self.completion_tokens += len(out.token_ids or [])
        if out.finish_reason is not None:
            self.finish[choice] = out.finish_reason


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    """OpenAI's `usage` block."""
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
