"""The lock between a worker's step loop and the control calls made into it, fair to the calls.

A worker actor (``controller/actors.py``) runs its step loop on one thread and answers the router's control
calls (submit, reserve, admit, abort, status) on others; both touch the worker, so each step and each call
holds one lock. A plain lock promises no order: the loop thread releases it at the end of a step and may take
it again for the next before a call woken by the release runs, so a call could wait several steps. With
``StepGate`` a call waiting when a step ends goes before the next step, at most the rest of the step in
progress, which is what the simulator assumes of a KV reservation (``controller/planner/simulator.py``).

Measured (``benchmarks/step_gate_bench.py``, ``benchmarks/results/same_session_17``): on the 2-core VM the
plain lock did not in fact starve calls (30 ms steps: median wait 19-22 ms under both); when the caller's
process is starved of CPU (niceness 15 against busy processes at 0, as Ray runs our actors) both wait about
190 ms, the scheduler's doing, not the lock's. The gate is the ordering guarantee, not a measured speed-up.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

# The longest the loop thread defers its next step to waiting calls (a guard: calls take micro- to
# milliseconds, and a call arriving while others go first joins them).
MAX_DEFER_S = 0.05


class StepGate:
    """``step()`` around each loop step, ``call()`` around each control call; re-entrant for one thread
    (a call made from inside a step or another call passes straight through).

    Invariant: a call that is waiting when a step ends holds the gate before the next step begins, unless
    calls kept arriving for ``MAX_DEFER_S`` (then the step goes first, and they wait at most one more step)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0

    @contextmanager
    def call(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._cond:
                self._waiting -= 1
                if not self._waiting:
                    self._cond.notify_all()
        try:
            yield
        finally:
            self._lock.release()

    @contextmanager
    def step(self) -> Iterator[None]:
        deadline = time.monotonic() + MAX_DEFER_S
        with self._cond:
            while self._waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        with self._lock:
            yield
