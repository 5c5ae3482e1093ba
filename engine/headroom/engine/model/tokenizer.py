"""Tokenizers the engine uses (byte-level built-in, Hugging Face `tokenizer.json`) and the
incremental detokenizer that turns a growing token list into text deltas."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with BOS when the model expects one and asked)."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; incomplete UTF-8 at the end decodes to U+FFFD."""
        ...


class ByteTokenizer:
    """Bytes 0-255 are tokens 0-255; 256 is BOS and 257 EOS (the tiny model's vocabulary)."""

    BOS = 256
    EOS = 257

    def __init__(self, vocab_size: int = 258) -> None:
        if vocab_size < 258:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 258, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id: int | None = self.BOS
        self.eos_token_ids = frozenset({self.EOS})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(t for t in token_ids if 0 <= t < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from a local `tokenizer.json`."""

    def __init__(
        self,
        path: str | Path,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string, None when the vocabulary lacks it."""
        tid = self._tok.token_to_id(token)
        return None if tid is None else int(tid)


class IncrementalDetokenizer:
    """Text deltas for a growing list of output tokens.

    Decodes a short window of recent tokens (so byte-level BPE and SentencePiece merges and
    leading spaces come out right) and holds text back while it ends in an incomplete UTF-8
    sequence; the same scheme vLLM uses.
    """

    __slots__ = ("_ids", "_prefix_offset", "_read_offset", "_tokenizer", "text")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-6:])
        self._prefix_offset = max(0, len(self._ids) - 5)
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Keep the window short: text already emitted needs only a few tokens of context.
        if self._prefix_offset > 64:
            drop = self._prefix_offset
            self._ids = self._ids[drop:]
            self._prefix_offset -= drop
            self._read_offset -= drop
        self.text += delta
        return delta

    def flush(self) -> str:
        """Text held back at the end of the output (an incomplete character), as decoded."""
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tokenizer.decode(self._ids[self._prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
