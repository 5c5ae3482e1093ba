"""What the completion and chat handlers share (`headroom.engine.server.generation`), against a
scripted fake engine: the merged event stream, its error mapping and aborts, the per-prompt
budgets, sampling parameters with the model's defaults, and usage."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from headroom.engine.async_engine import EngineClosed
from headroom.engine.errors import RequestFailed, RequestRejected
from headroom.engine.outputs import CompletionOutput, RequestOutput
from headroom.engine.sampling import SamplingParams
from headroom.engine.server.app import create_app
from headroom.engine.server.chat import _template_message
from headroom.engine.server.chat_template import default_template
from headroom.engine.server.errors import APIError
from headroom.engine.server.generation import (
    Generation,
    Tally,
    check_model,
    check_prompts,
    sampling_params,
    usage,
    with_model_defaults,
)
from headroom.engine.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from headroom.engine.server.state import SamplingDefaults, ServerSettings, ServerState
from headroom.engine.validation import resolve_max_tokens

MAX_MODEL_LEN = 32
HANG = "hang"  # a script entry: the stream waits forever (an unfinished request)

Script = list[RequestOutput | Exception | str]


def _out(index: int, text: str, ids: list[int], finish: str | None = None) -> RequestOutput:
    comp = CompletionOutput(index=index, text=text, token_ids=ids, finish_reason=finish)
    return RequestOutput(
        request_id="r", prompt_token_ids=[1], outputs=[comp], arrival_time=0.0,
        finished=finish is not None,
    )  # fmt: skip


class FakeEngine:
    """The part of `AsyncEngine` the server uses: each request id `<base>-<i>` streams the
    i-th script (outputs, then an exception to raise, or HANG to never end)."""

    max_model_len = MAX_MODEL_LEN

    def __init__(self, *scripts: Script) -> None:
        self.scripts = scripts
        self.aborted: list[str] = []
        self.params: dict[str, SamplingParams] = {}

    async def stream(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        self.params[request_id] = params
        for item in self.scripts[int(request_id.rsplit("-", 1)[1])]:
            if item == HANG:
                await asyncio.Event().wait()
            if isinstance(item, Exception):
                raise item
            assert isinstance(item, RequestOutput)
            yield item

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def check_request(self, ids: list[int], max_tokens: int | None, *, where: str) -> int:
        if not ids:
            raise RequestRejected(f"{where} is empty", param="prompt", code="empty_prompt")
        return resolve_max_tokens(len(ids), max_tokens, MAX_MODEL_LEN, where=where)


def _state(engine: FakeEngine, defaults: SamplingDefaults | None = None) -> ServerState:
    settings = ServerSettings(
        served_model_name="tiny", sampling_defaults=defaults or SamplingDefaults()
    )
    return ServerState(settings, engine=engine)  # type: ignore[arg-type]


# --- Generation ----------------------------------------------------------------------------


async def test_events_merge_every_prompts_outputs_until_each_stream_ends() -> None:
    """Each output arrives tagged with its prompt index; the stream ends only once all did."""
    engine = FakeEngine(
        [_out(0, "a", [1]), _out(0, "b", [2], "length")],
        [_out(0, "x", [9], "stop")],
    )
    params = SamplingParams(max_tokens=2)
    async with Generation(_state(engine), "g", [[1], [2]], [params, params]) as gen:
        got = [(i, out.outputs[0].text) async for i, out in gen.events()]
    assert sorted(got) == [(0, "a"), (0, "b"), (1, "x")]
    assert [t for i, t in got if i == 0] == ["a", "b"]
    assert engine.aborted == []


async def test_leaving_early_aborts_only_the_unfinished_requests() -> None:
    """A handler that leaves (client gone) aborts what is still running, not a request whose
    final output it already has (even before that stream's end was seen)."""
    engine = FakeEngine([_out(0, "a", [1]), HANG], [_out(0, "x", [9], "stop"), HANG])
    params = SamplingParams(max_tokens=4)
    async with Generation(_state(engine), "g", [[1], [2]], [params, params]) as gen:
        events = gen.events()
        seen = {(await events.__anext__())[0] for _ in range(2)}
        await events.aclose()
    assert seen == {0, 1}
    assert engine.aborted == ["g-0"]


@pytest.mark.parametrize(
    ("error", "status", "code", "param"),
    [
        (RequestRejected("too long", param="prompt", code="context_length_exceeded"), 400,
         "context_length_exceeded", "prompt"),
        (EngineClosed("engine closed"), 503, "draining", None),
        (RequestFailed("g-0", RuntimeError("boom")), 500, "engine_error", None),
        (ValueError("bad stop"), 400, "invalid_request", None),
    ],
)  # fmt: skip
async def test_engine_errors_become_the_matching_api_error(
    error: Exception, status: int, code: str, param: str | None
) -> None:
    """Each engine error maps to one HTTP status and code; a closed engine says retry elsewhere."""
    engine = FakeEngine([_out(0, "a", [1]), error])
    async with Generation(_state(engine), "g", [[1]], [SamplingParams()]) as gen:
        with pytest.raises(APIError) as info:
            _ = [e async for e in gen.events()]
    err = info.value
    assert (err.status, err.code, err.param) == (status, code, param)
    assert str(error) in err.message
    assert err.close is (status == 503)


async def test_an_unexpected_engine_error_is_raised_as_it_is() -> None:
    """An error that is not the engine's (a bug) is not dressed up as a client error."""
    engine = FakeEngine([KeyError("k")])
    async with Generation(_state(engine), "g", [[1]], [SamplingParams()]) as gen:
        with pytest.raises(KeyError):
            _ = [e async for e in gen.events()]


async def test_each_request_gets_the_model_defaults_the_request_left_out() -> None:
    """The server's generation-config defaults fill only the fields the request did not give."""
    engine = FakeEngine([_out(0, "a", [1], "stop")])
    st = _state(engine, SamplingDefaults(temperature=0.3, top_k=20))
    given = SamplingParams(temperature=0.9, max_tokens=3)
    async with Generation(st, "g", [[1]], [given]) as gen:
        _ = [e async for e in gen.events()]
    sent = engine.params["g-0"]
    assert (sent.temperature, sent.top_k, sent.max_tokens) == (0.9, 20, 3)


# --- request preparation -------------------------------------------------------------------


def test_with_model_defaults_keeps_given_values_and_returns_params_when_nothing_is_missing() -> (
    None
):
    """A request's own value always wins; no defaults (or none missing) leaves params as is."""
    params = SamplingParams(temperature=0.0)
    filled = with_model_defaults(params, SamplingDefaults(temperature=0.7, top_p=0.8))
    assert (filled.temperature, filled.top_p) == (0.0, 0.8)
    assert with_model_defaults(params, SamplingDefaults()) is params


def test_check_model_accepts_no_name_or_the_served_one_and_404s_any_other() -> None:
    """`model` is optional; a wrong one is OpenAI's model_not_found naming the field."""
    st = _state(FakeEngine())
    assert check_model(st, None) == check_model(st, "tiny") == "tiny"
    with pytest.raises(APIError) as info:
        check_model(st, "gpt-4")
    assert (info.value.status, info.value.param, info.value.code) == (
        404, "model", "model_not_found",
    )  # fmt: skip
    assert "'gpt-4'" in info.value.message and "'tiny'" in info.value.message


def test_check_prompts_gives_each_prompt_the_room_it_leaves() -> None:
    """Without max_tokens each prompt gets its own remaining room, not the smallest."""
    st = _state(FakeEngine())
    assert check_prompts(st, [[1] * 2, [1] * 30], None) == [30, 2]
    assert check_prompts(st, [[1] * 2, [1] * 30], 2) == [2, 2]


def test_check_prompts_names_the_prompt_index_and_the_request_s_own_fields() -> None:
    """The first prompt is `prompt`, later ones `prompt i`; chat's fields are named as sent."""
    st = _state(FakeEngine())
    with pytest.raises(RequestRejected) as info:
        check_prompts(st, [[1], [1] * MAX_MODEL_LEN], None)
    assert info.value.reason.startswith(f"prompt 1 has {MAX_MODEL_LEN} tokens")
    with pytest.raises(RequestRejected) as info:
        check_prompts(st, [[1] * 30], 3, max_tokens_field="max_completion_tokens")
    assert info.value.reason.startswith("prompt 30 + max_completion_tokens 3")
    assert info.value.param == "max_completion_tokens"
    with pytest.raises(RequestRejected) as info:
        check_prompts(st, [[1] * MAX_MODEL_LEN], None, prompt_field="messages")
    assert info.value.param == "messages"


def test_sampling_params_pass_only_the_given_model_defaulted_fields_and_each_budget() -> None:
    """Left-out (or null) temperature/top_p/top_k stay unset for the model's defaults."""
    req = CompletionRequest.model_validate(
        {"prompt": ["a", "b"], "n": 2, "temperature": 0.5, "top_p": None, "seed": 7,
         "stop": "\n", "stop_token_ids": [3], "ignore_eos": True}
    )  # fmt: skip
    first, second = sampling_params(req, [4, 9])
    assert {"temperature", "top_p", "top_k"} & first.model_fields_set == {"temperature"}
    assert (first.max_tokens, second.max_tokens) == (4, 9)
    assert (first.n, first.temperature, first.seed, first.stop, first.stop_token_ids) == (
        2, 0.5, 7, ["\n"], [3],
    )  # fmt: skip
    assert first.ignore_eos and second.ignore_eos and second.seed == 7
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"}]})
    (only,) = sampling_params(chat, [5])
    assert {"temperature", "top_p", "top_k"} & only.model_fields_set == set()


# --- usage ---------------------------------------------------------------------------------


def test_tally_joins_each_choice_s_text_counts_every_token_and_keeps_its_finish() -> None:
    """Completion tokens are counted over all choices; a finish reason is never unset."""
    tally = Tally()
    tally.add(0, CompletionOutput(index=0, text="he", token_ids=[1, 2]))
    tally.add(1, CompletionOutput(index=1, text="", token_ids=[3]))
    tally.add(0, CompletionOutput(index=0, text="y", token_ids=[4], finish_reason="stop"))
    tally.add(0, CompletionOutput(index=0))
    assert tally.texts == {0: ["he", "y", ""], 1: [""]}
    assert tally.completion_tokens == 4
    assert tally.finish == {0: "stop"}


def test_usage_total_is_prompt_plus_completion_tokens() -> None:
    """OpenAI's `usage.total_tokens` is the sum of the other two."""
    assert usage(5, 3).model_dump() == {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
    }  # fmt: skip


# --- through the completions handler -------------------------------------------------------


class _Health:
    healthy = True
    reason = ""


class ServedFakeEngine(FakeEngine):
    """A FakeEngine the HTTP middleware admits (running and healthy)."""

    running = True
    health = _Health()


# A stream that never ends fails the test rather than hanging it.
_NO_HANG = aiohttp.ClientTimeout(total=30)


async def _stream_completion(engine: FakeEngine, body: dict[str, object]) -> tuple[int, str]:
    st = _state(engine)
    st.tokenizer = object()  # type: ignore[assignment]  # token-id prompts only
    server = TestServer(create_app(st))
    await server.start_server()
    try:
        async with aiohttp.ClientSession(timeout=_NO_HANG) as http:
            url = str(server.make_url("/v1/completions"))
            async with http.post(url, json={"stream": True, **body}) as resp:
                return resp.status, await resp.text()
    finally:
        await server.close()


def _events(text: str) -> list[dict[str, Any]]:
    data = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data:")]
    assert data[-1] == "[DONE]", text
    return [json.loads(d) for d in data[:-1]]


async def test_streamed_choices_of_a_batch_are_numbered_prompt_times_n_plus_index() -> None:
    """With n=2 and two prompts, prompt 1's choice 1 streams as choice 3 (as OpenAI's)."""
    engine = ServedFakeEngine(
        [_out(0, "a", [1], "length"), _out(1, "b", [1], "length")],
        [_out(0, "c", [1], "length"), _out(1, "d", [1], "length")],
    )
    status, text = await _stream_completion(
        engine, {"prompt": [[5], [6]], "n": 2, "max_tokens": 1, "temperature": 1.0}
    )
    assert status == 200, text
    got = {c["index"]: c["text"] for e in _events(text) for c in e["choices"]}
    assert got == {0: "a", 1: "b", 2: "c", 3: "d"}


async def test_a_stream_error_before_any_output_is_a_plain_http_error() -> None:
    """An error before the stream opened is the status itself; after, an error event."""
    rejected = RequestRejected("bad prompt", param="prompt", code="invalid_prompt")
    status, text = await _stream_completion(ServedFakeEngine([rejected]), {"prompt": [5]})
    assert status == 400 and json.loads(text)["error"]["code"] == "invalid_prompt", text
    status, text = await _stream_completion(
        ServedFakeEngine([_out(0, "a", [1]), rejected]), {"prompt": [5]}
    )
    assert status == 200, text
    first, error = _events(text)
    assert first["choices"][0]["text"] == "a"
    assert error["error"]["code"] == "invalid_prompt"


async def test_a_held_back_token_sends_no_chunk_but_an_empty_final_one_does() -> None:
    """A token whose text is held back (incomplete UTF-8) is not streamed; the finish reason
    is, even when its output has no text."""
    script: Script = [_out(0, "a", [1]), _out(0, "", [2]), _out(0, "", [3], "stop")]
    status, text = await _stream_completion(
        ServedFakeEngine(script),
        {"prompt": [5], "max_tokens": 4, "stream_options": {"include_usage": True}},
    )
    assert status == 200, text
    *chunks, last = _events(text)
    got = [(c["text"], c["finish_reason"]) for e in chunks for c in e["choices"]]
    assert got == [("a", None), ("", "stop")]
    assert last["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}


class _Tokenizer:
    """Encodes any chat text as three tokens."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1, 2, 3]


async def _stream_chat(engine: FakeEngine, body: dict[str, object]) -> tuple[int, str]:
    st = _state(engine)
    st.tokenizer = _Tokenizer()  # type: ignore[assignment]
    st.chat_template = default_template()
    server = TestServer(create_app(st))
    await server.start_server()
    try:
        async with aiohttp.ClientSession(timeout=_NO_HANG) as http:
            url = str(server.make_url("/v1/chat/completions"))
            messages = [{"role": "user", "content": "hi"}]
            async with http.post(url, json={"stream": True, "messages": messages, **body}) as resp:
                return resp.status, await resp.text()
    finally:
        await server.close()


async def test_a_chat_stream_opens_every_choice_then_streams_deltas_and_usage() -> None:
    """OpenAI's chat stream: an empty assistant delta per choice, content deltas, an empty
    delta with the finish reason, then usage over all choices when asked."""
    script: Script = [_out(1, "b", [7]), _out(0, "a", [8]), _out(0, "", [9], "stop")]
    status, text = await _stream_chat(
        ServedFakeEngine(script),
        {"n": 2, "max_tokens": 3, "stream_options": {"include_usage": True}},
    )
    assert status == 200, text
    opening, *chunks, last = _events(text)
    assert [(c["index"], c["delta"]) for c in opening["choices"]] == [
        (0, {"role": "assistant", "content": ""}),
        (1, {"role": "assistant", "content": ""}),
    ]
    got = [(c["index"], c["delta"], c["finish_reason"]) for e in chunks for c in e["choices"]]
    assert got == [(1, {"content": "b"}, None), (0, {"content": "a"}, None), (0, {}, "stop")]
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


async def test_a_chat_stream_error_before_any_output_is_a_plain_http_error() -> None:
    """As completions: an error before the stream opened is the status, after it an event."""
    failed = RequestFailed("g-0", RuntimeError("boom"))
    status, text = await _stream_chat(ServedFakeEngine([failed]), {})
    assert status == 500 and json.loads(text)["error"]["code"] == "engine_error", text
    status, text = await _stream_chat(ServedFakeEngine([_out(0, "a", [1]), failed]), {})
    assert status == 200, text
    _, first, error = _events(text)
    assert first["choices"][0]["delta"] == {"content": "a"}
    assert error["error"]["code"] == "engine_error"


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_an_unexpected_error_mid_stream_is_its_last_event(
    route: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Not only an APIError: once the stream has begun, any failure ends it with a 500 error
    event and [DONE], and is logged. A second response used to be written into the stream's
    body, and the client waited for an end that never came."""
    engine = ServedFakeEngine([_out(0, "a", [1]), RuntimeError("boom")])
    stream = _stream_chat if route == "chat" else _stream_completion
    status, text = await stream(engine, {} if route == "chat" else {"prompt": [5]})
    assert status == 200, text
    error = _events(text)[-1]["error"]
    assert (error["type"], error["message"]) == (
        "server_error",
        "internal server error (see the server log)",
    )
    assert "HTTP/1.1" not in text
    assert any("mid-stream" in r.getMessage() and r.exc_info for r in caplog.records)
    assert engine.aborted, "the failed request's generation is aborted"


async def test_a_failure_after_the_outputs_is_the_streams_last_event_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failure after the outputs (here in the usage chunk) ends the begun stream the same
    way."""
    import headroom.engine.server.completions as completions

    def broken(*_: Any) -> Any:
        raise RuntimeError("usage")

    monkeypatch.setattr(completions, "usage", broken)
    body = {"prompt": [5], "stream_options": {"include_usage": True}}
    status, text = await _stream_completion(ServedFakeEngine([_out(0, "a", [1], "length")]), body)
    assert status == 200, text
    first, error = _events(text)
    assert first["choices"][0]["text"] == "a"
    assert error["error"]["type"] == "server_error"


async def test_a_failure_after_done_sends_no_second_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """`[DONE]` is the client's end: a failure after it (finishing the response) adds no error
    event and no second `[DONE]` after it."""
    from aiohttp import web

    real, calls = web.StreamResponse.write_eof, [0]

    async def failing(self: web.StreamResponse, data: bytes = b"") -> None:
        calls[0] += 1
        if calls[0] == 1:  # the route's own end fails; aiohttp's, after the handler, does not
            raise RuntimeError("after the end")
        await real(self, data)

    monkeypatch.setattr(web.StreamResponse, "write_eof", failing)
    status, text = await _stream_completion(
        ServedFakeEngine([_out(0, "a", [1], "length")]), {"prompt": [5]}
    )
    assert status == 200, text
    assert [e["choices"][0]["text"] for e in _events(text)] == ["a"]
    assert text.count("[DONE]") == 1


async def test_a_retry_elsewhere_mid_stream_ends_the_connection() -> None:
    """An engine closed mid-stream is the 503 "retry on another replica" as the last event,
    and the kept-alive connection ends after it, as that 503 does on its own: a retry on it
    would come back to this pod."""
    st = _state(ServedFakeEngine([_out(0, "a", [1]), EngineClosed("shutting down")]))
    st.tokenizer = object()  # type: ignore[assignment]
    server = TestServer(create_app(st))
    await server.start_server()
    try:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        body = json.dumps({"stream": True, "prompt": [5]}).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # Read until the server closes; a kept-alive connection would leave this waiting.
        raw = await asyncio.wait_for(reader.read(), 30)
        writer.close()
    finally:
        await server.close()
    assert b'"code":"draining"' in raw and raw.count(b"[DONE]") == 1


def test_a_template_message_has_a_name_only_when_one_was_sent() -> None:
    """`name` is left out when unset, so a template's `is defined` test holds; developer is
    rendered as system, as vLLM does."""
    assert _template_message(ChatMessage(role="developer", content="a")) == {
        "role": "system",
        "content": "a",
    }
    named = _template_message(ChatMessage(role="user", content="b", name="ann"))
    assert named == {"role": "user", "content": "b", "name": "ann"}
