"""The `headroom` command line: one entry point, each subcommand in the module that owns it."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

# Each module registers its subcommands with `add_parser(s)(subparsers)`. A subcommand that does
# not set its own `func` default runs the module's `run(args)`. Modules are imported only to
# build the parser; torch and kopf load inside the handlers, so `headroom plan` stays fast.
_SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("headroom.engine.plan_cli", "add_parser"),
    ("headroom.engine.server.cli", "add_parser"),
    ("headroom.engine.loadgen.cli", "add_parser"),
    ("headroom.sidecar.cli", "add_parser"),
    ("headroom.operator.cli", "add_parsers"),
)


def build_parser() -> argparse.ArgumentParser:
    """The full parser with every subcommand whose module is present."""
    parser = argparse.ArgumentParser(
        prog="headroom", description="KV-cache-aware autoscaling for LLM inference on Kubernetes."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module, func in _SUBCOMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):
                continue  # that part is not in this build
            raise
        before = set(sub.choices)
        getattr(mod, func)(sub)
        for name in set(sub.choices) - before:
            sp = sub.choices[name]
            if sp.get_default("func") is None and hasattr(mod, "run"):
                sp.set_defaults(func=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `headroom` CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
