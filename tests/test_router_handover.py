"""The router's hand-over after a committed migration when the source dies before its last tokens were read.

The window is the few milliseconds between the source's stop-and-copy and the router's next poll of it, which
no real run can hit on purpose; so this drives the router's own stream logic (``Router._stream``,
``Router._fail_instance``) with the events its polls would deliver. The client must get every token once, in
order, with its text: the source's unread tail is filled in from the copy the destination reported, the
destination's tokens follow, and anything the source sends afterwards is dropped."""

from __future__ import annotations

import asyncio
import time

from controller.request_state import RequestRecord, RequestState
from controller.router import Router, _Active
from controller.routing import Delta, Final, Instance
from decode_worker.messages import TokenDelta
from modeling.sampling import SamplingParams


def _stream_with_source_death(die: bool) -> list:
    async def scenario() -> list:
        router = Router([], [], max_concurrent=4, max_queue=4)
        src, dst = Instance("decode-0", "decode", None), Instance("decode-1", "decode", None)
        src.assigned.add("r")
        active = _Active(RequestRecord("r", router.counters), [1, 2, 3], SamplingParams(max_tokens=8),
                         asyncio.Queue(), time.perf_counter())
        for state in (RequestState.PREFILLING, RequestState.TRANSFERRING, RequestState.DECODING):
            active.record.to(state)
        active.tokens_streamed = 1  # the first token (10) came from prefill
        router.active["r"] = active
        q = active.events
        q.put_nowait(("delta", TokenDelta("r", [], "a", False), src))  # the first token's text
        q.put_nowait(("delta", TokenDelta("r", [11, 12], "bc", False), src))
        # the commit (``_on_migration_arrived``): the source produced 5 tokens, then stopped; 13 and 14 are
        # still unread in its outbox
        src.assigned.discard("r")
        dst.assigned.add("r")
        active.decode = dst
        active.handover, active.handover_from, active.handover_source = 5, dst, src
        active.handover_ids, active.handover_text = (10, 11, 12, 13, 14), "abcde"
        q.put_nowait(("delta", TokenDelta("r", [15, 16], "fg", False), dst))  # the destination runs ahead
        if die:
            router._fail_instance(src, "decode-0 crashed")
            q.put_nowait(("delta", TokenDelta("r", [13], "d", False), src))  # a late read: must not repeat
        else:
            q.put_nowait(("delta", TokenDelta("r", [13, 14], "de", False), src))
        q.put_nowait(("delta", TokenDelta("r", [17], "h", True, "length"), dst))
        async def collect() -> list:
            return [item async for item in router._stream(active)]

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
