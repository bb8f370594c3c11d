"""Prompts computed ahead while they wait for room on a decode instance (``controller/prefill_ahead.py``): the
policy on plain objects, and the placer driving plain actor objects (each method answers as told)."""

from __future__ import annotations

import asyncio
import time

from controller.kv_index import Cached, PrefixRouting
from controller.prefill_ahead import RESCAN_S, PrefillAhead
from controller.request_run import RequestRun, RunFailed
from controller.request_state import RequestRecord, RequestState, StateCounters
from controller.router import Router
from controller.routing import Instance
from modeling.prefix_cache import PrefixCacheEvents
from modeling.prefix_hash import block_hashes
from modeling.sampling import SamplingParams
from prefill_worker.messages import PrefillFailure, PrefillStepOutput
from tests.test_router_failures import _Actor

BS = 4


def _run(rid: str, n: int = 20, priority: int = 0, **params) -> RequestRun:
    return RequestRun(RequestRecord(rid, StateCounters()), list(range(n)), SamplingParams(max_tokens=8, **params),
                      time.perf_counter(), priority)


def _choose(ahead: PrefillAhead, run: RequestRun, pool, runs=None, cached=None, block_size=BS):
    time.sleep(RESCAN_S)  # a fresh scan
    return ahead.instance_for(run, pool, runs or {}, cached or (lambda r, i: Cached()), lambda name: block_size)


def test_the_oldest_waiting_request_goes_first_one_pass_per_idle_instance():
    ahead = PrefillAhead()
    p0, p1 = Instance("prefill-0", "prefill", None), Instance("prefill-1", "prefill", None)
    old, new, vip = _run("old"), _run("new"), _run("vip", priority=1)
    for r in (old, new):
        ahead.wait(r)
    assert _choose(ahead, new, [p0]) is None  # not its turn: the older one asks for itself
    assert _choose(ahead, old, [p0]) is p0
    ahead.started(old, p0)
    assert _choose(ahead, new, [p0]) is None  # p0 runs a pass already
    assert _choose(ahead, new, [p0, p1]) is p1
    ahead.wait(vip)
    assert _choose(ahead, new, [p0, p1]) is None and _choose(ahead, vip, [p0, p1]) is p1  # priority first
    ahead.ended("prefill-0", "old")
    ahead.started(vip, p1)
    assert _choose(ahead, new, [p0, p1]) is p0 and ahead.passes == 2


def test_no_pass_where_it_would_delay_a_prompt_or_compute_nothing():
    ahead = PrefillAhead()
    p0 = Instance("prefill-0", "prefill", None)
    queued, waiting = _run("queued"), _run("w")
    runs = {"queued": queued}
    p0.assigned.add("queued")
    ahead.wait(waiting)
    assert _choose(ahead, waiting, [p0], runs) is None  # a request of its own queued there
    queued.record.to(RequestState.PREFILLING)
    queued.record.to(RequestState.TRANSFERRING)
    assert _choose(ahead, waiting, [p0], runs) is p0  # its prompt computed, in transfer: the instance idles
    # all but the last block cached there: nothing for a pass to keep (the request computes its last block anyway)
    assert _choose(ahead, waiting, [p0], runs, lambda r, i: Cached(pool=16)) is None
    assert _choose(ahead, waiting, [p0], runs, lambda r, i: Cached(pool=12)) is p0
    assert _choose(ahead, waiting, [p0], runs, block_size=None) is None  # the instance keeps no prefix cache
    p0.draining = True
    assert _choose(ahead, waiting, [p0], runs) is None
    p0.draining = False
    ahead.started(waiting, p0)
    p0.generation += 1  # restarted: the pass died with it
    ahead.leave(waiting)
    again = _run("again")
    ahead.wait(again)
    assert _choose(ahead, again, [p0], runs) is p0
    scored = _run("scored", prompt_logprobs=1)
    ahead.wait(scored)  # computes its whole prompt: not waited for here
    assert _choose(ahead, scored, [p0], runs) is None
    off = PrefillAhead(enabled=False)
    off.wait(again)
    assert _choose(off, again, [p0], runs) is None


def _instance(name: str, role: str, **answers) -> Instance:
    return Instance(name, role, _Actor(**answers))


def _caching(router: Router, inst: Instance) -> None:
    """``inst`` reported a prefix cache (empty) to the router's index."""
    router.kv_index.apply(inst.name, PrefixCacheEvents(b"salt", BS, (), reset=True))


