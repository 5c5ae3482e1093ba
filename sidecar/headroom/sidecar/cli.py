"""`headroom sidecar`: flags (with the pod's env vars as defaults) into a `SidecarConfig`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys

from pydantic import ValidationError

from headroom.contract.cli import fields_as_flags
from headroom.contract.ports import SIDECAR_PORT
from headroom.sidecar.config import API_KEY_ENV, IdentityLabels, SidecarConfig

log = logging.getLogger("headroom.sidecar")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the `sidecar` subcommand."""
    p = subparsers.add_parser(
        "sidecar",
        help="export an engine's KV-cache state and saturation forecast to Prometheus",
        description="Polls the engine (headroom /stats, or vLLM or SGLang /metrics) and serves "
        "/metrics, /saturation and /healthz.",
    )
    configure_parser(p)


def configure_parser(p: argparse.ArgumentParser) -> None:
    """The sidecar's flags, on any parser."""
    env = os.environ.get
    p.add_argument(
        "--engine-url", required=True, help="engine base URL, e.g. http://127.0.0.1:8000"
    )
    p.add_argument(
        "--source",
        choices=("headroom", "vllm", "sglang"),
        default="headroom",
        help="headroom engine /stats, or a stock vLLM or SGLang server's /metrics",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=1,
        help="sglang source: tokens per KV page, as the server's --page-size (default 1, "
        "SGLang's default); blocks are tokens // page size. The server's own page size, from "
        "its server-info endpoint, wins when it answers",
    )
    p.add_argument(
        "--planned-blocks",
        type=int,
        default=None,
        metavar="N",
        help="the KV pool planned for this pod, in blocks (the operator passes its plan); "
        "exported as headroom_kv_blocks_planned, to compare with the running pool's "
        "headroom_kv_blocks_capacity",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=SIDECAR_PORT, help="port to listen on")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    p.add_argument("--timeout", type=float, default=0.8, help="seconds before a poll is abandoned")
    p.add_argument(
        "--window",
        type=float,
        default=60.0,
        help="seconds of history for the hit ratio and preemption rate",
    )
    p.add_argument(
        "--forecast-window",
        type=float,
        default=30.0,
        help="seconds of occupancy history the saturation slope is fitted over",
    )
    p.add_argument("--pod", default=env("POD_NAME", ""), help="pod label (default $POD_NAME)")
    p.add_argument(
        "--namespace",
        default=env("POD_NAMESPACE", ""),
        help="namespace label (default $POD_NAMESPACE)",
    )
    p.add_argument(
        "--inferencedeployment",
        default=env("HEADROOM_INFERENCEDEPLOYMENT", ""),
        help="inferencedeployment label (default $HEADROOM_INFERENCEDEPLOYMENT)",
    )
    p.add_argument("--model", default="", help="model label (default: what the engine reports)")
    p.add_argument(
        "--log-level",
        default=env("HEADROOM_LOG_LEVEL", "WARNING"),
        help="logging level (default WARNING: state changes only)",
    )


def config_from_args(args: argparse.Namespace) -> SidecarConfig:
    """Validate the parsed flags; raises pydantic.ValidationError."""
    return SidecarConfig(
        engine_url=args.engine_url,
        source=args.source,
        page_size=args.page_size,
        planned_blocks=args.planned_blocks,
        # From the environment only: a flag would put the key in the pod's command line.
        api_key=os.environ.get(API_KEY_ENV, "").strip() or None,
        host=args.host,
        port=args.port,
        interval=args.interval,
        timeout=args.timeout,
        window=args.window,
        forecast_window=args.forecast_window,
        labels=IdentityLabels(
            model=args.model,
            namespace=args.namespace,
            inferencedeployment=args.inferencedeployment,
            pod=args.pod,
        ),
    )


def _flag(field: str) -> str:
    return "--" + field.removeprefix("labels.").replace("_", "-")


def flag_errors(exc: ValidationError) -> list[str]:
    """Each error under the flag the user typed (`--page-size`, not `page_size`); a rule across
    fields names them as flags too."""
    out = []
    for err in exc.errors(include_url=False):
        field = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        if not field:
            msg = fields_as_flags(msg, SidecarConfig.model_fields, _flag)
        out.append(f"{_flag(field)}: {msg}" if field else msg)
    return out


def run(args: argparse.Namespace) -> int:
    """Run the sidecar until SIGTERM/SIGINT; returns the exit code."""
    try:
        cfg = config_from_args(args)
    except ValidationError as exc:
        for line in flag_errors(exc):
            print(f"headroom sidecar: {line}", file=sys.stderr)
        return 2
    level = logging.getLevelName(str(args.log_level).upper())
    if not isinstance(level, int):
        print(f"headroom sidecar: unknown --log-level {args.log_level!r}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=level,
        format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
        stream=sys.stderr,
    )
    from headroom.sidecar.server import serve

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop)

    try:
        asyncio.run(main())
    except socket.gaierror as exc:  # a host name that does not resolve is a bad flag
        print(f"headroom sidecar: --host {cfg.host}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the port is taken
        print(f"headroom sidecar: cannot listen on {cfg.host}:{cfg.port}: {exc}", file=sys.stderr)
        return 1
    return 0
