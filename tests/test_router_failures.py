"""The router sees every failed call to an instance and recovers the request (plain objects for the actors:
each method answers as told, or raises).

A failed commit, source release, abort or placement is counted against the instance (``call_failures``) and
logged as a WARNING naming the instance, the call and the error; a request the failure left nowhere decoding
continues elsewhere (resumed from what it streamed), and placement avoids the instance that failed it. With
no prefill instance in service a request is prefilled on a decode instance, or waits for a prefill instance
when it needs one."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from controller.migrations import PendingMigration
from controller.request_state import RequestRecord, RequestState
from controller.request_run import MigrationEnded, OutputArrived, RequestRun
from controller.router import Router
from controller.routing import Delta, Final, Instance
from decode_worker.messages import MigrationArrived, TokenDelta
from modeling.resume import ResumeRequest
from modeling.sampling import SamplingParams

_ANSWERS = {"add_remote": True, "add_prefill": True, "add_resume": True, "submit": None, "abort": True,
            "commit_migration": True, "finish_migration": True, "abort_migration": True}


class _Actor:
    """An actor handle: ``handle.method.remote(*args)`` records the call and answers ``answers[method]``
    (an exception is raised; a list is answered in turn)."""

    def __init__(self, **answers):
        self.answers = {**_ANSWERS, **answers}
        self.calls: list[tuple] = []

    def __getattr__(self, method: str):
        actor = self

        class _Method:
            @staticmethod
            def remote(*args):
                actor.calls.append((method, *args))

                async def answer():
                    a = actor.answers[method]
                    if isinstance(a, list):  # answers in turn, the last one for good
                        a = a.pop(0) if len(a) > 1 else a[0]
                    if isinstance(a, Exception):
                        raise a
                    return a
                return answer()
        return _Method

    def called(self, method: str) -> list[tuple]:
        return [c[1:] for c in self.calls if c[0] == method]


def _instance(name: str, role: str, **answers) -> Instance:
    return Instance(name, role, _Actor(**answers))


def _active(router: Router, rid: str = "r", **params) -> RequestRun:
    active = RequestRun(RequestRecord(rid, router.counters), [1, 2, 3], SamplingParams(**{"max_tokens": 8, **params}),
                        time.perf_counter())
    router.active[rid] = active
    return active


def _decoding_on(router: Router, src: Instance, rid: str = "r") -> RequestRun:
    """A request decoding on ``src`` that streamed its first two tokens."""
    active = _active(router, rid)
    for state in (RequestState.PREFILLING, RequestState.TRANSFERRING, RequestState.DECODING):
        active.record.to(state)
    active.place(src)
    active.order.accept(TokenDelta(rid, [10, 11], "ab", False, position=0))
    return active


def _migrating(router: Router, src: Instance, dst: Instance) -> RequestRun:
    """The request on ``src`` migrating to ``dst``, arrived there: the router commits now."""
    active = _decoding_on(router, src)
    active.migration_started(PendingMigration(src, dst, time.perf_counter(), asyncio.get_running_loop().create_future()))
    router.migrations.on_arrived(dst, MigrationArrived("r", 2))
    return active


async def _settled() -> None:
    for _ in range(20):  # the calls the router made on the side (each a task of a few awaits)
        await asyncio.sleep(0)


async def _stream_until(router: Router, active: RequestRun, *candidates: Instance) -> list:
    """Run the request's stream; once one of ``candidates`` takes it (``add_resume``), that instance
    finishes it."""
    async def finish_when_resumed():
        while not (took := [i for i in candidates if i.handle.called("add_resume")]):
            await asyncio.sleep(0.001)
        active.tell(OutputArrived(TokenDelta("r", [12], "c", True, "length", position=2), took[0]))

    task = asyncio.get_running_loop().create_task(finish_when_resumed())
    items = await asyncio.wait_for(_collect(router, active), 5.0)
    await task
    return items


async def _collect(router: Router, active: RequestRun) -> list:
    return [item async for item in router.streaming.stream(active)]


def _warned(caplog, *words) -> bool:
    return any(r.levelno == logging.WARNING and all(w in r.getMessage() for w in words) for r in caplog.records)


@pytest.mark.parametrize("answer", [RuntimeError("no such request"), False])
def test_a_failed_commit_resumes_the_request_elsewhere(caplog, answer):
    """The destination raised, or answered False, to the commit: it does not decode the request; the router
    counts it, aborts the destination's copy and resumes the request on another instance from the tokens
    it streamed."""
    async def scenario():
        router = Router([], [], max_concurrent=4, max_queue=4)
        src = _instance("decode-0", "decode")
        dst = _instance("decode-1", "decode", commit_migration=answer)
        other = _instance("decode-2", "decode")
        router.decode[:] = [src, dst, other]
        active = _migrating(router, src, dst)
        items = await _stream_until(router, active, src, other)
        return router, src, dst, other, items

    router, src, dst, other, items = asyncio.run(scenario())
    assert router.call_failures == {("decode-1", "commit_migration"): 1}
    assert _warned(caplog, "decode-1", "commit_migration", "r")
    assert dst.handle.called("abort") == [("r",)]  # its copy is freed
    assert src.handle.called("finish_migration") == [("r",)]
    resumed = [c[0] for inst in (src, other) for c in inst.handle.called("add_resume")]
    assert len(resumed) == 1 and isinstance(resumed[0], ResumeRequest)
    assert not dst.handle.called("add_resume")  # the instance that failed it is avoided
    assert resumed[0].sequences[0].output_ids == (10, 11)
    # `magicserve status` shows the failed call against the instance
    from frontend.server import MagicServeServicer

    async def statuses():
        return [{"name": i.name, "role": "decode"} for i in (src, dst, other)]

    status = asyncio.run(MagicServeServicer(router, None, statuses, "m").GetClusterStatus(None, None))
    assert {i.name: i.call_failures for i in status.instances} == {"decode-0": 0, "decode-1": 1, "decode-2": 0}
    assert isinstance(items[-1], Final) and [t for i in items if isinstance(i, Delta) for t in i.token_ids] == [12]


def test_a_commit_that_succeeds_leaves_the_request_on_its_destination():
    async def scenario():
        router = Router([], [], max_concurrent=4, max_queue=4)
        src, dst = _instance("decode-0", "decode"), _instance("decode-1", "decode")
        router.decode[:] = [src, dst]
        active = _migrating(router, src, dst)
        await _settled()
        return router, src, dst, active

    router, src, dst, active = asyncio.run(scenario())
    assert not router.call_failures and active.decode is dst and isinstance(active.events.get_nowait(), MigrationEnded)
    assert active.events.empty() and not src.handle.called("abort") and not dst.handle.called("abort")


def test_a_source_that_fails_to_free_its_copy_is_told_to_abort_it(caplog):
    async def scenario():
        router = Router([], [], max_concurrent=4, max_queue=4)
        src = _instance("decode-0", "decode", finish_migration=RuntimeError("boom"))
        dst = _instance("decode-1", "decode")
        router.decode[:] = [src, dst]
        active = _migrating(router, src, dst)
        await _settled()
        return router, src, dst, active

    router, src, dst, active = asyncio.run(scenario())
    assert router.call_failures == {("decode-0", "finish_migration"): 1}
    assert _warned(caplog, "decode-0", "finish_migration", "RuntimeError: boom")
    assert src.handle.called("abort") == [("r",)]
    assert active.decode is dst and "r" in dst.assigned  # the request goes on where it moved
    assert isinstance(active.events.get_nowait(), MigrationEnded) and active.events.empty()


def test_a_source_that_fails_to_take_an_aborted_migration_back_resumes_it_elsewhere(caplog):
    async def scenario():
        router = Router([], [], max_concurrent=4, max_queue=4)
        src = _instance("decode-0", "decode", abort_migration=RuntimeError("stuck"))
        dst, other = _instance("decode-1", "decode"), _instance("decode-2", "decode")
        router.decode[:] = [src, dst, other]
        active = _decoding_on(router, src)
        active.migration = PendingMigration(src, dst, time.perf_counter(), asyncio.get_running_loop().create_future())
        active.record.to(RequestState.MIGRATING)
        router.migrations.abort(active, "the test aborts it")
        items = await _stream_until(router, active, dst, other)
        return router, src, dst, other, items

    router, src, dst, other, items = asyncio.run(scenario())
    assert router.call_failures == {("decode-0", "abort_migration"): 1}
    assert _warned(caplog, "decode-0", "abort_migration", "stuck")
    assert dst.handle.called("abort") == [("r",)] and src.handle.called("abort") == [("r",)]
    assert [c[0].request_id for c in other.handle.called("add_resume") + dst.handle.called("add_resume")] == ["r"]
    assert not src.handle.called("add_resume")
    assert isinstance(items[-1], Final)


def test_a_failed_abort_is_counted_and_logged(caplog):
    async def scenario():
        router = Router([], [], max_concurrent=4, max_queue=4)
        inst = _instance("decode-0", "decode", abort=ConnectionError("unreachable"))
        return router, await router.calls.abort_on(inst, "r")

    router, ok = asyncio.run(scenario())
    assert ok is False and router.call_failures == {("decode-0", "abort"): 1}
    assert _warned(caplog, "decode-0", "abort(r)", "ConnectionError: unreachable")


@pytest.mark.parametrize("failing", ["submit", "add_remote"])
def test_a_placement_call_that_raises_is_counted_and_the_request_placed_elsewhere(caplog, failing):
    """Placement contacts a prefill and a decode instance at once; the one that raised is counted, logged,
    and left out of the request's placement while another instance can take it."""
    async def scenario():
        router = Router([], [], max_concurrent=4, max_queue=4)
        bad = {failing: ValueError("worker refused")}
        p0 = _instance("prefill-0", "prefill", **(bad if failing == "submit" else {}))
        p1 = _instance("prefill-1", "prefill")
        d0 = _instance("decode-0", "decode", **(bad if failing == "add_remote" else {}))
        d1 = _instance("decode-1", "decode")
        router.prefill[:], router.decode[:] = [p0, p1], [d0, d1]
        p1.assigned.add("x")  # p0 is the cheaper prefill instance, d0 is first for decode
        d1.assigned.add("x")
        active = _active(router)
        await router.placer.place(active)
        return router, active, (p0, p1, d0, d1)

    router, active, (p0, p1, d0, d1) = asyncio.run(scenario())
    failed = p0 if failing == "submit" else d0
    assert router.call_failures == {(failed.name, failing): 1}
    assert _warned(caplog, failed.name, failing, "ValueError: worker refused")
    assert active.record.state is RequestState.PREFILLING
    assert failed is not active.prefill and failed is not active.decode and "r" not in failed.assigned
    assert failed.name in active.avoid
    # the other end of the failed pair was told to drop what it took
    partner = d0 if failing == "submit" else p0
    assert partner.handle.called("abort") == [("r",)]


