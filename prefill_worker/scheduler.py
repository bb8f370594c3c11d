"""Chunked-prefill scheduling for a prefill-only worker. Pure Python (no torch).

Each step fills a token budget: prompts already mid-prefill continue first (oldest first), then
waiting prompts are admitted while the budget, ``max_num_seqs`` and free blocks allow. A late prompt
(``add(seq, late=True)``: past its TTFT SLO wherever it goes, the router's load-aware decision) gets a step only
when no prompt that is not late has a chunk to run, and is not admitted while one waits for blocks. A prompt gets
all of its blocks at admission, so it never runs out mid-prompt and nothing it needs is ever preempted. After
its last chunk a prompt leaves the running set but keeps its blocks until the KV transfer is
acknowledged (:meth:`PrefillScheduler.release`): blocks held by transfers are the back-pressure that
stops admission when the decode side is slow.

Passes computed ahead (``add(seq, ahead=True)``: a prompt that waits for room on a decode instance, computed
only so its KV is cached here when its turn comes) run in steps no other prompt has a chunk in, and give
their blocks up when another prompt needs them (:meth:`PrefillScheduler.take_dropped`): what they computed
stays cached.
"""

from __future__ import annotations

from collections import deque

from modeling.block_pool import BlockPool
from modeling.prefix_cache import CachedPrompt, PrefixCache
from modeling.scheduler import ScheduledChunk, SchedulerLimits
from modeling.sequence import Sequence, SequenceStatus


class PrefillScheduler:
    """Invariant: every sequence in ``running`` or ``handed_off`` holds blocks for its whole prompt; so does
    every one in ``running_ahead``."""

    def __init__(self, config: SchedulerLimits, pool: BlockPool, prefix_cache: PrefixCache | None = None):
        self.config = config
        self.pool = pool
        self.prefix_cache = prefix_cache  # admitted prompts start from their cached prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.handed_off: dict[str, Sequence] = {}  # prefilled, KV in transfer
        self.waiting_ahead: deque[Sequence] = deque()  # passes computed ahead, in their own lane
        self.running_ahead: list[Sequence] = []
        self._dropped: list[tuple[Sequence, CachedPrompt | None]] = []  # passes ahead that gave their blocks up,
        # and what each found of its prompt cached (None: not looked up yet), not yet taken
        self.late: set[str] = set()  # the request ids of the late prompts, waiting or running

    def add(self, seq: Sequence, ahead: bool = False, late: bool = False) -> None:
        """Queue a prompt (``ahead``: a pass computed ahead; ``late``: after every prompt that is not; see the
        module doc); the blocks of it only slower KV tiers hold are read ahead while it waits."""
        if self.prefix_cache is not None:
            self.prefix_cache.read_ahead(seq)
        if late:
            self.late.add(seq.request_id)
        (self.waiting_ahead if ahead else self.waiting).append(seq)

    def queued_tokens(self, late: bool = True) -> int:
        """Prompt tokens waiting or running, not computed yet (``late`` False: of the prompts that are not late)."""
        return sum(s.num_prompt - s.num_computed for s in [*self.running, *self.waiting]
                   if late or s.request_id not in self.late)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.handed_off or self.waiting_ahead or self.running_ahead)

    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks; ``sample`` marks a prompt's last chunk. Passes ahead get a step only when no other
        prompt has a chunk to run."""
        chunks = self._fill(self.running, self.waiting)
        if chunks or (self.waiting and self._give_ahead_blocks_up()):
            return chunks or self._fill(self.running, self.waiting)
        return self._fill(self.running_ahead, self.waiting_ahead)

    def _fill(self, running: list[Sequence], waiting: deque[Sequence]) -> list[ScheduledChunk]:
        """The prompts that are not late, running then waiting; only when none of them has a chunk, the late ones
        likewise (a step's time grows with its tokens: a late chunk beside theirs would delay them)."""
        chunks: list[ScheduledChunk] = []
        blocked = self._fill_lane(running, waiting, False, chunks, admit=True)
        if not chunks:
            self._fill_lane(running, waiting, True, chunks, admit=not blocked)
        return chunks

    def _fill_lane(self, running: list[Sequence], waiting: deque[Sequence], late: bool, chunks: list[ScheduledChunk],
                   admit: bool) -> bool:
        """Chunks for the prompts of one lane (``late`` or not), running first, then those waiting admitted (with
        ``admit``) while the budget, the seats and the blocks allow; whether one waits for blocks."""
        budget = self.config.token_budget
        for seq in [s for s in running if (s.request_id in self.late) is late]:
            if budget == 0:
                return False
            budget -= self._chunk(seq, budget, chunks)
        for seq in [s for s in waiting if (s.request_id in self.late) is late] if admit else []:
            if budget <= 0 or len(self.running) + len(self.running_ahead) >= self.config.max_num_seqs:
                break
            if not self._allocate(seq):
                return True
            waiting.remove(seq)
            running.append(seq)
            budget -= self._chunk(seq, budget, chunks)
        return False

    def _allocate(self, seq: Sequence) -> bool:
        """Give ``seq`` blocks for its whole prompt, from its cached prefix on; False when the pool lacks room."""
        if self.prefix_cache is not None:
            self.prefix_cache.attach(seq)
        need = self.pool.blocks_for_tokens(seq.num_prompt) - len(seq.block_table.blocks)
        if not self.pool.can_allocate(need):
            return False
        seq.block_table.ensure_capacity(self.pool, seq.num_prompt)
        seq.status = SequenceStatus.RUNNING
        return True

    def _give_ahead_blocks_up(self) -> bool:
        """A prompt waits, and passes ahead hold blocks or seats: drop them all (their full blocks stay cached);
        whether any was dropped."""
        dropped = self.running_ahead + list(self.waiting_ahead)
        for seq in dropped:
            cache = self.prefix_cache
            found = cache.found(seq.request_id) if cache is not None and cache.looked_up(seq.request_id) else None
            self.release(seq.request_id)
            self._dropped.append((seq, found))
        return bool(dropped)

    def take_dropped(self) -> list[tuple[Sequence, CachedPrompt | None]]:
        """The passes ahead dropped since the last call (their blocks are freed), each with what it found of its
        prompt cached (None: it had not looked it up)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def _chunk(self, seq: Sequence, budget: int, chunks: list[ScheduledChunk]) -> int:
        n = min(seq.num_prompt - seq.num_computed, budget)
        chunks.append(ScheduledChunk(seq, seq.num_computed, n, sample=(seq.num_computed + n == seq.num_prompt)))
        return n

    def hand_off(self, seq: Sequence) -> None:
        """The prompt is prefilled: stop scheduling it, keep its blocks for the transfer."""
        self.running.remove(seq)
        self.handed_off[seq.request_id] = seq

    def release(self, request_id: str) -> Sequence | None:
        """Free a sequence's blocks wherever it is (transfer acknowledged, failed, or aborted; a pass ahead
        computed or dropped)."""
        seq = self.handed_off.pop(request_id, None)
        if seq is None:
            seq = self._take(request_id)
            if seq is None:
                return None
        seq.block_table.release(self.pool)
        if self.prefix_cache is not None:
            self.prefix_cache.forget(request_id)
        self.late.discard(request_id)
        seq.status = SequenceStatus.FINISHED
        return seq

    def _take(self, request_id: str) -> Sequence | None:
        """Take the sequence out of whichever running or waiting list holds it."""
        for held in (self.running, self.running_ahead, self.waiting, self.waiting_ahead):
            seq = next((s for s in held if s.request_id == request_id), None)
            if seq is not None:
                held.remove(seq)
                return seq
        return None
