"""What the scheduler hands the model runner for one step: the sequences scheduled, each with
the token range to compute, and the block copies to apply first. Plain data, no policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from headroom.engine.sequence import Sequence


@dataclass(slots=True, eq=False)
class ScheduledSeq:
    """Compute `seq.all_token_ids[start:start + num_new_tokens]` at those positions; `sample`:
    the chunk ends at the last known token, so the engine samples the next one from it."""

    seq: Sequence
    start: int
    num_new_tokens: int
    sample: bool = field(init=False)

    def __post_init__(self) -> None:
        self.sample = self.start + self.num_new_tokens == len(self.seq.all_token_ids)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """One new token that is also the last: a single-query step over the cached context."""
        return self.num_new_tokens == 1 and self.sample


@dataclass(slots=True)
class SchedulerOutput:
    """One step: prefill chunks, then decodes. `blocks_to_copy` are copy-on-write `(src, dst)`
    pairs the engine applies to every layer's cache before running the step."""

    prefills: list[ScheduledSeq] = field(default_factory=list)
    decodes: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, entry: ScheduledSeq) -> None:
        (self.decodes if entry.is_decode else self.prefills).append(entry)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.prefills + self.decodes

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.prefills) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not (self.prefills or self.decodes)
