"""Detokenization and stop conditions of one completion, in the order they are checked: a stop
token id or EOS (unless `ignore_eos`) ends it with the token kept; a stop string ends it with
the text cut before the string; `max_tokens` ends it with `length`."""

from __future__ import annotations

from collections.abc import Set

from headroom.engine.outputs import FinishReason
from headroom.engine.requests import Completion
from headroom.engine.sampling import SamplingParams


def add_token(comp: Completion, token: int, params: SamplingParams, eos: Set[int]) -> None:
    """Record one sampled token: its text, and the finish reason when it ends `comp`."""
    comp.token_ids.append(token)
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
        finish(comp, "stop", token, params)
        return
    if _append_text(comp, comp.detok.add(token), params):
        return
    if len(comp.token_ids) >= params.max_tokens:
        finish(comp, "length", None, params)


def _append_text(comp: Completion, delta: str, params: SamplingParams) -> bool:
    """Append `delta` to the text; when a stop string now appears, cut the text before it and
    end `comp` with that stop string (returns True)."""
    if not delta:
        return False
    old = len(comp.text)
    comp.text += delta
    # Only a stop string ending in the new text can be new (one wholly in the old text ended
    # the completion when it arrived), so each is searched from its own length before the new
    # text, as vLLM does: a long stop string must not widen the others' search to the whole
    # text on every token. The first match of each is the same as from any earlier start.
    text = comp.text
    hits = [(i, s) for s in params.stop if (i := text.find(s, max(0, old - len(s) + 1))) >= 0]
    if not hits:
        return False
    at, stop = min(hits, key=lambda h: h[0])  # the earliest; a tie goes to the first listed
    comp.text = text[:at]
    comp.finish_reason = "stop"
    comp.stop_reason = stop
    return True


def finish(
    comp: Completion, reason: FinishReason, stop_reason: int | None, params: SamplingParams
) -> None:
    """End `comp` by a stop token, EOS or length. The detokenizer's held-back bytes are flushed
    first, and checked for stop strings like any other text: a stop string in them cuts the
    text there and ends `comp` with that string instead."""
    if _append_text(comp, comp.detok.flush(), params):
        return
    comp.finish_reason = reason
    comp.stop_reason = stop_reason
