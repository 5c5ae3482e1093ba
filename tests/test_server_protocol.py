"""Request validation and OpenAI-schema error mapping of the HTTP server (no engine)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from headroom.engine.server.auth import bearer_token, key_matches
from headroom.engine.server.errors import (
    RETRY_ELSEWHERE_AFTER_S,
    APIError,
    from_validation_error,
    retry_elsewhere,
)
from headroom.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from headroom.engine.server.sse import encode_event


def _error(model: type[BaseModel], body: dict[str, Any]) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    err = from_validation_error(info.value)
    assert err.status == 400
    return err.message, err.param


def test_completion_defaults_and_prompt_shapes() -> None:
    req = CompletionRequest.model_validate({"prompt": "hi"})
    assert (req.max_tokens, req.n, req.temperature, req.stream) == (16, 1, 1.0, False)
    assert req.prompts() == ["hi"]
    assert CompletionRequest.model_validate({"prompt": [1, 2, 3]}).prompts() == [[1, 2, 3]]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert CompletionRequest.model_validate({"prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    assert CompletionRequest.model_validate({"prompt": "x", "stop": "\n"}).stop_list == ["\n"]


def test_a_stop_token_id_list_over_the_cap_is_a_400_naming_the_field() -> None:
    # Each sampled token is looked up in the list on the engine's one thread: a million ids in
    # one request stalled every other request for 40 s.
    message, param = _error(CompletionRequest, {"prompt": "hi", "stop_token_ids": [1] * 257})
    assert param == "stop_token_ids" and "at most 256" in message, message


def test_unknown_field_is_named() -> None:
    message, param = _error(CompletionRequest, {"prompt": "hi", "max_token": 5})
    assert param == "max_token"
    assert "unknown field 'max_token'" in message


def test_missing_field_is_named() -> None:
    message, param = _error(ChatCompletionRequest, {"model": "tiny"})
    assert param == "messages"
    assert "missing" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.5),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("n", 0),
        ("max_tokens", 0),
        ("top_k", -2),
    ],
)
def test_out_of_range_values_name_the_field(field: str, value: float) -> None:
    message, param = _error(CompletionRequest, {"prompt": "hi", field: value})
    assert param == field
    assert f"field '{field}'" in message
    assert repr(value) in message


def test_union_field_errors_name_the_field_not_the_branch() -> None:
    _, param = _error(CompletionRequest, {"prompt": {"text": "hi"}})
    assert param == "prompt"
    _, param = _error(CompletionRequest, {"prompt": "hi", "stop": 7})
    assert param == "stop"
    message, _ = _error(CompletionRequest, {"prompt": []})
    assert "empty" in message


def test_nested_field_path() -> None:
    message, param = _error(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"}, {"role": "bot"}]}
    )
    assert param == "messages[1].role"
    assert "messages[1].role" in message


@pytest.mark.parametrize(
    ("body", "word"),
    [
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "logprobs": 3}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
    ],
)
def test_unsupported_settings_are_refused_by_name(body: dict[str, Any], word: str) -> None:
    message, _ = _error(CompletionRequest, body)
    assert word in message
    assert "not supported" in message


@pytest.mark.parametrize(
    ("model", "body", "field"),
    [
        (CompletionRequest, {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        (ChatCompletionRequest, {"frequency_penalty": -1.0}, "frequency_penalty"),
        (CompletionRequest, {"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
        (CompletionRequest, {"prompt": "x", "echo": True}, "echo"),
        (CompletionRequest, {"prompt": "x", "suffix": "z"}, "suffix"),
        (CompletionRequest, {"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ],
)  # fmt: skip
def test_unsupported_settings_name_their_field_as_param(
    model: type[BaseModel], body: dict[str, Any], field: str
) -> None:
    # OpenAI and vLLM put the offending field in `param`; these were null (model-level checks).
    if model is ChatCompletionRequest:
        body = {"messages": [{"role": "user", "content": "a"}], **body}
    message, param = _error(model, body)
    assert param == field and "not supported" in message, message


def test_stream_options_without_stream_is_refused_naming_the_field() -> None:
    # vLLM (and OpenAI) answer 400 instead of silently ignoring the options.
    options = {"stream_options": {"include_usage": True}}
    msgs = [{"role": "user", "content": "a"}]
    for model, body in (
        (CompletionRequest, {"prompt": "x"}),
        (ChatCompletionRequest, {"messages": msgs}),
    ):
        for stream in ({}, {"stream": False}):
            message, param = _error(model, {**body, **stream, **options})
            assert param == "stream_options" and "stream=True" in message, message
        assert model.model_validate({**body, "stream": True, **options})
        # As vLLM: null or empty options set nothing, so they pass.
        assert model.model_validate({**body, "stream_options": None})
        assert model.model_validate({**body, "stream_options": {}})


def test_neutral_values_of_unsupported_settings_pass() -> None:
    req = CompletionRequest.model_validate(
        {"prompt": "x", "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": None,
         "echo": False, "best_of": 1, "user": "me"}
    )  # fmt: skip
    assert req.n == 1


def test_any_completion_logprobs_is_refused_naming_the_field() -> None:
    # OpenAI and vLLM answer logprobs=0 with the chosen tokens' logprobs; the server used to
    # accept it and answer `logprobs: null`.
    for value in (0, 1):
        message, param = _error(CompletionRequest, {"prompt": "x", "logprobs": value})
        assert param == "logprobs" and "not supported" in message, message


def test_chat_logprobs_are_refused_naming_the_field_and_neutral_values_pass() -> None:
    msgs = [{"role": "user", "content": "a"}]
    message, param = _error(ChatCompletionRequest, {"messages": msgs, "logprobs": True})
    assert param == "logprobs" and "not supported" in message, message
    message, param = _error(ChatCompletionRequest, {"messages": msgs, "top_logprobs": 2})
    assert param == "top_logprobs" and "not supported" in message, message
    # top_logprobs=0 without logprobs=true asks for nothing (vLLM accepts it too).
    req = ChatCompletionRequest.model_validate(
        {"messages": msgs, "logprobs": False, "top_logprobs": 0}
    )
    assert req.top_logprobs == 0


def test_chat_message_parts_and_max_tokens_alias() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 7,
        }
    )  # fmt: skip
    # Text parts are joined by newlines, as vLLM renders them.
    assert req.messages[0].text == "a\nb"
    assert req.requested_max_tokens == 7
    _, param = _error(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    )
    assert param is not None and param.startswith("messages[0].content")


def test_bearer_parsing_and_constant_time_compare() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token(None) is None
    assert bearer_token("Bearer ") is None
    assert key_matches("k1", "k1")
    assert not key_matches("k1", "k2")
    assert not key_matches("k1", None)


def test_sse_event_encoding() -> None:
    assert encode_event("[DONE]") == b"data: [DONE]\n\n"
    assert encode_event({"a": 1}) == b'data: {"a":1}\n\n'


def test_caps_on_n_stop_strings_and_batch_prompts_are_inclusive() -> None:
    """`n` <= 64, <= 16 stop strings and <= 64 prompts pass; one more is a 400 naming the field."""
    assert CompletionRequest.model_validate({"prompt": "x", "n": 64}).n == 64
    assert CompletionRequest.model_validate({"prompt": "x", "stop": ["s"] * 16}).stop_list
    assert len(CompletionRequest.model_validate({"prompt": ["p"] * 64}).prompts()) == 64
    # The prompt cap counts prompts: one token-id prompt of 65 tokens is one prompt.
    assert CompletionRequest.model_validate({"prompt": [1] * 65}).prompts() == [[1] * 65]
    message, param = _error(CompletionRequest, {"prompt": "x", "n": 65})
    assert param == "n" and "65" in message, message
    message, param = _error(CompletionRequest, {"prompt": "x", "stop": ["s"] * 17})
    assert param == "stop" and "at most 16 stop strings, got 17" in message, message
    for prompts in (["p"] * 65, [[1]] * 65):
        message, param = _error(CompletionRequest, {"prompt": prompts})
        assert param == "prompt" and "at most 64 prompts per request, got 65" in message, message


def test_seed_takes_any_signed_or_unsigned_64_bit_value_and_no_more() -> None:
    """A seed is a 64-bit integer, signed or unsigned (as clients send either); past that, 400."""
    for seed in (-(2**63), 2**64 - 1):
        assert CompletionRequest.model_validate({"prompt": "x", "seed": seed}).seed == seed
    for seed in (-(2**63) - 1, 2**64):
        _, param = _error(CompletionRequest, {"prompt": "x", "seed": seed})
        assert param == "seed"


def test_null_sampling_fields_are_the_defaults_and_count_as_left_out() -> None:
    """Null n/temperature/top_p/top_k/stream/echo is the default, and not in model_fields_set
    (so the model's generation-config defaults apply); other fields keep their null."""
    nullable = ("n", "temperature", "top_p", "top_k", "stream", "echo")
    req = CompletionRequest.model_validate(
        {"prompt": "x", "seed": None, "max_tokens": None, **dict.fromkeys(nullable)}
    )
    assert [getattr(req, k) for k in nullable] == [1, 1.0, 1.0, -1, False, False]
    assert req.model_fields_set == {"prompt", "seed", "max_tokens"}
    assert req.max_tokens is None
    given = CompletionRequest.model_validate({"prompt": "x", "top_p": 0.5, "top_k": 0})
    assert (given.top_p, given.top_k) == (0.5, 0)
    assert {"top_p", "top_k"} <= given.model_fields_set


def test_one_element_prompts_are_validated_and_split_like_longer_ones() -> None:
    """A one-token prompt, or one token-id prompt in a list, is checked and served like more."""
    assert CompletionRequest.model_validate({"prompt": [7]}).prompts() == [[7]]
    assert CompletionRequest.model_validate({"prompt": [[7]]}).prompts() == [[7]]
    assert CompletionRequest.model_validate({"prompt": ["a"]}).prompts() == ["a"]
    message, param = _error(CompletionRequest, {"prompt": [-1]})
    assert param == "prompt" and "token ids must be >= 0" in message, message
    message, param = _error(CompletionRequest, {"prompt": [[]]})
    assert param == "prompt" and "token-id prompts must not be empty" in message, message


def test_chat_output_budgets_must_be_positive_naming_the_field_sent() -> None:
    """Chat's max_tokens and max_completion_tokens are both >= 1, each error naming its field."""
    msgs = [{"role": "user", "content": "a"}]
    for field in ("max_tokens", "max_completion_tokens"):
        message, param = _error(ChatCompletionRequest, {"messages": msgs, field: 0})
        assert param == field and "(got 0)" in message, message
        req = ChatCompletionRequest.model_validate({"messages": msgs, field: 1})
        assert (req.requested_max_tokens, req.max_tokens_field) == (1, field)


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (413, "invalid_request_error"),
        (500, "server_error"),
        (503, "service_unavailable"),
    ],
)
def test_error_body_type_follows_the_status_as_openai_s(status: int, kind: str) -> None:
    """The official client picks its exception class from the status; `type` must agree."""
    body = APIError(status, "m", param="p", code="c").body().model_dump()
    assert body == {"error": {"message": "m", "type": kind, "param": "p", "code": "c"}}


