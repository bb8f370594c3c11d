"""Continuous batching with chunked prefill (Sarathi-Serve): decode first, then prefill chunks, under a
token budget per step. Pure Python: it moves Sequences and blocks, never tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from modeling.block_pool import BlockPool
from modeling.errors import OutOfBlocksError
from modeling.prefix_cache import PrefixCache
from modeling.sequence import FinishReason, Sequence, SequenceStatus


class SchedulerLimits(Protocol):
    """What a scheduler reads of its instance's config (``EngineConfig``, ``PrefillWorkerConfig``, validated
    there): new tokens per step (decode tokens count too) and running sequences."""

    token_budget: int
    max_num_seqs: int


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute ``tokens[start : start + num_tokens]`` of ``seq``; sample after it iff ``sample``."""

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool


class ChunkedPrefillScheduler:
    """Chooses each step's work. Invariant: every RUNNING sequence holds blocks for its computed tokens."""

    def __init__(self, config: SchedulerLimits, pool: BlockPool, prefix_cache: PrefixCache | None = None):
        self.config = config
        self.pool = pool
        self.prefix_cache = prefix_cache  # admitted sequences start from their cached prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; the blocks of its prompt only slower KV tiers hold are read ahead while it waits."""
        if self.prefix_cache is not None:
            self.prefix_cache.read_ahead(seq)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.token_budget
        chunks: list[ScheduledChunk] = []
        # 1. decode steps of running sequences (one token each), preempting from the back on OOM
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed != 1:
                continue
            if not self._reserve(seq, seq.num_computed + 1, protect=chunks):
                continue  # seq itself was preempted
            chunks.append(ScheduledChunk(seq, seq.num_computed, 1, sample=True))
            budget -= 1
        # 2. prefill chunks: running sequences mid-prompt first, then newly admitted ones
        for seq in self.running:
            if budget == 0:
                break
            if seq.num_uncomputed > 1 and all(c.seq is not seq for c in chunks):
                budget -= self._add_prefill_chunk(seq, budget, chunks)
        while budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self.prefix_cache is not None:  # a preempted sequence's output tokens too: their blocks were cached
                self.prefix_cache.attach(seq, upto=seq.num_tokens - 1, load_tiers=False)
            n = min(seq.num_uncomputed, budget)
            if not self.pool.can_allocate(self.pool.blocks_for_tokens(seq.num_computed + n) - len(seq.block_table.blocks)):
                break
            if self.prefix_cache is not None:  # the tiers' blocks after the pool's, in room the chunk was granted
                self.prefix_cache.load_from_tiers(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._add_prefill_chunk(seq, budget, chunks)
        return chunks

    def _add_prefill_chunk(self, seq: Sequence, budget: int, chunks: list[ScheduledChunk]) -> int:
        n = min(seq.num_uncomputed, budget)
        try:
            seq.block_table.ensure_capacity(self.pool, seq.num_computed + n)
        except OutOfBlocksError:
            return 0
        chunks.append(ScheduledChunk(seq, seq.num_computed, n, sample=(n == seq.num_uncomputed)))
        return n

    def _reserve(self, seq: Sequence, num_tokens: int, protect: list[ScheduledChunk]) -> bool:
        """Make room for ``num_tokens`` positions of ``seq``, preempting the newest other sequences
        not yet scheduled this step. False if ``seq`` itself had to be preempted."""
        while True:
            try:
                seq.block_table.ensure_capacity(self.pool, num_tokens)
                return True
            except OutOfBlocksError:
                scheduled = {id(c.seq) for c in protect}
                victims = [s for s in self.running if s is not seq and id(s) not in scheduled]
                victim = victims[-1] if victims else seq
                self.preempt(victim)
                if victim is seq:
                    return False

    def preempt(self, seq: Sequence) -> None:
        """Drop ``seq``'s KV and requeue it at the front; it recomputes later what its prefix cache (the pool's
        cached blocks, the tiers below) no longer holds of its tokens."""
        seq.block_table.release(self.pool)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark finished and free its blocks (works for waiting and running sequences)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.block_table.release(self.pool)
        if self.prefix_cache is not None:
            self.prefix_cache.forget(seq.request_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
