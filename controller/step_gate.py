"""The lock between a worker's step loop and the control calls made into it, fair to the calls.

A worker actor (``controller/actors.py``) runs its step loop on one thread and answers the router's control
calls (submit, reserve, admit, abort, status) on others; both touch the worker, so each step and each call
holds one lock. A plain lock promises no order: the loop thread releases it at the end of a step and may take
it again for the next before a call woken by the release runs, so a call could wait several steps. With
``StepGate`` a call waiting when a step ends goes before the next step, at most the rest of the step in
progress, which is what the simulator assumes of a KV reservation (``planner/simulator.py``).

The gate is an ordering guarantee between one loop and its callers; it cannot help a caller whose process
the OS does not schedule.
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