def test_error_response_keeps_headers_and_closes_only_when_asked() -> None:
    """A 405 carries its Allow header; only a `close` error ends the connection."""
    resp = APIError(405, "m", headers={"Allow": "GET"}).response()
    assert (resp.status, resp.headers["Allow"], resp.keep_alive) == (405, "GET", None)
    assert json.loads(resp.text)["error"]["type"] == "invalid_request_error"
    assert APIError(400, "m", close=True).response().keep_alive is False


def test_retry_elsewhere_is_a_closing_503_with_retry_after() -> None:
    """A replica that cannot serve sends the client to another: 503, Retry-After, close."""
    err = retry_elsewhere("shutting down")
    assert (err.status, err.code, err.close) == (503, "draining", True)
    assert err.message == "shutting down; retry on another replica"
    assert err.headers == {"Retry-After": str(RETRY_ELSEWHERE_AFTER_S)} == {"Retry-After": "1"}
    assert retry_elsewhere("x", code="engine_unhealthy").code == "engine_unhealthy"


def test_a_body_that_is_not_an_object_is_a_400_without_a_param() -> None:
    """A model-level error (here, a JSON array as the body) has no field to name."""
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(["x"])
    err = from_validation_error(info.value)
    assert (err.status, err.param, err.code) == (400, None, "invalid_value")
    assert "valid dictionary" in err.message
