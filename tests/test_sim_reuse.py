"""The simulator with prefix caching, on hand-made profiles: a conversation's next turn is prefilled on the
decode instance that holds the last one (its TTFT computable by hand), shared documents are computed once per
instance, later turns arrive a think time after the turn before ends, and nothing leaks."""

from __future__ import annotations

import pytest

from controller.kv_index import PrefixRouting
from planner.reuse_workload import MultiTurnShape, SharedDocsShape, multi_turn_trace, shared_docs_trace
from planner.search import NO_SPECULATION, Planner, SearchSpace, SLOTarget, Workload
from planner.simulator import PoolPlan, SimConfig, SimConfigError, Simulation
from planner.sim_migration import SimMigration
from planner.reuse_workload import ReuseRequest
from planner.workload import LengthDist, WorkloadError, make_trace, workload_shape
from tests.test_planner_sim import make_profile


def config(caching: bool, decode: int = 1, overlap_weight: float = 1.0) -> SimConfig:
    return SimConfig("disaggregated", prefill=PoolPlan(1, 1, 1 << 20, 512, 16), decode=PoolPlan(decode, 1, 1 << 20, 1, 64),
                     speculation=NO_SPECULATION, prefix_caching=PrefixRouting(True, overlap_weight) if caching else None)


def run(caching: bool, trace, decode: int = 1, overlap_weight: float = 1.0) -> Simulation:
    sim = Simulation(make_profile(), config(caching, decode, overlap_weight))
    sim.result = sim.run(trace)
    return sim


def assert_idle(sim: Simulation) -> None:
    for inst in sim.instances:
        assert inst.scheduler.pool.num_free == inst.scheduler.pool.num_blocks, inst.name
        if inst.prefix_cache is not None:
            assert inst.prefix_cache.num_tracked == 0, inst.name


def test_the_next_turn_is_prefilled_where_the_last_one_decoded():
    # turn 1: 1000 tokens, 11 out; turn 2, 1 s after: its 1000 + 11 + 100 = 1111-token prompt
    trace = [ReuseRequest(0.0, 0, 0, 0, 1000, 11), ReuseRequest(0.0, 0, 1, 0, 100, 11, think_s=1.0)]
    cold, warm = run(False, trace), run(True, trace)
    for sim in (cold, warm):
        t1, t2 = sim.result.records
        assert t1.ttft_s == pytest.approx(2 * 5e-3 + 1000 * 1e-4)  # 512 + 488 tokens on the prefill instance
        assert t2.arrival_s == pytest.approx(t1.finish_s + 1.0)
        assert t2.completion_tokens == 11
        assert_idle(sim)
    # without caching: 512 + 512 + 87 tokens again on the prefill instance
    assert cold.result.records[1].ttft_s == pytest.approx(3 * 5e-3 + 1111 * 1e-4)
    # with it: turn 1 left its final positions cached on the decode instance (1010: 63 full blocks), which
    # prefills the other 1111 - 1008 = 103 tokens itself in one chunk; the prefill instance never sees turn 2
    assert warm.result.records[1].ttft_s == pytest.approx(5e-3 + 103 * 1e-4)
    assert warm.prefill[0].steps == 2 and cold.prefill[0].steps == 5
    assert warm.decode[0].prefix_cache.stats.hits == 1008


