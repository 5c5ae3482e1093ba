"""The user's documents for `--prompts`, and the haystacks cut from them.

Accepted files: JSON lines (one object per line with a `text` or `prompt` string, or a bare
JSON string), a JSON array of such items, or any other text file as one document. Every
problem is a `PromptsError` naming the file (and line) and what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from headroom.contract.jsonfile import parse_json


class PromptsError(ValueError):
    """The prompts file cannot be used; the message says why."""


def _text_of(item: Any, where: str) -> str:
    text: object
    if isinstance(item, str):
        text = item
    elif isinstance(item, dict):
        text = item.get("text", item.get("prompt"))
        if not isinstance(text, str):
            raise PromptsError(f"{where}: an object needs a string 'text' (or 'prompt') field")
    else:
        raise PromptsError(f"{where}: expected a string or an object, got {type(item).__name__}")
    assert isinstance(text, str)
    if not text.strip():
        raise PromptsError(f"{where}: the document is empty")
    return text


def read_documents(path: Path) -> list[str]:
    """The documents in `path` (see the module docstring for the formats)."""
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PromptsError(f"prompts file {path} does not exist") from None
    except IsADirectoryError:
        raise PromptsError(f"prompts file {path} is a directory") from None
    except UnicodeDecodeError as exc:
        raise PromptsError(f"prompts file {path} is not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise PromptsError(f"cannot read prompts file {path}: {exc}") from None
    if not raw.strip():
        raise PromptsError(f"prompts file {path} is empty")
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            data = parse_json(raw)
        except ValueError as exc:
            raise PromptsError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(data, list) or not data:
            raise PromptsError(f"{path}: expected a non-empty JSON array of documents")
        return [_text_of(item, f"{path} item {i}") for i, item in enumerate(data)]
    if suffix in (".jsonl", ".ndjson"):
        docs = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = parse_json(line)
            except ValueError as exc:
                raise PromptsError(f"{path} line {n} is not valid JSON: {exc}") from None
            docs.append(_text_of(item, f"{path} line {n}"))
        return docs
    return [raw]


class Haystacks:
    """Token windows cut from the documents, all tokenized once and joined into one stream;
    window i starts at its own offset and wraps around when the stream is shorter."""

    def __init__(self, documents: Sequence[Sequence[int]], bos: int | None) -> None:
        self.stream = [t for doc in documents for t in doc]
        if not self.stream:
            raise PromptsError("the documents tokenize to no tokens")
        self.bos = bos

    def window(self, i: int, n: int, count: int) -> list[int]:
        """`n` tokens for prompt `i` of `count`, offsets spread evenly over the stream."""
        size = len(self.stream)
        start = (i * size) // max(count, 1)
        return [self.stream[(start + j) % size] for j in range(max(n, 0))]

    def with_bos(self, tokens: list[int]) -> list[int]:
        return tokens if self.bos is None else [self.bos, *tokens]

    @property
    def num_tokens(self) -> int:
        return len(self.stream)
