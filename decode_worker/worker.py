"""The decode worker: continuous-batching decode with MagicDec-style speculative decoding.

A plain class (the controller wraps it as a Ray actor). It owns every request it holds from reservation to
finish, in one of five states: ``waiting_for_kv`` (blocks reserved, the prompt's KV and first token in
transfer from a prefill worker), ``prefilling`` (the prompt starts from its longest cached prefix here and
this worker's steps compute the rest, a chunk at a time), ``running``, ``waiting`` (preempted, or resumed
from a dead instance, to be recomputed) or ``migrating`` (live migration, stopped on its source or arrived
on its destination until the router decides: ``decode_worker/live_migration.py``).

Requests come in through one door, :meth:`DecodeWorker.admit` (``decode_worker/admission.py``), whose
source (``decode_worker/sources.py``) says where the KV comes from: ``RemoteKV``, ``LocalPrefill``,
``Resume``, ``Fork`` or ``MigrationIn``; every block reservation goes through one allocation call
(``decode_worker/kv_slots.py``). ``add_remote``, ``add_prefill``, ``add_resume`` and ``add_local`` are
that door under the names the router and the tests call. Each ``step``, then rounds of outgoing
migrations:

    admit arrived KV  ->  a chunk of local prefill  ->  choose k  ->  reserve room for k  ->  draft k tokens
    ->  verify all k + 1 in one target pass  ->  accept / recover / bonus per sequence  ->  roll back
    rejected KV  ->  cache the blocks now final  ->  emit deltas

Prefix caching: every full block whose KV is final (received, prefilled, or verified: never a draft position)
is cached under its content hash, so a finished request leaves its prompt and generated tokens' KV behind
for the conversation's next turn (evicted least recently used first, only when the space is needed).

k = 0 is a plain decode step. Sequences join and leave at every step, each with its own sampling parameters.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

from decode_worker.admission import Admission
from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
from decode_worker.drafters import Drafter
from decode_worker.first_tokens import FirstTokens
from decode_worker.held import HeldRequest
from decode_worker.kv_inbox import KVInbox
from decode_worker.live_migration import LiveMigrations
from decode_worker.messages import DecodeFailure, DecodeRequest, MigrationFailed, PoolLoad, TokenDelta
from decode_worker.metrics import WorkerMetrics
from decode_worker.migration_host import WorkerMigrationHost
from decode_worker.prefill_budget import PROBE_TOKENS, Pace, PrefillBudget
from decode_worker.prefill_queue import PrefillChunk, PrefillQueue
from decode_worker.ranks import FollowerRanks
from decode_worker.scheduler import DecodeScheduler
from decode_worker.sequence_output import SequenceOutput
from decode_worker.sources import AdmissionSource, LocalPrefill, RemoteKV, Resume
from decode_worker.speculation import Speculator
from decode_worker.tp_rank import DecodeRankFollower
from kv_transfer.channel import Rendezvous, TransferConfig
from kv_transfer.descriptors import KVFingerprint
from kv_transfer.receiver import KVReceiver, ReceivedKV
from modeling.block_pool import BlockTable
from modeling.checkpoint import LoadedModel
from modeling.errors import InvalidRequestError, OutOfBlocksError
from modeling.forks import split_sequence_id
from modeling.instance_core import InstanceCore, follower_runner
from modeling.params import SamplingParams
from modeling.pass_log import PassLog
from modeling.resume import ResumeRequest
from modeling.runner import StepInput
from modeling.sequence import FinishReason, Sequence, SequenceStatus
from modeling.tp_group import TPGroup
from modeling.tp_runner import TPFollower


class DecodeWorker:
    """One decode instance (its rank 0): a paged KV cache, the requests it holds, a drafter and the
    speculation policy, put together from parts with one job each."""

    def __init__(self, model: LoadedModel | str, config: DecodeWorkerConfig = DecodeWorkerConfig(),
                 instance_id: str = "decode-0", transfer: TransferConfig | None = None, tp: TPGroup | None = None):
        """``transfer``: receive prompts' KV from prefill workers (a ``KVReceiver`` under ``instance_id``);
        None: local requests only (``add_local``, ``add_prefill``, ``add_resume``). ``tp``: drive a
        tensor-parallel instance as its rank 0 (the other ranks run :func:`follower`); ``model`` is then a
        path, loaded as this rank's shard. A draft model runs whole on this rank."""
        self.config = config
        self.instance_id = instance_id
        self.transfer = transfer
        self.core = core = InstanceCore.build(model, config, tp, compile_steps=config.compile_steps,
                                              prefix_caching=config.prefix_caching, instance_id=instance_id)
        self.loaded, self.pool, self.runner, self.cache = core.loaded, core.pool, core.runner, core.cache
        self.prefix_cache, self.tokenizer = core.prefix_cache, core.tokenizer
        mc = self.loaded.config
        self.max_model_len = mc.max_position_embeddings
        self.metrics = WorkerMetrics()
        self.pass_log = PassLog()
        self.speculator = Speculator(self.runner, config, mc.vocab_size, self.metrics, self.pass_log)
        self.requests: dict[str, HeldRequest] = {}  # every sequence it holds; the scheduler orders the running
        self.scheduler = DecodeScheduler(self.pool, config.max_num_seqs, self.prefix_cache)
        self.tp = tp if tp is not None and tp.shard.sharded else None
        self.ranks = None if self.tp is None else FollowerRanks(self.runner, self.tp)
        self.events: list = []  # raised outside a step's flow (a preempted migration), emitted by the next step
        prefill_order: deque[str] = deque()
        self.admission = Admission(self.loaded, self.max_model_len, self.tokenizer, self.requests, self.scheduler,
                                   self.runner, prefill_order)
        self.inbox = None if transfer is None else KVInbox(
            self.cache, instance_id, mc, KVFingerprint.of(mc, config.block_size, self.loaded.dtype),
            self.loaded.kv_heads, transfer, self.ranks, on_release=self.admission.release_waiting)
        self.admission.inbox = self.inbox
        self.migrations = LiveMigrations(WorkerMigrationHost(instance_id, self.loaded, self.cache, transfer, self.ranks,
                                                             self.admission, self.speculator, self.events))
        self.output = SequenceOutput(self.requests, self.scheduler, self.speculator, self.metrics,
                                     on_leave=self.migrations.forget)  # the router aborts the other end
        self.first_tokens = FirstTokens(self.admission, self.output, self.prefix_cache)
        tpot_slo = config.prefill_tpot_slo_ms / 1e3 if config.prefill_tpot_slo_ms else None
        self.prefill_budget = PrefillBudget(config.prefill_chunk, tpot_slo)
        self._last_decode_end: float | None = None  # perf_counter() when the last step with a decode pass ended
        self.prefills = PrefillQueue(self.runner, self.requests, prefill_order, self.prefix_cache,
                                     self.prefill_budget, self.pass_log, self.first_tokens)
        if config.profile_on_start:
            self.profile()

    @property
    def drafter(self) -> Drafter:
        return self.speculator.drafter

    @property
    def receiver(self) -> KVReceiver | None:
        """This rank's receiver of prompts' KV (None: built without transfer)."""
        return None if self.inbox is None else self.inbox.receiver

    # -- admission --------------------------------------------------------------------------------

    def connect(self, prefill_id: str, rendezvous: Rendezvous, generation: int = 0, prefill_tp: int = 1) -> None:
        """Form this rank's KV channels with a prefill instance of ``prefill_tp`` ranks: one per prefill rank
        holding heads this rank receives (blocks until they join; the other ranks connect on their own)."""
        self.inbox.connect(prefill_id, rendezvous, generation, prefill_tp)

    def admit(self, request: DecodeRequest | ResumeRequest, source: AdmissionSource) -> bool:
        """The one door: hold ``request`` with its blocks reserved, its KV coming as ``source`` says
        (``Admission.admit``). False when there is no room now (back-pressure: the caller waits or goes
        elsewhere); raises InvalidRequestError naming the field."""
        return self.admission.admit(request, source)

    def add_remote(self, request: DecodeRequest) -> bool:
        """``admit(request, RemoteKV())``: hold ``request`` in ``waiting_for_kv`` with blocks reserved for its
        prompt (and the first decode step), into which its KV transfer is accepted when it comes (found by
        the request id)."""
        return self.admit(request, RemoteKV())

    def add_prefill(self, request: DecodeRequest, late: bool = False) -> bool:
        """``admit(request, LocalPrefill(late))``: prefill ``request`` here from its prompt's longest cached prefix
        (a conversation's earlier turns), ``prefill_chunk`` tokens per step, before it decodes (its first
        delta carries its first token); ``late``: after the queued prompts that are not."""
        return self.admit(request, LocalPrefill(late))

    def add_resume(self, request: ResumeRequest) -> bool:
        """``admit(request, Resume())``: continue a request another decode instance streamed part of (it
        died); its sequences' deltas carry on from their next output position."""
        return self.admit(request, Resume())

    def add_local(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> list[TokenDelta]:
        """Admit a request to prefill here, and prefill it at once (from the prompt's longest cached
        prefix), then decode (tests, benchmarks, single-process use). Raises OutOfBlocksError when there is
        no room."""
        if not self.admit(DecodeRequest(request_id, tuple(prompt_ids), params), LocalPrefill()):
            raise OutOfBlocksError(f"no room for a {len(prompt_ids)}-token prompt")
        return self.prefills.run_now(request_id)

    def kv_received(self, kv: ReceivedKV) -> list:
        """A transfer into a held request completed: a prompt starts decoding from its first token; a
        migration is held for the router's commit. Raises InvalidRequestError when the transfer does not
        fit the request."""
        if kv.request_id in self.migrations.incoming:
            return [self.migrations.arrive(kv)]
        return self.first_tokens.after_transfer(self.requests[kv.request_id], kv)

    def _receive(self) -> list:
        """Start the requests whose transfers completed; report those whose transfer failed (a migration's
        failure leaves the request on its source)."""
        if self.inbox is None:
            return []
        finished = self.inbox.get_finished()
        out: list = []
        for kv in finished.received:
            held = self.requests.get(kv.request_id)
            if held is not None and not self.prefix_cache.finish_load(held.seq):
                self.admission.drop(kv.request_id)  # its blocks from the tiers are not all there: computed again
                out.append(self._transfer_failed(kv.request_id, "a KV block loaded from a tier was missing or corrupt",
                                                 True))
                continue
            try:
                out.extend(self.kv_received(kv))
            except InvalidRequestError as err:  # no first token, or a migration state that does not fit
                self.admission.drop(kv.request_id)
                out.append(self._transfer_failed(kv.request_id, str(err), False))
        return out + [self._transfer_failed(f.request_id, f.reason, f.retryable) for f in finished.failed]

    def _transfer_failed(self, request_id: str, reason: str, retryable: bool) -> DecodeFailure | MigrationFailed:
        if request_id in self.migrations.incoming:
            self.migrations.incoming.discard(request_id)
            return MigrationFailed(request_id, reason)
        return DecodeFailure(request_id, reason, retryable)

    # -- the step ---------------------------------------------------------------------------------

    def step(self, k: int | None = None) -> list[TokenDelta | DecodeFailure]:
        """One decode iteration over every running sequence, after admitting the prompts whose KV arrived;
        the local prefills' chunk rides in its decode pass (``decode_worker/prefill_queue.py``). ``k``
        overrides the policy."""
        began = time.perf_counter()
        received = self._receive() + self.migrations.poll()
        for rid in self.prefills.take_failed_loads():  # prefilled here: the router runs it again
            self.admission.drop(rid)
            received.append(DecodeFailure(rid, "a KV block loaded from a tier was missing or corrupt", True))
        self._resume_preempted()
        running = [self.requests[rid] for rid in self.scheduler.running]
        if running:
            start = time.perf_counter()
            planned, choice = (self.speculator.choose_k([h.seq for h in running], tuple(self.scheduler.running))
                               if k is None else (k, None))
            planned_batch = len(running)
            k, running = self._make_room(planned)
        paced = self.prefill_budget.tpot_slo_s is not None  # without an SLO a chunk is the whole chunk
        arriving = self._arriving() if paced and len(self.prefills) else []
        if not running:  # no decode pass to ride in: the local prefills run in passes of their own
            self._last_decode_end = None
            received += self.prefills.step(self.decoding, arriving=arriving)
            return received + self._take_events()
        seqs = [h.seq for h in running]
        paces = self._paces(running) if paced else []
        queued = len(self.prefills) > 0
        head = self.prefills.head_start()
        chunks = self.prefills.plan(True, paces, arriving)
        same_shape = k == planned and len(running) == planned_batch  # the step the policy predicted
        verdicts, logits = self.speculator.run(seqs, k, choice if same_shape else None,
                                               [c.step_input() for c in chunks])
        deltas = [self.output.commit(h, v, k, logits[i]) for i, (h, v) in enumerate(zip(running, verdicts))]
        for h, delta in zip(running, deltas):
            h.steps_here += 1
            h.tokens_here += len(delta.token_ids)
        prefill_s = self._fused_prefill_s(seqs, k, chunks)
        deltas += self.prefills.finish(chunks, self.speculator.rider_logits)
        end = time.perf_counter()
        seconds = end - start
        self._record_step(k, seconds)
        # what the decoding sequences wait between two tokens beyond the prefill chunk's share: since the last
        # decode step ended (the loop's own work between steps included), else since this step began
        since = began if self._last_decode_end is None else self._last_decode_end
        self._last_decode_end = end
        self.prefill_budget.observe_step(end - since - prefill_s)
        if paced:
            prefilled = sum(c.end - c.start for c in chunks) if queued else None
            self.prefill_budget.observe_rate(end, end - since - prefill_s, prefilled, prefill_s, head, paces)
        self.pass_log.record("step", seconds, k=k, seqs=len(running))
        self.migrations.advance()
        return received + deltas + self._take_events()

    def _fused_prefill_s(self, seqs: list[Sequence], k: int, chunks: list[PrefillChunk]) -> float:
        """What the chunks added to the decode pass they rode in: the pass's time beyond the target cost
        model's for the decode part alone (the budget's prediction until that model is fitted)."""
        if not chunks:
            return 0.0
        spans = [(c.start, c.end - c.start) for c in chunks]
        alone = self.speculator.predict_target_s(seqs, k)
        if alone is None:
            if not self.prefill_budget.cost.ready:
                return 0.0
            return sum(self.prefill_budget.fused_s(start, n) for start, n in spans)
        share = max(0.0, self.speculator.target_pass_s - alone)
        self.prefill_budget.observe_fused(spans, share)
        return share

    def _paces(self, running: list[HeldRequest]) -> list[Pace]:
        """The running sequences' time per output token so far (``decode_worker/prefill_budget.py``); one whose
        first token's time is unknown paces as if it had just got it."""
        now, paces = time.time(), []
        for h in running:
            seq = h.seq
            out = len(seq.tokens) - seq.num_prompt
            room = min(seq.sampler.params.max_tokens, seq.max_model_len - seq.num_prompt)
            since_first, got = (0.0, 0) if h.first_token_at is None else (now - h.first_token_at, out - 1)
            paces.append(Pace.measured(since_first, got, max(1, room - out), h.steps_here, h.tokens_here))
        return paces

    def _arriving(self) -> list[int]:
        """The output tokens still to come after the first of each request whose KV is arriving (its first token
        may be streamed at any moment; ``decode_worker/prefill_budget.py``). A migration's is not among them: its
        request decodes on at its source meanwhile."""
        if self.inbox is None:
            return []
        out = []
        for rid in self.inbox.receiver.arriving():
            held = self.requests.get(rid)
            if held is None or rid in self.migrations.incoming:
                continue
            seq = held.seq
            out.append(min(seq.sampler.params.max_tokens, seq.max_model_len - seq.num_prompt) - 1)
        return out

    def _take_events(self) -> list:
        out = list(self.events)
        self.events.clear()  # the same list: the migration host appends to it
        return out

    def _record_step(self, k: int, seconds: float) -> None:
        self.metrics.steps += 1
        self.metrics.k_counts[k] = self.metrics.k_counts.get(k, 0) + 1
        self.metrics.last_k = k
        self.metrics.step_times.append(seconds)

    def _make_room(self, k: int) -> tuple[int, list[HeldRequest]]:
        """The step's k and batch (``DecodeScheduler.make_room``); the preempted give up their draft state."""
        k, batch, preempted = self.scheduler.make_room(k)
        for seq in preempted:
            self.drafter.release(seq)
            self.metrics.preemptions += 1
            if self.migrations.cancel_outgoing(seq.request_id):  # its KV is gone: the rounds sent cannot be completed
                self.events.append(MigrationFailed(seq.request_id, f"preempted on {self.instance_id}"))
        return k, [self.requests[seq.request_id] for seq in batch]

    def _resume_preempted(self) -> None:
        """Recompute the KV of the preempted (and resumed) sequences that fit again (all tokens but the last,
        from their longest cached prefix on)."""
        for seq in self.scheduler.resumable():
            self.prefills.compute(seq, seq.num_tokens - 1, want_logits=False)
            self.prefix_cache.commit(seq, seq.num_computed)
            self.drafter.admit(seq)

    # -- leaving ----------------------------------------------------------------------------------

    def abort(self, request_id: str) -> bool:
        """Cancel a request (every sequence of it) and free its KV, whatever its state (a transfer in flight
        is drained first)."""
        family = [sid for sid in self.requests if sid != request_id and split_sequence_id(sid)[0] == request_id]
        aborted = [self._abort_sequence(sid) for sid in [request_id] + family]
        return any(aborted)

    def _abort_sequence(self, request_id: str) -> bool:
        held = self.requests.get(request_id)
        if held is None:
            return False
        status = held.seq.status
        if status is SequenceStatus.WAITING_FOR_KV:  # its blocks are freed once no bytes are in flight
            self.migrations.forget(request_id)
            self.inbox.request_finished(request_id)
        elif status is SequenceStatus.PREFILLING:  # nothing of it was cached: its blocks were never complete
            self.prefills.cancel(request_id)
            self.admission.drop(request_id)
        elif status is SequenceStatus.WAITING:
            self.scheduler.finish(held.seq)
            del self.requests[request_id]
        else:
            self.output.finish(held, FinishReason.ABORT)
        return True

    def hand_back(self) -> list[str]:
        """Give up the local prefills no step has begun (``PrefillQueue.unbegun``), their blocks freed: the
        instance is draining, and another computes them sooner than its queue would. Their request ids."""
        ids = self.prefills.unbegun()
        for rid in ids:
            self.abort(rid)
        return ids

    def has_work(self) -> bool:
        """Requests running, preempted or waiting for their KV."""
        return bool(self.requests)

    def close(self) -> None:
        """Release a tensor-parallel instance's followers and finish the KV tiers' writes (``InstanceCore.close``)."""
        self.core.close()

    # -- speculation settings and reports ---------------------------------------------------------

    def profile(self, batches: tuple[int, ...] = (1, 4, 16), contexts: tuple[int, ...] = (256, 2048, 8192),
                ks: tuple[int, ...] = (0, 3)) -> None:
        """Seed the speculation cost models with synthetic passes (``Speculator.profile``), and the local
        prefill's cost model with prefill passes of a few chunk sizes; call when idle."""
        self.speculator.profile(self.pool, self.max_model_len, batches, contexts, ks)
        self._profile_prefill()

    def _profile_prefill(self) -> None:
        chunk = min(self.config.prefill_chunk, self.max_model_len)
        sizes = sorted({min(chunk, PROBE_TOKENS), max(1, chunk // 4), chunk})
        table = BlockTable(self.pool.block_size)
        if self.pool.blocks_for_tokens(chunk) > self.pool.num_free // 2:
            return
        table.ensure_capacity(self.pool, chunk)
        try:
            for n in sizes:
                self.runner.run([StepInput([1] * n, 0, table.blocks, num_logits=1)])  # warm-up
                t0 = time.perf_counter()
                self.runner.run([StepInput([1] * n, 0, table.blocks, num_logits=1)])
                self.prefill_budget.observe_prefill(0, n, time.perf_counter() - t0)
        finally:
            table.release(self.pool)

    def set_speculation(self, spec: SpeculationConfig) -> None:
        """Switch speculation settings between steps (planner updates, benchmarks): ``Speculator.reconfigure``."""
        self.config = dataclasses.replace(self.config, speculation=spec)
        self.speculator.reconfigure(self.config, list(self.scheduler.running.values()))

    @property
    def decoding(self) -> bool:
        """Sequences decode here, or will as soon as their KV lands or they resume: a local prefill keeps to
        their TPOT slack (``decode_worker/prefill_budget.py``)."""
        return len(self.requests) > len(self.prefills)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting_for_kv(self) -> int:
        return sum(h.seq.status is SequenceStatus.WAITING_FOR_KV and h.seq.request_id not in self.migrations.incoming
                   for h in self.requests.values())

    def request_loads(self) -> PoolLoad:
        """The load report the global rescheduling policy reads (``controller/migration_policy.py``); a
        request migrating away, or of several sequences (they share their prompt's blocks), cannot move."""
        report = self.scheduler.load(lambda seq: seq.request_id not in self.migrations.outgoing and
                                     seq.sampler.params.num_sequences == 1, frozenset(self.requests))
        rate = self.prefill_budget.tokens_per_s(self.prefills.head_start(), self.decoding)
        # rounded to two significant figures: a report goes out when it changes, not at every step's jitter
        return dataclasses.replace(report, prefill_queued_tokens=self.prefills.queued_tokens(),
                                   prefill_tokens_per_s=float(f"{rate:.2g}"))

    def status(self) -> dict:
        """Queue lengths, memory and metrics (GetClusterStatus reads this)."""
        return {
            "running": len(self.scheduler.running),
            "waiting_for_kv": self.num_waiting_for_kv,
            "migrating_out": len(self.migrations.outgoing),
            "migrating_in": len(self.migrations.incoming),
            "preempted": len(self.scheduler.preempted),
            "prefilling": len(self.prefills),
            "free_blocks": self.pool.num_free,
            "total_blocks": self.pool.num_blocks,
            "cached_blocks": self.pool.num_cached,
            "metrics": self.metrics.summary(),
            **self.speculator.status(),
        }


def follower(model: LoadedModel | str, config: DecodeWorkerConfig, tp: TPGroup, instance_id: str = "decode-0",
             transfer: TransferConfig | None = None) -> TPFollower:
    """A non-driver rank of a tensor-parallel decode instance: its shard (``model``: loaded, or a checkpoint
    path) and cache, ready to ``serve()``
    (draft passes over the sparse view and verification are forwards like any other); with ``transfer``,
    it receives its own KV heads from the prefill ranks that hold them (:class:`DecodeRankFollower`)."""
    runner = follower_runner(model, config, tp)
    return TPFollower(runner, tp) if transfer is None else DecodeRankFollower(runner, tp, instance_id, transfer)
