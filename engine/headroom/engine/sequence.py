"""One generation stream: its tokens, its KV blocks and how far its KV has been computed."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from headroom.engine.prefix_cache import ROOT_REF

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """A prompt and its generated tokens; the scheduler and the KV manager own `block_table`
    and the counters. Identity equality: two sequences with the same tokens are two streams.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    # Mixed into every block hash so different models/adapters never share KV.
    extra_key: str | None = None
    # The first completion of the same request (n > 1): this one shares its prompt's KV.
    sibling_of: Sequence | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache; the next step computes from here.
    num_computed_tokens: int = 0
    # Prompt tokens found already computed (prefix cache or sibling) at the last admission.
    num_cached_tokens: int = 0
    # Counted in the prefix cache's lookup counters: done at the first admission only, so a
    # preempted sequence's re-admission (its output and its own recomputed blocks) is not.
    prefix_counted: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    # Chained content hashes of the full blocks of `all_token_ids` computed so far. They depend
    # on tokens only, so they survive preemption and are never recomputed.
    block_hashes: list[int] = field(default_factory=list)
    # How many leading blocks of `block_table` have been offered to the prefix cache, and the
    # prefix-cache ref standing for the last of them (None: a hash collision broke the chain).
    num_registered_blocks: int = 0
    cache_parent_ref: int | None = ROOT_REF
    # Prompt then output tokens, kept in step with `output_token_ids` (read it, do not mutate).
    all_token_ids: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
