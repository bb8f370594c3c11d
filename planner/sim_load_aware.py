"""Load-aware disaggregation in the cluster simulator (no torch): the serving router's decision
(``controller/load_aware.decide``, as ``Placer._prefill_on_decode`` takes it) over the simulated instances'
queues and measured speeds."""

from __future__ import annotations

from controller.load_aware import REFUSED, DecodeOption, Decision, decide, prefill_ttft_s
from planner.sim_routing import cheapest_for, decode_order


def prefill_on_decode(sim, req) -> bool:
    """True when a decode instance of ``sim`` (a ``planner.simulator.Simulation``) holds ``req`` to prefill it:
    the prefill pool's predicted TTFT misses the target and that instance's is sooner, or the prompt is late
    wherever it goes and comes sooner there (``req.late``: in a late lane, there or in the prefill pool).
    Counted in ``sim.load_aware_counts`` by where the prompt went and why."""
    routing = sim.config.prefix_caching

    def computed(inst) -> int:  # the prompt tokens ``inst`` would compute
        return req.prompt_tokens - (inst.cached(req, routing.tier_load_cost).tokens if routing is not None else 0)

    prefill = cheapest_for(sim, req, sim.prefill)
    order = decode_order(sim, req)
    options = [DecodeOption(d.name, computed(d), d.prefill_queued_tokens(), d.prefill_tokens_per_s()) for d in order]
    n = computed(prefill)
    decision = decide(sim.config.load_aware, prefill_ttft_s(prefill.queued_tokens(late=False), n, prefill.rate),
                      options, prefill_ttft_s(prefill.queued_tokens(), n, prefill.rate))
    req.late = decision.late
    if decision.decode is not None:
        inst = next(d for d in order if d.name == decision.decode)
        if inst.hold_prefill(req, decision.late):
            sim.load_aware_counts[("decode", decision.reason)] += 1
            sim._assign(req, inst)
            return True
        decision = Decision(None, REFUSED)
    sim.load_aware_counts[("prefill", decision.reason)] += 1
    return False
