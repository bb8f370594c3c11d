"""Prefill ahead in the cluster simulator (no torch): the serving router's choice (``controller/prefill_ahead.py``)
over the simulated instances. Each idle prefill instance computes the full blocks of the oldest request waiting
for decode room that it has a block of to compute and no decode instance would prefill itself, one pass per
request; the pass runs in the worker's own scheduler lane (``PrefillSim.add_ahead``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from controller.kv_index import PrefixRouting
from controller.prefill_ahead import SCANNED


def compute_ahead(sim, waiting: Iterable) -> None:
    """Give each idle prefill instance of ``sim`` (a ``planner.simulator.Simulation``) a pass over one of the
    requests ``waiting`` for decode room, oldest first (the first ``SCANNED`` looked at)."""
    routing = sim.config.prefix_caching
    if routing is None or not routing.enabled or not routing.prefill_ahead:
        return
    for p in sim.prefill:
        if not p.idle():
            continue
        for req in itertools.islice(waiting, SCANNED):
            if not req.ahead_on and not prefilled_on_decode(sim, req, routing) and p.add_ahead(req):
                break


def prefilled_on_decode(sim, req, routing: PrefixRouting) -> bool:
    """Whether a decode instance of ``sim`` holds enough of the prompt to prefill the rest itself."""
    for d in sim.decode:
        cached = d.cached(req, routing.tier_load_cost).tokens
        if 0 < cached and req.prompt_tokens - cached <= routing.local_prefill_tokens:
            return True
    return False
