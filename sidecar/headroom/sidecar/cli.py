"""`headroom sidecar`: flags (with the pod's env vars as defaults) into a `SidecarConfig`, and
the process's stop: with `--shutdown-wait`, it goes on polling and serving while its engine
drains (see `run`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from urllib.parse import urlsplit

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
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default %(default)s)")
    p.add_argument(
        "--port", type=int, default=SIDECAR_PORT, help="port to listen on (default %(default)s)"
    )
    p.add_argument(
        "--interval", type=float, default=1.0, help="seconds between polls (default %(default)s)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=0.8,
        help="seconds before a poll is abandoned (default %(default)s)",
    )
    p.add_argument(
        "--window",
        type=float,
        default=60.0,
        help="seconds of history for the hit ratio and preemption rate (default %(default)s)",
    )
    p.add_argument(
        "--forecast-window",
        type=float,
        default=30.0,
        help="seconds of occupancy history the saturation slope is fitted over (default "
        "%(default)s)",
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
        "--shutdown-wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, go on polling and serving until the engine's port refuses "
        "connections (the engine has exited), for at most this long; a second signal exits at "
        "once. For a pod's sidecar, signalled with its engine: the operator counts the KV a "
        "draining pod still holds. Default 0: exit at once (the engine may well run on)",
    )
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
        shutdown_wait=args.shutdown_wait,
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


async def engine_listening(url: str, timeout: float) -> bool:
    """Whether anything accepts a TCP connection at `url`'s host and port. A refusal (or any
    other failure to connect) is the engine gone; no answer within `timeout` is not proof of
    that (a full listen queue), so it counts as still there."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(parts.hostname, port)
    except TimeoutError:
        return True
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def stop_when_engine_exits(
    url: str, wait_s: float, interval: float, timeout: float, stop: asyncio.Event
) -> None:
    """Set `stop` once the engine at `url` no longer listens (at once if it is already gone),
    or after `wait_s`: until then the sidecar polls and serves as before, so the operator
    still reads the KV a draining engine holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    said = False
    while await engine_listening(url, timeout):
        left = deadline - loop.time()
        if left <= 0:
            log.warning("event=shutdown_wait_over engine=%s waited_s=%g (the engine still "
                        "listens; exiting)", url, wait_s)  # fmt: skip
            break
        if not said:
            said = True
            # A pod's normal end (every scale-in): not a warning.
            log.info("event=shutdown_wait engine=%s (serving until the engine exits, at "
                     "most %g s; signal again to exit now)", url, wait_s)  # fmt: skip
        await asyncio.sleep(min(interval, left))
    else:
        log.info("event=engine_gone engine=%s (exiting)", url)
    stop.set()


def run(args: argparse.Namespace) -> int:
    """Run the sidecar until SIGTERM/SIGINT; returns the exit code. With `--shutdown-wait`, the
    first signal (the kubelet's, to every container of the pod at once: SIGINT, the image's
    STOPSIGNAL, or SIGTERM) lets it serve on while the engine drains, until the engine's port
    refuses connections or the wait runs out; a second signal, or an engine already gone,
    exits at once."""
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
        waiting: list[asyncio.Task[None]] = []

        def on_signal() -> None:
            if waiting or cfg.shutdown_wait == 0:
                stop.set()
                return
            waiting.append(loop.create_task(stop_when_engine_exits(
                cfg.poll_url, cfg.shutdown_wait, cfg.interval, cfg.timeout, stop
            )))  # fmt: skip

        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, on_signal)
        try:
            await serve(cfg, stop)
        finally:
            for task in waiting:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    try:
        asyncio.run(main())
    except socket.gaierror as exc:  # a host name that does not resolve is a bad flag
        print(f"headroom sidecar: --host {cfg.host}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the port is taken
        print(f"headroom sidecar: cannot listen on {cfg.host}:{cfg.port}: {exc}", file=sys.stderr)
        return 1
    return 0
