"""The decode worker: continuous-batching decode with MagicDec-style speculative decoding.

A plain class (the controller wraps it as a Ray actor). It owns every request it holds from reservation to
finish, in one of five states: ``waiting_for_kv`` (``add_remote``: blocks reserved, the prompt's KV and first
token in transfer from a prefill worker through this worker's ``KVReceiver``), ``prefilling`` (``add_prefill``:
the prompt starts from its longest cached prefix here and the rest is computed by this worker's steps, a
chunk at a time, with no prefill instance involved), ``running``, ``waiting`` (preempted, to be recomputed)
or ``migrating`` (live migration, stopped on its source or arrived on its destination until the router
decides: ``decode_worker/live_migration.py``). ``add_local`` prefills at once (tests, benchmarks). Each
``step``, then rounds of outgoing migrations:

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
from dataclasses import dataclass

import torch

from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
from decode_worker.drafters import Drafter
from decode_worker.live_migration import LiveMigrations
from decode_worker.messages import DecodeFailure, DecodeRequest, MigrationFailed, PoolLoad, TokenDelta
from decode_worker.metrics import WorkerMetrics
from decode_worker.scheduler import DecodeScheduler
from decode_worker.speculation import Speculator
from decode_worker.tp_rank import DecodeRankFollower
from decode_worker.verify import Verdict
from kv_transfer.channel import Rendezvous, TransferConfig
from kv_transfer.descriptors import KVFingerprint
from kv_transfer.heads import peer_ranks, rank_peer_id
from kv_transfer.rank_sync import FollowerOutcomes, exchange_outcomes
from kv_transfer.receiver import KVReceiver, ReceivedKV
from modeling.block_pool import BlockPool, BlockTable
from modeling.checkpoint import LoadedModel
from modeling.errors import InvalidRequestError, OutOfBlocksError
from modeling.forks import decode_forks, sequence_id, split_sequence_id
from modeling.output import OutputStream
from modeling.params import SamplingParams
from modeling.pass_log import PassLog
from modeling.resume import ResumeRequest, generator_state, seeded_state
from modeling.prefix_cache import PrefixCache
from modeling.prefix_hash import kv_salt
from modeling.request_check import check_request, check_room_to_generate
from modeling.runner import StepInput
from modeling.sampling import sampler_for, token_logprobs
from modeling.sequence import FinishReason, Sequence, SequenceStatus
from modeling.tokenizer import load_tokenizer_if_present
from modeling.tp_group import TPGroup
from modeling.tp_runner import (TPDriverRunner, TPFollower, build_runner, copy_kv_blocks, forward_follower,
                                load_for_rank)


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
        self.loaded = model if isinstance(model, LoadedModel) else load_for_rank(model, config.dtype, config.device, tp)
        mc = self.loaded.config
        self.max_model_len = mc.max_position_embeddings
        self.tokenizer = load_tokenizer_if_present(self.loaded.path)
        self.pool = BlockPool(config.kv_cache_tokens // config.block_size, config.block_size)
        self.runner = build_runner(self.loaded, self.pool.num_blocks, config.block_size, config.attention_backend, tp,
                                   compile_steps=config.compile_steps)
        self.cache = self.runner.cache
        self.metrics = WorkerMetrics()
        self.pass_log = PassLog()
        self.speculator = Speculator(self.runner, config, mc.vocab_size, self.metrics, self.pass_log)
        self.requests: dict[str, _Live] = {}  # all it holds; the scheduler orders the running and preempted
        self.prefix_cache = PrefixCache(self.pool, kv_salt(self.loaded.path, self.loaded.dtype, config.block_size),
                                        config.prefix_caching)
        self.scheduler = DecodeScheduler(self.pool, config.max_num_seqs, self.prefix_cache)
        self._prefilling: deque[str] = deque()  # requests prefilled here (``add_prefill``), first come first served
        self.tp = tp if tp is not None and tp.shard.sharded else None
        size = 1 if self.tp is None else self.tp.size
        self.receiver = None if transfer is None else KVReceiver(
            self.cache, self, rank_peer_id(instance_id, 0, size),
            KVFingerprint.of(mc, config.block_size, self.loaded.dtype), self.loaded.kv_heads, transfer)
        # TP: transfers whose KV the other ranks are still receiving, and prompts complete here waiting on them
        self._rank_outcomes = None if self.tp is None else FollowerOutcomes(self.tp.size)
        self._arrived: dict[str, ReceivedKV] = {}
        # requests of several sequences waiting for their KV: the blocks their further sequences will own
        self._fork_blocks: dict[str, list[int]] = {}
        self.migrations = LiveMigrations(self)
        self.events: list = []  # raised outside a step's flow (a preempted migration), emitted by the next step
        if config.profile_on_start:
            self.profile()

    @property
    def drafter(self) -> Drafter:
        return self.speculator.drafter

    # -- admission --------------------------------------------------------------------------------

    def connect(self, prefill_id: str, rendezvous: Rendezvous, generation: int = 0, prefill_tp: int = 1) -> None:
        """Form this rank's KV channels with a prefill instance of ``prefill_tp`` ranks: one per prefill rank
        holding heads this rank receives (blocks until they join; the other ranks connect on their own)."""
        size = 1 if self.tp is None else self.tp.size
        for r in peer_ranks(self.loaded.config.num_key_value_heads, prefill_tp, size, 0, sending=False):
            self.receiver.connect(rank_peer_id(prefill_id, r, prefill_tp), rendezvous, generation)

    def add_remote(self, request: DecodeRequest) -> bool:
        """Hold ``request`` in ``waiting_for_kv`` with blocks reserved for its prompt (and the first decode
        step), into which its KV transfer is accepted when it comes (found by the request id); False when
        there is no room (back-pressure: the caller waits or goes elsewhere). Raises InvalidRequestError
        naming the field."""
        if self.receiver is None:
            raise InvalidRequestError("request_id", "this worker receives no KV (it was built without transfer)")
        return self.hold(request, len(request.prompt_ids))

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """``BlockReserver`` for this worker's receiver: blocks for a request waiting for its KV (prompt and
        the first decode step, after the cached prefix it holds already); None when there is no room. Only
        requests added by ``add_remote`` get any."""
        live = self.requests.get(request_id)
        if live is None or live.seq.status is not SequenceStatus.WAITING_FOR_KV or \
                live.seq.block_table.capacity >= num_tokens:
            raise InvalidRequestError("request_id", f"{request_id!r} is not waiting for KV on this worker")
        if not self.scheduler.reserve(live.seq, num_tokens):
            return None
        return list(live.seq.block_table.blocks)

    def release_reservation(self, request_id: str) -> None:
        """``BlockReserver``: the transfer into a waiting request's blocks failed or was cancelled, and no
        bytes are in flight any more: free them and drop the request."""
        live = self.requests.get(request_id)
        if live is not None and live.seq.status is SequenceStatus.WAITING_FOR_KV:
            del self.requests[request_id]
            self._drop_unstarted(live.seq)

    def kv_received(self, kv: ReceivedKV) -> list[TokenDelta]:
        """The prompt's KV and first token arrived: the request starts decoding from the first token (the
        router streams its id, with its log-probability, from prefill; the delta here carries its text)."""
        live = self.requests[kv.request_id]
        seq = live.seq
        if kv.request_id in self.migrations.incoming:
            return [self.migrations.arrive(live, kv)]
        if kv.first_token is None:
            raise InvalidRequestError("first_token", f"the transfer of {kv.request_id!r} carried none")
        if kv.sampler_state:
            seq.sampler.generator.set_state(generator_state(kv.sampler_state))
        try:
            starts = decode_forks(kv.state)
        except ValueError as err:
            raise InvalidRequestError("state", str(err)) from None
        if len(starts) != seq.sampler.params.num_sequences - 1:
            raise InvalidRequestError("state", f"{len(starts)} further sequences arrived for a request of "
                                      f"{seq.sampler.params.num_sequences}")
        seq.num_computed = seq.num_prompt
        self.prefix_cache.commit(seq, seq.num_prompt)
        forks = []
        for f in starts:
            sampler = seq.sampler.for_sequence(f.index)
            sampler.generator.set_state(generator_state(f.sampler_state))
            forks.append((f.index, f.token, sampler))
        children = self._fork(live, forks, self._fork_blocks.pop(kv.request_id, None))
        # the forks first: the first sequence may finish at its first token and free the blocks they share
        deltas = [self._start(live, kv.first_token)] + [self._start(c, f[1]) for c, f in zip(children, forks)]
        # the router has each first token's id and log-probability from prefill: these deltas carry its text,
        # numbered to follow it (the router holds them until the token itself has gone out)
        return [dataclasses.replace(d, token_ids=[], position=1) for d in deltas]

    def add_local(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> list[TokenDelta]:
        """Prefill on this worker at once (from the prompt's longest cached prefix), then decode (tests,
        benchmarks, single-process use)."""
        self._check_new(request_id, list(prompt_ids), params)
        seq = self._new_sequence(request_id, list(prompt_ids), params, BlockTable(self.config.block_size))
        self.prefix_cache.attach(seq)
        if not self.scheduler.reserve(seq, len(prompt_ids)):
            self._drop_unstarted(seq)
            raise OutOfBlocksError(f"no room for a {len(prompt_ids)}-token prompt")
        live = _Live(seq, OutputStream.for_sequence(seq, self.tokenizer))
        self.requests[request_id] = live
        logits = self._prefill(seq, len(prompt_ids), want_logits=True)
        self.prefix_cache.commit(seq, seq.num_prompt)
        return self._start_prefilled(live, logits)

    def add_prefill(self, request: DecodeRequest) -> bool:
        """Hold ``request`` to be prefilled here: it starts from its prompt's longest cached prefix (a
        conversation's earlier turns, left by the requests that served them) and this worker's steps compute
        the rest, ``prefill_chunk`` tokens per step, before it decodes (its first delta carries its first
        token). False when there is no room (for its blocks and every sequence's). Raises
        InvalidRequestError naming the field."""
        rid, params = request.request_id, request.params
        self._check_new(rid, list(request.prompt_ids), params)
        n = params.num_sequences
        fork_room = self._fork_room(len(request.prompt_ids), n)
        seq = self._new_sequence(rid, list(request.prompt_ids), params, BlockTable(self.config.block_size))
        self.prefix_cache.attach(seq)
        need = self.pool.blocks_for_tokens(seq.num_prompt + 1) - len(seq.block_table.blocks) + fork_room
        if len(self.scheduler.running) + n > self.config.max_num_seqs or not self.pool.can_allocate(need) or \
                not self.scheduler.reserve(seq, seq.num_prompt):
            self._drop_unstarted(seq)
            return False
        if fork_room:
            self._fork_blocks[rid] = self.pool.allocate(fork_room)
        seq.status = SequenceStatus.PREFILLING
        self.requests[rid] = _Live(seq, OutputStream.for_sequence(seq, self.tokenizer))
        self._prefilling.append(rid)
        return True

    def add_resume(self, request: ResumeRequest) -> bool:
        """Continue a request another decode instance streamed part of (it died): for each of its sequences
        still running, its prompt and output are this worker's tokens, the grammar and the generator follow
        the output, the text state is where the client's stream stands, and the KV of every token but the
        last is computed again before the next step (from the longest cached prefix; the sequences of one
        request share their prompt's blocks through it). Their deltas carry on from the next output
        position. False when there is no room now for all of them. Raises InvalidRequestError naming the
        field."""
        rid, params, prompt = request.request_id, request.params, list(request.prompt_ids)
        request.check_sequences()
        self._check_new(rid, prompt, params)
        if any(split_sequence_id(sid)[0] == rid for sid in self.requests):
            raise InvalidRequestError("request_id", f"{rid!r} is already on this worker")
        for s in request.sequences:
            check_room_to_generate(len(prompt) + len(s.output_ids), self.max_model_len, "sequences.output_ids")
        if not self.scheduler.can_reserve(*(len(prompt) + len(s.output_ids) for s in request.sequences)):
            return False
        for s in request.sequences:
            output = list(s.output_ids)
            seq = self._new_sequence(sequence_id(rid, s.index), prompt, params, BlockTable(self.config.block_size))
            seq.sampler = seq.sampler.for_sequence(s.index)  # a fresh grammar; sequence i's own generator
            seq.tokens = prompt + output
            seq.sampler.catch_up(output)
            if s.sampler_state:
                seq.sampler.generator.set_state(generator_state(s.sampler_state))
            seq.status = SequenceStatus.WAITING
            live = _Live(seq, OutputStream.for_sequence(seq, self.tokenizer))
            live.stream.push(output, None)  # the text state as the client's stream has it ...
            live.stream.sent = s.text_sent  # ... of which this much went out
            self.requests[seq.request_id] = live
            self.scheduler.resume_first(seq)
        return True

    def _drop_unstarted(self, seq: Sequence) -> None:
        """Free a sequence that never started (its cached blocks stay cached)."""
        seq.block_table.release(self.pool)
        self.pool.free(self._fork_blocks.pop(seq.request_id, []))
        self.prefix_cache.forget(seq.request_id)

    def _prefill_step(self) -> list[TokenDelta]:
        """Compute up to ``prefill_chunk`` prompt tokens of the requests prefilled here, oldest first; those
        whose prompt is complete sample their first token and start decoding."""
        budget, out = self.config.prefill_chunk, []
        while self._prefilling and budget > 0:
            live = self.requests[self._prefilling[0]]
            seq = live.seq
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
            self._prefilling.popleft()
            self.prefix_cache.commit(seq, seq.num_prompt)
            out += self._start_prefilled(live, logits)
        return out

    def _start_prefilled(self, live: _Live, logits: torch.Tensor) -> list[TokenDelta]:
        """Start every sequence of a request whose prompt was computed here, from the last position's logits
        [1, V]: each samples its first token (the further ones take their blocks from those reserved with the
        request, or the pool)."""
        seq = live.seq
        forks = []
        for i in range(1, seq.sampler.params.num_sequences):
            sampler = seq.sampler.for_sequence(i)
            forks.append((i, sampler.choose(logits[0], seq.tokens), sampler))
        children = self._fork(live, forks, self._fork_blocks.pop(seq.request_id, None))
        token = seq.sampler.choose(logits[0], seq.tokens)
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
            self.requests[child.request_id] = live
            children.append(live)
        return children

    def _fork_room(self, num_prompt: int, n: int) -> int:
        """Blocks the further sequences of an n-sequence request need of their own at the start."""
        return (n - 1) * (self.pool.blocks_for_tokens(num_prompt + 1) - num_prompt // self.config.block_size)

    def _check_new(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        check_request(request_id, prompt_ids, params, self.loaded.config.vocab_size)
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already on this worker")
        check_room_to_generate(len(prompt_ids), self.max_model_len, "prompt_ids")

    def abort(self, request_id: str) -> bool:
        """Cancel a request (every sequence of it) and free its KV, whatever its state (a transfer in flight
        is drained first)."""
        family = [sid for sid in self.requests if sid != request_id and split_sequence_id(sid)[0] == request_id]
        aborted = [self._abort_sequence(sid) for sid in [request_id] + family]
        return any(aborted)

    def _abort_sequence(self, request_id: str) -> bool:
        live = self.requests.get(request_id)
        if live is None:
            return False
        status = live.seq.status
        if status is SequenceStatus.WAITING_FOR_KV:
            self._drop_transfer(request_id)
        elif status is SequenceStatus.PREFILLING:  # nothing of it was cached: its blocks were never complete
            self._prefilling.remove(request_id)
            del self.requests[request_id]
            self._drop_unstarted(live.seq)
        elif status is SequenceStatus.WAITING:
            self.scheduler.finish(live.seq)
            del self.requests[request_id]
        else:
            self._finish(live, FinishReason.ABORT)
        return True

    def has_work(self) -> bool:
        """Requests running, preempted or waiting for their KV."""
        return bool(self.requests)

    def close(self) -> None:
        """Release a tensor-parallel instance's followers (nothing to do on one rank)."""
        if isinstance(self.runner, TPDriverRunner):
            self.runner.stop()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting_for_kv(self) -> int:
        return sum(lv.seq.status is SequenceStatus.WAITING_FOR_KV and lv.seq.request_id not in self.migrations.incoming
                   for lv in self.requests.values())

    def request_loads(self) -> PoolLoad:
        """The load report the global rescheduling policy reads (``controller/migration_policy.py``); a
        request migrating away, or of several sequences (they share their prompt's blocks), cannot move."""
        return self.scheduler.load(lambda seq: seq.request_id not in self.migrations.outgoing and
                                   seq.sampler.params.num_sequences == 1, frozenset(self.requests))

    def hold(self, request: DecodeRequest, num_tokens: int) -> bool:
        """A new request waiting for its KV, with blocks for ``num_tokens`` positions (False: no room): its
        prompt's longest cached prefix here, whose KV the sender then skips, and new blocks for the rest. On
        a tensor-parallel instance every rank expects its heads in the same blocks."""
        rid = request.request_id
        self._check_new(rid, list(request.prompt_ids), request.params)
        n = request.params.num_sequences
        fork_room = self._fork_room(len(request.prompt_ids), n)
        if n > 1 and (len(self.scheduler.running) + n > self.config.max_num_seqs or
                      not self.pool.can_allocate(self.pool.blocks_for_tokens(num_tokens + 1) + fork_room)):
            return False  # room for every sequence of the request, or none
        seq = self._new_sequence(rid, list(request.prompt_ids), request.params, BlockTable(self.config.block_size))
        seq.status = SequenceStatus.WAITING_FOR_KV
        self.prefix_cache.attach(seq)
        have = len(seq.block_table.blocks)
        self.requests[rid] = _Live(seq, OutputStream.for_sequence(seq, self.tokenizer))
        blocks = self.receiver.reserve(rid, num_tokens, have)  # -> self.reserve, which takes the blocks
        if blocks is not None and fork_room:
            self._fork_blocks[rid] = self.pool.allocate(fork_room)
        if blocks is None:
            del self.requests[rid]
            self._drop_unstarted(seq)
        elif self.tp is not None:
            slot = self._rank_outcomes.track(rid)
            self.runner.call("kv_reserve", request_id=rid, slot=slot, num_tokens=num_tokens, blocks=blocks,
                             have_blocks=have)
            self.tp.barrier()
        return blocks is not None

    def _take_events(self) -> list:
        out, self.events = self.events, []
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
                self._drop_unstarted(self.requests.pop(kv.request_id).seq)
                if kv.request_id in self.migrations.incoming:  # a migration whose state does not fit: it stays on its source
                    self.migrations.incoming.discard(kv.request_id)
                    out.append(MigrationFailed(kv.request_id, str(err)))
                else:
                    out.append(DecodeFailure(kv.request_id, str(err), False))
        for f in events.failed:  # the receiver has released the blocks (release_reservation)
            if self._rank_outcomes is not None:
                self._forget_transfer(f.request_id)
            if f.request_id in self.migrations.incoming:
                self.migrations.incoming.discard(f.request_id)
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
        received = self._receive() + self.migrations.poll()
        self._resume_preempted()
        received += self._prefill_step()
        lives = [self.requests[rid] for rid in self.scheduler.running]
        if not lives:
            return received + self._take_events()
        start = time.perf_counter()
        planned, choice = (self.speculator.choose_k([lv.seq for lv in lives], tuple(self.scheduler.running))
                           if k is None else (k, None))
        batch = len(lives)
        k, lives = self._make_room(planned)
        if not lives:
            return received + self._take_events()
        seqs = [lv.seq for lv in lives]
        same_shape = k == planned and len(seqs) == batch  # the step the policy predicted
        verdicts, logits = self.speculator.run(seqs, k, choice if same_shape else None)
        deltas = [self._commit(lv, v, k, logits[i]) for i, (lv, v) in enumerate(zip(lives, verdicts))]
        seconds = time.perf_counter() - start
        self._record_step(k, seconds)
        self.pass_log.record("step", seconds, k=k, seqs=len(lives))
        self.migrations.advance()
        return received + deltas + self._take_events()

    def _commit(self, live: _Live, verdict: Verdict, k: int, logits: torch.Tensor) -> TokenDelta:
        """Append the verdict's tokens (up to a stop), roll back rejected KV, emit the delta. logits: the
        target's [k + 1, V] at the verified positions (the log-probabilities reported come from them)."""
        seq = live.seq
        n = len(seq.tokens)
        position, text_offset = n - seq.num_prompt, live.stream.sent
        appended: list[int] = []
        reason = None
        for tok in verdict.tokens:
            appended.append(tok)
            reason = seq.append_token(tok)
            if reason is not None:
                break
        logprobs = self._logprobs(seq, logits, appended)
        # verification computed target KV at positions n-1 .. n-1+accepted: final wherever a token was kept
        self.prefix_cache.commit(seq, n + verdict.num_accepted)
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
                          verdict.num_accepted, logprobs, index=index, position=position, text_offset=text_offset,
                          sampler_state=seeded_state(seq) if reason is None else b"")

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
            if self.migrations.cancel_outgoing(seq.request_id):  # its KV is gone: the rounds sent cannot be completed
                self.events.append(MigrationFailed(seq.request_id, f"preempted on {self.instance_id}"))
        return k, [self.requests[seq.request_id] for seq in batch]

    def _resume_preempted(self) -> None:
        """Recompute the KV of the preempted sequences that fit again (all tokens but the last, from their
        longest cached prefix on)."""
        for seq in self.scheduler.resumable():
            self._prefill(seq, seq.num_tokens - 1, want_logits=False)
            self.prefix_cache.commit(seq, seq.num_computed)
            self.drafter.admit(seq)

    def _prefill(self, seq: Sequence, upto: int, want_logits: bool) -> torch.Tensor:
        """Compute the KV of tokens[num_computed:upto] in chunks; logits of the last one if wanted."""
        logits = torch.empty(0)
        chunk = self.config.prefill_chunk
        for start in range(seq.num_computed, upto, chunk):
            end = min(upto, start + chunk)
            last = end == upto and want_logits
            logits = self.runner.run([StepInput(seq.tokens[start:end], start, seq.block_table.blocks, num_logits=int(last))])
        seq.num_computed = upto
        return logits

    # -- lifecycle --------------------------------------------------------------------------------

    def _new_sequence(self, request_id: str, prompt: list[int], params: SamplingParams, table: BlockTable) -> Sequence:
        eos = frozenset(self.loaded.eos_token_ids)
        return Sequence(
            request_id=request_id, prompt_ids=prompt, sampler=sampler_for(self.loaded, params, prompt),
            eos_token_ids=eos, block_table=table,
            max_model_len=self.max_model_len, status=SequenceStatus.RUNNING,
        )

    def _start(self, live: _Live, first_token: int, logprobs: tuple = ()) -> TokenDelta:
        """Start decoding a sequence whose prompt is computed, from its first token."""
        seq = live.seq
        self.scheduler.start(seq)
        position, text_offset = len(seq.tokens) - seq.num_prompt, live.stream.sent
        reason = seq.append_token(first_token)
        text, reason = live.stream.push([first_token], reason)
        self.metrics.tokens += 1
        if reason is not None:
            self._finish(live, reason)
        else:
            self.drafter.admit(seq)
        rid, index = split_sequence_id(seq.request_id)
        return TokenDelta(rid, [first_token], text, reason is not None, reason.value if reason is not None else None,
                          logprobs=logprobs, index=index, position=position, text_offset=text_offset,
                          sampler_state=seeded_state(seq))

    def _finish(self, live: _Live, reason: FinishReason) -> None:
        seq = live.seq
        self.requests.pop(seq.request_id, None)
        self.migrations.forget(seq.request_id)  # the router sees the finish and aborts the other end
        self.drafter.release(seq)
        self.scheduler.finish(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # -- speculation settings ---------------------------------------------------------------------

    def profile(self, batches: tuple[int, ...] = (1, 4, 16), contexts: tuple[int, ...] = (256, 2048, 8192),
                ks: tuple[int, ...] = (0, 3)) -> None:
        """Seed the speculation cost models with synthetic passes (``Speculator.profile``); call when idle."""
        self.speculator.profile(self.pool, self.max_model_len, batches, contexts, ks)

    def set_speculation(self, spec: SpeculationConfig) -> None:
        """Switch speculation settings between steps (planner updates, benchmarks): ``Speculator.reconfigure``."""
        self.config = dataclasses.replace(self.config, speculation=spec)
        self.speculator.reconfigure(self.config, list(self.scheduler.running.values()))

    def status(self) -> dict:
        """Queue lengths, memory and metrics (GetClusterStatus reads this)."""
        return {
            "running": len(self.scheduler.running),
            "waiting_for_kv": self.num_waiting_for_kv,
            "migrating_out": len(self.migrations.outgoing),
            "migrating_in": len(self.migrations.incoming),
            "preempted": len(self.scheduler.preempted),
            "prefilling": len(self._prefilling),
            "free_blocks": self.pool.num_free,
            "total_blocks": self.pool.num_blocks,
            "cached_blocks": self.pool.num_cached,
            "metrics": self.metrics.summary(),
            **self.speculator.status(),
        }


def follower(model_path: str, config: DecodeWorkerConfig, tp: TPGroup, instance_id: str = "decode-0",
             transfer: TransferConfig | None = None) -> TPFollower:
    """A non-driver rank of a tensor-parallel decode instance: its shard and cache, ready to ``serve()``
    (draft passes over the sparse view and verification are forwards like any other); with ``transfer``,
    it receives its own KV heads from the prefill ranks that hold them (:class:`DecodeRankFollower`)."""
    base = forward_follower(model_path, config.dtype, config.device, config.kv_cache_tokens // config.block_size,
                            config.block_size, config.attention_backend, tp)
    if transfer is None:
        return base
    return DecodeRankFollower(base.runner, tp, instance_id, transfer)
