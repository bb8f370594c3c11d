"""Which decode instance a request goes to: each decode instance's pool load (``PoolLoad``, pushed with its
outputs whenever it changes) read through the global rescheduling policy (``controller/migration_policy.py``).
New requests and live migrations' destinations are chosen by this one reading.

A report is as old as the instance's last step; requests placed on an instance since it was made count as
held there (the blocks of their prompt and first decode step), so a burst of arrivals spreads over the pool
instead of all going to the instance that looked freest. The instance's own reservation stays the authority:
a placement it refuses falls back to the next instance in the order.
"""

from __future__ import annotations

from typing import Mapping

from controller.kv_index import cached_first
from controller.migration_policy import InstanceLoad, PolicyConfig, RequestLoad, placement_order
from controller.request_state import RequestState
from controller.routing import Instance
from decode_worker.messages import PoolLoad


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks holding ``num_tokens`` positions."""
    return -(-num_tokens // block_size)


def record_report(inst: Instance, report: PoolLoad) -> None:
    """Keep the instance's latest report; placements it already counts stop being added on top."""
    inst.load = report
    inst.placed = {rid: b for rid, b in inst.placed.items() if rid not in report.holds and rid in inst.assigned}


def record_placement(inst: Instance, request_id: str, num_tokens: int) -> None:
    """A request now held (or being held) on ``inst`` for ``num_tokens`` positions and its first decode step."""
    if inst.load is not None:
        inst.placed[request_id] = blocks_for(num_tokens + 1, inst.load.block_size)


def instance_load(inst: Instance, report: PoolLoad, active: Mapping) -> InstanceLoad:
    """``inst`` as the policy reads it. A running request counts as movable (with its priority) only while the
    router sees it decoding there with no migration under way; every other block counts as held, and so do
    the requests placed since the report was made."""
    movable, held = [], report.held_blocks
    for rid, blocks in report.running.items():
        a = active.get(rid)
        if a is not None and a.decode is inst and a.migration is None and a.record.state is RequestState.DECODING:
            movable.append(RequestLoad(rid, blocks, a.priority))
        else:
            held += blocks
    held += sum(b for rid, b in inst.placed.items() if rid not in report.holds and rid in inst.assigned)
    return InstanceLoad(inst.name, report.total_blocks, tuple(movable), report.waiting_blocks, inst.draining, held)


def decode_order(instances: list[Instance], num_tokens: int, priority: int, policy: PolicyConfig,
                 active: Mapping, cached: Mapping[str, float] | None = None,
                 overlap_weight: float = 1.0) -> tuple[list[Instance], bool]:
    """The alive, not draining decode instances in the order a request of ``num_tokens`` prompt positions
    tries them, and whether the first has the blocks free by its report. Until every one has reported
    (just started), the order is by fewest assigned requests. ``cached``: the prompt tokens' worth of computing
    each instance's cache spares (by name: ``Cached.saved``); where any does, the instances with room come first,
    cheapest first by ``controller/kv_index.cached_first`` (blocks to compute against blocks in use)."""
    cached = cached or {}
    open_ = [i for i in instances if i.alive and not i.draining]
    if not open_ or any(i.load is None for i in open_):
        return sorted(open_, key=lambda i: (-cached.get(i.name, 0), len(i.assigned))), True
    loads = {i.name: instance_load(i, i.load, active) for i in open_}
    block_size = open_[0].load.block_size
    blocks = blocks_for(num_tokens + 1, block_size)
    by_name = {i.name: i for i in open_}
    order = [by_name[n] for n in placement_order(list(loads.values()), blocks, policy, priority)]
    order = cached_first(order, num_tokens + 1, block_size, lambda i: cached.get(i.name, 0),
                         lambda i: loads[i.name].used_blocks, lambda i: loads[i.name].free_blocks, overlap_weight)
    return order, bool(order) and loads[order[0].name].free_blocks >= blocks
