"""Prompts computed on the decode instance itself (``LocalPrefill``): each step as many of their tokens as the
TPOT slack of the sequences decoding beside them allows (``decode_worker/prefill_budget.py``), the fewest
remaining tokens first, with no prefill instance involved; and the chunked KV computation that preempted and
resumed sequences recompute with.

A step's chunks (``plan``) ride in the decode pass of the sequences decoding (``Speculator.run``'s riders), or,
with none decoding, run in passes of their own (``step``); ``finish`` then starts the requests whose prompt
they completed. A request whose cached prefix the tiers are still loading in the background
(``PrefixCache.load_from_tiers``) gets no chunk until the load is in; one whose load fell short (a block missing
or corrupt) leaves the queue, for the worker to fail (``take_failed_loads``)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable

import torch

from decode_worker.first_tokens import FirstTokens
from decode_worker.held import HeldRequest
from decode_worker.prefill_budget import Pace, PrefillBudget
from decode_worker.messages import TokenDelta
from modeling.pass_log import PassLog
from modeling.prefix_cache import PrefixCache
from modeling.runner import ModelRunner, StepInput
from modeling.sequence import Sequence


@dataclass(frozen=True)
class PrefillChunk:
    """Positions ``start .. end`` of a queued request's prompt, computed by one step."""

    held: HeldRequest
    start: int
    end: int

    @property
    def done(self) -> bool:
        """The chunk completes the prompt: its last position's logits give the first token."""
        return self.end == self.held.seq.num_prompt

    def step_input(self) -> StepInput:
        seq = self.held.seq
        return StepInput(seq.tokens[self.start:self.end], self.start, seq.block_table.blocks,
                         num_logits=int(self.done))


