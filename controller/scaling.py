"""Resizing pools while serving: one action at a time, each complete or undone.

A pool grows by an instance the cluster places and starts (its own placement group, its ranks up, its KV
channels formed with every live peer) before the router sends it anything; it shrinks by an instance the
router retires without losing a request (``Router.retire``: live migration off a decode instance, a
prefill instance finishing what it holds) before the cluster stops it and gives its resources back. A
failed step leaves the pool as it was and is reported; nothing half-added or half-removed remains.

``Scaler.scale`` is what ``magicserve scale POOL N`` (the ``ScalePool`` operator call) runs. A pool sized by
hand is held at that size (``held``) until the hold is released. No torch here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from controller.config import AutoscaleSection
from controller.routing import Instance, RouterError

log = logging.getLogger("magicserve.scaling")

MAX_DECISIONS = 32  # the decisions ``status`` remembers


@dataclass(frozen=True)
class ScaleDecision:
    """One resize of a pool and how it went."""

    pool: str
    desired: int
    reason: str  # "manual", or what an automatic decision was based on
    at: float  # time.time() when it was asked for
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    error: str = ""  # why the pool did not reach ``desired`` (it was left as it stood)
    seconds: float = 0.0
    switched: tuple[str, ...] = ()  # instances that changed role, into ``pool`` or out of it to ``switch_from``
    switch_from: str = ""  # the pool that gave (or took) the switched instances
    handed_back: int = 0  # requests the instances that left or switched had not begun, placed anew elsewhere


@dataclass
class _Pool:
    desired: int
    held: bool = False  # sized by hand: an automatic decision leaves it alone


@dataclass
class Scaler:
    """Resizes the pools of one cluster through its router (see the module doc)."""

    cluster: object  # controller.cluster.Cluster (add_instance, remove_instance)
    router: object  # controller.router.Router (add_instance, retire)
    bounds: AutoscaleSection
    metrics: object = None  # controller.metrics.ServingMetrics (pool_size)
    window: object = None  # the online planner's LoadWindow (told when the shape changes), if it runs
    decisions: deque = field(default_factory=lambda: deque(maxlen=MAX_DECISIONS))
    plans: deque = field(default_factory=lambda: deque(maxlen=MAX_DECISIONS))  # the online planner's decisions
    _pools: dict = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        for role, instances in self.in_service().items():
            self._pools[role] = _Pool(len(instances))
        self._report()

    def in_service(self) -> dict[str, list[Instance]]:
        """The instances of each pool that take requests (alive or restarting, not leaving)."""
        pools = {"colocated": self.router.decode} if not self.router.kv_transfer else {
            "prefill": self.router.prefill, "decode": self.router.decode}
        return {role: [i for i in insts if not i.draining] for role, insts in pools.items()}

    def shape(self) -> dict:
        """Per pool: ``current`` instances in service, ``desired``, ``held``, and the instances' names."""
        return {role: {"current": len(insts), "desired": self._pools[role].desired, "held": self._pools[role].held,
                       "instances": [i.name for i in insts]}
                for role, insts in self.in_service().items()}

    async def scale(self, pool: str, instances: int, reason: str = "manual", hold: bool | None = None,
                    switch_from: str = "") -> ScaleDecision:
        """Bring ``pool`` to ``instances`` in service. ``hold`` (default: a manual resize holds) keeps an
        automatic decision from changing it; ``hold=False`` with the current size releases it. ``switch_from``:
        the other pool gives the instances (or takes them back), each changing role in place (``Router.switch``)
        instead of being placed or stopped, so the cluster's devices stay as they are. Raises RouterError for a
        pool or size outside the bounds; a resize that fails midway is reported in the decision's ``error`` with
        the pool left at the size it reached, every instance whole."""
        if pool not in self._pools:
            raise RouterError("INVALID_ARGUMENT", f"pool: {pool!r}; this cluster's pools: {', '.join(self._pools)}")
        self._check_bounds(pool, instances)
        if reason != "manual" and self._pools[pool].held:
            raise RouterError("FAILED_PRECONDITION", f"{pool} is held at {self._pools[pool].desired} by hand")
        other = None
        if switch_from:
            other = self._switch_target(pool, instances, switch_from, reason)
        async with self._lock:
            state = self._pools[pool]
            state.desired = instances
            state.held = (reason == "manual") if hold is None else hold
            if other is not None:
                self._pools[switch_from].desired, self._pools[switch_from].held = other, state.held
            self._report()
            t0, at = time.monotonic(), time.time()
            added, removed, switched, error, handed = [], [], [], "", 0
            try:
                while switch_from and len(self.in_service()[pool]) != instances:
                    grow = len(self.in_service()[pool]) < instances
                    victim = self._victim(switch_from if grow else pool)
                    handed += await self.router.switch(victim, pool if grow else switch_from,
                                                       self.cluster.switch_role, self.bounds.drain_timeout_s)
                    switched.append(victim.name)
                    self._report()
                while len(self.in_service()[pool]) < instances:
                    inst = await self.cluster.add_instance(pool, self.bounds.placement_timeout_s)
                    self.router.add_instance(inst)
                    added.append(inst.name)
                    self._report()
                while len(self.in_service()[pool]) > instances:
                    victim = self._victim(pool)
                    handed += await self.router.retire(victim, self.bounds.drain_timeout_s)
                    self.cluster.remove_instance(victim)
                    removed.append(victim.name)
                    self._report()
            except Exception as err:  # noqa: BLE001 - reported; the pool stays whole at the size it reached
                error = f"{type(err).__name__}: {err}"
                log.error("scaling %s to %d stopped at %d: %s", pool, instances, len(self.in_service()[pool]), error)
            if (added or removed or switched) and self.window is not None:
                self.window.shape_changed()
            decision = ScaleDecision(pool, instances, reason, at, tuple(added), tuple(removed), error,
                                     time.monotonic() - t0, tuple(switched), switch_from, handed)
            self.decisions.append(decision)
            self._report()
            return decision

    async def plan_forever(self, planner, policy, window, interval_s: float, headroom: float,
                           min_requests: int) -> None:
        """The online planner's loop: every ``interval_s``, a decision on the window's requests (simulated off
        the event loop), then the resizes the policy allows, pools sized by hand left alone. A decision or
        resize that fails is logged and the loop goes on: the cluster keeps serving at the shape it has.
        A decision that moves instances between the pools is a role change where the planner says instances can
        switch (``planner.switchable``). The server that wires it passes ``planner`` (``decide``, ``smallest``,
        ``switchable``), ``policy`` (``switch``, ``actions``, ``acted``) and ``window`` (``summary``, ``plan_inputs``, ``acceptance``): ``planner/online.py``'s
        ``OnlinePlanner``, ``ScalePolicy`` and ``LoadWindow``."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval_s)
            try:
                summary = window.summary()
                current = {role: len(insts) for role, insts in self.in_service().items()}
                if summary["requests"] < min_requests:  # too little load to plan for: the smallest shape
                    decision = planner.smallest(summary, current)
                else:
                    trace, measured = window.plan_inputs(headroom)
                    acceptance = summary["acceptance"] = window.acceptance()
                    decision = await loop.run_in_executor(None, planner.decide, trace, current, summary, measured,
                                                          acceptance)
                self.plans.append(decision)
                log.info("planner: %s -> %s (predicted attainment %.2f, met %s, latency correction %s, %.2f s; "
                         "window %s)", current, decision.shape, decision.attainment, decision.met, decision.correction,
                         decision.seconds, summary)
                if self.metrics is not None:
                    self.metrics.planned(decision.shape, decision.attainment)
                reason = (f"planner: {summary['rate']:.2f} req/s, predicted attainment "
                          f"{decision.attainment:.2f} at {decision.shape}")
                switch = policy.switch(decision, current) if planner.switchable else None
                if switch is not None and not any(self._pools[p].held for p in (switch[0], switch[2])):
                    pool, n, other = switch
                    result = await self.scale(pool, n, reason=reason, switch_from=other)
                    for p in (pool, other):
                        policy.acted(p, failed=bool(result.error), grew=p == pool)
                    if result.error:
                        log.warning("planner's role change into %s stopped: %s", pool, result.error)
                    continue
                for pool, n in policy.actions(decision, current).items():
                    if self._pools[pool].held:
                        continue
                    result = await self.scale(pool, n, reason=reason)
                    policy.acted(pool, failed=bool(result.error), grew=n > current[pool])
                    if result.error:
                        log.warning("planner's resize of %s stopped: %s", pool, result.error)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - the planner failing must not take the service down
                log.error("online planner: %s: %s", type(err).__name__, err)

    def _check_bounds(self, pool: str, instances) -> None:
        limits = getattr(self.bounds, pool)
        top = limits.max_instances
        if isinstance(instances, bool) or not isinstance(instances, int) or instances < limits.min_instances or \
                (top is not None and instances > top):
            raise RouterError("INVALID_ARGUMENT", f"instances: {instances!r} is outside autoscale.{pool} "
                                                  f"[{limits.min_instances}, {top if top is not None else 'any'}]")

    def _switch_target(self, pool: str, instances: int, switch_from: str, reason: str) -> int:
        """The size ``switch_from`` reaches when it gives ``pool`` the instances it grows by (or takes those it
        shrinks by); RouterError when the pools cannot exchange instances or that size is outside its bounds."""
        if switch_from not in self._pools or switch_from == pool:
            others = ", ".join(p for p in self._pools if p != pool) or "none"
            raise RouterError("INVALID_ARGUMENT", f"switch_from: {switch_from!r}; the pools {pool} can exchange "
                                                  f"instances with: {others}")
        problem = self.cluster.switch_problem()
        if problem is not None:
            raise RouterError("FAILED_PRECONDITION", f"switch_from: {problem}")
        if reason != "manual" and self._pools[switch_from].held:
            raise RouterError("FAILED_PRECONDITION", f"{switch_from} is held at {self._pools[switch_from].desired} "
                                                     "by hand")
        other = len(self.in_service()[switch_from]) - (instances - len(self.in_service()[pool]))
        try:
            self._check_bounds(switch_from, other)
        except RouterError as err:
            raise RouterError("INVALID_ARGUMENT", f"switch_from: {switch_from} would have {other} instances; "
                                                  f"{err}") from None
        if switch_from == "decode" and other < 1:
            raise RouterError("INVALID_ARGUMENT", "switch_from: the decode pool keeps an instance")
        return other

    def _victim(self, pool: str) -> Instance:
        """The instance to remove: a dead one first, then the one holding the fewest requests, the newest of
        those (the oldest instances keep the warmest caches)."""
        insts = self.in_service()[pool]
        return min(reversed(insts), key=lambda i: (i.alive, len(i.assigned)))

    def _report(self) -> None:
        if self.metrics is None:
            return
        for role, insts in self.in_service().items():
            self.metrics.pool_size(role, len(insts), self._pools[role].desired)
