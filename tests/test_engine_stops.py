"""Stop strings against the text the detokenizer flushes when a completion ends (`stops.py`):
held-back bytes that complete at the end are checked like any other text, so a stop string in
them never reaches the output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pytest

from headroom.engine.model.tokenizer import IncrementalDetokenizer
from headroom.engine.requests import Completion, Request
from headroom.engine.sampling import SamplingParams
from headroom.engine.stops import add_token


class _MergedBytes:
    """Token 0 = b'Hi', 1 = b'\\n\\xe2' (a newline merged with the lead byte of a 3-byte
    character, as byte-level BPE vocabularies have), 2 = b'\\x80\\x94' (the rest of an em dash),
    3 = b'!'. Token 1's text is held back (it ends in an incomplete character) until the next
    token completes it or the completion ends and it is flushed."""

    vocab_size = 4
    bos_token_id = None
    eos_token_ids: frozenset[int] = frozenset()
    table: ClassVar[dict[int, bytes]] = {0: b"Hi", 1: b"\n\xe2", 2: b"\x80\x94", 3: b"!"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return []

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.table[i] for i in token_ids).decode("utf-8", errors="replace")


def _run(tokens: list[int], params: SamplingParams) -> Completion:
    comp = Completion(0, 0, None, IncrementalDetokenizer(_MergedBytes(), [0]))
    for t in tokens:
        assert comp.finish_reason is None
        add_token(comp, t, params, frozenset())
    return comp


def test_a_stop_string_in_text_flushed_at_length_cuts_the_text_and_stops() -> None:
    comp = _run([0, 1], SamplingParams(max_tokens=2, stop=["\n"]))
    assert comp.text == "Hi"
    assert comp.finish_reason == "stop" and comp.stop_reason == "\n"


def test_a_stop_string_spanning_emitted_and_flushed_text_is_found() -> None:
    comp = _run([0, 1], SamplingParams(max_tokens=2, stop=["i\n"]))
    assert comp.text == "H"
    assert comp.finish_reason == "stop" and comp.stop_reason == "i\n"


def test_a_stop_string_in_text_flushed_at_a_stop_token_wins_over_the_token() -> None:
    comp = _run([0, 1, 3], SamplingParams(max_tokens=8, stop=["\n"], stop_token_ids=[3]))
    assert comp.token_ids == [0, 1, 3]
    assert comp.text == "Hi"
    assert comp.finish_reason == "stop" and comp.stop_reason == "\n"


@pytest.mark.parametrize("stop", [[], ["never"]])
def test_flushed_text_without_a_stop_string_is_kept(stop: list[str]) -> None:
    comp = _run([0, 1], SamplingParams(max_tokens=2, stop=stop))
    assert comp.text == "Hi\n\ufffd"
    assert comp.finish_reason == "length" and comp.stop_reason is None
    comp = _run([0, 1, 3], SamplingParams(max_tokens=8, stop=stop, stop_token_ids=[3]))
    assert comp.text == "Hi\n\ufffd"
    assert comp.finish_reason == "stop" and comp.stop_reason == 3


def test_a_completed_character_is_still_checked_as_it_arrives() -> None:
    comp = _run([0, 1, 2], SamplingParams(max_tokens=3, stop=["\u2014"]))
    assert comp.text == "Hi\n"
    assert comp.finish_reason == "stop" and comp.stop_reason == "\u2014"


def test_the_streamed_deltas_never_expose_a_stop_string_in_flushed_text() -> None:
    params = SamplingParams(max_tokens=2, stop=["\n"])
    req = Request("r", [0], params, 0.0)
    comp = Completion(0, 0, None, IncrementalDetokenizer(_MergedBytes(), [0]))
    req.completions.append(comp)
    streamed = ""
    for t in (0, 1):
        add_token(comp, t, params, frozenset())
        out = req.output([comp], req.finished).outputs[0]
        streamed += out.text
    assert req.finished
    assert streamed == "Hi" and out.cumulative_text == "Hi"
    assert out.finish_reason == "stop"
