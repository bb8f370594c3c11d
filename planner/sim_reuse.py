"""Simulated requests of a trace with reuse (``planner/reuse_workload.py``): synthetic token ids that make
every repeated part identical and everything else distinct, so the simulator's prefix caches find exactly
the reuse the trace has, and the links that send a conversation's next turn after the previous one ends.

Ids only identify KV (the simulator never runs the model): each fresh segment (a document, a question, a
turn's message or answer) takes the next ids of one counter. A conversation's turns are windows onto one
list (its messages and answers in order), so a long conversation is held once, not once per turn.
"""

from __future__ import annotations

import itertools
import math

from planner.reuse_workload import ReuseRequest, prompt_lengths
from planner.sim_instances import SimRequest


class TokenWindow:
    """The first ``length`` ids of ``base`` as a read-only sequence (``base`` may grow beyond it)."""

    def __init__(self, base: list[int], length: int):
        self.base = base
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        if isinstance(index, slice):
            r = range(self.length)[index]
            return self.base[r.start:r.stop:r.step]
        return self.base[range(self.length)[index]]

    def __iter__(self):
        return iter(self.base[:self.length])


def reuse_requests(trace: list[ReuseRequest]) -> list[SimRequest]:
    """One ``SimRequest`` per request of ``trace``, with its prompt's and output's ids. A conversation's later
    turns have no arrival time yet (``nan``): each is sent ``think_s`` after the turn before it ends
    (``SimRequest.next_turn``)."""
    fresh = itertools.count(1)

    def segment(n: int) -> list[int]:
        return list(itertools.islice(fresh, n))

    documents: dict[int, list[int]] = {}
    conversations: dict[int, list[int]] = {}
    last_turn: dict[int, SimRequest] = {}
    out = []
    for i, (r, n) in enumerate(zip(trace, prompt_lengths(trace))):
        if r.shared_tokens:
            doc = documents.setdefault(r.group, segment(r.shared_tokens))
            req = SimRequest(i, r.arrival_s, n, r.output_tokens, prompt_ids=doc + segment(r.new_tokens),
                             output_ids=segment(r.output_tokens))
        else:
            conv = conversations.setdefault(r.group, [])
            conv += segment(r.new_tokens)
            if len(conv) != n:
                raise ValueError(f"trace: turn {r.turn} of conversation {r.group} comes out of order")
            output = segment(r.output_tokens)
            conv += output
            req = SimRequest(i, r.arrival_s if r.turn == 0 else math.nan, n, r.output_tokens,
                             prompt_ids=TokenWindow(conv, n), output_ids=output, think_s=r.think_s)
            if r.group in last_turn:
                last_turn[r.group].next_turn = req
            last_turn[r.group] = req
        out.append(req)
    return out


def distinct_requests(reqs: list[SimRequest]) -> None:
    """Give requests of a trace without reuse ids of their own (caching on, nothing to find)."""
    fresh = itertools.count(1)
    for req in reqs:
        req.prompt_ids = list(itertools.islice(fresh, req.prompt_tokens))
        req.output_ids = list(itertools.islice(fresh, req.output_tokens))
