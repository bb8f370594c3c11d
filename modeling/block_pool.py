"""KV block allocation: a pool of fixed-size blocks with reference counts, and per-sequence block tables.

Pure Python (no torch), so schedulers and allocators are tested on plain objects. A block holds
``block_size`` consecutive token positions of one sequence for every layer; the tensors themselves
live in :class:`modeling.kv_cache.PagedKVCache`.

Allocation prefers low block ids and, when a sequence grows, the block right after its last one: long
runs of physically contiguous blocks let attention read a sequence's KV as zero-copy views.

Prefix caching: a full block whose KV is final can be *cached* under its content hash
(:func:`modeling.prefix_hash.block_hashes`: chained over every token before and in it). A cached block
keeps its KV when its last reference goes: it then counts as free but stays findable (``cached_prefix``)
until the space is needed, when the least recently released of them is evicted first (a sequence's
blocks are released last to first, so its prefix's start is evicted last); blocks that were never cached
are always taken before any cached one. With :meth:`BlockPool.record_events` on, the pool logs each hash it
starts and stops holding (``take_events``): instances report them so the router knows where each prefix is
cached (``controller/kv_index.py``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from modeling.errors import OutOfBlocksError
from modeling.prefix_hash import leading_run


class BlockPool:
    """A fixed set of KV blocks: free list, reference counts, and the cached blocks' hashes.

    Invariant: a block is free iff its reference count is 0; ``num_free`` counts exactly those, the cached
    unreferenced blocks (evictable) among them.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self._check_size(num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcount = [0] * num_blocks
        # Free blocks are the ids >= _fresh (never allocated yet) and those in _heap, a min-heap of freed ids
        # that may hold stale entries (checked against _refcount on pop). Building the pool is O(1) in its size.
        self._fresh = 0
        self._heap: list[int] = []
        self._num_free = num_blocks
        self._hash_of: dict[int, int] = {}  # cached block -> its content hash
        self._block_of: dict[int, int] = {}  # content hash -> the cached block holding it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with no reference, oldest first
        self.num_evictions = 0
        self._events: list[tuple[int, bool]] | None = None  # (hash, stored) in order; None: not recorded

    @staticmethod
    def _check_size(num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size: must be > 0, got {block_size}")

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    @property
    def num_cached(self) -> int:
        """Blocks findable by content hash (referenced or not)."""
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no sequence references: free, but kept until the space is needed."""
        return len(self._evictable)

    def record_events(self) -> None:
        """From now on, log every hash the pool starts (stored) or stops (evicted) holding."""
        if self._events is None:
            self._events = []

    def take_events(self) -> list[tuple[int, bool]]:
        """The (hash, stored) events since the last call, oldest first (stored False: evicted)."""
        if not self._events:
            return []
        out, self._events = self._events, []
        return out

    @property
    def cached_hashes(self) -> list[int]:
        """Every hash the pool holds now (an instance's whole index, for a router that starts afresh)."""
        return list(self._block_of)

    def cache(self, block: int, block_hash: int) -> bool:
        """Make a full, referenced block whose KV is final findable under ``block_hash``. False (nothing
        changes) when another block already holds that content or this block is cached already."""
        if self._refcount[block] <= 0:
            raise ValueError(f"block {block} is free; only a referenced block can be cached")
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        if self._events is not None:
            self._events.append((block_hash, True))
        return True

    def cached_prefix(self, hashes: list[int]) -> list[int]:
        """The cached blocks holding the longest leading run of ``hashes``, each with one more reference
        (an unreferenced one is taken back from the evictable blocks)."""
        out = []
        for h in hashes[:self.cached_run(hashes)]:
            block = self._block_of[h]
            if self._refcount[block] == 0:
                del self._evictable[block]
                self._num_free -= 1
            self._refcount[block] += 1
            out.append(block)
        return out

    def cached_run(self, hashes: list[int]) -> int:
        """How many of ``hashes``, from the first, the pool holds cached (a lookup: no reference taken)."""
        return leading_run(hashes, self._block_of)

    def cached_hash(self, block: int) -> int | None:
        return self._hash_of.get(block)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self._num_free

    def allocate(self, num_blocks: int, after: int | None = None) -> list[int]:
        """Take ``num_blocks`` free blocks (refcount 1), preferring ``after + 1, after + 2, ...``.

        Raises OutOfBlocksError (taking nothing) when fewer are free.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks: must be >= 0, got {num_blocks}")
        if num_blocks > self._num_free:
            raise OutOfBlocksError(f"need {num_blocks} KV blocks, {self._num_free} free of {self.num_blocks}")
        out: list[int] = []
        nxt = None if after is None else after + 1
        while len(out) < num_blocks:
            if nxt is not None and nxt < self._fresh and self._refcount[nxt] == 0 and nxt not in self._evictable:
                block = nxt
            elif nxt is not None and nxt == self._fresh < self.num_blocks:
                block = nxt
                self._fresh += 1
            else:
                block = self._pop_lowest_free()
            self._refcount[block] = 1
            self._num_free -= 1
            out.append(block)
            nxt = block + 1
        return out

    def incref(self, blocks: list[int]) -> None:
        """Share already-allocated blocks (e.g. a common prefix)."""
        for b in blocks:
            if self._refcount[b] <= 0:
                raise ValueError(f"block {b} is free; only allocated blocks can be shared")
        for b in blocks:
            self._refcount[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 return to the free list. A table's blocks are
        released last to first, so a cached prefix loses its end before its start (a chain is found only
        from its first block: evicting that one first would strand the rest)."""
        for b in blocks:
            if self._refcount[b] <= 0:
                raise ValueError(f"block {b} freed more often than allocated")
        for b in reversed(blocks):
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._num_free += 1
                if b in self._hash_of:
                    self._evictable[b] = None  # most recently released last
                else:
                    heapq.heappush(self._heap, b)
        if len(self._heap) > 4 * self.num_blocks:
            self._heap = [b for b in range(self._fresh) if self._refcount[b] == 0 and b not in self._evictable]

    def _pop_lowest_free(self) -> int:
        while self._heap and (self._refcount[self._heap[0]] != 0 or self._heap[0] in self._evictable):
            heapq.heappop(self._heap)  # stale: allocated (and maybe cached) again since it was freed
        if self._heap and self._heap[0] < self._fresh:
            return heapq.heappop(self._heap)
        if self._fresh < self.num_blocks:
            block = self._fresh  # every freed block is taken: the lowest never-allocated one
            self._fresh += 1
            return block
        block, _ = self._evictable.popitem(last=False)  # only cached blocks are left: the oldest goes
        evicted = self._hash_of.pop(block)
        del self._block_of[evicted]
        self.num_evictions += 1
        if self._events is not None:
            self._events.append((evicted, False))
        return block


@dataclass
class BlockTable:
    """The blocks of one sequence, in order: token position p lives in ``blocks[p // block_size]``."""

    block_size: int
    blocks: list[int] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    def ensure_capacity(self, pool: BlockPool, num_tokens: int) -> list[int]:
        """Grow to hold ``num_tokens`` positions; returns the newly added blocks."""
        need = pool.blocks_for_tokens(num_tokens) - len(self.blocks)
        if need <= 0:
            return []
        new = pool.allocate(need, after=self.blocks[-1] if self.blocks else None)
        self.blocks.extend(new)
        return new

    def truncate(self, pool: BlockPool, num_tokens: int) -> None:
        """Release the blocks beyond what ``num_tokens`` positions need (KV rollback)."""
        keep = pool.blocks_for_tokens(num_tokens)
        if keep < len(self.blocks):
            pool.free(self.blocks[keep:])
            del self.blocks[keep:]

    def release(self, pool: BlockPool) -> None:
        pool.free(self.blocks)
        self.blocks = []

    def fork(self, pool: BlockPool, num_tokens: int, capacity_tokens: int,
             own_blocks: list[int] | None = None) -> tuple["BlockTable", list[tuple[int, int]]]:
        """A table for a sequence that continues from this one's first ``num_tokens`` positions (``n``
        sequences of one prompt): the blocks those positions fill completely are shared (one more reference
        each); the partly filled one and the room up to ``capacity_tokens`` are the fork's own, taken from
        ``own_blocks`` (reserved earlier) or the pool. Returns (the table, the (source, destination) block
        copies that give the fork its partly filled block's KV)."""
        shared = num_tokens // self.block_size
        need = pool.blocks_for_tokens(max(capacity_tokens, num_tokens)) - shared
        if own_blocks is None:
            own_blocks = pool.allocate(need, after=self.blocks[shared - 1] if shared else None)
        elif len(own_blocks) != need:
            raise ValueError(f"own_blocks: a fork of {num_tokens} tokens with room for {capacity_tokens} needs "
                             f"{need} blocks of its own, got {len(own_blocks)}")
        pool.incref(self.blocks[:shared])
        copies = [(self.blocks[shared], own_blocks[0])] if num_tokens % self.block_size else []
        return BlockTable(self.block_size, self.blocks[:shared] + list(own_blocks)), copies

    def slots(self, start: int, end: int) -> list[int]:
        """Flat cache slot (block * block_size + offset) of each position in [start, end)."""
        bs = self.block_size
        return [self.blocks[p // bs] * bs + p % bs for p in range(start, end)]
