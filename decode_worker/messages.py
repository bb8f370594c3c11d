"""Typed messages between the controller's router and a decode worker (no torch: the router imports them).

In: :class:`DecodeRequest`, sent once, before prefill: the decode worker reserves the prompt's KV blocks and
holds the request in ``waiting_for_kv`` until the prefill worker's transfer (KV and first token) completes.
Out, per step: :class:`TokenDelta` per request that produced something, and :class:`DecodeFailure` for a
request the worker gave up on (its KV never arrived).
"""

from __future__ import annotations

from dataclasses import dataclass

from modeling.params import SamplingParams


@dataclass(frozen=True)
class DecodeRequest:
    """A request to decode once its prompt's KV arrives from a prefill worker."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request from one step, and their text. The first delta of a request whose first
    token came from a prefill worker carries no token id (the router streamed it already) but that token's
    text. ``finish_reason`` is 'stop' | 'length' | 'abort' when finished."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(frozen=True)
class DecodeFailure:
    """A request the decode worker gave up on before decoding it (its KV transfer failed; blocks freed).
    ``retryable``: the router may run it again elsewhere."""

    request_id: str
    reason: str
    retryable: bool