def test_with_no_prefill_instance_in_service_a_decode_instance_prefills_the_request():
    async def scenario():
        router = Router([], [], max_concurrent=4, max_queue=4)
        p0, d0 = _instance("prefill-0", "prefill"), _instance("decode-0", "decode")
        p0.alive = False  # restarting
        router.prefill[:], router.decode[:] = [p0], [d0]
        active = _active(router)
        await router.placer.place(active)
        return active, p0, d0

    active, p0, d0 = asyncio.run(scenario())
    assert active.decode is d0 and active.prefill is None and active.record.state is RequestState.PREFILLING
    assert [c[0].request_id for c in d0.handle.called("add_prefill")] == ["r"] and not p0.handle.calls


def test_a_request_that_needs_a_prefill_instance_waits_for_one_to_come_back():
    """Prompt log-probabilities come from a prefill instance only: the request waits for the restart."""
    async def scenario():
        router = Router([], [], max_concurrent=4, max_queue=4)
        p0, d0 = _instance("prefill-0", "prefill"), _instance("decode-0", "decode")
        p0.alive = False
        router.prefill[:], router.decode[:] = [p0], [d0]
        active = _active(router, prompt_logprobs=1)
        placing = asyncio.get_running_loop().create_task(router.placer.place(active))
        await asyncio.sleep(0.3)
        waited = not placing.done() and not p0.handle.calls
        p0.alive = True  # back
        await asyncio.wait_for(placing, 5.0)
        return waited, active, p0, d0

    waited, active, p0, d0 = asyncio.run(scenario())
    assert waited and active.prefill is p0 and active.decode is d0
    assert p0.handle.called("submit") and d0.handle.called("add_remote") and not d0.handle.called("add_prefill")


