"""Slot mappings in the layout the attention backends read."""

from __future__ import annotations

import pytest

from headroom.engine.block_table import slot_mapping
from headroom.engine.sequence import Sequence


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


def test_slot_mapping_reads_a_sequences_own_table() -> None:
    seq = Sequence("a", [1, 2, 3, 4, 5], 1)
    seq.block_table[:] = [5, 3]
    assert slot_mapping(seq, 2, 3, 4) == [22, 23, 12]


def test_slot_mapping_refuses_positions_past_the_table() -> None:
    with pytest.raises(ValueError, match="outside"):
        slot_mapping([1, 2], 6, 3, 4)
    with pytest.raises(ValueError, match="outside"):
        slot_mapping([1, 2], -1, 1, 4)
