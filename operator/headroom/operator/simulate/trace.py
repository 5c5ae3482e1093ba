"""Request traces: read from the formats real services publish, or made from a rate shape.

Formats read (`read_trace` picks by content, `fmt` forces one):
- **azure**: the Azure LLM inference trace CSV, header `TIMESTAMP,ContextTokens,GeneratedTokens`,
  timestamps `YYYY-MM-DD HH:MM:SS.fffffff` (no zone: read as UTC; an offset such as `+01:00` or
  `Z`, as later Azure traces write, is converted to UTC).
- **mooncake**: Mooncake's JSON lines, `timestamp` (ms after the first request),
  `input_length`, `output_length`, `hash_ids` (prefix-chained ids of 512-token blocks).
- **csv**: the generic CSV, header `arrival_s,prompt_tokens,output_tokens` (seconds from any
  origin; extra columns are ignored).
- **jsonl**: the generic JSON lines, `{"arrival_s": .., "prompt_tokens": .., "output_tokens":
  .., "prefix_block_ids": [..] (optional), "prefix_block_tokens": 512 (optional)}`.

A bad file raises `TraceError` naming the file, the line and the reason; the CLI turns it into
exit 2. A reader reports its progress through `progress(lines read, lines in the file)`.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Literal

import numpy as np

TraceFormat = Literal["azure", "mooncake", "csv", "jsonl"]
FORMATS: tuple[TraceFormat, ...] = ("azure", "mooncake", "csv", "jsonl")
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
GENERIC_HEADER = ("arrival_s", "prompt_tokens", "output_tokens")
MOONCAKE_BLOCK_TOKENS = 512
MAX_REQUEST_TOKENS = 10_000_000  # the CRD's largest traffic.contextTokens
# Block ids are kept in int64 arrays: an id outside that range cannot be counted.
MIN_BLOCK_ID, MAX_BLOCK_ID = -(2**63), 2**63 - 1
# An Azure TIMESTAMP: date, time, any number of fractional digits, an optional zone (ASCII
# digits only: str.isdigit() and int() also take other scripts' digits).
AZURE_STAMP = re.compile(
    r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d+))?(Z|[+-]\d{2}:\d{2})?", re.ASCII
)
# A replay and its profile keep arrays per second of the trace: a trace longer than a month is
# most likely one bad timestamp (a 0 among epoch seconds), not a month of traffic.
MAX_TRACE_SECONDS = 31 * 86_400
PROGRESS_EVERY = 50_000  # lines between two progress reports

LineProgress = Callable[[int, int], None]  # (lines read, lines in the file)


class TraceError(ValueError):
    """A trace file that cannot be read, with the line and the reason."""


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival: seconds from the first, prompt and output tokens, and the
    prefix-chained block ids of each prompt where the trace has them."""

    name: str
    arrival: np.ndarray  # float seconds, first request at 0, non-decreasing
    prompt: np.ndarray  # int tokens
    output: np.ndarray  # int tokens
    prefix_blocks: tuple[tuple[int, ...], ...] | None = None
    prefix_block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        n = len(self.arrival)
        if not (len(self.prompt) == len(self.output) == n):
            raise ValueError("arrival, prompt and output must have one entry per request")
        if self.prefix_blocks is not None and len(self.prefix_blocks) != n:
            raise ValueError("prefix_blocks must have one entry per request")

    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def duration(self) -> float:
        """Seconds from the first arrival to the last."""
        return float(self.arrival[-1] - self.arrival[0]) if len(self) else 0.0


def _days(seconds: float) -> str:
    """A span in days, readable whether it is just over the limit or from another clock."""
    days = seconds / 86_400
    if days < 100:
        return f"{days:,.1f} days"
    return f"{days:,.0f} days" if days < 1e6 else f"{days:.2g} days"


def _trace(
    name: str,
    rows: list[tuple[float, int, int]],
    blocks: list[tuple[int, ...]] | None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Trace:
    if not rows:
        raise TraceError(f"{name}: no requests")
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])
    t0 = rows[order[0]][0]
    span = rows[order[-1]][0] - t0
    if span > MAX_TRACE_SECONDS:
        raise TraceError(
            f"{name}: arrivals span {_days(span)} ({t0:g} to {rows[order[-1]][0]:g} "
            f"s), more than the {MAX_TRACE_SECONDS // 86_400} a trace may: is one timestamp "
            "from another clock?"
        )
    return Trace(
        name=name,
        arrival=np.array([rows[i][0] - t0 for i in order], dtype=float),
        prompt=np.array([rows[i][1] for i in order], dtype=np.int64),
        output=np.array([rows[i][2] for i in order], dtype=np.int64),
        prefix_blocks=None if blocks is None else tuple(blocks[i] for i in order),
        prefix_block_tokens=block_tokens,
    )


