"""The router's stream across a committed migration when the source dies before its last tokens were read.

The window is the few milliseconds between the source's stop-and-copy and the router's next poll of it, which
no real run can hit on purpose; so this drives the router's own stream logic (``Streaming.stream``,
``Recovery.fail_instance``) with the events its polls would deliver. The client must get every token once, in
order, with its text: the destination's first delta repeats the output so far (its catch-up), which fills in
the source's unread tail; the destination's tokens follow, and anything the source sends afterwards is
dropped."""

from __future__ import annotations

import asyncio
import time

from controller.request_state import RequestRecord, RequestState
from controller.migrations import PendingMigration
from controller.request_run import OutputArrived, RequestRun
from controller.router import Router
from controller.routing import Delta, Final, Instance
from decode_worker.messages import TokenDelta
from modeling.sampling import SamplingParams


def _piece(ids, text, position, offset, finished=False):
    return TokenDelta("r", ids, text, finished, "length" if finished else None, position=position, text_offset=offset)


def _stream_with_source_death(die: bool, catch_up_first: bool = False) -> list:
    async def scenario() -> list:
        router = Router([], [], max_concurrent=4, max_queue=4)
        src, dst = Instance("decode-0", "decode", None), Instance("decode-1", "decode", None)
        active = RequestRun(RequestRecord("r", router.counters), [1, 2, 3], SamplingParams(max_tokens=8),
                            time.perf_counter())
        active.place(src)
        for state in (RequestState.PREFILLING, RequestState.TRANSFERRING):
            active.record.to(state)
        active.order.accept(_piece([10], "", 0, 0))  # the first token (10) came from prefill
        router.active["r"] = active
        q = active.events
        q.put_nowait(OutputArrived(_piece([], "a", 1, 0), src))  # its text, from the decode instance
        q.put_nowait(OutputArrived(_piece([11, 12], "bc", 1, 1), src))
        # the commit (``MigrationCoordinator.on_arrived``): the source produced 5 tokens, then stopped; 13 and
        # 14 are still unread in its outbox
        active.migration = PendingMigration(src, dst, time.perf_counter(), asyncio.get_running_loop().create_future())
        active.migration_committed()
        catch_up = OutputArrived(_piece([10, 11, 12, 13, 14], "abcde", 0, 0), dst)
        if catch_up_first:
            q.put_nowait(catch_up)
        q.put_nowait(OutputArrived(_piece([15, 16], "fg", 5, 5), dst))  # the destination runs ahead
        if die:
            router.recovery.fail_instance(src, "decode-0 crashed")
            q.put_nowait(catch_up)
            q.put_nowait(OutputArrived(_piece([13], "d", 3, 3), src))  # a late read: must not repeat
        else:
            q.put_nowait(OutputArrived(_piece([13, 14], "de", 3, 3), src))
            if not catch_up_first:
                q.put_nowait(catch_up)
        q.put_nowait(OutputArrived(_piece([17], "h", 7, 7, finished=True), dst))

        async def collect() -> list:
            return [item async for item in router.streaming.stream(active)]

        return await asyncio.wait_for(collect(), 10.0)  # a hand-over that never completes fails, not hangs

    return asyncio.run(scenario())


def _ids_and_text(items) -> tuple[list[int], str, str]:
    deltas = [i for i in items if isinstance(i, Delta)]
    final = [i for i in items if isinstance(i, Final)]
    assert len(final) == 1 and items[-1] is final[0]
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), final[0].finish_reason


def test_source_death_after_commit_streams_every_token_once():
    ids, text, reason = _ids_and_text(_stream_with_source_death(die=True))
    assert ids == [11, 12, 13, 14, 15, 16, 17] and text == "abcdefgh" and reason == "length"


def test_without_a_death_the_source_streams_its_own_tail():
    ids, text, reason = _ids_and_text(_stream_with_source_death(die=False))
    assert ids == [11, 12, 13, 14, 15, 16, 17] and text == "abcdefgh" and reason == "length"


def test_the_catch_up_read_before_the_source_tail_makes_it_a_duplicate():
    ids, text, reason = _ids_and_text(_stream_with_source_death(die=False, catch_up_first=True))
    assert ids == [11, 12, 13, 14, 15, 16, 17] and text == "abcdefgh" and reason == "length"
