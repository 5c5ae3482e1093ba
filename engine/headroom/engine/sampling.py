"""Sampling parameters (validated at the boundary) and the sampler.

Every completion owns a `torch.Generator`: seeded from (`seed`, completion index) when the
request gives a seed, otherwise from the engine's seeded stream. Draws never come from a
shared generator, so a seeded request samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

_SEED_MASK = (1 << 63) - 1
# Below this a temperature is greedy, as in vLLM: logits / 1e-300 overflow fp32 to inf, and the
# softmax of that is NaN, which would fail the whole batch's step.
SAMPLING_EPS = 1e-5
MAX_STOP_TOKEN_IDS = 256  # each sampled token is looked up in the list, on the engine's thread


class SamplingParams(BaseModel):
    """How to sample one request; `temperature` 0 is greedy, `top_k` 0 or -1 is off."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(default=1, ge=1, le=128, description="completions per prompt")
    max_tokens: int = Field(default=16, ge=1, description="tokens to generate at most")
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, description="0 or -1: no top-k filter")
    seed: int | None = Field(default=None, description="per-request seed for reproducibility")
    stop: list[str] = Field(default_factory=list, description="strings that end a completion")
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_nonnegative(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def completion_seed(seed: int, index: int) -> int:
    """The generator seed of completion `index` of a request seeded with `seed`."""
    return (seed * 1_000_003 + index * 7_919 + 1) & _SEED_MASK


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A private generator for one completion."""
    return torch.Generator(device=device).manual_seed(seed)


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """One token from fp32 `logits` `[vocab]`: greedy, or temperature / top-k / top-p."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scaled = logits.float() / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop tokens once the mass before them already reaches top_p; the top one always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop[0] = False  # a top_p that rounds to 0 in fp32 would otherwise drop every token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_logits)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of `logits` `[rows, vocab]`, greedy rows in one argmax."""
    if not params:
        return []
    if all(p.greedy for p in params):
        return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
    return [
        sample_token(logits[i], p, g)
        for i, (p, g) in enumerate(zip(params, generators, strict=True))
    ]
