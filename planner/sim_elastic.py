"""Elastic pools in the cluster simulator: the online planner resizing a simulated cluster, at any scale.

:func:`simulate_elastic` runs a trace on a :class:`planner.simulator.Simulation` whose pools are resized as
the served cluster's are (``Scaler.plan_forever`` in ``controller/scaling.py``), with the same parts:

* every ``autoscale.interval_s`` of simulated time, a ``LoadWindow`` of the last ``autoscale.window_s``
  seconds holds what the router saw (each request's arrival and prompt length, the tokens it generated so
  far, the TTFT and TPOT its client measured once it finished);
* fewer than ``autoscale.min_window_requests`` requests ask for the bounds' minimums; otherwise
  ``OnlinePlanner.decide`` chooses a shape from the window's trace (``autoscale.headroom`` times faster),
  corrected by the measured latencies;
* ``ScalePolicy`` turns decisions into resizes (a pool grows at once, shrinks by one after
  ``autoscale.scale_down_after`` decisions, never twice within ``autoscale.cooldown_s``);
* a new instance holds its devices from the resize and serves ``startup_s`` later (placement, process
  start, weights, warm-up); a leaving one drains (``Simulation.retire_instance``: live migration off a decode
  instance, a prefill instance finishing its prompts) and gives its devices back once empty;
* with ``switch_s``, a decision that moves instances between the pools is a role change
  (``ScalePolicy.switch``, ``Simulation.switch_instance``): the instance drains, then serves in the other
  pool ``switch_s`` later on the devices it held.

The planner's own simulations run on the trace of its window, as in serving; only the cluster they resize is
simulated here. No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controller.config import AutoscaleSection
from planner.online import Decision, LoadWindow, OnlinePlanner, ScalePolicy
from planner.profile import Profile
from planner.search import SLOTarget
from planner.simulator import SimConfig, SimResult, Simulation
from planner.workload import RequestSpec


@dataclass(frozen=True)
class PlanTick:
    """One decision of the planner in the run: when, the shape then (serving + starting), what it chose."""

    at_s: float
    current: dict
    decision: Decision
    resizes: dict  # pool -> the size the policy resized it to (absent: left alone)


@dataclass(frozen=True)
class InstanceSpan:
    """One instance of the run: its devices, from its resize (0: the starting shape) to its stop (nan: ran
    to the end)."""

    name: str
    devices: int
    allocated_s: float
    stopped_s: float


@dataclass(frozen=True)
class ElasticResult:
    result: SimResult
    ticks: list[PlanTick]
    instances: list[InstanceSpan]

    def devices_at(self, t: float) -> int:
        """Devices held at time ``t``."""
        return sum(i.devices for i in self.instances
                   if i.allocated_s <= t and (math.isnan(i.stopped_s) or t < i.stopped_s))

    def resizes(self) -> list[tuple[float, str, int]]:
        """(time, pool, new size) of every resize, in order."""
        return [(t.at_s, pool, n) for t in self.ticks for pool, n in sorted(t.resizes.items())]


def window_at(requests, now: float, window_s: float, client_delay_s: float,
              shape_changed_s: float = -math.inf) -> LoadWindow:
    """What the router's window holds at ``now``: the requests that arrived in the last ``window_s``
    seconds with the tokens generated so far; a finished one with the TTFT and TPOT its client saw; the
    shape last changed at ``shape_changed_s``."""
    clock = [0.0]
    window = LoadWindow(window_s, clock=lambda: clock[0])
    window.measured_since = shape_changed_s
    seen = sorted((r for r in requests if now - window_s <= r.arrival_s <= now), key=lambda r: r.arrival_s)
    for r in seen:
        clock[0] = r.arrival_s
        window.admitted(str(r.index), r.prompt_tokens)
    clock[0] = now
    for r in seen:
        finished = not math.isnan(r.finish_s) and r.finish_s + client_delay_s <= now
        ttft = tpot = None
        if finished:
            ttft = r.first_token_s + client_delay_s - r.arrival_s
            tpot = (r.finish_s - r.first_token_s) / (r.generated - 1) if r.generated > 1 else 0.0
        window.generated(str(r.index), r.generated, finished, ttft, tpot)
        window.speculated(str(r.index), r.accepted_tokens, r.draft_rejections)
        window.cached(str(r.index), r.cached_tokens)
    return window


def simulate_elastic(profile: Profile, config: SimConfig, trace: list[RequestSpec], slo: SLOTarget,
                     autoscale: AutoscaleSection, startup_s: float = 30.0, seed: int = 0,
                     time_limit_s: float | None = None, switch_s: float | None = None) -> ElasticResult:
    """Simulate ``trace`` on ``config`` (the starting shape) with the online planner resizing its pools within
    ``autoscale``'s bounds (every pool needs ``max_instances``) toward ``slo`` (see the module doc).
    ``switch_s``: instances may change role too (``Simulation.switch_instance``), serving in their new pool
    this long after they drained; None: pools change by adding and removing instances only."""
    if startup_s < 0:
        raise ValueError(f"startup_s: must be >= 0, got {startup_s}")
    if switch_s is not None and (switch_s < 0 or config.mode != "disaggregated"):
        raise ValueError(f"switch_s: must be >= 0 on a disaggregated config, or None, got {switch_s}")
    sim = Simulation(profile, config, seed)
    bounds = autoscale.planning_bounds(sim.pools())
    for pool, (lo, hi) in bounds.items():
        n = getattr(config, pool).instances
        if not lo <= n <= hi:
            raise ValueError(f"{pool}.instances: the starting shape's {n} is outside autoscale.{pool} [{lo}, {hi}]")
    planner = OnlinePlanner(profile, config, slo, bounds, autoscale.decision_time_limit_s,
                            switchable=switch_s is not None, role_changes_only=autoscale.role_changes_only)
    policy = ScalePolicy(autoscale.cooldown_s, autoscale.scale_down_after, clock=lambda: sim.now)
    ticks: list[PlanTick] = []
    changed = [-math.inf]  # when the shape last changed (an added instance: once it serves)

    def tick() -> None:
        if not sim.open_requests:
            return  # the trace is done
        now = sim.now
        window = window_at(sim.requests, now, autoscale.window_s, sim.client_delay_s, changed[0])
        summary = window.summary()
        current = {pool: sim.pool_size(pool) for pool in bounds}
        if summary["requests"] < autoscale.min_window_requests:
            decision = planner.smallest(summary, current)
        else:
            plan_trace, measured = window.plan_inputs(autoscale.headroom)
            acceptance = summary["acceptance"] = window.acceptance()
            decision = planner.decide(plan_trace, current, summary, measured, acceptance)
        switch = policy.switch(decision, current) if switch_s is not None else None
        if switch is not None:
            pool, n, other = switch
            while sim.pool_size(pool) < n:
                sim.switch_instance(other, pool, switch_s)
            for p in (pool, other):
                policy.acted(p, grew=p == pool)
            changed[0] = max(changed[0], now + switch_s)
            ticks.append(PlanTick(now, current, decision, {pool: n, other: sim.pool_size(other)}))
            sim.at(now + autoscale.interval_s, tick)
            return
        actions = policy.actions(decision, current)
        for pool, n in actions.items():
            grows = sim.pool_size(pool) < n
            while sim.pool_size(pool) < n:
                sim.add_instance(pool, startup_s)
            while sim.pool_size(pool) > n:
                sim.retire_instance(pool)
            policy.acted(pool, grew=grows)
            changed[0] = max(changed[0], now + startup_s if grows else now)
        ticks.append(PlanTick(now, current, decision, actions))
        sim.at(now + autoscale.interval_s, tick)

    sim.at(autoscale.interval_s, tick)
    result = sim.run(trace, time_limit_s)
    return ElasticResult(result, ticks, [InstanceSpan(i.name, i.devices, i.allocated_s, i.stopped_s)
                                         for i in sim.instances])
