"""The request router: admission, the pools, and the parts a request passes through.

One request, end to end (``Router.generate``): admitted (bounded concurrency, bounded queue), it becomes a
``RequestRun`` (``controller/request_run.py``: its state machine, placement, output order and timings, fed typed
events) -> placed (``controller/placer.py``): the decode instance that holds its KV and the prefill instance
that computes its prompt -> streamed (``controller/streaming.py``): the instances' outputs, polled by
``controller/instance_watch.py``, become the run's events and the client's deltas. Failures are recovered
(``controller/recovery.py``: run again before output went out, resumed on another instance after); every control
call is checked (``controller/control_calls.py``). A decoding request may move to another decode instance
while it streams (live migration: ``controller/migrations.py``). The parts share one ``RouterContext``
(``controller/router_context.py``); none imports this module.

``ColocatedRouter`` (``controller/colocated_router.py``) serves the same API from colocated instances.

Nothing is dropped silently: every request ends in finished, failed or cancelled, and the counters say how many
are where.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import AsyncIterator

from controller.admission import PriorityGate
from controller.control_calls import ControlCalls
from controller.instance_watch import InstanceWatch
from controller.kv_index import PrefixRouting
from controller.metrics import ServingMetrics
from controller.migrations import MigrationCoordinator
from controller.placer import Placer
from controller.recovery import Recovery
from controller.request_run import RequestRun, RunCancelled
from controller.request_state import RequestRecord, RequestState, StateCounters
from controller.router_context import RouterContext
from controller.routing import Delta, Final, Instance, RouterError
from controller.streaming import Streaming
from modeling.params import SamplingParams

log = logging.getLogger("magicserve.router")


class Router:
    """Routes requests over the prefill and decode instances (asyncio; one per controller).

    ``restart``: async callable(instance) replacing a dead instance as a whole (every rank, its channels
    re-formed; raises when it cannot); ``check_ranks``: async callable(instance) raising when a rank the polls
    do not reach died or hung; ``connect_pair``: async callable(source, destination) forming the migration
    channel between two decode instances."""

    kv_transfer = True  # requests go prefilling -> transferring -> decoding
    placer_class = Placer

    def __init__(self, prefill: list[Instance], decode: list[Instance], max_concurrent: int, max_queue: int,
                 request_timeout_s: float = 600.0, restart=None, check_ranks=None,
                 metrics: ServingMetrics | None = None, connect_pair=None,
                 prefix_routing: PrefixRouting = PrefixRouting()):
        self.context = RouterContext(prefill, decode, request_timeout_s, self.kv_transfer, metrics, prefix_routing)
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.counters = StateCounters()
        self.calls = ControlCalls(self.context)
        self.migrations = MigrationCoordinator(self.context, self.calls, connect_pair)
        self.placer = self.placer_class(self.context, self.calls, lambda: self.migrations.policy)
        self.recovery = Recovery(self.context, self.calls, self.placer, self.migrations, restart)
        self.streaming = Streaming(self.context, self.recovery)
        self.watch = InstanceWatch(self.context, self.recovery, self.migrations, check_ranks)
        self._slots = PriorityGate(max_concurrent)
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []

    # -- what the fronts, the scaler and the status read --------------------------------------------------

    @property
    def prefill(self) -> list[Instance]:
        return self.context.prefill

    @property
    def decode(self) -> list[Instance]:
        return self.context.decode

    @property
    def instances(self) -> list[Instance]:
        return self.context.instances

    @property
    def active(self) -> dict[str, RequestRun]:
        return self.context.runs

    @property
    def metrics(self) -> ServingMetrics | None:
        return self.context.metrics

    @property
    def kv_index(self):
        return self.context.kv_index

    @property
    def prefix_routing(self) -> PrefixRouting:
        return self.context.prefix_routing

    @property
    def request_timeout_s(self) -> float:
        return self.context.request_timeout_s

    @property
    def call_failures(self):
        """(instance name, call) -> control calls to it that failed."""
        return self.calls.failures

    @property
    def load_window(self):
        """The online planner's ``LoadWindow`` (None: it does not run): told of every request admitted."""
        return self.context.load_window

    @load_window.setter
    def load_window(self, window) -> None:
        self.context.load_window = window

    def queue_stats(self) -> dict:
        return {"waiting": self._slots.waiting, "active": len(self.active), "states": self.counters.snapshot()}

    # -- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        for inst in self.instances:
            self.watch.watch(inst)
        if self.migrations.automatic:
            self._tasks.append(asyncio.get_running_loop().create_task(self.migrations.reschedule_forever()))

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let in-flight ones finish (up to the timeout), then stop polling."""
        self.context.closing = True
        deadline = time.monotonic() + drain_timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.active):
            self.cancel(rid)
        for t in self._tasks:
            t.cancel()
        self.watch.stop()

    # -- pools ---------------------------------------------------------------------------------------------

    def add_instance(self, inst: Instance) -> None:
        """A new instance (its ranks up, its KV channels formed) joins its pool and takes requests."""
        self.context.pool_of(inst).append(inst)
        self.instances.append(inst)
        self.watch.watch(inst)
        log.warning("%s %s joined", inst.role, inst.name)

    async def retire(self, inst: Instance, timeout_s: float = 600.0) -> int:
        """Take ``inst`` out of its pool without losing a request: it gets no new ones; the prompts it has not
        begun are placed anew elsewhere; a decode instance moves its running requests away by live migration (a
        request that cannot move, one of several sequences or still prefilling, finishes there), a prefill
        instance finishes the prompts it has begun. Then it is no longer polled, and the caller stops its actors.
        Returns how many requests it handed back. Raises RouterError (the instance back in service) when it
        still holds requests after ``timeout_s`` or is the last alive instance of a pool other than prefill (the
        bounds say whether the prefill pool may empty)."""
        pool = self.context.pool_of(inst)
        if inst not in pool:
            raise RouterError("INVALID_ARGUMENT", f"instance: {inst.name} is not in the {inst.role} pool")
        if inst.role != "prefill" and not any(i.alive and not i.draining for i in pool if i is not inst):
            raise RouterError("FAILED_PRECONDITION", f"{inst.name} is the last {inst.role} instance in service")
        handed = await self._drain(inst, timeout_s)  # the prefill pool may empty: decode instances then prefill
        pool.remove(inst)
        self.instances.remove(inst)
        self.watch.unwatch(inst)
        self.kv_index.drop(inst.name)
        log.warning("%s %s left", inst.role, inst.name)
        return handed

    async def switch(self, inst: Instance, role: str, become, timeout_s: float = 600.0) -> int:
        """Move ``inst`` to pool ``role`` without losing a request: drained as ``retire`` drains it (it gets no
        new requests; the prompts it has not begun are placed anew elsewhere, a decode instance's running
        requests move away by live migration, a prefill instance finishes the prompts it has begun), then
        ``become(inst, role)`` (``Cluster.switch_role``: its worker changes role and its KV channels form), then it
        takes requests in its new pool. The decode pool keeps an instance in service; the prefill pool may empty
        (decode instances then prefill every prompt themselves). Returns how many requests it handed back.
        Raises RouterError with the instance back in its pool when it could not drain or its worker did not
        switch."""
        ctx, pool = self.context, self.context.pool_of(inst)
        if inst not in pool or role == inst.role or role not in ("prefill", "decode"):
            raise RouterError("INVALID_ARGUMENT", f"instance: {inst.name} is a {inst.role} instance; it can "
                                                  f"become a {'decode' if inst.role == 'prefill' else 'prefill'} one")
        if inst.role == "decode" and not any(i.alive and not i.draining for i in pool if i is not inst):
            raise RouterError("FAILED_PRECONDITION", f"{inst.name} is the last decode instance in service")
        handed = await self._drain(inst, timeout_s)
        old = inst.role
        try:
            await become(inst, role)
        finally:
            if inst.role == old:  # the worker did not switch: back in service where it was
                inst.draining = False
            else:  # its new pool, whatever its channels' formation gave
                pool.remove(inst)
                self.kv_index.drop(inst.name)  # the new worker's first report lists what its tiers hold
                inst.load, inst.placed, inst.room, inst.draining = None, {}, True, False
                ctx.pool_of(inst).append(inst)
                log.warning("%s is a %s instance now", inst.name, inst.role)
        return handed

    async def _drain(self, inst: Instance, timeout_s: float) -> int:
        """Stop sending ``inst`` requests and wait until it holds none: the requests it has not begun are placed
        anew elsewhere (``ControlCalls.hand_back``), a decode instance's running ones move away by live
        migration, the rest finish there. Returns how many it handed back; raises RouterError, the instance back
        in service, after ``timeout_s``."""
        ctx = self.context
        inst.draining = True
        start = time.monotonic()
        deadline = start + timeout_s
        try:
            # a decode instance's drain (``MigrationCoordinator.drain``) hands back its own
            handed = len(await self.calls.hand_back(inst)) if self.kv_transfer and inst.role == "prefill" else 0
            while ctx.held_by(inst):
                if time.monotonic() > deadline:
                    raise RouterError("DEADLINE_EXCEEDED", f"{inst.name} still holds {len(ctx.held_by(inst))} "
                                      f"requests after {timeout_s:g} s")
                if inst.role == "decode":
                    outcome = await self.migrations.drain(inst.name, max(0.1, deadline - time.monotonic()))
                    handed += outcome.handed_back
                else:
                    await asyncio.sleep(0.05)
        except BaseException:
            inst.draining = False
            raise
        log.warning("%s %s drained in %.1f s (prompts handed back: %d)", inst.role, inst.name,
                    time.monotonic() - start, handed)
        return handed

    # -- requests ------------------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}-{int(time.time() * 1000) % 100000}"

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[Delta | Final]:
        """Serve one request: yields Delta messages, then one Final. Raises RouterError. ``priority``: higher is
        admitted first when requests queue, and (with migration on) keeps headroom on its decode instance and is
        the last to be moved."""
        arrival = time.perf_counter()  # before admission: the TTFT reported includes any wait for a slot
        try:
            if self.context.closing:
                raise RouterError("UNAVAILABLE", "server is shutting down")
            if request_id in self.active:
                raise RouterError("ALREADY_EXISTS", f"request_id: {request_id!r} is already running")
            await self._admit(priority)
        except RouterError as err:  # refused before it began: counted, nothing to release
            if self.metrics is not None:
                self.metrics.failed(err.code)
            raise
        run = RequestRun(RequestRecord(request_id, self.counters, self.kv_transfer), list(prompt_ids), params,
                         arrival, priority)
        self.active[request_id] = run
        if self.load_window is not None:
            self.load_window.admitted(request_id, len(prompt_ids))
        try:
            await self.placer.place(run)
            async for item in self.streaming.stream(run):
                yield item
        except asyncio.CancelledError:
            self.recovery.cancel(run, "client cancelled")
            raise
        except RouterError as err:
            run.end(RequestState.FAILED, str(err))
            if self.metrics is not None:
                self.metrics.failed(err.code)
            raise
        finally:
            self._release(run)

    def cancel(self, request_id: str) -> bool:
        """Cancel a running request everywhere (frees its KV on both workers)."""
        run = self.active.get(request_id)
        if run is None:
            return False
        self.recovery.cancel(run, "cancelled")
        run.tell(RunCancelled())
        return True

    async def _admit(self, priority: int) -> None:
        waiting = self._slots.waiting
        if self._slots.locked() and waiting >= self.max_queue:
            raise RouterError("RESOURCE_EXHAUSTED",
                              f"{self.max_concurrent} requests running and {waiting} queued (limit {self.max_queue})")
        await self._slots.acquire(priority)

    def _release(self, run: RequestRun) -> None:
        if run.migration is not None:  # ended while migrating: the destination's copy goes too
            self.migrations.abort(run, "the request ended on its source")
        if not run.state.terminal:
            self.recovery.cancel(run, "stream closed")
        run.released(self.instances)
        self.active.pop(run.request_id, None)
        self.migrations.forget(run.request_id)
        self._slots.release()
