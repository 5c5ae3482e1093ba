"""The rules a request must meet before it is queued (`validation.py`), at their boundaries:
the first and last ids of the vocabulary, and a budget that exactly fills `max_model_len`."""

from __future__ import annotations

import pytest

from headroom.engine.errors import RequestRejected
from headroom.engine.validation import check_prompt, resolve_max_tokens


def test_the_first_and_last_ids_of_the_vocabulary_are_accepted() -> None:
    """Valid ids are `0 <= id < vocab_size`: both ends are in, one past either end is out."""
    check_prompt([0, 99], 100)
    for bad in (100, -1):
        with pytest.raises(RequestRejected, match=r"token ids \[" + str(bad)) as info:
            check_prompt([0, bad], 100)
        assert (info.value.param, info.value.code) == ("prompt", "invalid_token_id")


def test_a_rejection_names_only_the_first_five_bad_ids() -> None:
    """The error body stays small however many ids of a long prompt are out of range."""
    with pytest.raises(RequestRejected) as info:
        check_prompt([1, *range(100, 200)], 100)
    assert "token ids [100, 101, 102, 103, 104] are outside the vocabulary of 100" in str(
        info.value
    )


def test_an_empty_prompt_is_rejected_naming_where_it_is() -> None:
    """An empty prompt is rejected, named by `where` (a batch names which of its prompts)."""
    with pytest.raises(RequestRejected, match="prompt 3 is empty") as info:
        check_prompt([], 100, where="prompt 3")
    assert (info.value.param, info.value.code) == ("prompt", "empty_prompt")


def test_a_budget_that_exactly_fills_max_model_len_is_accepted() -> None:
    """prompt + max_tokens == max_model_len fits; one more token does not."""
    assert resolve_max_tokens(1000, 24, 1024) == 24
    with pytest.raises(RequestRejected, match="1000 \\+ max_tokens 25 = 1025") as info:
        resolve_max_tokens(1000, 25, 1024)
    assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")


def test_one_token_is_the_smallest_budget() -> None:
    """max_tokens 1 is served as asked; 0 or less is rejected naming the field as sent."""
    assert resolve_max_tokens(10, 1, 1024) == 1
    for bad in (0, -5):
        with pytest.raises(RequestRejected, match=f"at least 1, got {bad}") as info:
            resolve_max_tokens(10, bad, 1024, max_tokens_param="max_completion_tokens")
        assert info.value.param == "max_completion_tokens"


def test_no_max_tokens_takes_all_the_room_left_and_a_full_prompt_leaves_none() -> None:
    """None: max_model_len - prompt_len, down to 1; a prompt of max_model_len tokens is
    rejected on the prompt field, whatever max_tokens says."""
    assert resolve_max_tokens(1, None, 1024) == 1023
    assert resolve_max_tokens(1023, None, 1024) == 1
    for max_tokens in (None, 1):
        with pytest.raises(RequestRejected, match="leaving no room") as info:
            resolve_max_tokens(1024, max_tokens, 1024, prompt_param="messages")
        assert (info.value.param, info.value.code) == ("messages", "context_length_exceeded")
