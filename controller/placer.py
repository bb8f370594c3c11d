"""Where a request runs: the decode instance that holds its KV and the prefill instance that computes its prompt
(no torch, no Ray).

``Placer.place`` hands the request to a decode instance (which reserves its KV) and the prompt to a prefill
instance: both at once when the decode instance is thought to have room (its last hold succeeded, or a request
has left it since), else the decode instance first, waiting for one with room (back-pressure: KV frees up as
requests finish), while an idle prefill instance may compute its prompt ahead (``controller/prefill_ahead.py``).
A request whose decode instance holds all its prompt cached but a short suffix is prefilled there alone
(``prefix_caching.local_prefill_tokens``), and so is every request while no prefill instance is in service. A
request that generates nothing (``max_tokens`` 0: its prompt is scored) goes to a prefill instance alone. The
order of the decode instances is the rescheduling policy's (``controller/placement.py``), by the load each pushes
and the prefix each holds cached (``controller/kv_index.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from controller.control_calls import ControlCalls
from controller.kv_index import Cached, blocks_of, cheapest
from controller.load_aware import OFF, REFUSED, DecodeOption, Decision, decide, prefill_ttft_s
from controller.placement import decode_order
from controller.request_run import RequestRun, RunFailed
from controller.request_state import RequestState
from controller.router_context import PLACEMENT_RETRY_S, RouterContext
from controller.routing import Instance, RouterError
from decode_worker.messages import DecodeRequest
from modeling.params import SamplingParams
from prefill_worker.messages import KVDestination, PrefillRequest

log = logging.getLogger("magicserve.router")


class Placer:
    """Places requests over the context's pools. ``policy``: the rescheduling policy's thresholds now (the
    migration coordinator's, which a configuration may replace)."""

    def __init__(self, context: RouterContext, calls: ControlCalls, policy: Callable):
        self.context = context
        self.calls = calls
        self._policy = policy

    async def place(self, run: RequestRun) -> None:
        """Place ``run`` (see the module doc)."""
        ctx, rid = self.context, run.request_id
        if run.params.max_tokens == 0:
            prefill = await self.wait_for(run, ctx.prefill, "prefill")
            run.place_on_prefill(prefill)
            await self.submit(run, prefill, PrefillRequest(rid, tuple(run.prompt_ids), run.params, None))
            return
        request = DecodeRequest(rid, tuple(run.prompt_ids), run.params)
        cached = {i.name: ctx.cached(run, i) for i in ctx.decode}
        order, has_room = self.decode_order(run, cached)
        first = order[0] if order and has_room and order[0].room else None
        if first is not None and self._prefills_there(run, cached[first.name].tokens) and \
                await self._hold_prefill(run, request, first):
            if ctx.load_window is not None:  # no prefill instance computes any of it
                ctx.load_window.cached(rid, len(run.prompt_ids) - 1)
            return
        prefill = self.cheapest(run, ctx.prefill)
        if prefill is None:
            await self._place_without_prefill(run, request)
            return
        if await self._prefill_on_decode(run, request, prefill, order, cached):
            return
        if first is not None and await self._place_at_once(run, request, prefill, first):
            return
        decode = await self._wait_for_room(run, request, lambda: self.decode_order(run, cached)[0], compute_ahead=True)
        prefill = self.cheapest(run, ctx.prefill)
        if prefill is None:
            await self.calls.abort_on(decode, rid)
            await self._place_without_prefill(run, request)
            return
        run.place(decode, prefill)
        await self.submit(run, prefill, self._prefill_request(run, decode))

    async def _prefill_on_decode(self, run: RequestRun, request: DecodeRequest, prefill: Instance,
                                 order: list[Instance], cached: dict[str, Cached]) -> bool:
        """Load-aware disaggregation (``controller/load_aware.py``): True when a decode instance holds the
        request to prefill it beside its decoding batch, because ``prefill`` would miss the TTFT target and that
        instance's TPOT slack computes the prompt sooner, or the prompt misses the SLO wherever it goes and
        comes sooner there, in its late lane; False: the prefill pool computes it (``run.late``: in its late
        lane)."""
        ctx, rid, la = self.context, run.request_id, self.context.load_aware
        n = len(run.prompt_ids)
        run.late = False
        if not la.policy.enabled or run.params.prompt_logprobs is not None:
            self._decided(Decision(None, OFF))
            return False
        queued = [ctx.runs[r] for r in prefill.assigned
                  if r in ctx.runs and ctx.runs[r].state in (RequestState.QUEUED, RequestState.PREFILLING)]
        on_time = sum(q.prefill_tokens for q in queued if not q.late)
        rate = la.rates.get(prefill.name)
        options = [DecodeOption(i.name, n - cached[i.name].tokens,
                                i.load.prefill_queued_tokens + la.placed_since_report(i.name, i.load.holds, ctx.runs),
                                i.load.prefill_tokens_per_s)
                   for i in order if i.load is not None and i.room and i.name in cached]
        decision = decide(la.policy, prefill_ttft_s(on_time, run.prefill_tokens, rate), options,
                          prefill_ttft_s(sum(q.prefill_tokens for q in queued), run.prefill_tokens, rate))
        run.late = decision.late  # in the late lane of whichever instance computes it
        if decision.decode is None:
            self._decided(decision)
            return False
        inst = next(i for i in order if i.name == decision.decode)
        la.placing(inst.name, rid, n - cached[inst.name].tokens)
        if not await self._hold_prefill(run, request, inst, decision.late):
            la.forget(inst.name, rid)
            self._decided(Decision(None, REFUSED, decision.prefill_ttft_s, decision.decode_ttft_s))
            return False
        self._decided(decision)
        log.info("%s: the prefill pool would take %.2f s to its first token, %s %.2f s: prefilled on %s%s", rid,
                 decision.prefill_ttft_s, inst.name, decision.decode_ttft_s, inst.name,
                 " (late: after the prompts that can still meet the SLO)" if decision.late else "")
        if ctx.load_window is not None:
            ctx.load_window.cached(rid, cached[inst.name].tokens)
        return True

    def _decided(self, decision: Decision) -> None:
        """Count a load-aware decision (``magicserve status``, ``/metrics``)."""
        self.context.load_aware.count(decision)
        if self.context.metrics is not None:
            self.context.metrics.load_aware("decode" if decision.decode else "prefill", decision.reason)

    async def _place_without_prefill(self, run: RequestRun, request: DecodeRequest) -> None:
        """No prefill instance is in service (each dead, restarting or draining): a decode instance prefills the
        request (``add_prefill``: from its longest cached prefix, the whole prompt when none). A request that
        needs a prefill instance (its prompt's log-probabilities), or that no decode instance has room for,
        waits for a prefill instance to come back, up to the request's timeout."""
        ctx, rid = self.context, run.request_id
        deadline = time.monotonic() + ctx.request_timeout_s
        while True:
            if run.params.prompt_logprobs is None:
                cached = {i.name: ctx.cached(run, i) for i in ctx.decode}
                for inst in self.decode_order(run, cached)[0]:
                    if await self._hold_prefill(run, request, inst):
                        log.info("%s: no prefill instance in service; prefilled on %s", rid, inst.name)
                        if ctx.load_window is not None:
                            ctx.load_window.cached(rid, cached[inst.name].tokens)
                        return
            if ctx.in_service(ctx.prefill):
                await self.place(run)
                return
            if time.monotonic() > deadline:
                raise RouterError("UNAVAILABLE", f"no prefill instance came back within {ctx.request_timeout_s:g} s "
                                  "and no decode instance could prefill the request")
            await asyncio.sleep(PLACEMENT_RETRY_S * 10)

    async def wait_for(self, run: RequestRun, pool: list[Instance], role: str) -> Instance:
        """The instance of ``pool`` to compute the prompt (``cheapest``), waiting up to the request's timeout for
        one to be in service (a restart). Raises RouterError UNAVAILABLE when none is."""
        deadline = time.monotonic() + self.context.request_timeout_s
        while (inst := self.cheapest(run, pool)) is None:
            if time.monotonic() > deadline:
                raise RouterError("UNAVAILABLE", f"no {role} instance came back within "
                                  f"{self.context.request_timeout_s:g} s")
            await asyncio.sleep(PLACEMENT_RETRY_S * 10)
        return inst

    def _prefills_there(self, run: RequestRun, cached: int) -> bool:
        """Whether a decode instance holding ``cached`` prompt tokens (in its pool or its tiers) prefills the rest
        itself: a cache hit leaving at most ``local_prefill_tokens`` to compute, for a request that needs nothing
        only a prefill instance gives (the prompt's log-probabilities)."""
        missing = len(run.prompt_ids) - cached
        return cached > 0 and missing <= self.context.prefix_routing.local_prefill_tokens and \
            run.params.prompt_logprobs is None

    def _prefilled_on_decode(self, run: RequestRun) -> bool:
        """Whether a decode instance holds enough of the prompt to prefill the rest itself, once it has room."""
        return any(self._prefills_there(run, self.context.cached(run, d).tokens) for d in self.context.decode)

    async def _hold_prefill(self, run: RequestRun, request: DecodeRequest, decode: Instance,
                            late: bool = False) -> bool:
        """Have ``decode`` prefill the request from its cache (``late``: in its late lane, ``LocalPrefill``);
        False (it holds nothing) when it has no room or cannot be reached."""
        run.place(decode)
        try:
            held = await decode.handle.add_prefill.remote(request, late)
        except Exception as err:
            self.calls.failed(decode, "add_prefill", run.request_id, err, run)
            held = None
        if held:
            run.prefilling()
            if self.context.metrics is not None:
                self.context.metrics.local_prefill()
            return True
        decode.room = held is not False
        run.unplace()
        return False

    def cheapest(self, run: RequestRun, pool: list[Instance]) -> Instance | None:
        """The alive instance of ``pool`` to compute the prompt: the fewest assigned requests, unless some hold
        part of the prompt cached (in the pool or the tiers); then the cheapest by ``kv_index.cheapest`` (blocks
        to compute, a block to load counting part of one, against the prompt blocks of the requests already
        assigned there)."""
        ctx = self.context
        alive = self.usable(run, [i for i in pool if i.alive and not i.draining])
        cached = {i.name: ctx.cached(run, i) for i in alive}
        bs = next((ctx.kv_index.block_size(name) for name, c in cached.items() if c.tokens), 1)

        def queued(inst: Instance) -> int:
            return sum(blocks_of(len(ctx.runs[r].prompt_ids), bs) for r in inst.assigned if r in ctx.runs)

        chosen = cheapest(alive, len(run.prompt_ids), bs, lambda i: cached[i.name].saved, queued,
                          ctx.prefix_routing.overlap_weight)
        if chosen is not None:
            run.expect_prefill(len(run.prompt_ids) - cached[chosen.name].tokens)
            if ctx.load_window is not None:
                ctx.load_window.cached(run.request_id, cached[chosen.name].tokens)
        return chosen

    async def _place_at_once(self, run: RequestRun, request: DecodeRequest, prefill: Instance,
                             decode: Instance) -> bool:
        """Contact both instances together (the prefill instance's transfer waits, answered BUSY, until the decode
        instance holds the request); False, with neither holding it, when the decode instance had no room or
        either call failed. Where the decode instance had no room but the prefill instance keeps the prompt (its
        transfer there is under way), the request waits for room on that decode instance."""
        rid = run.request_id
        run.place(decode, prefill)
        held, submitted = await asyncio.gather(decode.handle.add_remote.remote(request),
                                               prefill.handle.submit.remote(self._prefill_request(run, decode)),
                                               return_exceptions=True)
        if held is True and not isinstance(submitted, Exception):
            run.prefilling()
            return True
        for inst, method, result in ((decode, "add_remote", held), (prefill, "submit", submitted)):
            if isinstance(result, Exception):
                self.calls.failed(inst, method, rid, result, run)
        decode.room = held is not False
        if held is False and submitted is None and not await self.calls.lets_go(prefill, rid):
            # the prefill instance is already sending the prompt to ``decode`` (answered BUSY there until it holds
            # the request) and keeps its id until that transfer ends: wait for room there
            return await self._hold_when_room(run, request, decode)
        undo = [self.calls.abort_on(inst, rid) for inst, ok in ((decode, held is True), (prefill, submitted is None))
                if ok]
        await asyncio.gather(*undo)
        run.unplace()
        return False

    async def _hold_when_room(self, run: RequestRun, request: DecodeRequest, decode: Instance) -> bool:
        """Wait for ``decode`` to hold the request (``_wait_for_room``); True once it does, or once the prefill
        instance gave the prompt up (its transfer withdrawn for want of room: the failure it reported runs the
        request again). Raises RouterError UNAVAILABLE when ``decode`` fails meanwhile, RESOURCE_EXHAUSTED when it
        never had room."""
        prefill = run.prefill

        def there() -> list[Instance]:
            if decode.name in run.avoid or not decode.alive:
                raise RouterError("UNAVAILABLE", f"{decode.name} failed while the prompt was on its way there")
            return [decode]

        await self._wait_for_room(run, request, there,
                                  given_up=lambda: prefill is not None and run.request_id not in prefill.assigned)
        run.prefilling()
        return True

    @staticmethod
    def _prefill_request(run: RequestRun, decode: Instance) -> PrefillRequest:
        return PrefillRequest(run.request_id, tuple(run.prompt_ids), run.params,
                              KVDestination(decode.name, reserved=True), late=run.late)

    def decode_order(self, run: RequestRun, cached: dict[str, Cached]) -> tuple[list[Instance], bool]:
        """The decode instances in the order the request tries them, by the rescheduling policy (the one that
        picks migration destinations) and what each holds of the prompt, and whether the first has room by its
        last report."""
        ctx = self.context
        return decode_order(self.usable(run, ctx.decode), len(run.prompt_ids), run.priority, self._policy(),
                            ctx.runs, {name: c.saved for name, c in cached.items()},
                            ctx.prefix_routing.overlap_weight)

    @staticmethod
    def usable(run: RequestRun, pool: list[Instance]) -> list[Instance]:
        """``pool`` without the instances that failed a call for this request, unless that leaves none."""
        return [i for i in pool if i.name not in run.avoid] or pool

    async def submit(self, run: RequestRun, inst: Instance, request) -> None:
        """Hand the request to the instance that prefills it; when the actor is gone or refuses, the run is told
        it failed (retryable: its stream runs it again elsewhere)."""
        run.prefilling()
        try:
            await inst.handle.submit.remote(request)
        except Exception as err:  # the actor died between choosing and submitting, or its worker refused
            self.calls.failed(inst, "submit", run.request_id, err, run)
            run.tell(RunFailed(f"submit to {inst.role} {inst.name} failed: {type(err).__name__}: {err}", True))

    async def _wait_for_room(self, run: RequestRun, request: DecodeRequest, order: Callable[[], list[Instance]],
                             compute_ahead: bool = False, given_up: Callable[[], bool] | None = None) -> Instance | None:
        """The first instance of ``order()`` to hold the request, asked again every ``PLACEMENT_RETRY_S`` while
        none has room, up to the request's timeout (None once ``given_up()``). Raises RouterError RESOURCE_EXHAUSTED
        when none had room in time. ``compute_ahead``: meanwhile an idle prefill instance may compute the prompt
        ahead (``controller/prefill_ahead.py``)."""
        deadline = time.monotonic() + self.context.request_timeout_s
        ahead = self.context.prefill_ahead
        if compute_ahead:
            ahead.wait(run)
        try:
            while (decode := await self.reserve_decode(run, request, order())) is None:
                if given_up is not None and given_up():
                    return None
                if time.monotonic() > deadline:
                    raise RouterError("RESOURCE_EXHAUSTED", "no decode instance had room for the prompt's KV in time")
                if compute_ahead:
                    await self._compute_ahead(run)
                await asyncio.sleep(PLACEMENT_RETRY_S)
        finally:
            if compute_ahead:
                ahead.leave(run)
        return decode

    async def _compute_ahead(self, run: RequestRun) -> None:
        """Have an idle prefill instance compute ``run``'s prompt ahead, when it is the request's turn."""
        ctx = self.context
        inst = ctx.prefill_ahead.instance_for(run, ctx.prefill, ctx.runs, ctx.cached, ctx.kv_index.block_size,
                                              self._prefilled_on_decode)
        if inst is None:
            return
        ctx.prefill_ahead.started(run, inst)
        try:
            await inst.handle.submit.remote(PrefillRequest(run.request_id, tuple(run.prompt_ids), SamplingParams(),
                                                           None, ahead=True))
        except Exception as err:  # the instance's death is handled as any instance's; the request waits on
            ctx.prefill_ahead.ended(inst.name, run.request_id)
            self.calls.failed(inst, "submit", run.request_id, err)
            return
        if ctx.metrics is not None:
            ctx.metrics.prefill_ahead()

    async def reserve_decode(self, run: RequestRun, request, order: list[Instance],
                             method: str = "add_remote") -> Instance | None:
        """The first instance of ``order`` that holds the request with room for its KV (None: none has room): a
        ``DecodeRequest`` waiting for its prompt's KV (``add_remote``), or a ``ResumeRequest`` (``add_resume``)."""
        for inst in order:
            try:
                inst.room = await getattr(inst.handle, method).remote(request)
                if inst.room:
                    return inst
            except Exception as err:
                self.calls.failed(inst, method, request.request_id, err, run)
        return None
