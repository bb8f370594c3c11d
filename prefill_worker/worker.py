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
from kv_transfer.rank_sync import FollowerOutcomes, exchange_outcomes
from kv_transfer.sender import KVSender
from kv_transfer.streaming import forward_streaming, leg_targets
from modeling.block_pool import BlockPool, BlockTable
from modeling.checkpoint import LoadedModel
from modeling.errors import InvalidRequestError
from modeling.forks import ForkStart, encode_forks
from modeling.heads import peer_ranks, rank_peer_id
from modeling.pass_log import PassLog
from modeling.prefix_cache import PrefixCache
from modeling.prefix_hash import kv_salt
from modeling.request_check import check_request
from modeling.runner import StepInput
from modeling.sampling import PromptLogprobs, sampler_for, token_logprobs
from modeling.scheduler import ScheduledChunk
from modeling.sequence import Sequence
from modeling.tp_group import TPGroup
from modeling.tp_runner import TPDriverRunner, TPFollower, build_runner, load_for_rank
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.messages import FirstToken, PrefillFailure, PrefillRequest, PrefillStepOutput
from prefill_worker.scheduler import PrefillScheduler
from prefill_worker.tp_rank import PrefillRankFollower


@dataclass
class _Request:
    request: PrefillRequest
    seq: Sequence
    arrival: float
    prompt_scorer: PromptLogprobs | None = None


