"""Checks on a file a command will write, made before the work: a run of minutes must not be
lost to a path it cannot write at the end; and what a command does when its reader goes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

CHART_SUFFIXES = (".png", ".svg", ".pdf")  # what matplotlib writes here without extra backends


def output_error(path: Path, flag: str) -> str | None:
    """Why `path` cannot take a file (the flag named), or None; '-' (stdout) is fine."""
    if str(path) == "-":
        return None
    if path.is_dir():
        return f"{flag}: {path} is a directory"
    parent = path.parent
    if not parent.is_dir():
        return f"{flag}: no directory {parent}"
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return f"{flag}: {path} is not writable"
    return None


def write_output(path: Path, text: str) -> None:
    """`text` into `path`, or onto stdout (flushed) when `path` is '-'."""
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        path.write_text(text)


def chart_error(path: Path, flag: str) -> str | None:
    """`output_error`, and a suffix matplotlib can write."""
    if path.suffix.lower() not in CHART_SUFFIXES:
        return f"{flag}: {path} must end in {', '.join(CHART_SUFFIXES)}"
    return output_error(path, flag)


def stdout_to_devnull() -> None:
    """After a reader stopped early (`| head`): point stdout at /dev/null, so that later output
    and the interpreter's own flush at exit find no closed pipe."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
