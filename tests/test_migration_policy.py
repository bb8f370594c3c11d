"""The global rescheduling policy (Llumnix's virtual usage and freeness) on plain objects: load balance,
de-fragmentation, priority headroom, draining, rate limits and no ping-pong."""

from __future__ import annotations

import math

import pytest

from controller.migration_policy import (InstanceLoad, MigrationHistory, PolicyConfig, RequestLoad, freeness,
                                         pick_instance, plan_migrations, virtual_usage)

CFG = PolicyConfig(migrate_out_freeness=8, migrate_in_freeness=32, priority_headroom_blocks=64,
                   max_migrations_per_round=4, cooldown_s=30)


def inst(name, total, *blocks, waiting=0, draining=False, priority=()):
    running = tuple(RequestLoad(f"{name}-r{i}", b, priority[i] if i < len(priority) else 0) for i, b in enumerate(blocks))
    return InstanceLoad(name, total, running, waiting, draining)


def test_virtual_usage_and_freeness():
    a = inst("a", 1000, 100, 200, priority=(0, 1))
    assert virtual_usage(a, CFG) == 300 + 64
    assert freeness(a, CFG) == pytest.approx((1000 - 364) / 3)
    assert virtual_usage(inst("b", 1000, 100, waiting=500), CFG) == 600
    assert freeness(inst("c", 1000, 10, draining=True), CFG) == -math.inf
    assert freeness(inst("d", 100), CFG) == 100  # empty: the whole cache for the next request


def test_new_requests_go_to_the_freest_instance_with_room():
    busy, idle = inst("busy", 1000, 400, 400), inst("idle", 1000, 100)
    assert pick_instance([busy, idle], 50, CFG) == "idle"
    assert pick_instance([busy, inst("idle", 1000, 100, draining=True)], 50, CFG) == "busy"  # never a draining one
    assert pick_instance([inst("x", 100, 90), inst("y", 100, 95)], 20, CFG) is None  # no instance has 20 free
    assert pick_instance([inst("w", 1000, 100, waiting=850)], 100, CFG) is None  # the waiting prompt's blocks
    # a high-priority request prefers where its headroom fits, even when that instance is a little less free
    tight, roomy = inst("tight", 200, 60), inst("roomy", 1000, *[100] * 8)  # freeness 70 vs 22
    assert pick_instance([tight, roomy], 100, CFG, priority=1) == "roomy"


def test_load_balance_moves_the_cheapest_request_from_the_fullest_to_the_freest():
    full = inst("full", 1000, 300, 250, 200, 200)  # 50 free / 5 = 10
    cfg = PolicyConfig(migrate_out_freeness=12, migrate_in_freeness=32)
    idle = inst("idle", 1000, 100)  # 900 / 2 = 450
    (m,) = plan_migrations([full, idle], cfg, now=0.0)
    assert (m.source, m.destination, m.request_id, m.blocks) == ("full", "idle", "full-r2", 200)  # fewest blocks, first by id


def test_defragmentation_makes_room_for_a_waiting_request():
    """Both instances have 300 free blocks; a 500-block prompt waits on ``a``: a request moves off ``a``."""
    a = inst("a", 1000, 200, 200, 300, waiting=500)
    b = inst("b", 1000, 300, 400)
    assert freeness(a, CFG) < CFG.migrate_out_freeness
    plans = plan_migrations([a, b], PolicyConfig(migrate_out_freeness=8, migrate_in_freeness=32, cooldown_s=30), 0.0)
    assert [(m.source, m.destination, m.blocks) for m in plans] == [("a", "b", 200)]


def test_high_priority_requests_keep_headroom_and_stay_put():
    """The instance of a high-priority request sheds its normal requests first."""
    a = inst("a", 600, 150, 150, 200, priority=(0, 1, 0))  # virtual 564: freeness 9
    b = inst("b", 2000)
    (m,) = plan_migrations([a, b], PolicyConfig(migrate_out_freeness=10, migrate_in_freeness=32), 0.0)
    assert m.request_id == "a-r0"  # the normal request, not the high-priority one


def apply(instances: dict[str, InstanceLoad], m) -> None:
    """Carry out migration ``m`` on the reports (the request leaves its source, joins its destination)."""
    src, dst = instances[m.source], instances[m.destination]
    req = next(r for r in src.running if r.request_id == m.request_id)
    instances[m.source] = InstanceLoad(src.name, src.total_blocks, tuple(r for r in src.running if r is not req),
                                       src.waiting_blocks, src.draining)
    instances[m.destination] = InstanceLoad(dst.name, dst.total_blocks, dst.running + (req,), dst.waiting_blocks,
                                            dst.draining)


def test_draining_moves_everything_away_over_rounds_without_ping_pong():
    cfg = PolicyConfig(migrate_out_freeness=8, migrate_in_freeness=32, max_migrations_per_round=4, cooldown_s=30)
    loads = {"a": inst("a", 1000, 50, 60, 70, draining=True), "b": inst("b", 1000, 100), "c": inst("c", 1000)}
    history, moved = MigrationHistory(), []
    for now in range(5):
        plans = plan_migrations(list(loads.values()), cfg, float(now), history)
        assert len({m.destination for m in plans}) == len(plans)  # one into each destination per round
        assert len([m for m in plans if m.source == "a"]) <= 1  # one out of each source per round
        for m in plans:
            history.record(m.request_id, float(now))
            apply(loads, m)
            moved.append(m)
    assert not loads["a"].running and len(moved) == 3
    assert all(m.source == "a" for m in moved)  # nothing moved back or between the destinations
    assert pick_instance(list(loads.values()), 10, cfg) != "a"


def test_recently_moved_requests_stay_and_rounds_are_capped():
    cfg = PolicyConfig(migrate_out_freeness=50, migrate_in_freeness=60, max_migrations_per_round=2, cooldown_s=30)
    sources = [inst(f"s{i}", 300, 100, 100) for i in range(4)]  # freeness 100 / 3 = 33 < 50
    dests = [inst(f"d{i}", 5000) for i in range(4)]
    plans = plan_migrations(sources + dests, cfg, now=0.0)
    assert len(plans) == 2
    history = MigrationHistory()
    for s in sources:
        for r in s.running:
            history.record(r.request_id, 0.0)
    assert plan_migrations(sources + dests, cfg, now=10.0, history=history) == []  # all within the cooldown
    assert len(plan_migrations(sources + dests, cfg, now=31.0, history=history)) == 2


def test_no_move_that_would_only_swap_the_roles():
    """A move happens only if the destination stays freer than the source will be; otherwise the request
    would bounce back next round (ping-pong)."""
    cfg = PolicyConfig(migrate_out_freeness=250, migrate_in_freeness=300, cooldown_s=0)
    lone = inst("src", 1000, 600)  # freeness 200: sheds
    empty = inst("dst", 1000)  # freeness 1000: takes
    assert plan_migrations([lone, empty], cfg, 0.0) == []  # dst would end at 200, src at 1000
    two = inst("src", 1000, 600, 150)  # freeness 250 / 3 = 83: the small request can go
    (m,) = plan_migrations([two, empty], cfg, 0.0)
    assert m.request_id == "src-r1"


def test_config_is_validated():
    with pytest.raises(ValueError, match="migrate_in_freeness: must be > migrate_out_freeness"):
        PolicyConfig(migrate_out_freeness=10, migrate_in_freeness=5)
    with pytest.raises(ValueError, match="cooldown_s"):
        PolicyConfig(cooldown_s=-1)
