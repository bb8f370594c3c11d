"""The one allocation call of a decode instance's KV blocks, modelled on vLLM v1's
``KVCacheManager.allocate_slots``. Pure Python (no torch): the decode scheduler runs it, and so does the
planner's simulator through the scheduler.

One call covers what a sequence needs next, granted whole or not at all:

* computed tokens: with ``cached_upto``, the longest cached prefix of its first ``cached_upto`` tokens is
  looked up first (its blocks are shared, their KV is not computed or sent again);
* new tokens: room for ``num_tokens`` positions in all (counting what it holds already);
* lookahead tokens: ``lookahead_tokens`` more (the first decode step at admission, k drafts each step);
* fork blocks: the blocks of its own each of ``num_forks`` further sequences of the request (n > 1) will
  need when they fork from it (``BlockTable.fork``: the prompt's full blocks are shared, the partly filled
  one and the first step's position are each sequence's own).

Every admission source (remote KV, local prefill, resume, fork, migration in) and the resumption of preempted
sequences reserve through :meth:`KVSlots.allocate_slots`; each step's growth through :meth:`KVSlots.grow`, the
same call without a lookup or forks that answers only whether it was granted (it runs for every sequence at
every step, so it copies no block table).
"""

from __future__ import annotations

from dataclasses import dataclass

from modeling.block_pool import BlockPool
from modeling.prefix_cache import PrefixCache


@dataclass(frozen=True)
class SlotGrant:
    """What one ``allocate_slots`` call gave a sequence."""

    blocks: tuple[int, ...]  # the sequence's whole block table after the call
    cached_blocks: int  # leading blocks found in the prefix cache: their KV is here already
    fork_blocks: tuple[int, ...] = ()  # own blocks for the further sequences, ``fork_blocks_each`` apiece


class KVSlots:
    """Block reservations over one pool (and its prefix cache, if any). Invariant: a call that returns None
    leaves the sequence and the pool as they were."""

    def __init__(self, pool: BlockPool, prefix_cache: PrefixCache | None = None):
        self.pool = pool
        self.prefix_cache = prefix_cache

    def fork_blocks_each(self, num_prompt: int) -> int:
        """Blocks of its own a further sequence of a ``num_prompt``-token prompt needs at its start: the
        partly filled prompt block (if any) and room for its first decode step."""
        return self.pool.blocks_for_tokens(num_prompt + 1) - num_prompt // self.pool.block_size

    def allocate_slots(self, seq, num_tokens: int, lookahead_tokens: int = 0, num_forks: int = 0,
                       cached_upto: int | None = None, load_in_background: bool = False) -> SlotGrant | None:
        """Give ``seq`` blocks for ``num_tokens + lookahead_tokens`` positions (beside the blocks it holds)
        and ``num_forks`` further sequences' own blocks; None when the pool cannot (nothing taken).
        ``load_in_background``: the blocks found in the tiers are loaded beside the worker's steps where they
        can be (``PrefixCache.load_from_tiers``; the caller finishes the load before the sequence runs).

        ``seq``: any object with ``request_id``, ``block_table`` and ``num_computed`` (with ``cached_upto``,
        also ``tokens``; with ``num_forks``, also ``prompt_ids``)."""
        looked_up = cached_upto is not None and self.prefix_cache is not None and not seq.block_table.blocks
        if looked_up:  # the pool's cached prefix, marked computed; the tiers' blocks once the rest is known to fit
            self.prefix_cache.attach(seq, cached_upto, load_tiers=False)
        fork_blocks = num_forks * self.fork_blocks_each(len(seq.prompt_ids)) if num_forks else 0
        need = self.pool.blocks_for_tokens(num_tokens + lookahead_tokens) - len(seq.block_table.blocks)
        if not self.pool.can_allocate(max(0, need) + fork_blocks):
            if looked_up:  # give the cached prefix back (its blocks stay cached)
                self.prefix_cache.give_back(seq)
            return None
        if looked_up:  # fresh blocks out of ``need``, their KV loaded instead of computed or sent
            self.prefix_cache.load_from_tiers(seq, in_background=load_in_background)
        cached = len(seq.block_table.blocks) if looked_up else 0
        seq.block_table.ensure_capacity(self.pool, num_tokens + lookahead_tokens)
        forks = self.pool.allocate(fork_blocks) if fork_blocks else []
        return SlotGrant(tuple(seq.block_table.blocks), cached, tuple(forks))

    def grow(self, seq, num_tokens: int) -> bool:
        """Room for ``num_tokens`` positions in all (``allocate_slots(seq, num_tokens)`` on a sequence that holds
        blocks), granted whole or not at all; whether it was."""
        need = self.pool.blocks_for_tokens(num_tokens) - len(seq.block_table.blocks)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        seq.block_table.ensure_capacity(self.pool, num_tokens)
        return True
