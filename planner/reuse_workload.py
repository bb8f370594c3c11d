"""Workloads whose prompts repeat earlier ones, where keeping computed KV pays (prefix caching): seeded,
reproducible, pure Python. Shared by the benchmarks that replay them on real servers and the simulator.

* ``multi_turn``: conversations of 4-16 turns. A turn's prompt is the previous turn's prompt, its output and
  a new message; the next turn is sent a think time after the previous one's last token (closed loop per
  conversation), so a conversation grows to several thousand tokens (8-16K with the defaults).
* ``shared_docs``: a few long documents, many questions about each: every prompt is one document followed
  by its own question, sent open loop at a mean rate (vLLM's ``prefix_repetition`` trace is this shape).

A trace is a list of :class:`ReuseRequest`; :func:`prompt_lengths` gives each request's prompt length.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from planner.workload import LengthDist, WorkloadError, arrival_times


@dataclass(frozen=True)
class ReuseRequest:
    """One request of a trace with reuse. ``group``: its conversation (multi_turn) or document (shared_docs);
    ``turn``: its turn in the conversation, or its question's index on the document. Its prompt is
    ``shared_tokens`` of the group's document (shared_docs; 0 for multi_turn), then, for turn t of a
    conversation, every earlier turn's prompt and output, then ``new_tokens`` of its own. ``arrival_s``: when
    it is sent (open loop; a conversation's turn > 0 is sent ``think_s`` after the previous turn's last token
    instead)."""

    arrival_s: float
    group: int
    turn: int
    shared_tokens: int
    new_tokens: int
    output_tokens: int
    think_s: float = 0.0


@dataclass(frozen=True)
class MultiTurnShape:
    """Conversations: ``turns`` (lo, hi) per conversation, a ``first`` message, then ``message`` per later
    turn, ``output`` tokens per answer, exponential think times of mean ``think_s``; a conversation ends
    before a turn would take it past ``max_context`` tokens."""

    turns: tuple[int, int] = (4, 16)
    first: LengthDist = LengthDist(median=1024, sigma=0.5, lo=256, hi=4096)
    message: LengthDist = LengthDist(median=384, sigma=0.6, lo=32, hi=1536)
    output: LengthDist = LengthDist(median=256, sigma=0.5, lo=32, hi=768)
    think_s: float = 5.0
    max_context: int = 16384

    def validate(self) -> None:
        lo, hi = self.turns
        if not 1 <= lo <= hi:
            raise WorkloadError(f"multi_turn.turns: need 1 <= lo <= hi, got {self.turns}")
        for name in ("first", "message", "output"):
            getattr(self, name).validate(f"multi_turn.{name}")
        if self.think_s < 0:
            raise WorkloadError(f"multi_turn.think_s: must be >= 0, got {self.think_s}")
        if self.max_context < self.first.hi + self.output.hi:
            raise WorkloadError(f"multi_turn.max_context: must hold a first turn ({self.first.hi + self.output.hi} "
                                f"tokens), got {self.max_context}")


@dataclass(frozen=True)
class SharedDocsShape:
    """``documents`` documents of ``document`` tokens, ``questions`` questions per document of ``question``
    tokens, ``output`` tokens per answer; questions arrive shuffled across documents."""

    documents: int = 4
    questions: int = 16
    document: LengthDist = LengthDist(median=3000, sigma=0.0, lo=3000, hi=3000)
    question: LengthDist = LengthDist(median=200, sigma=0.0, lo=200, hi=200)
    output: LengthDist = LengthDist(median=64, sigma=0.0, lo=64, hi=64)

    def validate(self) -> None:
        if self.documents < 1 or self.questions < 1:
            raise WorkloadError(f"shared_docs: need >= 1 document and question, got {self.documents}, {self.questions}")
        for name in ("document", "question", "output"):
            getattr(self, name).validate(f"shared_docs.{name}")


def multi_turn_trace(shape: MultiTurnShape, conversations: int, rate: float, seed: int = 0) -> list[ReuseRequest]:
    """``conversations`` conversations starting at ``rate`` conversations/s (Poisson), each with all its
    turns, in order of their first turn."""
    shape.validate()
    if conversations < 1:
        raise WorkloadError(f"conversations: must be >= 1, got {conversations}")
    rng = random.Random(seed)
    out = []
    for c, start in enumerate(arrival_times(rate, conversations, seed + 1)):
        context, turns = 0, rng.randint(*shape.turns)
        for t in range(turns):
            new = (shape.first if t == 0 else shape.message).sample(rng)
            answer = shape.output.sample(rng)
            if context + new + answer > shape.max_context:
                break
            think = 0.0 if t == 0 else rng.expovariate(1.0 / shape.think_s) if shape.think_s else 0.0
            out.append(ReuseRequest(start, c, t, 0, new, answer, think))
            context += new + answer
    return out


def shared_docs_trace(shape: SharedDocsShape, rate: float, seed: int = 0) -> list[ReuseRequest]:
    """Every question of every document, shuffled, arriving at ``rate`` requests/s (Poisson)."""
    shape.validate()
    rng = random.Random(seed)
    docs = [shape.document.sample(rng) for _ in range(shape.documents)]
    asks = [(d, q) for d in range(shape.documents) for q in range(shape.questions)]
    rng.shuffle(asks)
    times = arrival_times(rate, len(asks), seed + 1)
    return [ReuseRequest(t, d, q, docs[d], shape.question.sample(rng), shape.output.sample(rng))
            for t, (d, q) in zip(times, asks)]


REUSE_WORKLOADS: dict[str, MultiTurnShape | SharedDocsShape] = {
    "multi_turn": MultiTurnShape(),
    "shared_docs": SharedDocsShape(),
}


def reuse_trace(name: str, rate: float, num_requests: int, seed: int = 0,
                min_duration_s: float = 0.0) -> list[ReuseRequest]:
    """About ``max(num_requests, rate * min_duration_s)`` requests of the named shape at ``rate`` requests/s:
    multi_turn starts conversations at ``rate`` / (mean turns) per second; shared_docs asks enough
    questions per document."""
    if name not in REUSE_WORKLOADS:
        raise WorkloadError(f"workload: unknown {name!r}; choose one of {sorted(REUSE_WORKLOADS)}")
    if not rate > 0:
        raise WorkloadError(f"rate: must be > 0 requests/s, got {rate}")
    shape = REUSE_WORKLOADS[name]
    n = max(num_requests, math.ceil(rate * min_duration_s))
    if isinstance(shape, MultiTurnShape):
        turns = sum(shape.turns) / 2
        return multi_turn_trace(shape, max(1, math.ceil(n / turns)), rate / turns, seed)
    return shared_docs_trace(replace(shape, questions=max(1, math.ceil(n / shape.documents))), rate, seed)


def prompt_lengths(trace: list[ReuseRequest]) -> list[int]:
    """Each request's prompt length: its document, every earlier turn of its conversation, its own tokens."""
    history: dict[int, int] = {}  # conversation -> its tokens so far (prompts and outputs)
    out = []
    for r in trace:
        before = history.get(r.group, 0) if r.shared_tokens == 0 else r.shared_tokens
        out.append(before + r.new_tokens)
        if r.shared_tokens == 0:
            history[r.group] = before + r.new_tokens + r.output_tokens
    return out
