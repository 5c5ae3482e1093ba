"""What the engine hands back per step: deltas per completion, grouped per request.

Streaming (`Engine.step`, `AsyncEngine.stream`) yields deltas: `text` and `token_ids` hold only
what is new since the previous output of that completion, and `outputs` lists only the
completions that changed. `Engine.generate` returns one merged output per request where
`text`/`token_ids` are the whole completion. An `AsyncEngine` stream whose consumer falls
behind gets the deltas it missed folded into one, so a delta may span several steps. Times
are unix seconds. The engine builds these without re-validation and `prompt_token_ids` is
shared with the engine: read, do not mutate.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length", "abort"]


class CompletionOutput(BaseModel):
    """One completion (`index` of the request's n) at one step."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0)
    text: str = Field(default="", description="new text (stop strings excluded)")
    token_ids: list[int] = Field(default_factory=list, description="new token ids")
    cumulative_text: str | None = Field(
        default=None,
        description="all the completion's text: set on its final output only (and by merge)",
    )
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = Field(
        default=None, description="the stop string or stop token id that ended it"
    )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(BaseModel):
    """A request's progress; `finished` once every completion has a finish_reason."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = Field(
        default=0, ge=0, description="prompt tokens from the prefix cache"
    )
