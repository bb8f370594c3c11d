"""What an instance's tiers start and stop holding, for the router's KV index (``controller/kv_index.py``).

Each tier (``host``, ``disk``, ``store``) appends ``(tier, block hash, stored)`` as it keeps or drops a block,
from whichever thread does it (the worker's for the host tier, the writer's for the disk and the store); the
prefix cache takes them with its own events. Only the store's additions are seen: it evicts without telling
its clients, so the index treats a store entry as likely, and the instance's own lookup stays the authority.
"""

from __future__ import annotations

from collections import deque

HOST, DISK, STORE = "host", "disk", "store"


class TierEvents:
    """An ordered log of ``(tier, block hash, stored)``, appended and drained from any thread (``deque``'s
    ``append`` and ``popleft`` are atomic)."""

    def __init__(self) -> None:
        self._log: deque[tuple[str, int, bool]] = deque()

    def add(self, tier: str, block_hash: int, stored: bool) -> None:
        self._log.append((tier, block_hash, stored))

    def take(self) -> tuple[tuple[str, int, bool], ...]:
        """Everything logged since the last call, oldest first."""
        out = []
        while True:
            try:
                out.append(self._log.popleft())
            except IndexError:
                return tuple(out)
