"""Decode-side scheduling: admission room, room for each step's speculation, preemption and resumption.
Pure Python (no torch): the decode worker runs it, and so does the planner's simulator.

Each step every running sequence needs blocks for its tokens plus the step's k draft positions. When the
pool runs short, k drops to 0 first (a plain decode step needs the least), then the newest sequences are
preempted: their KV is dropped and they wait, first in first out, to be recomputed once there is room.

Every block it reserves (admission, resumption, each step's room) goes through one call,
``KVSlots.allocate_slots`` (``decode_worker/kv_slots.py``); this module decides who gets a seat and when.

Sequences are any objects with ``request_id``, ``num_tokens``, ``num_computed``, ``block_table`` and
``status`` (``modeling.sequence.Sequence``, or the simulator's stand-in); with a prefix cache, also ``tokens``
and ``prompt_ids``: a preempted sequence resumes from its longest cached prefix, and a sequence that leaves
is forgotten there (its cached blocks stay in the pool).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator

from decode_worker.kv_slots import KVSlots, SlotGrant
from decode_worker.messages import PoolLoad
from modeling.block_pool import BlockPool
from modeling.prefix_cache import PrefixCache
from modeling.sequence import SequenceStatus


class DecodeScheduler:
    """Invariant: every running sequence holds blocks for its computed tokens; a preempted one holds none."""

    def __init__(self, pool: BlockPool, max_num_seqs: int, prefix_cache: PrefixCache | None = None):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.prefix_cache = prefix_cache
        self.slots = KVSlots(pool, prefix_cache)
        self.running: dict[str, object] = {}  # request id -> sequence, in admission order
        self.preempted: deque = deque()  # FIFO
        self.num_preemptions = 0

    def can_reserve(self, *num_tokens: int) -> bool:
        """Room to admit sequences of these token counts (each with its first decode step) alongside the
        running ones."""
        return len(self.running) + len(num_tokens) <= self.max_num_seqs and \
            self.pool.can_allocate(sum(self.pool.blocks_for_tokens(n + 1) for n in num_tokens))

    def reserve(self, seq, num_tokens: int, num_forks: int = 0, cached_upto: int | None = None,
                load_in_background: bool = False) -> SlotGrant | None:
        """Admit ``seq`` with blocks for ``num_tokens`` positions and its first decode step (on top of the blocks
        it holds: a cached prefix, looked up here first with ``cached_upto``), and the own blocks of its
        ``num_forks`` further sequences, if there are seats for all of them beside the running ones and
        blocks in the pool; None, with nothing taken, when not. ``load_in_background``: ``KVSlots.allocate_slots``'s."""
        if len(self.running) + 1 + num_forks > self.max_num_seqs:
            return None
        return self.slots.allocate_slots(seq, num_tokens, lookahead_tokens=1, num_forks=num_forks,
                                         cached_upto=cached_upto, load_in_background=load_in_background)

    def start(self, seq) -> None:
        """``seq`` (its prompt computed) joins the running batch."""
        seq.status = SequenceStatus.RUNNING
        self.running[seq.request_id] = seq

    def finish(self, seq) -> None:
        """``seq`` leaves (finished or aborted), wherever it is; its blocks are freed."""
        if self.running.pop(seq.request_id, None) is None and seq in self.preempted:
            self.preempted.remove(seq)
        if self.prefix_cache is not None:  # first: a load into its blocks stops before they go
            self.prefix_cache.forget(seq.request_id)
        seq.block_table.release(self.pool)

    def load(self, movable: Callable[[object], bool], holds: frozenset[str] = frozenset()) -> PoolLoad:
        """The pool's load report: the running sequences ``movable`` accepts count as running, every other
        used block as held."""
        running = {rid: len(seq.block_table.blocks) for rid, seq in self.running.items() if movable(seq)}
        used = self.pool.num_blocks - self.pool.num_free
        waiting = 0
        if self.preempted:
            need = self.pool.blocks_for_tokens(self.preempted[0].num_tokens + 1)
            waiting = 0 if self.pool.can_allocate(need) else need
        return PoolLoad(self.pool.num_blocks, self.pool.block_size, running, max(0, used - sum(running.values())),
                        waiting, holds)

    def make_room(self, k: int) -> tuple[int, list, list]:
        """(the step's k, its batch, the sequences preempted for it): blocks for positions up to
        ``num_tokens + k - 1`` of every running sequence, lowering k to 0 and then preempting the newest
        sequences when the pool runs short."""
        batch, preempted = list(self.running.values()), []
        while batch:
            # a sequence granted room keeps it when a later one cannot get its own: the retry needs less
            if all(self.slots.grow(seq, seq.num_tokens + k) for seq in batch):
                return k, batch, preempted
            if k > 0:
                k = 0
                continue
            preempted.append(batch.pop())
            self._preempt(preempted[-1])
        return 0, batch, preempted

    def resume_first(self, seq) -> None:
        """``seq`` (no blocks, nothing computed: a request continued from elsewhere) waits to be computed and
        to join the batch ahead of the sequences preempted here."""
        self.preempted.appendleft(seq)

    def resumable(self) -> Iterator:
        """Preempted sequences, first in first out, while the next fits (blocks for its tokens and a step)
        under ``max_num_seqs``: each is given blocks for its tokens (from the longest cached prefix of its
        tokens but the last, those marked computed) and joins the running batch; the caller recomputes the
        rest of its KV (from ``num_computed``) before the next step."""
        while self.preempted:
            seq = self.preempted[0]
            if not self.can_reserve(seq.num_tokens):
                return
            self.preempted.popleft()
            # can_reserve left room for its tokens and one more, whatever the cache holds: this cannot fail
            self.slots.allocate_slots(seq, seq.num_tokens, cached_upto=seq.num_tokens - 1)
            self.start(seq)
            yield seq

    def _preempt(self, seq) -> None:
        del self.running[seq.request_id]
        seq.block_table.release(self.pool)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        self.preempted.append(seq)
        self.num_preemptions += 1
