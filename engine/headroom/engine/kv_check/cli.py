"""`headroom kv-check`: run a model on the user's prompts with the auto KV cache and with fp8 or
int8, and say up to which context the quantized cache is safe.

    headroom kv-check --model /models/llama-3.1-8b --prompts docs.jsonl --kv-cache-dtype fp8 \\
        --contexts 1k,4k,16k --calibrate --json kv.json --plot kv.png

Exit status: 0 when the quantized cache is safe at every context, 1 when it is not at some,
2 for bad input (files, options, a model the engine cannot load), with the reason.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

import torch

from headroom.contract.outputs import chart_error, output_error, write_output
from headroom.engine.attention import BackendUnavailable, allocate_layer_cache, select_backend
from headroom.engine.attention.kv_scales import (
    SCALES_FILE,
    KVScales,
    KVScalesError,
    apply_scales,
    model_scales_path,
    read_scales,
    write_scales,
)
from headroom.engine.kv_check import check, report
from headroom.engine.kv_check.calibrate import calibrate
from headroom.engine.kv_check.prompts import Haystacks, PromptsError, read_documents
from headroom.engine.kv_check.session import BLOCK, KVSetting
from headroom.engine.model.loader import LoadedModel, load_failure, load_model

# Calibration prefills each prompt at the largest context, but no longer than this: the
# absmax of K and V settles long before, and the pass costs as much as a check row.
CALIBRATION_TOKENS = 8192


class UsageError(ValueError):
    """Bad options or input: exit 2 with the message."""


def parse_contexts(text: str) -> tuple[int, ...]:
    """ "1k,4k,16k" -> (1024, 4096, 16384); plain numbers are tokens."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        try:
            n = int(p[:-1]) * 1024 if p.endswith("k") else int(p)
        except ValueError:
            raise UsageError(
                f"--contexts: {part.strip()!r} is not a number like 4k or 512"
            ) from None
        if n < 1:
            raise UsageError(f"--contexts: {part.strip()!r} must be positive")
        out.append(n)
    if not out:
        raise UsageError("--contexts needs at least one length")
    return tuple(sorted(set(out)))


def parse_depths(text: str) -> tuple[float, ...]:
    try:
        depths = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise UsageError(f"--depths: {text!r} must be numbers between 0 and 1") from None
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise UsageError(f"--depths: {text!r} must be numbers between 0 and 1")
    return depths


