"""Chat templates: turning `messages` into the prompt text a model was trained on.

A model directory's own template wins: `chat_template.jinja` beside the weights, else the
`chat_template` key of `tokenizer_config.json` (a string, or a list of named templates of which
"default" is used). It is rendered the way Hugging Face renders it: a sandboxed Jinja
environment with `trim_blocks`/`lstrip_blocks`, `raise_exception`, `strftime_now`, the
`tojson` filter, the `{% generation %}` block, and the tokenizer's special tokens (`bos_token`,
`eos_token`, ...) as variables. The rendered text is the whole prompt: BOS appears only where
the template writes it, as in transformers' `apply_chat_template` and vLLM.

The built-in `tiny` model (and a directory without a template) uses DEFAULT_TEMPLATE, which
renders each message as a role header line and its content, then opens the assistant turn::

    <|system|>
    You are terse.
    <|user|>
    Hi!
    <|assistant|>

Role headers are plain text, so the byte-level tiny tokenizer needs no special tokens for them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from headroom.contract.jsonfile import read_json_object, read_text

DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DEFAULT_SOURCE = "built-in (<|role|> headers)"


class ChatTemplateError(ValueError):
    """The template rejected the conversation (e.g. roles that do not alternate)."""


class TemplateCompileError(ValueError):
    """The model's chat template is not valid Jinja, or not one template to use."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' signature: Jinja's own tojson escapes HTML characters and takes no options.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (AssistantTracker): it marks
    assistant text for training masks (TRL); serving only needs the body rendered."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain set)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        # A call block, as in transformers, so `{% set %}` inside keeps the same scope.
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class ChatTemplate:
    """A compiled chat template plus the special-token variables it may refer to."""

    def __init__(self, source_text: str, source: str, tokens: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source_text)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateCompileError(
                f"chat template from {source} does not compile: line {e.lineno}: {e.message}"
            ) from e
        self.source = source
        self.tokens = dict(tokens or {})

    @property
    def bos_token(self) -> str | None:
        return self.tokens.get("bos_token") or None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`; raises ChatTemplateError on a rejected conversation."""
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.tokens
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError) as e:  # TypeError: e.g. tojson of a bad value
            raise ChatTemplateError(f"chat template failed: {e}") from e


class UnusableTemplate(ChatTemplate):
    """Stands in for a template that does not compile, as transformers and vLLM treat one: the
    model serves completions, and every chat request fails (400) naming the problem."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.source = f"unusable, chat requests get 400 ({reason})"
        self.tokens = {}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        raise ChatTemplateError(self.reason)


def default_template() -> ChatTemplate:
    """The documented template of the built-in tiny model."""
    return ChatTemplate(DEFAULT_TEMPLATE, DEFAULT_SOURCE)


def load_chat_template(model: str | Path) -> ChatTemplate:
    """The model directory's own template, else the default one (`model="tiny"` included).
    Raises ValueError (or OSError) naming the file when tokenizer_config.json or
    chat_template.jinja cannot be read, TemplateCompileError when the template is not Jinja (or
    the config names templates but no 'default', as transformers refuses)."""
    if str(model) == "tiny":
        return default_template()
    root = Path(model).expanduser()
    config_path = root / "tokenizer_config.json"
    config = read_json_object(config_path) if config_path.is_file() else {}
    tokens = {
        k: text
        for k, v in config.items()
        if k.endswith("_token") and (text := _token_text(v)) is not None
    }
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(read_text(jinja_file), str(jinja_file), tokens)
    raw = config.get("chat_template")
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        if named and "default" not in named:
            # transformers refuses too: rendering the first would serve, say, the tool-use one.
            raise TemplateCompileError(
                f"{config_path}: chat_template names {', '.join(map(str, named))} and none "
                "'default', the one chat would use"
            )
        raw = named.get("default")
    if isinstance(raw, str) and raw.strip():
        return ChatTemplate(raw, f"{config_path} (chat_template)", tokens)
    tmpl = default_template()
    tmpl.tokens = tokens
    return tmpl


def serving_chat_template(model: str | Path) -> ChatTemplate:
    """`load_chat_template` for the server: a template that does not compile becomes an
    UnusableTemplate (chat gets 400, completions serve); an unreadable tokenizer_config.json
    or chat_template.jinja still raises, naming the file."""
    try:
        return load_chat_template(model)
    except TemplateCompileError as e:
        return UnusableTemplate(str(e))