def test_a_request_waiting_for_decode_room_is_computed_ahead_then_placed_on_that_prefill_instance():
    async def scenario():
        router = Router([], [], max_concurrent=4, max_queue=4)
        p0, p1 = _instance("prefill-0", "prefill"), _instance("prefill-1", "prefill")
        d0 = _instance("decode-0", "decode", add_remote=[False] * 30 + [True])
        d0.room = False
        router.prefill[:], router.decode[:] = [p0, p1], [d0]
        for inst in (p0, p1):
            _caching(router, inst)
        run = RequestRun(RequestRecord("r", router.counters), list(range(100, 121)), SamplingParams(max_tokens=8),
                         time.perf_counter())
        router.active["r"] = run

        async def pass_done():  # the instance computes the pass: its blocks are cached, and it says the pass ended
            while not (took := [i for i in (p0, p1) if i.handle.called("submit")]):
                await asyncio.sleep(0.001)
            inst = took[0]
            blocks = block_hashes(run.prompt_ids[:-1], BS, b"salt")  # the prompt's but its last token's
            router.watch.dispatch(inst, PrefillStepOutput(tokens_computed=21, ahead_ended=["r"]))
            router.watch.dispatch(inst, PrefixCacheEvents(b"salt", BS, tuple((h, True) for h in blocks)))
            assert router.kv_index.cached(inst.name, run.prompt_ids, {}).pool == 20
            return inst

        task = asyncio.get_running_loop().create_task(pass_done())
        await router.placer.place(run)
        return run, await task, router

    run, ahead_on, router = asyncio.run(scenario())
    passes = ahead_on.handle.called("submit")
    assert passes[0][0].ahead and passes[0][0].destination is None and passes[0][0].request_id == "r"
    real = passes[1][0]  # placed on the instance holding the blocks computed ahead
    assert not real.ahead and real.destination.decode_id == "decode-0" and run.prefill is ahead_on
    assert len(passes) == 2 and router.context.prefill_ahead.passes == 1
    assert not router.context.prefill_ahead.running and not router.call_failures


def test_with_prefill_ahead_off_the_prompt_waits_untouched():
    async def scenario():
        router = Router([], [], max_concurrent=4, max_queue=4, prefix_routing=PrefixRouting(prefill_ahead=False))
        p0, d0 = _instance("prefill-0", "prefill"), _instance("decode-0", "decode", add_remote=[False] * 5 + [True])
        d0.room = False
        router.prefill[:], router.decode[:] = [p0], [d0]
        _caching(router, p0)
        run = RequestRun(RequestRecord("r", router.counters), list(range(100, 121)), SamplingParams(max_tokens=8),
                         time.perf_counter())
        router.active["r"] = run
        await router.placer.place(run)
        return p0

    p0 = asyncio.run(scenario())
    assert [c[0].ahead for c in p0.handle.called("submit")] == [False]


def test_a_prompt_whose_transfer_waits_for_room_stops_waiting_when_the_prefill_instance_withdraws_it():
    """Placed at once, the decode instance had no room and the prefill instance kept the prompt (its transfer
    under way): the request waits for room there, until the prefill instance withdraws the transfer for want of
    blocks. The placement then returns, and the failure it reported (retryable) runs the request again."""
    async def scenario():
        router = Router([], [], max_concurrent=4, max_queue=4)
        p0 = _instance("prefill-0", "prefill", abort=False)
        d0 = _instance("decode-0", "decode", add_remote=False)
        router.prefill[:], router.decode[:] = [p0], [d0]
        run = RequestRun(RequestRecord("r", router.counters), list(range(100, 121)), SamplingParams(max_tokens=8),
                         time.perf_counter())
        router.active["r"] = run

        async def withdraw():
            while len(d0.handle.called("add_remote")) < 5:
                await asyncio.sleep(0.001)
            router.watch.dispatch(p0, PrefillStepOutput(failed=[PrefillFailure("r", "withdrawn", True)]))

        task = asyncio.get_running_loop().create_task(withdraw())
        await asyncio.wait_for(router.placer.place(run), 5.0)
        await task
        return run, p0

    run, p0 = asyncio.run(scenario())
    assert "r" not in p0.assigned and isinstance(run.events.get_nowait(), RunFailed)


def test_no_pass_for_a_request_a_decode_instance_will_prefill_itself():
    ahead = PrefillAhead()
    p0 = Instance("prefill-0", "prefill", None)
    turn, other = _run("turn"), _run("other")
    for r in (turn, other):
        ahead.wait(r)
    time.sleep(RESCAN_S)
    skip = lambda r: r is turn  # noqa: E731 - its history is on the decode instance it waits for
    assert ahead.instance_for(turn, [p0], {}, lambda r, i: Cached(), lambda name: BS, skip) is None
    assert ahead.instance_for(other, [p0], {}, lambda r, i: Cached(), lambda name: BS, skip) is p0
