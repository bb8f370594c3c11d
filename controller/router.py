"""The request router: admission, placement, the request state machine, streaming back.

One request, end to end (``Router.generate``):

    admit (bounded concurrency, bounded queue)  ->  hand the request to the decode instance the rescheduling
    policy puts first (``controller/placement.py``, by the load each decode instance pushes, and by the
    prefix each holds cached: ``controller/kv_index.py``), which reserves its KV blocks and holds it waiting
    for KV, and at the same time the prompt to the prefill instance with the cheapest mix of uncached blocks
    and queued work (KV and then the first token stream to that decode instance, which accepts
    them into its reservation: no block id leaves it; a decode instance without room sends the request
    through a decode-first placement that waits for room)  ->  first token streamed  ->  the decode
    instance starts it once its KV and first token arrived  ->  deltas

A request whose decode instance holds all of its prompt cached but a short suffix (a conversation's next
turn, back on the instance that served the last one) is prefilled there instead, with no prefill instance
and no transfer (``prefix_caching.local_prefill_tokens``). While no prefill instance is in service (each dead,
restarting or draining) every request is prefilled on a decode instance that way, from whatever it holds cached;
one that needs a prefill instance (prompt log-probabilities, scoring) waits for one to come back.

Output is numbered by position in its sequence, whoever reports it (the prefill instance's first token, the
decode instance's deltas, both ends of a live migration): the router emits each position once, in order
(``controller/output_order.py``).

``ColocatedRouter`` (``controller/colocated_router.py``) serves the same API from colocated instances.

A decoding request may move to another decode instance while it streams (live migration, decided by the
router's ``migrations``: ``controller/migrations.py``).

A failure before anything was streamed re-runs the request elsewhere (up to ``MAX_RETRIES``); after
that the request fails with UNAVAILABLE. A failure after output went out resumes it on another instance from
the tokens streamed. Every call to an instance about a request is checked: a failed one is counted against the
instance and logged (``Router.call_failed``), and a request it left decoding nowhere is recovered
(``Router.recover``). Nothing is dropped silently: every request ends in finished,
failed or cancelled, and the counters say how many are where.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from controller.actor_messages import WorkerCrashed
from controller.admission import PriorityGate
from controller.kv_index import PrefixIndex, PrefixRouting, blocks_of, cheapest
from controller.metrics import FinishedRequest, ServingMetrics
from controller.migrations import PendingMigration, MigrationCoordinator
from controller.output_order import OutputOrder
from controller.placement import decode_order, record_placement, record_report
from controller.request_state import RequestRecord, RequestState, StateCounters
from controller.routing import Delta, Final, Instance, RouterError
from decode_worker.messages import (DecodeFailure, DecodeRequest, MigrationArrived, MigrationFailed, PoolLoad,
                                     TokenDelta)
from modeling.params import SamplingParams
from modeling.prefix_cache import PrefixCacheEvents
from modeling.resume import ResumedSequence, ResumeRequest
from prefill_worker.messages import FirstToken, KVDestination, PrefillRequest, PrefillStepOutput

log = logging.getLogger("magicserve.router")

MAX_RETRIES = 3
RANK_CHECK_PERIOD_S = 1.0  # how often an instance's other ranks are checked (``check_ranks``)
_PLACEMENT_RETRY_S = 0.01
CALL_TIMEOUT_S = 30.0  # a control call (abort, commit, finish) not answered by then has failed
# control calls whose False answer means the instance does not hold the request as the router does
_MUST_HOLD = frozenset({"commit_migration", "finish_migration"})


@dataclass
class _Active:
    record: RequestRecord
    prompt_ids: list[int]
    params: SamplingParams
    events: asyncio.Queue
    arrival: float
    prefill: Instance | None = None
    decode: Instance | None = None  # colocated: the instance that runs the request
    # the decode instances whose output counts: the one placed on, and each a live migration moved it to
    decoders: set = field(default_factory=set)
    order: OutputOrder = field(default_factory=OutputOrder)  # what was streamed, per sequence
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    priority: int = 0
    migration: PendingMigration | None = None  # in progress, undecided
    finished_sequences: set = field(default_factory=set)  # n > 1: the sequences that have ended
    prompt_hashes: dict = field(default_factory=dict)  # the prompt's block hashes per way of hashing (kv_index)
    # seeded sampling: each sequence's generator state after the last token reported (by sequence index)
    sampler_states: dict = field(default_factory=dict)
    resumes: int = 0  # times it continued on another decode instance after its own died
    avoid: set = field(default_factory=set)  # instances that failed a call for it: placed elsewhere while others can

    @property
    def tokens_streamed(self) -> int:
        return self.order.emitted_tokens()


class Router:
    """Routes requests over the prefill and decode instances (asyncio; one per controller)."""

    kv_transfer = True  # requests go prefilling -> transferring -> decoding

    def __init__(self, prefill: list[Instance], decode: list[Instance], max_concurrent: int, max_queue: int,
                 request_timeout_s: float = 600.0, restart=None, check_ranks=None,
                 metrics: ServingMetrics | None = None, connect_pair=None,
                 prefix_routing: PrefixRouting = PrefixRouting()):
        self.prefill = list(prefill)  # the router's own lists: pools change as instances join and leave
        self.decode = list(decode)
        self.instances = self.prefill + self.decode  # every instance the router polls
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self.counters = StateCounters()
        self.active: dict[str, _Active] = {}
        self._slots = PriorityGate(max_concurrent)
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._polls: dict[str, asyncio.Task] = {}  # instance name -> its polling task
        # async callables(instance): ``restart`` replaces a dead instance as a whole (every rank, its
        # channels re-formed; raises when it cannot), ``check_ranks`` raises when a rank the polls do not
        # reach (a tensor-parallel follower) died or hung
        self._restart = restart
        self._check_ranks = check_ranks
        self.metrics = metrics  # told of every first token, token batch, finish and failure
        self._closing = False
        # ``connect_pair``: async callable(source, destination) forming the migration channel between two
        # decode instances
        self.migrations = MigrationCoordinator(self, connect_pair)
        self.prefix_routing = prefix_routing
        self.kv_index = PrefixIndex()  # what each instance holds cached, from its events
        self.load_window = None  # controller.online_planner.LoadWindow: what the online planner reads
        self.call_failures = collections.Counter()  # (instance name, call) -> calls to it that failed

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        for inst in self.instances:
            self._watch(inst)
        loop = asyncio.get_running_loop()
        if self.migrations.automatic:
            self._tasks.append(loop.create_task(self.migrations.reschedule_forever()))

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let in-flight ones finish (up to the timeout), then stop polling."""
        self._closing = True
        deadline = time.monotonic() + drain_timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.active):
            self.cancel(rid)
        for t in [*self._tasks, *self._polls.values()]:
            t.cancel()

    def _watch(self, inst: Instance) -> None:
        self._polls[inst.name] = asyncio.get_running_loop().create_task(self._poll_instance(inst))

    # -- pools ------------------------------------------------------------------------------------

    def add_instance(self, inst: Instance) -> None:
        """A new instance (its ranks up, its KV channels formed) joins its pool and takes requests."""
        pool = self.prefill if inst.role == "prefill" else self.decode
        pool.append(inst)
        self.instances.append(inst)
        self._watch(inst)
        log.warning("%s %s joined", inst.role, inst.name)

    async def retire(self, inst: Instance, timeout_s: float = 600.0) -> None:
        """Take ``inst`` out of its pool without losing a request: it gets no new ones; a decode instance
        moves its running requests away by live migration (a request that cannot move, one of several
        sequences or still prefilling, finishes there), a prefill instance finishes what it holds. Then it
        is no longer polled, and the caller stops its actors. Raises RouterError (the instance back in
        service) when it still holds requests after ``timeout_s`` or is its pool's last alive instance."""
        pool = self.prefill if inst.role == "prefill" else self.decode
        if inst not in pool:
            raise RouterError("INVALID_ARGUMENT", f"instance: {inst.name} is not in the {inst.role} pool")
        if not any(i.alive and not i.draining for i in pool if i is not inst):
            raise RouterError("FAILED_PRECONDITION", f"{inst.name} is the last {inst.role} instance in service")
        inst.draining = True
        deadline = time.monotonic() + timeout_s
        try:
            while self._held_by(inst):
                if time.monotonic() > deadline:
                    raise RouterError("DEADLINE_EXCEEDED", f"{inst.name} still holds {len(self._held_by(inst))} "
                                      f"requests after {timeout_s:g} s")
                if inst.role == "decode":
                    await self.migrations.drain(inst.name, max(0.1, deadline - time.monotonic()))
                else:
                    await asyncio.sleep(0.05)
        except BaseException:
            inst.draining = False
            raise
        pool.remove(inst)
        self.instances.remove(inst)
        task = self._polls.pop(inst.name, None)
        if task is not None:
            task.cancel()
        self.kv_index.drop(inst.name)
        log.warning("%s %s left", inst.role, inst.name)

    def _held_by(self, inst: Instance) -> set[str]:
        """Requests ``inst`` holds: a prefill instance, those it has not handed off; a decode instance, those
        decoding (or placed, or migrating in) there."""
        if inst.role == "prefill":
            return {rid for rid in inst.assigned if rid in self.active}
        return set(inst.migrating_in) | {rid for rid, a in self.active.items()
                                         if a.decode is inst and not a.record.state.terminal}

    # -- requests ---------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}-{int(time.time() * 1000) % 100000}"

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[Delta | Final]:
        """Serve one request: yields Delta messages, then one Final. Raises RouterError. ``priority``:
        higher is admitted first when requests queue, and (with migration on) keeps headroom on its decode
        instance and is the last to be moved."""
        arrival = time.perf_counter()  # before admission: the TTFT reported includes any wait for a slot
        try:
            if self._closing:
                raise RouterError("UNAVAILABLE", "server is shutting down")
            if request_id in self.active:
                raise RouterError("ALREADY_EXISTS", f"request_id: {request_id!r} is already running")
            await self._admit(priority)
        except RouterError as err:  # refused before it began: counted, nothing to release
            if self.metrics is not None:
                self.metrics.failed(err.code)
            raise
        record = RequestRecord(request_id, self.counters, self.kv_transfer)
        active = _Active(record, list(prompt_ids), params, asyncio.Queue(), arrival, priority=priority)
        self.active[request_id] = active
        if self.load_window is not None:
            self.load_window.admitted(request_id, len(prompt_ids))
        try:
            await self._place(active)
            async for item in self._stream(active):
                yield item
        except asyncio.CancelledError:
            self._cancel_active(active, "client cancelled")
            raise
        except RouterError as err:
            self._end(active, RequestState.FAILED, str(err))
            if self.metrics is not None:
                self.metrics.failed(err.code)
            raise
        finally:
            self._release(active)

    def cancel(self, request_id: str) -> bool:
        """Cancel a running request everywhere (frees its KV on both workers)."""
        active = self.active.get(request_id)
        if active is None:
            return False
        self._cancel_active(active, "cancelled")
        active.events.put_nowait(("cancelled", None, None))
        return True

    # -- admission and placement ------------------------------------------------------------------

    async def _admit(self, priority: int) -> None:
        waiting = self._slots.waiting
        if self._slots.locked() and waiting >= self.max_queue:
            raise RouterError("RESOURCE_EXHAUSTED",
                              f"{self.max_concurrent} requests running and {waiting} queued (limit {self.max_queue})")
        await self._slots.acquire(priority)

    async def _place(self, active: _Active) -> None:
        """Hand the request to a decode instance (which reserves its KV) and the prompt to a prefill instance:
        both at once when the decode instance is thought to have room (its last hold succeeded, or a request
        has left it since), else the decode instance first, waiting for one with room. A request whose decode
        instance holds all its prompt cached but a short suffix is prefilled there alone, and so is every
        request while no prefill instance is in service (``_place_without_prefill``). A request that
        generates nothing (``max_tokens`` 0: its prompt is scored) goes to a prefill instance alone (waiting
        for one to be in service)."""
        rid = active.record.request_id
        if active.params.max_tokens == 0:
            prefill = await self._wait_for(active, self.prefill, "prefill")
            active.prefill = prefill
            prefill.assigned.add(rid)
            await self._submit(active, prefill, PrefillRequest(rid, tuple(active.prompt_ids), active.params, None))
            return
        request = DecodeRequest(rid, tuple(active.prompt_ids), active.params)
        cached = {i.name: self._cached(active, i) for i in self.decode}
        order, has_room = self._decode_order(active, cached)
        first = order[0] if order and has_room and order[0].room else None
        if first is not None and self._prefills_there(active, cached[first.name]) and \
                await self._hold_prefill(active, request, first):
            if self.load_window is not None:  # no prefill instance computes any of it
                self.load_window.cached(rid, len(active.prompt_ids) - 1)
            return
        prefill = self._cheapest(active, self.prefill)
        if prefill is None:
            await self._place_without_prefill(active, request)
            return
        if first is not None and await self._place_at_once(active, request, prefill, first):
            return
        decode = await self._wait_for_room(active, request, lambda: self._decode_order(active, cached)[0])
        prefill = self._cheapest(active, self.prefill)
        if prefill is None:
            await self.abort_on(decode, rid)
            await self._place_without_prefill(active, request)
            return
        self._assign(active, prefill, decode)
        await self._submit(active, prefill, self._prefill_request(active, decode))

    async def _place_without_prefill(self, active: _Active, request: DecodeRequest) -> None:
        """No prefill instance is in service (each dead, restarting or draining): a decode instance prefills
        the request (``add_prefill``: from its longest cached prefix, the whole prompt when none). A request
        that needs a prefill instance (its prompt's log-probabilities), or that no decode instance has room
        for, waits for a prefill instance to come back, up to the request's timeout."""
        rid = active.record.request_id
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            if active.params.prompt_logprobs is None:
                cached = {i.name: self._cached(active, i) for i in self.decode}
                for inst in self._decode_order(active, cached)[0]:
                    if await self._hold_prefill(active, request, inst):
                        log.info("%s: no prefill instance in service; prefilled on %s", rid, inst.name)
                        if self.load_window is not None:
                            self.load_window.cached(rid, cached[inst.name])
                        return
            if self._in_service(self.prefill):
                await self._place(active)
                return
            if time.monotonic() > deadline:
                raise RouterError("UNAVAILABLE", f"no prefill instance came back within {self.request_timeout_s:g} s "
                                  "and no decode instance could prefill the request")
            await asyncio.sleep(_PLACEMENT_RETRY_S * 10)

    async def _wait_for(self, active: _Active, pool: list[Instance], role: str) -> Instance:
        """The instance of ``pool`` to compute the prompt (``_cheapest``), waiting up to the request's timeout
        for one to be in service (a restart). Raises RouterError UNAVAILABLE when none is."""
        deadline = time.monotonic() + self.request_timeout_s
        while (inst := self._cheapest(active, pool)) is None:
            if time.monotonic() > deadline:
                raise RouterError("UNAVAILABLE", f"no {role} instance came back within {self.request_timeout_s:g} s")
            await asyncio.sleep(_PLACEMENT_RETRY_S * 10)
        return inst

    @staticmethod
    def _in_service(pool: list[Instance]) -> bool:
        return any(i.alive and not i.draining for i in pool)

    def _cached(self, active: _Active, inst: Instance) -> int:
        """Prompt tokens ``inst`` holds cached, by the index (0 with prefix routing off)."""
        if not self.prefix_routing.enabled:
            return 0
        return self.kv_index.cached_tokens(inst.name, active.prompt_ids, active.prompt_hashes)

    def _prefills_there(self, active: _Active, cached: int) -> bool:
        """Whether a decode instance holding ``cached`` prompt tokens prefills the rest itself: a cache hit
        leaving at most ``local_prefill_tokens`` to compute, for a request that needs nothing only a prefill
        instance gives (the prompt's log-probabilities)."""
        missing = len(active.prompt_ids) - cached
        return cached > 0 and missing <= self.prefix_routing.local_prefill_tokens and \
            active.params.prompt_logprobs is None

    async def _hold_prefill(self, active: _Active, request: DecodeRequest, decode: Instance) -> bool:
        """Have ``decode`` prefill the request from its cache; False (it holds nothing) when it has no room
        or cannot be reached."""
        rid = active.record.request_id
        active.decode, active.prefill, active.decoders = decode, None, {decode}
        decode.assigned.add(rid)
        record_placement(decode, rid, len(active.prompt_ids))
        try:
            held = await decode.handle.add_prefill.remote(request)
        except Exception as err:
            self.call_failed(decode, "add_prefill", rid, err, active)
            held = None
        if held:
            active.record.to(RequestState.PREFILLING)
            if self.metrics is not None:
                self.metrics.local_prefill()
            return True
        decode.room = held is not False
        decode.assigned.discard(rid)
        active.decode, active.decoders = None, set()
        return False

    def _cheapest(self, active: _Active, pool: list[Instance]) -> Instance | None:
        """The alive instance of ``pool`` to compute the prompt: the fewest assigned requests, unless some
        hold part of the prompt cached; then the cheapest by ``kv_index.cheapest`` (uncached blocks against
        the prompt blocks of the requests already assigned there)."""
        alive = self._usable(active, [i for i in pool if i.alive and not i.draining])
        cached = {i.name: self._cached(active, i) for i in alive}
        bs = next((self.kv_index.block_size(name) for name, c in cached.items() if c), 1)

        def queued(inst: Instance) -> int:
            return sum(blocks_of(len(self.active[r].prompt_ids), bs) for r in inst.assigned if r in self.active)

        chosen = cheapest(alive, len(active.prompt_ids), bs, lambda i: cached[i.name], queued,
                          self.prefix_routing.overlap_weight)
        if chosen is not None and self.load_window is not None:
            self.load_window.cached(active.record.request_id, cached[chosen.name])
        return chosen

    async def _place_at_once(self, active: _Active, request: DecodeRequest, prefill: Instance,
                             decode: Instance) -> bool:
        """Contact both instances together (the prefill instance's transfer waits, answered BUSY, until the
        decode instance holds the request); False, with neither holding it, when the decode instance had no
        room or either call failed. Where the decode instance had no room but the prefill instance keeps the
        prompt (its transfer there is under way), the request waits for room on that decode instance."""
        rid = active.record.request_id
        self._assign(active, prefill, decode)
        held, submitted = await asyncio.gather(decode.handle.add_remote.remote(request),
                                               prefill.handle.submit.remote(self._prefill_request(active, decode)),
                                               return_exceptions=True)
        if held is True and not isinstance(submitted, Exception):
            active.record.to(RequestState.PREFILLING)
            return True
        for inst, method, result in ((decode, "add_remote", held), (prefill, "submit", submitted)):
            if isinstance(result, Exception):
                self.call_failed(inst, method, rid, result, active)
        decode.room = held is not False
        if held is False and submitted is None and not await self._lets_go(prefill, rid):
            # the prefill instance is already sending the prompt to ``decode`` (answered BUSY there until it holds
            # the request) and keeps its id until that transfer ends: wait for room there
            return await self._hold_when_room(active, request, decode)
        undo = [self.abort_on(inst, rid) for inst, ok in ((decode, held is True), (prefill, submitted is None)) if ok]
        await asyncio.gather(*undo)
        for inst in (prefill, decode):
            inst.assigned.discard(rid)
        active.prefill = active.decode = None
        active.decoders = set()
        return False

    async def _lets_go(self, prefill: Instance, rid: str) -> bool:
        """Ask ``prefill`` to drop a prompt it took; False when it keeps it (its transfer is under way)."""
        try:
            return await asyncio.wait_for(prefill.handle.abort.remote(rid), CALL_TIMEOUT_S) is not False
        except asyncio.CancelledError:
            raise
        except Exception as err:  # gone: its death is handled as any instance's
            self.call_failed(prefill, "abort", rid, err)
            return True

    async def _hold_when_room(self, active: _Active, request: DecodeRequest, decode: Instance) -> bool:
        """Wait for ``decode`` to hold the request (``_wait_for_room``); True once it does. Raises RouterError
        UNAVAILABLE when it fails meanwhile, RESOURCE_EXHAUSTED when it never had room."""
        def there() -> list[Instance]:
            if decode.name in active.avoid or not decode.alive:
                raise RouterError("UNAVAILABLE", f"{decode.name} failed while the prompt was on its way there")
            return [decode]

        await self._wait_for_room(active, request, there)
        active.record.to(RequestState.PREFILLING)
        return True

    def _assign(self, active: _Active, prefill: Instance, decode: Instance) -> None:
        rid = active.record.request_id
        active.decode, active.prefill, active.decoders = decode, prefill, {decode}
        decode.assigned.add(rid)
        record_placement(decode, rid, len(active.prompt_ids))
        prefill.assigned.add(rid)

    @staticmethod
    def _prefill_request(active: _Active, decode: Instance) -> PrefillRequest:
        return PrefillRequest(active.record.request_id, tuple(active.prompt_ids), active.params,
                              KVDestination(decode.name, reserved=True))

    def _decode_order(self, active: _Active, cached: dict[str, int]) -> tuple[list[Instance], bool]:
        """The decode instances in the order the request tries them, by the rescheduling policy (the one
        that picks migration destinations) and the prompt tokens each holds cached, and whether the first has
        room by its last report."""
        return decode_order(self._usable(active, self.decode), len(active.prompt_ids), active.priority,
                            self.migrations.policy, self.active, cached, self.prefix_routing.overlap_weight)

    @staticmethod
    def _usable(active: _Active, pool: list[Instance]) -> list[Instance]:
        """``pool`` without the instances that failed a call for this request, unless that leaves none."""
        return [i for i in pool if i.name not in active.avoid] or pool

    async def _submit(self, active: _Active, inst: Instance, request) -> None:
        """Hand the request to the instance that prefills it (re-placed if the actor is gone)."""
        active.record.to(RequestState.PREFILLING)
        try:
            await inst.handle.submit.remote(request)
        except Exception as err:  # the actor died between choosing and submitting, or its worker refused
            self.call_failed(inst, "submit", active.record.request_id, err, active)
            await self._retry_or_fail(active, f"submit to {inst.role} {inst.name} failed: {type(err).__name__}: {err}")

    async def _wait_for_room(self, active: _Active, request: DecodeRequest,
                             order: Callable[[], list[Instance]]) -> Instance:
        """The first instance of ``order()`` to hold the request, asked again every ``_PLACEMENT_RETRY_S`` while
        none has room (back-pressure: KV frees up as requests finish), up to the request's timeout. Raises
        RouterError RESOURCE_EXHAUSTED when none had room in time."""
        deadline = time.monotonic() + self.request_timeout_s
        while (decode := await self._reserve_decode(active, request, order())) is None:
            if time.monotonic() > deadline:
                raise RouterError("RESOURCE_EXHAUSTED", "no decode instance had room for the prompt's KV in time")
            await asyncio.sleep(_PLACEMENT_RETRY_S)
        return decode

    async def _reserve_decode(self, active: _Active, request, order: list[Instance],
                              method: str = "add_remote") -> Instance | None:
        """The first instance of ``order`` that holds the request with room for its KV (None: none has room):
        a ``DecodeRequest`` waiting for its prompt's KV (``add_remote``), or a ``ResumeRequest`` (``add_resume``)."""
        for inst in order:
            try:
                inst.room = await getattr(inst.handle, method).remote(request)
                if inst.room:
                    return inst
            except Exception as err:
                self.call_failed(inst, method, request.request_id, err, active)
        return None

    # -- streaming --------------------------------------------------------------------------------

    async def _stream(self, active: _Active) -> AsyncIterator[Delta | Final]:
        rid = active.record.request_id
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                self._cancel_active(active, "timed out")
                raise RouterError("DEADLINE_EXCEEDED", f"request ran longer than {self.request_timeout_s}s")
            try:
                kind, payload, source = await asyncio.wait_for(active.events.get(), timeout)
            except asyncio.TimeoutError:
                continue
            if kind == "cancelled":
                return
            if kind == "migration_ended":
                if active.record.state is RequestState.MIGRATING:
                    active.record.to(RequestState.DECODING)
                continue
            if kind == "failed":
                reason, retryable = payload
                if retryable and active.tokens_streamed == 0 and active.record.retries < MAX_RETRIES:
                    await self._retry_or_fail(active, reason)
                    continue
                if retryable and self._can_resume(active):
                    await self._resume(active, reason)
                    continue
                self._cancel_on_workers(active)
                raise RouterError("UNAVAILABLE", f"request {rid} failed: {reason}")
            if kind == "first_token":
                if payload.token_id is None:  # nothing to generate: the prompt was scored
                    if active.prefill is not None:
                        active.prefill.assigned.discard(rid)
                    active.first_token_at = active.last_token_at = time.perf_counter()
                    yield Delta([], "", prompt_logprobs=payload.prompt_logprobs)
                    self._end(active, RequestState.FINISHED)
                    yield self._final(active, "length")
                    return
                if active.record.state is RequestState.PREFILLING:
                    active.record.to(RequestState.TRANSFERRING)
                pieces = self._first_tokens(rid, payload)
            elif source in active.decoders:  # a delta
                self._decoding(active)
                pieces = [payload]
                if payload.sampler_state:
                    active.sampler_states[payload.index] = payload.sampler_state
            else:
                continue  # from an instance the request left (a re-run elsewhere)
            for piece in pieces:
                for cut in active.order.accept(piece):
                    delta = self._emit(active, cut)
                    if delta is not None:
                        yield delta
                    n = active.params.num_sequences
                    if cut.finished and (n == 1 or len(active.finished_sequences) >= n):
                        self._end(active, RequestState.FINISHED)
                        yield self._final(active, cut.finish_reason)
                        return

    @staticmethod
    def _first_tokens(rid: str, first: FirstToken) -> list[TokenDelta]:
        """The first token of each sequence as prefill sampled it, as output pieces at position 0 (their text
        comes with the decode instance's first delta of that sequence, which repeats the token)."""
        pieces = [TokenDelta(rid, [first.token_id], "", False, logprobs=() if first.logprob is None else (first.logprob,),
                             prompt_logprobs=first.prompt_logprobs)]
        pieces += [TokenDelta(rid, [token], "", False, logprobs=() if lp is None else (lp,), index=index)
                   for index, token, lp in first.forks]
        return pieces

    def _decoding(self, active: _Active) -> None:
        """A decode instance reported output: the request decodes (its transfer, if any, is complete)."""
        state = active.record.state
        if state is RequestState.PREFILLING and self.kv_transfer and active.prefill is not None:
            active.record.to(state := RequestState.TRANSFERRING)
        if state in (RequestState.PREFILLING, RequestState.TRANSFERRING):
            active.record.to(RequestState.DECODING)

    def _emit(self, active: _Active, piece: TokenDelta) -> Delta | None:
        """The client's delta for an output piece cut to what was not streamed yet (None: nothing to send)."""
        ids = list(piece.token_ids)
        active.draft_tokens += piece.draft_tokens
        active.accepted_tokens += piece.accepted_tokens
        if piece.draft_tokens and self.load_window is not None:
            self.load_window.speculated(active.record.request_id, piece.accepted_tokens,
                                        int(piece.accepted_tokens < piece.draft_tokens))
        if ids:
            now = time.perf_counter()
            if not active.first_token_at:
                active.first_token_at = active.last_token_at = now
                if self.metrics is not None:
                    self.metrics.first_token(now - active.arrival)
            elif piece.position > 0:  # a sequence's first token is no step of its own
                if self.metrics is not None:
                    self.metrics.tokens(len(ids), now - active.last_token_at)
                active.last_token_at = now
            if self.load_window is not None:
                self.load_window.generated(active.record.request_id, active.tokens_streamed + len(ids))
        finish_reason = None
        if active.params.num_sequences > 1 and piece.finished:  # one of several sequences ended: its choice closes
            active.finished_sequences.add(piece.index)
            finish_reason = piece.finish_reason or "stop"
        if not ids and not piece.text and piece.prompt_logprobs is None and finish_reason is None:
            return None
        return Delta(ids, piece.text, tuple(piece.logprobs), piece.prompt_logprobs, piece.index, finish_reason)

    def _final(self, active: _Active, reason: str | None) -> Final:
        n = active.tokens_streamed
        tpot = (active.last_token_at - active.first_token_at) / (n - 1) if n > 1 else 0.0
        if self.load_window is not None:
            self.load_window.generated(active.record.request_id, n, True, active.first_token_at - active.arrival, tpot)
        final = Final(reason or "stop", len(active.prompt_ids), n, active.first_token_at - active.arrival, tpot,
                      active.draft_tokens, active.accepted_tokens, frozenset(active.finished_sequences))
        if self.metrics is not None:
            self.metrics.finished(FinishedRequest(final.finish_reason, final.prompt_tokens, n, final.ttft_s, tpot,
                                                  time.perf_counter() - active.arrival))
        return final

    # -- failures ---------------------------------------------------------------------------------

    async def _retry_or_fail(self, active: _Active, reason: str) -> None:
        rid = active.record.request_id
        # the aborts complete before any instance is asked to take it again under the same id
        await asyncio.gather(*self._detach(active))
        if active.record.retries >= MAX_RETRIES:
            raise RouterError("UNAVAILABLE", f"request {rid} failed after {MAX_RETRIES} retries: {reason}")
        active.record.to(RequestState.QUEUED, reason)
        active.order, active.decoders = OutputOrder(), set()  # the re-run streams afresh
        await self._place(active)

    def _can_resume(self, active: _Active) -> bool:
        """Whether a request whose instance failed after output went out continues elsewhere: fewer than
        ``MAX_RETRIES`` resumes so far, and every sequence still running has streamed its first token."""
        running = self._running_sequences(active)
        return active.resumes < MAX_RETRIES and bool(running) and \
            all(active.order.emitted_tokens(i) > 0 for i in running)

    @staticmethod
    def _running_sequences(active: _Active) -> list[int]:
        return [i for i in range(active.params.num_sequences) if i not in active.finished_sequences]

    async def _resume(self, active: _Active, reason: str) -> None:
        """Continue a request on an alive decode instance from its prompt and the tokens the client has
        received (the grammar, the text state and, seeded, the generator follow them): its stream goes on
        where it stood, and greedy output is the undisturbed run's. Waits for room up to the request's
        timeout; raises RouterError when no decode instance can take it."""
        rid = active.record.request_id
        active.resumes += 1
        log.warning("resuming %s on another instance: %s", rid, reason)
        if active.migration is not None:
            self.migrations.abort(active, reason)
        # the aborts complete before any instance is asked to take it again under the same id
        await asyncio.gather(*self._detach(active))
        active.decoders = set()
        sequences = tuple(ResumedSequence(i, *active.order.emitted(i), active.sampler_states.get(i, b""))
                          for i in self._running_sequences(active))
        request = ResumeRequest(rid, tuple(active.prompt_ids), active.params, sequences)
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            cached = {i.name: self._cached(active, i) for i in self.decode}
            inst = await self._reserve_decode(active, request, self._decode_order(active, cached)[0], "add_resume")
            if inst is not None:
                active.decode, active.decoders = inst, {inst}
                inst.assigned.add(rid)
                record_placement(inst, rid, sum(len(active.prompt_ids) + len(s.output_ids) for s in sequences))
                if self.metrics is not None:
                    self.metrics.resumed()
                return
            if time.monotonic() > deadline:
                raise RouterError("UNAVAILABLE", f"request {rid} could not continue: no decode instance took it "
                                  f"({reason})")
            await asyncio.sleep(_PLACEMENT_RETRY_S * 10)

    def _cancel_active(self, active: _Active, reason: str) -> None:
        if not active.record.state.terminal:
            self._cancel_on_workers(active)
            self._end(active, RequestState.CANCELLED, reason)

    def _cancel_on_workers(self, active: _Active) -> None:
        loop = asyncio.get_running_loop()
        for abort in self._detach(active):
            loop.create_task(abort)

    def _detach(self, active: _Active) -> list:
        """Unassign the request from its prefill and decode instances; the aborts to send the alive ones."""
        rid = active.record.request_id
        aborts = []
        for inst in (active.prefill, active.decode):
            if inst is not None:
                inst.assigned.discard(rid)
                if inst.alive:
                    aborts.append(self.abort_on(inst, rid))
        active.prefill = active.decode = None
        return aborts

    async def abort_on(self, inst: Instance, rid: str) -> bool:
        return await self.call(inst, "abort", rid)

    async def call(self, inst: Instance, method: str, rid: str) -> bool:
        """``inst.method(rid)``, a control call about one request (abort, commit_migration, ...); False when it
        failed: it raised, was not answered within ``CALL_TIMEOUT_S``, or answered False to a call that must
        succeed (``commit_migration``, ``finish_migration``). A failure is counted against the instance and
        logged (``call_failed``); the caller recovers the request (``recover``)."""
        try:
            result = await asyncio.wait_for(getattr(inst.handle, method).remote(rid), CALL_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self.call_failed(inst, method, rid, err)
            return False
        if result is False and method in _MUST_HOLD:
            self.call_failed(inst, method, rid, "answered False: the request is not there as the router holds it")
            return False
        return True

    def call_failed(self, inst: Instance, method: str, rid: str, error, active: _Active | None = None) -> None:
        """A call to ``inst`` about request ``rid`` failed: counted (``call_failures``, the metrics), logged as a
        WARNING naming the instance, the call and the error; with ``active``, the request avoids ``inst`` from
        now on while another instance can take it."""
        self.call_failures[(inst.name, method)] += 1
        if self.metrics is not None:
            self.metrics.call_failed(inst.name, method)
        if active is not None:
            active.avoid.add(inst.name)
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}".rstrip(": ")
        log.warning("%s %s: %s(%s) failed: %s", inst.role, inst.name, method, rid, why)

    def recover(self, active: _Active, inst: Instance, reason: str) -> None:
        """A call failed on ``inst``, which holds the request (it did not take it, or kept it stopped): the
        request continues elsewhere as when an instance dies (resumed from what it streamed, or run again when
        nothing was), and avoids ``inst``. Nothing to do when the request ended or has left ``inst`` already."""
        rid = active.record.request_id
        if self.active.get(rid) is not active or active.record.state.terminal or rid not in inst.assigned:
            return
        inst.assigned.discard(rid)
        active.avoid.add(inst.name)
        self._send(rid, "failed", (reason, True))

    def _end(self, active: _Active, state: RequestState, reason: str = "") -> None:
        if not active.record.state.terminal:
            active.record.to(state, reason)

    def _release(self, active: _Active) -> None:
        rid = active.record.request_id
        if active.migration is not None:  # ended while migrating: the destination's copy goes too
            self.migrations.abort(active, "the request ended on its source")
        if not active.record.state.terminal:
            self._cancel_active(active, "stream closed")
        for inst in self.instances:
            if rid in inst.assigned:
                inst.assigned.discard(rid)
                inst.room = True  # what it held is freed
        self.active.pop(rid, None)
        self.migrations.forget(rid)
        self._slots.release()

    # -- instance polling -------------------------------------------------------------------------

    async def _poll_instance(self, inst: Instance) -> None:
        next_check = time.monotonic() + RANK_CHECK_PERIOD_S
        while True:
            try:
                items = await inst.handle.poll.remote(0.05)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                if not await self._instance_down(inst, f"{inst.role} {inst.name} died: {type(err).__name__}"):
                    return
                continue
            for item in items:
                self._dispatch(inst, item)
            reason = next((f"{inst.role} {inst.name} crashed" for item in items if isinstance(item, WorkerCrashed)),
                          None)
            if reason is None and self._check_ranks is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + RANK_CHECK_PERIOD_S
                try:
                    await self._check_ranks(inst)
                except asyncio.CancelledError:
                    raise
                except Exception as err:
                    reason = f"{inst.role} {inst.name} lost a rank: {type(err).__name__}: {err}".rstrip(": ")
            if reason is not None and not await self._instance_down(inst, reason):
                return

    def _dispatch(self, inst: Instance, item) -> None:
        if isinstance(item, PrefillStepOutput):
            for ft in item.first_tokens:
                self._send(ft.request_id, "first_token", ft)
            for rid in item.transferred:  # the decode instance holds its KV now
                inst.assigned.discard(rid)
            for f in item.failed:
                self._send(f.request_id, "failed", (f.reason, f.retryable))
        elif isinstance(item, TokenDelta):
            self._send(item.request_id, "delta", item, inst)
        elif isinstance(item, PoolLoad):
            record_report(inst, item)
        elif isinstance(item, PrefixCacheEvents):
            self.kv_index.apply(inst.name, item)
        elif isinstance(item, MigrationArrived):
            self.migrations.on_arrived(inst, item)
        elif isinstance(item, MigrationFailed):
            active = self.active.get(item.request_id)
            m = None if active is None else active.migration
            if m is not None and inst in (m.source, m.destination):
                self.migrations.abort(active, f"{inst.name}: {item.reason}")
        elif isinstance(item, DecodeFailure):
            self._send(item.request_id, "failed", (item.reason, item.retryable))
        elif isinstance(item, WorkerCrashed):  # its loop stopped: nothing it holds will progress
            self._fail_instance(inst, f"{inst.role} {inst.name} crashed")  # _poll_instance restarts it

    def _send(self, rid: str, kind: str, payload, source: Instance | None = None) -> None:
        active = self.active.get(rid)
        if active is not None:
            active.events.put_nowait((kind, payload, source))

    def _fail_instance(self, inst: Instance, reason: str) -> None:
        """Take the instance out of service and fail its requests (retryable while nothing has streamed:
        ``_stream`` decides)."""
        if inst.alive:
            inst.alive = False
            self.kv_index.drop(inst.name)
            log.error("%s", reason)
            for rid in list(inst.assigned):
                self._send(rid, "failed", (reason, True))
            inst.assigned.clear()
            for rid in list(inst.migrating_in):  # migrations into it abort: their requests stay where they are
                active = self.active.get(rid)
                if active is not None and active.migration is not None:
                    self.migrations.abort(active, reason)
            inst.migrating_in.clear()

    async def _instance_down(self, inst: Instance, reason: str) -> bool:
        """Fail over the instance's requests and bring it back as a whole; False when it stays out of
        service (no restart hook, or the restart failed)."""
        self._fail_instance(inst, reason)
        if self._restart is None or self._closing:
            return False
        log.warning("restarting %s %s", inst.role, inst.name)
        try:
            await self._restart(inst)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            log.error("%s %s stays out of service: %s", inst.role, inst.name, err)
            return False
        inst.alive = True
        log.warning("%s %s is back (generation %d)", inst.role, inst.name, inst.generation)
        return True

    # -- status -----------------------------------------------------------------------------------

    def queue_stats(self) -> dict:
        snap = self.counters.snapshot()
        return {"waiting": self._slots.waiting, "active": len(self.active), "states": snap}
