"""The scheduler: admission, chunked prefill, decode, preemption, abort, n > 1 siblings, stats."""

from __future__ import annotations

import random
import time

import pytest
from test_kv_model_sim import VOCAB, KVSimulator, drive, random_prompts, sample

from headroom.engine.config import EngineConfig
from headroom.engine.errors import RequestRejected
from headroom.engine.kv_manager import KVManager
from headroom.engine.prefix_cache import PrefixCache
from headroom.engine.scheduled import SchedulerOutput
from headroom.engine.scheduler import Scheduler
from headroom.engine.sequence import Sequence, SequenceStatus
from headroom.engine.stats import scheduler_stats


def make(**kw: object) -> tuple[Scheduler, KVSimulator]:
    values: dict[str, object] = {"num_blocks": 64, "block_size": 4, "max_model_len": 256}
    values.update(kw)
    sched = Scheduler(EngineConfig.model_validate(values))
    return sched, KVSimulator(sched.num_blocks, sched.config.block_size)


def step(sched: Scheduler, sim: KVSimulator) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, {k: sample(v) for k, v in sim.run(out).items()})
    return out


def seq(prompt_len: int, max_tokens: int = 4, start: int = 0) -> Sequence:
    return Sequence(f"r{start}", [(start + i) % VOCAB for i in range(prompt_len)], max_tokens)


# -- configuration and rejection ---------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_blocks", 0),
        ("block_size", 0),
        ("max_model_len", 0),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("watermark", 1.0),
        ("watermark", -0.1),
        ("no_such_field", 1),
    ],
)
def test_bad_config_raises_value_error_naming_the_field(field: str, value: object) -> None:
    values: dict[str, object] = {"num_blocks": 8, "max_model_len": 64, field: value}
    with pytest.raises(ValueError, match=field):
        EngineConfig.model_validate(values)


def test_the_scheduler_needs_the_pool_size_resolved() -> None:
    with pytest.raises(ValueError, match="num_blocks and max_model_len"):
        Scheduler(EngineConfig(max_model_len=64))


def test_requests_that_can_never_fit_are_rejected_with_the_numbers() -> None:
    sched, _ = make(num_blocks=10, block_size=16, max_model_len=1024)
    with pytest.raises(RequestRejected) as e:
        sched.add(Sequence("a", [1] * 900, 200))
    assert e.value.reason == (
        "prompt 900 + max_tokens 200 = 1100 tokens exceeds max_model_len 1024"
    )
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(RequestRejected, match=r"11 KV blocks of 16 tokens .* holds 10") as e:
        sched.add(Sequence("b", [1] * 151, 11))
    assert e.value.reason.startswith("prompt 151 + max_tokens 11 needs the KV of 161 tokens")
    assert (e.value.param, e.value.code) == ("max_tokens", "exceeds_kv_pool")
    with pytest.raises(RequestRejected, match="empty"):
        sched.add(Sequence("c", [], 10))
    with pytest.raises(RequestRejected, match="max_tokens must be at least 1"):
        sched.add(Sequence("d", [1], 0))
    ok = Sequence("e", [1] * 150, 10)
    sched.add(ok)
    with pytest.raises(RequestRejected, match="already added"):
        sched.add(ok)
    assert len(sched.waiting) == 1 and sched.kv.pool.num_used == 0


