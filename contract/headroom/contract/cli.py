"""The `headroom` command line: one entry point, each subcommand in the module that owns it."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import re
import select
import sys
from collections.abc import Callable, Iterable, Sequence

from headroom.contract.outputs import stdout_to_devnull


def fields_as_flags(message: str, fields: Iterable[str], flag: Callable[[str], str]) -> str:
    """A validation `message` with each of `fields` (as a model names them) written as the flag
    the user typed: a rule across fields reads `--timeout must not exceed --interval`."""
    pattern = r"\b(?:" + "|".join(map(re.escape, fields)) + r")\b"
    return re.sub(pattern, lambda m: flag(m[0]), message)


# name -> (module, registration function, one-line help). Only the chosen subcommand's module is
# imported, so `headroom plan` never pays for torch, aiohttp or kopf. A subcommand that does not
# set its own `func` default runs its module's `run(args)`.
# An output that cannot be written, whatever the command: no room, past a size limit, I/O.
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EIO})

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
    "kv-check": (
        "headroom.engine.kv_check.cli",
        "add_parser",
        "check fp8/int8 KV against the auto cache on your own model and prompts",
    ),
    "sidecar": (
        "headroom.sidecar.cli",
        "add_parser",
        "export an engine's KV-cache state and saturation forecast to Prometheus",
    ),
    "operator": ("headroom.operator.cli", "add_parsers", "run the InferenceDeployment operator"),
    "crd": ("headroom.operator.cli", "add_parsers", "print the InferenceDeployment CRD"),
    "profile": (
        "headroom.operator.simulate.cli",
        "add_parsers",
        "profile a request trace: concurrency, lengths, burstiness, prefix overlap",
    ),
    "simulate": (
        "headroom.operator.simulate.cli",
        "add_parsers",
        "replay a trace through the operator's decide() for a spec",
    ),
}


# What each extra of pyproject.toml adds, by import name: the operator, the sidecar, `plan`,
# `load` and `crd` run without any of them.
EXTRAS: dict[str, frozenset[str]] = {
    "engine": frozenset({"torch", "safetensors", "tokenizers", "numpy", "matplotlib"}),
    "sim": frozenset({"numpy", "matplotlib"}),
}
# The extra a command is meant to run with, when a module comes with several.
COMMAND_EXTRA = {"serve": "engine", "kv-check": "engine", "profile": "sim", "simulate": "sim"}


def extra_for(command: str | None, module: str) -> str | None:
    """The extra that brings `module` to `command`: the command's own if it has the module,
    else the smallest that does (None: no extra has it)."""
    own = COMMAND_EXTRA.get(command or "")
    if own is not None and module in EXTRAS[own]:
        return own
    having = sorted((len(mods), name) for name, mods in EXTRAS.items() if module in mods)
    return having[0][1] if having else None


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
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # a socket or a child's pipe broke, not our reader: a real failure
        # A reader that stops early (`| head`) ends the command quietly, as `_emit` in
        # simulate/cli.py does, and with 0: stopping to read is not a failure.
        stdout_to_devnull()
        return 0
    except OSError as e:
        if e.errno not in _WRITE_ERRNOS:
            raise
        # The result could not be written (stdout on a full disk, a file past its size
        # limit): one line, and the command failed.
        with contextlib.suppress(OSError):
            stdout_to_devnull()
        print(f"headroom {command}: cannot write the output: {e}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:
        root = (e.name or "").split(".")[0]
        extra = extra_for(command, root)
        if extra is None:
            raise
        print(
            f"headroom {command}: needs {root}, which this install lacks: it comes with the "
            f"{extra} extra (pip install '.[{extra}]' in a headroom checkout)",
            file=sys.stderr,
        )
        return 2


def _stdout_closed() -> bool:
    """Whether stdout is a pipe (or socket) its reader has closed: poll flags it POLLERR (Linux)
    or POLLHUP. Without poll (Windows) a broken pipe is taken to be stdout's."""
    if not hasattr(select, "poll"):
        return True
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object with no descriptor
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))


if __name__ == "__main__":
    raise SystemExit(main())
