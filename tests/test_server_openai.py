"""The official `openai` client against a real `headroom serve --model tiny` subprocess:
completions, chat, streaming, sampling controls, and the error cases with our messages."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from engine_process import ServerProcess

from headroom.engine.server.chat_template import default_template

MAX_MODEL_LEN = 512
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(
        "--model", "tiny", "--max-model-len", str(MAX_MODEL_LEN), "--num-blocks", "256",
        "--max-body-bytes", str(MAX_BODY), "--served-model-name", "tiny-test",
    ) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def _raw_post(url: str, data: bytes) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_startup_prints_the_budget(server: ServerProcess) -> None:
    line = next(ln for ln in server.lines if "budget:" in ln)
    assert "weights" in line
    assert "pool 256 blocks x 16 = 4,096 tokens" in line
    assert f"max concurrency at max_model_len {MAX_MODEL_LEN}: 8 sequences" in line


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-test"]


def test_completion_greedy_is_deterministic_and_reports_usage(client: openai.OpenAI) -> None:
    kw = dict(model="tiny-test", prompt="hello", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    a = client.completions.create(**kw)  # type: ignore[call-overload]
    b = client.completions.create(**kw)  # type: ignore[call-overload]
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].finish_reason == "length"
    assert a.usage is not None
    # The byte tokenizer: one token per byte plus BOS.
    assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (6, 12)
    assert a.usage.total_tokens == 18
    assert a.id.startswith("cmpl-") and a.model == "tiny-test"


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_choices(
    client: openai.OpenAI,
) -> None:
    kw = dict(model="tiny-test", prompt="seed me", max_tokens=16, temperature=1.0, top_p=0.95,
              n=3, seed=1234, extra_body={"ignore_eos": True})  # fmt: skip
    a = client.completions.create(**kw)  # type: ignore[call-overload]
    b = client.completions.create(**kw)  # type: ignore[call-overload]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    assert a.usage is not None and a.usage.completion_tokens == 48


def test_batch_and_token_id_prompts(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny-test", prompt=["a", "bcd"], max_tokens=3, temperature=0, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage is not None and out.usage.prompt_tokens == 2 + 4
    # Token ids go straight to the engine: [256 (BOS), 'h', 'i'] equals the text "hi".
    ids = client.completions.create(model="tiny-test", prompt=[256, 104, 105], max_tokens=6,
                                    temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    text = client.completions.create(model="tiny-test", prompt="hi", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    assert ids.choices[0].text == text.choices[0].text


def test_stop_string_cuts_the_output(client: openai.OpenAI) -> None:
    kw = dict(model="tiny-test", prompt="The stop test", temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    full = client.completions.create(max_tokens=64, **kw).choices[0].text  # type: ignore[call-overload]
    # A printable ASCII character somewhere after the start of the greedy output.
    pos = next(i for i, ch in enumerate(full) if i > 0 and ch.isascii() and ch.isprintable())
    stop = full[pos]
    cut = client.completions.create(max_tokens=64, stop=[stop], **kw).choices[0]  # type: ignore[call-overload]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI) -> None:
    kw = dict(model="tiny-test", prompt="stream", max_tokens=20, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**kw)  # type: ignore[call-overload]
    # Without stream_options.include_usage every chunk carries a choice, as OpenAI's do: the
    # usual client loop reads chunk.choices[0].
    plain = list(client.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    assert all(c.choices and c.usage is None for c in plain)
    assert "".join(c.choices[0].text for c in plain) == whole.choices[0].text
    chunks = list(client.completions.create(  # type: ignore[call-overload]
        stream=True, stream_options={"include_usage": True}, **kw))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == 7


def test_chat_uses_the_template_and_streams(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    kw = dict(model="tiny-test", messages=messages, max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    rendered = default_template().render(messages)
    assert whole.usage is not None
    # The template owns BOS (as transformers and vLLM): the built-in one writes none.
    assert whole.usage.prompt_tokens == len(rendered.encode())
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw)  # type: ignore[call-overload]  # fmt: skip
    chunks = list(stream)
    plain = list(client.chat.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    assert all(c.choices and c.usage is None for c in plain)
    text = "".join(c.choices[0].delta.content or "" for c in plain)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_without_max_tokens_fills_the_context_limit(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny-test", messages=[{"role": "user", "content": "x" * 400}], temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.usage is not None
    assert out.usage.prompt_tokens + out.usage.completion_tokens == MAX_MODEL_LEN


def test_each_prompt_gets_its_own_budget_without_max_tokens(client: openai.OpenAI) -> None:
    # As vLLM: max_tokens null gives each prompt the room it leaves, not the least room of all.
    prompts = ["x" * 300, "x" * 450]  # 301 and 451 tokens with BOS: room for 211 and 61
    kw = dict(model="tiny-test", prompt=prompts, max_tokens=None, temperature=0, n=2,
              extra_body={"ignore_eos": True})  # fmt: skip
    out = client.completions.create(**kw)  # type: ignore[call-overload]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage is not None and out.usage.prompt_tokens == 301 + 451
    assert out.usage.completion_tokens == 2 * (211 + 61)
    chunks = list(client.completions.create(  # type: ignore[call-overload]
        stream=True, stream_options={"include_usage": True}, **kw))  # fmt: skip
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2 * (211 + 61)


def test_chat_rejections_name_the_fields_the_request_sent(client: openai.OpenAI) -> None:
    # OpenAI and vLLM name the field the client sent: a chat request has no `prompt`, and
    # may give its budget as `max_completion_tokens`.
    short = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="leaving no room") as info:
        client.chat.completions.create(
            model="tiny-test", messages=[{"role": "user", "content": "x" * 600}]
        )
    assert (info.value.param, info.value.code) == ("messages", "context_length_exceeded")
    with pytest.raises(openai.BadRequestError, match=r"\+ max_completion_tokens 600 =") as info:
        client.chat.completions.create(model="tiny-test", messages=short, max_completion_tokens=600)
    assert info.value.param == "max_completion_tokens"
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match=r"\+ max_tokens 600 =") as info:
        client.chat.completions.create(model="tiny-test", messages=short, max_tokens=600)
    assert info.value.param == "max_tokens"


def test_too_long_request_is_a_bad_request_with_both_numbers(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-test", prompt="x" * 100, max_tokens=450)
    msg = str(info.value)
    assert "101 + max_tokens 450 = 551" in msg and f"max_model_len {MAX_MODEL_LEN}" in msg
    assert info.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="leaving no room"):
        client.completions.create(model="tiny-test", prompt="x" * 600, max_tokens=1)


def test_unknown_and_out_of_range_fields(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="unknown field 'bogus'") as info:
        client.completions.create(model="tiny-test", prompt="x", extra_body={"bogus": 1})
    assert info.value.param == "bogus"
    with pytest.raises(openai.BadRequestError, match="temperature") as info:
        client.chat.completions.create(
            model="tiny-test", messages=[{"role": "user", "content": "x"}], temperature=3.0
        )
    assert info.value.param == "temperature"
    assert info.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model="tiny-test", prompt="x", presence_penalty=1.0)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="tiny-test", prompt=[5, 99999])


@pytest.mark.parametrize(
    ("body", "param", "code", "message"),
    [
        ({"prompt": [5, 99999]}, "prompt", "invalid_token_id", "[99999] are outside"),
        # The request schema itself refuses what is no token id at all, naming the item.
        ({"prompt": [5, -1]}, "prompt", "invalid_value", "token ids must be >= 0"),
        ({"prompt": ["hi", []]}, "prompt[1]", "invalid_value", "prompt[1]"),
        ({"prompt": "x" * 600}, "prompt", "context_length_exceeded", "leaving no room"),
        ({"prompt": "x" * 100, "max_tokens": 450}, "max_tokens", "context_length_exceeded",
         "101 + max_tokens 450"),
        ({"prompt": ["hi", "x" * 100], "max_tokens": 450}, "max_tokens",
         "context_length_exceeded", "prompt 1 101 + max_tokens 450"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "invalid_value", "max_tokens"),
        ({"prompt": "hi", "top_p": 0}, "top_p", "invalid_value", "top_p"),
        # 0 asks for the chosen tokens' logprobs, which the engine does not compute.
        ({"prompt": "hi", "logprobs": 0}, "logprobs", "invalid_value", "logprobs=0"),
    ],
)  # fmt: skip
def test_each_rejection_names_its_field(
    client: openai.OpenAI, body: dict[str, Any], param: str, code: str, message: str
) -> None:
    """The engine's validation names the field at fault; the server passes it on as `param`."""
    prompt = body.pop("prompt")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-test", prompt=prompt, extra_body=body)
    assert (info.value.param, info.value.code) == (param, code)
    assert message in str(info.value)


