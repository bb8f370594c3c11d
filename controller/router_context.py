"""What the router's parts share (no torch, no Ray): the pools, the running requests (``RequestRun``), the
prefix index, and where requests report (metrics, the online planner's load window).

Placement (``controller/placer.py``), streaming (``controller/streaming.py``), recovery
(``controller/recovery.py``), polling (``controller/instance_watch.py``) and live migration
(``controller/migrations.py``) each read this one context; ``Router`` (``controller/router.py``) builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.kv_index import NOTHING, Cached, PrefixIndex, PrefixRouting
from controller.load_aware import LoadAwareState
from controller.prefill_ahead import PrefillAhead
from controller.metrics import ServingMetrics
from controller.request_run import RequestRun, RunEvent
from controller.routing import Instance

PLACEMENT_RETRY_S = 0.01  # how often a placement that found no room (or no instance in service) looks again


@dataclass
class RouterContext:
    """The router's shared state. ``prefill`` and ``decode`` are the router's own lists: pools change as
    instances join and leave; ``instances`` is every instance polled. ``kv_transfer`` False: colocated
    instances (no hand-off between pools)."""

    prefill: list[Instance]
    decode: list[Instance]
    request_timeout_s: float = 600.0
    kv_transfer: bool = True
    metrics: ServingMetrics | None = None  # told of every first token, token batch, finish and failure
    prefix_routing: PrefixRouting = PrefixRouting()
    kv_index: PrefixIndex = field(default_factory=PrefixIndex)  # what each instance holds cached, from its events
    runs: dict[str, RequestRun] = field(default_factory=dict)
    load_window: object = None  # planner.online.LoadWindow: what the online planner reads, when it runs
    load_aware: LoadAwareState = field(default_factory=LoadAwareState)  # prefill on decode under a backlog
    prefill_ahead: PrefillAhead = field(default_factory=PrefillAhead)  # prompts computed while they wait for room
    closing: bool = False
    instances: list[Instance] = field(init=False)

    def __post_init__(self) -> None:
        self.prefill, self.decode = list(self.prefill), list(self.decode)
        self.instances = self.prefill + self.decode
        self.prefill_ahead.enabled = self.prefix_routing.enabled and self.prefix_routing.prefill_ahead

    def pool_of(self, inst: Instance) -> list[Instance]:
        return self.prefill if inst.role == "prefill" else self.decode

    def send(self, request_id: str, event: RunEvent) -> None:
        """Tell the run of ``request_id`` (nothing when it has ended)."""
        run = self.runs.get(request_id)
        if run is not None:
            run.tell(event)

    def cached(self, run: RequestRun, inst: Instance) -> Cached:
        """What ``inst`` holds of the request's prompt in its pool and its tiers, by the index (nothing with
        prefix routing off)."""
        if not self.prefix_routing.enabled:
            return NOTHING
        return self.kv_index.cached(inst.name, run.prompt_ids, run.prompt_hashes, self.prefix_routing.tier_load_cost)

    def held_by(self, inst: Instance) -> set[str]:
        """Requests ``inst`` holds: a prefill instance, those it has not handed off; a decode instance, those
        decoding (or placed, or migrating in) there."""
        if inst.role == "prefill":
            return {rid for rid in inst.assigned if rid in self.runs}
        return set(inst.migrating_in) | {rid for rid, run in self.runs.items()
                                         if run.decode is inst and not run.state.terminal}

    @staticmethod
    def in_service(pool: list[Instance]) -> bool:
        return any(i.alive and not i.draining for i in pool)
