"""`POST /v1/chat/completions`: the messages rendered by the model's chat template, then one
engine request (x `n` choices), answered as one response or one SSE stream."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from headroom.engine.sampling import SamplingParams
from headroom.engine.server.chat_template import ChatTemplateError
from headroom.engine.server.errors import APIError
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
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    Usage,
    new_id,
    now,
)
from headroom.engine.server.sse import SSEWriter
from headroom.engine.server.state import ServerState, state_of


def _chat_prompt(st: ServerState, req: ChatCompletionRequest) -> list[int]:
    assert st.chat_template is not None and st.tokenizer is not None
    try:
        text = st.chat_template.render(
            [_template_message(m) for m in req.messages],
            add_generation_prompt=req.add_generation_prompt,
        )
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages", code="chat_template_error") from e
    # The template owns BOS (transformers and vLLM encode chat text without special tokens):
    # a tokenizer that prepends BOS would otherwise add one the model never saw in training.
    return list(st.tokenizer.encode(text, add_special_tokens=False))


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as the template sees it; `name` only when set, so `is defined` tests hold."""
    message: dict[str, Any] = {
        "role": "system" if m.role == "developer" else m.role,
        "content": m.text,
    }
    if m.name is not None:
        message["name"] = m.name
    return message


async def handle_chat(request: web.Request) -> web.StreamResponse:
    st = state_of(request)
    req = await parse_request(request, ChatCompletionRequest)
    model = check_model(st, req.model)
    ids = _chat_prompt(st, req)
    budgets = check_prompts(
        st, [ids], req.requested_max_tokens,
        prompt_field="messages", max_tokens_field=req.max_tokens_field,
    )  # fmt: skip
    params = sampling_params(req, budgets)
    rid = new_id("chatcmpl")
    if req.stream:
        return await _stream_chat(request, st, rid, model, ids, params, req)
    tally = Tally()
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
        usage=usage(len(ids), tally.completion_tokens),
    )  # fmt: skip
    return web.json_response(body.model_dump())


async def _stream_chat(
    request: web.Request,
    st: ServerState,
    rid: str,
    model: str,
    ids: list[int],
    params: list[SamplingParams],
    req: ChatCompletionRequest,
) -> web.StreamResponse:
    created = now()
    sse = SSEWriter(request)
    tally = Tally()

    def chunk(choices: list[ChatChunkChoice], totals: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=rid, created=created, model=model, choices=choices, usage=totals
        )

    async with sse.failures_as_last_event():
        async with Generation(st, rid, [ids], params) as gen:
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
        if req.include_usage:  # as OpenAI: clients that did not ask read choices[0] of every chunk
            await sse.send(chunk([], usage(len(ids), tally.completion_tokens)))
        await sse.done()
    return sse.response
