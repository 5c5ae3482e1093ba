"""The needle: a key-value fact inserted at a depth of the user's own text, then asked for.

The fact and the question are plain sentences (`NEEDLE`, `QUESTION`), so any tokenizer reads
them; keys are common nouns and values three-digit numbers, drawn from a seeded generator so
two runs (auto and quantized KV) ask exactly the same questions. A continuation scores 1 when
its text starts with the value as a whole number ("4720" or "472.5" do not answer 472).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

NEEDLE = "The pass key for {key} is {value}."
QUESTION = "What is the pass key for {key}? The pass key for {key} is"

KEYS: tuple[str, ...] = (
    "apple", "river", "castle", "forest", "garden", "island", "mirror", "planet",
    "rocket", "silver", "tiger", "violin", "window", "anchor", "bridge", "candle",
    "desert", "engine", "falcon", "glacier", "harbor", "jungle", "kettle", "lantern",
    "meadow", "needle", "orchid", "pepper", "quartz", "saddle", "temple", "valley",
)  # fmt: skip
VALUES: tuple[str, ...] = tuple(str(v) for v in range(100, 1000))


@dataclass(frozen=True, slots=True)
class Needle:
    """One fact to hide and ask for."""

    key: str
    value: str

    @property
    def fact(self) -> str:
        return NEEDLE.format(key=self.key, value=self.value)

    @property
    def question(self) -> str:
        return QUESTION.format(key=self.key)


def draw_needles(n: int, seed: int) -> list[Needle]:
    """`n` needles from a seeded generator (distinct keys while the key list lasts)."""
    rng = random.Random(seed)
    keys = rng.sample(KEYS, k=min(n, len(KEYS)))
    keys += [rng.choice(KEYS) for _ in range(n - len(keys))]
    return [Needle(k, rng.choice(VALUES)) for k in keys]


def insert_at_depth(
    haystack: Sequence[int], needle: Sequence[int], question: Sequence[int], depth: float
) -> list[int]:
    """`haystack` with `needle` spliced in at fraction `depth` (0 = start, 1 = end), then the
    question; the token count is len(haystack) + len(needle) + len(question)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    at = round(depth * len(haystack))
    return [*haystack[:at], *needle, *haystack[at:], *question]


def answered(continuation: str, value: str) -> bool:
    """True when the generated text starts with the value and the number ends there (spacing
    and a final period aside): a digit, or a period before a digit, would make it another."""
    text = continuation.strip()
    if not text.startswith(value):
        return False
    rest = text[len(value) :]
    return not (rest[:1].isdigit() or (rest[:1] == "." and rest[1:2].isdigit()))
