"""Request bookkeeping: an API request with `n` completions fans out before the core into `n`
sequences (vLLM's ParentRequest), the second and later sharing the first one's prompt KV
(see `KVManager.computed_blocks`); the engine maps each sampled token back to its completion
and builds the request's `RequestOutput` deltas here."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from headroom.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from headroom.engine.outputs import CompletionOutput, FinishReason, RequestOutput
from headroom.engine.sampling import SamplingParams, completion_seed, make_generator
from headroom.engine.sequence import Sequence


@dataclass(slots=True, eq=False)
class Completion:
    """One of a request's `n` completions: its sequence, sampler, text and what was emitted."""

    index: int
    seq_id: int
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted_tokens: int = 0
    emitted_text: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass(slots=True, eq=False)
class Request:
    """An API request and its completions."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    completions: list[Completion] = field(default_factory=list)
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def output(self, comps: list[Completion], finished: bool) -> RequestOutput:
        """The delta of `comps` since their last output; text that could still turn out to be
        the start of a stop string is held back until the completion finishes. Only a
        completion's final output carries `cumulative_text`."""
        outs = []
        hold = self.params.max_stop_len - 1 if self.params.stop else 0
        for comp in sorted(comps, key=lambda c: c.index):
            end = len(comp.text)
            if comp.finish_reason is None:
                end = max(comp.emitted_text, end - hold)
            outs.append(
                CompletionOutput.model_construct(
                    index=comp.index,
                    text=comp.text[comp.emitted_text : end],
                    token_ids=comp.token_ids[comp.emitted_tokens :],
                    # Not on every delta: a stalled stream would hold a copy of the whole
                    # text per queued step (quadratic). At the end it is `comp.text` itself.
                    cumulative_text=None if comp.finish_reason is None else comp.text,
                    finish_reason=comp.finish_reason,
                    stop_reason=comp.stop_reason,
                )
            )
            comp.emitted_text, comp.emitted_tokens = end, len(comp.token_ids)
        # model_construct: these are the engine's own values, and validating a long prompt's
        # ids on every step of every request would cost more than the step's bookkeeping.
        return RequestOutput.model_construct(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            finished=finished,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            finished_time=self.finished_time,
            num_cached_tokens=self.num_cached_tokens,
        )


def fan_out(req: Request, seed: int, tokenizer: Tokenizer, extra_key: str | None) -> list[Sequence]:
    """The `n` sequences of a request, the first one first, and their completions in `req`."""
    seqs: list[Sequence] = []
    params, ids = req.params, req.prompt_token_ids
    for index in range(params.n):
        first = seqs[0] if seqs else None
        seq = Sequence(req.request_id, ids, params.max_tokens, extra_key, sibling_of=first)
        gen = None if params.greedy else make_generator(completion_seed(seed, index))
        detok = IncrementalDetokenizer(tokenizer, ids)
        req.completions.append(Completion(index, seq.seq_id, gen, detok))
        seqs.append(seq)
    return seqs


def merge(into: RequestOutput, delta: RequestOutput) -> None:
    """Fold a later delta of the same request into `into` (whole texts and token ids)."""
    by_index = {c.index: c for c in into.outputs}
    for c in delta.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            prev = c.model_copy()
            into.outputs.append(prev)
        else:
            prev.text += c.text
            prev.token_ids.extend(c.token_ids)
            prev.finish_reason = c.finish_reason
            prev.stop_reason = c.stop_reason
        # `into` holds whole texts, so its text is the cumulative text (a delta carries
        # `cumulative_text` only on its completion's final output).
        prev.cumulative_text = prev.text
    into.outputs.sort(key=lambda c: c.index)
    into.finished = delta.finished
    into.first_token_time = delta.first_token_time
    into.finished_time = delta.finished_time
    into.num_cached_tokens = delta.num_cached_tokens
