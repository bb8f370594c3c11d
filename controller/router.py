"""The request router: admission, placement, the request state machine, streaming back.

One request, end to end (``Router.generate``):

    admit (bounded concurrency, bounded queue)  ->  hand the request to the least-loaded decode instance
    with room, which reserves its KV blocks and holds it waiting for KV  ->  prefill on the least-loaded
    prefill instance (KV and then the first token stream to the reserved blocks)  ->  first token
    streamed  ->  the decode instance starts it once its KV and first token arrived  ->  deltas

``ColocatedRouter`` serves the same API from colocated instances (the reference engine: prefill and decode
in one instance, no KV transfer); it shares everything with ``Router`` but placement.

A failure before anything was streamed re-runs the request elsewhere (up to ``MAX_RETRIES``); after
that the request fails with UNAVAILABLE. Nothing is dropped silently: every request ends in finished,
failed or cancelled, and the counters say how many are where.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from controller.actors import ColocatedRequest, WorkerCrashed
from controller.metrics import FinishedRequest, ServingMetrics
from controller.request_state import RequestRecord, RequestState, StateCounters
from decode_worker.messages import DecodeFailure, DecodeRequest, TokenDelta
from modeling.params import SamplingParams
from prefill_worker.messages import FirstToken, KVDestination, PrefillRequest, PrefillStepOutput

log = logging.getLogger("magicserve.router")

MAX_RETRIES = 3
RANK_CHECK_PERIOD_S = 1.0  # how often an instance's other ranks are checked (``check_ranks``)
_PLACEMENT_RETRY_S = 0.01


class RouterError(Exception):
    """A request the router cannot serve; ``code`` is a gRPC status name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Instance:
    """A worker actor as the router sees it."""

    name: str
    role: str  # "prefill" | "decode" | "colocated"
    handle: object
    alive: bool = True
    generation: int = 0  # bumped when the instance restarts (new ranks, new group and KV channels)
    assigned: set = field(default_factory=set)  # request ids currently placed here


