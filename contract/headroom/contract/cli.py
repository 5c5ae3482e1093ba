"""The `headroom` command line: one entry point, each subcommand in the module that owns it."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, registration function, one-line help). Only the chosen subcommand's module is
# imported, so `headroom plan` never pays for torch, aiohttp or kopf. A subcommand that does not
# set its own `func` default runs its module's `run(args)`.
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "plan": (
        "headroom.contract.plan_cli",
        "add_parser",
        "size a deployment from KV-cache arithmetic",
    ),
    "serve": (
        "headroom.engine.server.cli",
        "add_parser",
        "run the engine behind an OpenAI-compatible HTTP API",
    ),
    "load": ("headroom.engine.loadgen.cli", "add_parser", "load-test an OpenAI-compatible server"),
    "sidecar": (
        "headroom.sidecar.cli",
        "add_parser",
        "export an engine's KV-cache state and saturation forecast to Prometheus",
    ),
    "operator": ("headroom.operator.cli", "add_parsers", "run the InferenceDeployment operator"),
    "crd": ("headroom.operator.cli", "add_parsers", "print the InferenceDeployment CRD"),
}


# What `pip install 'headroom[engine]'` adds: the operator and the sidecar run without them.
ENGINE_EXTRA = frozenset({"torch", "safetensors", "tokenizers", "numpy", "matplotlib"})


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with the real options of `command` and a help line for every other one."""
    parser = argparse.ArgumentParser(
        prog="headroom", description="KV-cache-aware autoscaling for LLM inference on Kubernetes."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    if command in _COMMANDS:
        module, func, _ = _COMMANDS[command]
        mod = importlib.import_module(module)
        getattr(mod, func)(sub)
        for sp in sub.choices.values():
            if sp.get_default("func") is None and hasattr(mod, "run"):
                sp.set_defaults(func=mod.run)
    else:
        for name, (_, _, help_text) in _COMMANDS.items():
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `headroom` CLI; returns the process exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    try:
        parser = build_parser(command)
        args = parser.parse_args(args_list)
        if args.command is None or getattr(args, "func", None) is None:
            parser.print_help()
            return 2
        return int(args.func(args))
    except ModuleNotFoundError as e:
        root = (e.name or "").split(".")[0]
        if root not in ENGINE_EXTRA:
            raise
        print(
            f"headroom {command}: needs {root}, which this install lacks: it comes with the "
            "engine extra (pip install 'headroom[engine]')",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
