"""`python -m headroom.operator [operator|crd] ...`: the operator's commands without the console
script (what the e2e tests and the container image run)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from headroom.operator.cli import add_parsers


def main(argv: Sequence[str] | None = None) -> int:
    """Parse and run `operator` or `crd`."""
    parser = argparse.ArgumentParser(prog="python -m headroom.operator")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_parsers(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
