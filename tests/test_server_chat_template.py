"""Chat template rendering: the built-in template and a model directory's own, and chat
prompts token for token against transformers' `apply_chat_template`."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from headroom.engine.model.tokenizer import ByteTokenizer, HFTokenizer
from headroom.engine.server.chat import _chat_prompt
from headroom.engine.server.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    TemplateCompileError,
    UnusableTemplate,
    default_template,
    load_chat_template,
    serving_chat_template,
)
from headroom.engine.server.errors import APIError
from headroom.engine.server.protocol import ChatCompletionRequest
from headroom.engine.server.state import ServerSettings, ServerState

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
]


def test_builtin_template_matches_its_documentation() -> None:
    text = load_chat_template("tiny").render(MESSAGES)
    assert text == "<|system|>\nYou are terse.\n<|user|>\nHi!\n<|assistant|>\n"
    no_gen = default_template().render(MESSAGES, add_generation_prompt=False)
    assert not no_gen.endswith("<|assistant|>\n")


def test_tokenizer_config_template_with_special_tokens(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}"
        # trim_blocks eats a newline right after a tag, so templates write it as an expression
        "{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '\\n' }}[ASSISTANT]{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": template,
                "bos_token": {"content": "<s>", "lstrip": False},
                "eos_token": "</s>",
            }
        )
    )
    tmpl = load_chat_template(tmp_path)
    assert tmpl.bos_token == "<s>"
    assert tmpl.render(MESSAGES) == "<s>[SYSTEM] You are terse.\n[USER] Hi!\n[ASSISTANT]"


def test_named_templates_and_jinja_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "TOOLS"},
                    {"name": "default", "template": "{{ messages | length }} messages"},
                ]
            }
        )
    )
    assert load_chat_template(tmp_path).render(MESSAGES) == "2 messages"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[-1]['content'] | tojson }}")
    assert load_chat_template(tmp_path).render(MESSAGES) == '"Hi!"'


def test_template_raise_exception_becomes_chat_template_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": "{% if messages[0]['role'] == 'system' %}"
                "{{ raise_exception('System role not supported') }}{% endif %}ok"
            }
        )
    )
    tmpl = load_chat_template(tmp_path)
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        tmpl.render(MESSAGES)
    assert tmpl.render(MESSAGES[1:]) == "ok"


def test_directory_without_template_falls_back_to_default(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tmpl = load_chat_template(tmp_path)
    assert tmpl.render(MESSAGES) == default_template().render(MESSAGES)
    assert tmpl.tokens["eos_token"] == "</s>"


def test_broken_template_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template(tmp_path)


def test_an_unreadable_tokenizer_config_is_named(tmp_path: Path) -> None:
    # A list or broken JSON used to raise AttributeError / a bare parser message, after the
    # whole weight load.
    config = tmp_path / "tokenizer_config.json"
    for text, says in [
        ("{oops", "not valid JSON: Expecting property name"),
        ("[]", "expected a JSON object, got list"),
        ('"chat"', "expected a JSON object, got str"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON: nested too deeply"),
    ]:
        config.write_text(text)
        with pytest.raises(ValueError, match=r"^.*: " + says) as info:
            serving_chat_template(tmp_path)
        assert str(info.value).startswith(f"{config}: "), str(info.value)
    config.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        load_chat_template(tmp_path)
    config.unlink()
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff")
    with pytest.raises(ValueError, match=r"chat_template\.jinja: not UTF-8 text"):
        load_chat_template(tmp_path)


def test_a_template_that_does_not_compile_fails_chat_requests_only(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "hi\n{% for m in messages %}", "eos_token": "</s>"})
    )
    with pytest.raises(TemplateCompileError, match="does not compile: line 2: Unexpected end"):
        load_chat_template(tmp_path)
    tmpl = serving_chat_template(tmp_path)
    assert isinstance(tmpl, UnusableTemplate) and "unusable" in tmpl.source
    st = ServerState(
        settings=ServerSettings(served_model_name="m"),
        tokenizer=ByteTokenizer(),
        chat_template=tmpl,
    )
    with pytest.raises(APIError) as info:
        _chat_prompt(st, ChatCompletionRequest.model_validate({"messages": MESSAGES}))
    assert info.value.status == 400 and info.value.code == "chat_template_error"
    assert "tokenizer_config.json (chat_template) does not compile" in str(info.value)


def test_a_model_path_with_a_tilde_finds_its_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "chat_template.jinja").write_text("home")
    assert load_chat_template("~/m").render(MESSAGES) == "home"


def test_sandbox_blocks_attribute_escapes(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages.__class__.__mro__ }}"})
    )
    with pytest.raises(ChatTemplateError):
        load_chat_template(tmp_path).render(MESSAGES)


def test_generation_block_renders_its_body() -> None:
    # transformers' AssistantTracker tag (TRL's assistant-only loss); it did not compile, so a
    # model shipping such a template never became ready.
    tmpl = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'assistant' %}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}",
        "test",
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    assert tmpl.render(messages) == "hi[ok]"


def test_tojson_forwards_every_option_as_transformers_does() -> None:
    value = {"b": "é<", "a": [1, 2]}

    def render(args: str) -> str:
        return ChatTemplate("{{ messages[0] | tojson(" + args + ") }}", "test").render([value])

    assert render("sort_keys=True, separators=(',', ':')") == '{"a":[1,2],"b":"é<"}'
    assert render("") == json.dumps(value, ensure_ascii=False)
    assert render("ensure_ascii=True, indent=2") == json.dumps(value, indent=2)


def test_special_tokens_are_the_string_or_added_token_entries_ending_in_token(
    tmp_path: Path,
) -> None:
    """A null, number or content-less AddedToken entry is no variable, nor is a non-token key."""
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>", "lstrip": False},
                "eos_token": "</s>",
                "pad_token": None,
                "unk_token": {"lstrip": False},
                "sep_token": 5,
                "tokenizer_class": "LlamaTokenizer",
            }
        )
    )
    assert load_chat_template(tmp_path).tokens == {"bos_token": "<s>", "eos_token": "</s>"}


# --- chat prompts against transformers -------------------------------------------------------

CHAT = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": 'Hi "there"', "name": "bob"},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "again"},
]
HF_TEMPLATES = {
    # No bos_token in the template while the tokenizer's post-processor prepends one
    # (Llama/Mistral tokenizers): transformers and vLLM add none, nor may the engine.
    "no_bos": "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    "writes_bos": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}"
    "{{ eos_token }}{% endfor %}",
    "name": "{% for m in messages %}{{ m.role }}{% if m.name is defined %}({{ m.name }})"
    "{% endif %}: {{ m.content }}\n{% endfor %}",
    "tojson": "{% for m in messages %}{{ m | tojson(sort_keys=True, separators=(',', ':')) }}"
    "{% endfor %}",
    "generation": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
    # Indented tags on their own lines: trim_blocks and lstrip_blocks drop the tag lines.
    "indented": "{% for m in messages %}\n  {% if m.role == 'user' %}\nU: {{ m.content }}\n"
    "  {% else %}\n{{ m.role }}: {{ m.content }}\n  {% endif %}\n{% endfor %}",
}


def _save_hf_tokenizer(root: Path, template: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer whose post-processor prepends BOS, saved with `template`."""
    chars = sorted(set(string.printable) | {"é"})
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(root / "tokenizer.json"))
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(root / "tokenizer.json"),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    hf.chat_template = template
    hf.save_pretrained(root)
    return hf


