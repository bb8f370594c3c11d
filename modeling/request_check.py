"""What makes a request valid, defined once. The fronts (gRPC and the OpenAI HTTP API) check every request
with these before anything is admitted or placed; each worker entry point (usable on its own: the engine's
API, benchmarks, tests) runs the same checks on what it is handed, so a worker never holds a request the
fronts would refuse. Each check raises ``InvalidRequestError`` naming the field.

What depends on one worker's state (an id already in use there, a prompt larger than its KV cache) is the
worker's own check.
"""

from __future__ import annotations

from collections.abc import Sequence

from modeling.errors import InvalidRequestError
from modeling.forks import split_sequence_id
from modeling.params import SamplingParams


def check_request_id(request_id: str) -> None:
    """Not empty, and not ending in ``#<number>`` (the suffix that names a request's further sequences)."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id", "must be a non-empty string")
    if split_sequence_id(request_id)[1]:
        raise InvalidRequestError("request_id", f"{request_id!r}: '#<number>' ends the ids of a request's "
                                                "further sequences")


def check_token_ids(ids: Sequence, vocab_size: int, field: str, empty_field: str | None = None) -> list[int]:
    """``ids`` as a list: at least one, each an integer in [0, ``vocab_size``) (the element is named
    ``field[i]``; an empty list names ``empty_field``, by default ``field``)."""
    out = list(ids)
    for i, t in enumerate(out):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidRequestError(f"{field}[{i}]", f"must be an integer in [0, {vocab_size}), got {t!r}")
    if not out:
        raise InvalidRequestError(empty_field or field, "must not be empty")
    return out


def check_room_to_generate(num_prompt_tokens: int, max_model_len: int, field: str = "prompt") -> None:
    """A prompt must leave at least one position of the model's context for output."""
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(field, f"{num_prompt_tokens} tokens leave no room to generate within the context "
                                         f"of {max_model_len}")


def check_request(request_id: str, prompt_ids: Sequence, params: SamplingParams, vocab_size: int,
                  prompt_field: str = "prompt_ids") -> list[int]:
    """The checks every worker entry point runs: the id, the prompt's token ids and the sampling parameters
    (``SamplingParams.validate``). Returns the prompt as a list."""
    check_request_id(request_id)
    ids = check_token_ids(prompt_ids, vocab_size, prompt_field)
    params.validate(vocab_size=vocab_size)
    return ids
