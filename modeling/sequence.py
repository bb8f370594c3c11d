"""A generation request's token state and its stop conditions (no torch here)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from modeling.block_pool import BlockTable

if TYPE_CHECKING:
    from modeling.sampling import RequestSampler


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted (its KV dropped, to be recomputed)
    WAITING_FOR_KV = "waiting_for_kv"  # blocks reserved on a decode worker; the prompt's KV is in transfer
    PREFILLING = "prefilling"  # on a decode worker: the prompt's uncached rest is computed there, no transfer
    RUNNING = "running"
    MIGRATING = "migrating"  # live migration: stopped on its source, or arrived on its destination, holding its KV
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled or failed


@dataclass
class Sequence:
    """Tokens of one request. Invariant: ``num_computed <= len(tokens)``; the KV of
    ``tokens[:num_computed]`` is in the cache at ``block_table``."""

    request_id: str
    prompt_ids: list[int]
    sampler: RequestSampler
    eos_token_ids: frozenset[int]
    block_table: BlockTable
    max_model_len: int
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV must still be computed (1 while decoding: the last sampled token)."""
        return len(self.tokens) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token: int) -> FinishReason | None:
        """Record a sampled token; return why the sequence must stop, if it must."""
        self.tokens.append(token)
        grammar = self.sampler.grammar
        if grammar is not None:
            grammar.advance(token)
            if grammar.finished:  # the output is complete: nothing but EOS could follow
                return FinishReason.STOP
        return self.stop_reason(token, len(self.output_ids))

    def stop_reason(self, token: int, num_output: int) -> FinishReason | None:
        """Why the sequence stops when its ``num_output``-th output token is ``token`` (its grammar aside), if
        it does."""
        params = self.sampler.params
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if num_output >= params.max_tokens or self.num_prompt + num_output >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def find_stop_string(text: str, stops: tuple[str, ...], new_chars: int) -> tuple[int, int]:
    """(index in ``text`` where the earliest stop string starts, its length), looking only where the last
    ``new_chars`` characters could complete one; (-1, 0) if none."""
    best, length = -1, 0
    for s in stops:
        start = max(0, len(text) - new_chars - len(s) + 1)
        i = text.find(s, start)
        if i >= 0 and (best < 0 or i < best):
            best, length = i, len(s)
    return best, length
