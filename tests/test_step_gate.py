"""controller/step_gate.py: a control call waiting on a busy step loop gets in before the loop's next step."""

from __future__ import annotations

import threading
import time

from controller import step_gate
from controller.step_gate import StepGate


def test_a_waiting_call_goes_before_the_next_step(monkeypatch):
    """The loop runs steps back to back (each sleeps: the GIL is free, as in a forward pass); every call
    made meanwhile holds the gate before the loop starts another step: at most the step in progress starts
    between the call's start and its turn. (A plain lock lets the loop take the next step first.)"""
    monkeypatch.setattr(step_gate, "MAX_DEFER_S", 30.0)  # the invariant without the guard's time limit
    gate, started, stop = StepGate(), [0], threading.Event()

    def loop():
        while not stop.is_set():
            with gate.step():
                started[0] += 1
                time.sleep(0.01)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    overtaken = []
    try:
        for i in range(30):
            time.sleep(0.003 * (i % 5))
            before = started[0]
            with gate.call():
                overtaken.append(started[0] - before)
                # re-entrant: a call made from inside a call passes straight through
                with gate.call():
                    pass
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()
    assert started[0] > 10 and max(overtaken) <= 1, overtaken


def test_the_loop_waits_for_calls_at_most_the_guard_time(monkeypatch):
    """A call holding the gate for long keeps the loop out (it is a lock); calls queueing behind one another
    cannot hold the next step back beyond MAX_DEFER_S once the gate is free."""
    monkeypatch.setattr(step_gate, "MAX_DEFER_S", 0.05)
    gate = StepGate()
    entered = threading.Event()
    release = threading.Event()

    def long_call():
        with gate.call():
            entered.set()
            release.wait(5)

    caller = threading.Thread(target=long_call, daemon=True)
    caller.start()
    assert entered.wait(5)
    stepped = threading.Event()

    def one_step():
        with gate.step():
            stepped.set()

    stepper = threading.Thread(target=one_step, daemon=True)
    stepper.start()
    assert not stepped.wait(0.2)  # the call holds the gate
    release.set()
    assert stepped.wait(5)
    caller.join(5)
    stepper.join(5)
    # a count of waiting calls that never drains (a caller stuck before acquiring) delays a step by the guard only
    gate._waiting = 1
    t = time.monotonic()
    with gate.step():
        pass
    assert 0.04 <= time.monotonic() - t < 1.0
    gate._waiting = 0


def test_calls_from_many_threads_all_get_in():
    gate, done, calls = StepGate(), [], 3

    def call(i):
        with gate.call():
            done.append(i)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(calls)]
    with gate.step():
        for t in threads:
            t.start()
        time.sleep(0.05)
        assert done == []  # the step holds the gate
    for t in threads:
        t.join(5)
    assert sorted(done) == list(range(calls))
