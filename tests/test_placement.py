"""Decode placement on plain objects: the rescheduling policy's order over the instances' pushed load reports,
with requests placed since a report counted on top of it, as the router and the simulator use it."""

from __future__ import annotations

from dataclasses import dataclass

from controller.migration_policy import InstanceLoad, PolicyConfig, RequestLoad, pick_instance, placement_order
from controller.placement import decode_order, instance_load, record_placement, record_report
from controller.request_state import RequestState
from controller.routing import Instance
from decode_worker.messages import PoolLoad

CFG = PolicyConfig()


def load(name, total, *blocks, draining=False, held=0):
    return InstanceLoad(name, total, tuple(RequestLoad(f"{name}-{i}", b) for i, b in enumerate(blocks)), 0, draining,
                        held)


@dataclass
class _Record:
    state: RequestState


@dataclass
class _Active:  # the fields of the router's request that the placement reads
    decode: Instance
    record: _Record
    priority: int = 0
    migration: object = None


def test_the_order_puts_room_first_then_free_blocks_then_the_rest_never_a_draining_instance():
    full = load("full", 100, 95)  # 5 free
    busy = load("busy", 1000, 300, 300, 300)  # 100 free, freeness 25
    idle = load("idle", 1000, 100)  # freeness 450
    gone = load("gone", 4000, draining=True)
    assert placement_order([full, busy, idle, gone], 50, CFG) == ["idle", "busy", "full"]
    # a high-priority request needs room for its headroom (64 blocks) too: the freer "tight" (70 blocks per
    # request) comes after "roomy" (22), which has that room, but before "full", which lacks the blocks
    tight, roomy = load("tight", 200, 60), load("roomy", 1000, *[100] * 8)
    assert placement_order([tight, roomy, full], 100, CFG) == ["tight", "roomy", "full"]
    assert placement_order([tight, roomy, full], 100, CFG, priority=1) == ["roomy", "tight", "full"]
    # ties go by name; pick_instance is the head of the order when it has the blocks free
    assert placement_order([load("b", 100), load("a", 100)], 10, CFG) == ["a", "b"]
    assert pick_instance([load("b", 100), load("a", 100)], 10, CFG) == "a"
    assert pick_instance([full], 50, CFG) is None and placement_order([full], 50, CFG) == ["full"]


def _decode(name, total_blocks, running=None, holds=(), held=0):
    inst = Instance(name, "decode", handle=None)
    record_report(inst, PoolLoad(total_blocks, 16, dict(running or {}), held, 0, frozenset(holds)))
    return inst


def test_requests_placed_since_the_last_report_count_so_a_burst_spreads():
    a, b = _decode("decode-0", 100), _decode("decode-1", 100)
    placed = []
    for i in range(4):  # 4 prompts of 320 tokens (21 blocks with the first decode step), no report in between
        order, has_room = decode_order([a, b], 320, 0, CFG, {})
        assert has_room
        order[0].assigned.add(f"r{i}")
        record_placement(order[0], f"r{i}", 320)
        placed.append(order[0].name)
    assert placed == ["decode-0", "decode-1", "decode-0", "decode-1"]
    assert instance_load(a, a.load, {}).held_blocks == 42
    # the next report holds r0 (its KV arriving: held blocks) but not yet r2: only r2 still counts on top
    record_report(a, PoolLoad(100, 16, {}, 21, 0, frozenset({"r0"})))
    assert a.placed == {"r2": 21} and instance_load(a, a.load, {}).held_blocks == 42
    # a request that ended (no longer assigned) stops counting
    a.assigned.discard("r2")
    assert instance_load(a, a.load, {}).held_blocks == 21
    # no room left by the reports: the order still lists every instance, but the first has no room
    full = _decode("decode-2", 10, held=10)
    order, has_room = decode_order([full], 320, 0, CFG, {})
    assert [i.name for i in order] == ["decode-2"] and not has_room


def test_only_requests_decoding_there_without_a_migration_count_as_movable():
    inst = _decode("decode-0", 100, running={"moves": 5, "migrating": 6, "elsewhere": 7, "unknown": 8})
    other = Instance("decode-1", "decode", handle=None)
    active = {"moves": _Active(inst, _Record(RequestState.DECODING), priority=1),
              "migrating": _Active(inst, _Record(RequestState.MIGRATING), migration=object()),
              "elsewhere": _Active(other, _Record(RequestState.DECODING))}
    view = instance_load(inst, inst.load, active)
    assert view.running == (RequestLoad("moves", 5, 1),)
    assert view.held_blocks == 6 + 7 + 8


def test_until_every_instance_has_reported_the_order_is_by_fewest_assigned():
    reported, fresh = _decode("decode-0", 100), Instance("decode-1", "decode", handle=None)
    reported.assigned.update({"x", "y"})
    fresh.assigned.add("z")
    order, has_room = decode_order([reported, fresh], 10, 0, CFG, {})
    assert [i.name for i in order] == ["decode-1", "decode-0"] and has_room
    fresh.draining = True
    assert [i.name for i in decode_order([reported, fresh], 10, 0, CFG, {})[0]] == ["decode-0"]
