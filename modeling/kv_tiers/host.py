"""The host-memory tier: full KV blocks kept in host memory, least recently used evicted first.

Each entry is one block's KV, a tensor [num_layers, 2, block_size, num_kv_heads, head_dim] on the host
(pinned when the pool is on a GPU, so loading it back is an asynchronous copy). Used from the worker's thread
only.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from modeling.kv_tiers.events import HOST, TierEvents
from modeling.kv_tiers.stats import TierStats


class HostTier:
    """Up to ``capacity_bytes`` of blocks, keyed by content hash."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.stats = TierStats(capacity_bytes=capacity_bytes)
        self.events: TierEvents | None = None  # set while the router is told what the tier holds

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, block_hash: int) -> torch.Tensor | None:
        """The block's KV (None: not held); a hit becomes the most recently used."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            self._entries.move_to_end(block_hash)
        return entry

    def put(self, block_hash: int, kv: torch.Tensor) -> bool:
        """Keep ``kv`` under ``block_hash``, evicting the least recently used for room. False (nothing kept) when
        it is held already or larger than the whole tier."""
        size = kv.numel() * kv.element_size()
        if block_hash in self._entries or size > self.capacity_bytes:
            return False
        while self.stats.bytes + size > self.capacity_bytes:
            old_hash, old = self._entries.popitem(last=False)
            self.stats.bytes -= old.numel() * old.element_size()
            self.stats.evicted += 1
            self._tell(old_hash, False)
        self._entries[block_hash] = kv
        self.stats.bytes += size
        self.stats.stored += 1
        self.stats.bytes_out += size
        self.stats.blocks = len(self._entries)
        self._tell(block_hash, True)
        return True

    def drop(self, block_hash: int) -> None:
        old = self._entries.pop(block_hash, None)
        if old is not None:
            self.stats.bytes -= old.numel() * old.element_size()
            self.stats.blocks = len(self._entries)
            self._tell(block_hash, False)

    def items(self) -> list[tuple[int, torch.Tensor]]:
        """(hash, KV) of every block held now, least recently used first."""
        return list(self._entries.items())

    def hashes(self) -> list[int]:
        """The hashes held now, least recently used first."""
        return list(self._entries)

    def _tell(self, block_hash: int, stored: bool) -> None:
        if self.events is not None:
            self.events.add(HOST, block_hash, stored)
