"""Drafters: propose k tokens per sequence cheaply, attending only to a sparse KV view.

Both drafters attend to the first ``sink_tokens`` tokens plus the most recent ones (StreamingLLM), so a
draft step costs O(budget) KV reads per sequence whatever the context length.

* :class:`SelfSparseDrafter` runs the target model itself over a sparse view of the target's own paged
  KV (built from the full KV at no cost: the view is just which cached positions attention reads). Draft
  steps write their (sparse-quality) KV into the target cache at the speculative positions; the
  verification pass then overwrites those positions with target-quality KV, so the view always holds
  target-quality KV for accepted tokens, and the window slides with every step.
* :class:`DraftModelDrafter` runs a separate small model with its own cache; blocks that fall out of the
  window are freed, so its memory stays at about ``budget`` tokens per sequence, and a sequence's cache is
  built from its sink and last two windows only (a long prompt, or one the target prefilled from its
  prefix cache, costs the draft O(budget) tokens).

Sliding-window layers: the view is a property of the step, the layer's window one of the model, and the
attention backends apply both (:mod:`modeling.attention.metadata`): on a layer with window ``W`` a draft
query at position ``p`` reads only the view's keys in ``p - W + 1 .. p``, so a draft never attends to a
key the target would not see on that layer (the sink included, once it falls behind the window).

RoPE positions: keys are cached after rotation at their original positions, so draft queries use their
original positions too (``draft_positions='original'``); re-indexing queries into the compressed view
(``'reindexed'``) skews every query-key distance and is kept only to measure that cost
(benchmarks/results/spec_decode.md records acceptance under both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from decode_worker.config import SpeculationConfig
from modeling.block_pool import BlockPool, BlockTable
from modeling.grammar import DraftPath, constrain
from modeling.runner import ModelRunner, StepInput
from modeling.sampling import processed_logits, sample_from, target_probs
from modeling.sequence import Sequence


@dataclass
class Proposal:
    """k draft tokens per sequence and, for sampling requests, the draft distributions q [k, V]; for requests
    with structured output drafted under their grammar, the grammar's walk along the drafts (``paths``: its
    masks were applied to the draft's logits; ``close`` gives the masks the verification applies)."""

    tokens: list[list[int]]
    probs: list[torch.Tensor | None]
    paths: list[DraftPath | None] = field(default_factory=list)

    @classmethod
    def start(cls, seqs: list[Sequence], grammar_drafts: bool) -> "Proposal":
        paths = [DraftPath(s.sampler.grammar) if grammar_drafts and s.sampler.grammar is not None else None
                 for s in seqs]
        return cls([[] for _ in seqs], [None] * len(seqs), paths)


class Drafter(Protocol):
    name: str

    def admit(self, seq: Sequence) -> None:
        """Build draft state for a sequence whose target KV is complete up to ``seq.num_computed``."""

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's draft state."""

    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        """Draft k tokens after each sequence's last token. The target cache must already have room
        for positions up to ``len(seq.tokens) + k - 1``."""

    def on_verified(self, seq: Sequence, num_valid: int) -> None:
        """After verification: draft state beyond the first ``num_valid`` tokens is stale."""

    def kv_tokens_read(self, seq_len: int, step: int) -> int:
        """KV tokens one draft step reads for a sequence of ``seq_len`` tokens (for the cost model)."""


def window_start(config: SpeculationConfig, context: int) -> int:
    """First non-sink position a draft query at position ``context`` sees, keeping the view at
    ``budget`` prefix tokens (sink + window). Never beyond ``context`` (the metadata invariant)."""
    return min(context, max(config.sink_tokens, context - config.window))


def choose_draft_tokens(seqs: list[Sequence], logits: torch.Tensor, proposal: Proposal, step: int) -> list[int]:
    """Pick one draft token per sequence from draft logits [B, V], processed as the target's are at that
    position (penalties over the output and the drafts before it, bias, min_tokens, the grammar's mask where
    the request drafts under its grammar): the argmax for greedy requests, a sample from the request's
    distribution otherwise (recorded for rejection sampling)."""
    greedy = torch.argmax(logits, dim=-1).tolist()
    out = []
    for b, seq in enumerate(seqs):
        params = seq.sampler.params
        raw = logits[b : b + 1]
        row = processed_logits(seq.sampler, raw, seq.tokens, proposal.tokens[b])
        path = proposal.paths[b] if proposal.paths else None
        mask = path.next_mask() if path is not None else None
        if mask is not None:
            row = constrain(row, mask.unsqueeze(0))
        if params.greedy:
            tok = greedy[b] if row is raw else int(torch.argmax(row[0]).item())
        else:
            q = target_probs(row, params)[0]
            tok = sample_from(q, seq.sampler.generator)
            prev = proposal.probs[b]
            proposal.probs[b] = q.unsqueeze(0) if prev is None else torch.cat([prev, q.unsqueeze(0)])
        proposal.tokens[b].append(tok)
        if path is not None:
            path.keep(tok)
        out.append(tok)
    return out


