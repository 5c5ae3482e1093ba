"""`python -m headroom.engine.loadgen ...`: the same flags as `headroom load`."""

import argparse
import sys

from headroom.engine.loadgen.cli import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m headroom.engine.loadgen")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
