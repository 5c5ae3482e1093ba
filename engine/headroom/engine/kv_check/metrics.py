"""How far a quantized-KV run strays from the reference: pure functions of logits and tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def top1_agreement(ref: torch.Tensor, other: torch.Tensor) -> float:
    """Fraction of rows (`[positions, vocab]` logits) whose argmax agrees (in float64: 18 of 20
    is 0.9, not fp32's 0.89999998)."""
    return float((ref.argmax(-1) == other.argmax(-1)).double().mean())


def kl_divergence(ref: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over rows of KL(p_ref || p_other) of the next-token distributions, in nats."""
    ref_logp = torch.log_softmax(ref.double(), -1)
    other_logp = torch.log_softmax(other.double(), -1)
    per_row = (ref_logp.exp() * (ref_logp - other_logp)).sum(-1)
    return float(per_row.clamp_min(0).mean())


def matched_prefix(ref: Sequence[int], other: Sequence[int]) -> int:
    """How many greedy tokens match before the first divergence."""
    n = 0
    for a, b in zip(ref, other, strict=False):
        if a != b:
            break
        n += 1
    return n


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else float("nan")
