"""PASS/MISS bookkeeping for the benchmarks: any MISS not marked informational exits 1.

A benchmark states its targets; when a measured row misses one, the script says so in the
table and in its exit status, so `make bench` and CI cannot print MISS and report success.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


class Verdicts:
    """Collects each target's verdict; `exit_code()` is 1 when a graded target missed."""

    def __init__(self) -> None:
        self.passed = 0
        self.missed: list[str] = []
        self.informational: list[str] = []

    def __call__(self, ok: bool, what: str, *, informational: bool = False) -> str:
        """`PASS` or `MISS` for the table; an informational row is printed but not graded."""
        if informational:
            self.informational.append(what)
            return f"{'PASS' if ok else 'MISS'} (informational)"
        if ok:
            self.passed += 1
            return "PASS"
        self.missed.append(what)
        return "MISS"

    def summary(self) -> str:
        """One line: the counts, and what missed."""
        text = (
            f"{self.passed} PASS, {len(self.missed)} MISS, {len(self.informational)} informational"
        )
        return text + (f" (MISS: {'; '.join(self.missed)})" if self.missed else "")

    def exit_code(self) -> int:
        """Print the summary line and return the process exit status."""
        if self.missed:
            print(f"verdicts: {self.summary()}", file=sys.stderr)
            return 1
        print(f"verdicts: {self.summary()}")
        return 0


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse `type` for integers >= `minimum`: a count that would leave a benchmark
    nothing to measure (or divide by zero) is refused with exit 2 and a message."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


positive_int = at_least(1)
