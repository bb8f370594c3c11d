"""The request checks every front and worker entry point shares (``modeling/request_check.py``)."""

from __future__ import annotations

import pytest

from modeling.errors import InvalidRequestError
from modeling.params import SamplingParams
from modeling.request_check import check_request, check_request_id, check_room_to_generate, check_token_ids


@pytest.mark.parametrize("request_id,reason", [
    ("", "must be a non-empty string"),
    (None, "must be a non-empty string"),
    ("chat-1#2", "'#<number>' ends the ids of a request's further sequences"),
])
def test_request_ids(request_id, reason):
    with pytest.raises(InvalidRequestError) as err:
        check_request_id(request_id)
    assert (err.value.field, err.value.reason.split(": ", 1)[-1]) == ("request_id", reason)
    check_request_id("chat-1#x")  # only a numeric suffix names a further sequence


def test_token_ids_name_the_offending_element_and_the_empty_field():
    assert check_token_ids((1, 2, 3), 10, "prompt_ids") == [1, 2, 3]
    for bad in (10, -1, True, 2.0, "3"):
        with pytest.raises(InvalidRequestError, match=r"^prompt_ids\[1\]: must be an integer in \[0, 10\)"):
            check_token_ids([1, bad], 10, "prompt_ids")
    with pytest.raises(InvalidRequestError, match="^prompt: must not be empty"):
        check_token_ids([], 10, "prompt_token_ids", empty_field="prompt")


def test_room_to_generate_and_the_whole_check():
    check_room_to_generate(1023, 1024)
    with pytest.raises(InvalidRequestError, match="^prompt_ids: 1024 tokens leave no room to generate"):
        check_room_to_generate(1024, 1024, "prompt_ids")
    assert check_request("r", (4, 5), SamplingParams(max_tokens=3), 10) == [4, 5]
    with pytest.raises(InvalidRequestError, match="^temperature: must be >= 0.0"):
        check_request("r", (4, 5), SamplingParams(temperature=-1.0), 10)