@dataclass(frozen=True)
class Delta:
    """Streamed to the client: new token ids and text."""

    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class Final:
    """The last message of a request."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    mean_tpot_s: float
    draft_tokens: int
    accepted_tokens: int


@dataclass
class _Active:
    record: RequestRecord
    prompt_ids: list[int]
    params: SamplingParams
    events: asyncio.Queue
    arrival: float
    prefill: Instance | None = None
    decode: Instance | None = None  # colocated: the instance that runs the request
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    tokens_streamed: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


class Router:
    """Routes requests over the prefill and decode instances (asyncio; one per controller)."""

    kv_transfer = True  # requests go prefilling -> transferring -> decoding

    def __init__(self, prefill: list[Instance], decode: list[Instance], max_concurrent: int, max_queue: int,
                 request_timeout_s: float = 600.0, restart=None, check_ranks=None,
                 metrics: ServingMetrics | None = None):
        self.prefill = prefill
        self.decode = decode
        self.instances = prefill + decode  # every instance the router polls
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self.counters = StateCounters()
        self._active: dict[str, _Active] = {}
        self._slots = asyncio.Semaphore(max_concurrent)
        self._waiting = 0
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        # async callables(instance): ``restart`` replaces a dead instance as a whole (every rank, its
        # channels re-formed; raises when it cannot), ``check_ranks`` raises when a rank the polls do not
        # reach (a tensor-parallel follower) died or hung
        self._restart = restart
        self._check_ranks = check_ranks
        self.metrics = metrics  # told of every first token, token batch, finish and failure
        self._closing = False

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        for inst in self.instances:
            self._tasks.append(asyncio.get_running_loop().create_task(self._poll_instance(inst)))

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let in-flight ones finish (up to the timeout), then stop polling."""
        self._closing = True
        deadline = time.monotonic() + drain_timeout_s
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._active):
            self.cancel(rid)
        for t in self._tasks:
            t.cancel()

    # -- requests ---------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}-{int(time.time() * 1000) % 100000}"

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Delta | Final]:
        """Serve one request: yields Delta messages, then one Final. Raises RouterError."""
        arrival = time.perf_counter()  # before admission: the TTFT reported includes any wait for a slot
        try:
            if self._closing:
                raise RouterError("UNAVAILABLE", "server is shutting down")
            if request_id in self._active:
                raise RouterError("ALREADY_EXISTS", f"request_id: {request_id!r} is already running")
            await self._admit()
        except RouterError as err:  # refused before it began: counted, nothing to release
            if self.metrics is not None:
                self.metrics.failed(err.code)
            raise
        record = RequestRecord(request_id, self.counters, self.kv_transfer)
        active = _Active(record, list(prompt_ids), params, asyncio.Queue(), arrival)
        self._active[request_id] = active
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
        active = self._active.get(request_id)
        if active is None:
            return False
        self._cancel_active(active, "cancelled")
        active.events.put_nowait(("cancelled", None))
        return True

    # -- admission and placement ------------------------------------------------------------------

    async def _admit(self) -> None:
        if self._slots.locked():
            if self._waiting >= self.max_queue:
                raise RouterError("RESOURCE_EXHAUSTED",
                                  f"{self.max_concurrent} requests running and {self._waiting} queued (limit {self.max_queue})")
            self._waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self._waiting -= 1
        else:
            await self._slots.acquire()

    async def _place(self, active: _Active) -> None:
        """Hand the request to a decode instance (which reserves its KV), then the prompt to a prefill instance."""
        rid = active.record.request_id
        deadline = time.monotonic() + self.request_timeout_s
        request = DecodeRequest(rid, tuple(active.prompt_ids), active.params)
        while True:
            decode, blocks = await self._reserve_decode(request)
            if decode is not None:
                break
            if time.monotonic() > deadline:
                raise RouterError("RESOURCE_EXHAUSTED", "no decode instance had room for the prompt's KV in time")
            await asyncio.sleep(_PLACEMENT_RETRY_S)  # back-pressure: wait for KV to free up
        prefill = self._least_loaded(self.prefill)
        if prefill is None:
            await self._abort_on(decode, rid)
            raise RouterError("UNAVAILABLE", "no prefill instance is alive")
        active.decode, active.prefill = decode, prefill
        decode.assigned.add(rid)
        prefill.assigned.add(rid)
        request = PrefillRequest(rid, tuple(active.prompt_ids), active.params, KVDestination(decode.name, tuple(blocks)))
        await self._submit(active, prefill, request)

    async def _submit(self, active: _Active, inst: Instance, request) -> None:
        """Hand the request to the instance that prefills it (re-placed if the actor is gone)."""
        active.record.to(RequestState.PREFILLING)
        try:
            await inst.handle.submit.remote(request)
        except Exception as err:  # the actor died between choosing and submitting
            await self._retry_or_fail(active, f"{inst.role} {inst.name} unreachable: {err}")

    async def _reserve_decode(self, request: DecodeRequest):
        for inst in sorted((d for d in self.decode if d.alive), key=lambda d: len(d.assigned)):
            try:
                blocks = await inst.handle.add_remote.remote(request)
            except Exception as err:
                log.warning("decode %s unreachable: %s", inst.name, err)
                continue
            if blocks is not None:
                return inst, blocks
        return None, None

    @staticmethod
    def _least_loaded(pool: list[Instance]) -> Instance | None:
        alive = [i for i in pool if i.alive]
        return min(alive, key=lambda i: len(i.assigned)) if alive else None

    # -- streaming --------------------------------------------------------------------------------

    async def _stream(self, active: _Active) -> AsyncIterator[Delta | Final]:
        rid = active.record.request_id
        deadline = time.monotonic() + self.request_timeout_s
        # decode deltas that overtook the prefill instance's first token (each instance is polled on its
        # own): held until the first token has gone out, so tokens stream in order
        early: collections.deque = collections.deque()
        while True:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                self._cancel_active(active, "timed out")
                raise RouterError("DEADLINE_EXCEEDED", f"request ran longer than {self.request_timeout_s}s")
            if early and active.record.state is not RequestState.PREFILLING:
                kind, payload = "delta", early.popleft()
            else:
                try:
                    kind, payload = await asyncio.wait_for(active.events.get(), timeout)
                except asyncio.TimeoutError:
                    continue
            if kind == "delta" and self.kv_transfer and active.record.state is RequestState.PREFILLING:
                early.append(payload)
                continue
            if kind == "cancelled":
                return
            if kind == "first_token":
                yield self._on_first_token(active, payload)
            elif kind == "transferred":
                if active.record.state is RequestState.TRANSFERRING:
                    active.record.to(RequestState.DECODING)
            elif kind == "delta":
                delta = self._on_delta(active, payload)
                if delta is not None:
                    yield delta
                if payload.finished:
                    self._end(active, RequestState.FINISHED)
                    yield self._final(active, payload.finish_reason)
                    return
            elif kind == "failed":
                reason, retryable = payload
                if retryable and active.tokens_streamed == 0 and active.record.retries < MAX_RETRIES:
                    early.clear()  # the re-run streams afresh
                    await self._retry_or_fail(active, reason)
                else:
                    self._cancel_on_workers(active)
                    raise RouterError("UNAVAILABLE", f"request {rid} failed: {reason}")

    def _on_first_token(self, active: _Active, first: FirstToken) -> Delta:
        active.record.to(RequestState.TRANSFERRING)
        active.first_token_at = active.last_token_at = time.perf_counter()
        active.tokens_streamed = 1
        if self.metrics is not None:
            self.metrics.first_token(active.first_token_at - active.arrival)
        return Delta([first.token_id], "")  # its text comes with the decode worker's first delta

    def _on_delta(self, active: _Active, delta: TokenDelta) -> Delta | None:
        if active.record.state is RequestState.TRANSFERRING:
            active.record.to(RequestState.DECODING)
        ids = list(delta.token_ids)
        active.tokens_streamed += len(ids)
        active.draft_tokens += delta.draft_tokens
        active.accepted_tokens += delta.accepted_tokens
        if ids:
            now = time.perf_counter()
            if self.metrics is not None and active.tokens_streamed > len(ids):  # not the request's first token
                self.metrics.tokens(len(ids), now - active.last_token_at)
            active.last_token_at = now
        if not ids and not delta.text:
            return None
        return Delta(ids, delta.text)

    def _final(self, active: _Active, reason: str | None) -> Final:
        n = active.tokens_streamed
        tpot = (active.last_token_at - active.first_token_at) / (n - 1) if n > 1 else 0.0
        final = Final(reason or "stop", len(active.prompt_ids), n, active.first_token_at - active.arrival, tpot,
                      active.draft_tokens, active.accepted_tokens)
        if self.metrics is not None:
            self.metrics.finished(FinishedRequest(final.finish_reason, final.prompt_tokens, n, final.ttft_s, tpot,
                                                  time.perf_counter() - active.arrival))
        return final

    # -- failures ---------------------------------------------------------------------------------

    async def _retry_or_fail(self, active: _Active, reason: str) -> None:
        rid = active.record.request_id
        self._cancel_on_workers(active)
        if active.record.retries >= MAX_RETRIES:
            raise RouterError("UNAVAILABLE", f"request {rid} failed after {MAX_RETRIES} retries: {reason}")
        active.record.to(RequestState.QUEUED, reason)
        await self._place(active)

    def _cancel_active(self, active: _Active, reason: str) -> None:
        if not active.record.state.terminal:
            self._cancel_on_workers(active)
            self._end(active, RequestState.CANCELLED, reason)

    def _cancel_on_workers(self, active: _Active) -> None:
        rid = active.record.request_id
        for inst in (active.prefill, active.decode):
            if inst is not None:
                inst.assigned.discard(rid)
                if inst.alive:
                    asyncio.get_running_loop().create_task(self._abort_on(inst, rid))
        active.prefill = active.decode = None

    async def _abort_on(self, inst: Instance, rid: str) -> None:
        try:
            await inst.handle.abort.remote(rid)
        except Exception as err:
            log.debug("abort of %s on %s failed: %s", rid, inst.name, err)

    def _end(self, active: _Active, state: RequestState, reason: str = "") -> None:
        if not active.record.state.terminal:
            active.record.to(state, reason)

    def _release(self, active: _Active) -> None:
        rid = active.record.request_id
        if not active.record.state.terminal:
            self._cancel_active(active, "stream closed")
        for inst in self.instances:
            inst.assigned.discard(rid)
        self._active.pop(rid, None)
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
            for rid in item.transferred:
                self._send(rid, "transferred", None)
                inst.assigned.discard(rid)
            for f in item.failed:
                self._send(f.request_id, "failed", (f.reason, f.retryable))
        elif isinstance(item, TokenDelta):
            self._send(item.request_id, "delta", item)
        elif isinstance(item, DecodeFailure):
            self._send(item.request_id, "failed", (item.reason, item.retryable))
        elif isinstance(item, WorkerCrashed):  # its loop stopped: nothing it holds will progress
            self._fail_instance(inst, f"{inst.role} {inst.name} crashed")  # _poll_instance restarts it

    def _send(self, rid: str, kind: str, payload) -> None:
        active = self._active.get(rid)
        if active is not None:
            active.events.put_nowait((kind, payload))

    def _fail_instance(self, inst: Instance, reason: str) -> None:
        """Take the instance out of service and fail its requests (retryable while nothing has streamed:
        ``_stream`` decides)."""
        if inst.alive:
            inst.alive = False
            log.error("%s", reason)
            for rid in list(inst.assigned):
                self._send(rid, "failed", (reason, True))
            inst.assigned.clear()

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
        return {"waiting": self._waiting, "active": len(self._active), "states": snap}


