"""`headroom serve` (and `python -m headroom.engine.server`): the engine behind an
OpenAI-compatible HTTP API. Flag names are a contract: the operator renders pods with them."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import re
import socket
import sys
import threading
from fractions import Fraction

from pydantic import ValidationError

from headroom.engine.config import EngineConfig
from headroom.engine.health import DEFAULT_STEP_TIMEOUT_S
from headroom.engine.server import log_format
from headroom.engine.server.auth import API_KEY_ENV
from headroom.engine.server.listener import SEND_TIMEOUT_S
from headroom.engine.server.runner import STATS_MAX_CONNECTIONS, ListenConfig, serve
from headroom.engine.server.state import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    SamplingDefaults,
    ServerSettings,
)

log = logging.getLogger("headroom.server")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

# Longer than any size a person types; Fraction would refuse past 4,300 digits anyway.
_MAX_SIZE_CHARS = 64


def parse_bytes(text: str) -> int:
    """`4GiB`, `512MiB`, `2G`, `1.5e9` or plain bytes -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use bytes or a unit (KiB, MiB, GiB, K, M, G)"
        )
    number, unit = m.group(1), _UNITS[m.group(2).lower()]
    if len(number) > _MAX_SIZE_CHARS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: too many digits")
    approx = float(number) * unit
    if not math.isfinite(approx):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: not a finite number")
    # Exact: in floats 4.1G is 4,099,999,999.9... and truncates a byte short. The float
    # bounds the exponent first, so `0e9999999` never becomes a 10**9999999 to build.
    value = int(Fraction(number) * unit) if approx >= 1 else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `headroom serve`."""
    m = p.add_argument_group("model")
    m.add_argument("--model", default="tiny", help='"tiny" or a local Hugging Face directory')
    m.add_argument("--served-model-name", help="name clients ask for (default: the model)")
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    m.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    m.add_argument("--seed", type=int, default=0, help="seed for requests without one")
    m.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                   help="auto: a request that leaves temperature, top_p or top_k out (or "
                   "null) samples with the model's generation_config.json value, as vLLM's "
                   "default does; vllm: with the neutral defaults (1.0, 1.0, off)")  # fmt: skip
    h = p.add_argument_group("http")
    h.add_argument("--host", default="127.0.0.1")
    h.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    h.add_argument("--stats-host", help="open listener for /health /ready /stats")
    h.add_argument("--stats-port", type=int, help="default: served on the main listener only")
    h.add_argument("--api-key", help=f"bearer token for /v1/* (env {API_KEY_ENV})")
    h.add_argument("--max-body-bytes", type=parse_bytes, default=DEFAULT_MAX_BODY_BYTES)
    h.add_argument("--keepalive-timeout", type=float, default=5.0,
                   help="seconds an idle connection stays open (from its start and after "
                   "each response) until a request's headers are in")  # fmt: skip
    h.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds from the first byte of a request to its last header")  # fmt: skip
    h.add_argument("--send-timeout", type=float, default=SEND_TIMEOUT_S,
                   help="seconds a response may wait on a client that reads none of it "
                   "(then the connection closes and its requests are aborted)")  # fmt: skip
    h.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="seconds from the end of the headers to the end of the body "
                   "(then 408)")  # fmt: skip
    h.add_argument("--max-connections", type=int,
                   help="open connections per listener; more wait in the listen queue "
                   "(default: what the open-files limit allows, at most 4096; "
                   f"the --stats-port listener {STATS_MAX_CONNECTIONS})")  # fmt: skip
    h.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds running requests get to finish on SIGTERM")  # fmt: skip
    h.add_argument("--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S,
                   help="seconds one model step may run before the engine counts as hung: "
                   "/health, /ready and /stats then answer 503")  # fmt: skip
    h.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])  # fmt: skip
    k = p.add_argument_group("kv cache and batching")
    k.add_argument("--block-size", type=int, default=16)
    pool = k.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=int, help="exact KV pool size in blocks")
    pool.add_argument("--kv-cache-memory", type=parse_bytes,
                      help="KV pool size in bytes or with a unit (e.g. 2GiB)")  # fmt: skip
    k.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"])
    k.add_argument("--max-model-len", type=int, help="default: the model's context length")
    k.add_argument("--max-num-seqs", type=int, default=256)
    k.add_argument("--max-num-batched-tokens", type=int, default=2048)
    k.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)  # fmt: skip
    k.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cuda"])


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `headroom serve`."""
    p = subparsers.add_parser(
        "serve",
        help="run the engine behind an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions and /v1/models, plus "
        "/health, /ready and /stats (the sidecar's input).",
    )
    add_arguments(p)


