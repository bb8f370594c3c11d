"""The router's choices over the simulated instances (no torch): the decode instances' order for a request
(``controller/placement.py``), the instance to compute a prompt on (``Router._cheapest``), and, with no prefill
instance in the pool, the decode instance that prefills it (``Placer._place_without_prefill``). Each takes the
``planner.simulator.Simulation`` whose instances it weighs."""

from __future__ import annotations

from controller.kv_index import cached_first, cheapest
from controller.migration_policy import PolicyConfig, placement_order
from controller.placement import blocks_for


def decode_order(sim, req) -> list:
    """The decode instances in the router's order: the rescheduling policy's placement order over their loads
    (every simulated request has priority 0), those holding the prompt cached first where prefix caching
    routes."""
    cfg = sim.config
    policy = cfg.migration.policy if cfg.migration is not None else PolicyConfig()
    moving = sim.migration.moving if sim.migration is not None else frozenset()
    by_name = {d.name: d for d in sim.decode}
    blocks = blocks_for(req.prompt_tokens + 1, cfg.block_size)
    loads = {d.name: d.load(moving) for d in sim.decode}
    order = [by_name[n] for n in placement_order(list(loads.values()), blocks, policy)]
    routing = cfg.prefix_caching
    if routing is None or not routing.enabled:
        return order
    cached = {d.name: d.cached(req, routing.tier_load_cost).saved for d in order}
    return cached_first(order, req.prompt_tokens + 1, cfg.block_size, lambda d: cached[d.name],
                        lambda d: loads[d.name].used_blocks, lambda d: loads[d.name].free_blocks,
                        routing.overlap_weight)


def cheapest_for(sim, req, pool: list):
    """The instance of ``pool`` to compute the prompt on: the fewest assigned requests, or with a cached prefix
    somewhere the cheapest by blocks to compute against the prompt blocks queued there."""
    routing = sim.config.prefix_caching
    on = routing is not None and routing.enabled
    cached = {i.name: i.cached(req, routing.tier_load_cost).saved if on else 0 for i in pool}
    bs = sim.config.block_size
    reqs = sim.requests

    def queued(inst) -> int:
        return sum(blocks_for(reqs[r].prompt_tokens, bs) for r in inst.assigned)

    return cheapest(pool, req.prompt_tokens, bs, lambda i: cached[i.name], queued,
                    routing.overlap_weight if on else 1.0)


def hold_on_decode(sim, req) -> bool:
    """With no prefill instance, the first decode instance in the router's order that holds the prompt prefills
    it; False when none has room."""
    for d in decode_order(sim, req):
        if d.hold_prefill(req):
            sim._assign(req, d)
            return True
    return False