class ColocatedRouter(Router):
    """Routes requests over colocated instances, each running prefill and decode (the reference engine):
    ``queued -> prefilling -> decoding -> finished``. Admission, streaming, cancellation, timeouts,
    retries before anything was streamed and instance failover are ``Router``'s; placement is one
    least-loaded pick, and the instance's first delta for a request carries its first token."""

    kv_transfer = False

    def __init__(self, instances: list[Instance], max_concurrent: int, max_queue: int, request_timeout_s: float = 600.0,
                 restart=None, check_ranks=None, metrics: ServingMetrics | None = None):
        # the instances stand where decode instances do: each holds its requests' KV until they end
        super().__init__([], instances, max_concurrent, max_queue, request_timeout_s, restart, check_ranks, metrics)

    async def _place(self, active: _Active) -> None:
        rid = active.record.request_id
        inst = self._least_loaded(self.decode)
        if inst is None:
            raise RouterError("UNAVAILABLE", "no colocated instance is alive")
        active.decode = inst
        inst.assigned.add(rid)
        await self._submit(active, inst, ColocatedRequest(rid, tuple(active.prompt_ids), active.params))

    def _on_delta(self, active: _Active, delta: TokenDelta) -> Delta | None:
        if active.record.state is RequestState.PREFILLING:  # the first token: prefill is done
            active.record.to(RequestState.DECODING)
            active.first_token_at = active.last_token_at = time.perf_counter()
            if self.metrics is not None:
                self.metrics.first_token(active.first_token_at - active.arrival)
        return super()._on_delta(active, delta)
