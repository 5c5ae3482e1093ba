"""Chat template rendering: the built-in template and a model directory's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headroom.engine.server.chat_template import (
    ChatTemplateError,
    default_template,
    load_chat_template,
)

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


def test_sandbox_blocks_attribute_escapes(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages.__class__.__mro__ }}"})
    )
    with pytest.raises(ChatTemplateError):
        load_chat_template(tmp_path).render(MESSAGES)
