"""Load-aware disaggregation in the simulator, on hand-made profiles: a burst of long prompts that saturates
the prefill instance is shared with the decode instance, whose steps prefill only what keeps its decoding
requests within the TPOT target; without a backlog every prompt goes to the prefill pool as before."""

from __future__ import annotations

import dataclasses

import pytest

from controller.load_aware import BACKLOG, LATE, MEETS_SLO, UNMEASURED, LoadAwarePolicy
from controller.config import load_config
from planner.profile import Calibration
from planner.sim_instances import StepCosts
from planner.simulator import SimConfig, SimConfigError, simulate
from planner.workload import RequestSpec
from tests.test_planner_sim import disagg, make_profile

TPOT_S = 0.05


def load_aware(config: SimConfig, ttft_s: float = 0.3) -> SimConfig:
    return dataclasses.replace(config, load_aware=LoadAwarePolicy(True, ttft_s), decode_prefill_tpot_s=TPOT_S)


def burst(n: int = 16, prompt: int = 2000, output: int = 40, gap_s: float = 0.02) -> list[RequestSpec]:
    return [RequestSpec(i * gap_s, prompt, output) for i in range(n)]


def test_a_saturated_prefill_pool_shares_its_backlog_with_the_decode_instance():
    """16 prompts of 2000 tokens, one every 20 ms: the prefill instance needs 0.2 s each, so its queue grows
    to seconds. The decode instance prefills part of them beside its batch: the worst TTFT falls, and no
    decoding request's TPOT passes the target (its steps prefill only within the slack)."""
    prof = make_profile()  # prefill 5 ms + 0.1 ms a token; a decode step 10 ms
    static = simulate(prof, disagg(), burst())
    aware = simulate(prof, load_aware(disagg()), burst())
    assert static.load_aware is None
    counts = aware.load_aware
    # until the prefill instance's first step ends (56 ms) it has measured nothing: the first three go there
    assert counts[("prefill", UNMEASURED)] == 3
    assert counts[("decode", BACKLOG)] >= 3 and sum(counts.values()) == 16
    ttft = {name: sorted(r.ttft_s for r in res.records) for name, res in (("static", static), ("aware", aware))}
    assert ttft["aware"][-1] < 0.8 * ttft["static"][-1]
    assert all(r.finished and r.completion_tokens == 40 for r in aware.records)
    assert max(r.tpot_s for r in aware.records) <= TPOT_S * 1.001


def test_prompts_late_wherever_they_go_leave_the_prefill_queue_to_those_that_can_be_served_in_time():
    """50 prompts of 2000 tokens, one every 100 ms: twice what the prefill instance computes (0.2 s each). With
    the late lanes, a prompt predicted past the 0.5 s SLO both in the prefill pool and on the decode instance is
    computed after the prompts that can still make it (on the decode instance at least ten times), instead of
    holding up every prompt after it in the prefill queue: more than twice as many first tokens within the SLO,
    every request complete, no decoding request's TPOT past the target."""
    prof = make_profile()
    trace = burst(50, output=20, gap_s=0.1)
    runs = {late: simulate(prof, dataclasses.replace(disagg(), load_aware=LoadAwarePolicy(True, 0.4, late),
                                                     decode_prefill_tpot_s=TPOT_S), trace) for late in (None, 0.5)}
    within = {late: sum(r.ttft_s <= 0.5 for r in res.records) for late, res in runs.items()}
    assert within[0.5] > 2 * within[None]
    assert runs[0.5].load_aware[("decode", LATE)] >= 10 and ("decode", LATE) not in runs[None].load_aware
    for res in runs.values():
        assert all(r.finished and r.completion_tokens == 20 for r in res.records)
        assert max(r.tpot_s for r in res.records) <= TPOT_S * 1.001


