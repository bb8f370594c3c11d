"""Starting a request whose prompt is computed: its first sequence from the first token (sent by the prefill
instance with the KV, or sampled here from the last prompt position), and its further sequences (n > 1)
forked from it through the admission door (``Fork``), each from its own first token."""

from __future__ import annotations

import dataclasses
import time

import torch

from decode_worker.admission import Admission
from decode_worker.held import HeldRequest
from decode_worker.messages import DecodeRequest, TokenDelta
from decode_worker.sequence_output import SequenceOutput
from decode_worker.sources import Fork
from kv_transfer.receiver import ReceivedKV
from modeling.errors import InvalidRequestError
from modeling.forks import decode_starts, sequence_id
from modeling.prefix_cache import PrefixCache
from modeling.resume import generator_state
from modeling.sampling import RequestSampler


class FirstTokens:
    """Starts held requests once their prompt's KV is here."""

    def __init__(self, admission: Admission, output: SequenceOutput, prefix_cache: PrefixCache):
        self.admission = admission
        self.output = output
        self.prefix_cache = prefix_cache

    def after_transfer(self, held: HeldRequest, kv: ReceivedKV) -> list[TokenDelta]:
        """The prompt's KV and first token arrived: every sequence starts from its first token, which the
        router streamed from the prefill instance with its text and log-probability; the deltas here continue
        after it (the next position, the characters after those the client has). Raises InvalidRequestError
        naming the field the transfer got wrong."""
        seq = held.seq
        if kv.first_token is None:
            raise InvalidRequestError("first_token", f"the transfer of {kv.request_id!r} carried none")
        if kv.sampler_state:
            seq.sampler.generator.set_state(generator_state(kv.sampler_state))
        try:
            starts = decode_starts(kv.state)
        except ValueError as err:
            raise InvalidRequestError("state", str(err)) from None
        if len(starts.forks) != seq.sampler.params.num_sequences - 1:
            raise InvalidRequestError("state", f"{len(starts.forks)} further sequences arrived for a request of "
                                      f"{seq.sampler.params.num_sequences}")
        seq.num_computed = seq.num_prompt
        self.prefix_cache.commit(seq, seq.num_prompt)
        forks = []
        for f in starts.forks:
            sampler = seq.sampler.for_sequence(f.index)
            sampler.generator.set_state(generator_state(f.sampler_state))
            forks.append((f.index, f.token, sampler))
        return self._start_all(held, kv.first_token, forks, sent=starts.text_sent, first_token_at=starts.first_token_at)

    def after_prefill(self, held: HeldRequest, logits: torch.Tensor) -> list[TokenDelta]:
        """The prompt was computed here: every sequence samples its first token from the last position's
        logits [1, V] (sequence i with its own generator) and starts; the first delta says what was found of
        the prompt rather than computed."""
        seq = held.seq
        forks = []
        for i in range(1, seq.sampler.params.num_sequences):
            sampler = seq.sampler.for_sequence(i)
            forks.append((i, sampler.choose(logits[0], seq.tokens), sampler))
        token = seq.sampler.choose(logits[0], seq.tokens)
        first, *rest = self._start_all(held, token, forks, logits[:1])
        return [dataclasses.replace(first, cached=self.prefix_cache.found(seq.request_id)), *rest]

    def _start_all(self, held: HeldRequest, token: int, forks: list[tuple[int, int, RequestSampler]],
                   logits: torch.Tensor | None = None, sent: tuple[int, ...] | None = None,
                   first_token_at: float | None = None) -> list[TokenDelta]:
        """Fork the further sequences ``(index, first token, sampler)`` off ``held``, then start them all;
        with ``logits`` [1, V], each delta carries its first token's log-probabilities. ``sent``: the first
        tokens were streamed already (by the prefill instance), with this many characters of text by sequence
        index: the deltas start after them. ``first_token_at``: when the client got them (None: now)."""
        rid, seq = held.seq.request_id, held.seq
        prompt, params = tuple(seq.prompt_ids), seq.sampler.params
        pairs = [(held, token)]
        for index, first, sampler in forks:
            sid = sequence_id(rid, index)
            self.admission.admit(DecodeRequest(sid, prompt, params), Fork(rid, index, sampler))
            pairs.append((self.admission.requests[sid], first))
        at = time.time() if first_token_at is None else first_token_at
        for h, _ in pairs:
            h.first_token_at = at
        # every fork first: the first sequence may finish at its first token and free the blocks they share
        if sent is not None:
            return [self.output.start_after(h, tok, sent[i] if i < len(sent) else 0) for i, (h, tok) in enumerate(pairs)]
        return [self.output.start(h, tok, () if logits is None else self.output.logprobs(h.seq, logits, [tok]))
                for h, tok in pairs]
