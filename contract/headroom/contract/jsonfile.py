"""A user's JSON file read as a mapping (a model's `config.json`, its `tokenizer_config.json`, a
shard index), with errors that name the file on one line; and pydantic's report on one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError


def parse_json(raw: str | bytes) -> Any:
    """`json.loads`, with arrays or objects nested past the parser's recursion limit raised
    as the ValueError every other malformed document raises (it is a RecursionError)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_text(file: Path) -> str:
    """The file's text; ValueError naming it when it is not UTF-8 (OSError as reading raises)."""
    try:
        return file.read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text: {e}") from None


def read_json_object(file: Path, unreadable: str = "not valid JSON") -> dict[str, Any]:
    """The JSON object `file` holds. ValueError naming the file when it is not UTF-8, not JSON
    (`unreadable` says so, then why) or not an object; OSError as reading raises it."""
    text = read_text(file)
    try:
        data = parse_json(text)
    except ValueError as e:  # JSONDecodeError, or an integer of more digits than Python reads
        raise ValueError(f"{file}: {unreadable}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def fields_line(err: ValidationError) -> str:
    """pydantic's errors as `field: message; ...` on one line, without its links."""
    return "; ".join(
        f"{'.'.join(str(x) for x in e['loc']) or 'config'}: {e['msg']}"
        for e in err.errors(include_url=False)
    )
