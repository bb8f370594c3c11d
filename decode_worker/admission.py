"""The one door into a decode instance: ``Admission.admit(request, source)``.

Whatever its source (``decode_worker/sources.py``), an admitted request is checked the same way, gets its
sequence(s) and text stream the same way, reserves its blocks with one call (``DecodeScheduler.reserve``
over ``KVSlots.allocate_slots``: the cached prefix, its positions, the first step and its further
sequences' own blocks together) and is held in the worker's ``requests`` from then until it finishes:

* ``RemoteKV`` / ``MigrationIn``: ``waiting_for_kv``, the transfer expected into its blocks (``KVInbox``, the
  receiving KV connector, told after the allocation);
* ``LocalPrefill``: ``prefilling``, queued for the worker's steps to compute (``PrefillQueue``);
* ``Resume``: ``waiting``, its sequences ahead of the preempted, their blocks reserved when they resume;
* ``Fork``: a further sequence of a request whose prompt is computed, on blocks reserved with it.

Admission answers False when there is no room now (back-pressure: the caller waits or goes elsewhere) and
raises InvalidRequestError naming the field when the request itself is wrong.
"""

from __future__ import annotations

from collections import deque

from decode_worker.held import HeldRequest
from decode_worker.kv_inbox import KVInbox
from decode_worker.kv_slots import SlotGrant
from decode_worker.messages import DecodeRequest
from decode_worker.scheduler import DecodeScheduler
from decode_worker.sources import AdmissionSource, Fork, LocalPrefill, MigrationIn, RemoteKV, Resume
from modeling.block_pool import BlockTable
from modeling.checkpoint import LoadedModel
from modeling.errors import InvalidRequestError
from modeling.forks import sequence_id, split_sequence_id
from modeling.kv_connector import KVRequest
from modeling.output import OutputStream
from modeling.params import SamplingParams
from modeling.request_check import check_request, check_room_to_generate
from modeling.resume import ResumeRequest, generator_state
from modeling.runner import ModelRunner
from modeling.sampling import RequestSampler, sampler_for
from modeling.sequence import Sequence, SequenceStatus
from modeling.tokenizer import TextTokenizer
from modeling.tp_runner import copy_kv_blocks