def _count(value: object, what: str, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool):
        raise TraceError(f"{where}: {what} must be an integer, got {value!r}")
    try:
        n = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise TraceError(f"{where}: {what} must be an integer, got {value!r}") from None
    if n < minimum:
        raise TraceError(f"{where}: {what} must be at least {minimum}, got {n}")
    if n > MAX_REQUEST_TOKENS:
        raise TraceError(f"{where}: {what} must be at most {MAX_REQUEST_TOKENS:,}, got {n}")
    return n


def _request(t: float, prompt: int, output: int, where: str) -> tuple[float, int, int]:
    """One request; its whole context (prompt + output) must fit the CRD's contextTokens,
    which `headroom profile` suggests from these lengths."""
    if prompt + output > MAX_REQUEST_TOKENS:
        raise TraceError(
            f"{where}: prompt + output tokens must be at most {MAX_REQUEST_TOKENS:,}, got "
            f"{prompt:,} + {output:,}"
        )
    return t, prompt, output


def _seconds(value: object, where: str) -> float:
    if isinstance(value, bool):  # JSON true is no time, though Python counts it as 1
        raise TraceError(f"{where}: arrival time must be a number, got {value!r}")
    try:
        t = float(str(value).strip()) if not isinstance(value, int | float) else float(value)
    except ValueError:
        raise TraceError(f"{where}: arrival time must be a number, got {value!r}") from None
    except OverflowError:  # a JSON integer beyond a float's range
        shown = f"{str(value)[:24]}..."
        raise TraceError(f"{where}: arrival time must be finite, got {shown}") from None
    if not math.isfinite(t):
        raise TraceError(f"{where}: arrival time must be finite, got {value!r}")
    return t


def _csv_rows(
    text: str, name: str, header: tuple[str, ...], progress: LineProgress | None
) -> Iterator[tuple[int, list[str]]]:
    # Extra columns are ignored, and one may hold whole prompts: no field limit below the file.
    csv.field_size_limit(max(csv.field_size_limit(), len(text) + 1))
    # strict: an unterminated quote is an error, not a field that swallows the rest of the file.
    reader = csv.reader(io.StringIO(text), strict=True)
    try:
        # Blank lines (only whitespace) are skipped wherever they are, the header's line too,
        # as the format detection and the JSON readers skip them.
        first = next((r for r in reader if any(c.strip() for c in r)), None)
        if first is None or tuple(c.strip() for c in first[: len(header)]) != header:
            raise TraceError(
                f"{name}:{reader.line_num}: expected the header {','.join(header)}, got {first}"
            )
        total = text.count("\n") + 1
        for row in reader:
            if progress is not None and reader.line_num % PROGRESS_EVERY == 0:
                progress(reader.line_num, total)
            if any(c.strip() for c in row):
                yield reader.line_num, row
    except csv.Error as exc:
        raise TraceError(f"{name}:{reader.line_num}: not CSV: {exc}") from None


def _azure_seconds(stamp: str, where: str) -> float:
    """Seconds since the epoch of an Azure TIMESTAMP. The fraction is added apart: Azure writes
    seven digits, Python's parser takes six. Without a zone it is read as UTC, so that the
    machine's zone (and its daylight-saving jumps) cannot move arrivals; with one (`Z`,
    `+01:00`) it is converted to UTC, with or without a fraction."""
    match = AZURE_STAMP.fullmatch(stamp)
    try:
        if match is None:
            raise ValueError(stamp)
        day, clock, frac, zone = match.groups()
        offset = "+00:00" if zone in (None, "Z") else zone
        t = datetime.fromisoformat(f"{day}T{clock}{offset}").timestamp()
    except ValueError:
        raise TraceError(
            f"{where}: TIMESTAMP must be YYYY-MM-DD HH:MM:SS.fffffff (optionally with a zone such "
            f"as +01:00), got {stamp!r}"
        ) from None
    return t + (float("0." + frac) if frac else 0.0)


def read_azure(text: str, name: str = "azure", progress: LineProgress | None = None) -> Trace:
    """The Azure LLM inference trace CSV."""
    rows: list[tuple[float, int, int]] = []
    for line, row in _csv_rows(text, name, AZURE_HEADER, progress):
        where = f"{name}:{line}"
        if len(row) < 3:
            raise TraceError(f"{where}: expected 3 columns, got {len(row)}")
        t = _azure_seconds(row[0].strip(), where)
        rows.append(
            _request(
                t, _count(row[1], "ContextTokens", where), _count(row[2], "GeneratedTokens", where),
                where,
            )
        )  # fmt: skip
    return _trace(name, rows, None)


