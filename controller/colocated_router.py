"""The router over colocated instances (the reference engine: prefill and decode in one instance, no KV
transfer): everything is ``Router``'s but placement."""

from __future__ import annotations

from controller.actor_messages import ColocatedRequest
from controller.kv_index import PrefixRouting
from controller.metrics import ServingMetrics
from controller.placer import Placer
from controller.request_run import RequestRun
from controller.router import Router
from controller.routing import Instance


class ColocatedPlacer(Placer):
    """One pick: the fewest assigned requests, or the cheapest by cached prefix and load (``Placer.cheapest``);
    while none is in service, the request waits for a restart up to its timeout."""

    async def place(self, run: RequestRun) -> None:
        inst = await self.wait_for(run, self.context.decode, "colocated")
        run.place_colocated(inst)
        await self.submit(run, inst, ColocatedRequest(run.request_id, tuple(run.prompt_ids), run.params))


class ColocatedRouter(Router):
    """Routes requests over colocated instances, each running prefill and decode (the reference engine):
    ``queued -> prefilling -> decoding -> finished``. Admission, streaming, cancellation, timeouts, retries
    before anything was streamed and instance failover (a request its instance dropped midway resumes on
    another one, ``ColocatedActor.add_resume``) are ``Router``'s; placement is ``ColocatedPlacer``'s, and the
    instance's first delta for a request carries its first token."""

    kv_transfer = False
    placer_class = ColocatedPlacer

    def __init__(self, instances: list[Instance], max_concurrent: int, max_queue: int, request_timeout_s: float = 600.0,
                 restart=None, check_ranks=None, metrics: ServingMetrics | None = None,
                 prefix_routing: PrefixRouting = PrefixRouting()):
        # the instances stand where decode instances do: each holds its requests' KV until they end
        super().__init__([], instances, max_concurrent, max_queue, request_timeout_s, restart, check_ranks, metrics,
                         prefix_routing=prefix_routing)
