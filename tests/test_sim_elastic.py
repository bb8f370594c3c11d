"""Resizing a simulated cluster: an added instance serves after its start-up and holds devices from the
resize; a retired decode instance live-migrates its requests away and a retired prefill instance finishes
its prompts, with every request completing; a leaving instance hands back the prompts it has not begun; the
online planner's walk on large bounds; and the closed loop (``planner/sim_elastic.py``) growing a cluster under
a step up in load and shrinking it after."""

from __future__ import annotations

import math
import os

import pytest

from controller.config import AutoscaleSection, PoolBounds
from decode_worker.config import SpeculationConfig
from planner.online import OnlinePlanner
from planner.profile import Profile
from planner.search import SLOTarget
from planner.sim_elastic import simulate_elastic
from planner.simulator import PoolPlan, SimConfig, SimConfigError, Simulation
from planner.workload import RequestSpec, make_trace, workload_shape

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = os.path.join(REPO, "benchmarks", "results", "profile_h100_llama31_8b.json")
NO_SPEC = SpeculationConfig(drafter="none")


@pytest.fixture(scope="module")
def profile():
    return Profile.load(PROFILE)


def config(prefill: int, decode: int) -> SimConfig:
    return SimConfig("disaggregated", prefill=PoolPlan(prefill, 1, 200000, 2048, 64),
                     decode=PoolPlan(decode, 1, 200000, 1, 128), speculation=NO_SPEC, max_concurrent=100000)


def all_complete(result) -> bool:
    return all(r.finished and r.completion_tokens == r.output_tokens for r in result.records)


def test_an_added_instance_serves_after_its_start_up_and_holds_devices_from_the_resize(profile):
    trace = make_trace(workload_shape("chat"), 40.0, 400, seed=3)
    sim = Simulation(profile, config(1, 1))
    sim.at(2.0, lambda: sim.add_instance("decode", startup_s=3.0))
    seen = {}
    sim.at(4.9, lambda: seen.update(before=[d.name for d in sim.decode], size=sim.pool_size("decode")))
    sim.at(5.1, lambda: seen.update(after=[d.name for d in sim.decode]))
    result = sim.run(trace)
    assert seen == {"before": ["decode-0"], "size": 2, "after": ["decode-0", "decode-1"]}
    added = next(i for i in sim.instances if i.name == "decode-1")
    assert added.allocated_s == 2.0 and added.assigned == set()
    served = [r for r in sim.requests if r.decode is added]
    assert served and min(r.arrival_s for r in served) >= 4.9  # nothing placed there before it joined at 5 s
    assert all_complete(result)
    assert result.device_seconds == pytest.approx(2 * result.duration_s + (result.duration_s - 2.0))


def test_retired_instances_leave_without_losing_a_request(profile):
    trace = make_trace(workload_shape("chat"), 40.0, 400, seed=4)
    sim = Simulation(profile, config(2, 3))
    names, running = {}, {}

    def retire():
        victim = min(reversed(sim.decode), key=lambda d: len(d.assigned))
        running["decode"] = len(victim.scheduler.running)
        names["decode"] = sim.retire_instance("decode")
        names["prefill"] = sim.retire_instance("prefill")

    sim.at(4.0, retire)
    result = sim.run(trace)
    assert all_complete(result)
    gone = {i.name: i for i in sim.instances if i.leaving}
    assert set(gone) == set(names.values()) and running["decode"] > 0
    assert all(4.0 <= i.stopped_s < result.duration_s for i in gone.values())
    assert len(sim.decode) == 2 and len(sim.prefill) == 1
    moved = [r for r in sim.requests if any(i.name == names["decode"] for i in r.placed) and r.decode.name != names["decode"]]
    assert moved  # its running requests finished elsewhere, by live migration
    assert result.device_seconds < 5 * result.duration_s
    with pytest.raises(SimConfigError, match="prefill: cannot retire the pool's last instance"):
        sim.retire_instance("prefill")


def test_the_walk_plans_a_large_cluster_in_few_simulations(profile):
    base = SimConfig("disaggregated", prefill=PoolPlan(1, 1, 200000, 2048, 64), decode=PoolPlan(1, 1, 200000, 1, 128),
                     speculation=NO_SPEC, max_concurrent=100000)
    planner = OnlinePlanner(profile, base, SLOTarget(0.5, 0.05, 0.9), {"prefill": (1, 32), "decode": (1, 32)},
                            time_limit_s=60.0)
    trace = make_trace(workload_shape("long_doc"), 150.0, 1500, seed=5)
    d = planner.decide(trace, {"prefill": 1, "decode": 1})
    assert d.met and d.shape["prefill"] > 4
    assert len(d.predicted) <= 2 * (sum(d.shape.values()) - 2) + 3  # two simulations a step, not 1024 shapes
    for pool in d.shape:  # a smallest shape: one instance fewer anywhere misses
        fewer = {**d.shape, pool: d.shape[pool] - 1}
        assert fewer[pool] < 1 or not planner.predict(fewer, trace)[0]


