"""What `headroom load` sends: request count or duration, a concurrency schedule, length
distributions and a shared-prefix mix, turned into concrete prompts.

Lengths are in tokens of the target server's tokenizer. Prompts are text (so any
OpenAI-compatible server accepts them, chat endpoints included) made of common English words;
the client measures the server's tokens per word once before the run (see
`client.calibrate_tokens_per_word`) and sizes prompts with it. A request drawn into the
shared-prefix fraction starts with one fixed `prefix_len`-token prefix (a system prompt) followed
by its own `prompt_len`-token part; every other request is unique from its first word.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Short, frequent words: one BPE token each (with the leading space) in the Llama, Mistral,
# Qwen and GPT vocabularies, a handful of bytes in a byte-level one.
_WORD_TEXT = """
the of and to in is that for it as was with be by on not he this are or his from at which but
have an they you were her she there one all we their has been if more when will would who so no
out up into do than can only other new some could time these two may first then any like now my
such make over our even most made after also did many off before must well back through years
much where your way down should because each just those people how too little state good very
world still own see men work long get here between both life being under never day same another
know while last might us great old year come since against go came right used take three small
large next early young important few public bad able
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LengthDist(_Spec):
    """A token-length distribution: `fixed` at `mean`, or `uniform`/`normal`/`exponential`
    around it (`spread` is the half-width of uniform and the std of normal, as a fraction of the
    mean). Draws are clamped to [1, max]."""

    kind: Literal["fixed", "uniform", "normal", "exponential"] = "fixed"
    mean: int = Field(ge=1)
    spread: float = Field(default=0.5, ge=0.0, le=1.0)
    max: int | None = Field(default=None, ge=1)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            x = float(self.mean)
        elif self.kind == "uniform":
            x = rng.uniform(self.mean * (1 - self.spread), self.mean * (1 + self.spread))
        elif self.kind == "normal":
            x = rng.gauss(self.mean, self.mean * self.spread)
        else:
            x = rng.expovariate(1 / self.mean)
        hi = self.max if self.max is not None else max(self.mean * 8, 1)
        return int(min(max(1, round(x)), hi))


class WorkloadSpec(_Spec):
    """A whole run. Exactly one of `num_requests` and `duration_s` bounds it; with `ramp_to`
    the concurrency steps linearly from `concurrency` to `ramp_to` over `ramp_s` seconds
    (default: `duration_s`): |ramp_to - concurrency| + 1 levels, each held for an equal share
    of the ramp, so `ramp_to` itself is held for the last share too."""

    num_requests: int | None = Field(default=None, ge=1)
    duration_s: float | None = Field(default=None, gt=0)
    concurrency: int = Field(default=8, ge=1, le=4096)
    ramp_to: int | None = Field(default=None, ge=1, le=4096)
    ramp_s: float | None = Field(default=None, gt=0)
    prompt_len: LengthDist = LengthDist(mean=128)
    output_len: LengthDist = LengthDist(mean=64)
    shared_prefix_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    prefix_len: int = Field(default=0, ge=0)
    disconnect_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> WorkloadSpec:
        if (self.num_requests is None) == (self.duration_s is None):
            raise ValueError("give exactly one of num_requests and duration_s")
        if self.shared_prefix_fraction > 0 and self.prefix_len == 0:
            raise ValueError("shared_prefix_fraction > 0 needs prefix_len > 0")
        if self.ramp_to is not None and self.ramp_s is None and self.duration_s is None:
            raise ValueError("a ramp over a request count needs ramp_s")
        return self

    @property
    def max_concurrency(self) -> int:
        return max(self.concurrency, self.ramp_to or 0)

    @property
    def ramp_seconds(self) -> float:
        return self.ramp_s or self.duration_s or 0.0

    def concurrency_at(self, t: float) -> int:
        """Target concurrency `t` seconds into the run (integer steps along the ramp).

        The ramp's span+1 levels (start and end included) each get 1/(span+1) of the ramp, so
        a ramp as long as the run (the default) spends its last share at `ramp_to`; flooring
        span*t/ramp would reach `ramp_to` only at the ramp's end, when a run stops sending."""
        if self.ramp_to is None or self.ramp_seconds <= 0:
            return self.concurrency
        frac = min(1.0, max(0.0, t / self.ramp_seconds))
        span = self.ramp_to - self.concurrency
        step = min(abs(span), math.floor((abs(span) + 1) * frac))
        return self.concurrency + step if span >= 0 else self.concurrency - step


@dataclass(slots=True, frozen=True)
class RequestSpec:
    """One request: its text, the tokens it was sized to and its output budget."""

    index: int
    prompt: str
    prompt_tokens: int
    max_tokens: int
    shared_prefix: bool
    # The client hangs up after this many streamed text chunks (one token each from vLLM and
    # `headroom serve`); 0: right after the response headers, before any token. None: it reads
    # to the end.
    disconnect_after: int | None = None


class PromptFactory:
    """Builds prompt text of a target token length from a tokens-per-word ratio."""

    def __init__(self, spec: WorkloadSpec, tokens_per_word: float) -> None:
        if tokens_per_word <= 0:
            raise ValueError(f"tokens_per_word must be > 0, got {tokens_per_word}")
        self.spec = spec
        self.tokens_per_word = tokens_per_word
        self._rng = random.Random(spec.seed)
        # A stream of its own, so turning disconnects on does not change the prompts drawn.
        self._hangups = random.Random(spec.seed ^ 0xD15C)
        prefix_rng = random.Random(spec.seed ^ 0x5EED)
        self.prefix = self._words(spec.prefix_len, prefix_rng) if spec.prefix_len else ""

    def _words(self, tokens: int, rng: random.Random) -> str:
        n = max(1, round(tokens / self.tokens_per_word))
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def make(self, index: int) -> RequestSpec:
        """The `index`-th request; the same spec and ratio always give the same sequence."""
        rng = self._rng
        shared = self.spec.shared_prefix_fraction > 0 and (
            rng.random() < self.spec.shared_prefix_fraction
        )
        own = self.spec.prompt_len.sample(rng)
        max_tokens = self.spec.output_len.sample(rng)
        text = self._words(own, rng)
        hangup = None
        if self.spec.disconnect_fraction > 0 and (
            self._hangups.random() < self.spec.disconnect_fraction
        ):
            hangup = self._hangups.randrange(max_tokens)  # 0: before the first token
        if shared:
            return RequestSpec(index, f"{self.prefix} {text}", self.spec.prefix_len + own,
                               max_tokens, True, hangup)  # fmt: skip
        return RequestSpec(index, text, own, max_tokens, False, hangup)
