"""PASS/MISS bookkeeping for the benchmarks: any MISS not marked informational exits 1.

A benchmark states its targets; when a measured row misses one, the script says so in the
table and its exit status, so `make bench` and CI cannot print MISS and report success.
"""

from __future__ import annotations

import sys


class Verdicts:
    """Collects each target's verdict; `exit_code()` is 1 when a graded target missed."""

    def __init__(self) -> None:
        self.misses: list[str] = []
        self.informational: list[str] = []

    def __call__(self, ok: bool, what: str, *, informational: bool = False) -> str:
        """`PASS` or `MISS` for the table; an informational MISS is printed but not graded."""
        if ok:
            return "PASS"
        if informational:
            self.informational.append(what)
            return "MISS (informational)"
        self.misses.append(what)
        return "MISS"

    def exit_code(self) -> int:
        """Print the summary line and return the process exit status."""
        if self.informational:
            print(f"informational, not graded: {'; '.join(self.informational)}")
        if self.misses:
            print(
                f"MISS on {len(self.misses)} target(s): {'; '.join(self.misses)}", file=sys.stderr
            )
            return 1
        print("every graded target: PASS")
        return 0