@pytest.mark.parametrize("question,where", [(300, "prefill"), (100, "decode")])
def test_shared_documents_are_computed_once_per_instance(question, where):
    """Later questions on a document start from its cached KV: on the prefill instance when the question is
    longer than ``local_prefill_tokens`` (256), else on the decode instance, which prefills the question itself."""
    shape = SharedDocsShape(documents=2, questions=4, document=LengthDist(2000, 0.0, 2000, 2000),
                            question=LengthDist(question, 0.0, question, question))
    trace = shared_docs_trace(shape, rate=0.5, seed=2)
    cold, warm = run(False, trace), run(True, trace)
    first_seen = {}
    for spec, rec in zip(trace, warm.result.records):
        first_seen.setdefault(spec.group, rec)
    later = [rec for spec, rec in zip(trace, warm.result.records) if first_seen[spec.group] is not rec]
    assert all(rec.finished for rec in warm.result.records)
    assert max(r.ttft_s for r in later) < min(r.ttft_s for r in first_seen.values()) / 3
    hits = {"prefill": warm.prefill[0].prefix_cache.stats.hits, "decode": warm.decode[0].prefix_cache.stats.hits}
    assert hits[where] == len(later) * 2000  # the document's 125 blocks, each time
    # the first question on each document: 5 steps of up to 512 tokens; a later one on the prefill instance
    # computes its 300 new tokens in one step, one on the decode instance none there
    assert warm.prefill[0].steps == 2 * 5 + (len(later) if where == "prefill" else 0) < cold.prefill[0].steps
    assert sum(r.ttft_s for r in warm.result.records) < sum(r.ttft_s for r in cold.result.records) / 2
    assert_idle(warm)


def test_conversations_go_back_to_the_instance_that_holds_them():
    shape = MultiTurnShape(turns=(4, 4), first=LengthDist(800, 0.0, 800, 800), message=LengthDist(50, 0.0, 50, 50),
                           output=LengthDist(20, 0.0, 20, 20), think_s=0.5, max_context=4096)
    trace = multi_turn_trace(shape, conversations=6, rate=2.0, seed=1)
    # a block to compute weighs 10 blocks in use: a turn goes back to the instance holding its conversation
    # even when the other one is less loaded (with weight 1 a few turns go to the freer instance instead)
    sim = run(True, trace, decode=2, overlap_weight=10.0)
    assert all(rec.finished for rec in sim.result.records)
    # every later turn was prefilled on a decode instance from the turn before: none reached the prefill pool
    assert sim.prefill[0].prefix_cache.stats.queries == 6 * 800  # the first turns only
    assert sum(d.prefix_cache.stats.hits for d in sim.decode) > 6 * 3 * 800
    assert_idle(sim)


def test_a_trace_without_reuse_simulates_the_same_with_caching_on():
    trace = make_trace(workload_shape("chat"), rate=4.0, n=60, seed=3)
    a, b = run(False, trace, decode=2), run(True, trace, decode=2)
    assert [(r.first_token_s, r.finish_s) for r in a.result.records] == \
        [(r.first_token_s, r.finish_s) for r in b.result.records]


def test_caching_with_migration_is_refused():
    with pytest.raises(SimConfigError, match="prefix_caching: not simulated together with migration"):
        SimConfig("disaggregated", prefill=PoolPlan(1), decode=PoolPlan(2), prefix_caching=PrefixRouting(),
                  migration=SimMigration())


def test_the_planner_plans_a_workload_with_reuse_with_caching_on():
    workload = Workload(reuse="shared_docs", num_requests=24, min_duration_s=1.0)
    trace = workload.at_rate(2.0)
    assert len(trace) >= 24 and all(isinstance(r, ReuseRequest) for r in trace)
    assert max(workload.prompt_lengths()) == 3200 and "prefix caching on" in workload.describe()
    planner = Planner(make_profile(prefill_per_token=5e-4), SLOTarget(3.0, 0.05), workload, SearchSpace(devices=2, tensor_parallel=(1,)),
                      verify_top=1, bisect_steps=2, progress=False)
    result = planner.run()
    assert result.best.goodput > 0 and result.best.config.prefix_caching == PrefixRouting()
    with pytest.raises(WorkloadError, match="workload: unknown 'chats'"):
        Workload(reuse="chats").at_rate(1.0)


