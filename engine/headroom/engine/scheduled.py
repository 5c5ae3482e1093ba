"""What the scheduler hands the model runner for one step: the sequences scheduled, each with
the token range to compute, and the block copies to apply first. Plain data, no policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from headroom.engine.sequence import Sequence


class ScheduledSeq:
    """Compute `seq.all_token_ids[start:start + num_new_tokens]` at those positions.

    `sample` is fixed at construction (computed unless given): the chunk ends at the last known
    token, so the engine samples the next token from its logits. A plain slotted class rather
    than a dataclass because the scheduler builds one per sequence per step.
    """

    __slots__ = ("num_new_tokens", "sample", "seq", "start")

    def __init__(
        self, seq: Sequence, start: int, num_new_tokens: int, sample: bool | None = None
    ) -> None:
        self.seq = seq
        self.start = start
        self.num_new_tokens = num_new_tokens
        if sample is None:
            sample = start + num_new_tokens == len(seq.all_token_ids)
        self.sample = sample

    def __repr__(self) -> str:
        return (
            f"ScheduledSeq(seq_id={self.seq.seq_id}, start={self.start}, "
            f"num_new_tokens={self.num_new_tokens}, sample={self.sample})"
        )

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """One new token that is also the last: a single-query step over the cached context."""
        return self.num_new_tokens == 1 and self.sample

    @property
    def token_ids(self) -> list[int]:
        return self.seq.all_token_ids[self.start : self.start + self.num_new_tokens]

    @property
    def context_len(self) -> int:
        """Tokens of context after this step (the attention backends' `seq_lens`)."""
        return self.start + self.num_new_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """One step: prefills first, then decodes, in `scheduled`.

    `blocks_to_copy` are copy-on-write `(src, dst)` pairs the engine applies to every layer's
    cache before running the step. `forked` holds children `fork()` attached to this step;
    they ride on their parent's computation (no logits rows of their own).
    """

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    forked: list[ScheduledSeq] = field(default_factory=list)
    num_prefills: int = 0

    @property
    def prefills(self) -> list[ScheduledSeq]:
        return self.scheduled[: self.num_prefills]

    @property
    def decodes(self) -> list[ScheduledSeq]:
        return self.scheduled[self.num_prefills :]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
