"""Control calls about one request to one instance (abort, commit, finish, ...), each checked: a call that
raised, timed out, or answered False where it must succeed is counted against the instance and logged, and the
request it concerned is recovered (``ControlCalls.recover``). No torch."""

from __future__ import annotations

import asyncio
import collections
import logging

from controller.request_run import RequestRun, RunFailed, RunHandedBack
from controller.router_context import RouterContext
from controller.routing import Instance

log = logging.getLogger("magicserve.router")

CALL_TIMEOUT_S = 30.0  # a control call (abort, commit, finish) not answered by then has failed
# control calls whose False answer means the instance does not hold the request as the router does
_MUST_HOLD = frozenset({"commit_migration", "finish_migration"})


class ControlCalls:
    """The router's checked calls to its instances; ``failures``: (instance name, call) -> calls that failed."""

    def __init__(self, context: RouterContext):
        self.context = context
        self.failures = collections.Counter()

    async def call(self, inst: Instance, method: str, rid: str) -> bool:
        """``inst.method(rid)``; False when it failed: it raised, was not answered within ``CALL_TIMEOUT_S``, or
        answered False to a call that must succeed (``commit_migration``, ``finish_migration``). A failure is
        counted and logged (``failed``); the caller recovers the request (``recover``)."""
        try:
            result = await asyncio.wait_for(getattr(inst.handle, method).remote(rid), CALL_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self.failed(inst, method, rid, err)
            return False
        if result is False and method in _MUST_HOLD:
            self.failed(inst, method, rid, "answered False: the request is not there as the router holds it")
            return False
        return True

    async def abort_on(self, inst: Instance, rid: str) -> bool:
        return await self.call(inst, "abort", rid)

    async def lets_go(self, prefill: Instance, rid: str) -> bool:
        """Ask ``prefill`` to drop a prompt it took; False when it keeps it (its transfer is under way)."""
        try:
            return await asyncio.wait_for(prefill.handle.abort.remote(rid), CALL_TIMEOUT_S) is not False
        except asyncio.CancelledError:
            raise
        except Exception as err:  # gone: its death is handled as any instance's
            self.failed(prefill, "abort", rid, err)
            return True

    async def hand_back(self, inst: Instance) -> set[str]:
        """Draining ``inst`` gives up the requests it has not begun (prompts waiting in its queue, freed there):
        each run is told, and runs from the start elsewhere (``Recovery.handed_back``) rather than wait for it.
        Their ids; none when the call failed (the drain then waits for them as for the rest)."""
        try:
            ids = list(await asyncio.wait_for(inst.handle.hand_back.remote(), CALL_TIMEOUT_S))
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self.failed(inst, "hand_back", "-", err)
            return set()
        for rid in ids:
            self.context.load_aware.forget(inst.name, rid)
            self.context.send(rid, RunHandedBack(inst))
        return set(ids)

    def failed(self, inst: Instance, method: str, rid: str, error, run: RequestRun | None = None) -> None:
        """A call to ``inst`` about request ``rid`` failed: counted (``failures``, the metrics), logged as a
        WARNING naming the instance, the call and the error; with ``run``, the request avoids ``inst`` from now on
        while another instance can take it."""
        self.failures[(inst.name, method)] += 1
        if self.context.metrics is not None:
            self.context.metrics.call_failed(inst.name, method)
        if run is not None:
            run.avoid.add(inst.name)
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}".rstrip(": ")
        log.warning("%s %s: %s(%s) failed: %s", inst.role, inst.name, method, rid, why)

    def recover(self, run: RequestRun, inst: Instance, reason: str) -> None:
        """A call failed on ``inst``, which holds the request (it did not take it, or kept it stopped): the request
        continues elsewhere as when an instance dies (resumed from what it streamed, or run again when nothing
        was), and avoids ``inst``. Nothing to do when the request ended or has left ``inst`` already."""
        if self.context.runs.get(run.request_id) is not run or run.state.terminal or not run.left(inst):
            return
        run.tell(RunFailed(reason, True))