def test_tiers_bring_back_documents_the_pools_evicted_and_their_loads_take_time():
    """Pools that hold one 2000-token document each and two documents asked about in turn: without tiers every
    question recomputes its document; with tiers below the pools (``planner/sim_tiers.py``) it is loaded back,
    its load time on the instance's next step, and no tier holds more than its capacity."""
    from planner.sim_tiers import SimTierConfig

    shape = SharedDocsShape(documents=2, questions=4, document=LengthDist(2000, 0.0, 2000, 2000),
                            question=LengthDist(300, 0.0, 300, 300))
    trace = shared_docs_trace(shape, rate=0.5, seed=2)

    def tiered(load_gb_per_s: float | None) -> Simulation:
        tiers = None if load_gb_per_s is None else SimTierConfig(8192, load_gb_per_s, 131072)
        cfg = SimConfig("disaggregated", prefill=PoolPlan(1, 1, 2560, 512, 16), decode=PoolPlan(1, 1, 1 << 20, 1, 64),
                        speculation=NO_SPECULATION, prefix_caching=PrefixRouting(True, 1.0), tiers=tiers)
        sim = Simulation(make_profile(), cfg)
        sim.result = sim.run(trace)
        return sim

    pools_only, fast, slow = tiered(None), tiered(100.0), tiered(0.01)
    for sim in (pools_only, fast, slow):
        assert all(rec.finished for rec in sim.result.records)
        assert_idle(sim)
    prefill = fast.prefill[0].prefix_cache
    assert pools_only.prefill[0].prefix_cache.stats.tier_hits == 0
    assert prefill.stats.tier_hits >= 2 * 2000  # later questions found (most of) their document below the pool
    assert prefill.stats.hits > pools_only.prefill[0].prefix_cache.stats.hits
    assert len(prefill.tiers) <= prefill.tiers.capacity_blocks
    ttft = {name: sum(r.ttft_s for r in sim.result.records) for name, sim in
            (("pools", pools_only), ("fast", fast), ("slow", slow))}
    # 2000 tokens at 131 KB each over 0.01 GB/s: 26 s a load, far more than computing them (0.2 s)
    assert ttft["fast"] < ttft["pools"] < ttft["slow"]


def test_a_decode_instance_loads_a_prompt_sent_to_it_beside_its_steps():
    """A decode pool that holds one document: a question on the other finds it in the decode instance's tiers,
    whose load runs while the prefill instance computes the question (``SimTiers.start_load``): counted, and
    paid by none of the decode instance's steps, while the prefill instance's loads are paid by its steps."""
    from planner.sim_tiers import SimTierConfig

    shape = SharedDocsShape(documents=2, questions=4, document=LengthDist(2000, 0.0, 2000, 2000),
                            question=LengthDist(300, 0.0, 300, 300))
    trace = shared_docs_trace(shape, rate=0.5, seed=2)
    cfg = SimConfig("disaggregated", prefill=PoolPlan(1, 1, 2560, 512, 16), decode=PoolPlan(1, 1, 2560, 1, 2),
                    speculation=NO_SPECULATION, prefix_caching=PrefixRouting(True, 1.0),
                    tiers=SimTierConfig(8192, 1.0, 131072))
    sim = Simulation(make_profile(), cfg)
    paid = {"prefill": 0.0, "decode": 0.0}
    for role, inst in (("prefill", sim.prefill[0]), ("decode", sim.decode[0])):
        tiers, take = inst.prefix_cache.tiers, inst.prefix_cache.tiers.take_load_seconds

        def taking(role=role, take=take):
            seconds = take()
            paid[role] += seconds
            return seconds
        tiers.take_load_seconds = taking
    result = sim.run(trace)
    assert all(rec.finished for rec in result.records)
    assert_idle(sim)
    decode_tiers = sim.decode[0].prefix_cache.tiers
    assert decode_tiers.loaded_tokens >= 2000 and sim.decode[0].prefix_cache.stats.tier_hits >= 2000
    assert paid["decode"] == 0.0 and paid["prefill"] > 0.0


