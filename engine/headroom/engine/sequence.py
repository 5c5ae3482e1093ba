"""One generation stream: its tokens, its KV blocks and how far its KV has been computed."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from headroom.engine.prefix_cache import ROOT_REF

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """A prompt and its generated tokens; the scheduler owns `block_table` and the counters.

    Identity equality (`eq=False`): two sequences with the same tokens are still two streams.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache; the next step computes from here.
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache at the last admission.
    num_cached_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    # Mixed into every block hash so different models/adapters never share KV.
    extra_key: str | None = None
    parent_seq_id: int | None = None
    # Chained content hashes of the full blocks of `all_token_ids` computed so far. They depend
    # on tokens only, so they survive preemption and are never recomputed.
    block_hashes: list[int] = field(default_factory=list)
    # How many leading blocks of `block_table` have been offered to the prefix cache, and the
    # prefix-cache ref standing for the last of them (None: a hash collision broke the chain).
    num_registered_blocks: int = 0
    cache_parent_ref: int | None = ROOT_REF
    # Prompt then output tokens, kept in step by `append_token` (read it, do not mutate it).
    all_token_ids: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    @classmethod
    def new(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        extra_key: str | None = None,
    ) -> Sequence:
        """A waiting sequence with a fresh process-unique `seq_id`."""
        return cls(
            seq_id=next(_seq_ids),
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            max_tokens=max_tokens,
            extra_key=extra_key,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.all_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Record one sampled token."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def clone(self) -> Sequence:
        """A copy with a fresh `seq_id` and `parent_seq_id` set; the caller shares the blocks."""
        child = Sequence(
            seq_id=next(_seq_ids),
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            max_tokens=self.max_tokens,
            output_token_ids=list(self.output_token_ids),
            block_table=list(self.block_table),
            num_computed_tokens=self.num_computed_tokens,
            num_cached_tokens=self.num_cached_tokens,
            status=self.status,
            arrival_time=self.arrival_time,
            extra_key=self.extra_key,
            parent_seq_id=self.seq_id,
            block_hashes=list(self.block_hashes),
            num_registered_blocks=self.num_registered_blocks,
            cache_parent_ref=self.cache_parent_ref,
        )
        return child
