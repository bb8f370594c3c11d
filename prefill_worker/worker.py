"""The prefill worker: chunked prefill over its own paged KV cache, first-token sampling, and the
hand-off of each prompt's KV to kv_transfer.

A plain class (the controller wraps it as a Ray actor). ``step()`` is the loop's skeleton:

    apply transfer events (free acknowledged KV)  ->  schedule chunks  ->  announce new transfers
    ->  forward, streaming each layer's KV as it is written  ->  sample first tokens
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kv_transfer.channel import Rendezvous
from kv_transfer.descriptors import KVFingerprint
from kv_transfer.errors import TransferError
from kv_transfer.heads import HeadRange
from kv_transfer.sender import KVSender, LegTarget
from kv_transfer.streaming import LayerStreamingContext
from modeling.attention import make_backend
from modeling.block_pool import BlockPool, BlockTable
from modeling.checkpoint import LoadedModel, load_model
from modeling.errors import InvalidRequestError
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.pass_log import PassLog
from modeling.runner import ModelRunner, StepInput
from modeling.sampling import RequestSampler
from modeling.scheduler import ScheduledChunk, SchedulerConfig
from modeling.sequence import Sequence
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.messages import FirstToken, PrefillFailure, PrefillRequest, PrefillStepOutput
from prefill_worker.scheduler import PrefillScheduler


@dataclass
class _Request:
    request: PrefillRequest
    seq: Sequence
    arrival: float


class PrefillWorker:
    """Owns a model, a paged KV cache, a chunked-prefill scheduler and a KV sender."""

    def __init__(self, model: LoadedModel | str, config: PrefillWorkerConfig = PrefillWorkerConfig(),
                 instance_id: str = "prefill-0"):
        self.config = config
        self.instance_id = instance_id
        self.loaded = model if isinstance(model, LoadedModel) else load_model(model, config.dtype, config.device)
        mc = self.loaded.config
        spec = KVCacheSpec(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, config.block_size,
                           self.loaded.dtype)
        self.pool = BlockPool(config.kv_cache_tokens // config.block_size, config.block_size)
        self.cache = PagedKVCache(spec, self.pool.num_blocks, self.loaded.device)
        self.backend = make_backend(config.attention_backend, self.loaded.device, config.block_size)
        self.runner = ModelRunner(self.loaded.model, self.cache, self.backend)
        self.pass_log = PassLog()
        self.scheduler = PrefillScheduler(SchedulerConfig(config.token_budget, config.max_num_seqs), self.pool)
        self.fingerprint = KVFingerprint.of(mc, config.block_size, self.loaded.dtype)
        self.sender = KVSender(self.cache, instance_id, self.fingerprint, HeadRange(0, mc.num_key_value_heads),
                               config.transfer)
        self._requests: dict[str, _Request] = {}

    # -- control ----------------------------------------------------------------------------------

    def connect(self, decode_id: str, rendezvous: Rendezvous, generation: int = 0) -> None:
        """Form the KV channel to a decode instance (its receiver connects to this id concurrently)."""
        self.sender.connect(decode_id, rendezvous, generation)

    def add_request(self, request: PrefillRequest) -> None:
        """Validate and queue a prompt. Raises InvalidRequestError naming the field."""
        if not request.request_id:
            raise InvalidRequestError("request_id", "must not be empty")
        if request.request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        vocab = self.loaded.config.vocab_size
        request.params.validate(vocab_size=vocab)
        if not request.prompt_ids:
            raise InvalidRequestError("prompt_ids", "must not be empty")
        for i, t in enumerate(request.prompt_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(f"prompt_ids[{i}]", f"must be an integer in [0, {vocab}), got {t!r}")
        if self.pool.blocks_for_tokens(len(request.prompt_ids)) > self.pool.num_blocks:
            raise InvalidRequestError("prompt_ids", f"{len(request.prompt_ids)} tokens exceed the KV cache "
                                                    f"({self.pool.num_blocks * self.pool.block_size} tokens)")
        seq = Sequence(request.request_id, list(request.prompt_ids), RequestSampler(request.params),
                       frozenset(self.loaded.eos_token_ids), BlockTable(self.config.block_size),
                       max_model_len=self.loaded.config.max_position_embeddings)
        arrival = request.arrival_time if request.arrival_time is not None else time.perf_counter()
        self._requests[request.request_id] = _Request(request, seq, arrival)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request that is not yet transferring (False otherwise: its transfer runs to the end)."""
        req = self._requests.get(request_id)
        if req is None or request_id in self.scheduler.handed_off:
            return False
        if any(s.request_id == request_id for s in self.scheduler.running):
            return False  # its descriptor is out; let the transfer finish or fail
        self.scheduler.release(request_id)
        del self._requests[request_id]
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> PrefillStepOutput:
        """One iteration; returns first tokens, acknowledged transfers and failures."""
        out = PrefillStepOutput()
        self._apply_transfer_events(out)
        chunks = self.scheduler.schedule()
        chunks = self._begin_transfers(chunks, out)
        if chunks:
            t0 = time.perf_counter()
            logits = self._forward(chunks)
            self.pass_log.record("prefill", time.perf_counter() - t0, chunks=[[c.start, c.num_tokens] for c in chunks])
            out.first_tokens.extend(self._sample(chunks, logits))
        return out

    # -- internals --------------------------------------------------------------------------------

    def _apply_transfer_events(self, out: PrefillStepOutput) -> None:
        events = self.sender.poll()
        for rid in events.done:
            self.scheduler.release(rid)
            self._requests.pop(rid, None)
            out.transferred.append(rid)
        for failure in events.failed:
            self.scheduler.release(failure.request_id)
            self._requests.pop(failure.request_id, None)
            out.failed.append(PrefillFailure(failure.request_id, str(failure.error), failure.error.retryable))

    def _begin_transfers(self, chunks: list[ScheduledChunk], out: PrefillStepOutput) -> list[ScheduledChunk]:
        """Announce the KV of prompts starting this step; drop those whose destination is unreachable."""
        kept = []
        for c in chunks:
            dest = self._requests[c.seq.request_id].request.destination
            if c.start == 0 and dest is not None:
                target = LegTarget(dest.decode_id, self.sender.heads, dest.block_ids)
                try:
                    self.sender.begin(c.seq.request_id, c.seq.num_prompt, c.seq.block_table.blocks, [target])
                except TransferError as err:
                    self.scheduler.release(c.seq.request_id)
                    del self._requests[c.seq.request_id]
                    out.failed.append(PrefillFailure(c.seq.request_id, str(err), err.retryable))
                    continue
            kept.append(c)
        return kept

    def _ready_blocks(self, chunk: ScheduledChunk) -> int:
        """Blocks of the prompt whose KV is final once this chunk is computed."""
        end = chunk.start + chunk.num_tokens
        if chunk.sample:
            return self.pool.blocks_for_tokens(end)
        return end // self.config.block_size if self.config.layerwise_streaming else 0

    @torch.inference_mode()
    def _forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run the chunks; KV streams out layer by layer (or after the pass). Returns logits [n_sample, V]."""
        inputs = [StepInput(c.seq.tokens[c.start : c.start + c.num_tokens], c.start, c.seq.block_table.blocks,
                            num_logits=1 if c.sample else 0) for c in chunks]
        ids, positions, meta, rows = self.runner.build(inputs)
        ready = {c.seq.request_id: self._ready_blocks(c) for c in chunks}
        model = self.loaded.model
        if self.config.layerwise_streaming:
            group = self.sender.open_group(ready)
            ctx = LayerStreamingContext(self.cache, meta, self.backend, group.send_layer)
            hidden = model(ids, positions, ctx)
            group.close()
        else:
            ctx = LayerStreamingContext(self.cache, meta, self.backend, lambda layer: None)
            hidden = model(ids, positions, ctx)
            group = self.sender.open_group(ready)
            for layer in range(self.loaded.config.num_hidden_layers):
                group.send_layer(layer)
            group.close()
        if not rows:
            return torch.empty(0, self.loaded.config.vocab_size)
        return model.logits(hidden.index_select(0, torch.tensor(rows, dtype=torch.int64, device=hidden.device)))

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[FirstToken]:
        now = time.perf_counter()
        firsts = []
        row = 0
        for c in chunks:
            seq = c.seq
            seq.num_computed += c.num_tokens
            if not c.sample:
                continue
            token = seq.sampler.choose(logits[row])
            row += 1
            seq.append_token(token)
            req = self._requests[seq.request_id]
            firsts.append(FirstToken(seq.request_id, token, now - req.arrival, seq.num_prompt))
            self.scheduler.hand_off(seq)
            if req.request.destination is not None:  # the first token ends the transfer: decode continues from it
                self.sender.finish_prompt(seq.request_id, token, seq.sampler.generator.get_state().numpy().tobytes())
            else:  # nothing to transfer: done with this prompt
                self.scheduler.release(seq.request_id)
                del self._requests[seq.request_id]
        return firsts