class Progress:
    """Redrawn on a terminal, a line every few seconds otherwise."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()
        self._last = -1e9

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < (0.2 if self.tty else 5.0) and done < total:
            return
        self._last = now
        line = f"[{done}/{total}] {label} ({now - self.t0:.0f}s)"
        if self.tty:
            self.stream.write("\r" + line.ljust(79) + ("\n" if done >= total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def say(self, text: str) -> None:
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "kv-check",
        help="check fp8/int8 KV against the auto cache on your own model and prompts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="a local Hugging Face model directory")
    p.add_argument(
        "--prompts",
        required=True,
        type=Path,
        help="documents: .jsonl ({'text': ...}), .json or text",
    )
    p.add_argument("--kv-cache-dtype", required=True, choices=["fp8", "int8"])
    p.add_argument("--contexts", default="1k,4k,16k", help="context lengths (default 1k,4k,16k)")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="derive per-head fp8 scales from the prompts; report scale 1.0 and calibrated "
        f"(without it, fp8 is checked with MODEL/{SCALES_FILE} when there is one, as the "
        "engine runs it)",
    )
    p.add_argument(
        "--scales-out",
        type=Path,
        default=None,
        help=f"where --calibrate writes the scales (default MODEL/{SCALES_FILE}, which the "
        "engine reads at start-up)",
    )
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per context (default 4)")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths, 0 to 1")
    p.add_argument("--positions", type=int, default=32, help="teacher-forced positions per prompt")
    p.add_argument("--greedy-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0, help="seeds the needles' keys and values")
    p.add_argument("--json", type=Path, default=None,
                   help="write the report as JSON (-: stdout, the table on stderr)")  # fmt: skip
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of the results")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise UsageError(f"--device {name!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: torch sees no CUDA GPU")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu, cuda, cuda:N or auto, got {name!r}")
    return dev


def _load(args: argparse.Namespace, device: torch.device) -> LoadedModel:
    try:
        return load_model(args.model, args.dtype, device)
    except Exception as exc:  # a broken checkpoint too: exit 2, not 1 ("unsafe")
        raise UsageError(f"cannot load model {args.model}: {load_failure(exc)}") from None


def _validate(args: argparse.Namespace, loaded: LoadedModel) -> check.CheckConfig:
    for name in ("num_prompts", "positions", "greedy_tokens"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    cfg = check.CheckConfig(
        contexts=parse_contexts(args.contexts),
        num_prompts=args.num_prompts,
        depths=parse_depths(args.depths),
        positions=args.positions,
        greedy_tokens=args.greedy_tokens,
        seed=args.seed,
    )
    limit = loaded.config.max_position_embeddings
    generated = max(cfg.positions, cfg.greedy_tokens, check.longest_needle_tokens(loaded.tokenizer))
    longest = max(cfg.contexts) + generated
    if longest > limit:
        raise UsageError(
            f"context {check.short_context(max(cfg.contexts))} plus {longest - max(cfg.contexts)} "
            f"generated tokens exceeds the model's max_position_embeddings {limit}"
        )
    if args.calibrate and args.kv_cache_dtype != "fp8":
        raise UsageError(
            "--calibrate derives static fp8 scales; int8 KV scales each token as it is written"
        )
    return cfg


def run(args: argparse.Namespace) -> int:
    """The kv-check command; returns its exit status."""
    try:
        return _run(args)
    except (UsageError, PromptsError, check.CheckError) as exc:
        print(f"headroom kv-check: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    progress = Progress(sys.stderr, not args.quiet)
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    scales_path = _scales_path(args) if args.calibrate and args.kv_cache_dtype == "fp8" else None
    for bad in (
        chart_error(args.plot, "--plot") if args.plot is not None else None,
        output_error(args.json, "--json") if args.json is not None else None,
        output_error(scales_path, "--scales-out") if scales_path is not None else None,
    ):
        if bad is not None:  # before the check's minutes, not after
            raise UsageError(bad)
    # Without --calibrate, fp8 is checked as `headroom serve` runs it: with the model
    # directory's scales file when there is one (read now: a broken file fails before loading).
    served = _served_scales(args) if scales_path is None and args.kv_cache_dtype == "fp8" else None
    if scales_path is not None:
        _say_what_calibrate_replaces(args, scales_path)
    docs = read_documents(args.prompts)  # cheap: fail on a bad file before loading a model
    device = _device(args.device)
    progress.say(f"loading {args.model} on {device} ...")
    loaded = _load(args, device)
    cfg = _validate(args, loaded)
    if served is not None:
        _check_scales_fit(served, loaded)
    try:
        backend = select_backend(
            args.attention_backend, device, loaded.config.head_dim, BLOCK, loaded.dtype
        )
    except (BackendUnavailable, ValueError) as exc:
        raise UsageError(str(exc)) from None
    tok = loaded.tokenizer
    hay = Haystacks([tok.encode(d, add_special_tokens=False) for d in docs], tok.bos_token_id)
    check.check_needles_fit(tok, hay, cfg)  # a context too short: exit 2 before any model run
    if hay.num_tokens < max(cfg.contexts):
        progress.say(
            f"note: the documents hold {hay.num_tokens} tokens; longer contexts repeat them"
        )
    settings = [KVSetting("auto", "auto")]
    scales: KVScales | None = None
    if scales_path is not None:
        scales = _calibrate(args, loaded, backend, device, hay, cfg, progress)
        settings += [
            KVSetting("fp8 (scale 1.0)", "fp8"),
            KVSetting("fp8 calibrated", "fp8", scales),
        ]
    elif served is not None:
        path, file_scales = served
        progress.say(f"checking fp8 with the scales in {path}, as headroom serve applies them")
        settings.append(KVSetting(f"fp8 ({path.name})", "fp8", file_scales))
    else:
        settings.append(KVSetting(args.kv_cache_dtype, args.kv_cache_dtype))
    results = check.run_check(
        loaded.model, tok, backend, device, settings, hay, cfg, progress=progress
    )
    if scales_path is not None and scales is not None:
        # Only now: a run stopped by bad input or an interrupt leaves the old file in place.
        _write_scales(scales_path, scales)
        progress.say(f"calibrated fp8 scales written to {scales_path}")
    rep = report.build_report(
        results,
        model=loaded.name,
        kv_cache_dtype=args.kv_cache_dtype,
        device=str(device),
        model_dtype=str(loaded.dtype).removeprefix("torch."),
        num_prompts=cfg.num_prompts,
        depths=cfg.depths,
        scales_path=None if scales_path is None else str(scales_path),
    )
    # `--json -` is the JSON on stdout: the table goes to stderr then, as headroom load does.
    to_stdout = args.json is not None and str(args.json) == "-"
    print(report.table(rep), file=sys.stderr if to_stdout else sys.stdout)
    if args.json is not None:
        _write(args.json, rep.model_dump_json(indent=2) + "\n")
    if args.plot is not None:
        try:
            report.plot(rep, args.plot)
        except OSError as exc:
            raise UsageError(f"cannot write {args.plot}: {exc}") from None
    # The status grades the cache that would be deployed: with --calibrate that is fp8 with the
    # scales just written (the scale 1.0 row is the comparison that shows what they buy).
    return 0 if check.all_safe(results, settings[-1].name) else 1


def _calibrate(
    args: argparse.Namespace,
    loaded: LoadedModel,
    backend: object,
    device: torch.device,
    hay: Haystacks,
    cfg: check.CheckConfig,
    progress: Progress,
) -> KVScales:
    n = min(max(cfg.contexts), CALIBRATION_TOKENS) - (hay.bos is not None)
    prompts = [hay.with_bos(hay.window(i, n, cfg.num_prompts)) for i in range(cfg.num_prompts)]
    return calibrate(
        loaded.model,
        backend,  # type: ignore[arg-type]
        device,
        prompts,
        source=f"{args.prompts.name}: {len(prompts)} prompts of {n} tokens",
        progress=lambda done, total: progress(done, total, "calibrating fp8 scales"),
    )


def _served_scales(args: argparse.Namespace) -> tuple[Path, KVScales] | None:
    """The scales file `headroom serve --kv-cache-dtype fp8` applies (the engine's lookup and
    parser), with its path; None when the model directory has none."""
    path = model_scales_path(args.model)
    if path is None:
        return None
    try:
        return path, read_scales(path)
    except KVScalesError as exc:
        raise UsageError(str(exc)) from None


def _check_scales_fit(served: tuple[Path, KVScales], loaded: LoadedModel) -> None:
    """The engine's `apply_scales` on one-slot fp8 caches: a file for another model (layers,
    KV heads) exits 2 with its message before the check, as the engine refuses to start."""
    path, scales = served
    cfg = loaded.config
    probe = [
        allocate_layer_cache(1, 1, cfg.num_kv_heads, cfg.head_dim, torch.float32, "fp8")
        for _ in range(cfg.num_layers)
    ]
    try:
        apply_scales(probe, scales)
    except KVScalesError as exc:
        raise UsageError(f"{path}: {exc}") from None


def _say_what_calibrate_replaces(args: argparse.Namespace, scales_path: Path) -> None:
    """On stderr (even with --quiet): the file --calibrate will replace, and a model directory's
    scales file that the engine keeps applying when --scales-out writes elsewhere."""
    if scales_path.exists():
        print(
            f"headroom kv-check: note: --calibrate replaces the existing {scales_path} once "
            "the check has run",
            file=sys.stderr,
        )
    served = model_scales_path(args.model)
    if served is not None and served.resolve() != scales_path.resolve():
        print(
            f"headroom kv-check: note: {served} stays, and headroom serve applies it, not the "
            f"scales written to {scales_path}",
            file=sys.stderr,
        )


def _scales_path(args: argparse.Namespace) -> Path:
    """Where --calibrate writes: --scales-out, else the model directory (resolved up front)."""
    if args.scales_out is not None:
        if str(args.scales_out) == "-":
            raise UsageError(
                "--scales-out -: the scales go to a file, not stdout; the engine reads them "
                f"only from MODEL/{SCALES_FILE}"
            )
        return Path(args.scales_out)
    model_dir = Path(args.model).expanduser()
    if not model_dir.is_dir():
        raise UsageError(
            f"--calibrate needs --scales-out: {args.model} is not a model directory to write "
            f"{SCALES_FILE} into"
        )
    return model_dir / SCALES_FILE


def _write_scales(path: Path, scales: KVScales) -> None:
    try:
        write_scales(scales, path)
    except OSError as exc:
        raise UsageError(f"cannot write the scales to {path}: {exc} (use --scales-out)") from None


def _write(path: Path, text: str) -> None:
    try:
        write_output(path, text)
    except OSError as exc:
        if str(path) == "-":
            raise  # stdout: the command line's one line for an output it cannot write
        raise UsageError(f"cannot write {path}: {exc}") from None
