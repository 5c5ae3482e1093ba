"""Block tables and slot mappings as the attention backends consume them.

A token at logical position p of a sequence lives in physical slot
`block_table[p // block_size] * block_size + p % block_size` (see `attention/base.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch

from headroom.engine.scheduled import ScheduledSeq
from headroom.engine.sequence import Sequence


def block_tables_tensor(
    seqs: Iterable[Sequence],
    device: torch.device | str = "cpu",
    max_blocks: int | None = None,
) -> torch.Tensor:
    """`[num_seqs, max_blocks]` int32 block ids, each row padded with 0 past its end."""
    tables = [s.block_table for s in seqs]
    width = max((len(t) for t in tables), default=0)
    if max_blocks is not None:
        if max_blocks < width:
            raise ValueError(f"max_blocks {max_blocks} is shorter than a table of {width} blocks")
        width = max_blocks
    rows = [t + [0] * (width - len(t)) for t in tables]
    out = (
        torch.tensor(rows, dtype=torch.int32)
        if rows
        else torch.zeros((0, width), dtype=torch.int32)
    )
    return out.to(device)


def slot_mapping(seq: Sequence | Seq[int], start: int, n: int, block_size: int) -> list[int]:
    """Physical slots of positions `start..start+n-1` of a sequence (or a bare block table)."""
    table = seq.block_table if isinstance(seq, Sequence) else seq
    end = start + n
    if start < 0 or n < 0 or end > len(table) * block_size:
        raise ValueError(
            f"positions {start}..{end - 1} are outside a table of {len(table)} blocks "
            f"of {block_size} tokens"
        )
    slots: list[int] = []
    p = start
    while p < end:
        index, offset = divmod(p, block_size)
        stop = min(end, (index + 1) * block_size)
        base = table[index] * block_size
        slots.extend(range(base + offset, base + offset + stop - p))
        p = stop
    return slots


def batch_slot_mapping(scheduled: Iterable[ScheduledSeq], block_size: int) -> list[int]:
    """Slots of every new token of a step, in `scheduled` order (for `write_kv`)."""
    slots: list[int] = []
    for s in scheduled:
        slots.extend(slot_mapping(s.seq.block_table, s.start, s.num_new_tokens, block_size))
    return slots


def batch_positions(scheduled: Iterable[ScheduledSeq]) -> list[int]:
    """Positions of every new token of a step, in `scheduled` order."""
    positions: list[int] = []
    for s in scheduled:
        positions.extend(range(s.start, s.start + s.num_new_tokens))
    return positions
