"""Global rescheduling policy over decode instances (Llumnix's virtual usage and freeness).

Plain Python, no torch, no Ray: its input is the decode instances' load reports, its output the requests
to place and the migrations to carry out. Each instance reports its total KV blocks, its running requests (blocks held, priority) and
the blocks its head-of-line waiting request needs. The policy then sees each instance through its
*virtual usage*, which folds every goal into one load figure:

* a running request counts its physical blocks;
* the head-of-line request that does not fit counts the blocks it needs: an instance that cannot admit
  it looks full, so requests migrate away and the free blocks come together (de-fragmentation);
* a high-priority request also counts ``priority_headroom_blocks``: its instance looks fuller than it
  is, so others move away and leave it room to grow;
* a draining instance counts as infinitely full: everything migrates away, and nothing is placed there.

*Freeness* = (total blocks - virtual usage) / (running requests + 1): the decode steps of room per
request. New requests go to the freest instance with room (:func:`placement_order`, :func:`pick_instance`).
:func:`plan_migrations` pairs the least free instances (below ``migrate_out_freeness``, or draining) with the freest (above
``migrate_in_freeness``) and moves one request per pair: the cheapest to move (fewest blocks) of the
lowest priority. Migrations are rate-limited (one out of and one into an instance per round, at most
``max_migrations_per_round``) and never ping-pong: a request moved within ``cooldown_s`` stays put, and a
move happens only when the destination stays at least as free after it as the source will be (moving it back
could then only make the less free side worse).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestLoad:
    """One running request on an instance: the KV blocks it holds and its priority (0 = normal, higher
    = more important)."""

    request_id: str
    blocks: int
    priority: int = 0


@dataclass(frozen=True)
class InstanceLoad:
    """A decode instance's load report. ``waiting_blocks``: the blocks its head-of-line waiting request
    needs and cannot get now (0: nothing waits, or it fits)."""

    name: str
    total_blocks: int
    running: tuple[RequestLoad, ...] = ()
    waiting_blocks: int = 0
    draining: bool = False
    held_blocks: int = 0  # held by requests that cannot move now (KV arriving, migrating, preempted)

    @property
    def used_blocks(self) -> int:
        return sum(r.blocks for r in self.running) + self.held_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks free for a newcomer: not held, and not needed by the waiting head-of-line request."""
        return self.total_blocks - self.used_blocks - self.waiting_blocks


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds of the policy (freeness is in blocks per running request)."""

    migrate_out_freeness: float = 8.0  # an instance below this sheds load
    migrate_in_freeness: float = 32.0  # an instance above this takes load
    priority_headroom_blocks: int = 64  # reserved on the instance of each high-priority request
    max_migrations_per_round: int = 4
    cooldown_s: float = 30.0  # a request moved recently is not moved again within this long

    def __post_init__(self) -> None:
        if not self.migrate_in_freeness > self.migrate_out_freeness:
            raise ValueError(f"migrate_in_freeness: must be > migrate_out_freeness ({self.migrate_out_freeness}), "
                             f"got {self.migrate_in_freeness}")
        for name in ("priority_headroom_blocks", "max_migrations_per_round"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown_s: must be >= 0, got {self.cooldown_s}")


@dataclass(frozen=True)
class Migration:
    """Move ``request_id`` (holding ``blocks``) from ``source`` to ``destination``."""

    request_id: str
    source: str
    destination: str
    blocks: int


@dataclass
class MigrationHistory:
    """When each request last moved (the anti-ping-pong memory); the caller records what it started."""

    moved_at: dict[str, float] = field(default_factory=dict)

    def record(self, request_id: str, now: float) -> None:
        self.moved_at[request_id] = now

    def recent(self, request_id: str, now: float, cooldown_s: float) -> bool:
        at = self.moved_at.get(request_id)
        return at is not None and now - at < cooldown_s

    def forget(self, request_id: str) -> None:
        """The request finished: its entry is no longer needed."""
        self.moved_at.pop(request_id, None)


def virtual_usage(inst: InstanceLoad, cfg: PolicyConfig) -> float:
    """Blocks the instance counts as used (see the module docstring); infinite while draining."""
    if inst.draining:
        return math.inf
    headroom = sum(cfg.priority_headroom_blocks for r in inst.running if r.priority > 0)
    return inst.used_blocks + inst.waiting_blocks + headroom


def freeness(inst: InstanceLoad, cfg: PolicyConfig) -> float:
    """(total - virtual usage) / (running + 1): negative when overloaded, -inf while draining."""
    return (inst.total_blocks - virtual_usage(inst, cfg)) / (len(inst.running) + 1)


def placement_order(instances: list[InstanceLoad], blocks: int, cfg: PolicyConfig, priority: int = 0) -> list[str]:
    """The instances a new request needing ``blocks`` tries, in order, never a draining one: those with room
    for it (a high-priority request counts its own headroom too) first, then those with the blocks free, then
    the rest (a report may be stale: the instance's own reservation decides), each group freest first (ties: by
    name)."""
    need = blocks + (cfg.priority_headroom_blocks if priority > 0 else 0)

    def group(inst: InstanceLoad) -> int:
        if inst.free_blocks < blocks:
            return 2
        return 0 if inst.total_blocks - virtual_usage(inst, cfg) >= need else 1

    ranked = sorted((i for i in instances if not i.draining), key=lambda i: (group(i), -freeness(i, cfg), i.name))
    return [i.name for i in ranked]


def pick_instance(instances: list[InstanceLoad], blocks: int, cfg: PolicyConfig, priority: int = 0) -> str | None:
    """Where a new request needing ``blocks`` goes: the first of :func:`placement_order` when it has the
    blocks free (None: no instance has)."""
    order = placement_order(instances, blocks, cfg, priority)
    if not order:
        return None
    first = next(i for i in instances if i.name == order[0])
    return first.name if first.free_blocks >= blocks else None


def _after(inst: InstanceLoad, delta: RequestLoad, cfg: PolicyConfig, adding: bool) -> float:
    """The instance's freeness once ``delta`` has moved in (``adding``) or out."""
    running = inst.running + (delta,) if adding else tuple(r for r in inst.running if r.request_id != delta.request_id)
    return freeness(InstanceLoad(inst.name, inst.total_blocks, running, inst.waiting_blocks, inst.draining,
                                 inst.held_blocks), cfg)