def test_a_prefill_instance_loading_layer_by_layer_pays_only_what_its_pass_does_not_hide():
    """``SimTierConfig.layered`` (``kv_tiers.layered_loads``, on GPUs): a question on a document the prefill pool
    evicted loads 1744 of its tokens from the tiers (0.23 s at 1 GB/s) beside its own 300-token pass (35 ms): the
    step takes the load's time, not the sum, so its first token comes exactly that pass sooner."""
    from planner.sim_tiers import SimTierConfig

    trace = [ReuseRequest(0.0, 0, 0, 2000, 300, 2), ReuseRequest(1.0, 1, 0, 2000, 300, 2),  # the second evicts doc 0
             ReuseRequest(2.0, 0, 1, 2000, 300, 2)]

    def question_ttft(layered: bool) -> float:
        cfg = SimConfig("disaggregated", prefill=PoolPlan(1, 1, 2560, 512, 16), decode=PoolPlan(1, 1, 1 << 20, 1, 64),
                        speculation=NO_SPECULATION, prefix_caching=PrefixRouting(True, 1.0),
                        tiers=SimTierConfig(8192, 1.0, 131072, layered=layered))
        sim = Simulation(make_profile(), cfg)
        sim.result = sim.run(trace)
        assert all(rec.finished for rec in sim.result.records)
        # the third request's document: its first 16 blocks still in the pool, the other 109 from the tiers
        assert sim.prefill[0].prefix_cache.stats.tier_hits == 1744
        assert_idle(sim)
        return sim.result.records[2].ttft_s

    layered, at_once = question_ttft(True), question_ttft(False)
    assert at_once - layered == pytest.approx(5e-3 + 300 * 1e-4)  # the question's pass, hidden under the load
    assert layered >= 1744 * 131072 / 1e9 - 1e-9  # and no sooner than the load allows


def test_a_turn_prefilled_on_its_decode_instance_loads_its_history_beside_the_batch():
    """Questions of 100 tokens are prefilled on the decode instance, whose pool holds one of two documents: a
    question on the other loads it from the decode instance's tiers beside its steps (no step pays the 2.6 s
    load at 0.1 GB/s) and its first chunk waits for the load."""
    from planner.sim_tiers import SimTierConfig

    shape = SharedDocsShape(documents=2, questions=4, document=LengthDist(2000, 0.0, 2000, 2000),
                            question=LengthDist(100, 0.0, 100, 100))
    trace = shared_docs_trace(shape, rate=0.5, seed=2)
    cfg = SimConfig("disaggregated", prefill=PoolPlan(1, 1, 1 << 20, 512, 16), decode=PoolPlan(1, 1, 2560, 1, 64),
                    speculation=NO_SPECULATION, prefix_caching=PrefixRouting(True, 1.0),
                    tiers=SimTierConfig(8192, 0.1, 131072))
    sim = Simulation(make_profile(), cfg)
    decode = sim.decode[0]
    tiers, take, paid = decode.prefix_cache.tiers, decode.prefix_cache.tiers.take_load_seconds, []
    tiers.take_load_seconds = lambda: paid.append(take()) or paid[-1]
    result = sim.run(trace)
    assert all(rec.finished for rec in result.records)
    assert_idle(sim)
    assert tiers.loaded_tokens >= 2000 and decode.prefix_cache.stats.tier_hits >= 2000
    assert sum(paid) == 0.0  # loaded beside the steps
    assert max(r.ttft_s for r in result.records) >= 2000 * 131072 / 1e8  # a question waited for its document

