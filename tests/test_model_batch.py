"""The flattened forward batch: token rows, positions, slots and padded block tables."""

from __future__ import annotations

import torch

from headroom.engine.model.batch import build_forward_batch


def test_block_tables_of_uneven_lengths_are_padded_with_zeros_as_int32() -> None:
    batch = build_forward_batch(
        [([5, 6, 7], 4, [40, 41, 42], [9, 10])],
        [(1, 7, 70, [3]), (2, 20, 200, [4, 8, 12])],
    )
    assert batch.decode_block_tables.dtype == torch.int32
    assert batch.decode_block_tables.tolist() == [[3, 0, 0], [4, 8, 12]]
    assert batch.prefill_block_tables.tolist() == [[9, 10]]
    assert batch.input_ids.tolist() == [5, 6, 7, 1, 2] and batch.num_prefill_tokens == 3
    assert batch.positions.tolist() == [4, 5, 6, 7, 20]
    assert batch.slot_mapping.tolist() == [40, 41, 42, 70, 200]
    assert batch.prefill_seq_lens.tolist() == [7] and batch.decode_seq_lens.tolist() == [8, 21]


def test_a_batch_without_prefills_has_an_empty_table_of_width_zero() -> None:
    batch = build_forward_batch([], [(1, 0, 0, [2])])
    assert tuple(batch.prefill_block_tables.shape) == (0, 0)
    assert batch.prefill_block_tables.dtype == torch.int32
