"""The router's side of live migration: one decision point per migration (commit when the destination
reports the request arrived, abort on any failure before), the global rescheduling policy's rounds, and
draining a decode instance. The decode workers' side is ``decode_worker/live_migration.py``; the policy
(where to move what) is ``controller/migration_policy.py``; tokens stream in order across the hand-over
(``controller/streaming.py``)."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

from controller.control_calls import ControlCalls
from controller.migration_policy import InstanceLoad, MigrationHistory, PolicyConfig, pick_instance, plan_migrations
from controller.placement import instance_load, record_report
from controller.request_run import MigrationEnded, RequestRun
from controller.request_state import RequestState
from controller.router_context import RouterContext
from controller.routing import Instance, RouterError
from decode_worker.messages import DecodeRequest, MigrationArrived

log = logging.getLogger("magicserve.router")

MIGRATION_TIMEOUT_S = 60.0  # a migration not committed by then is aborted (the request stays on its source)


@dataclass(frozen=True)
class MigrationOutcome:
    """How a migration ended: ``committed`` (the request now decodes on ``destination``) or not, and why."""

    request_id: str
    source: str
    destination: str
    committed: bool
    reason: str = ""
    seconds: float = 0.0
    source_tokens: int = 0  # committed: output tokens the source generated (the destination continues after)


@dataclass(frozen=True)
class DrainOutcome:
    """How a drain ended: ``drained`` (the instance holds no request) or not (timed out), the migrations it
    made, the requests that finished on the instance before they could move, and those it handed back before
    beginning them (placed anew elsewhere)."""

    instance: str
    drained: bool
    migrations: tuple[MigrationOutcome, ...] = ()
    finished_in_place: int = 0
    handed_back: int = 0


@dataclass
class PendingMigration:
    """A migration in progress: its ends, when it started, and its outcome once decided."""

    source: Instance
    destination: Instance
    started: float
    done: asyncio.Future  # MigrationOutcome, once decided


class _Refused(Exception):
    """A migration one of its ends declined to start (the reason is the message)."""


class MigrationCoordinator:
    """Live migrations of one router's requests between its decode instances. ``connect_pair``: an async
    callable(source, destination) forming the migration channel between two decode instances (None: this
    router cannot migrate)."""

    def __init__(self, context: RouterContext, calls: ControlCalls, connect_pair=None):
        self.context = context
        self.calls = calls
        self._connect_pair = connect_pair
        self._pairs: set[tuple] = set()  # (source, destination, their generations) with a formed channel
        self._pair_locks: dict[tuple, asyncio.Lock] = {}
        self.counts = collections.Counter()  # outcomes: committed, aborted
        self.policy = PolicyConfig()  # the global rescheduling policy's thresholds (``configure``)
        self.timeout_s = MIGRATION_TIMEOUT_S
        self._history = MigrationHistory()
        self.every_s: float | None = None  # seconds between policy rounds; None: no automatic moves

    def configure(self, policy: PolicyConfig, timeout_s: float, reschedule_every_s: float | None) -> None:
        """Policy thresholds and timeout for migrations; ``reschedule_every_s``: run a policy round that often
        (None: requests move only through ``migrate`` and ``drain``). Call before the router starts."""
        self.policy = policy
        self.timeout_s = timeout_s
        self.every_s = reschedule_every_s

    @property
    def automatic(self) -> bool:
        return self.every_s is not None and self._connect_pair is not None

    def forget(self, request_id: str) -> None:
        """The request ended: the policy's record of its moves goes."""
        self._history.forget(request_id)

    async def migrate(self, request_id: str, destination: str | None = None,
                      timeout_s: float | None = None) -> MigrationOutcome:
        """Move a decoding request to decode instance ``destination`` while it streams; returns once the
        migration is committed or aborted (an aborted request goes on where it was). Raises RouterError
        (INVALID_ARGUMENT / NOT_FOUND / FAILED_PRECONDITION) when it cannot start. ``destination`` None: the
        freest other decode instance (the policy's pick)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        active = self.context.runs.get(request_id)
        if active is None:
            raise RouterError("NOT_FOUND", f"request_id: {request_id!r} is not running")
        if active.params.num_sequences > 1:
            raise RouterError("FAILED_PRECONDITION", f"request_id: {request_id!r} decodes "
                                                     f"{active.params.num_sequences} sequences sharing their "
                                                     "prompt's KV blocks; such requests do not migrate")
        if destination is None:
            destination = await self._pick_destination(active)
        dst = next((d for d in self.context.decode if d.name == destination), None)
        if dst is None:
            names = ", ".join(d.name for d in self.context.decode) or "none"
            raise RouterError("INVALID_ARGUMENT", f"destination: no decode instance {destination!r} (decode "
                                                  f"instances: {names})")
        src = active.decode
        if active.record.state is not RequestState.DECODING or src is None:
            raise RouterError("FAILED_PRECONDITION", f"request_id: {request_id!r} is {active.record.state.value}, "
                                                     "not decoding")
        if dst is src:
            raise RouterError("INVALID_ARGUMENT", f"destination: {request_id!r} already decodes on {destination}")
        if not src.alive:
            raise RouterError("FAILED_PRECONDITION", f"request_id: {request_id!r} is on {src.name}, which is not alive")
        if not dst.alive or dst.draining:
            raise RouterError("FAILED_PRECONDITION", f"destination: {destination} is "
                                                     f"{'draining' if dst.draining else 'not alive'}")
        if self._connect_pair is None:
            raise RouterError("FAILED_PRECONDITION", "this router cannot form migration channels")
        started = time.perf_counter()
        m = PendingMigration(src, dst, started, asyncio.get_running_loop().create_future())
        active.migration_started(m)
        try:
            await self._start(active, m)
        except Exception as err:  # noqa: BLE001 - an unreachable end or a refusal aborts, never loses the request
            self.abort(active, f"{type(err).__name__}: {err}" if not isinstance(err, _Refused) else str(err),
                                  m)
        try:
            return await asyncio.wait_for(asyncio.shield(m.done), timeout_s)
        except asyncio.TimeoutError:
            self.abort(active, f"not committed within {timeout_s}s", m)
            return m.done.result()

    async def _start(self, active: RequestRun, m: PendingMigration) -> None:
        rid = active.record.request_id
        await self._ensure_pair(m.source, m.destination)
        if m.done.done():
            return
        request = DecodeRequest(rid, tuple(active.prompt_ids), active.params)
        # the source is at least this long (deltas may still be on their way); the destination adds headroom
        capacity = await m.destination.handle.migrate_in.remote(request, len(active.prompt_ids) + active.tokens_streamed)
        if capacity is None:
            raise _Refused(f"{m.destination.name} has no room for the request's KV")
        if m.done.done():  # aborted meanwhile (the request ended): free what was just reserved
            await self.calls.abort_on(m.destination, rid)
            return
        why = await m.source.handle.migrate_out.remote(rid, m.destination.name, capacity)
        if why is not None:
            if "no migration channel" in why:
                self._pairs.discard(self._pair_key(m.source, m.destination))  # formed anew next time
            raise _Refused(why)

    async def _pick_destination(self, active) -> str:
        name = self._destination_for(active, await self.instance_loads(), active.decode)
        if name is None:
            raise RouterError("FAILED_PRECONDITION", "destination: no other decode instance has room for "
                                                     f"{active.record.request_id!r}")
        return name

    def _destination_for(self, active, loads: list[InstanceLoad], source: Instance | None) -> str | None:
        """The policy's pick for the request among the instances other than ``source`` (None: none has room)."""
        rid = active.record.request_id
        blocks = next((r.blocks for ld in loads for r in ld.running if r.request_id == rid), 1)
        others = [ld for ld in loads if source is None or ld.name != source.name]
        return pick_instance(others, blocks, self.policy, active.priority)

    async def instance_loads(self) -> list[InstanceLoad]:
        """The live decode instances' loads as the policy reads them (``controller/placement.py``), each from a
        report asked for now (it also refreshes the one new requests are placed by)."""
        async def report(inst: Instance):
            try:
                return inst, await asyncio.wait_for(inst.handle.request_loads.remote(), 5.0)
            except Exception as err:  # noqa: BLE001 - an instance that does not answer is left out this round
                log.debug("no load report from %s: %s", inst.name, err)
                return inst, None

        loads = []
        for inst, rep in await asyncio.gather(*(report(i) for i in self.context.decode if i.alive)):
            if rep is not None:
                record_report(inst, rep)
                loads.append(instance_load(inst, rep, self.context.runs))
        return loads

    async def reschedule_once(self) -> list[MigrationOutcome]:
        """One round of the global rescheduling policy: read the loads, start the planned migrations and
        wait for their outcomes."""
        now = time.monotonic()
        plans = plan_migrations(await self.instance_loads(), self.policy, now, self._history)
        for p in plans:
            self._history.record(p.request_id, now)
        results = await asyncio.gather(*(self.migrate(p.request_id, p.destination) for p in plans),
                                       return_exceptions=True)
        for p, r in zip(plans, results):
            if isinstance(r, Exception):
                log.debug("planned migration of %s to %s not started: %s", p.request_id, p.destination, r)
        return [r for r in results if isinstance(r, MigrationOutcome)]

    async def reschedule_forever(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.reschedule_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a failed round must not end rescheduling
                log.exception("rescheduling round failed")

    async def drain(self, name: str, timeout_s: float = 600.0, undo: bool = False) -> DrainOutcome:
        """Stop placing requests on decode instance ``name``, place the prompts it has not begun anew elsewhere
        (``ControlCalls.hand_back``) and migrate its requests away (each as soon as it decodes there); returns once
        it holds none, or after ``timeout_s``. ``undo``: back into service."""
        inst = next((d for d in self.context.decode if d.name == name), None)
        if inst is None:
            names = ", ".join(d.name for d in self.context.decode) or "none"
            raise RouterError("INVALID_ARGUMENT", f"instance: no decode instance {name!r} (decode instances: {names})")
        if undo:
            inst.draining = False
            return DrainOutcome(name, False)
        inst.draining = True
        log.warning("draining %s", name)
        # they leave it as their streams place them anew (a colocated instance finishes its queue: no hand-back)
        handed = await self.calls.hand_back(inst) if self.context.kv_transfer else set()
        on_it = self._requests_on(inst) - handed
        outcomes: list[MigrationOutcome] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            here = self._requests_on(inst)
            if not here:
                moved = {o.request_id for o in outcomes if o.committed}
                return DrainOutcome(name, True, tuple(outcomes), len(on_it - moved), len(handed))
            on_it |= here - handed
            # a request of several sequences does not migrate: it finishes where it is
            movable = [rid for rid in here if self.context.runs[rid].record.state is RequestState.DECODING
                       and self.context.runs[rid].migration is None and self.context.runs[rid].params.num_sequences == 1]
            started = []
            loads = await self.instance_loads() if movable else []
            for rid in movable[: max(1, self.policy.max_migrations_per_round)]:
                run = self.context.runs.get(rid)  # it may have finished while the loads were read
                if run is None or run.record.state is not RequestState.DECODING or run.migration is not None:
                    continue
                dst = self._destination_for(run, loads, inst)
                if dst is not None:
                    started.append(self.migrate(rid, dst))
            results = await asyncio.gather(*started, return_exceptions=True)
            outcomes.extend(r for r in results if isinstance(r, MigrationOutcome))
            if not any(isinstance(r, MigrationOutcome) and r.committed for r in results):
                await asyncio.sleep(0.05)  # nothing moved: wait for requests to reach decoding or room to free
        moved = {o.request_id for o in outcomes if o.committed}
        return DrainOutcome(name, False, tuple(outcomes), len(on_it - moved - self._requests_on(inst)), len(handed))

    def _requests_on(self, inst: Instance) -> set[str]:
        return {rid for rid, a in self.context.runs.items() if a.decode is inst and not a.record.state.terminal}

    @staticmethod
    def _pair_key(src: Instance, dst: Instance) -> tuple:
        return src.name, dst.name, src.generation, dst.generation

    async def _ensure_pair(self, src: Instance, dst: Instance) -> None:
        key = self._pair_key(src, dst)
        lock = self._pair_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in self._pairs:
                await self._connect_pair(src, dst)
                self._pairs.add(key)

    def on_arrived(self, inst: Instance, arrived: MigrationArrived) -> None:
        """The destination holds the request's KV and state: commit (the one decision point)."""
        rid = arrived.request_id
        active = self.context.runs.get(rid)
        m = None if active is None else active.migration
        if m is None or m.destination is not inst or m.done.done():
            return  # aborted already: the abort sent to the destination frees its copy
        src, dst = active.migration_committed()
        asyncio.get_running_loop().create_task(self._settle(active, src, dst))
        self.counts["committed"] += 1
        if self.context.metrics is not None:
            self.context.metrics.migration(True)
        m.done.set_result(MigrationOutcome(rid, src.name, dst.name, True, seconds=time.perf_counter() - m.started,
                                           source_tokens=arrived.num_output_tokens))
        active.tell(MigrationEnded())

    async def _settle(self, active: RequestRun, src: Instance, dst: Instance) -> None:
        """Tell both ends of a committed migration: the destination decodes the request from its next step,
        the source frees its copy. A destination that fails its commit does not decode the request: it
        continues elsewhere (``Router.recover``); a source that fails to free its copy is told to abort it."""
        rid = active.record.request_id
        committed, finished = await asyncio.gather(self.calls.call(dst, "commit_migration", rid),
                                                   self.calls.call(src, "finish_migration", rid))
        if not finished and src.alive:
            await self.calls.abort_on(src, rid)
        if not committed:
            self.calls.recover(active, dst, f"{dst.name} did not start the migrated request (commit_migration failed)")

    async def _resume_at_source(self, active: RequestRun, src: Instance) -> None:
        """An aborted migration's source takes the request back (it may have stopped it for the last copy); one
        that fails to does not decode it: it continues elsewhere (``Router.recover``)."""
        rid = active.record.request_id
        if not await self.calls.call(src, "abort_migration", rid):
            self.calls.recover(active, src, f"{src.name} did not take the request back (abort_migration failed)")

    def abort(self, active: RequestRun, reason: str, m: PendingMigration | None = None) -> None:
        """Abort the request's undecided migration: it goes on at its source; the destination frees its copy."""
        m = m or active.migration
        if m is None or m.done.done():
            return
        rid = active.record.request_id
        active.migration_dropped(m)
        loop = asyncio.get_running_loop()
        if m.destination.alive:
            loop.create_task(self.calls.abort_on(m.destination, rid))
        if m.source.alive:
            loop.create_task(self._resume_at_source(active, m.source))
        self.counts["aborted"] += 1
        if self.context.metrics is not None:
            self.context.metrics.migration(False)
        log.info("migration of %s from %s to %s aborted: %s", rid, m.source.name, m.destination.name, reason)
        m.done.set_result(MigrationOutcome(rid, m.source.name, m.destination.name, False, reason,
                                           time.perf_counter() - m.started))
        active.tell(MigrationEnded())


