"""The rules a request must meet before it is queued: owned here, by the engine; the server
calls the same functions and maps `RequestRejected` to an OpenAI error once."""

from __future__ import annotations

from collections.abc import Sequence

from headroom.engine.errors import RequestRejected


def check_prompt(ids: Sequence[int], vocab_size: int, *, where: str = "prompt") -> None:
    """A prompt must hold at least one token, each an id of the vocabulary."""
    if not ids:
        raise RequestRejected(f"{where} is empty", param="prompt", code="empty_prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestRejected(
            f"{where} token ids {bad[:5]} are outside the vocabulary of {vocab_size}",
            param="prompt",
            code="invalid_token_id",
        )


def resolve_max_tokens(
    prompt_len: int,
    max_tokens: int | None,
    max_model_len: int,
    *,
    where: str = "prompt",
    prompt_param: str = "prompt",
    max_tokens_param: str = "max_tokens",
) -> int:
    """The output budget: `max_tokens` as asked (None: all the room left), checked to fit
    `max_model_len` together with the prompt. `prompt_param` and `max_tokens_param` are the
    request fields a rejection names (a chat request sends `messages`, and may send
    `max_completion_tokens`)."""
    if max_tokens is not None and max_tokens < 1:
        raise RequestRejected(
            f"{max_tokens_param} must be at least 1, got {max_tokens}", param=max_tokens_param
        )
    if prompt_len >= max_model_len:
        raise RequestRejected(
            f"{where} has {prompt_len} tokens, leaving no room to generate within "
            f"max_model_len {max_model_len}",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise RequestRejected(
            f"{where} {prompt_len} + {max_tokens_param} {max_tokens} = "
            f"{prompt_len + max_tokens} tokens exceeds max_model_len {max_model_len}",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    return max_tokens