def read_generic_csv(text: str, name: str = "trace", progress: LineProgress | None = None) -> Trace:
    """The generic CSV: arrival_s,prompt_tokens,output_tokens."""
    rows: list[tuple[float, int, int]] = []
    for line, row in _csv_rows(text, name, GENERIC_HEADER, progress):
        where = f"{name}:{line}"
        if len(row) < 3:
            raise TraceError(f"{where}: expected 3 columns, got {len(row)}")
        rows.append(
            _request(
                _seconds(row[0], where),
                _count(row[1], "prompt_tokens", where),
                _count(row[2], "output_tokens", where),
                where,
            )
        )
    return _trace(name, rows, None)


def _json_object(raw: str, where: str) -> object:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON: {exc.msg}") from None
    except RecursionError:
        raise TraceError(f"{where}: not JSON this reads: nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise TraceError(f"{where}: not JSON this reads: {str(exc).split(':')[0]}") from None


def _json_lines(
    text: str, name: str, progress: LineProgress | None
) -> Iterator[tuple[str, dict[str, object]]]:
    # Only "\n" ends a JSON line: splitlines() would also break at U+2028, U+2029 and U+0085,
    # which JSON strings may hold raw.
    lines = text.split("\n")
    for i, raw in enumerate(lines, start=1):
        if progress is not None and i % PROGRESS_EVERY == 0:
            progress(i, len(lines))
        if not raw.strip():
            continue
        where = f"{name}:{i}"
        obj = _json_object(raw, where)
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        yield where, obj


def _ids(value: object, where: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    ):
        raise TraceError(f"{where}: {what} must be a list of integers")
    if value and not MIN_BLOCK_ID <= min(value) <= max(value) <= MAX_BLOCK_ID:
        x = next(x for x in value if not MIN_BLOCK_ID <= x <= MAX_BLOCK_ID)
        shown = str(x) if len(str(x)) <= 24 else f"{str(x)[:24]}..."
        raise TraceError(
            f"{where}: {what} must be 64-bit integers (at most {MAX_BLOCK_ID:,} in size), "
            f"got {shown}"
        )
    return tuple(value)


def _need(obj: dict[str, object], key: str, where: str) -> object:
    if key not in obj:
        raise TraceError(f"{where}: missing {key!r}")
    return obj[key]


def read_mooncake(text: str, name: str = "mooncake", progress: LineProgress | None = None) -> Trace:
    """Mooncake's JSON lines (timestamp in ms)."""
    rows: list[tuple[float, int, int]] = []
    blocks: list[tuple[int, ...]] = []
    for where, obj in _json_lines(text, name, progress):
        prompt = _count(_need(obj, "input_length", where), "input_length", where)
        rows.append(
            _request(
                _seconds(_need(obj, "timestamp", where), where) / 1000.0,
                prompt,
                _count(_need(obj, "output_length", where), "output_length", where),
                where,
            )
        )
        ids = _ids(obj.get("hash_ids", []), where, "hash_ids")
        if ids and len(ids) != math.ceil(prompt / MOONCAKE_BLOCK_TOKENS):
            raise TraceError(
                f"{where}: {len(ids)} hash_ids for {prompt} tokens (expected "
                f"ceil({prompt} / {MOONCAKE_BLOCK_TOKENS}))"
            )
        blocks.append(ids)
    return _trace(name, rows, blocks)


def read_generic_jsonl(
    text: str, name: str = "trace", progress: LineProgress | None = None
) -> Trace:
    """The generic JSON lines (see the module docstring)."""
    rows: list[tuple[float, int, int]] = []
    blocks: list[tuple[int, ...]] = []
    wheres: list[str] = []
    block_tokens = MOONCAKE_BLOCK_TOKENS
    set_at: str | None = None  # where a line first set prefix_block_tokens
    for where, obj in _json_lines(text, name, progress):
        rows.append(
            _request(
                _seconds(_need(obj, "arrival_s", where), where),
                _count(_need(obj, "prompt_tokens", where), "prompt_tokens", where),
                _count(_need(obj, "output_tokens", where), "output_tokens", where),
                where,
            )
        )
        blocks.append(_ids(obj.get("prefix_block_ids", []), where, "prefix_block_ids"))
        wheres.append(where)
        if "prefix_block_tokens" in obj:
            n = _count(obj["prefix_block_tokens"], "prefix_block_tokens", where)
            if set_at is not None and n != block_tokens:
                # One size for the whole trace: the ids of blocks of two sizes cannot be compared.
                raise TraceError(
                    f"{where}: prefix_block_tokens is {n}, but line {set_at.rsplit(':', 1)[1]} "
                    f"set it to {block_tokens}: a trace has one block size"
                )
            block_tokens, set_at = n, set_at or where
    # Checked once the block size is final (any line may set it): a block starts inside the
    # prompt, or it holds no prompt token to hit.
    for (_, prompt, _), ids, where in zip(rows, blocks, wheres, strict=True):
        if len(ids) > math.ceil(prompt / block_tokens):
            raise TraceError(
                f"{where}: {len(ids)} prefix_block_ids for {prompt} tokens (at most "
                f"ceil({prompt} / {block_tokens}))"
            )
    return _trace(name, rows, blocks if any(blocks) else None, block_tokens)


_READERS: dict[TraceFormat, Callable[[str, str, LineProgress | None], Trace]] = {
    "azure": read_azure,
    "mooncake": read_mooncake,
    "csv": read_generic_csv,
    "jsonl": read_generic_jsonl,
}


def detect_format(text: str, path: Path) -> TraceFormat:
    """The format of a trace from its first line."""
    rest = text.lstrip()
    # Named by its line in the file: blank lines may come first.
    line = text.count("\n", 0, len(text) - len(rest)) + 1
    where = f"{path.name}:{line}"
    first = rest.split("\n", 1)[0].strip()
    if first.startswith("{"):
        obj = _json_object(first, where)
        return "mooncake" if isinstance(obj, dict) and "input_length" in obj else "jsonl"
    # Read as the CSV readers read it: a header a spreadsheet quoted is still the header.
    try:
        cells = next(csv.reader([first]), [])
    except csv.Error:
        cells = first.split(",")
    head = tuple(c.strip() for c in cells)
    if head[:3] == AZURE_HEADER:
        return "azure"
    if head[:3] == GENERIC_HEADER:
        return "csv"
    raise TraceError(
        f"{where}: not a trace this reads: expected the Azure header "
        f"{','.join(AZURE_HEADER)}, the CSV header {','.join(GENERIC_HEADER)}, or JSON lines"
    )


def _decode(data: bytes, path: Path) -> str:
    """The file's text: UTF-8, after the byte-order mark a spreadsheet's export starts with,
    every line ending "\n" (Windows' "\r\n" and the classic Mac's lone "\r" too)."""
    if data[:2] == b"\x1f\x8b":
        raise TraceError(f"{path}: cannot read: gzip-compressed (decompress it first: gunzip)")
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise TraceError(f"{path}: cannot read: UTF-16 (save it as UTF-8)")
    if b"\r" in data:
        # Before decoding, so that a line named below is the line an editor shows (a "\r"
        # byte is never part of a longer UTF-8 character).
        data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise TraceError(
            f"{path}: cannot read: line {line} is not UTF-8 (byte {data[exc.start]:#04x}: "
            f"{exc.reason})"
        ) from None


def read_trace(
    path: Path, fmt: TraceFormat | None = None, progress: LineProgress | None = None
) -> Trace:
    """Read a trace file, detecting its format unless `fmt` says; the trace is named after the
    file's stem, and errors name the file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from None
    text = _decode(data, path)
    if not text.strip():
        raise TraceError(f"{path.name}: empty file")
    kind = fmt or detect_format(text, path)
    return replace(_READERS[kind](text, path.name, progress), name=path.stem)


def scaled(trace: Trace, factor: float, seed: int, jitter_seconds: float) -> Trace:
    """`factor` times the trace's rate, keeping its shape: every request is replayed
    floor(`factor`) times, plus once more with the fractional part's probability, each copy
    moved by up to +-`jitter_seconds`. Different seeds give different realizations of the same
    traffic; at factor 1 the requests are exactly the trace's, only their times move."""
    if factor <= 0:
        raise ValueError(f"the rate factor must be positive, got {factor}")
    rng = np.random.default_rng(seed)
    whole = math.floor(factor)
    copies = whole + (rng.uniform(0, 1, len(trace)) < factor - whole)
    idx = np.repeat(np.arange(len(trace)), copies)
    if len(idx) == 0:
        raise TraceError(
            f"{trace.name}: a rate of {factor:g} leaves none of its {len(trace):,} requests"
        )
    t = trace.arrival[idx] + rng.uniform(-jitter_seconds, jitter_seconds, len(idx))
    order = np.argsort(t, kind="stable")
    idx, t = idx[order], np.clip(t[order], 0.0, None)
    blocks = None
    if trace.prefix_blocks is not None:
        blocks = tuple(trace.prefix_blocks[i] for i in idx)
    return Trace(
        name=trace.name,
        arrival=t - (t[0] if len(t) else 0.0),
        prompt=trace.prompt[idx],
        output=trace.output[idx],
        prefix_blocks=blocks,
        prefix_block_tokens=trace.prefix_block_tokens,
    )
