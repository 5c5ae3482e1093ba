"""Replica bounds, shared by both loops: reconcile's first count and every scaling decision."""

from __future__ import annotations


def clamp(n: int, lo: int, hi: int) -> int:
    """n within [lo, hi]."""
    return max(lo, min(hi, n))
