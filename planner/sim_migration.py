"""Live migration in the cluster simulator: the global rescheduling policy's rounds and each migration's
cost, so plans can count on migration (no torch).

Every ``interval_s`` the simulated router reads the decode instances' loads as the real one does
(``Router.instance_loads``: running requests and their blocks, blocks held otherwise, the head-of-line
preempted request's need) and asks ``plan_migrations`` (``controller/migration_policy.py``, the real
policy) what to move. A migration then runs as in ``decode_worker/migration.py``:

* the destination reserves the request's current length plus headroom, or the migration is aborted;
* the rounds copy the KV while the request keeps decoding on its source: the profile's KV transfer model
  for the request's context gives their time;
* the stop-and-copy takes the request out of its source's batch (at a step boundary) for the copy of its
  last blocks plus the router's commit (``commit_s``); then it joins the destination's batch at its next
  step and the source frees its blocks;
* a request that finished or was preempted on its source before the stop, or that outgrew the
  destination's room, is not moved (aborted: it stays where it is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from controller.migration_policy import MigrationHistory, PolicyConfig, plan_migrations
from decode_worker.migration import headroom_tokens
from modeling.errors import OutOfBlocksError
from planner.sim_instances import DecodeSim, SimRequest, SimSequence

if TYPE_CHECKING:
    from planner.profile import FittedModel


@dataclass(frozen=True)
class SimMigration:
    """Migration in a simulation: the policy's thresholds, how often it runs, and the router's commit round
    trip beyond the copy of the last blocks (``commit_s``)."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    interval_s: float = 0.5
    commit_s: float = 0.01

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"migration.interval_s: must be > 0, got {self.interval_s}")
        if self.commit_s < 0:
            raise ValueError(f"migration.commit_s: must be >= 0, got {self.commit_s}")


@dataclass
class MigrationStats:
    committed: int = 0
    aborted: int = 0
    pauses_s: list[float] = field(default_factory=list)  # each committed request's stop-and-copy pause


class MigrationSim:
    """The policy's rounds and the migrations they start, inside one :class:`Simulation`."""

    def __init__(self, sim, config: SimMigration, transfer: FittedModel, max_k: int):
        self.sim = sim
        self.config = config
        self.transfer = transfer
        self.max_k = max_k
        self.history = MigrationHistory()
        self.moving: set[int] = set()  # request indices migrating
        self.stats = MigrationStats()

    def start(self) -> None:
        self.sim.at(self.sim.now + self.config.interval_s, self._round)

    def _round(self) -> None:
        if not self.sim.open_requests:
            return  # the trace is done: no more rounds (the event loop ends)
        now = self.sim.now
        by_name = {d.name: d for d in self.sim.decode}
        loads = [d.load(self.moving) for d in self.sim.decode]
        for plan in plan_migrations(loads, self.config.policy, now, self.history):
            self.history.record(plan.request_id, now)
            self.begin(int(plan.request_id), by_name[plan.source], by_name[plan.destination])
        self.sim.at(now + self.config.interval_s, self._round)

    def begin(self, index: int, src: DecodeSim, dst: DecodeSim) -> None:
        """Start moving request ``index`` from ``src`` to ``dst`` (nothing if it no longer runs on ``src``;
        aborted if ``dst`` has no room)."""
        seq = src.seqs.get(index)
        if seq is None or seq.request_id not in src.scheduler.running:
            return
        req = seq.req
        capacity = req.context + headroom_tokens(self.max_k, dst.block_size)
        landing = SimSequence(req, dst.block_size)
        if not dst.scheduler.reserve(landing, capacity):
            self.stats.aborted += 1
            return
        self.moving.add(index)
        copy_s = self.transfer.predict({"passes": 1.0, "tokens": float(req.context)})
        self.sim.at(self.sim.now + copy_s,
                    lambda: src.between_steps(lambda: self._stop(req, src, dst, landing, capacity)))

    def _stop(self, req: SimRequest, src: DecodeSim, dst: DecodeSim, landing: SimSequence, capacity: int) -> None:
        seq = src.seqs.get(req.index)
        if not math.isnan(req.finish_s) or seq is None or seq.request_id not in src.scheduler.running \
                or req.context + 1 > capacity:
            self._abort(req, dst, landing)
            return
        del src.scheduler.running[seq.request_id]  # out of the source's batch; its blocks stay for the last copy
        last = self.transfer.predict({"passes": 1.0, "tokens": float(2 * src.block_size)})
        pause = last + self.config.commit_s
        self.sim.at(self.sim.now + pause, lambda: self._commit(req, src, dst, seq, landing, pause))

    def _commit(self, req: SimRequest, src: DecodeSim, dst: DecodeSim, seq: SimSequence, landing: SimSequence,
                pause: float) -> None:
        try:
            landing.block_table.ensure_capacity(dst.scheduler.pool, req.context + 1)
        except OutOfBlocksError:  # the destination filled up meanwhile: the request goes on at its source
            src.scheduler.start(seq)
            src.kick()
            self._abort(req, dst, landing)
            return
        src.scheduler.finish(src.seqs.pop(req.index))
        dst.seqs[req.index] = landing
        dst.ready.append(landing)
        req.decode = dst
        src.assigned.discard(req.index)
        dst.assigned.add(req.index)
        req.placed.append(dst)
        self.moving.discard(req.index)
        self.stats.committed += 1
        self.stats.pauses_s.append(pause)
        dst.kick()

    def _abort(self, req: SimRequest, dst: DecodeSim, landing: SimSequence) -> None:
        dst.scheduler.finish(landing)
        self.moving.discard(req.index)
        self.stats.aborted += 1