def _hf_ids(hf: PreTrainedTokenizerFast, messages: list[dict[str, Any]]) -> list[int]:
    out: Any = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    # transformers 5 returns a BatchEncoding, 4.x the id list.
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("name", sorted(HF_TEMPLATES))
def test_chat_prompt_ids_match_transformers_apply_chat_template(tmp_path: Path, name: str) -> None:
    hf = _save_hf_tokenizer(tmp_path, HF_TEMPLATES[name])
    st = ServerState(
        settings=ServerSettings(served_model_name="m"),
        tokenizer=HFTokenizer(tmp_path / "tokenizer.json"),
        chat_template=load_chat_template(tmp_path),
    )
    ids = _chat_prompt(st, ChatCompletionRequest.model_validate({"messages": CHAT}))
    assert ids == _hf_ids(hf, CHAT)
    assert ids[0] != 0 or name == "writes_bos"  # BOS only where the template writes it
    assert ids.count(0) <= 1


def test_named_templates_without_a_default_are_refused_as_transformers_does(
    tmp_path: Path,
) -> None:
    """A list of named templates is read for its 'default'; with none, transformers raises
    rather than pick one: so does headroom (the server then answers chat with 400)."""
    named = [{"name": "tool_use", "template": "TOOLS:{{ messages[0]['content'] }}"},
             {"name": "rag", "template": "RAG:{{ messages[0]['content'] }}"}]  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    with pytest.raises(TemplateCompileError, match="names tool_use, rag and none 'default'"):
        load_chat_template(tmp_path)
    assert isinstance(serving_chat_template(tmp_path), UnusableTemplate)
    default = [*named, {"name": "default", "template": "D:{{ messages[0]['content'] }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": default}))
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "hi"}]) == "D:hi"
