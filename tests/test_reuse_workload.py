"""Workloads with reuse on plain objects: conversations grow turn by turn within their context cap, shared
documents are asked about in a shuffled order, traces are reproducible and bad shapes name the field."""

from __future__ import annotations

import pytest

from planner.reuse_workload import (MultiTurnShape, SharedDocsShape, multi_turn_trace, prompt_lengths,
                                    shared_docs_trace)
from planner.workload import LengthDist, WorkloadError


def test_conversations_grow_by_each_answer_and_message_up_to_the_cap():
    shape = MultiTurnShape(max_context=6000)
    trace = multi_turn_trace(shape, conversations=20, rate=0.5, seed=3)
    assert trace == multi_turn_trace(shape, conversations=20, rate=0.5, seed=3)
    lengths = prompt_lengths(trace)
    by_conv: dict[int, list[int]] = {}
    for i, r in enumerate(trace):
        turns = by_conv.setdefault(r.group, [])
        assert r.turn == len(turns)  # turns in order
        if turns:
            prev = trace[turns[-1]]
            assert lengths[i] == lengths[turns[-1]] + prev.output_tokens + r.new_tokens
            assert r.think_s >= 0 and r.arrival_s == prev.arrival_s
        turns.append(i)
        assert lengths[i] + r.output_tokens <= 6000
    assert len(by_conv) == 20 and max(len(t) for t in by_conv.values()) >= 4
    assert max(lengths) > 3000  # conversations reach thousands of tokens


def test_every_question_of_every_document_in_a_shuffled_order():
    shape = SharedDocsShape(documents=3, questions=5)
    trace = shared_docs_trace(shape, rate=2.0, seed=1)
    assert sorted((r.group, r.turn) for r in trace) == [(d, q) for d in range(3) for q in range(5)]
    assert [r.group for r in trace] != sorted(r.group for r in trace)
    assert prompt_lengths(trace) == [3200] * 15
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(trace, trace[1:]))


@pytest.mark.parametrize("shape,message", [
    (MultiTurnShape(turns=(5, 2)), "multi_turn.turns: need 1 <= lo <= hi"),
    (MultiTurnShape(max_context=100), "multi_turn.max_context: must hold a first turn"),
    (MultiTurnShape(think_s=-1), "multi_turn.think_s: must be >= 0"),
    (SharedDocsShape(question=LengthDist(10, 0.0, 20, 30)), "shared_docs.question: need 1 <= lo <= median <= hi"),
])
def test_bad_shapes_name_the_field(shape, message):
    with pytest.raises(WorkloadError, match=message.replace("(", r"\(")):
        if isinstance(shape, MultiTurnShape):
            multi_turn_trace(shape, 2, 1.0)
        else:
            shared_docs_trace(shape, 1.0)
