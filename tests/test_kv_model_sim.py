"""A stand-in for the model that makes KV bookkeeping errors visible, and its own tests.

`KVSimulator` keeps one int per physical slot. Computing position p stores
hash((kv[p-1], token[p])), reading kv[p-1] back through the block table, so like real KV a
slot's value depends on the whole prefix: a wrong prefix hit, a missing copy-on-write or a bad
slot mapping changes every later value, the check at sampling time, and the sampled token.
Other test_kv_* modules import it (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import random

import pytest

from headroom.engine.block_table import slot_mapping
from headroom.engine.config import EngineConfig
from headroom.engine.scheduled import SchedulerOutput
from headroom.engine.scheduler import Scheduler
from headroom.engine.sequence import Sequence, SequenceStatus

VOCAB = 50


class CacheCorrupted(AssertionError):
    pass


def reference_kv(tokens: list[int]) -> list[int]:
    """What the slots of a correctly cached sequence hold."""
    out: list[int] = []
    prev = 0
    for t in tokens:
        prev = hash((prev, t))
        out.append(prev)
    return out


class KVSimulator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)

    def read(self, seq: Sequence, upto: int) -> list[int | None]:
        """The KV of positions 0..upto-1 as seen through the sequence's block table."""
        return [self.slots[s] for s in slot_mapping(seq, 0, upto, self.block_size)]

    def check(self, seq: Sequence, upto: int) -> None:
        got = self.read(seq, upto)
        want = reference_kv(seq.all_token_ids[:upto])
        if got != want:
            bad = next(i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
            raise CacheCorrupted(
                f"seq {seq.seq_id}: KV at position {bad} is wrong (table {seq.block_table})"
            )

    def run(self, out: SchedulerOutput) -> dict[int, int]:
        """Apply copies, write every chunk's KV, check and return seq_id -> last KV value for
        the entries that sample (the 'logits')."""
        bs = self.block_size
        for src, dst in out.blocks_to_copy:
            self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]
        logits: dict[int, int] = {}
        for e in out.scheduled:
            seq = e.seq
            tokens = seq.all_token_ids
            prev: int | None = 0
            if e.start:
                prev = self.slots[slot_mapping(seq, e.start - 1, 1, bs)[0]]
                if prev is None:
                    raise CacheCorrupted(f"seq {seq.seq_id}: context slot {e.start - 1} empty")
            for p, slot in zip(
                range(e.start, e.end), slot_mapping(seq, e.start, e.num_new_tokens, bs), strict=True
            ):
                prev = hash((prev, tokens[p]))
                self.slots[slot] = prev
            if e.sample:
                assert prev is not None
                logits[seq.seq_id] = prev
        # Checked after all writes: a chunk of one sequence must not clobber another's KV.
        for e in out.scheduled:
            if e.sample:
                self.check(e.seq, e.end)
        return logits


def sample(kv: int, salt: int = 0) -> int:
    return (kv + salt) % VOCAB


def drive(sched: Scheduler, sim: KVSimulator, max_steps: int = 100_000) -> int:
    """Run to completion with the simulator as the model; returns the number of steps."""
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        logits = sim.run(out)
        sched.update(out, {sid: sample(kv) for sid, kv in logits.items()})
        steps += 1
        if steps > max_steps:
            raise AssertionError(f"no completion after {max_steps} steps")
    return steps


def random_prompts(rng: random.Random, n: int, shared: list[int], max_len: int) -> list[list[int]]:
    """Prompts that often start with `shared` (a system prompt) so prefix hits happen."""
    prompts = []
    for _ in range(n):
        head = shared[: rng.randrange(len(shared) + 1)] if rng.random() < 0.7 else []
        tail = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, max_len))]
        prompts.append(head + tail)
    return prompts


# -- the simulator's own tests: it must catch the bugs the other tests rely on it to catch --


def _one_step(block_size: int = 4) -> tuple[Scheduler, KVSimulator, Sequence]:
    cfg = EngineConfig(num_blocks=8, block_size=block_size, max_model_len=32)
    sched = Scheduler(cfg)
    sim = KVSimulator(8, block_size)
    seq = Sequence("r", [1, 2, 3, 4, 5, 6], max_tokens=4)
    sched.add(seq)
    out = sched.schedule()
    logits = sim.run(out)
    sched.update(out, {k: sample(v) for k, v in logits.items()})
    return sched, sim, seq


def test_simulator_accepts_a_correct_run() -> None:
    _, sim, seq = _one_step()
    sim.check(seq, seq.num_computed_tokens)
    assert sim.read(seq, 6) == reference_kv([1, 2, 3, 4, 5, 6])


def test_simulator_detects_a_wrong_block_table() -> None:
    sched, sim, seq = _one_step()
    seq.block_table[0], seq.block_table[1] = seq.block_table[1], seq.block_table[0]
    with pytest.raises(CacheCorrupted):
        sim.check(seq, 6)
    out = sched.schedule()
    with pytest.raises(CacheCorrupted):
        sim.run(out)


def test_simulator_detects_a_skipped_copy() -> None:
    sched, sim, seq = _one_step()
    sched.add(Sequence("r", seq.prompt_token_ids, 4, sibling_of=seq))
    out = sched.schedule()
    assert out.blocks_to_copy, "the shared partial block must be copied before writing to it"
    out.blocks_to_copy.clear()
    with pytest.raises(CacheCorrupted):
        sim.run(out)


def test_drive_runs_a_small_trace_to_completion() -> None:
    rng = random.Random(1)
    cfg = EngineConfig(num_blocks=24, block_size=4, max_model_len=64, max_num_batched_tokens=16)
    sched = Scheduler(cfg)
    sim = KVSimulator(24, 4)
    seqs = [Sequence(f"r{i}", p, 5) for i, p in enumerate(random_prompts(rng, 12, [7] * 9, 20))]
    for s in seqs:
        sched.add(s)
    drive(sched, sim)
    assert all(s.status is SequenceStatus.FINISHED and len(s.output_token_ids) == 5 for s in seqs)
