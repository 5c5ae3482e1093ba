"""`python -m headroom.sidecar`: the same as `headroom sidecar`."""

from __future__ import annotations

import argparse
import sys

from headroom.sidecar.cli import configure_parser, run


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the sidecar."""
    parser = argparse.ArgumentParser(prog="python -m headroom.sidecar")
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