class SelfSparseDrafter:
    """The target model over a sink + window view of its own KV (MagicDec self-speculation)."""

    name = "self_sparse"

    def __init__(self, runner: ModelRunner, config: SpeculationConfig):
        self.runner = runner
        self.config = config

    def admit(self, seq: Sequence) -> None:
        pass  # the view is built from the target KV on the fly

    def release(self, seq: Sequence) -> None:
        pass

    def on_verified(self, seq: Sequence, num_valid: int) -> None:
        pass  # verification rewrote every kept position with target KV

    def kv_tokens_read(self, seq_len: int, step: int) -> int:
        return min(seq_len, self.config.budget) + step + 1

    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        proposal = Proposal.start(seqs, self.config.grammar_drafts)
        first = [len(s.tokens) - 1 for s in seqs]  # position of each sequence's last (uncomputed) token
        starts = [window_start(self.config, p) for p in first]
        last = [s.tokens[-1] for s in seqs]
        for step in range(k):
            inputs = [
                StepInput([last[b]], first[b] + step, seq.block_table.blocks,
                          positions=[self._position(first[b], starts[b]) + step])
                for b, seq in enumerate(seqs)
            ]
            logits = self.runner.run(inputs, sink_len=self.config.sink_tokens, window_starts=starts)
            last = choose_draft_tokens(seqs, logits, proposal, step)
        return proposal

    def _position(self, pos: int, start: int) -> int:
        if self.config.draft_positions == "original" or start <= self.config.sink_tokens:
            return pos
        return self.config.sink_tokens + (pos - start)  # index within the compressed view


@dataclass(frozen=True)
class DraftLayout:
    """Where a sequence's draft-cache blocks sit in its table (``DraftModelDrafter.export_state``): the
    tokens whose draft KV is cached, the table's length, and the entries already evicted."""

    computed: int
    entries: int
    evicted: tuple[int, ...]


@dataclass
class _DraftState:
    table: BlockTable
    computed: int = 0  # leading tokens whose draft KV is cached
    evicted: set[int] = field(default_factory=set)  # indices of table entries already freed
    floor: int = 0  # no view reaches below this position past the sink: the blocks there are freed


