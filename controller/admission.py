"""Admission slots handed out by priority (no torch, no Ray): at most ``capacity`` holders at once; when all
are taken, waiters get the next free slot highest priority first, first come first served within a priority."""

from __future__ import annotations

import asyncio
import heapq
import itertools


class PriorityGate:
    """An asyncio semaphore whose waiters are served by priority (higher first)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self._free = capacity
        self._waiters: list[tuple[int, int, asyncio.Future]] = []  # heap of (-priority, arrival, future)
        self._arrivals = itertools.count()

    def locked(self) -> bool:
        """No slot free now (a newcomer would wait)."""
        return self._free == 0

    @property
    def waiting(self) -> int:
        return sum(not f.done() for _, _, f in self._waiters)

    async def acquire(self, priority: int = 0) -> None:
        if self._free > 0:
            self._free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (-priority, next(self._arrivals), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a slot just as it was cancelled: pass it on
                self.release()
            raise

    def release(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():  # a cancelled waiter's future is done: skip it
                fut.set_result(None)
                return
        self._free += 1
