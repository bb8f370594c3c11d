"""A held sequence's tokens, out: appended (up to a stop), streamed as text, numbered in a ``TokenDelta``; a
sequence that finishes leaves the instance. Every token a decode instance produces goes through here: a
first token (``start``) or a step's verdict (``commit``)."""

from __future__ import annotations

from typing import Callable

import torch

from decode_worker.held import HeldRequest
from decode_worker.messages import TokenDelta
from decode_worker.metrics import WorkerMetrics
from decode_worker.scheduler import DecodeScheduler
from decode_worker.speculation import Speculator
from decode_worker.verify import Verdict
from modeling.forks import split_sequence_id
from modeling.resume import seeded_state
from modeling.sampling import token_logprobs
from modeling.sequence import FinishReason, Sequence, SequenceStatus


class SequenceOutput:
    """Emits the tokens of the sequences in ``requests`` (the worker's) and retires those that finish."""

    def __init__(self, requests: dict[str, HeldRequest], scheduler: DecodeScheduler, speculator: Speculator,
                 metrics: WorkerMetrics, on_leave: Callable[[str], None]):
        """``on_leave(request_id)``: a sequence left (finished or aborted); whatever else tracks it forgets it."""
        self.requests = requests
        self.scheduler = scheduler
        self.speculator = speculator  # its drafter changes with the speculation settings: read it each time
        self.metrics = metrics
        self.on_leave = on_leave

    def start(self, held: HeldRequest, first_token: int, logprobs: tuple = ()) -> TokenDelta:
        """Start decoding a sequence whose prompt is computed, from its first token (sampled here): the delta
        carries the token and its text."""
        return self._start(held, first_token, logprobs, None)

    def start_after(self, held: HeldRequest, first_token: int, text_sent: int) -> TokenDelta:
        """Start decoding a sequence from a first token the client already has, with ``text_sent`` characters
        of its text (the prefill instance sampled and streamed it): the delta continues after them, at the next
        position (no token; the text only where this side's cut differs, a finish where the token ends it)."""
        return self._start(held, first_token, (), text_sent)

    def _start(self, held: HeldRequest, first_token: int, logprobs: tuple, text_sent: int | None) -> TokenDelta:
        seq = held.seq
        self.scheduler.start(seq)
        position, text_offset = len(seq.tokens) - seq.num_prompt, held.stream.sent
        reason = seq.append_token(first_token)
        text, reason = held.stream.push([first_token], reason)
        self.metrics.tokens += 1
        if reason is not None:
            self.finish(held, reason)
        else:
            self.speculator.drafter.admit(seq)
        ids = [first_token]
        if text_sent is not None:  # the token and the first ``text_sent`` characters went out with prefill's
            skip = min(text_sent, len(text))
            ids, text, position, text_offset = [], text[skip:], position + 1, text_offset + skip
        rid, index = split_sequence_id(seq.request_id)
        return TokenDelta(rid, ids, text, reason is not None, reason.value if reason is not None else None,
                          logprobs=logprobs, index=index, position=position, text_offset=text_offset,
                          sampler_state=seeded_state(seq))

    def commit(self, held: HeldRequest, verdict: Verdict, k: int, logits: torch.Tensor) -> TokenDelta:
        """Append the verdict's tokens (up to a stop), roll back rejected KV, emit the delta. logits: the
        target's [k + 1, V] at the verified positions (the log-probabilities reported come from them)."""
        seq = held.seq
        n = len(seq.tokens)
        position, text_offset = n - seq.num_prompt, held.stream.sent
        appended: list[int] = []
        reason = None
        for tok in verdict.tokens:
            appended.append(tok)
            reason = seq.append_token(tok)
            if reason is not None:
                break
        logprobs = self.logprobs(seq, logits, appended)
        # verification computed target KV at positions n-1 .. n-1+accepted: final wherever a token was kept
        self.scheduler.prefix_cache.commit(seq, n + verdict.num_accepted)
        text, reason = held.stream.push(appended, reason)
        if k > 0:
            self.metrics.draft_tokens += k
            self.metrics.accepted_tokens += verdict.num_accepted
            self.metrics.seq_spec_steps += 1
        self.metrics.tokens += len(appended)
        if reason is not None:
            self.finish(held, reason)
        else:
            # positions after n-1+accepted hold draft KV, stale now: keep room for the next step's one
            seq.num_computed = n + verdict.num_accepted
            seq.block_table.truncate(self.scheduler.pool, seq.num_computed + 1)
            self.speculator.drafter.on_verified(seq, seq.num_computed)
        rid, index = split_sequence_id(seq.request_id)
        return TokenDelta(rid, appended, text, reason is not None, reason.value if reason is not None else None, k,
                          verdict.num_accepted, logprobs, index=index, position=position, text_offset=text_offset,
                          sampler_state=seeded_state(seq) if reason is None else b"")

    def finish(self, held: HeldRequest, reason: FinishReason) -> None:
        """``held`` leaves the instance, wherever it is (running, preempted, migrating); its blocks are freed
        (the cached ones stay cached)."""
        seq = held.seq
        self.requests.pop(seq.request_id, None)
        self.on_leave(seq.request_id)
        self.speculator.drafter.release(seq)
        self.scheduler.finish(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    @staticmethod
    def logprobs(seq: Sequence, logits: torch.Tensor, tokens: list[int]) -> tuple:
        """The target's log-probabilities of ``tokens`` (row j of logits [>= len, V] is token j's position),
        when the request asked for them."""
        num = seq.sampler.params.logprobs
        return () if num is None else tuple(token_logprobs(logits, tokens, num))
