"""Log-probabilities as reported to clients (no torch: the router and the message modules import them).

Values are the target model's log-softmax over its raw logits (before penalties, bias, temperature or
filters: vLLM's default "raw" mode), for the token at a position given everything before it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its log-probability and rank (1: the most likely), and the ``top``
    most likely tokens as (id, log-probability), best first (as many as the request asked for)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


def cumulative(logprobs) -> float:
    """Sum of the log-probabilities of a sequence's tokens (``best_of`` ranks sequences by it)."""
    return sum(lp.logprob for lp in logprobs)