class Admission:
    """Admits requests into ``requests`` (the worker's: every sequence it holds, by sequence id)."""

    def __init__(self, loaded: LoadedModel, max_model_len: int, tokenizer: TextTokenizer | None,
                 requests: dict[str, HeldRequest], scheduler: DecodeScheduler, runner: ModelRunner,
                 prefill_order: deque[str], inbox: KVInbox | None = None):
        """``prefill_order``: the requests prefilled here, first come first served (``PrefillQueue`` reads it);
        ``inbox``: where remote KV is expected (None: this instance receives none; the worker sets it once
        built, as the inbox hands failed transfers back to ``release_waiting``)."""
        self.loaded = loaded
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.requests = requests
        self.scheduler = scheduler
        self.runner = runner
        self.prefill_order = prefill_order
        self.inbox = inbox

    def admit(self, request: DecodeRequest | ResumeRequest, source: AdmissionSource) -> bool:
        """Hold ``request`` here as ``source`` says its KV comes; False when there is no room now (nothing is
        held then). Raises InvalidRequestError naming the field."""
        match source:
            case RemoteKV():
                return self._await_kv(request, len(request.prompt_ids))
            case MigrationIn(capacity_tokens=capacity):
                return self._await_kv(request, capacity)
            case LocalPrefill(late=late):
                return self._prefill_here(request, late)
            case Resume():
                return self._resume(request)
            case Fork():
                return self._fork(request, source)
        raise TypeError(f"source: expected one of RemoteKV, LocalPrefill, Resume, Fork, MigrationIn, got {source!r}")

    def drop(self, request_id: str) -> None:
        """Free a held sequence that never started (no bytes may be in flight into its blocks); its cached
        blocks stay cached."""
        held = self.requests.pop(request_id)
        pool = self.scheduler.pool
        self.scheduler.prefix_cache.forget(request_id)  # first: a load into its blocks stops before they go
        held.seq.block_table.release(pool)
        pool.free(held.fork_blocks)
        held.fork_blocks = []

    def release_waiting(self, request_id: str) -> None:
        """``KVInbox``: the transfer into a waiting request's blocks failed or was cancelled, and no bytes are
        in flight any more: free them and drop the request."""
        held = self.requests.get(request_id)
        if held is not None and held.seq.status is SequenceStatus.WAITING_FOR_KV:
            self.drop(request_id)

    # -- the sources ------------------------------------------------------------------------------

    def _await_kv(self, request: DecodeRequest, num_tokens: int) -> bool:
        """RemoteKV, MigrationIn: blocks for ``num_tokens`` positions from the prompt's longest cached prefix on
        (the sender skips those blocks), every further sequence's room with them; on a tensor-parallel
        instance every rank expects its heads in the same blocks."""
        if self.inbox is None:
            raise InvalidRequestError("request_id", "this worker receives no KV (it was built without transfer)")
        held = self._new_held(request, SequenceStatus.WAITING_FOR_KV)
        grant = self._reserve(held, num_tokens, load_in_background=True)  # loaded while the rest arrives
        if grant is None:
            return False
        try:
            external = num_tokens - grant.cached_blocks * self._block_size  # the sender skips the cached blocks
            self.inbox.update_state_after_alloc(KVRequest(request.request_id, num_tokens), grant.blocks, external)
        except ValueError:  # e.g. a cancelled transfer under this id still drains into its old blocks
            self.drop(request.request_id)
            raise
        return True

    def _prefill_here(self, request: DecodeRequest, late: bool) -> bool:
        """LocalPrefill: blocks for the prompt and the first step from its longest cached prefix on (a
        conversation's earlier turns, left by the requests that served them), every further sequence's room
        with them; the worker's steps compute the rest. What the tiers hold of it is loaded beside the worker's
        steps where they can, unless that is a mere copy within host memory on CPU: the request's first chunk
        waits for it (``PrefillQueue``), the decoding batch does not."""
        held = self._new_held(request, SequenceStatus.PREFILLING)
        held.late = late
        beside = not self.scheduler.prefix_cache.loads_from_memory(held.seq.prompt_ids)
        if self._reserve(held, held.seq.num_prompt, load_in_background=beside) is None:
            return False
        self.prefill_order.append(request.request_id)
        return True

    def _resume(self, request: ResumeRequest) -> bool:
        """Resume: for each of its sequences still running, its prompt and output are this instance's tokens,
        the grammar and the generator follow the output, the text state is where the client's stream stands;
        the scheduler reserves its blocks and the worker computes the KV of every token but the last before
        the next step (from the longest cached prefix: the sequences share their prompt's blocks through it).
        False when there is no room now for all of them."""
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
            seq = self._new_sequence(sequence_id(rid, s.index), prompt, params)
            seq.sampler = seq.sampler.for_sequence(s.index)  # a fresh grammar; sequence i's own generator
            seq.tokens = prompt + output
            seq.sampler.catch_up(output)
            if s.sampler_state:
                seq.sampler.generator.set_state(generator_state(s.sampler_state))
            seq.status = SequenceStatus.WAITING
            held = HeldRequest(seq, OutputStream.for_sequence(seq, self.tokenizer))
            held.stream.push(output, None)  # the text state as the client's stream has it ...
            held.stream.sent = s.text_sent  # ... of which this much went out
            self.requests[seq.request_id] = held
            self.scheduler.resume_first(seq)
        return True

    def _fork(self, request: DecodeRequest, source: Fork) -> bool:
        """Fork: the sequence shares the parent's full prompt blocks (``BlockTable.fork``) and takes its own
        from those reserved with the parent (or the pool), the partly filled prompt block's KV copied."""
        parent = self.requests[source.parent_id]
        seq = parent.seq
        num_prompt = seq.num_prompt
        each = self.scheduler.slots.fork_blocks_each(num_prompt)
        own = parent.fork_blocks[:each] or None
        del parent.fork_blocks[:each]
        child = self._new_sequence(request.request_id, seq.prompt_ids, seq.sampler.params, source.sampler)
        child.block_table, copies = seq.block_table.fork(self.scheduler.pool, num_prompt, num_prompt + 1, own)
        copy_kv_blocks(self.runner, copies)
        child.num_computed = num_prompt
        self.requests[child.request_id] = HeldRequest(child, OutputStream.for_sequence(child, self.tokenizer))
        return True

    # -- shared steps -----------------------------------------------------------------------------

    @property
    def _block_size(self) -> int:
        return self.scheduler.pool.block_size

    def _new_held(self, request: DecodeRequest, status: SequenceStatus) -> HeldRequest:
        """A checked new request's first sequence in ``status``, not yet held (it has no blocks)."""
        prompt = list(request.prompt_ids)
        self._check_new(request.request_id, prompt, request.params)
        seq = self._new_sequence(request.request_id, prompt, request.params)
        seq.status = status
        return HeldRequest(seq, OutputStream.for_sequence(seq, self.tokenizer))

    def _reserve(self, held: HeldRequest, num_tokens: int, load_in_background: bool = False) -> SlotGrant | None:
        """Reserve ``held``'s blocks (one ``allocate_slots`` call, from the prompt's longest cached prefix on)
        and hold it; None, holding nothing, when there is no room for every sequence of its request.
        ``load_in_background``: its blocks found in the tiers are loaded while it waits (``KVSlots``)."""
        seq = held.seq
        grant = self.scheduler.reserve(seq, num_tokens, num_forks=seq.sampler.params.num_sequences - 1,
                                       cached_upto=seq.num_prompt - 1, load_in_background=load_in_background)
        if grant is not None:
            held.fork_blocks = list(grant.fork_blocks)
            self.requests[seq.request_id] = held
        return grant

    def _new_sequence(self, request_id: str, prompt: list[int], params: SamplingParams,
                      sampler: RequestSampler | None = None) -> Sequence:
        return Sequence(
            request_id=request_id, prompt_ids=prompt,
            sampler=sampler if sampler is not None else sampler_for(self.loaded, params, prompt),
            eos_token_ids=frozenset(self.loaded.eos_token_ids), block_table=BlockTable(self._block_size),
            max_model_len=self.max_model_len, status=SequenceStatus.RUNNING,
        )

    def _check_new(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        check_request(request_id, prompt_ids, params, self.loaded.config.vocab_size)
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already on this worker")
        check_room_to_generate(len(prompt_ids), self.max_model_len, "prompt_ids")