def test_a_colocated_request_arriving_while_every_instance_restarts_waits_for_one():
    from controller.colocated_router import ColocatedRouter

    async def scenario():
        c0 = _instance("colocated-0", "colocated")
        router = ColocatedRouter([c0], max_concurrent=4, max_queue=4)
        c0.alive = False
        active = _active(router)
        placing = asyncio.get_running_loop().create_task(router.placer.place(active))
        await asyncio.sleep(0.2)
        waited = not placing.done()
        c0.alive = True
        await asyncio.wait_for(placing, 5.0)
        return waited, active, c0

    waited, active, c0 = asyncio.run(scenario())
    assert waited and active.decode is c0 and [c[0].request_id for c in c0.handle.called("submit")] == ["r"]


def test_a_decode_instance_without_room_is_waited_for_while_the_prefill_instance_sends_to_it():
    """Placement contacted both instances; the decode instance had no room, and the prefill instance, already
    sending the prompt there, keeps it (it refuses the abort): the request waits for room on that decode
    instance instead of being placed again under an id the prefill instance still holds."""
    async def scenario():
        router = Router([], [], max_concurrent=4, max_queue=4)
        p0 = _instance("prefill-0", "prefill", abort=False)
        d0 = _instance("decode-0", "decode", add_remote=[False, False, True])
        router.prefill[:], router.decode[:] = [p0], [d0]
        active = _active(router)
        await router.placer.place(active)
        return router, active, p0, d0

    router, active, p0, d0 = asyncio.run(scenario())
    assert active.record.state is RequestState.PREFILLING
    assert active.prefill is p0 and active.decode is d0 and "r" in p0.assigned and "r" in d0.assigned
    assert len(p0.handle.called("submit")) == 1 and len(d0.handle.called("add_remote")) == 3
    assert not router.call_failures  # no room is back-pressure, not a failure