def test_a_shared_store_serves_every_instance_and_each_pays_its_own_loads():
    """``SimTierConfig.shared``: one store for the cluster; what one instance saved another finds and loads, the
    load time on the loader's next step only; and a whole simulation over it serves every request."""
    from collections import OrderedDict

    from planner.sim_tiers import SimTierConfig, SimTiers

    config = SimTierConfig(64, 1.0, 1000, shared=True)
    store: OrderedDict[int, None] = OrderedDict()
    a, b = SimTiers(config, 16, store), SimTiers(config, 16, store)
    a.save([0, 1], [11, 12])
    assert b.find([11, 12, 13]) == 2 and b.load([11, 12], [5, 6]) == 2
    assert a.take_load_seconds() == 0.0 and b.take_load_seconds() == pytest.approx(32 * 1000 / 1e9)
    a.save([2, 3, 4], [13, 14, 15])  # 5 blocks in a store of 4: the least recently used (11) goes
    assert len(b) == 4 and b.find([11]) == 0 and b.find([12, 13]) == 2

    shape = SharedDocsShape(documents=2, questions=4, document=LengthDist(2000, 0.0, 2000, 2000),
                            question=LengthDist(300, 0.0, 300, 300))
    cfg = SimConfig("disaggregated", prefill=PoolPlan(2, 1, 2560, 512, 16), decode=PoolPlan(1, 1, 1 << 20, 1, 64),
                    speculation=NO_SPECULATION, prefix_caching=PrefixRouting(True, 1.0),
                    tiers=SimTierConfig(16384, 100.0, 131072, shared=True))
    sim = Simulation(make_profile(), cfg)
    result = sim.run(shared_docs_trace(shape, rate=0.5, seed=2))
    assert all(rec.finished for rec in result.records)
    assert_idle(sim)
    assert sum(p.prefix_cache.stats.tier_hits for p in sim.prefill) >= 2000  # a document came back from the store
    assert sim.prefill[0].prefix_cache.tiers._held is sim.prefill[1].prefix_cache.tiers._held


def test_tiers_without_prefix_caching_are_refused():
    from planner.sim_tiers import SimTierConfig

    with pytest.raises(SimConfigError, match="tiers: sit below the prefix cache"):
        SimConfig("disaggregated", prefill=PoolPlan(1, 1, 4096, 512, 16), decode=PoolPlan(1, 1, 4096, 1, 64),
                  tiers=SimTierConfig(4096, 10.0, 1024))


@pytest.mark.parametrize("ahead", [True, False])
def test_prompts_waiting_for_decode_room_are_computed_ahead_by_the_idle_prefill_instance(ahead):
    """A decode pool of 2048 tokens holds two of four 1000-token prompts: the other two wait for room. With
    ``prefill_ahead`` the idle prefill instance computes their 62 full blocks meanwhile, in steps of their own,
    and once placed each computes only its last 8 tokens; each prompt is looked up once, and what was computed
    ahead for it is not counted found."""
    trace = [ReuseRequest(0.0, g, 0, 0, 1000, 50) for g in range(4)]
    cfg = SimConfig("disaggregated", prefill=PoolPlan(1, 1, 1 << 20, 512, 16), decode=PoolPlan(1, 1, 2048, 1, 64),
                    speculation=NO_SPECULATION, prefix_caching=PrefixRouting(True, prefill_ahead=ahead))
    sim = Simulation(make_profile(), cfg)
    sim.result = sim.run(trace)
    waited = sorted(r.ttft_s for r in sim.result.records)[2:]
    freed = min(r.finish_s for r in sim.result.records)  # room for both frees when the first request ends
    prefill = sim.prefill[0]
    assert prefill.prefix_cache.stats.queries == 4000 and prefill.prefix_cache.stats.hits == 0
    if ahead:  # each computes its last 8 tokens in a short step of its own
        assert all(t - freed < 0.02 for t in waited)  # two such steps and the transfers, in turn
        assert prefill.steps == 4 + 4 + 2  # the two placed at once, the two passes ahead, the two last blocks
    else:  # each computes its whole prompt, in two full steps, once the room frees
        assert all(t - freed > 2 * 5e-3 + 1000 * 1e-4 for t in waited)
        assert prefill.steps == 8
    assert_idle(sim)
