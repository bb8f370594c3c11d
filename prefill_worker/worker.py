"""The prefill worker: chunked prefill over its own paged KV cache, first-token sampling, and the
hand-off of each prompt's KV through its KV connector (:mod:`modeling.kv_connector`; by default the
prefill -> decode transfer, ``kv_transfer/connector.py``).

A plain class (the controller wraps it as a Ray actor). ``step()`` is the loop's skeleton:

    apply the connector's outcomes (free acknowledged KV)  ->  schedule chunks  ->  tell the connector of
    new prompts  ->  forward, the connector saving each layer's KV as it is written  ->  sample first tokens

A prompt that waits for room on a decode instance may be computed ahead (``PrefillRequest.ahead``), in steps no
other prompt needs: its full blocks are cached here, and the request, arriving under the same id, computes only
the rest; what it reports found cached is what the pass ahead found.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kv_transfer.channel import Rendezvous
from kv_transfer.connector import TPTransferConnector, TransferConnector
from kv_transfer.descriptors import KVFingerprint
from kv_transfer.sender import KVSender
from modeling.block_pool import BlockTable
from modeling.checkpoint import LoadedModel
from modeling.errors import InvalidRequestError, KVConnectorError
from modeling.forks import ForkStart, SequenceStarts, encode_starts
from modeling.heads import rank_peer_id
from modeling.instance_core import InstanceCore, follower_runner
from modeling.kv_connector import HandOff, KVConnector, KVPeer, KVRequest, LayerHooks, StepKV
from modeling.output import OutputStream
from modeling.pass_log import PassLog
from modeling.prefix_cache import CachedPrompt
from modeling.request_check import check_request
from modeling.runner import StepInput
from modeling.sampling import PromptLogprobs, sampler_for, token_logprobs
from modeling.scheduler import ScheduledChunk
from modeling.sequence import FinishReason, Sequence
from modeling.tp_group import TPGroup
from modeling.tp_runner import TPFollower
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
    kv_told: bool = False  # the connector knows the request (its blocks are allocated)

    @property
    def ahead(self) -> bool:
        return self.request.ahead


log = logging.getLogger("magicserve.prefill")

# A prompt's transfer whose decode instance has had no room for this long gives its blocks up when a waiting prompt
# needs them and nothing else runs (it fails as retryable, its full blocks cached): otherwise that decode instance,
# full of requests waiting for their prompts here, and this pool, full of prompts waiting for its room, would wait
# on each other for ever.
REFUSED_TRANSFER_S = 1.0
AHEAD_FOUND_KEPT = 4096  # passes ahead whose finding is kept for their request's return (the oldest forgotten)


class PrefillWorker:
    """Owns a model, a paged KV cache, a chunked-prefill scheduler and a KV connector."""

    def __init__(self, model: LoadedModel | str, config: PrefillWorkerConfig = PrefillWorkerConfig(),
                 instance_id: str = "prefill-0", tp: TPGroup | None = None, kv_connector: KVConnector | None = None):
        """``tp``: drive a tensor-parallel instance as its rank 0 (the other ranks run :func:`follower`);
        ``model`` is then a path, loaded as this rank's shard, and each rank sends its own KV heads.
        ``kv_connector``: where prompts' KV goes (None: the prefill -> decode transfer, ``self.transfer``)."""
        self.config = config
        self.instance_id = instance_id
        self.core = core = InstanceCore.build(model, config, tp, compile_steps=config.compile_steps,
                                              prefix_caching=config.prefix_caching, instance_id=instance_id)
        self.loaded, self.pool, self.runner, self.cache = core.loaded, core.pool, core.runner, core.cache
        self.prefix_cache, self.tokenizer = core.prefix_cache, core.tokenizer  # tokenizer: the first tokens' text
        self.backend = self.runner.backend
        mc = self.loaded.config
        self.pass_log = PassLog()
        self.scheduler = PrefillScheduler(config, self.pool, self.prefix_cache)
        self.fingerprint = KVFingerprint.of(mc, config.block_size, self.loaded.dtype)
        self.tp = tp if tp is not None and tp.shard.sharded else None
        self.tp_size = 1 if self.tp is None else self.tp.size
        self.sender = KVSender(self.cache, rank_peer_id(instance_id, 0, self.tp_size), self.fingerprint,
                               self.loaded.kv_heads, config.transfer)
        here = TransferConnector(self.sender, mc, 0, self.tp_size, config.layerwise_streaming)
        self.transfer = here if self.tp is None else TPTransferConnector(here, self.runner, self.tp)
        self.kv: KVConnector = self.transfer if kv_connector is None else kv_connector
        self.kv.register_kv_cache(self.cache)
        # what the tiers load is written layer by layer beside the pass that reads it (None: before the pass)
        self._layer_loads = core.tiers.load_layer_by_layer() \
            if core.tiers is not None and config.kv_tiers.loads_layer_by_layer(str(self.cache.device)) else None
        self._hook = self.kv if self._layer_loads is None else LayerHooks(self._layer_loads, self.kv)
        self._requests: dict[str, _Request] = {}
        self._found_ahead: OrderedDict[str, CachedPrompt] = OrderedDict()  # ended passes ahead: what each found
        self._ahead_ended: list[str] = []  # not reported yet

    # -- control ----------------------------------------------------------------------------------

    def connect(self, decode_id: str, rendezvous: Rendezvous, generation: int = 0, decode_tp: int = 1) -> None:
        """Form this rank's KV channels to a decode instance of ``decode_tp`` ranks: one per decode rank it
        sends heads to (their receivers connect concurrently; the other ranks connect on their own)."""
        self.transfer.connect(decode_id, rendezvous, generation, decode_tp)

    def close(self) -> None:
        """Release a tensor-parallel instance's followers and finish the KV tiers' writes (``InstanceCore.close``)."""
        self.core.close()

    def transfer_stats(self) -> dict:
        """The KV sender's cumulative counts (``TransferStats``) for the whole instance: under tensor
        parallelism every rank sends its own heads, so the bytes are rank 0's share times the ranks."""
        st = self.transfer.stats
        return {"kv_transfers_completed": st.completed, "kv_transfers_failed": st.failed,
                "kv_transfer_bytes": st.bytes * self.tp_size, "kv_transfer_seconds": st.seconds}

    def transfers_pending(self) -> int:
        """Transfers not yet acknowledged by every receiving rank."""
        return self.transfer.pending()

    def add_request(self, request: PrefillRequest) -> None:
        """Validate and queue a prompt (a pass ahead: ``PrefillRequest.ahead``). Raises InvalidRequestError naming
        the field."""
        check_request(request.request_id, request.prompt_ids, request.params, self.loaded.config.vocab_size)
        held = self._requests.get(request.request_id)
        if held is not None and held.ahead and not request.ahead:  # the request is back: its pass ahead ends
            self._end_ahead(request.request_id)
        elif held is not None:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        if request.params.max_tokens == 0 and request.destination is not None:
            raise InvalidRequestError("destination", "a request that generates nothing (max_tokens 0) hands no KV off")
        if self.pool.blocks_for_tokens(len(request.prompt_ids)) > self.pool.num_blocks:
            raise InvalidRequestError("prompt_ids", f"{len(request.prompt_ids)} tokens exceed the KV cache "
                                                    f"({self.pool.num_blocks * self.pool.block_size} tokens)")
        if request.ahead:
            self._add_ahead(request)
            return
        prompt, eos = list(request.prompt_ids), frozenset(self.loaded.eos_token_ids)
        seq = Sequence(request.request_id, prompt, sampler_for(self.loaded, request.params, prompt),
                       eos, BlockTable(self.config.block_size), max_model_len=self.loaded.config.max_position_embeddings)
        arrival = request.arrival_time if request.arrival_time is not None else time.perf_counter()
        num = request.params.prompt_logprobs
        self._requests[request.request_id] = _Request(request, seq, arrival,
                                                      None if num is None else PromptLogprobs(prompt, num))
        if num is not None:  # scoring the prompt needs the logits of every position
            self.prefix_cache.compute_in_full(request.request_id)
        found = self._found_ahead.pop(request.request_id, None)
        if found is not None:
            self.prefix_cache.found_before(request.request_id, found)
        self.scheduler.add(seq, late=request.late)

    def _add_ahead(self, request: PrefillRequest) -> None:
        """Queue a pass ahead over the prompt's full blocks but its last token (what a lookup can find; the
        request computes the rest), and one token more, so that the last of them is final."""
        rid, bs = request.request_id, self.config.block_size
        end = (len(request.prompt_ids) - 1) // bs * bs + 1
        if end == 1:  # not one full block: nothing to keep
            self._ahead_ended.append(rid)
            return
        prompt = list(request.prompt_ids[:end])
        seq = Sequence(rid, prompt, sampler_for(self.loaded, request.params, prompt), frozenset(),
                       BlockTable(bs), max_model_len=self.loaded.config.max_position_embeddings)
        self._requests[rid] = _Request(request, seq, time.perf_counter())
        self.prefix_cache.count_apart(rid)
        self.scheduler.add(seq, ahead=True)

    def _end_ahead(self, request_id: str, found: CachedPrompt | None = None, freed: bool = False) -> None:
        """A pass ahead ends (computed, taken over, aborted; ``freed``: dropped, its blocks freed already): what it
        found, if it looked its prompt up, is kept for its request, whose lookup counts that as found."""
        if not freed:
            found = self.prefix_cache.found(request_id) if self.prefix_cache.looked_up(request_id) else None
            self.scheduler.release(request_id)
        del self._requests[request_id]
        if found is not None:
            self._found_ahead[request_id] = found
            while len(self._found_ahead) > AHEAD_FOUND_KEPT:
                self._found_ahead.popitem(last=False)
        self._ahead_ended.append(request_id)

    def abort(self, request_id: str) -> bool:
        """Drop a request that is not yet transferring (False otherwise: its transfer runs to the end)."""
        req = self._requests.get(request_id)
        if req is not None and req.ahead:
            self._end_ahead(request_id)
            return True
        if req is None or request_id in self.scheduler.handed_off:
            return False
        if any(s.request_id == request_id for s in self.scheduler.running):
            return False  # its descriptor is out; let the transfer finish or fail
        self.scheduler.release(request_id)
        del self._requests[request_id]
        return True

    def hand_back(self) -> list[str]:
        """Give up the prompts still waiting for their first step (no pass ahead, none that only a prefill
        instance serves: prompt log-probabilities, nothing to generate): the instance is draining, and another
        computes them sooner than its queue would. Their request ids, freed here."""
        ids = [s.request_id for s in self.scheduler.waiting
               if (p := self._requests[s.request_id].request.params).prompt_logprobs is None and p.max_tokens > 0]
        for rid in ids:
            self.abort(rid)
        return ids

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._ahead_ended)

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> PrefillStepOutput:
        """One iteration; returns first tokens, acknowledged transfers and failures."""
        out = PrefillStepOutput()
        self._apply_kv_outcomes(out)
        chunks = self.scheduler.schedule()
        for seq, found in self.scheduler.take_dropped():
            self._end_ahead(seq.request_id, found, freed=True)
        if not chunks and self.scheduler.waiting:  # the next prompt lacks blocks, and nothing runs
            for rid in self.kv.withdraw_refused(REFUSED_TRANSFER_S):
                log.warning("%s: withdrew the transfer of %s (its decode instance has had no room for %g s; a "
                            "waiting prompt needs its blocks): it runs again", self.instance_id, rid,
                            REFUSED_TRANSFER_S)
        chunks = self._tell_connector(chunks, out)
        if chunks:
            t0 = time.perf_counter()
            logits = self._forward(chunks)
            out.compute_s = time.perf_counter() - t0
            out.tokens_computed = sum(c.num_tokens for c in chunks)
            self.pass_log.record("prefill", out.compute_s, chunks=[[c.start, c.num_tokens] for c in chunks])
            out.first_tokens.extend(self._sample(chunks, logits))
        if self._layer_loads is not None:  # in before anything else reads or reuses the blocks
            self._layer_loads.finish()
        out.ahead_ended, self._ahead_ended = self._ahead_ended, []
        return out

    # -- internals --------------------------------------------------------------------------------

    def _apply_kv_outcomes(self, out: PrefillStepOutput) -> None:
        """Free the prompts whose KV the connector is done with (acknowledged, or failed)."""
        finished = self.kv.get_finished()
        for rid in finished.sent:
            self.scheduler.release(rid)
            self._requests.pop(rid, None)
            out.transferred.append(rid)
        for f in finished.failed:
            self.scheduler.release(f.request_id)
            self._requests.pop(f.request_id, None)
            out.failed.append(PrefillFailure(f.request_id, f.reason, f.retryable))

    def _tell_connector(self, chunks: list[ScheduledChunk], out: PrefillStepOutput) -> list[ScheduledChunk]:
        """Tell the connector of the prompts starting this step (their blocks are allocated); drop those whose
        KV cannot go where asked."""
        kept = []
        for c in chunks:
            req = self._requests[c.seq.request_id]
            if not req.kv_told:  # its first chunk
                req.kv_told = True
                rid, dest = c.seq.request_id, req.request.destination
                peer = None if dest is None else KVPeer(dest.decode_id, dest.reserved)
                kv_request = KVRequest(rid, c.seq.num_prompt, peer)
                try:
                    self.kv.update_state_after_alloc(kv_request, c.seq.block_table.blocks, 0)
                except KVConnectorError as err:
                    self.scheduler.release(rid)
                    del self._requests[rid]
                    out.failed.append(PrefillFailure(rid, str(err), err.retryable))
                    continue
            kept.append(c)
        return kept

    def _final_blocks(self, chunk: ScheduledChunk) -> int:
        """Blocks of the prompt whose KV is final once this chunk is computed."""
        end = chunk.start + chunk.num_tokens
        return self.pool.blocks_for_tokens(end) if chunk.sample else end // self.config.block_size

    def _num_logits(self, chunk: ScheduledChunk) -> int:
        """Logits at the chunk's last position when it samples, at all of them when they score the prompt."""
        req = self._requests[chunk.seq.request_id]
        if req.prompt_scorer is not None and req.prompt_scorer.wants(chunk.start):
            return chunk.num_tokens
        return 1 if chunk.sample and not req.ahead else 0

    @torch.inference_mode()
    def _forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run the chunks, the connector saving (sending) each layer's KV as the runner writes it. Returns the
        logits of every chunk's ``_num_logits`` last positions, in chunk order [rows, V]."""
        inputs = [StepInput(c.seq.tokens[c.start : c.start + c.num_tokens], c.start, c.seq.block_table.blocks,
                            num_logits=self._num_logits(c)) for c in chunks]
        self.kv.start_load_kv(StepKV({c.seq.request_id: self._final_blocks(c) for c in chunks}))
        hidden, rows = self.runner.forward(inputs, kv_hook=self._hook)
        self.kv.wait_for_save()
        if not rows:
            return torch.empty(0, self.loaded.config.vocab_size)
        model = self.loaded.model
        return model.logits(hidden.index_select(0, torch.tensor(rows, dtype=torch.int64, device=hidden.device)))

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[FirstToken]:
        now = time.perf_counter()
        firsts = []
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
            if req.ahead:  # its blocks are cached: nothing to sample
                self._end_ahead(seq.request_id)
                continue
            params = seq.sampler.params
            prompt_logprobs = None if req.prompt_scorer is None else tuple(req.prompt_scorer.logprobs)
            if params.max_tokens == 0:  # the prompt alone was asked for (no destination: nothing to hand off)
                firsts.append(FirstToken(seq.request_id, None, now - req.arrival, seq.num_prompt,
                                         prompt_logprobs=prompt_logprobs,
                                         cached=self.prefix_cache.found(seq.request_id)))
                self.scheduler.hand_off(seq)
                self.scheduler.release(seq.request_id)
                del self._requests[seq.request_id]
                continue
            last = chunk_logits[-1:]
            # the further sequences first: they start where the first one starts (its grammar included)
            forks = [self._fork_start(seq, i, last[0]) for i in range(1, params.num_sequences)]
            token = seq.sampler.choose(last[0], seq.tokens)
            texts = [self._first_text(seq, token, seq.append_token(token))]
            texts += [self._first_text(seq, f.token, seq.stop_reason(f.token, 1)) for f in forks]
            firsts.append(FirstToken(seq.request_id, token, now - req.arrival, seq.num_prompt,
                                     self._logprob(params, last, token), prompt_logprobs,
                                     tuple((f.index, f.token, self._logprob(params, last, f.token), text)
                                           for f, text in zip(forks, texts[1:])), texts[0],
                                     self.prefix_cache.found(seq.request_id)))
            self.scheduler.hand_off(seq)
            if req.request.destination is not None:  # the first token ends the transfer: decode continues from it
                state = seq.sampler.generator.get_state().numpy().tobytes()
                starts = encode_starts(SequenceStarts(tuple(forks), tuple(len(t) for t in texts), time.time()))
                self.kv.request_finished(seq.request_id, HandOff(token, state, starts))
            else:  # nothing to transfer: done with this prompt
                self.scheduler.release(seq.request_id)
                del self._requests[seq.request_id]
        return firsts

    def _first_text(self, seq: Sequence, token: int, reason: FinishReason | None) -> str:
        """The text of a sequence's first token as its decode instance's output stream cuts it (stop strings,
        characters held back while they could start one): the client gets it with the token."""
        return OutputStream.for_sequence(seq, self.tokenizer).push([token], reason)[0]

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


def follower(model: LoadedModel | str, config: PrefillWorkerConfig, tp: TPGroup,
             instance_id: str = "prefill-0") -> TPFollower:
    """A non-driver rank of a tensor-parallel prefill instance: its shard (``model``: loaded, or a checkpoint
    path), its cache and a KV sender for its heads, ready to ``serve()``."""
    return PrefillRankFollower(follower_runner(model, config, tp), tp, instance_id, config)