def plan_migrations(instances: list[InstanceLoad], cfg: PolicyConfig, now: float,
                    history: MigrationHistory | None = None) -> list[Migration]:
    """This round's migrations: the least free sources paired with the freest destinations (rules in the
    module docstring). Deterministic for the same reports."""
    history = history or MigrationHistory()
    sources = sorted((i for i in instances if (i.draining or freeness(i, cfg) < cfg.migrate_out_freeness) and i.running),
                     key=lambda i: (freeness(i, cfg), i.name))
    dests = sorted((i for i in instances if not i.draining and freeness(i, cfg) > cfg.migrate_in_freeness),
                   key=lambda i: (-freeness(i, cfg), i.name))
    plans: list[Migration] = []
    used_dests: set[str] = set()
    for src in sources:
        if len(plans) >= cfg.max_migrations_per_round:
            break
        candidates = sorted((r for r in src.running if not history.recent(r.request_id, now, cfg.cooldown_s)),
                            key=lambda r: (r.priority, r.blocks, r.request_id))
        for dst in dests:
            if dst.name in used_dests or dst.name == src.name:
                continue
            move = next((r for r in candidates if dst.free_blocks > r.blocks  # room, and a block to grow
                         and _after(dst, r, cfg, adding=True) >= _after(src, r, cfg, adding=False)), None)
            if move is not None:
                plans.append(Migration(move.request_id, src.name, dst.name, move.blocks))
                used_dests.add(dst.name)
                break
    return plans

