"""Chunked-prefill scheduling for a prefill-only worker. Pure Python (no torch).

Each step fills a token budget: prompts already mid-prefill continue first (oldest first), then
waiting prompts are admitted while the budget, ``max_num_seqs`` and free blocks allow. A prompt gets
all of its blocks at admission, so it never runs out mid-prompt and nothing is ever preempted. After
its last chunk a prompt leaves the running set but keeps its blocks until the KV transfer is
acknowledged (:meth:`PrefillScheduler.release`): blocks held by transfers are the back-pressure that
stops admission when the decode side is slow.
"""

from __future__ import annotations

from collections import deque

from modeling.block_pool import BlockPool
from modeling.prefix_cache import PrefixCache
from modeling.scheduler import ScheduledChunk, SchedulerLimits
from modeling.sequence import Sequence, SequenceStatus


class PrefillScheduler:
    """Invariant: every sequence in ``running`` or ``handed_off`` holds blocks for its whole prompt."""

    def __init__(self, config: SchedulerLimits, pool: BlockPool, prefix_cache: PrefixCache | None = None):
        self.config = config
        self.pool = pool
        self.prefix_cache = prefix_cache  # admitted prompts start from their cached prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.handed_off: dict[str, Sequence] = {}  # prefilled, KV in transfer

    def add(self, seq: Sequence) -> None:
        """Queue a prompt; the blocks of it only slower KV tiers hold are read ahead while it waits."""
        if self.prefix_cache is not None:
            self.prefix_cache.read_ahead(seq)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.handed_off)

    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks; ``sample`` marks a prompt's last chunk."""
        budget = self.config.token_budget
        chunks: list[ScheduledChunk] = []
        for seq in self.running:
            if budget == 0:
                break
            budget -= self._chunk(seq, budget, chunks)
        while budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self.prefix_cache is not None:
                self.prefix_cache.attach(seq)
            need = self.pool.blocks_for_tokens(seq.num_prompt) - len(seq.block_table.blocks)
            if not self.pool.can_allocate(need):
                break
            self.waiting.popleft()
            seq.block_table.ensure_capacity(self.pool, seq.num_prompt)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._chunk(seq, budget, chunks)
        return chunks

    def _chunk(self, seq: Sequence, budget: int, chunks: list[ScheduledChunk]) -> int:
        n = min(seq.num_prompt - seq.num_computed, budget)
        chunks.append(ScheduledChunk(seq, seq.num_computed, n, sample=(seq.num_computed + n == seq.num_prompt)))
        return n

    def hand_off(self, seq: Sequence) -> None:
        """The prompt is prefilled: stop scheduling it, keep its blocks for the transfer."""
        self.running.remove(seq)
        self.handed_off[seq.request_id] = seq

    def release(self, request_id: str) -> Sequence | None:
        """Free a sequence's blocks wherever it is (transfer acknowledged, failed, or aborted)."""
        seq = self.handed_off.pop(request_id, None)
        if seq is None:
            seq = next((s for s in self.running if s.request_id == request_id), None)
            if seq is not None:
                self.running.remove(seq)
            else:
                seq = next((s for s in self.waiting if s.request_id == request_id), None)
                if seq is None:
                    return None
                self.waiting.remove(seq)
        seq.block_table.release(self.pool)
        if self.prefix_cache is not None:
            self.prefix_cache.forget(request_id)
        seq.status = SequenceStatus.FINISHED
        return seq
