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
from headroom.engine.stops import _append_text, add_token


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


def _comp() -> Completion:
    return Completion(0, 0, None, IncrementalDetokenizer(_MergedBytes(), [0]))


def _run(tokens: list[int], params: SamplingParams) -> Completion:
    comp = _comp()
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


# Each stop string is searched only from its own length before the new text (as vLLM does): a
# long stop string must not make the search for the others cover the whole text on every token.


class _FindSpy(str):
    """The completion's text, recording what each `find` is asked to scan: (stop string,
    characters from the start of the search to the end of the text)."""

    calls: ClassVar[list[tuple[str, int]]] = []

    def __add__(self, other: str) -> _FindSpy:
        return _FindSpy(str(self) + other)

    def find(self, sub: str, start: object = None, end: object = None) -> int:
        assert isinstance(start, int) and end is None
        _FindSpy.calls.append((sub, len(self) - start))
        return str.find(self, sub, start)


def _feed(deltas: list[str], params: SamplingParams) -> Completion:
    comp = _comp()
    for d in deltas:
        if comp.finish_reason is not None:
            break
        _append_text(comp, d, params)
    return comp


def test_each_stop_string_is_searched_only_where_it_could_end_in_the_new_text() -> None:
    long_stop = "x" * 1000
    params = SamplingParams(max_tokens=4096, stop=["<|end|>", "\n\n", long_stop])
    comp = _comp()
    comp.text = _FindSpy("")
    _FindSpy.calls = []
    deltas = ["word "] * 500
    for d in deltas:
        assert not _append_text(comp, d, params)
    assert len(_FindSpy.calls) == len(deltas) * 3
    for sub, scanned in _FindSpy.calls:
        assert scanned <= len(sub) - 1 + len("word ")  # not the long sibling's window
    # The short strings' total scan stays per-token constant however long the text grows.
    short = sum(n for sub, n in _FindSpy.calls if sub != long_stop)
    assert short <= len(deltas) * (len("<|end|>") - 1 + len("\n\n") - 1 + 2 * len("word "))


@pytest.mark.parametrize("long_first", [False, True])
def test_a_stop_string_spanning_deltas_is_found_beside_a_long_one(long_first: bool) -> None:
    stop = ["<|end|>", "y" * 500]
    params = SamplingParams(max_tokens=64, stop=stop[::-1] if long_first else stop)
    comp = _feed(["some text <", "|e", "n", "d|", "> more"], params)
    assert comp.text == "some text "
    assert comp.finish_reason == "stop" and comp.stop_reason == "<|end|>"


def test_a_longer_stop_string_begun_in_earlier_text_wins_over_a_later_short_one() -> None:
    # "abcdef" started in the previous delta; "S" lies wholly in the new one, listed first.
    comp = _feed(["xxabc", "defS"], SamplingParams(max_tokens=8, stop=["S", "abcdef"]))
    assert comp.text == "xx" and comp.stop_reason == "abcdef"


def test_the_earliest_match_wins_and_a_tie_goes_to_the_first_listed() -> None:
    params = SamplingParams(max_tokens=8, stop=["cdef", "abcdefgh"])
    comp = _feed(["ab", "cdefgh"], params)  # both end in the same delta: the longer starts first
    assert comp.text == "" and comp.stop_reason == "abcdefgh"
    comp = _feed(["ab", "cdef", "gh"], params)  # "cdef" ends first and stops the completion
    assert comp.text == "ab" and comp.stop_reason == "cdef"
    comp = _feed(["xab", "cd"], SamplingParams(max_tokens=8, stop=["abc", "abcd", "ab"]))
    assert comp.text == "x" and comp.stop_reason == "ab"  # "ab" ended in the first delta
    comp = _feed(["xa", "bcd"], SamplingParams(max_tokens=8, stop=["abcd", "abc", "ab"]))
    assert comp.text == "x" and comp.stop_reason == "abcd"  # all start at 1: first listed


def test_multibyte_stop_strings_are_found_across_deltas_beside_a_long_one() -> None:
    params = SamplingParams(max_tokens=64, stop=["終わり", "\U0001f600" * 300])
    comp = _feed(["これで終", "わり です"], params)
    assert comp.text == "これで" and comp.stop_reason == "終わり"
    comp = _run([0, 1, 2], SamplingParams(max_tokens=3, stop=["\n\u2014", "z" * 300]))
    assert comp.text == "Hi" and comp.stop_reason == "\n\u2014"


def test_streaming_beside_a_long_stop_string_never_leaks_part_of_a_short_one() -> None:
    params = SamplingParams(max_tokens=64, stop=["<end>", "Z" * 20])
    req = Request("r", [0], params, 0.0)
    comp = _comp()
    req.completions.append(comp)
    streamed = ""
    for ch in "hello there, friend <end> and more":
        if req.finished:
            break
        _append_text(comp, ch, params)
        out = req.output([comp], req.finished).outputs[0]
        streamed += out.text
        assert "hello there, friend ".startswith(streamed)
    assert streamed == "hello there, friend " and out.finish_reason == "stop"


def _stream(deltas: list[str], params: SamplingParams) -> list[str]:
    """The text of each output while `deltas` arrive, none of them ending the completion."""
    req = Request("r", [0], params, 0.0)
    comp = _comp()
    req.completions.append(comp)
    outs = []
    for d in deltas:
        assert not _append_text(comp, d, params)
        outs.append(req.output([comp], req.finished).outputs[0].text)
    return outs


def test_only_the_last_max_stop_len_minus_one_characters_are_held_back() -> None:
    """Text that can no longer begin a stop string streams as soon as it arrives: a delta holds
    back exactly the last len(longest stop) - 1 characters, never what it already released."""
    params = SamplingParams(max_tokens=64, stop=["<end>", "!!"])
    outs = _stream(["abc", "defg", "h", "", "ijklmnop"], params)
    assert outs == ["", "abc", "d", "", "efghijkl"]  # held: abc, defg, efgh, efgh, mnop
    assert "".join(outs) == "abcdefghijklmnop"[:-4]


def test_without_stop_strings_every_delta_streams_whole() -> None:
    """No stop string: nothing is held back, each output carries all its new text at once."""
    outs = _stream(["a", "bc", "def"], SamplingParams(max_tokens=64))
    assert outs == ["a", "bc", "def"]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_ends_a_completion_unless_ignore_eos(ignore_eos: bool) -> None:
    """EOS stops with the token kept (its text is not, as in vLLM), as a stop token id does;
    `ignore_eos` generates on to `max_tokens` (a benchmark's fixed-length output)."""
    params = SamplingParams(max_tokens=3, ignore_eos=ignore_eos)
    comp = _comp()
    add_token(comp, 3, params, frozenset({3}))
    if ignore_eos:
        assert comp.finish_reason is None
        add_token(comp, 3, params, frozenset({3}))
        add_token(comp, 0, params, frozenset({3}))
        assert comp.finish_reason == "length" and comp.token_ids == [3, 3, 0]
    else:
        assert comp.finish_reason == "stop" and comp.stop_reason == 3
        assert comp.token_ids == [3] and comp.text == ""
