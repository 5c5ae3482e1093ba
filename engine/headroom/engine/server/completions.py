"""`POST /v1/completions`: one engine request per prompt (x `n` choices), answered as one
response or one SSE stream."""

from __future__ import annotations

from aiohttp import web

from headroom.engine.sampling import SamplingParams
from headroom.engine.server.generation import (
    Generation,
    Tally,
    check_model,
    check_prompts,
    sampling_params,
    usage,
)
from headroom.engine.server.middleware import parse_request
from headroom.engine.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    new_id,
    now,
)
from headroom.engine.server.sse import SSEWriter
from headroom.engine.server.state import ServerState, state_of


async def handle_completions(request: web.Request) -> web.StreamResponse:
    st = state_of(request)
    req = await parse_request(request, CompletionRequest)
    model = check_model(st, req.model)
    assert st.tokenizer is not None
    tokenizer = st.tokenizer
    prompts = [list(tokenizer.encode(p)) if isinstance(p, str) else list(p) for p in req.prompts()]
    params = sampling_params(req, check_prompts(st, prompts, req.max_tokens))
    rid = new_id("cmpl")
    prompt_tokens = sum(len(p) for p in prompts)
    if req.stream:
        return await _stream_completion(
            request, st, rid, model, prompts, params, req, prompt_tokens
        )
    tally = Tally()
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
        usage=usage(prompt_tokens, tally.completion_tokens),
    )  # fmt: skip
    return web.json_response(body.model_dump())


async def _stream_completion(
    request: web.Request,
    st: ServerState,
    rid: str,
    model: str,
    prompts: list[list[int]],
    params: list[SamplingParams],
    req: CompletionRequest,
    prompt_tokens: int,
) -> web.StreamResponse:
    created = now()
    sse = SSEWriter(request)
    tally = Tally()
    async with sse.failures_as_last_event():
        async with Generation(st, rid, prompts, params) as gen:
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
        if req.include_usage:  # as OpenAI: clients that did not ask read choices[0] of every chunk
            totals = usage(prompt_tokens, tally.completion_tokens)
            final = CompletionResponse(
                id=rid, created=created, model=model, choices=[], usage=totals
            )
            await sse.send(final)
        await sse.done()
    return sse.response