def build_configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerSettings, ListenConfig]:
    """Validated configs from the flags (ValidationError names the bad field)."""
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        seed=args.seed,
    )
    # The directory's own name: `--model .` or `~/m/` is the directory, not "." or ""; the
    # root has no name but its path.
    path = os.path.abspath(os.path.expanduser(args.model))
    name = args.served_model_name or (
        "tiny" if args.model == "tiny" else os.path.basename(path) or path
    )
    settings = ServerSettings(
        served_model_name=name,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        shutdown_grace_s=args.shutdown_grace,
        step_timeout_s=args.step_timeout,
        sampling_defaults=_sampling_defaults(args.model, args.generation_config),
    )
    listen = ListenConfig(
        host=args.host,
        port=args.port,
        stats_host=args.stats_host,
        stats_port=args.stats_port,
        keepalive_timeout_s=args.keepalive_timeout,
        header_timeout_s=args.header_timeout,
        send_timeout_s=args.send_timeout,
        max_connections=args.max_connections,
    )
    return engine, settings, listen


def _sampling_defaults(model: str, generation_config: str) -> SamplingDefaults:
    """The model's sampling defaults under `--generation-config` (none for vllm and for the
    built-in tiny model, which has no generation config)."""
    # Imported here: the model package pulls numpy before torch, and an install without the
    # engine extra must be told that `serve` needs torch (the runner's import says so).
    from headroom.engine.model.loader import generation_sampling_defaults
    from headroom.engine.model.tiny import TINY_NAME

    if generation_config == "vllm" or model == TINY_NAME:
        return SamplingDefaults()
    return SamplingDefaults.model_validate(generation_sampling_defaults(model))


def _flag_errors(err: ValidationError) -> str:
    flags = {
        "kv_cache_memory_bytes": "--kv-cache-memory",
        "shutdown_grace_s": "--shutdown-grace",
        "step_timeout_s": "--step-timeout",
        "served_model_name": "--served-model-name",
        "body_timeout_s": "--body-timeout",
        "keepalive_timeout_s": "--keepalive-timeout",
        "header_timeout_s": "--header-timeout",
        "send_timeout_s": "--send-timeout",
    }
    parts = []
    for e in err.errors(include_url=False):
        field = ".".join(str(x) for x in e["loc"])
        flag = flags.get(field, "--" + field.replace("_", "-")) if field else "flags"
        msg = str(e["msg"]).removeprefix("Value error, ")
        for name, opt in (("stats_host", "--stats-host"), ("stats_port", "--stats-port")):
            msg = msg.replace(name, opt)
        parts.append(f"{flag}: {msg}")
    return "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    """Entry point of `headroom serve`: 0 after a graceful shutdown, 2 on bad flags, a model
    directory that is missing or whose tokenizer_config.json cannot be read, or a pool too
    small for one max-length sequence, 1 when the model fails to load."""
    log_format.configure(getattr(logging, str(args.log_level).upper()))
    try:
        engine, settings, listen = build_configs(args)
    except ValidationError as e:
        print(f"headroom serve: {_flag_errors(e)}", file=sys.stderr)
        return 2
    if given := settings.sampling_defaults.given():
        # As vLLM says it at start-up: a model's defaults change what requests sample.
        log.info("default sampling parameters from the model's generation_config.json "
                 "(--generation-config vllm ignores them)", extra=given)  # fmt: skip
    # `~` expanded as the loader expands it (a quoted '~/m' reaches us unexpanded).
    if engine.model != "tiny" and not os.path.isdir(os.path.expanduser(engine.model)):
        # Said before the port is bound: the same path kv-check refuses with exit 2.
        print(
            f"headroom serve: --model: no directory {engine.model} (give tiny or a local "
            "Hugging Face checkpoint directory)",
            file=sys.stderr,
        )
        return 2
    left_behind: list[threading.Thread] = []
    try:
        code = asyncio.run(serve(engine, settings, listen, left_behind=left_behind))
    except socket.gaierror as e:  # a host name that does not resolve is a bad flag
        hosts = ", ".join(h for h in (listen.host, listen.stats_host) if h)
        print(f"headroom serve: --host/--stats-host {hosts}: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. the port is taken
        print(f"headroom serve: {e}", file=sys.stderr)
        return 1
    if any(t.is_alive() for t in left_behind):
        # A load cut short or an engine thread hung in a kernel: daemon threads, but the
        # interpreter's teardown (CUDA and NCCL destructors) can still block on what they
        # hold, so end the process here, past every Python exit hook.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def main(argv: list[str] | None = None) -> int:
    """`python -m headroom.engine.server ...`."""
    parser = argparse.ArgumentParser(prog="python -m headroom.engine.server")
    add_arguments(parser)
    return run(parser.parse_args(argv))