class PrefillWorker:
    """Owns a model, a paged KV cache, a chunked-prefill scheduler and a KV sender."""

    def __init__(self, model: LoadedModel | str, config: PrefillWorkerConfig = PrefillWorkerConfig(),
                 instance_id: str = "prefill-0", tp: TPGroup | None = None):
        """``tp``: drive a tensor-parallel instance as its rank 0 (the other ranks run :func:`follower`);
        ``model`` is then a path, loaded as this rank's shard, and each rank sends its own KV heads."""
        self.config = config
        self.instance_id = instance_id
        self.loaded = model if isinstance(model, LoadedModel) else load_for_rank(model, config.dtype, config.device, tp)
        mc = self.loaded.config
        self.pool = BlockPool(config.kv_cache_tokens // config.block_size, config.block_size)
        self.runner = build_runner(self.loaded, self.pool.num_blocks, config.block_size, config.attention_backend, tp)
        self.cache, self.backend = self.runner.cache, self.runner.backend
        self.pass_log = PassLog()
        self.prefix_cache = PrefixCache(self.pool, kv_salt(self.loaded.path, self.loaded.dtype, config.block_size),
                                        config.prefix_caching)
        self.scheduler = PrefillScheduler(config, self.pool, self.prefix_cache)
        self.fingerprint = KVFingerprint.of(mc, config.block_size, self.loaded.dtype)
        self.tp = tp if tp is not None and tp.shard.sharded else None
        self.tp_size = 1 if self.tp is None else self.tp.size
        self.sender = KVSender(self.cache, rank_peer_id(instance_id, 0, self.tp_size), self.fingerprint,
                               self.loaded.kv_heads, config.transfer)
        self._decode_tp: dict[str, int] = {}  # decode instance -> its tensor-parallel degree
        # TP: transfers the other ranks are still sending, and those done here waiting on them
        self._rank_outcomes = None if self.tp is None else FollowerOutcomes(self.tp.size)
        self._sent_here: set[str] = set()
        self._requests: dict[str, _Request] = {}

    # -- control ----------------------------------------------------------------------------------

    def connect(self, decode_id: str, rendezvous: Rendezvous, generation: int = 0, decode_tp: int = 1) -> None:
        """Form this rank's KV channels to a decode instance of ``decode_tp`` ranks: one per decode rank it
        sends heads to (their receivers connect concurrently; the other ranks connect on their own)."""
        for r in peer_ranks(self.loaded.config.num_key_value_heads, self.tp_size, decode_tp, 0, sending=True):
            self.sender.connect(rank_peer_id(decode_id, r, decode_tp), rendezvous, generation)
        self._decode_tp[decode_id] = decode_tp

    def close(self) -> None:
        """Release a tensor-parallel instance's followers (nothing to do on one rank)."""
        if isinstance(self.runner, TPDriverRunner):
            self.runner.stop()

    def transfer_stats(self) -> dict:
        """The KV sender's cumulative counts (``TransferStats``) for the whole instance: under tensor
        parallelism every rank sends its own heads, so the bytes are rank 0's share times the ranks."""
        st = self.sender.stats
        return {"kv_transfers_completed": st.completed, "kv_transfers_failed": st.failed,
                "kv_transfer_bytes": st.bytes * self.tp_size, "kv_transfer_seconds": st.seconds}

    def transfers_pending(self) -> int:
        """Transfers not yet acknowledged by every receiving rank."""
        return self.sender.pending() + len(self._sent_here)

    def add_request(self, request: PrefillRequest) -> None:
        """Validate and queue a prompt. Raises InvalidRequestError naming the field."""
        check_request(request.request_id, request.prompt_ids, request.params, self.loaded.config.vocab_size)
        if request.request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        if request.params.max_tokens == 0 and request.destination is not None:
            raise InvalidRequestError("destination", "a request that generates nothing (max_tokens 0) hands no KV off")
        if self.pool.blocks_for_tokens(len(request.prompt_ids)) > self.pool.num_blocks:
            raise InvalidRequestError("prompt_ids", f"{len(request.prompt_ids)} tokens exceed the KV cache "
                                                    f"({self.pool.num_blocks * self.pool.block_size} tokens)")
        prompt, eos = list(request.prompt_ids), frozenset(self.loaded.eos_token_ids)
        seq = Sequence(request.request_id, prompt, sampler_for(self.loaded, request.params, prompt),
                       eos, BlockTable(self.config.block_size), max_model_len=self.loaded.config.max_position_embeddings)
        arrival = request.arrival_time if request.arrival_time is not None else time.perf_counter()
        num = request.params.prompt_logprobs
        self._requests[request.request_id] = _Request(request, seq, arrival,
                                                      None if num is None else PromptLogprobs(prompt, num))
        if num is not None:  # scoring the prompt needs the logits of every position
            self.prefix_cache.compute_in_full(request.request_id)
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
        done = events.done
        failed = [(f.request_id, str(f.error), f.error.retryable) for f in events.failed]
        if self._rank_outcomes is not None:
            done = self._done_on_every_rank(done, failed)
        for rid in done:
            self.scheduler.release(rid)
            self._requests.pop(rid, None)
            out.transferred.append(rid)
        for rid, why, retryable in failed:
            self.scheduler.release(rid)
            self._requests.pop(rid, None)
            out.failed.append(PrefillFailure(rid, why, retryable))

    def _done_on_every_rank(self, done: list[str], failed: list[tuple[str, str, bool]]) -> list[str]:
        """TP: the transfers every rank has finished (this rank's now or earlier); a transfer any rank failed
        joins ``failed`` (its blocks are freed once; the other ranks' legs fail or drain on their own)."""
        self._sent_here.update(done)
        for rid, _, _ in failed:
            self._rank_outcomes.forget(rid)
        if not self._rank_outcomes:
            return []
        self.runner.call("kv_sync")
        self._rank_outcomes.absorb(exchange_outcomes(self.tp, [], []))
        failed_here = {rid for rid, _, _ in failed}
        for rid, why in self._rank_outcomes.failures():
            self._rank_outcomes.forget(rid)
            self._sent_here.discard(rid)
            if rid not in failed_here:
                failed.append((rid, why, True))
        ready = [rid for rid in self._sent_here if self._rank_outcomes.all_done(rid)]
        for rid in ready:
            self._rank_outcomes.forget(rid)
            self._sent_here.discard(rid)
        return ready

    def _begin_transfers(self, chunks: list[ScheduledChunk], out: PrefillStepOutput) -> list[ScheduledChunk]:
        """Announce the KV of prompts starting this step; drop those whose destination is unreachable."""
        kept = []
        for c in chunks:
            dest = self._requests[c.seq.request_id].request.destination
            if dest is not None and not self.sender.transferring(c.seq.request_id):  # its first chunk
                rid, decode_tp = c.seq.request_id, self._decode_tp.get(dest.decode_id, 1)
                try:
                    self.sender.begin(rid, c.seq.num_prompt, c.seq.block_table.blocks,
                                      leg_targets(self.loaded.config, 0, self.tp_size,
                                                  dest.decode_id, decode_tp, dest.reserved))
                except TransferError as err:
                    self.scheduler.release(rid)
                    del self._requests[rid]
                    out.failed.append(PrefillFailure(rid, str(err), err.retryable))
                    continue
                if self.tp is not None:
                    self.runner.call("kv_begin", request_id=rid, slot=self._rank_outcomes.track(rid),
                                     num_tokens=c.seq.num_prompt, src_blocks=list(c.seq.block_table.blocks),
                                     decode_id=dest.decode_id, decode_tp=decode_tp,
                                     reserved=dest.reserved)
            kept.append(c)
        return kept

    def _ready_blocks(self, chunk: ScheduledChunk) -> int:
        """Blocks of the prompt whose KV is final once this chunk is computed."""
        end = chunk.start + chunk.num_tokens
        if chunk.sample:
            return self.pool.blocks_for_tokens(end)
        return end // self.config.block_size if self.config.layerwise_streaming else 0

    def _num_logits(self, chunk: ScheduledChunk) -> int:
        """Logits at the chunk's last position when it samples, at all of them when they score the prompt."""
        scorer = self._requests[chunk.seq.request_id].prompt_scorer
        if scorer is not None and scorer.wants(chunk.start):
            return chunk.num_tokens
        return 1 if chunk.sample else 0

    @torch.inference_mode()
    def _forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run the chunks; KV streams out layer by layer (or after the pass). Returns the logits of every
        chunk's ``_num_logits`` last positions, in chunk order [rows, V]."""
        inputs = [StepInput(c.seq.tokens[c.start : c.start + c.num_tokens], c.start, c.seq.block_table.blocks,
                            num_logits=self._num_logits(c)) for c in chunks]
        ready = {c.seq.request_id: self._ready_blocks(c) for c in chunks}
        if self.tp is not None:
            self.runner.announce(inputs, side={"ready": ready})
        hidden, rows = forward_streaming(self.runner, self.sender, inputs, ready, self.config.layerwise_streaming)
        if not rows:
            return torch.empty(0, self.loaded.config.vocab_size)
        model = self.loaded.model
        return model.logits(hidden.index_select(0, torch.tensor(rows, dtype=torch.int64, device=hidden.device)))

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[FirstToken]:
        now = time.perf_counter()
        firsts = []
        ends = []  # (request id, first token, sampler state hex): every rank ends its legs with them
        row = 0
        for c in chunks:
            seq = c.seq
            req = self._requests[seq.request_id]
            rows = self._num_logits(c)
            chunk_logits = logits[row : row + rows]
            row += rows
            if rows > 1:
                req.prompt_scorer.add(chunk_logits, c.start)
            seq.num_computed += c.num_tokens
            self.prefix_cache.commit(seq, seq.num_computed)
            if not c.sample:
                continue
            params = seq.sampler.params
            prompt_logprobs = None if req.prompt_scorer is None else tuple(req.prompt_scorer.logprobs)
            if params.max_tokens == 0:  # the prompt alone was asked for (no destination: nothing to hand off)
                firsts.append(FirstToken(seq.request_id, None, now - req.arrival, seq.num_prompt,
                                         prompt_logprobs=prompt_logprobs))
                self.scheduler.hand_off(seq)
                self.scheduler.release(seq.request_id)
                del self._requests[seq.request_id]
                continue
            last = chunk_logits[-1:]
            # the further sequences first: they start where the first one starts (its grammar included)
            forks = [self._fork_start(seq, i, last[0]) for i in range(1, params.num_sequences)]
            token = seq.sampler.choose(last[0], seq.tokens)
            seq.append_token(token)
            firsts.append(FirstToken(seq.request_id, token, now - req.arrival, seq.num_prompt,
                                     self._logprob(params, last, token), prompt_logprobs,
                                     tuple((f.index, f.token, self._logprob(params, last, f.token)) for f in forks)))
            self.scheduler.hand_off(seq)
            if req.request.destination is not None:  # the first token ends the transfer: decode continues from it
                state = seq.sampler.generator.get_state().numpy().tobytes()
                self.sender.finish_prompt(seq.request_id, token, state, state=encode_forks(forks))
                ends.append([seq.request_id, token, state.hex(), encode_forks(forks)])
            else:  # nothing to transfer: done with this prompt
                self.scheduler.release(seq.request_id)
                del self._requests[seq.request_id]
        if ends and self.tp is not None:
            self.runner.call("kv_finish", ends=ends)
        return firsts

    @staticmethod
    def _fork_start(seq: Sequence, index: int, logits: torch.Tensor) -> ForkStart:
        """Sequence ``index`` of a request (n > 1): its first token, drawn from the prompt's last logits with
        its own generator, and the generator's state after it (the decode side continues from there)."""
        sampler = seq.sampler.for_sequence(index)
        token = sampler.choose(logits, seq.prompt_ids)
        return ForkStart(index, token, sampler.generator.get_state().numpy().tobytes())

    @staticmethod
    def _logprob(params, logits: torch.Tensor, token: int):
        return None if params.logprobs is None else token_logprobs(logits, [token], params.logprobs)[0]


def follower(model_path: str, config: PrefillWorkerConfig, tp: TPGroup, instance_id: str = "prefill-0") -> TPFollower:
    """A non-driver rank of a tensor-parallel prefill instance: its shard, its cache and a KV sender for its
    heads, ready to ``serve()``."""
    loaded = load_for_rank(model_path, config.dtype, config.device, tp)
    runner = build_runner(loaded, config.kv_cache_tokens // config.block_size, config.block_size,
                          config.attention_backend, tp)
    return PrefillRankFollower(runner, tp, instance_id, config)
