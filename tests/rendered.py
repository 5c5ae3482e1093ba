"""Reading rendered manifests in the operator's tests: a container's flags, a pod's containers."""

from __future__ import annotations

from typing import Any


def flags(args: list[str]) -> dict[str, str | bool]:
    """`--flag value` pairs and bare `--flag`s (positional words before the first flag skipped)."""
    out: dict[str, str | bool] = {}
    i = next((n for n, a in enumerate(args) if a.startswith("--")), len(args))
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[args[i]] = args[i + 1]
            i += 2
        else:
            out[args[i]] = True
            i += 1
    return out


def containers(dep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A Deployment's containers by name."""
    return {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}
