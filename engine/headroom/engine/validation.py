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
    prompt_len: int, max_tokens: int | None, max_model_len: int, *, where: str = "prompt"
) -> int:
    """The output budget: `max_tokens` as asked (None: all the room left), checked to fit
    `max_model_len` together with the prompt."""
    if max_tokens is not None and max_tokens < 1:
        raise RequestRejected(
            f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens"
        )
    if prompt_len >= max_model_len:
        raise RequestRejected(
            f"{where} has {prompt_len} tokens, leaving no room to generate within "
            f"max_model_len {max_model_len}",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise RequestRejected(
            f"{where} {prompt_len} + max_tokens {max_tokens} = {prompt_len + max_tokens} "
            f"tokens exceeds max_model_len {max_model_len}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens
