"""OpenAI-compatible request, response and error bodies (pydantic).

Requests forbid unknown fields so a typo (`max_token`) is a 400 naming the field instead of a
silently ignored setting. Fields OpenAI defines but the engine does not implement (penalties,
logprobs, logit_bias, echo, suffix, best_of > n) are accepted only at their neutral value; any
other value is a 400 that says so. vLLM's extensions `top_k`, `ignore_eos` and `stop_token_ids`
are accepted so the same clients (and `headroom load`) work against either server.

OpenAI marks `n`, `temperature`, `top_p`, `stream` (and completions' `echo`) nullable, and vLLM
takes null for those and `top_k` as "use the default": so does this server, null being the same
as leaving the field out. The handlers see the concrete default; whether the request gave
`temperature`, `top_p` or `top_k` at all is `model_fields_set` (a left-out one takes the
model's generation_config.json default, see `generation.sampling_params`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from headroom.engine.sampling import MAX_STOP_TOKEN_IDS

FinishReason = Literal["stop", "length", "abort"]

MAX_N = 64
MAX_STOP_STRINGS = 16
MAX_BATCH_PROMPTS = 64


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


def _neutral(name: str, value: Any, neutral: Any) -> None:
    if value is not None and value != neutral:
        raise ValueError(f"{name}={value!r} is not supported by this server (only {neutral!r})")


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    # Null here means the default: the key is dropped before validation, so the field is
    # unset, exactly as if left out (and keeps every bound for a value that is not null).
    _NULL_IS_DEFAULT: ClassVar[frozenset[str]] = frozenset(
        {"n", "temperature", "top_p", "top_k", "stream"}
    )

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, description="vLLM extension; -1 or 0 = off")
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, max_length=MAX_STOP_TOKEN_IDS
    )
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in cls._NULL_IS_DEFAULT}

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    # The unsupported settings are checked per field, not on the whole model, so the error's
    # `param` names the field (as OpenAI's and vLLM's do), not null.
    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _check_penalty(cls, v: float | None, info: ValidationInfo) -> float | None:
        _neutral(str(info.field_name), v, 0.0)
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported by this server")
        return v

    @field_validator("stream_options", mode="before")
    @classmethod
    def _check_stream_options(cls, v: Any, info: ValidationInfo) -> Any:
        # As vLLM and OpenAI: options of a stream that is not asked for are a mistake to
        # report, not to ignore (null or {} set nothing). `stream` is declared first, so it
        # is already in `info.data`.
        if v and not info.data.get("stream"):
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return v

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`."""

    _NULL_IS_DEFAULT: ClassVar[frozenset[str]] = _SamplingFields._NULL_IS_DEFAULT | {"echo"}

    prompt: Prompt
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Prompt) -> Prompt:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be an empty list")
            if len(v) > MAX_BATCH_PROMPTS and not isinstance(v[0], int):
                raise ValueError(f"at most {MAX_BATCH_PROMPTS} prompts per request, got {len(v)}")
            if isinstance(v[0], list) and any(not p for p in v):
                raise ValueError("token-id prompts must not be empty")
            if isinstance(v[0], int) and any(t < 0 for t in v):
                raise ValueError("token ids must be >= 0")
        return v

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, v: int | None) -> int | None:
        # Any integer, 0 included, asks for the chosen tokens' logprobs (OpenAI, vLLM), which
        # the engine does not compute: only leaving it out (or null) is neutral.
        if v is not None:
            raise ValueError(f"logprobs={v!r} is not supported by this server (only null)")
        return v

    @field_validator("echo")
    @classmethod
    def _check_echo(cls, v: bool) -> bool:
        _neutral("echo", v, False)
        return v

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, v: str | None) -> str | None:
        _neutral("suffix", v, "")
        return v

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        # `n` (a shared field) is validated before this one; when `n` itself is invalid its
        # own error is the one to report.
        n = info.data.get("n")
        if v is not None and n is not None and v != n:
            raise ValueError(f"best_of={v} is not supported (only best_of == n)")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) of this request, one entry per engine request."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # Parts joined by newlines, as vLLM's chat_utils renders a list of text parts.
        return "\n".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, v: bool | None) -> bool | None:
        # True asks for the chosen tokens' logprobs, which the engine does not compute.
        _neutral("logprobs", v, False)
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, v: int | None) -> int | None:
        # 0 asks for no alternatives, and without logprobs=true nothing is returned (vLLM).
        _neutral("top_logprobs", v, 0)
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The output-budget field this request sent, for errors to name it."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


# --- responses -----------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


def new_id(prefix: str) -> str:
    """An OpenAI-style object id (`cmpl-...`, `chatcmpl-...`)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason | None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(_Response):
    """A streamed message delta; unset keys are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "headroom"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """OpenAI's error envelope: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo
