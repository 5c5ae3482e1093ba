"""The admission rule in the contract (`headroom.contract.admission`), which the scheduler
admits by and the autoscaling simulator imports: a table of its cases, and the scheduler
following it."""

from __future__ import annotations

import pytest
from test_kv_model_sim import KVSimulator, sample

from headroom.contract.admission import fits, watermark_blocks
from headroom.engine.config import EngineConfig
from headroom.engine.scheduler import Scheduler
from headroom.engine.sequence import Sequence, SequenceStatus


@pytest.mark.parametrize(
    ("free", "prompt", "watermark", "running", "max_seqs", "admitted"),
    [
        (10, 4, 2, 1, 8, True),  # 4 + 2 kept free <= 10
        (10, 8, 2, 1, 8, True),  # exactly the free blocks less the watermark
        (10, 9, 2, 1, 8, False),  # would eat into the watermark
        (10, 9, 2, 0, 8, True),  # nothing runs: the watermark would only block it
        (10, 11, 0, 0, 8, False),  # more than the pool has free
        (10, 1, 0, 8, 8, False),  # max_num_seqs already running
        (0, 0, 0, 0, 1, True),  # a prompt wholly in the prefix cache takes no block
    ],
)
def test_fits_admits_by_free_blocks_watermark_and_seat_count(
    free: int, prompt: int, watermark: int, running: int, max_seqs: int, admitted: bool
) -> None:
    assert fits(free, prompt, watermark, running, max_seqs) is admitted


def test_the_watermark_is_a_whole_number_of_blocks_and_a_fraction_below_one() -> None:
    assert watermark_blocks(0.05, 1000) == 50
    assert watermark_blocks(0.05, 19) == 0
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="watermark"):
            watermark_blocks(bad, 100)


def test_the_scheduler_admits_exactly_what_fits_allows() -> None:
    cfg = EngineConfig(num_blocks=20, block_size=4, max_model_len=80, watermark=0.25)
    sched, sim = Scheduler(cfg), KVSimulator(20, 4)
    held = Sequence("a", [1] * 40, 4)  # 11 blocks once it decodes
    sched.add(held)
    out = sched.schedule()
    sched.update(out, {k: sample(v) for k, v in sim.run(out).items()})
    decisions = []
    for prompt_len in (24, 16, 20, 12):  # 6, 4, 5 and 3 blocks, with 5 (25 %) kept free
        waiting = Sequence("b", [2] * prompt_len, 1)
        sched.add(waiting)
        # What is left once `held` took its next block (it needs one at a block boundary).
        free = sched.kv.num_available - (held.num_computed_tokens % 4 == 0)
        expect = fits(free, prompt_len // 4, 5, 1, cfg.max_num_seqs)
        out = sched.schedule()
        assert (waiting.status is SequenceStatus.RUNNING) is expect
        decisions.append(expect)
        sched.update(out, {k: sample(v) for k, v in sim.run(out).items()})
        sched.finish(waiting.seq_id)
    assert True in decisions and False in decisions, "both sides of the rule were exercised"
