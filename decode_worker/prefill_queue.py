"""Prompts computed on the decode instance itself (``LocalPrefill``): a few chunks per step, oldest first,
with no prefill instance involved; and the chunked KV computation that preempted and resumed sequences
recompute with."""

from __future__ import annotations

import time
from collections import deque

import torch

from decode_worker.first_tokens import FirstTokens
from decode_worker.held import HeldRequest
from decode_worker.messages import TokenDelta
from modeling.pass_log import PassLog
from modeling.prefix_cache import PrefixCache
from modeling.runner import ModelRunner, StepInput
from modeling.sequence import Sequence


class PrefillQueue:
    """The requests in ``order`` (admitted ``prefilling``, first come first served), computed
    ``chunk`` tokens per step in all."""

    def __init__(self, runner: ModelRunner, requests: dict[str, HeldRequest], order: deque[str],
                 prefix_cache: PrefixCache, chunk: int, pass_log: PassLog, first_tokens: FirstTokens):
        self.runner = runner
        self.requests = requests
        self.order = order
        self.prefix_cache = prefix_cache
        self.chunk = chunk
        self.pass_log = pass_log
        self.first_tokens = first_tokens

    def __len__(self) -> int:
        return len(self.order)

    def cancel(self, request_id: str) -> None:
        """``request_id`` leaves the queue (the caller frees it)."""
        self.order.remove(request_id)

    def step(self) -> list[TokenDelta]:
        """Compute up to ``chunk`` prompt tokens of the queued requests, oldest first; those whose prompt is
        complete sample their first token and start decoding."""
        budget, out = self.chunk, []
        while self.order and budget > 0:
            held = self.requests[self.order[0]]
            seq = held.seq
            start = time.perf_counter()
            end = min(seq.num_prompt, seq.num_computed + budget)
            done = end == seq.num_prompt
            logits = self.runner.run([StepInput(seq.tokens[seq.num_computed:end], seq.num_computed,
                                                seq.block_table.blocks, num_logits=int(done))])
            self.pass_log.record("prefill", time.perf_counter() - start,
                                 chunks=[[seq.num_computed, end - seq.num_computed]])
            budget -= end - seq.num_computed
            seq.num_computed = end
            if not done:
                break
            self.order.popleft()
            self.prefix_cache.commit(seq, seq.num_prompt)
            out += self.first_tokens.after_prefill(held, logits)
        return out

    def run_now(self, request_id: str) -> list[TokenDelta]:
        """Compute a queued request's whole prompt now, out of turn, and start it (tests, benchmarks,
        single-process use)."""
        self.order.remove(request_id)
        held = self.requests[request_id]
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
            logits = self.runner.run([StepInput(seq.tokens[start:end], start, seq.block_table.blocks,
                                                num_logits=int(last))])
        seq.num_computed = upto
        return logits
