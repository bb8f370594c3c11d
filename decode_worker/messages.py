"""Typed messages between the controller's router and a decode worker (no torch: the router imports them).

In: :class:`DecodeRequest`, sent once, before prefill: the decode worker reserves the prompt's KV blocks and
holds the request in ``waiting_for_kv`` until the prefill worker's transfer (KV and first token) completes.
Out, per step: :class:`TokenDelta` per request that produced something, and :class:`DecodeFailure` for a
request the worker gave up on (its KV never arrived). Migration (live, between decode instances):
:class:`MigrationArrived` from the destination, :class:`MigrationFailed` from either end. Load:
:class:`PoolLoad`, whenever it changes (the router places new requests and migrations by it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modeling.logprobs import TokenLogprob
from modeling.params import SamplingParams
from modeling.prefix_cache import CachedPrompt


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
    """New tokens of one sequence of a request from one step, and their text, numbered by where they sit:
    ``position`` is the output position of ``token_ids[0]``, ``text_offset`` the characters of the sequence's
    text before ``text``. Pieces may repeat what another end already reported (the first token, which the
    prefill worker sampled; a migration's catch-up): the router emits each position once
    (``controller/output_order.py``). ``finish_reason`` is 'stop' | 'length' | 'abort' when finished."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for log-probabilities
    # a colocated instance's first delta of a request that asked for the prompt's log-probabilities
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # seeded sampling: the generator's state after this delta's last token (a resume elsewhere continues the
    # same random stream from it); empty otherwise
    sampler_state: bytes = b""
    index: int = 0  # the request's sequence these tokens belong to (n > 1; ``request_id`` is the request's)
    position: int = 0
    text_offset: int = 0
    # the first delta of a request whose prompt this instance computed: what it found of the prompt instead
    cached: CachedPrompt | None = None


@dataclass(frozen=True)
class DecodeFailure:
    """A request the decode worker gave up on before decoding it (its KV transfer failed; blocks freed).
    ``retryable``: the router may run it again elsewhere."""

    request_id: str
    reason: str
    retryable: bool


@dataclass(frozen=True)
class MigrationArrived:
    """A migrating request's KV and state are complete on its destination, which holds it until the router
    commits (then it decodes there, its first delta repeating the whole output so far) or aborts (then it is
    freed there). ``num_output_tokens``: output tokens the source produced before it stopped."""

    request_id: str
    num_output_tokens: int


@dataclass(frozen=True)
class MigrationFailed:
    """A migration that cannot complete, as one of its ends saw it (a broken or stalled channel, the
    request preempted or ended on its source). The router aborts it: the request stays on its source."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class PoolLoad:
    """A decode instance's KV pool as the rescheduling policy reads it (``controller/migration_policy.py``):
    ``running``, the blocks of each running request that could migrate; ``held_blocks``, the blocks held
    otherwise (KV arriving, migrating, preempted, shared by several sequences); ``waiting_blocks``, what the
    head-of-line preempted request needs and cannot get (0: nothing waits, or it fits); ``holds``, every
    request the instance holds in any state. ``prefill_queued_tokens``: prompt tokens its local prefills have
    still to compute; ``prefill_tokens_per_s``: how fast its steps compute them now, within the TPOT slack of
    the sequences decoding (``decode_worker/prefill_budget.py``; 0: no slack, or not measured yet)."""

    total_blocks: int
    block_size: int
    running: dict[str, int] = field(default_factory=dict)
    held_blocks: int = 0
    waiting_blocks: int = 0
    holds: frozenset[str] = frozenset()
    prefill_queued_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