class PrefillQueue:
    """The requests in ``order`` (admitted ``prefilling``; the fewest remaining tokens first, ties first come first
    served, a late request after every one that is not: ``LocalPrefill.late``), computed ``budget``'s tokens per
    step in all (at most ``budget.chunk``)."""

    def __init__(self, runner: ModelRunner, requests: dict[str, HeldRequest], order: deque[str],
                 prefix_cache: PrefixCache, budget: PrefillBudget, pass_log: PassLog, first_tokens: FirstTokens):
        self.runner = runner
        self.requests = requests
        self.order = order
        self.prefix_cache = prefix_cache
        self.budget = budget
        self.chunk = budget.chunk
        self.pass_log = pass_log
        self.first_tokens = first_tokens
        self.last_seconds = 0.0  # the prompt passes of the latest ``step``
        self._failed_loads: list[str] = []
        self._begun: set[str] = set()  # queued requests a step has computed a chunk of

    def __len__(self) -> int:
        return len(self.order)

    def queued_tokens(self) -> int:
        """Prompt tokens the queue has still to compute."""
        return sum(self._remaining(rid) for rid in self.order)

    def _remaining(self, request_id: str) -> int:
        seq = self.requests[request_id].seq
        return seq.num_prompt - seq.num_computed

    def head_start(self) -> int:
        """Positions computed of the prompt at the head of the queue (0 when the queue is empty)."""
        return self.requests[self.order[0]].seq.num_computed if self.order else 0

    def cancel(self, request_id: str) -> None:
        """``request_id`` leaves the queue (the caller frees it)."""
        self.order.remove(request_id)
        self._begun.discard(request_id)

    def unbegun(self) -> list[str]:
        """The queued requests no step has computed a chunk of (their prompt past its cached prefix untouched),
        in queue order."""
        return [rid for rid in self.order if rid not in self._begun]

    def take_failed_loads(self) -> list[str]:
        """The requests that left the queue since the last call because a block of their background tier load was
        missing or corrupt (their blocks are still held: the caller drops them)."""
        failed, self._failed_loads = self._failed_loads, []
        return failed

    def _loading(self, request_id: str) -> bool:
        return self.prefix_cache is not None and self.prefix_cache.loading(request_id)

    def _settle_loads(self) -> None:
        """Finish the background tier loads that are done; a request whose load fell short leaves the queue."""
        for rid in [r for r in self.order if self._loading(r) and self.prefix_cache.load_done(r)]:
            if not self.prefix_cache.finish_load(self.requests[rid].seq):
                self.order.remove(rid)
                self._begun.discard(rid)
                self._failed_loads.append(rid)

    def plan(self, decoding: bool, paces: Iterable[Pace] = (), arriving: Iterable[int] = ()) -> list[PrefillChunk]:
        """The chunks of the step (``decoding``: sequences decode beside them, at ``paces``, and requests join
        whose KV is arriving, with ``arriving`` output tokens to come): the tokens the budget allows, the fewest
        remaining first, none for a request whose tier load is still running; all but the last complete their
        prompt."""
        self._settle_loads()
        if len(self.order) > 1:  # shortest remaining first: a conversation's next turn does not wait on a document
            ranked = sorted(self.order, key=lambda rid: (self.requests[rid].late, self._remaining(rid)))
            self.order.clear()
            self.order.extend(ranked)
        paces, arriving = list(paces), list(arriving)
        budget, chunks, spent_s = self.budget.tokens(self.head_start(), decoding, paces, arriving), [], 0.0
        fitted = decoding and self.budget.tpot_slo_s is not None and self.budget.cost.ready
        for rid in self.order:
            if budget <= 0:
                break
            if self._loading(rid):
                continue
            held = self.requests[rid]
            start = held.seq.num_computed
            n = budget
            if chunks and fitted:  # a later chunk is deeper into its prompt: sized by what the slack has left
                n = min(n, self.budget.tokens(start, decoding, paces, arriving, spent_s))
                if n <= 0:
                    break
            end = min(held.seq.num_prompt, start + n)
            chunks.append(PrefillChunk(held, start, end))
            budget -= end - start
            if fitted:
                spent_s += self.budget.fused_s(start, end - start)
        return chunks

    def finish(self, chunks: list[PrefillChunk], logits: torch.Tensor) -> list[TokenDelta]:
        """The chunks were computed (``logits`` [done chunks, V], in order): those that complete their prompt
        sample their first token and start decoding."""
        out, row = [], 0
        for chunk in chunks:
            seq = chunk.held.seq
            seq.num_computed = chunk.end
            if not chunk.done:
                self._begun.add(seq.request_id)
                continue
            self.order.remove(seq.request_id)
            self._begun.discard(seq.request_id)
            self.prefix_cache.commit(seq, seq.num_prompt)
            out += self.first_tokens.after_prefill(chunk.held, logits[row:row + 1])
            row += 1
        return out

    def step(self, decoding: bool, paces: Iterable[Pace] = (), arriving: Iterable[int] = ()) -> list[TokenDelta]:
        """Compute the step's chunks (``plan``) in passes of their own, one per request (no decode pass to ride
        in), and start the requests whose prompt is complete."""
        chunks = self.plan(decoding, paces, arriving)
        self.last_seconds, rows = 0.0, []
        for chunk in chunks:
            start = time.perf_counter()
            logits = self.runner.run([chunk.step_input()])
            seconds = time.perf_counter() - start
            self.last_seconds += seconds
            n = chunk.end - chunk.start
            self.budget.observe_prefill(chunk.start, n, seconds)
            self.pass_log.record("prefill", seconds, chunks=[[chunk.start, n]])
            rows.append(logits)
        return self.finish(chunks, torch.cat(rows) if rows else torch.empty(0))

    def run_now(self, request_id: str) -> list[TokenDelta]:
        """Compute a queued request's whole prompt now, out of turn, and start it (tests, benchmarks,
        single-process use)."""
        self.order.remove(request_id)
        held = self.requests[request_id]
        if not self.prefix_cache.finish_load(held.seq):
            raise RuntimeError(f"{request_id}: a KV block loaded from a tier was missing or corrupt")
        logits = self.compute(held.seq, held.seq.num_prompt, want_logits=True)
        self.prefix_cache.commit(held.seq, held.seq.num_prompt)
        return self.first_tokens.after_prefill(held, logits)

    def compute(self, seq: Sequence, upto: int, want_logits: bool) -> torch.Tensor:
        """Compute the KV of ``tokens[num_computed:upto]`` in chunks; the logits [1, V] of the last one if
        wanted (else empty)."""
        logits = torch.empty(0)
        for start in range(seq.num_computed, upto, self.chunk):
            end = min(upto, start + self.chunk)
            last = end == upto and want_logits
            t0 = time.perf_counter()
            logits = self.runner.run([StepInput(seq.tokens[start:end], start, seq.block_table.blocks,
                                                num_logits=int(last))])
            self.budget.observe_prefill(start, end - start, time.perf_counter() - t0)
        seq.num_computed = upto
        return logits