class DraftModelDrafter:
    """A small draft model with its own StreamingLLM-style paged cache."""

    name = "draft_model"

    # Sentinel block id left in a table slot whose block was evicted; never read (outside the view).
    _EVICTED = 0

    def __init__(self, runner: ModelRunner, pool: BlockPool, config: SpeculationConfig, prefill_chunk: int = 512):
        self.runner = runner
        self.pool = pool
        self.config = config
        # chunks no longer than the window keep the cache at about sink + 2 * window tokens
        self.prefill_chunk = max(1, min(prefill_chunk, config.window))
        self._states: dict[str, _DraftState] = {}

    def kv_tokens_read(self, seq_len: int, step: int) -> int:
        return min(seq_len, self.config.budget) + step + 1

    def admit(self, seq: Sequence) -> None:
        """Streaming prefill of the sink and of the last two windows of tokens but the last (each chunk sees the
        sink, the window and itself): no view reaches further back than one window, so the tokens in between
        are skipped and the cache is built from O(budget) tokens whatever the context (a long prompt, or one
        prefilled from the target's prefix cache). The first window after the skip sees only what was
        computed; the next ones see full views."""
        state = _DraftState(BlockTable(self.pool.block_size))
        self._states[seq.request_id] = state
        target = len(seq.tokens) - 1
        bs = self.pool.block_size
        sink_end = min(target, -(-self.config.sink_tokens // bs) * bs)  # the sink's blocks, whole
        resume = max(sink_end, (target - 2 * self.config.window) // bs * bs)
        while state.computed < target:
            if state.computed == sink_end and resume > sink_end:
                self._skip(state, resume)
            end = sink_end if state.computed < sink_end else target
            n = min(self.prefill_chunk, end - state.computed)
            self._forward([seq], [seq.tokens[state.computed : state.computed + n]], num_logits=0)

    def _skip(self, state: _DraftState, position: int) -> None:
        """Go on from block-aligned ``position``: the table's entries below it, past the sink's, are marked
        evicted without ever holding a block."""
        bs = self.pool.block_size
        first = len(state.table.blocks)
        state.table.blocks.extend([self._EVICTED] * (position // bs - first))
        state.evicted.update(range(first, position // bs))
        state.computed = state.floor = position

    def release(self, seq: Sequence) -> None:
        state = self._states.pop(seq.request_id, None)
        if state is not None:
            self._free(state, range(len(state.table.blocks)))
            state.table.blocks = []

    def holds(self, seq: Sequence) -> bool:
        """Whether the sequence's draft cache is here (admitted, or imported)."""
        return seq.request_id in self._states

    def export_state(self, seq: Sequence) -> tuple[torch.Tensor, "DraftLayout"]:
        """The sequence's draft cache as it is (live migration): the KV of its blocks still in the window,
        [layers, 2, n, block_size, kv_heads, head_dim], and where they sit in its table."""
        state = self._states[seq.request_id]
        live = [i for i in range(len(state.table.blocks)) if i not in state.evicted]
        ids = torch.tensor([state.table.blocks[i] for i in live], dtype=torch.int64, device=self.runner.cache.kv.device)
        kv = self.runner.cache.kv.index_select(2, ids).contiguous()
        return kv, DraftLayout(state.computed, len(state.table.blocks), tuple(sorted(state.evicted)))

    def import_state(self, seq: Sequence, kv: torch.Tensor, layout: "DraftLayout") -> None:
        """Continue from a draft cache another instance exported (the same draft model and block size): the
        sequence drafts exactly as it would have there."""
        live = [i for i in range(layout.entries) if i not in set(layout.evicted)]
        expect = (*self.runner.cache.kv.shape[:2], len(live), *self.runner.cache.kv.shape[3:])
        if tuple(kv.shape) != expect:
            raise ValueError(f"draft cache: expected a tensor of shape {expect}, got {tuple(kv.shape)}")
        blocks = self.pool.allocate(len(live))
        evicted = set(layout.evicted)
        state = _DraftState(BlockTable(self.pool.block_size), layout.computed, evicted,
                            (max(evicted) + 1) * self.pool.block_size if evicted else 0)
        state.table.blocks = [self._EVICTED] * layout.entries
        for i, b in zip(live, blocks):
            state.table.blocks[i] = b
        self.runner.cache.kv.index_copy_(2, torch.tensor(blocks, dtype=torch.int64, device=kv.device), kv)
        self._states[seq.request_id] = state

    def on_verified(self, seq: Sequence, num_valid: int) -> None:
        state = self._states[seq.request_id]
        state.computed = min(state.computed, num_valid)

    def propose(self, seqs: list[Sequence], k: int) -> Proposal:
        proposal = Proposal.start(seqs, self.config.grammar_drafts)
        # first step catches each sequence up on tokens the draft has not seen (accepted + new token)
        feeds = [s.tokens[self._states[s.request_id].computed :] for s in seqs]
        for step in range(k):
            logits = self._forward(seqs, feeds, num_logits=1)
            feeds = [[t] for t in choose_draft_tokens(seqs, logits, proposal, step)]
        return proposal

    def _forward(self, seqs: list[Sequence], feeds: list[list[int]], num_logits: int) -> torch.Tensor:
        inputs, starts = [], []
        for seq, feed in zip(seqs, feeds):
            state = self._states[seq.request_id]
            start = max(window_start(self.config, state.computed), state.floor)
            state.table.ensure_capacity(self.pool, state.computed + len(feed))
            self._evict_before(state, start)
            inputs.append(StepInput(feed, state.computed, state.table.blocks, num_logits=num_logits))
            starts.append(start)
        logits = self.runner.run(inputs, sink_len=self.config.sink_tokens, window_starts=starts)
        for seq, feed in zip(seqs, feeds):
            self._states[seq.request_id].computed += len(feed)
        return logits

    def _evict_before(self, state: _DraftState, start: int) -> None:
        """Free blocks wholly between the sink and ``start``: no future view can reach them."""
        bs = self.pool.block_size
        first = -(-self.config.sink_tokens // bs)  # blocks overlapping the sink stay
        last = start // bs  # blocks [first, last) lie entirely below start
        self._free(state, range(first, last))

    def _free(self, state: _DraftState, indices) -> None:
        doomed = [i for i in indices if i < len(state.table.blocks) and i not in state.evicted]
        if doomed:
            self.pool.free([state.table.blocks[i] for i in doomed])
            for i in doomed:
                state.table.blocks[i] = self._EVICTED
                state.evicted.add(i)
            state.floor = max(state.floor, (max(doomed) + 1) * self.pool.block_size)
