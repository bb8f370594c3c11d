"""What happens to requests when something fails (no torch, no Ray): a failure before anything was streamed
runs the request again elsewhere (up to ``MAX_RETRIES``); after output went out the request resumes on another
decode instance from the tokens streamed; a dead instance fails over its requests and is brought back as a whole.
Nothing is dropped silently: a request that cannot go on fails with UNAVAILABLE."""

from __future__ import annotations

import asyncio
import logging
import time

from controller.control_calls import ControlCalls
from controller.placer import Placer
from controller.request_run import RequestRun, RunFailed
from controller.request_state import RequestState
from controller.router_context import PLACEMENT_RETRY_S, RouterContext
from controller.routing import Instance, RouterError

log = logging.getLogger("magicserve.router")

MAX_RETRIES = 3


class Recovery:
    """Retries, resumes, cancellations and instance failover for one router. ``migrations``: the router's
    ``MigrationCoordinator`` (a migration under way is aborted before its request moves); ``restart``: async
    callable(instance) replacing a dead instance as a whole (None: a dead instance stays out of service)."""

    def __init__(self, context: RouterContext, calls: ControlCalls, placer: Placer, migrations, restart=None):
        self.context = context
        self.calls = calls
        self.placer = placer
        self.migrations = migrations
        self._restart = restart

    async def retry_or_fail(self, run: RequestRun, reason: str) -> None:
        """Run the request again from the start elsewhere; raises RouterError UNAVAILABLE after ``MAX_RETRIES``."""
        await self._run_again(run, reason, retry=True)

    async def handed_back(self, run: RequestRun, source: Instance) -> None:
        """``source``, draining, gave the request up before computing any of it: it runs from the start
        elsewhere, not counted as a retry (nothing failed). Nothing to do once it has left ``source`` or streamed
        output (it was handed back too late: it goes on where it is)."""
        if run.state.terminal or run.tokens_streamed or (source is not run.prefill and source is not run.decode):
            return
        if self.context.metrics is not None:
            self.context.metrics.handed_back()
        await self._run_again(run, f"{source.role} {source.name} handed it back while draining", retry=False)

    async def _run_again(self, run: RequestRun, reason: str, retry: bool) -> None:
        # the aborts complete before any instance is asked to take it again under the same id
        await asyncio.gather(*self._detach(run))
        if retry and run.record.retries >= MAX_RETRIES:
            raise RouterError("UNAVAILABLE", f"request {run.request_id} failed after {MAX_RETRIES} retries: {reason}")
        run.restart(reason, retry)
        await self.placer.place(run)

    async def resume(self, run: RequestRun, reason: str) -> None:
        """Continue a request on an alive decode instance from its prompt and the tokens the client has received
        (the grammar, the text state and, seeded, the generator follow them): its stream goes on where it stood,
        and greedy output is the undisturbed run's. Waits for room up to the request's timeout; raises RouterError
        when no decode instance can take it."""
        ctx, rid = self.context, run.request_id
        log.warning("resuming %s on another instance: %s", rid, reason)
        if run.migration is not None:
            self.migrations.abort(run, reason)
        # the aborts complete before any instance is asked to take it again under the same id
        await asyncio.gather(*self._detach(run))
        request = run.resume_request()
        deadline = time.monotonic() + ctx.request_timeout_s
        while True:
            cached = {i.name: ctx.cached(run, i) for i in ctx.decode}
            inst = await self.placer.reserve_decode(run, request, self.placer.decode_order(run, cached)[0],
                                                    "add_resume")
            if inst is not None:
                run.place(inst, tokens=sum(len(run.prompt_ids) + len(s.output_ids) for s in request.sequences))
                if ctx.metrics is not None:
                    ctx.metrics.resumed()
                return
            if time.monotonic() > deadline:
                raise RouterError("UNAVAILABLE", f"request {rid} could not continue: no decode instance took it "
                                  f"({reason})")
            await asyncio.sleep(PLACEMENT_RETRY_S * 10)

    def cancel(self, run: RequestRun, reason: str) -> None:
        """End the request as cancelled and free it on its instances."""
        if not run.state.terminal:
            self.cancel_on_workers(run)
            run.end(RequestState.CANCELLED, reason)

    def cancel_on_workers(self, run: RequestRun) -> None:
        loop = asyncio.get_running_loop()
        for abort in self._detach(run):
            loop.create_task(abort)

    def _detach(self, run: RequestRun) -> list:
        """The aborts to send the alive instances the request leaves."""
        return [self.calls.abort_on(inst, run.request_id) for inst in run.detach()]

    def fail_instance(self, inst: Instance, reason: str) -> None:
        """Take the instance out of service and fail its requests (retryable while nothing has streamed: the
        stream decides); migrations into it abort, their requests staying where they are."""
        if not inst.alive:
            return
        inst.alive = False
        self.context.kv_index.drop(inst.name)
        log.error("%s", reason)
        for rid in list(inst.assigned):
            self.context.send(rid, RunFailed(reason, True))
        for rid in list(inst.migrating_in):
            run = self.context.runs.get(rid)
            if run is not None and run.migration is not None:
                self.migrations.abort(run, reason)
        inst.assigned.clear()  # the requests it held are failed over: it counts none of them
        inst.migrating_in.clear()

    async def instance_down(self, inst: Instance, reason: str) -> bool:
        """Fail over the instance's requests and bring it back as a whole; False when it stays out of service (no
        restart hook, or the restart failed)."""
        self.fail_instance(inst, reason)
        if self._restart is None or self.context.closing:
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
