"""Block tables and slot mappings in the layout the attention backends read."""

from __future__ import annotations

import pytest
import torch

from headroom.engine.block_table import (
    batch_positions,
    batch_slot_mapping,
    block_tables_tensor,
    slot_mapping,
)
from headroom.engine.scheduler import Scheduler, SchedulerConfig
from headroom.engine.sequence import Sequence


def test_block_tables_are_int32_and_padded_with_zero() -> None:
    a = Sequence.new("a", [1], 1)
    b = Sequence.new("b", [1], 1)
    a.block_table[:] = [5, 3, 9]
    b.block_table[:] = [7]
    t = block_tables_tensor([a, b])
    assert t.dtype == torch.int32 and t.tolist() == [[5, 3, 9], [7, 0, 0]]
    assert block_tables_tensor([a, b], max_blocks=5).shape == (2, 5)
    assert block_tables_tensor([]).shape == (0, 0)
    with pytest.raises(ValueError, match="shorter"):
        block_tables_tensor([a], max_blocks=2)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_slot_mapping_follows_the_cache_layout(block_size: int) -> None:
    table = [4, 0, 7, 2]
    for start in range(len(table) * block_size):
        for n in range(len(table) * block_size - start + 1):
            want = [
                table[p // block_size] * block_size + p % block_size
                for p in range(start, start + n)
            ]
            assert slot_mapping(table, start, n, block_size) == want


def test_slot_mapping_refuses_positions_past_the_table() -> None:
    with pytest.raises(ValueError, match="outside"):
        slot_mapping([1, 2], 6, 3, 4)
    with pytest.raises(ValueError, match="outside"):
        slot_mapping([1, 2], -1, 1, 4)


def test_batch_helpers_cover_every_scheduled_token_in_order() -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64))
    a, b = Sequence.new("a", list(range(6)), 2), Sequence.new("b", list(range(3)), 2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    slots = batch_slot_mapping(out.scheduled, 4)
    assert len(slots) == len(set(slots)) == 9
    assert slots[:6] == slot_mapping(a, 0, 6, 4) and slots[6:] == slot_mapping(b, 0, 3, 4)
    assert batch_positions(out.scheduled) == [0, 1, 2, 3, 4, 5, 0, 1, 2]
