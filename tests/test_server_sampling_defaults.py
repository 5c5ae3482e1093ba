"""Sampling fields left to their default: JSON null is the same as leaving a field out (OpenAI
marks them nullable, vLLM takes null as "the default", the openai client sends null for an
explicit None), and the default of `temperature`, `top_p` and `top_k` is the model's own from
its generation_config.json (`--generation-config auto`, vLLM's default), counted only where it
differs from transformers' defaults; `--generation-config vllm` ignores the file."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from engine_process import ServerProcess
from pydantic import BaseModel

from headroom.engine.model.loader import generation_sampling_defaults
from headroom.engine.server.cli import add_arguments, build_configs
from headroom.engine.server.protocol import ChatCompletionRequest, CompletionRequest

VOCAB = 320
PROMPT = "t5 t6 t7"
MESSAGES = [{"role": "user", "content": "t9 t10"}]
SEEDS = (1, 2, 3, 4)
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
# Sampling defaults that transformers' GenerationConfig defaults (temperature 1.0, top_k 50)
# make no setting; top_p 0.5 differs and applies; repetition_penalty cannot (warned).
DIFF_FILE = {"do_sample": True, "temperature": 1.0, "top_k": 50, "top_p": 0.5,
             "repetition_penalty": 1.1}  # fmt: skip
# top_k 1: greedy unless the request turns top-k off itself.
GREEDY_FILE = {"do_sample": True, "top_k": 1, "temperature": 0.6, "top_p": 0.9}
NULLABLE = {
    "/v1/completions": ("temperature", "top_p", "top_k", "n", "stream", "echo"),
    "/v1/chat/completions": ("temperature", "top_p", "top_k", "n", "stream"),
}
DEFAULTS_LINE = "default sampling parameters from the model's generation_config.json"


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama (near-uniform next-token distribution: sampling differs from the
    argmax almost every token) with a word-level tokenizer (`t<id>` is token id)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("weights")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


def _checkpoint(weights: Path, root: Path, sampling: dict[str, Any]) -> Path:
    path = root / "model"
    shutil.copytree(weights, path)
    gen = json.loads((path / "generation_config.json").read_text())  # bos/eos ids
    (path / "generation_config.json").write_text(json.dumps({**gen, **sampling}))
    return path


def _serve(model: Path, *flags: str) -> ServerProcess:
    return ServerProcess("--model", str(model), "--num-blocks", "64", "--max-model-len", "256",
                         "--log-level", "info", *flags)  # fmt: skip


@pytest.fixture(scope="module")
def diff_server(weights: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with _serve(_checkpoint(weights, tmp_path_factory.mktemp("diff"), DIFF_FILE)) as srv:
        yield srv


@pytest.fixture(scope="module")
def greedy_model(weights: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(weights, tmp_path_factory.mktemp("greedy"), GREEDY_FILE)


@pytest.fixture(scope="module")
def greedy_server(greedy_model: Path) -> Iterator[ServerProcess]:
    with _serve(greedy_model) as srv:
        yield srv


@pytest.fixture(scope="module")
def vllm_server(greedy_model: Path) -> Iterator[ServerProcess]:
    with _serve(greedy_model, "--generation-config", "vllm") as srv:
        yield srv


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        server.url + path, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _base(path: str, max_tokens: int = 8) -> dict[str, Any]:
    shared = {"max_tokens": max_tokens, "ignore_eos": True}
    if path == "/v1/completions":
        return {"prompt": PROMPT, **shared}
    return {"messages": MESSAGES, **shared}


def _text(server: ServerProcess, body: dict[str, Any], path: str = "/v1/completions") -> str:
    status, out = _post(server, path, {**_base(path, 24), **body})
    assert status == 200, out
    choice = out["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


# --- null is the default -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "base"),
    [(CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, {"messages": MESSAGES})],
)
def test_null_validates_as_the_field_left_out(model: type[BaseModel], base: dict[str, Any]) -> None:
    path = "/v1/completions" if model is CompletionRequest else "/v1/chat/completions"
    omitted = model.model_validate(base)
    for field in NULLABLE[path]:
        nulled = model.model_validate({**base, field: None})
        assert nulled.model_dump() == omitted.model_dump(), field
        assert field not in nulled.model_fields_set, field  # the model's default may apply


@pytest.mark.parametrize(
    ("path", "field"), [(p, f) for p, fields in NULLABLE.items() for f in fields]
)
def test_a_null_field_is_accepted_and_samples_as_if_left_out(
    diff_server: ServerProcess, path: str, field: str
) -> None:
    body = {**_base(path), "seed": 7}
    status, omitted = _post(diff_server, path, body)
    assert status == 200, omitted
    status, nulled = _post(diff_server, path, {**body, field: None})
    assert status == 200, f"{field}=null: {nulled}"
    assert nulled["object"] == omitted["object"]  # stream=null is no stream
    assert nulled["choices"] == omitted["choices"], f"{field}=null sampled otherwise"


def test_the_openai_client_sending_none_gets_the_defaults(diff_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=diff_server.url + "/v1", api_key="x", max_retries=0,
                           timeout=60)  # fmt: skip
    with client:
        kw: dict[str, Any] = dict(model="model", messages=MESSAGES, max_tokens=8, seed=3)
        plain = client.chat.completions.create(**kw)
        nones = client.chat.completions.create(**kw, temperature=None, top_p=None, n=None)
    assert nones.choices[0].message.content == plain.choices[0].message.content


# --- the model's generation_config.json -------------------------------------------------


def test_only_values_that_differ_from_transformers_defaults_apply(
    diff_server: ServerProcess,
) -> None:
    # The file's top_p 0.5 applies to requests that leave it out; its temperature 1.0 and
    # top_k 50 are transformers' defaults, so no setting: no top-k filter.
    for seed in SEEDS:
        omitted = _text(diff_server, {"seed": seed})
        assert omitted == _text(diff_server, {"seed": seed, **NEUTRAL, "top_p": 0.5}), seed
    assert any(
        _text(diff_server, {"seed": s}) != _text(diff_server, {"seed": s, **NEUTRAL}) for s in SEEDS
    ), "top_p 0.5 from generation_config.json did not change what omitted fields sample"
    lines = [ln for ln in diff_server.lines if DEFAULTS_LINE in ln]
    assert len(lines) == 1 and " INFO " in lines[0], diff_server.output
    assert "top_p=0.5" in lines[0] and "top_k=" not in lines[0] and "temperature=" not in lines[0]
    warned = [ln for ln in diff_server.lines if "repetition_penalty 1.1 is not supported" in ln]
    assert len(warned) == 1 and " WARNING " in warned[0], diff_server.output


def test_a_model_top_k_of_1_decodes_greedily_unless_the_request_says_otherwise(
    greedy_server: ServerProcess, vllm_server: ServerProcess
) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        greedy = _text(greedy_server, {"temperature": 0}, path)
        for seed in SEEDS[:2]:
            assert _text(greedy_server, {"seed": seed}, path) == greedy, (path, seed)
            assert _text(greedy_server, {"seed": seed, "top_k": None}, path) == greedy
    greedy = _text(greedy_server, {"temperature": 0})
    # A request's own top_k wins (with the model's temperature 0.6 and top_p 0.9).
    sampled = [_text(greedy_server, {"seed": s, "top_k": 0}) for s in SEEDS]
    assert any(t != greedy for t in sampled), "explicit top_k 0 still decoded greedily"
    explicit = {"temperature": 0.6, "top_p": 0.9, "top_k": 0}
    assert sampled == [_text(greedy_server, {"seed": s, **explicit}) for s in SEEDS]
    # All three given: the request's values, the same as a server that ignores the file.
    for seed in SEEDS[:2]:
        assert _text(greedy_server, {"seed": seed, **NEUTRAL}) == _text(vllm_server, {"seed": seed})
    line = next(ln for ln in greedy_server.lines if DEFAULTS_LINE in ln)
    assert all(kv in line for kv in ("temperature=0.6", "top_p=0.9", "top_k=1")), line


def test_generation_config_vllm_ignores_the_file(vllm_server: ServerProcess) -> None:
    greedy = _text(vllm_server, {"temperature": 0})
    omitted = [_text(vllm_server, {"seed": s}) for s in SEEDS]
    assert any(t != greedy for t in omitted), "--generation-config vllm still applied top_k 1"
    assert omitted == [_text(vllm_server, {"seed": s, **NEUTRAL}) for s in SEEDS]
    assert not any(DEFAULTS_LINE in ln for ln in vllm_server.lines), vllm_server.output


# --- reading the file, as vLLM's get_diff_sampling_param ---------------------------------


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        ({}, {}),
        ({"temperature": 1.0, "top_p": 1.0, "top_k": 50}, {}),  # transformers' defaults
        ({"temperature": 1, "top_p": 1, "top_k": 50.0}, {}),
        ({"temperature": None, "top_p": None, "top_k": None}, {}),
        ({"do_sample": False, "temperature": 0.6, "top_p": 0.9},
         {"temperature": 0.6, "top_p": 0.9}),
        ({"top_k": 1}, {"top_k": 1}),
        ({"top_k": 0, "temperature": 0}, {"top_k": 0, "temperature": 0}),
        ({"top_k": 20.0, "temperature": 0.7, "top_p": 0.8},
         {"top_k": 20, "temperature": 0.7, "top_p": 0.8}),
    ],
)  # fmt: skip
def test_the_file_sets_what_differs_from_transformers_defaults(
    tmp_path: Path, sampling: dict[str, Any], expected: dict[str, Any]
) -> None:
    gen = {"bos_token_id": 1, "eos_token_id": 2, **sampling}
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    got = generation_sampling_defaults(tmp_path)
    assert got == expected
    assert all(type(got[k]) is type(v) for k, v in expected.items())


def test_values_the_engine_cannot_apply_are_warned_and_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    file = tmp_path / "generation_config.json"
    file.write_text(json.dumps({"temperature": -1, "top_p": 0, "top_k": "5", "min_p": 0.05,
                                "repetition_penalty": 1.05}))  # fmt: skip
    with caplog.at_level(logging.WARNING):
        assert generation_sampling_defaults(tmp_path) == {}
    said = caplog.text
    for part in ("temperature -1", "top_p 0", "top_k '5'", "min_p 0.05", "repetition_penalty 1.05"):
        assert part in said, said
    caplog.clear()
    file.write_text(json.dumps({"min_p": 0.0, "repetition_penalty": 1.0, "top_k": 1}))
    with caplog.at_level(logging.WARNING):
        assert generation_sampling_defaults(tmp_path) == {"top_k": 1}
    assert not caplog.records  # neutral values: nothing lost
    file.write_text("{oops")  # the load warns about this one; the defaults are just none
    assert generation_sampling_defaults(tmp_path) == {}
    assert generation_sampling_defaults(tmp_path / "missing") == {}


def test_the_flag_picks_the_defaults_and_tiny_has_none(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(GREEDY_FILE))
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def defaults(*argv: str) -> dict[str, Any]:
        return build_configs(parser.parse_args(list(argv)))[1].sampling_defaults.model_dump()

    assert defaults("--model", str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "top_k": 1}
    assert defaults("--model", str(tmp_path), "--generation-config", "auto")["top_k"] == 1
    none = {"temperature": None, "top_p": None, "top_k": None}
    assert defaults("--model", str(tmp_path), "--generation-config", "vllm") == none
    assert defaults("--model", "tiny") == none