def test_a_chunk_riding_in_the_decode_pass_costs_its_tokens_not_a_pass():
    """The decode worker computes its local-prefill chunk in its decode pass, which already pays the fixed
    per-pass cost (5 ms here, the smaller of the two models')."""
    costs = StepCosts(make_profile(), Calibration("disaggregated", 0.0, 1.0, 0.0, 1.0, 0, 0.0, 0.0), (1, 1))
    assert costs.prefill_chunk(0, 100) == pytest.approx(5e-3 + 100 * 1e-4)
    assert costs.fused_prefill_chunk(0, 100) == pytest.approx(100 * 1e-4)


def test_without_a_backlog_every_prompt_goes_to_the_prefill_pool():
    prof = make_profile()
    spaced = burst(gap_s=1.0)  # each prompt done (0.2 s) before the next arrives
    static = simulate(prof, disagg(), spaced)
    aware = simulate(prof, load_aware(disagg()), spaced)
    assert aware.load_aware == {("prefill", UNMEASURED): 1, ("prefill", MEETS_SLO): 15}
    assert [r.ttft_s for r in aware.records] == pytest.approx([r.ttft_s for r in static.records])


def test_no_slack_keeps_the_decode_instance_to_decoding():
    """A TPOT target the decode step alone takes (10 ms of 10 ms): once the decode instance holds requests it
    reports no prefill rate and takes no prompt, and the run is the static one."""
    prof = make_profile()
    static = simulate(prof, disagg(), burst())
    res = simulate(prof, dataclasses.replace(load_aware(disagg()), decode_prefill_tpot_s=0.01), burst())
    assert not any(where == "decode" for where, _ in res.load_aware)
    assert [r.ttft_s for r in res.records] == pytest.approx([r.ttft_s for r in static.records])
    assert [r.tpot_s for r in res.records] == pytest.approx([r.tpot_s for r in static.records])


def test_the_cluster_config_turns_it_on_and_bad_settings_name_the_field():
    cfg = load_config(overrides={"slo": {"ttft_ms": 1000, "tpot_ms": 50}})
    sim = SimConfig.from_cluster_config(cfg)
    assert sim.load_aware == LoadAwarePolicy(True, 0.8, 1.0) and sim.decode_prefill_tpot_s == pytest.approx(0.04)
    off = SimConfig.from_cluster_config(load_config(overrides={"load_aware": {"enabled": False}}))
    assert off.load_aware is None
    with pytest.raises(SimConfigError, match="load_aware"):
        SimConfig("colocated", colocated=disagg().prefill, load_aware=LoadAwarePolicy())
    with pytest.raises(SimConfigError, match="decode_prefill_tpot_s"):
        dataclasses.replace(disagg(), decode_prefill_tpot_s=0.0)


def test_with_no_prefill_instance_the_decode_instances_prefill_every_prompt():
    """The prefill pool emptied (``autoscale.prefill.min_instances: 0``, a role change to decode): two decode
    instances prefill the burst themselves, each within its decoding requests' TPOT target, and every request
    finishes; the same two devices as 1 prefill + 1 decode instance serve the burst's first tokens no later at
    the worst, since both prefill."""
    prof = make_profile()
    split = load_aware(disagg())
    empty = dataclasses.replace(split, prefill=dataclasses.replace(split.prefill, instances=0),
                                decode=dataclasses.replace(split.decode, instances=2))
    assert empty.devices == split.devices
    res = simulate(prof, empty, burst())
    assert all(r.finished and r.completion_tokens == 40 for r in res.records)
    assert max(r.tpot_s for r in res.records) <= TPOT_S * 1.001
    assert res.load_aware == {}  # nothing to decide: no prefill pool to weigh against
    assert max(r.ttft_s for r in res.records) <= max(r.ttft_s for r in simulate(prof, split, burst()).records)
    with pytest.raises(SimConfigError, match="decode.instances: must be >= 1, got 0"):
        dataclasses.replace(empty, decode=dataclasses.replace(empty.decode, instances=0))