def test_the_planner_grows_the_cluster_for_a_step_up_in_load_and_shrinks_it_after(profile):
    rates = ((5.0, 60.0), (40.0, 90.0), (5.0, 120.0))
    trace, start = [], 0.0
    for i, (rate, seconds) in enumerate(rates):
        trace += [RequestSpec(start + r.arrival_s, r.prompt_tokens, r.output_tokens)
                  for r in make_trace(workload_shape("long_doc"), rate, int(rate * seconds * 2), seed=i)
                  if r.arrival_s < seconds]
        start += seconds
    autoscale = AutoscaleSection(prefill=PoolBounds(1, 8), decode=PoolBounds(1, 4), interval_s=10.0, window_s=30.0,
                                 cooldown_s=20.0, scale_down_after=2, decision_time_limit_s=30.0)
    slo = SLOTarget(1.0, 0.05, 0.9)
    run = simulate_elastic(profile, config(1, 1), trace, slo, autoscale, startup_s=10.0)
    assert all_complete(run.result)
    grew = [(t, n) for t, pool, n in run.resizes() if pool == "prefill" and n > 1]
    assert grew and 60.0 <= grew[0][0] <= 90.0  # within the busy phase's first 30 s
    peak = max(run.devices_at(t) for t, _, _ in run.resizes())
    assert peak >= 3 and run.devices_at(run.result.duration_s - 1e-6) < peak  # back down in the calm
    assert run.result.device_seconds < peak * run.result.duration_s
    assert [t.at_s for t in run.ticks] == [10.0 * (k + 1) for k in range(len(run.ticks))]
    assert all(not math.isnan(t.decision.attainment) or not t.decision.predicted for t in run.ticks)


def test_an_instance_changes_role_on_the_devices_it_holds(profile):
    """A prefill instance switched to decoding finishes its prompts, then serves in the decode pool after the
    switch time; the cluster holds three devices throughout and every request completes."""
    trace = make_trace(workload_shape("chat"), 40.0, 400, seed=5)
    sim = Simulation(profile, config(2, 1))
    left = []
    sim.at(2.0, lambda: left.append(sim.switch_instance("prefill", "decode", switch_s=1.0)))
    seen = {}
    sim.at(2.0 + 1e-6, lambda: seen.update(sizes={p: sim.pool_size(p) for p in ("prefill", "decode")}))
    result = sim.run(trace)
    assert seen["sizes"] == {"prefill": 1, "decode": 2}  # counted in its new pool from the decision on
    assert [d.name for d in sim.decode] == ["decode-0", "decode-1"] and len(sim.prefill) == 1
    old = next(i for i in sim.instances if i.name == left[0])
    new = next(i for i in sim.instances if i.name == "decode-1")
    assert old.stopped_s >= 2.0 and new.allocated_s == old.stopped_s
    assert any(r.decode is new for r in sim.requests)  # it decodes requests in its new role
    assert all_complete(result)
    assert result.device_seconds == pytest.approx(3 * result.duration_s)


def test_an_instance_leaving_its_pool_hands_back_the_prompts_it_has_not_begun(profile):
    """A prefill instance switched to decoding under a backlog of long prompts: the ones waiting in its queue
    are placed anew at once (on the other prefill instance), it finishes only the prompts it has begun, and
    every request completes."""
    trace = make_trace(workload_shape("long_doc"), 40.0, 300, seed=6)
    sim = Simulation(profile, config(2, 1))
    seen = {}

    def switch():
        victim = min(reversed(sim.prefill), key=lambda p: len(p.assigned))
        seen.update(victim=victim, waiting=[s.req for s in victim.scheduler.waiting])
        sim.switch_instance("prefill", "decode", switch_s=1.0)

    def after():
        victim, other = seen["victim"], sim.prefill[0]
        seen.update(left=len(victim.scheduler.waiting), placed=all(r.index in other.assigned for r in seen["waiting"]),
                    held=[r for r in seen["waiting"] if r.index in victim.assigned])

    sim.at(2.0, switch)
    sim.at(2.0 + 1e-6, after)
    result = sim.run(trace)
    assert len(seen["waiting"]) >= 2 and seen["left"] == 0 and seen["placed"] and not seen["held"]
    assert all_complete(result)


def test_a_decode_instance_leaving_hands_back_the_local_prefills_it_has_not_begun(profile):
    """No prefill instance: the decode instances prefill every prompt. One leaves under a backlog: the prompts no
    step of it has begun go to the other at once, it keeps the one it is computing, and every request completes."""
    trace = make_trace(workload_shape("long_doc"), 40.0, 200, seed=7)
    sim = Simulation(profile, config(0, 2))
    seen = {}

    def retire():
        victim = min(reversed(sim.decode), key=lambda d: len(d.assigned))
        seen.update(victim=victim, queued=[s.req for s in victim.prefilling],
                    begun=[s.req for s in victim.prefilling if s.num_computed > s.req.decode_cached])
        sim.retire_instance("decode")
        other = sim.decode[0]
        seen.update(kept=len(victim.prefilling), moved=[r for r in seen["queued"] if r.index in other.assigned])

    sim.at(2.0, retire)
    result = sim.run(trace)
    assert len(seen["queued"]) >= 3 and seen["kept"] == len(seen["begun"]) == 1
    assert len(seen["moved"]) == len(seen["queued"]) - 1
    assert all_complete(result)
