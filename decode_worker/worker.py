"""The decode worker: continuous-batching decode with MagicDec-style speculative decoding.

A plain class (the controller wraps it as a Ray actor). It owns every request it holds from reservation to
finish, in one of three states: ``waiting_for_kv`` (``add_remote``: blocks reserved, the prompt's KV and first
token in transfer from a prefill worker through this worker's ``KVReceiver``), ``running``, or ``waiting``
(preempted, to be recomputed), or ``migrating`` (live migration to or from another decode instance:
stopped on its source, or arrived on its destination, until the router decides; see
``decode_worker/migration.py``). Requests may also be prefilled here (``add_local``: tests, benchmarks).
Each ``step``:

    admit arrived KV  ->  choose k  ->  reserve room for k  ->  draft k tokens  ->  verify all k + 1 in one
    target pass  ->  accept / recover / bonus per sequence  ->  roll back rejected KV  ->  emit deltas

then rounds of outgoing migrations go out. k = 0 is a plain decode step. Sequences join and leave at
every step, each with its own sampling parameters and stop conditions.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
from decode_worker.messages import DecodeFailure, DecodeRequest, MigrationArrived, MigrationFailed, TokenDelta
from decode_worker.migration import MigrationState, OutgoingMigration, headroom_tokens, should_stop
from decode_worker.migration_sender import MigrationLegs
from decode_worker.drafters import DraftLayout, DraftModelDrafter, Drafter, SelfSparseDrafter, window_start
from decode_worker.scheduler import DecodeScheduler
from decode_worker.policy import (CHOICE_REUSE_STEPS, AcceptanceEstimator, AdaptiveK, KChoice, LinearCostModel,
                                  PassShape, StepCorrection)
from decode_worker.verify import Verdict, verify_greedy, verify_sampled
from kv_transfer.channel import Rendezvous, TransferConfig
from kv_transfer.descriptors import KVFingerprint
from kv_transfer.errors import TransferError
from kv_transfer.heads import peer_ranks, rank_peer_id
from kv_transfer.rank_sync import FollowerOutcomes, exchange_outcomes
from kv_transfer.receiver import KVReceiver, ReceivedKV
from modeling.block_pool import BlockPool, BlockTable
from modeling.checkpoint import LoadedModel, load_model
from modeling.errors import InvalidRequestError, OutOfBlocksError
from modeling.forks import decode_forks, sequence_id, split_sequence_id
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.output import OutputStream
from modeling.pass_log import PassLog
from modeling.runner import ModelRunner, StepInput
from modeling.params import SamplingParams
from modeling.sampling import RequestSampler, processed_logits, target_probs, token_logprobs
from modeling.sequence import FinishReason, Sequence, SequenceStatus
from modeling.tokenizer import load_tokenizer_if_present
from modeling.tp_group import TPGroup
from modeling.tp_runner import (TPDriverRunner, TPFollower, build_runner, copy_kv_blocks, forward_follower,
                                load_for_rank)


@dataclass
class WorkerMetrics:
    """Counters of a decode worker (see ``summary``)."""

    steps: int = 0
    tokens: int = 0  # emitted tokens
    draft_tokens: int = 0
    accepted_tokens: int = 0
    seq_spec_steps: int = 0  # (sequence, step) pairs with k > 0
    k_counts: dict[int, int] = field(default_factory=dict)  # steps by the speculation length chosen
    last_k: int = 0  # the speculation length of the latest step
    step_times: deque = field(default_factory=lambda: deque(maxlen=1024))
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    preemptions: int = 0

    def summary(self) -> dict:
        times = sorted(self.step_times)
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "mean_accepted_length": self.accepted_tokens / self.seq_spec_steps if self.seq_spec_steps else 0.0,
            "seq_spec_steps": self.seq_spec_steps,
            "k_counts": dict(sorted(self.k_counts.items())),
            "last_k": self.last_k,
            "median_step_ms": 1e3 * times[len(times) // 2] if times else 0.0,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "preemptions": self.preemptions,
        }


@dataclass
class _Live:
    """A request this worker holds; ``seq.status`` says where it is."""

    seq: Sequence
    stream: OutputStream


class DecodeWorker:
    """Owns a paged KV cache, a drafter and the speculation policy for one decode instance."""

    def __init__(self, model: LoadedModel | str, config: DecodeWorkerConfig = DecodeWorkerConfig(),
                 instance_id: str = "decode-0", transfer: TransferConfig | None = None, tp: TPGroup | None = None):
        """``transfer``: receive prompts' KV from prefill workers (a ``KVReceiver`` under ``instance_id``);
        None: local requests only (``add_local``). ``tp``: drive a tensor-parallel instance as its rank 0
        (the other ranks run :func:`follower`); ``model`` is then a path, loaded as this rank's shard. A
        draft model runs whole on this rank."""
        self.config = config
        self.instance_id = instance_id
        self.transfer = transfer
        spec_cfg = config.speculation
        self.loaded = model if isinstance(model, LoadedModel) else load_for_rank(model, config.dtype, config.device, tp)
        mc = self.loaded.config
        self.max_model_len = mc.max_position_embeddings
        self.tokenizer = load_tokenizer_if_present(self.loaded.path)
        self.pool = BlockPool(config.kv_cache_tokens // config.block_size, config.block_size)
        self.runner = build_runner(self.loaded, self.pool.num_blocks, config.block_size, config.attention_backend, tp)
        self.cache = self.runner.cache
        self.drafter = self._make_drafter(self.runner.backend)
        self.target_cost = LinearCostModel()
        self.draft_cost = LinearCostModel()
        self.acceptance = AcceptanceEstimator()
        self.step_correction = StepCorrection()
        slo = spec_cfg.tpot_slo_ms / 1e3 if spec_cfg.tpot_slo_ms else None
        self.policy = AdaptiveK(spec_cfg.max_k, self.target_cost, self.draft_cost, self.acceptance, slo,
                                self.step_correction)
        self._cached_choice: tuple[tuple, int, KChoice] | None = None  # (request ids, reuses left, choice)
        self.metrics = WorkerMetrics()
        self.pass_log = PassLog()
        # every request this worker holds, by id (``seq.status`` says where it is); the scheduler orders the
        # running and preempted ones and gives them blocks
        self._requests: dict[str, _Live] = {}
        self.scheduler = DecodeScheduler(self.pool, config.max_num_seqs)
        self.tp = tp if tp is not None and tp.shard.sharded else None
        size = 1 if self.tp is None else self.tp.size
        self.receiver = None if transfer is None else KVReceiver(
            self.cache, self, rank_peer_id(instance_id, 0, size),
            KVFingerprint.of(mc, config.block_size, self.loaded.dtype), self.loaded.kv_heads, transfer)
        # TP: transfers whose KV the other ranks are still receiving, and prompts complete here waiting on them
        self._rank_outcomes = None if self.tp is None else FollowerOutcomes(self.tp.size)
        self._arrived: dict[str, ReceivedKV] = {}
        # live migration: this rank's sender of outgoing requests' KV (formed on the first connect_migration),
        # the requests leaving and arriving, and events raised outside a step's flow (emitted by the next step)
        self.migration_legs: MigrationLegs | None = None
        self._migration_slots = itertools.count(1)  # TP: numbers outgoing migrations for the rank reports
        self._outgoing: dict[str, OutgoingMigration] = {}
        self._incoming: set[str] = set()
        self._draft_imports: dict[str, tuple] = {}  # arrived requests' draft caches, imported on commit
        # requests of several sequences waiting for their KV: the blocks their further sequences will own
        self._fork_blocks: dict[str, list[int]] = {}
        self._events: list = []
        if config.profile_on_start:
            self.profile()

    # -- admission --------------------------------------------------------------------------------

    def connect(self, prefill_id: str, rendezvous: Rendezvous, generation: int = 0, prefill_tp: int = 1) -> None:
        """Form this rank's KV channels with a prefill instance of ``prefill_tp`` ranks: one per prefill rank
        holding heads this rank receives (blocks until they join; the other ranks connect on their own)."""
        size = 1 if self.tp is None else self.tp.size
        for r in peer_ranks(self.loaded.config.num_key_value_heads, prefill_tp, size, 0, sending=False):
            self.receiver.connect(rank_peer_id(prefill_id, r, prefill_tp), rendezvous, generation)

    def add_remote(self, request: DecodeRequest) -> list[int] | None:
        """Hold ``request`` in ``waiting_for_kv`` with blocks reserved for its prompt (and the first decode
        step): their ids, for the prefill worker to stream the KV into; None when there is no room
        (back-pressure: the caller waits or goes elsewhere). Raises InvalidRequestError naming the field."""
        if self.receiver is None:
            raise InvalidRequestError("request_id", "this worker receives no KV (it was built without transfer)")
        return self._hold(request, len(request.prompt_ids))

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """``BlockReserver`` for this worker's receiver: blocks for a request waiting for its KV (prompt and
        the first decode step); None when there is no room. Only requests added by ``add_remote`` get any."""
        live = self._requests.get(request_id)
        if live is None or live.seq.status is not SequenceStatus.WAITING_FOR_KV or live.seq.block_table.blocks:
            raise InvalidRequestError("request_id", f"{request_id!r} is not waiting for KV on this worker")
        if not self.scheduler.reserve(live.seq, num_tokens):
            return None
        return list(live.seq.block_table.blocks)

    def release_reservation(self, request_id: str) -> None:
        """``BlockReserver``: the transfer into a waiting request's blocks failed or was cancelled, and no
        bytes are in flight any more: free them and drop the request."""
        live = self._requests.get(request_id)
        if live is not None and live.seq.status is SequenceStatus.WAITING_FOR_KV:
            del self._requests[request_id]
            live.seq.block_table.release(self.pool)
            self.pool.free(self._fork_blocks.pop(request_id, []))

    def kv_received(self, kv: ReceivedKV) -> list[TokenDelta]:
        """The prompt's KV and first token arrived: the request starts decoding. Its delta carries the
        first token's text but not its id (the router streamed the id when prefill sampled it)."""
        live = self._requests[kv.request_id]
        seq = live.seq
        if kv.request_id in self._incoming:
            return [self._arrive(live, kv)]
        if kv.first_token is None:
            raise InvalidRequestError("first_token", f"the transfer of {kv.request_id!r} carried none")
        if kv.sampler_state:
            seq.sampler.generator.set_state(_generator_state(kv.sampler_state))
        try:
            starts = decode_forks(kv.state)
        except ValueError as err:
            raise InvalidRequestError("state", str(err)) from None
        if len(starts) != seq.sampler.params.num_sequences - 1:
            raise InvalidRequestError("state", f"{len(starts)} further sequences arrived for a request of "
                                      f"{seq.sampler.params.num_sequences}")
        seq.num_computed = seq.num_prompt
        forks = []
        for f in starts:
            sampler = seq.sampler.for_sequence(f.index)
            sampler.generator.set_state(_generator_state(f.sampler_state))
            forks.append((f.index, f.token, sampler))
        children = self._fork(live, forks, self._fork_blocks.pop(kv.request_id, None))
        # the forks first: the first sequence may finish at its first token and free the blocks they share
        deltas = [self._start(live, kv.first_token)] + [self._start(c, f[1]) for c, f in zip(children, forks)]
        return [dataclasses.replace(d, token_ids=[]) for d in deltas]

    def add_local(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> list[TokenDelta]:
        """Prefill on this worker, then decode (tests, benchmarks, single-process use)."""
        self._check_new(request_id, list(prompt_ids), params)
        seq = self._new_sequence(request_id, list(prompt_ids), params, BlockTable(self.config.block_size))
        if not self.scheduler.reserve(seq, len(prompt_ids)):
            raise OutOfBlocksError(f"no room for a {len(prompt_ids)}-token prompt")
        live = _Live(seq, OutputStream.for_sequence(seq, self.tokenizer))
        self._requests[request_id] = live
        logits = self._prefill(seq, len(prompt_ids), want_logits=True)
        forks = []
        for i in range(1, params.num_sequences):
            sampler = seq.sampler.for_sequence(i)
            forks.append((i, sampler.choose(logits[0], []), sampler))
        children = self._fork(live, forks, None)
        token = seq.sampler.choose(logits[0], [])
        pairs = [(live, token)] + [(c, f[1]) for c, f in zip(children, forks)]
        return [self._start(lv, tok, self._logprobs(lv.seq, logits[:1], [tok])) for lv, tok in pairs]

    def _fork(self, parent: _Live, forks: list[tuple], own_blocks: list[int] | None) -> list[_Live]:
        """The further sequences of ``parent``'s request (n > 1), each given as (index, first token, sampler):
        they share the prompt's full KV blocks (``BlockTable.fork``); their own blocks come from
        ``own_blocks`` (reserved with the request) or the pool."""
        seq = parent.seq
        num_prompt = seq.num_prompt
        per_fork = self.pool.blocks_for_tokens(num_prompt + 1) - num_prompt // self.config.block_size
        children = []
        for j, (index, _, sampler) in enumerate(forks):
            child = self._new_sequence(sequence_id(seq.request_id, index), seq.prompt_ids, seq.sampler.params,
                                       BlockTable(self.config.block_size))
            child.sampler = sampler
            own = None if own_blocks is None else own_blocks[j * per_fork : (j + 1) * per_fork]
            child.block_table, copies = seq.block_table.fork(self.pool, num_prompt, num_prompt + 1, own)
            copy_kv_blocks(self.runner, copies)
            child.num_computed = num_prompt
            live = _Live(child, OutputStream.for_sequence(child, self.tokenizer))
            self._requests[child.request_id] = live
            children.append(live)
        return children

    def _fork_room(self, num_prompt: int, n: int) -> int:
        """Blocks the further sequences of an n-sequence request need of their own at the start."""
        return (n - 1) * (self.pool.blocks_for_tokens(num_prompt + 1) - num_prompt // self.config.block_size)

    def _check_new(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if not request_id or split_sequence_id(request_id)[1]:
            raise InvalidRequestError("request_id", "must not be empty nor end in '#<number>'")
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already on this worker")
        params.validate(self.loaded.config.vocab_size)
        if not prompt_ids or len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError("prompt", f"must have 1 to {self.max_model_len - 1} tokens, got {len(prompt_ids)}")

    def abort(self, request_id: str) -> bool:
        """Cancel a request (every sequence of it) and free its KV, whatever its state (a transfer in flight
        is drained first)."""
        family = [sid for sid in self._requests if sid != request_id and split_sequence_id(sid)[0] == request_id]
        aborted = [self._abort_sequence(sid) for sid in [request_id] + family]
        return any(aborted)

    def _abort_sequence(self, request_id: str) -> bool:
        live = self._requests.get(request_id)
        if live is None:
            return False
        status = live.seq.status
        if status is SequenceStatus.WAITING_FOR_KV:
            self._drop_transfer(request_id)
        elif status is SequenceStatus.WAITING:
            self.scheduler.finish(live.seq)
            del self._requests[request_id]
        else:
            self._finish(live, FinishReason.ABORT)
        return True

    def has_work(self) -> bool:
        """Requests running, preempted or waiting for their KV."""
        return bool(self._requests)

    def close(self) -> None:
        """Release a tensor-parallel instance's followers (nothing to do on one rank)."""
        if isinstance(self.runner, TPDriverRunner):
            self.runner.stop()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting_for_kv(self) -> int:
        return sum(lv.seq.status is SequenceStatus.WAITING_FOR_KV and lv.seq.request_id not in self._incoming
                   for lv in self._requests.values())

    # -- live migration ---------------------------------------------------------------------------

    def connect_migration(self, destination: str, rendezvous: Rendezvous, generation: int = 0,
                          destination_tp: int = 1) -> None:
        """Form this rank's channels to the ranks of ``destination`` (an instance of ``destination_tp``
        ranks) this instance migrates requests over (blocks until they join with :meth:`connect`, giving
        this instance's id and degree; the other ranks connect on their own, ``DecodeRankFollower``)."""
        if self.transfer is None:
            raise InvalidRequestError("destination", "this worker moves no KV (it was built without transfer)")
        if self.migration_legs is None:
            size = 1 if self.tp is None else self.tp.size
            self.migration_legs = MigrationLegs(self.cache, self.instance_id, 0, size, self.loaded.config,
                                                self.config.block_size, self.loaded.kv_heads, self.transfer)
        self.migration_legs.connect(destination, destination_tp, rendezvous, generation)

    def migrate_in(self, request: DecodeRequest, num_tokens: int) -> tuple[int, list[int]] | None:
        """Destination: hold ``request`` for a migration, with blocks for its ``num_tokens`` positions now
        and headroom for the steps its source runs meanwhile. Returns (the positions reserved, their block
        ids) for the source, or None when there is no room."""
        capacity = min(self.max_model_len,
                       num_tokens + headroom_tokens(self.config.speculation.max_k, self.config.block_size))
        if num_tokens < len(request.prompt_ids) + 1 or num_tokens >= capacity:
            raise InvalidRequestError("num_tokens", f"must be in ({len(request.prompt_ids)}, {capacity}), "
                                      f"got {num_tokens}")
        self._incoming.add(request.request_id)
        try:
            blocks = self._hold(request, capacity)
        finally:
            if request.request_id not in self._requests:
                self._incoming.discard(request.request_id)
        return None if blocks is None else (capacity, blocks)

    def migrate_out(self, request_id: str, destination: str, capacity_tokens: int, block_ids: list[int]) -> str | None:
        """Source: start migrating a running request to ``destination``, into the ``block_ids`` it reserved
        for ``capacity_tokens`` positions; it keeps decoding here meanwhile. None when started, else why not."""
        live = self._requests.get(request_id)
        if live is None or live.seq.status is not SequenceStatus.RUNNING:
            return f"{request_id!r} is not decoding on {self.instance_id}"
        if request_id in self._outgoing:
            return f"{request_id!r} is already migrating"
        if self.migration_legs is None or not self.migration_legs.connected(destination):
            return f"no migration channel from {self.instance_id} to {destination}"
        if live.seq.num_tokens + self._step_tokens() >= capacity_tokens:
            return f"{request_id!r} has outgrown the {capacity_tokens} positions reserved on {destination}"
        src_blocks = list(live.seq.block_table.blocks)
        try:
            self.migration_legs.begin(request_id, capacity_tokens, src_blocks, destination, list(block_ids))
        except (TransferError, ValueError) as err:
            return str(err)
        m = OutgoingMigration(request_id, capacity_tokens, slot=next(self._migration_slots),
                              ranks_caught_up=self.tp is None)
        self._outgoing[request_id] = m
        if self.tp is not None:  # every rank sends its own heads (a rank that cannot fails its slot)
            self.runner.call("mig_begin", request_id=request_id, slot=m.slot, capacity_tokens=capacity_tokens,
                             src_blocks=src_blocks, destination=destination, dst_blocks=list(block_ids))
        return None

    def commit_migration(self, request_id: str) -> bool:
        """Destination: the router committed the migration; the request decodes here from the next step."""
        live = self._requests.get(request_id)
        if request_id not in self._incoming or live is None or live.seq.status is not SequenceStatus.MIGRATING:
            return False
        self._incoming.discard(request_id)
        seq = live.seq
        seq.block_table.truncate(self.pool, seq.num_tokens)
        self.scheduler.start(seq)
        draft = self._draft_imports.pop(request_id, None)
        try:
            if draft is None or not isinstance(self.drafter, DraftModelDrafter):
                raise ValueError("no draft cache to import")
            kv, (computed, entries, evicted) = draft
            self.drafter.import_state(seq, kv, DraftLayout(computed, entries, evicted))
        except (ValueError, OutOfBlocksError):  # none sent, another draft model, or no room: rebuild it here
            self.drafter.admit(seq)
        return True

    def finish_migration(self, request_id: str) -> bool:
        """Source: the request now lives on its destination; free its copy here."""
        m = self._outgoing.get(request_id)
        live = self._requests.get(request_id)
        if m is None or not m.stopped or live is None:
            return False
        # the destination acknowledged every byte (DONE) before it reported the arrival that made the router
        # commit: this rank's sender counts the transfer when it reads that DONE; the other ranks forget theirs
        del self._outgoing[request_id]
        if self.tp is not None:
            self.runner.call("mig_cancel", request_id=request_id)
        del self._requests[request_id]
        self.drafter.release(live.seq)
        live.seq.block_table.release(self.pool)
        live.seq.status = SequenceStatus.FINISHED
        return True

    def abort_migration(self, request_id: str) -> bool:
        """Source: the router aborted the migration; the request goes on decoding here (resumed if it had
        stopped for the last copy)."""
        m = self._outgoing.get(request_id)
        if m is None:
            return False
        self._cancel_outgoing(request_id)
        live = self._requests.get(request_id)
        if m.stopped and live is not None and live.seq.status is SequenceStatus.MIGRATING:
            self.scheduler.start(live.seq)
            if isinstance(self.drafter, DraftModelDrafter) and not self.drafter.holds(live.seq):
                self.drafter.admit(live.seq)  # the drafter was rebuilt meanwhile (set_speculation)
            self._cached_choice = None
        return True

    def request_loads(self) -> dict:
        """The load report the global rescheduling policy reads (``controller/migration_policy.py``): the
        pool's blocks, each running request's blocks (those it could migrate), blocks held by requests that
        cannot move now (KV arriving, migrating, preempted waiting), and what the head-of-line preempted
        request needs and cannot get (0: nothing waits, or it fits)."""
        # a request of several sequences shares its prompt's blocks among them and does not migrate
        running = {rid: len(seq.block_table.blocks) for rid, seq in self.scheduler.running.items()
                   if rid not in self._outgoing and seq.sampler.params.num_sequences == 1}
        used = self.pool.num_blocks - self.pool.num_free
        waiting = 0
        if self.scheduler.preempted:
            head = self.scheduler.preempted[0]
            need = self.pool.blocks_for_tokens(head.num_tokens + 1)
            waiting = 0 if self.pool.can_allocate(need) else need
        return {"total_blocks": self.pool.num_blocks, "running": running,
                "held_blocks": max(0, used - sum(running.values())), "waiting_blocks": waiting}

    def _hold(self, request: DecodeRequest, num_tokens: int) -> list[int] | None:
        """A new request waiting for its KV, with blocks for ``num_tokens`` positions (None: no room); on a
        tensor-parallel instance every rank expects its heads in the same blocks."""
        rid = request.request_id
        self._check_new(rid, list(request.prompt_ids), request.params)
        n = request.params.num_sequences
        fork_room = self._fork_room(len(request.prompt_ids), n)
        if n > 1 and (len(self.scheduler.running) + n > self.config.max_num_seqs or
                      not self.pool.can_allocate(self.pool.blocks_for_tokens(num_tokens + 1) + fork_room)):
            return None  # room for every sequence of the request, or none
        seq = self._new_sequence(rid, list(request.prompt_ids), request.params, BlockTable(self.config.block_size))
        seq.status = SequenceStatus.WAITING_FOR_KV
        self._requests[rid] = _Live(seq, OutputStream.for_sequence(seq, self.tokenizer))
        blocks = self.receiver.reserve(rid, num_tokens)  # -> self.reserve, which takes the blocks
        if blocks is not None and fork_room:
            self._fork_blocks[rid] = self.pool.allocate(fork_room)
        if blocks is None:
            del self._requests[rid]
        elif self.tp is not None:
            slot = self._rank_outcomes.track(rid)
            self.runner.call("kv_reserve", request_id=rid, slot=slot, num_tokens=num_tokens, blocks=blocks)
            self.tp.barrier()
        return blocks

    def _arrive(self, live: _Live, kv: ReceivedKV) -> MigrationArrived:
        """A migrating request's KV and state are here: hold it for the router's commit."""
        seq = live.seq
        try:
            state = MigrationState.decode(kv.state)
        except (ValueError, KeyError, TypeError) as err:
            raise InvalidRequestError("state", f"malformed migration state: {err}") from None
        tokens = list(seq.prompt_ids) + list(state.output_ids)
        if not state.num_computed == kv.num_tokens == len(tokens) - 1:
            raise InvalidRequestError("state", f"{kv.num_tokens} positions sent for {len(tokens)} tokens "
                                      f"({state.num_computed} computed)")
        if seq.block_table.capacity < len(tokens):
            raise InvalidRequestError("state", f"{len(tokens)} tokens exceed the room reserved")
        seq.tokens = tokens
        seq.num_computed = state.num_computed
        if state.sampler_state:
            seq.sampler.generator.set_state(torch.frombuffer(bytearray.fromhex(state.sampler_state), dtype=torch.uint8))
        seq.status = SequenceStatus.MIGRATING
        if state.draft is not None and kv.extra is not None:
            self._draft_imports[seq.request_id] = (kv.extra, state.draft)
        live.stream = OutputStream.for_sequence(seq, self.tokenizer)
        live.stream.push(seq.output_ids, None)  # the text state as the source had it ...
        live.stream.sent = state.text_sent  # ... of which this much was streamed
        return MigrationArrived(seq.request_id, len(state.output_ids), tuple(state.output_ids),
                                live.stream.text[:state.text_sent])

    def _poll_migrations(self) -> list:
        """Failures of outgoing migrations' transfers on any rank (the request stays here until the router
        decides); on a tensor-parallel instance, also which migrations every other rank has caught up."""
        if self.migration_legs is None:
            return []
        failed = [(f.request_id, str(f.error)) for f in self.migration_legs.poll()]
        if self.tp is not None and self._outgoing:
            self.runner.call("mig_sync")
            reports = exchange_outcomes(self.tp, [], [])[1:]
            by_slot = {m.slot: m for m in self._outgoing.values()}
            for m in self._outgoing.values():
                m.ranks_caught_up = all(m.slot in caught for caught, _ in reports)
            for rank, (_, bad) in enumerate(reports, start=1):
                failed += [(by_slot[s].request_id, f"rank {rank}'s KV transfer failed") for s in bad if s in by_slot]
        out = []
        for rid, why in failed:
            m = self._outgoing.get(rid)
            if m is not None and not m.failed:
                m.failed = True  # nothing more goes out; a stopped request waits for abort_migration
                out.append(MigrationFailed(rid, why))
        return out

    def _advance_migrations(self) -> None:
        """After a step: send each outgoing request's newly final blocks (a round), or stop it and send
        the rest with its state (``decode_worker/migration.py``)."""
        if not self._outgoing:
            return
        legs, bs = self.migration_legs, self.config.block_size
        rounds, ends = [], []  # what the other ranks do on their legs, in the same order
        for m in [m for m in self._outgoing.values() if not m.stopped and not m.failed]:
            live = self._requests[m.request_id]  # an outgoing request that ends or is preempted is cancelled
            seq = live.seq
            caught_up = legs.caught_up(m.request_id) and m.ranks_caught_up
            if should_stop(caught_up, m.rounds, seq.num_tokens, self._step_tokens(), m.capacity_tokens):
                ends.append(self._stop_and_copy(m, live))
                continue
            full = seq.num_computed // bs  # blocks whose every position holds final KV
            if full > m.blocks_sent:
                blocks = list(seq.block_table.blocks)
                legs.send_round(m.request_id, blocks, full)
                rounds.append([m.request_id, blocks, full])
                m.blocks_sent = full
            m.rounds += 1
        legs.flush()
        if self.tp is not None and (rounds or ends):
            self.runner.call("mig_advance", rounds=rounds, ends=ends)

    def _stop_and_copy(self, m: OutgoingMigration, live: _Live) -> list:
        """Stop the request here and send the rest of its KV and its state; returns the end for the other
        ranks' legs ``[request id, blocks, positions]``."""
        seq = live.seq
        self.scheduler.running.pop(seq.request_id)  # its draft state stays until the router decides
        seq.status = SequenceStatus.MIGRATING
        self._cached_choice = None
        n = seq.num_computed  # every token but the last has its KV here
        draft_kv, draft = None, None
        if isinstance(self.drafter, DraftModelDrafter) and self.drafter.holds(seq):
            draft_kv, layout = self.drafter.export_state(seq)  # its own cache moves too (a window's worth)
            draft = (layout.computed, layout.entries, layout.evicted)
        state = MigrationState(tuple(seq.output_ids), n, seq.sampler.generator.get_state().numpy().tobytes().hex(),
                               live.stream.sent, draft)
        blocks = list(seq.block_table.blocks)
        self.migration_legs.end(seq.request_id, blocks, n, state.encode(), draft_kv)
        m.stopped = True
        return [seq.request_id, blocks, n]

    def _cancel_outgoing(self, request_id: str) -> bool:
        if self._outgoing.pop(request_id, None) is None:
            return False
        self.migration_legs.cancel(request_id)
        if self.tp is not None:
            self.runner.call("mig_cancel", request_id=request_id)
        return True

    def _step_tokens(self) -> int:
        """The most positions one step may add to a sequence."""
        spec = self.config.speculation
        return spec.max_k + 1 if spec.enabled else 1

    def _take_events(self) -> list:
        out, self._events = self._events, []
        return out

    def _receive(self) -> list:
        """Admit the prompts whose KV and first token arrived; report those whose transfer failed."""
        if self.receiver is None:
            return []
        events = self.receiver.poll()
        out: list = []
        completed = events.completed
        if self._rank_outcomes is not None:
            completed = self._complete_on_every_rank(completed, out)
        for kv in completed:
            try:
                out.extend(self.kv_received(kv))
            except InvalidRequestError as err:  # a transfer without a first token: nothing to decode from
                live = self._requests.pop(kv.request_id)
                live.seq.block_table.release(self.pool)
                self.pool.free(self._fork_blocks.pop(kv.request_id, []))
                if kv.request_id in self._incoming:  # a migration whose state does not fit: it stays on its source
                    self._incoming.discard(kv.request_id)
                    out.append(MigrationFailed(kv.request_id, str(err)))
                else:
                    out.append(DecodeFailure(kv.request_id, str(err), False))
        for f in events.failed:  # the receiver has released the blocks (release_reservation)
            if self._rank_outcomes is not None:
                self._forget_transfer(f.request_id)
            if f.request_id in self._incoming:
                self._incoming.discard(f.request_id)
                out.append(MigrationFailed(f.request_id, str(f.error)))
            else:
                out.append(DecodeFailure(f.request_id, str(f.error), f.error.retryable))
        return out

    def _complete_on_every_rank(self, completed: list[ReceivedKV], out: list) -> list[ReceivedKV]:
        """TP: the prompts whose KV every rank holds (this rank's arrived now or earlier); prompts a follower
        failed to receive fail here too (``out``), their blocks freed on every rank."""
        for kv in completed:
            self._arrived[kv.request_id] = kv
        if not self._rank_outcomes:
            return []
        self.runner.call("kv_sync")
        self._rank_outcomes.absorb(exchange_outcomes(self.tp, [], []))
        for rid, why in self._rank_outcomes.failures():
            self._drop_transfer(rid)
            out.append(DecodeFailure(rid, why, True))
        ready = [rid for rid in self._arrived if self._rank_outcomes.all_done(rid)]
        for rid in ready:
            self._rank_outcomes.forget(rid)
        return [self._arrived.pop(rid) for rid in ready]

    def _drop_transfer(self, request_id: str) -> None:
        """Free a request waiting for its KV, on every rank (bytes still in flight are drained first)."""
        kv = self._arrived.pop(request_id, None)
        if kv is None:
            self.receiver.release(request_id)  # calls release_reservation once no bytes are in flight
        else:  # complete here, waiting on other ranks: the blocks are this worker's already
            self.release_reservation(request_id)
        if self._rank_outcomes is not None:
            self._forget_transfer(request_id)

    def _forget_transfer(self, request_id: str) -> None:
        if request_id in self._rank_outcomes:
            self._rank_outcomes.forget(request_id)
            self.runner.call("kv_release", request_id=request_id)

    # -- the step ---------------------------------------------------------------------------------

    def step(self, k: int | None = None) -> list[TokenDelta | DecodeFailure]:
        """One decode iteration over every running sequence, after admitting the prompts whose KV arrived.
        ``k`` overrides the policy."""
        received = self._receive() + self._poll_migrations()
        self._resume_preempted()
        lives = [self._requests[rid] for rid in self.scheduler.running]
        if not lives:
            return received + self._take_events()
        start = time.perf_counter()
        planned, choice = self._choose_k(lives) if k is None else (k, None)
        batch = len(lives)
        k, lives = self._make_room(planned)
        if not lives:
            return received + self._take_events()
        seqs = [lv.seq for lv in lives]
        t_forward, draft_before = time.perf_counter(), self.metrics.draft_time_s
        if k == 0:
            verdicts, logits = self._decode(seqs)
        else:
            verdicts, logits = self._speculate(seqs, k)
        if choice is not None and k == planned and len(seqs) == batch:  # same shape as predicted
            draft_s = self.metrics.draft_time_s - draft_before  # the policy corrects draft and verify apart
            self.policy.observe_step(choice, draft_s, time.perf_counter() - t_forward - draft_s)
        if k > 0:  # before committing: a sequence that finishes still verified its drafts
            self.acceptance.observe_step([(k, v.num_accepted) for v in verdicts])
        deltas = [self._commit(lv, v, k, logits[i]) for i, (lv, v) in enumerate(zip(lives, verdicts))]
        seconds = time.perf_counter() - start
        self._record_step(k, seconds)
        self.pass_log.record("step", seconds, k=k, seqs=len(lives))
        self._advance_migrations()
        return received + deltas + self._take_events()

    def _choose_k(self, lives: list[_Live]) -> tuple[int, KChoice | None]:
        """This step's k, and the adaptive policy's choice behind it (None for fixed / no speculation)."""
        spec = self.config.speculation
        if not spec.enabled:
            return 0, None
        if spec.k_policy == "fixed":
            return spec.k, None
        key = tuple(self.scheduler.running)  # the running request ids, in admission order
        cached = self._cached_choice
        if cached is not None and cached[0] == key and cached[1] > 0:
            self._cached_choice = (key, cached[1] - 1, cached[2])
            return cached[2].k, cached[2]
        choice = self._adaptive_choice([lv.seq for lv in lives])
        self._cached_choice = (key, CHOICE_REUSE_STEPS - 1, choice)
        return choice.k, choice

    def _adaptive_choice(self, seqs: list[Sequence]) -> KChoice:
        lens = [len(s.tokens) for s in seqs]
        b = len(seqs)

        def target_pass(k: int) -> PassShape:
            return PassShape(b, sum(lens) + b * k, b * (k + 1))

        def draft_pass(step: int) -> PassShape:
            return PassShape(b, sum(self.drafter.kv_tokens_read(n, step) for n in lens), b)

        return self.policy.choose(target_pass, draft_pass)

    def _decode(self, seqs: list[Sequence]) -> tuple[list[Verdict], torch.Tensor]:
        """A plain decode step: (one token per sequence, the target logits [B, 1, V])."""
        t0 = time.perf_counter()
        logits = self.runner.run([StepInput([s.tokens[-1]], len(s.tokens) - 1, s.block_table.blocks) for s in seqs])
        self._observe_target(seqs, 0, time.perf_counter() - t0)
        verdicts = [Verdict(0, [s.sampler.choose(logits[i], s.output_ids)]) for i, s in enumerate(seqs)]
        return verdicts, logits.unsqueeze(1)

    def _speculate(self, seqs: list[Sequence], k: int) -> tuple[list[Verdict], torch.Tensor]:
        """Draft k tokens per sequence and verify them in one target pass: (the verdicts, the target logits
        [B, k + 1, V]). Each verified position's logits are processed with the tokens before it, drafts
        included, exactly as plain decoding would process them there."""
        t0 = time.perf_counter()
        proposal = self.drafter.propose(seqs, k)
        t1 = time.perf_counter()
        inputs = [
            StepInput([s.tokens[-1]] + proposal.tokens[i], len(s.tokens) - 1, s.block_table.blocks, num_logits=k + 1)
            for i, s in enumerate(seqs)
        ]
        logits = self.runner.run(inputs).view(len(seqs), k + 1, -1)  # [B, k + 1, V]
        t2 = time.perf_counter()
        lens = [len(s.tokens) for s in seqs]
        draft_shape = sum((PassShape(len(seqs), sum(self.drafter.kv_tokens_read(n, j) for n in lens), len(seqs))
                           for j in range(k)), PassShape(0, 0, 0, 0))
        self.draft_cost.observe(draft_shape, t1 - t0)
        self.pass_log.record("draft", t1 - t0, passes=k, seqs=draft_shape.seqs, kv_tokens=draft_shape.kv_tokens,
                             new_tokens=draft_shape.new_tokens)
        self._observe_target(seqs, k, t2 - t1)
        self.metrics.draft_time_s += t1 - t0
        self.metrics.verify_time_s += t2 - t1
        raw_argmax = torch.argmax(logits, dim=-1).tolist()
        verdicts = []
        for i, s in enumerate(seqs):
            params, drafts = s.sampler.params, proposal.tokens[i]
            raw = logits[i]
            processed = processed_logits(s.sampler, raw, s.output_ids, drafts)
            if params.greedy:
                best = raw_argmax[i] if processed is raw else torch.argmax(processed, dim=-1).tolist()
                verdicts.append(verify_greedy(drafts, best))
            else:
                p = target_probs(processed, params)
                verdicts.append(verify_sampled(drafts, proposal.probs[i], p, s.sampler.generator))
        return verdicts, logits

    def _observe_target(self, seqs: list[Sequence], k: int, seconds: float) -> None:
        b = len(seqs)
        kv_tokens = sum(len(s.tokens) for s in seqs) + b * k
        self.pass_log.record("verify" if k else "decode", seconds, seqs=b, kv_tokens=kv_tokens, new_tokens=b * (k + 1))
        self.target_cost.observe(PassShape(b, kv_tokens, b * (k + 1)), seconds)

    def _commit(self, live: _Live, verdict: Verdict, k: int, logits: torch.Tensor) -> TokenDelta:
        """Append the verdict's tokens (up to a stop), roll back rejected KV, emit the delta. logits: the
        target's [k + 1, V] at the verified positions (the log-probabilities reported come from them)."""
        seq = live.seq
        n = len(seq.tokens)
        appended: list[int] = []
        reason = None
        for tok in verdict.tokens:
            appended.append(tok)
            reason = seq.append_token(tok)
            if reason is not None:
                break
        logprobs = self._logprobs(seq, logits, appended)
        text, reason = live.stream.push(appended, reason)
        if k > 0:
            self.metrics.draft_tokens += k
            self.metrics.accepted_tokens += verdict.num_accepted
            self.metrics.seq_spec_steps += 1
        self.metrics.tokens += len(appended)
        if reason is not None:
            self._finish(live, reason)
        else:
            # verification computed positions n-1 .. n-1+accepted with target KV; later ones are stale
            seq.num_computed = n + verdict.num_accepted
            seq.block_table.truncate(self.pool, seq.num_computed + 1)
            self.drafter.on_verified(seq, seq.num_computed)
        rid, index = split_sequence_id(seq.request_id)
        return TokenDelta(rid, appended, text, reason is not None, reason.value if reason is not None else None, k,
                          verdict.num_accepted, logprobs, index=index)

    @staticmethod
    def _logprobs(seq: Sequence, logits: torch.Tensor, tokens: list[int]) -> tuple:
        """The target's log-probabilities of ``tokens`` (row j of logits [>= len, V] is token j's position),
        when the request asked for them."""
        num = seq.sampler.params.logprobs
        return () if num is None else tuple(token_logprobs(logits, tokens, num))

    def _record_step(self, k: int, seconds: float) -> None:
        self.metrics.steps += 1
        self.metrics.k_counts[k] = self.metrics.k_counts.get(k, 0) + 1
        self.metrics.last_k = k
        self.metrics.step_times.append(seconds)

    # -- memory -----------------------------------------------------------------------------------

    def _make_room(self, k: int) -> tuple[int, list[_Live]]:
        """The step's k and batch (``DecodeScheduler.make_room``); the preempted give up their draft state."""
        k, batch, preempted = self.scheduler.make_room(k)
        for seq in preempted:
            self.drafter.release(seq)
            self.metrics.preemptions += 1
            if self._cancel_outgoing(seq.request_id):  # its KV is gone: the rounds sent cannot be completed
                self._events.append(MigrationFailed(seq.request_id, f"preempted on {self.instance_id}"))
        return k, [self._requests[seq.request_id] for seq in batch]

    def _resume_preempted(self) -> None:
        """Recompute the KV of the preempted sequences that fit again (all tokens but the last)."""
        for seq in self.scheduler.resumable():
            self._prefill(seq, seq.num_tokens - 1, want_logits=False)
            self.drafter.admit(seq)

    def _prefill(self, seq: Sequence, upto: int, want_logits: bool) -> torch.Tensor:
        """Compute the KV of tokens[:upto] in chunks; logits of the last one if wanted."""
        logits = torch.empty(0)
        chunk = self.config.prefill_chunk
        for start in range(0, upto, chunk):
            end = min(upto, start + chunk)
            last = end == upto and want_logits
            logits = self.runner.run([StepInput(seq.tokens[start:end], start, seq.block_table.blocks, num_logits=int(last))])
        seq.num_computed = upto
        return logits

    # -- lifecycle --------------------------------------------------------------------------------

    def _new_sequence(self, request_id: str, prompt: list[int], params: SamplingParams, table: BlockTable) -> Sequence:
        eos = frozenset(self.loaded.eos_token_ids)
        return Sequence(
            request_id=request_id, prompt_ids=prompt, sampler=RequestSampler(params, prompt_ids=prompt, eos_token_ids=eos),
            eos_token_ids=eos, block_table=table,
            max_model_len=self.max_model_len, status=SequenceStatus.RUNNING,
        )

    def _start(self, live: _Live, first_token: int, logprobs: tuple = ()) -> TokenDelta:
        """Start decoding a sequence whose prompt is computed, from its first token."""
        seq = live.seq
        self.scheduler.start(seq)
        reason = seq.append_token(first_token)
        text, reason = live.stream.push([first_token], reason)
        self.metrics.tokens += 1
        if reason is not None:
            self._finish(live, reason)
        else:
            self.drafter.admit(seq)
        rid, index = split_sequence_id(seq.request_id)
        return TokenDelta(rid, [first_token], text, reason is not None, reason.value if reason is not None else None,
                          logprobs=logprobs, index=index)

    def _finish(self, live: _Live, reason: FinishReason) -> None:
        seq = live.seq
        self._requests.pop(seq.request_id, None)
        self._cancel_outgoing(seq.request_id)  # the router sees the finish and aborts the destination's copy
        self._incoming.discard(seq.request_id)
        self._draft_imports.pop(seq.request_id, None)
        self.drafter.release(seq)
        self.scheduler.finish(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _make_drafter(self, backend) -> Drafter:
        spec = self.config.speculation
        if spec.drafter == "draft_model":
            draft = load_model(spec.draft_model, self.config.dtype, self.config.device)
            if draft.config.vocab_size != self.loaded.config.vocab_size:
                raise ValueError(
                    f"speculation.draft_model: vocabulary {draft.config.vocab_size} differs from the target's "
                    f"{self.loaded.config.vocab_size}"
                )
            dc = draft.config
            bs = self.config.block_size
            # per sequence: sink + window, plus one window-sized prefill chunk or k drafts, plus slack
            per_seq = 2 * spec.budget + spec.max_k + 3 * bs
            blocks = self.config.max_num_seqs * (-(-per_seq // bs))
            pool = BlockPool(blocks, bs)
            cache = PagedKVCache(KVCacheSpec(dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim, bs, draft.dtype),
                                 blocks, draft.device)
            return DraftModelDrafter(ModelRunner(draft.model, cache, backend), pool, spec, self.config.prefill_chunk)
        return SelfSparseDrafter(self.runner, spec)

    # -- profiling --------------------------------------------------------------------------------

    def profile(self, batches: tuple[int, ...] = (1, 4, 16), contexts: tuple[int, ...] = (256, 2048, 8192),
                ks: tuple[int, ...] = (0, 3)) -> None:
        """Time synthetic target and draft passes to seed the cost models (KV content is irrelevant
        to timing). Uses free blocks temporarily; call when the worker is idle."""
        budget_tokens = self.pool.num_free * self.pool.block_size // 2
        for b in batches:
            b = min(b, self.config.max_num_seqs)
            for ctx in contexts:
                if b * (ctx + 8) > budget_tokens or ctx + 8 > self.max_model_len:
                    continue
                tables = [BlockTable(self.pool.block_size) for _ in range(b)]
                for t in tables:
                    t.ensure_capacity(self.pool, ctx + 8)
                try:
                    for k in ks:
                        inputs = [StepInput([1] * (k + 1), ctx, t.blocks, num_logits=k + 1) for t in tables]
                        self.runner.run(inputs)  # warm-up
                        t0 = time.perf_counter()
                        self.runner.run(inputs)
                        self.target_cost.observe(PassShape(b, b * (ctx + k + 1), b * (k + 1)), time.perf_counter() - t0)
                    if self.config.speculation.drafter == "self_sparse":
                        spec = self.config.speculation
                        starts = [window_start(spec, ctx)] * b
                        inputs = [StepInput([1], ctx, t.blocks) for t in tables]
                        t0 = time.perf_counter()
                        self.runner.run(inputs, sink_len=spec.sink_tokens, window_starts=starts)
                        kv = b * self.drafter.kv_tokens_read(ctx + 1, 0)
                        self.draft_cost.observe(PassShape(b, kv, b), time.perf_counter() - t0)
                finally:
                    for t in tables:
                        t.release(self.pool)
        self.target_cost.fit()
        self.draft_cost.fit()

    def set_speculation(self, spec: SpeculationConfig) -> None:
        """Switch speculation settings between steps (planner updates, benchmarks). The drafter is
        rebuilt; cost models and the step-time correction carry over unless the drafter (kind or model)
        changes, the acceptance estimate unless the draft's view (budget, sink, positions) changes too."""
        live = list(self.scheduler.running.values())
        for seq in live:
            self.drafter.release(seq)
        old = self.config.speculation
        kind_changed = spec.drafter != old.drafter or spec.draft_model != old.draft_model
        # what the draft attends to decides its acceptance (not its cost, which the models take per shape)
        view_changed = kind_changed or (spec.budget, spec.sink_tokens, spec.draft_positions) != (
            old.budget, old.sink_tokens, old.draft_positions)
        self.config = dataclasses.replace(self.config, speculation=spec)
        self.drafter = self._make_drafter(self.runner.backend)
        if kind_changed:
            self.draft_cost = LinearCostModel()
            self.step_correction = StepCorrection()
        if view_changed:
            self.acceptance = AcceptanceEstimator()
        slo = spec.tpot_slo_ms / 1e3 if spec.tpot_slo_ms else None
        self.policy = AdaptiveK(spec.max_k, self.target_cost, self.draft_cost, self.acceptance, slo,
                                self.step_correction)
        self._cached_choice = None
        for seq in live:
            self.drafter.admit(seq)

    def rewind(self, request_id: str, num_tokens: int) -> None:
        """Cut a running sequence back to its first ``num_tokens`` tokens (at least prompt + 1),
        dropping the KV of later positions; its text stream restarts from there."""
        live = self._requests[request_id]
        seq = live.seq
        if not seq.num_prompt < num_tokens <= len(seq.tokens):
            raise ValueError(f"num_tokens: must be in ({seq.num_prompt}, {len(seq.tokens)}], got {num_tokens}")
        del seq.tokens[num_tokens:]
        seq.num_computed = min(seq.num_computed, num_tokens - 1)
        seq.block_table.truncate(self.pool, num_tokens)
        self.drafter.on_verified(seq, seq.num_computed)
        live.stream = OutputStream.for_sequence(seq, self.tokenizer)
        live.stream.push(seq.output_ids, None)

    def status(self) -> dict:
        """Queue lengths, memory and metrics (GetClusterStatus reads this)."""
        return {
            "running": len(self.scheduler.running),
            "waiting_for_kv": self.num_waiting_for_kv,
            "migrating_out": len(self._outgoing),
            "migrating_in": len(self._incoming),
            "preempted": len(self.scheduler.preempted),
            "free_blocks": self.pool.num_free,
            "total_blocks": self.pool.num_blocks,
            "acceptance_rate_estimate": self.acceptance.rate,
            "acceptance_rate_by_depth": [self.acceptance.rate_at(d)
                                         for d in range(1, self.config.speculation.max_k + 1)],
            "metrics": self.metrics.summary(),
            "target_cost": self.target_cost.coefficients(),
            "draft_cost": self.draft_cost.coefficients(),
            "step_correction": self.step_correction.summary(),
        }


def _generator_state(raw: bytes) -> torch.Tensor:
    """A ``torch.Generator`` state from the bytes another process sent."""
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def follower(model_path: str, config: DecodeWorkerConfig, tp: TPGroup, instance_id: str = "decode-0",
             transfer: TransferConfig | None = None) -> TPFollower:
    """A non-driver rank of a tensor-parallel decode instance: its shard and cache, ready to ``serve()``
    (draft passes over the sparse view and verification are forwards like any other); with ``transfer``,
    it receives its own KV heads from the prefill ranks that hold them (:class:`DecodeRankFollower`)."""
    base = forward_follower(model_path, config.dtype, config.device, config.kv_cache_tokens // config.block_size,
                            config.block_size, config.attention_backend, tp)
    if transfer is None:
        return base
    from decode_worker.tp_rank import DecodeRankFollower

    return DecodeRankFollower(base.runner, tp, instance_id, transfer)
