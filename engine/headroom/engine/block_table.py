"""Slot mappings as the attention backends consume them.

A token at logical position p of a sequence lives in physical slot
`block_table[p // block_size] * block_size + p % block_size` (see `attention/base.py`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from headroom.engine.sequence import Sequence


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
