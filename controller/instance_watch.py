"""Polling the instances (no torch): each instance's outputs become its requests' events, its load reports and
prefix-cache events go to placement and the prefix index, and a dead, crashed or rank-losing instance is failed
over and restarted (``controller/recovery.py``)."""

from __future__ import annotations

import asyncio
import time

from controller.actor_messages import WorkerCrashed
from controller.placement import record_report
from controller.recovery import Recovery
from controller.request_run import FirstTokenArrived, OutputArrived, RunFailed
from controller.router_context import RouterContext
from controller.routing import Instance
from decode_worker.messages import DecodeFailure, MigrationArrived, MigrationFailed, PoolLoad, TokenDelta
from modeling.prefix_cache import PrefixCacheEvents
from prefill_worker.messages import PrefillStepOutput

RANK_CHECK_PERIOD_S = 1.0  # how often an instance's other ranks are checked (``check_ranks``)


class InstanceWatch:
    """One polling task per instance. ``migrations``: the router's ``MigrationCoordinator`` (told of arrivals
    and failures); ``check_ranks``: async callable(instance) raising when a rank the polls do not reach (a
    tensor-parallel follower) died or hung (None: not checked)."""

    def __init__(self, context: RouterContext, recovery: Recovery, migrations, check_ranks=None):
        self.context = context
        self.recovery = recovery
        self.migrations = migrations
        self._check_ranks = check_ranks
        self._polls: dict[str, asyncio.Task] = {}  # instance name -> its polling task

    def watch(self, inst: Instance) -> None:
        self._polls[inst.name] = asyncio.get_running_loop().create_task(self._poll(inst))

    def unwatch(self, inst: Instance) -> None:
        task = self._polls.pop(inst.name, None)
        if task is not None:
            task.cancel()

    def stop(self) -> None:
        for task in self._polls.values():
            task.cancel()

    async def _poll(self, inst: Instance) -> None:
        next_check = time.monotonic() + RANK_CHECK_PERIOD_S
        while True:
            try:
                items = await inst.handle.poll.remote(0.05)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                if not await self.recovery.instance_down(inst, f"{inst.role} {inst.name} died: {type(err).__name__}"):
                    return
                continue
            for item in items:
                self.dispatch(inst, item)
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
            if reason is not None and not await self.recovery.instance_down(inst, reason):
                return

    def dispatch(self, inst: Instance, item) -> None:
        """Route one item an instance reported."""
        ctx = self.context
        if isinstance(item, PrefillStepOutput):
            ctx.load_aware.observe_prefill(inst.name, item.tokens_computed, item.compute_s)
            for ft in item.first_tokens:
                ctx.send(ft.request_id, FirstTokenArrived(ft))
            for rid in item.transferred:  # the decode instance holds its KV now
                run = ctx.runs.get(rid)
                if run is not None:
                    run.handed_off(inst)
            for f in item.failed:  # the instance holds the prompt no more
                run = ctx.runs.get(f.request_id)
                if run is not None:
                    run.handed_off(inst)
                ctx.send(f.request_id, RunFailed(f.reason, f.retryable))
            for rid in item.ahead_ended:
                ctx.prefill_ahead.ended(inst.name, rid)
        elif isinstance(item, TokenDelta):
            ctx.send(item.request_id, OutputArrived(item, inst))
        elif isinstance(item, PoolLoad):
            record_report(inst, item)
        elif isinstance(item, PrefixCacheEvents):
            ctx.kv_index.apply(inst.name, item)
        elif isinstance(item, MigrationArrived):
            self.migrations.on_arrived(inst, item)
        elif isinstance(item, MigrationFailed):
            run = ctx.runs.get(item.request_id)
            m = None if run is None else run.migration
            if m is not None and inst in (m.source, m.destination):
                self.migrations.abort(run, f"{inst.name}: {item.reason}")
        elif isinstance(item, DecodeFailure):
            ctx.send(item.request_id, RunFailed(item.reason, item.retryable))
        elif isinstance(item, WorkerCrashed):  # its loop stopped: nothing it holds will progress
            self.recovery.fail_instance(inst, f"{inst.role} {inst.name} crashed")  # _poll restarts it
