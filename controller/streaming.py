"""A request's stream back to its client (no torch, no Ray): the run's events in, ``Delta`` ... ``Final`` out.

Output is numbered by position in its sequence, whoever reports it (the prefill instance's first token, the
decode instance's deltas, both ends of a live migration): each position is emitted once, in order
(``controller/output_order.py``). Latencies go to the metrics and the online planner's load window as they are
streamed.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from controller.metrics import FinishedRequest
from controller.recovery import MAX_RETRIES, Recovery
from controller.request_run import (FirstTokenArrived, MigrationEnded, OutputArrived, RequestRun, RunCancelled,
                                    RunFailed, RunHandedBack)
from controller.request_state import RequestState
from controller.router_context import RouterContext
from controller.routing import Delta, Final, RouterError


class Streaming:
    """Streams the router's requests (see the module doc)."""

    def __init__(self, context: RouterContext, recovery: Recovery):
        self.context = context
        self.recovery = recovery

    async def stream(self, run: RequestRun) -> AsyncIterator[Delta | Final]:
        ctx = self.context
        deadline = time.monotonic() + ctx.request_timeout_s
        while True:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                self.recovery.cancel(run, "timed out")
                raise RouterError("DEADLINE_EXCEEDED", f"request ran longer than {ctx.request_timeout_s}s")
            try:
                event = await asyncio.wait_for(run.events.get(), timeout)
            except asyncio.TimeoutError:
                continue
            if isinstance(event, RunCancelled):
                return
            if isinstance(event, MigrationEnded):
                run.migration_ended()
                continue
            if isinstance(event, RunFailed):
                await self._failed(run, event)
                continue
            if isinstance(event, RunHandedBack):
                await self.recovery.handed_back(run, event.source)
                continue
            if isinstance(event, FirstTokenArrived):
                if event.first.token_id is None:  # nothing to generate: the prompt was scored
                    yield run.scored(event.first)
                    run.end(RequestState.FINISHED)
                    yield self._final(run, "length")
                    return
                run.transferring()
                pieces = run.first_tokens(event.first)
            elif isinstance(event, OutputArrived) and event.source in run.decoders:
                run.output_from_decoder(event.delta, ctx.kv_transfer)
                pieces = [event.delta]
            else:
                continue  # from an instance the request left (a re-run elsewhere)
            for piece in pieces:
                for cut in run.order.accept(piece):
                    delta = self._emit(run, cut)
                    if delta is not None:
                        yield delta
                    if run.all_finished(cut):
                        run.end(RequestState.FINISHED)
                        yield self._final(run, cut.finish_reason)
                        return

    async def _failed(self, run: RequestRun, failure: RunFailed) -> None:
        """Run the request again (nothing streamed), resume it elsewhere (output went out), or fail it."""
        if failure.retryable and run.tokens_streamed == 0 and run.record.retries < MAX_RETRIES:
            await self.recovery.retry_or_fail(run, failure.reason)
        elif failure.retryable and run.can_resume(MAX_RETRIES):
            await self.recovery.resume(run, failure.reason)
        else:
            self.recovery.cancel_on_workers(run)
            raise RouterError("UNAVAILABLE", f"request {run.request_id} failed: {failure.reason}")

    def _emit(self, run: RequestRun, piece) -> Delta | None:
        """``run.emit``, with its latencies told to the metrics and the load window."""
        ctx, rid = self.context, run.request_id
        if piece.draft_tokens and ctx.load_window is not None:
            ctx.load_window.speculated(rid, piece.accepted_tokens, int(piece.accepted_tokens < piece.draft_tokens))
        delta, times = run.emit(piece)
        if ctx.metrics is not None and times.ttft_s is not None:
            ctx.metrics.first_token(times.ttft_s)
        if ctx.metrics is not None and times.gap_s is not None:
            ctx.metrics.tokens(times.tokens, times.gap_s)
        if piece.token_ids and ctx.load_window is not None:
            ctx.load_window.generated(rid, run.tokens_streamed + len(piece.token_ids))
        return delta

    def _final(self, run: RequestRun, reason: str | None) -> Final:
        ctx, final = self.context, run.final(reason)
        if ctx.load_window is not None:
            ctx.load_window.generated(run.request_id, final.completion_tokens, True, final.ttft_s, final.mean_tpot_s)
        if ctx.metrics is not None:
            ctx.metrics.finished(FinishedRequest(final.finish_reason, final.prompt_tokens, final.completion_tokens,
                                                 final.ttft_s, final.mean_tpot_s, time.perf_counter() - run.arrival,
                                                 final.cached))
        return final