def test_wrong_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="this server serves 'tiny-test'"):
        client.completions.create(model="gpt-4", prompt="x")


def test_malformed_json_and_oversized_body(server: ServerProcess) -> None:
    status, body = _raw_post(server.url + "/v1/completions", b'{"prompt": "x",')
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert "malformed JSON" in body["error"]["message"]
    status, body = _raw_post(server.url + "/v1/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    big = json.dumps({"prompt": "x" * (MAX_BODY + 10)}).encode()
    status, body = _raw_post(server.url + "/v1/completions", big)
    assert status == 413
    assert str(MAX_BODY) in body["error"]["message"]


def test_oversized_body_through_the_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="tiny-test", prompt="y" * (MAX_BODY * 2))
    assert info.value.status_code == 413
    assert "exceeds the limit" in str(info.value)


def test_stats_is_the_versioned_snapshot(server: ServerProcess) -> None:
    from headroom.contract.stats import STATS_SCHEMA_VERSION, StatsSnapshot

    with urllib.request.urlopen(server.url + "/stats", timeout=10) as resp:
        snap = StatsSnapshot.model_validate_json(resp.read())
    assert snap.version == STATS_SCHEMA_VERSION
    assert snap.model == "tiny-test"  # the served name, as vLLM and SGLang report theirs
    assert snap.kv.capacity == 256
    assert snap.kv.free + snap.kv.used + snap.kv.cached == snap.kv.capacity
    with urllib.request.urlopen(server.url + "/health", timeout=10) as resp:
        assert json.loads(resp.read()) == {"status": "ok"}