@pytest.mark.parametrize(("prompt_len", "max_tokens"), [(16, 1), (151, 10), (1, 160)])
def test_a_request_whose_kv_fills_the_pool_exactly_is_admitted_and_runs(
    prompt_len: int, max_tokens: int
) -> None:
    # The last sampled token is never fed back: prompt + max_tokens - 1 positions take KV.
    bs, pool = 16, -(-(prompt_len + max_tokens - 1) // 16)
    sched, sim = make(num_blocks=pool, block_size=bs, max_model_len=1024)
    s = seq(prompt_len, max_tokens)
    sched.add(s)  # was rejected as needing one block more than the pool
    most = 0
    while sched.has_unfinished():
        out = sched.schedule()
        most = max(most, len(s.block_table))
        sched.update(out, {k: sample(v) for k, v in sim.run(out).items()})
    assert len(s.output_token_ids) == max_tokens and s.status is SequenceStatus.FINISHED
    assert most == pool and sched.preemptions_total == 0


def test_a_finished_sequence_cannot_be_added_again() -> None:
    sched, sim = make()
    s = seq(5, 2)
    sched.add(s)
    drive(sched, sim)
    with pytest.raises(RequestRejected, match="finished"):
        sched.add(s)


# -- batching ----------------------------------------------------------------------------


def test_long_prompts_prefill_in_chunks_under_the_token_budget() -> None:
    sched, sim = make(max_num_batched_tokens=32)
    s = seq(100, max_tokens=2)
    sched.add(s)
    chunks = []
    while not s.output_token_ids:
        out = step(sched, sim)
        (e,) = out.scheduled
        chunks.append((e.start, e.num_new_tokens, e.sample))
        assert len(s.block_table) == -(-e.end // 4), "blocks are allocated chunk by chunk"
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert s.num_computed_tokens == 100


def test_decodes_keep_running_while_a_long_prompt_prefills() -> None:
    sched, sim = make(max_num_batched_tokens=16, num_blocks=128)
    short = [seq(3, max_tokens=30, start=i) for i in range(4)]
    for s in short:
        sched.add(s)
    step(sched, sim)  # all four prefill in one step
    long = seq(60, max_tokens=2, start=40)
    sched.add(long)
    for _ in range(5):
        out = step(sched, sim)
        assert out.num_batched_tokens <= 16
        assert [e.seq for e in out.decodes] == short, "every running decode, every step"
        assert [e.seq for e in out.prefills] == [long]
        assert out.prefills[0].num_new_tokens == 12  # the budget less one token per decode
        assert out.scheduled == out.prefills + out.decodes


def test_admissions_share_the_steps_token_budget() -> None:
    # Each admission spends its chunk of the budget: the next one gets what is left, chunked.
    sched, sim = make(max_num_batched_tokens=16)
    a, b, c = (seq(10, max_tokens=2, start=20 * i) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    out = step(sched, sim)
    assert [(e.seq, e.num_new_tokens) for e in out.scheduled] == [(a, 10), (b, 6)]
    assert out.num_batched_tokens == 16 and c.status is SequenceStatus.WAITING


def test_a_budget_of_one_token_per_step_still_runs_every_request() -> None:
    # The smallest budget: one prompt token per step, then one decode per step each.
    sched, sim = make(max_num_batched_tokens=1)
    a, b = seq(3, max_tokens=2), seq(2, max_tokens=2, start=10)
    sched.add(a)
    sched.add(b)
    assert drive(sched, sim, max_steps=20) == (3 + 1) + (2 + 1)  # prompt tokens, a decode
    assert len(a.output_token_ids) == len(b.output_token_ids) == 2


def test_max_num_seqs_caps_the_running_set() -> None:
    sched, sim = make(max_num_seqs=3)
    for i in range(5):
        sched.add(seq(4, max_tokens=3, start=i))
    out = step(sched, sim)
    assert len(out.scheduled) == 3 and len(sched.running) == 3 and len(sched.waiting) == 2
    drive(sched, sim)
    assert sched.kv.pool.num_used == 0


def test_the_watermark_keeps_blocks_free_for_running_decodes() -> None:
    sched, sim = make(num_blocks=20, block_size=4, watermark=0.25)  # 5 blocks held back
    first = Sequence("a", [1] * 40, 4)  # 10 blocks
    sched.add(first)
    step(sched, sim)
    second = Sequence("b", [2] * 24, 4)  # 6 blocks: first holds 11, 11 + 6 > 20 - 5
    sched.add(second)
    out = step(sched, sim)
    assert [e.seq for e in out.scheduled] == [first]
    assert second.status is SequenceStatus.WAITING
    third = Sequence("c", [3] * 8, 1)  # 2 blocks would fit, but second came first
    sched.add(third)
    assert [e.seq for e in step(sched, sim).scheduled] == [first], "first come, first served"
    drive(sched, sim)
    assert all(s.status is SequenceStatus.FINISHED for s in (first, second, third))


def test_a_waiting_sequence_that_fills_the_whole_pool_is_admitted_when_it_is_alone() -> None:
    sched, sim = make(num_blocks=10, block_size=4, max_model_len=40, watermark=0.5)
    s = seq(36, max_tokens=4)
    sched.add(s)
    drive(sched, sim)
    assert s.status is SequenceStatus.FINISHED and len(s.output_token_ids) == 4


# -- preemption ---------------------------------------------------------------------------


def run_trace(
    num_blocks: int, prompts: list[list[int]], max_tokens: list[int], **kw: object
) -> tuple[Scheduler, list[Sequence], int]:
    sched, sim = make(num_blocks=num_blocks, **kw)
    seqs = [
        Sequence(f"r{i}", p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    for s in seqs:
        sched.add(s)
    steps = drive(sched, sim, max_steps=20_000)
    return sched, seqs, steps


@pytest.mark.parametrize("caching", [True, False])
def test_a_tiny_pool_preempts_yet_every_request_finishes_with_the_same_output(
    caching: bool,
) -> None:
    rng = random.Random(3)
    prompts = random_prompts(rng, 30, [rng.randrange(VOCAB) for _ in range(12)], 20)
    max_tokens = [rng.randrange(1, 24) for _ in prompts]
    roomy, ref, _ = run_trace(512, prompts, max_tokens, enable_prefix_caching=caching)
    assert roomy.preemptions_total == 0
    tiny, got, _ = run_trace(
        14, prompts, max_tokens, enable_prefix_caching=caching, max_num_batched_tokens=24
    )
    assert tiny.preemptions_total > 0
    assert scheduler_stats(tiny).preemptions_total == tiny.preemptions_total
    assert all(s.status is SequenceStatus.FINISHED for s in got)
    # Recompute after preemption reproduces exactly what an unpressured run generated.
    assert [s.output_token_ids for s in got] == [s.output_token_ids for s in ref]
    assert tiny.kv.pool.num_used == 0


def test_the_most_recently_admitted_sequence_is_preempted_and_requeued_first() -> None:
    sched, sim = make(num_blocks=6, block_size=4, max_model_len=24, watermark=0.0)
    a, b, c = (seq(7, max_tokens=12, start=10 * i) for i in range(3))  # 2 blocks each
    for s in (a, b, c):
        sched.add(s)
    step(sched, sim)
    assert sched.running == [a, b, c] and sched.kv.pool.num_available == 0
    waiting = seq(3, max_tokens=2, start=90)
    sched.add(waiting)
    step(sched, sim)  # position 8: a new block for everyone
    out = sched.schedule()
    assert out.preempted == [c] and sched.preemptions_total == 1
    assert list(sched.waiting) == [c, waiting]
    assert c.status is SequenceStatus.WAITING and not c.block_table and c.num_computed_tokens == 0
    assert [e.seq for e in out.scheduled] == [a, b], "nothing is admitted right after"
    sched.update(out, {k: sample(v) for k, v in sim.run(out).items()})
    drive(sched, sim)
    assert all(
        s.status is SequenceStatus.FINISHED and len(s.output_token_ids) == s.max_tokens
        for s in (a, b, c)
    )


# -- abort, finish, update contract -------------------------------------------------------


def test_abort_frees_blocks_at_once_for_waiting_and_running_sequences() -> None:
    sched, sim = make(max_num_seqs=1)
    running, waiting = seq(10, 8), seq(10, 8, start=20)
    sched.add(running)
    sched.add(waiting)
    step(sched, sim)
    assert sched.kv.pool.num_used == 3
    assert sched.finish(running.seq_id)
    assert (
        sched.kv.pool.num_used == 0
        and running.status is SequenceStatus.FINISHED
        and not running.block_table
    )
    assert sched.finish(waiting.seq_id) and not sched.has_unfinished()
    assert not sched.finish(waiting.seq_id) and not sched.finish(12345)
    assert running.seq_id not in sched.seqs


def test_abort_while_the_step_runs_is_skipped_by_update() -> None:
    sched, sim = make()
    a, b = seq(6, 4), seq(6, 4, start=30)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    logits = sim.run(out)
    sched.finish(a.seq_id)
    sched.update(out, {k: sample(v) for k, v in logits.items()})
    assert not a.output_token_ids and b.output_token_ids
    assert sched.kv.pool.num_used == len(b.block_table)


def test_aborting_every_sibling_frees_every_block() -> None:
    sched, sim = make()
    first = seq(6, 4)
    sched.add(first)
    siblings = [Sequence(first.request_id, first.prompt_token_ids, 4, sibling_of=first)]
    sched.add(siblings[0])
    step(sched, sim)
    step(sched, sim)
    assert siblings[0].block_table[0] == first.block_table[0]
    assert all(sched.finish(s.seq_id) for s in (first, *siblings))
    assert not sched.has_unfinished() and sched.kv.pool.num_used == 0


def test_finish_keeps_full_blocks_cached_and_frees_the_rest() -> None:
    sched, sim = make(num_blocks=16, max_num_batched_tokens=64)
    s = seq(10, max_tokens=20)
    sched.add(s)
    step(sched, sim)
    step(sched, sim)
    assert s.num_computed_tokens == 11
    assert sched.finish(s.seq_id) and not sched.finish(s.seq_id)
    kv = scheduler_stats(sched).kv
    assert (kv.used, kv.cached, kv.free) == (0, 2, 14)


def test_update_finishes_sequences_at_max_tokens() -> None:
    sched, sim = make()
    s = seq(5, max_tokens=2)
    sched.add(s)
    step(sched, sim)
    out = sched.schedule()
    finished = sched.update(out, {k: sample(v) for k, v in sim.run(out).items()})
    assert finished == [s] and s.status is SequenceStatus.FINISHED and len(s.output_token_ids) == 2
    assert sched.kv.pool.num_used == 0 and not sched.finish(s.seq_id)


def test_update_checks_the_sampled_tokens_against_the_step() -> None:
    sched, _ = make()
    s = seq(5)
    sched.add(s)
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="before update"):
        sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update(out, {})
    with pytest.raises(ValueError, match="not sampling"):
        sched.update(out, {s.seq_id: 1, 999: 2})
    sched.update(out, {s.seq_id: 1})  # nothing was applied by the failed calls
    assert s.output_token_ids == [1] and s.num_computed_tokens == 5
    with pytest.raises(RuntimeError, match="not the step in flight"):
        sched.update(out, {s.seq_id: 1})


def test_an_empty_step_is_harmless() -> None:
    sched, _ = make()
    assert scheduler_stats(sched).last_step_schedule_seconds == 0.0, "no step planned yet"
    out = sched.schedule()
    assert out.is_empty and scheduler_stats(sched).steps_total == 0
    assert sched.update(out, {}) == []


# -- n > 1: siblings share the first one's prompt ----------------------------------------


def siblings(first: Sequence, n: int) -> list[Sequence]:
    return [
        Sequence(first.request_id, first.prompt_token_ids, first.max_tokens, sibling_of=first)
        for _ in range(n)
    ]


def test_siblings_share_the_prompt_blocks_then_copy_on_write() -> None:
    sched, sim = make(block_size=4)
    first = seq(6, max_tokens=5)  # blocks: one full, one with 2 of 4 slots used
    others = siblings(first, 2)
    for s in (first, *others):
        sched.add(s)
    out = step(sched, sim)
    assert [e.seq for e in out.scheduled] == [first], "the siblings wait for the prompt's KV"
    assert all(s.status is SequenceStatus.WAITING for s in others)
    out = sched.schedule()
    assert [e.seq for e in out.decodes] == [first, *others]
    # Each sibling computes only the prompt's last token, in a private copy of the shared
    # partial block: two of its three writers get a copy first.
    assert [(e.start, e.num_new_tokens) for e in out.decodes[1:]] == [(5, 1), (5, 1)]
    assert len(out.blocks_to_copy) == 2 and len({src for src, _ in out.blocks_to_copy}) == 1
    assert all(s.num_cached_tokens == 5 for s in others)
    logits = sim.run(out)
    sched.update(out, {k: sample(v, salt=k) for k, v in logits.items()})
    tails = {s.block_table[1] for s in [first, *others]}
    assert len(tails) == 3, "each sequence now writes its own last block"
    assert len({s.block_table[0] for s in [first, *others]}) == 1, "the full block stays shared"
    assert sched.kv.pool.ref_counts[first.block_table[0]] == 3
    drive(sched, sim)
    assert all(s.status is SequenceStatus.FINISHED for s in [first, *others])
    assert sched.kv.pool.num_used == 0


def test_a_sibling_whose_first_sibling_is_gone_computes_the_prompt_itself() -> None:
    sched, sim = make(block_size=4, enable_prefix_caching=False)
    first = seq(9, max_tokens=1)  # finishes in the step that computes the prompt
    (other,) = siblings(first, 1)
    sched.add(first)
    sched.add(other)
    step(sched, sim)
    assert first.status is SequenceStatus.FINISHED and other.status is SequenceStatus.WAITING
    out = step(sched, sim)
    assert [(e.seq, e.start, e.num_new_tokens) for e in out.scheduled] == [(other, 0, 9)]
    assert other.output_token_ids == first.output_token_ids


def test_a_sibling_joins_once_its_first_has_computed_all_but_the_prompts_last_token() -> None:
    # The siblings share the prompt less its last token (each computes that one itself), so a
    # chunk ending there is enough: the sibling joins in the step that finishes the prompt.
    sched, sim = make(block_size=4, max_num_batched_tokens=8)
    first = seq(9, max_tokens=3)
    (other,) = siblings(first, 1)
    sched.add(first)
    sched.add(other)
    step(sched, sim)
    assert first.num_computed_tokens == 8 and other.status is SequenceStatus.WAITING
    out = step(sched, sim)
    assert [(e.seq, e.start, e.num_new_tokens) for e in out.scheduled] == [
        (first, 8, 1),
        (other, 8, 1),
    ]
    assert other.num_cached_tokens == 8 and other.block_table[:2] == first.block_table[:2]
    assert not out.blocks_to_copy, "the shared blocks are full: nothing to copy"
    drive(sched, sim)
    assert other.output_token_ids == first.output_token_ids


@pytest.mark.parametrize(("prompt_len", "num_blocks"), [(6, 2), (3, 1)])
def test_a_sibling_waits_while_no_block_is_left_for_its_copy(
    prompt_len: int, num_blocks: int
) -> None:
    # The shared prompt ends in a partly filled block, so joining takes one block for the
    # sibling's private copy, even when the whole prompt fits in one block: a full pool waits.
    max_tokens = num_blocks * 4 - prompt_len + 1  # the first sibling fills the pool exactly
    sched, sim = make(num_blocks=num_blocks, block_size=4, max_model_len=16)
    first = seq(prompt_len, max_tokens=max_tokens)
    (other,) = siblings(first, 1)
    sched.add(first)
    sched.add(other)
    step(sched, sim)
    assert sched.kv.num_available == 0
    out = step(sched, sim)
    assert [e.seq for e in out.scheduled] == [first] and not out.blocks_to_copy
    assert other.status is SequenceStatus.WAITING
    drive(sched, sim)
    assert len(other.output_token_ids) == max_tokens and sched.kv.pool.num_used == 0


def test_a_shared_partial_last_block_is_copied_and_only_the_room_left_is_taken() -> None:
    # `allocate_slots` returns the tokens that fit: with a copy to make first, one block less.
    kv = KVManager(3, 4, None)
    first = Sequence("a", list(range(6)), 4)
    kv.admit(first, [], 0, 6, [])
    first.num_computed_tokens = 6
    other = Sequence("a", first.prompt_token_ids, 4, sibling_of=first)
    for b in first.block_table:  # as a sibling's admission leaves it before its first write
        kv.pool.share(b)
    other.block_table[:] = first.block_table
    other.num_computed_tokens = 5
    copies: list[tuple[int, int]] = []
    assert kv.allocate_slots(other, 8, copies) == 3  # the rest of its private copy, no more
    assert copies == [(1, 2)] and other.block_table == [0, 2] and first.block_table == [0, 1]
    assert kv.pool.ref_counts == [2, 1, 1] and kv.num_available == 0


def test_blocks_to_admit_counts_revived_blocks_the_private_copy_and_new_blocks() -> None:
    kv = KVManager(8, 4, PrefixCache(8))
    first = Sequence("a", list(range(6)), 8)
    kv.admit(first, [], 0, 6, [])
    first.num_computed_tokens = 6
    kv.cache_blocks(first)  # its full block 0 is findable
    # A sibling preempted after 3 outputs rejoins from the 5 shared prompt tokens: a copy of
    # the partly filled block 1, and a new block for position 8.
    assert kv.blocks_to_admit(first.block_table, 5, 4) == 2
    assert kv.blocks_to_admit(first.block_table[:1], 4, 1) == 1, "in use: no revival, 1 new"
    kv.free(first)
    # A repeat of the prompt hits block 0, parked now: reviving it takes a block of room too.
    assert kv.pool.num_cached == 1 and kv.blocks_to_admit([0], 4, 2) == 2


def test_a_repeated_prompt_filling_the_pool_exactly_is_admitted_from_its_cached_blocks() -> None:
    # A prefix of whole blocks has nothing to copy: a hit of 2 blocks plus 1 new fits 3.
    sched, sim = make(num_blocks=3, block_size=4, max_model_len=12, watermark=0.0)
    first = seq(9, max_tokens=1)
    sched.add(first)
    drive(sched, sim)
    again = Sequence("b", first.prompt_token_ids, 1)
    sched.add(again)
    drive(sched, sim, max_steps=5)
    assert again.num_cached_tokens == 8 and again.output_token_ids == first.output_token_ids


def test_a_sequence_whose_own_last_block_is_private_is_never_copied() -> None:
    # b shares a's first block through the prefix cache; its partly filled last block is its
    # own, so no step copies anything (a self-copy would also cost a block of room).
    sched, sim = make(block_size=4)
    prompt = [5, 6, 7, 8, 9]
    a = Sequence("a", prompt, 6)
    sched.add(a)
    copies = list(step(sched, sim).blocks_to_copy)
    b = Sequence("b", prompt, 6)
    sched.add(b)
    while sched.has_unfinished():
        out = step(sched, sim)
        copies += out.blocks_to_copy
        if b.block_table and a.block_table:
            assert b.block_table[0] == a.block_table[0]
    assert b.num_cached_tokens == 4 and copies == []
    assert b.output_token_ids == a.output_token_ids


# -- stats -------------------------------------------------------------------------------


def test_stats_snapshot_reports_blocks_requests_and_timings() -> None:
    sched, sim = make(num_blocks=32, max_num_seqs=2)
    for i in range(3):
        sched.add(seq(9, max_tokens=3, start=i))
    step(sched, sim)
    st = scheduler_stats(sched, bytes_per_token=320 * 1024)
    assert st.kv.capacity == 32 and st.kv.block_size == 4
    assert st.kv.bytes_per_token == 320 * 1024
    assert st.kv.used == 6 and st.kv.free + st.kv.used + st.kv.cached == 32
    assert st.kv.occupancy == pytest.approx(6 / 32)
    assert (st.requests.running, st.requests.waiting) == (2, 1)
    assert st.steps_total == 1 and st.last_step_schedule_seconds > 0
    assert st.prefix_cache.enabled and st.prefix_cache.queries_tokens_total == 18
    assert st.model_dump()["kv"]["cached"] == st.kv.cached


def test_the_schedule_time_is_the_duration_of_the_schedule_call() -> None:
    # An interval inside the caller's: not a threshold, so no host is too slow for it.
    sched, _ = make()
    sched.add(seq(9))
    before = time.perf_counter()
    sched.schedule()
    took = time.perf_counter() - before
    assert 0 < scheduler_stats(sched).last_step_schedule_seconds <= took


def _count_prefix_walks(sched: Scheduler, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    walks: list[int] = []
    walk = sched.kv.computed_blocks

    def counted(s: Sequence) -> tuple[list[int], int] | None:
        walks.append(s.seq_id)
        return walk(s)

    monkeypatch.setattr(sched.kv, "computed_blocks", counted)
    return walks


def test_a_queue_blocked_on_max_num_seqs_does_not_walk_the_heads_prefix_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The walk is as long as the head's cached prompt (3.4 ms at 32k tokens, 20x the rest of
    # the step): doing it at every step only for `fits` to refuse a full slot set is waste.
    sched, sim = make(max_num_seqs=2, num_blocks=256, max_model_len=1024)
    prompt = [(7 * i) % VOCAB for i in range(200)]
    sched.add(Sequence("warm", prompt, 1))
    drive(sched, sim)  # the prompt's blocks are now in the prefix cache
    for i in range(2):
        sched.add(seq(8, max_tokens=12, start=100 + i))
    step(sched, sim)
    head = Sequence("head", [*prompt, 1], 2)
    sched.add(head)
    walks = _count_prefix_walks(sched, monkeypatch)
    for _ in range(5):
        step(sched, sim)
    assert head.status is SequenceStatus.WAITING and walks == []
    drive(sched, sim)
    assert walks and head.status is SequenceStatus.FINISHED and head.num_cached_tokens == 200


def test_a_queue_blocked_on_a_full_pool_does_not_walk_the_heads_prefix_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sched, sim = make(num_blocks=20, block_size=4, watermark=0.25)  # 5 blocks held back
    sched.add(Sequence("a", [1] * 56, 8))  # 14 + 1 blocks: 5 free, none beyond the watermark
    step(sched, sim)
    sched.add(Sequence("b", [2] * 8, 2))
    walks = _count_prefix_walks(sched, monkeypatch)
    for _ in range(3):
        step(sched, sim)
    assert walks == [] and len(sched.waiting) == 1
    drive(sched, sim)
    assert walks and not sched.has_unfinished()


class _Compared(Sequence):
    compared = 0

    def __eq__(self, other: object) -> bool:
        _Compared.compared += 1
        return self is other

    __hash__ = Sequence.__hash__


def test_aborting_sequences_deep_in_the_queue_does_not_scan_it() -> None:
    # A client that goes away takes its waiting sequences from anywhere in the queue; a
    # deque's `remove` compared each against every sequence ahead of it, on the engine thread
    # (3.5 s for a 4,096-sequence request behind 28,672 others, every stream paused).
    sched, sim = make(num_blocks=64, max_num_seqs=4)
    seqs = [_Compared(f"r{i}", [i % VOCAB + 1], 2) for i in range(2_000)]
    for s in seqs:
        sched.add(s)
    _Compared.compared = 0
    for s in seqs[1_000:1_010]:
        assert sched.finish(s.seq_id) and not sched.finish(s.seq_id)
    assert _Compared.compared == 0
    assert scheduler_stats(sched).requests.waiting == 1_990 == len(sched.seqs)
    admitted: list[Sequence] = []
    while sched.has_unfinished():
        admitted += [e.seq for e in step(sched, sim).scheduled if e.start == 0]
    assert admitted == seqs[:1_000] + seqs[1_010:], "first come, first served, aborted skipped"
    assert not sched.waiting and sched.kv.pool.num_used == 0


def test_a_sequence_aborted_while_it_waits_behind_a_preempted_one_is_never_admitted() -> None:
    sched, sim = make(num_blocks=6, block_size=4, max_model_len=24, watermark=0.0)
    a, b, c = (seq(7, max_tokens=12, start=10 * i) for i in range(3))
    for s in (a, b, c):
        sched.add(s)
    step(sched, sim)
    late = seq(3, max_tokens=2, start=90)
    sched.add(late)
    step(sched, sim)
    out = sched.schedule()
    assert out.preempted == [c]
    sched.update(out, {k: sample(v) for k, v in sim.run(out).items()})
    assert sched.finish(late.seq_id) and sched.finish(c.seq_id)
    assert scheduler_stats(sched).requests.waiting == 0 and sched.has_unfinished()
    while sched.has_unfinished():
        assert not {late, c} & {e.seq for e in step(sched, sim).scheduled}
    assert sched.kv.pool.num_used == 0 and late.status is SequenceStatus.FINISHED
