"""The cluster simulator and the placement search, on hand-made profiles whose costs make the expected
timings computable by hand."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics

import pytest
import yaml

from controller.config import load_config
from controller.planner.plan_output import plan_config
from controller.planner.profile import (PREFILL_FEATURES, TRANSFER_FEATURES, AcceptanceEntry, Calibration,
                                        FittedModel, InstanceCosts, Profile, ProfileError)
from controller.planner.search import (NO_SPECULATION, Planner, SearchSpace, SLOTarget, Workload,
                                       speculation_space)
from controller.planner.simulator import PoolPlan, SimConfig, SimConfigError, simulate
from controller.planner.slo import RequestOutcome, attainment, goodput
from controller.planner.workload import RequestSpec, make_trace, workload_shape
from decode_worker.config import SpeculationConfig

PASS = ("passes", "seqs", "kv_tokens", "new_tokens")


def fitted(features, coefs) -> FittedModel:
    return FittedModel(tuple(features), tuple(coefs), 0.0, 0)


def make_profile(prefill_per_token=1e-4, step_s=0.01, rate=0.7, tps=(1,), transfer_per_token=0.0,
                 capacity=1 << 20, draft_step_s=0.002) -> Profile:
    """prefill: 5 ms + per-token cost; decode pass: ``step_s`` flat; draft pass: ``draft_step_s`` flat;
    TP t divides every cost by t."""
    costs = tuple(InstanceCosts(
        t, 1,
        fitted(PREFILL_FEATURES, (5e-3 / t, 0.0, prefill_per_token / t, 0.0, 0.0)),
        fitted(PASS, (step_s / t, 0.0, 0.0, 0.0)),
        {"self_sparse": fitted(PASS, (draft_step_s / t, 0.0, 0.0, 0.0))},
        capacity * t) for t in tps)
    return Profile("test hardware", "gpu-test", 8, "test-model", 1000, 64, "analytical", costs,
                   fitted(TRANSFER_FEATURES, (0.0, transfer_per_token)),
                   (AcceptanceEntry("self_sparse", 256, 0, 1 << 30, rate, 1000),))


def disagg(spec=NO_SPECULATION, np_=1, nd=1, decode_capacity=1 << 20, budget=512, tp=1) -> SimConfig:
    return SimConfig("disaggregated", prefill=PoolPlan(np_, tp, 1, 1 << 20, budget, 16),
                     decode=PoolPlan(nd, tp, 1, decode_capacity, 1, 64), speculation=spec)


def test_single_request_timings_match_the_cost_models():
    prof = make_profile(transfer_per_token=1e-5)
    res = simulate(prof, disagg(), [RequestSpec(0.0, 1000, 11)])
    r = res.records[0]
    # two prefill steps (512 + 488 tokens), 5 ms + 0.1 ms/token each
    assert r.ttft_s == pytest.approx(2 * 5e-3 + 1000 * 1e-4)
    # the last chunk's KV (488 tokens) arrives 4.88 ms after the first token, then 10 steps of 10 ms
    assert r.finish_s - r.first_token_s == pytest.approx(488 * 1e-5 + 10 * 0.01)
    assert r.completion_tokens == 11 and r.finished


def test_a_speed_timeline_scales_each_step_by_its_roles_factor_when_it_starts():
    """Prefill steps starting from t = 1 s take twice as long (the machine slowed); decode steps keep their
    time; a timeline of 1.0 everywhere is the run without one."""
    from controller.planner.load_speed import SpeedTimeline

    prof, trace = make_profile(), [RequestSpec(0.0, 1000, 11), RequestSpec(2.0, 1000, 11)]
    plain = simulate(prof, disagg(), trace)
    assert simulate(prof, disagg(), trace, speed=SpeedTimeline(1.0, (0.0, 1.0), ({}, {"prefill": 1.0}))).records \
        == plain.records
    slowed = simulate(prof, disagg(), trace, speed=SpeedTimeline(1.0, (0.0, 1.0), ({}, {"prefill": 2.0}))).records
    prefill_s = 2 * 5e-3 + 1000 * 1e-4
    assert slowed[0].ttft_s == pytest.approx(prefill_s) and slowed[1].ttft_s == pytest.approx(2 * prefill_s)
    assert slowed[1].finish_s - slowed[1].first_token_s == pytest.approx(10 * 0.01)  # decode at its own speed
    with pytest.raises(ValueError, match="increase"):
        SpeedTimeline(1.0, (1.0, 1.0), ({}, {}))
    with pytest.raises(ValueError, match="positive"):
        SpeedTimeline(1.0, (0.0,), ({"decode": 0.0},))


def test_a_reservation_on_a_busy_decode_instance_waits_for_its_step_to_end():
    """A decodes in 10 ms steps from 15 ms on (its 15 ms prefill); B arrives mid-step at 50.1 ms: the decode
    worker answers B's KV reservation when that step ends (55 ms), then B's 15 ms prefill runs."""
    prof = make_profile()
    a, b = simulate(prof, disagg(), [RequestSpec(0.0, 100, 11), RequestSpec(0.0501, 100, 4)]).records
    prefill_s = 5e-3 + 100 * 1e-4
    assert a.ttft_s == pytest.approx(prefill_s)
    assert b.ttft_s == pytest.approx(0.055 + prefill_s - 0.0501, abs=1e-6)  # (+ the 0.1 us floor of a free transfer)
    # an idle decode instance answers at once
    (alone,) = simulate(prof, disagg(), [RequestSpec(0.0501, 100, 4)]).records
    assert alone.ttft_s == pytest.approx(prefill_s)


def test_colocated_single_request():
    prof = make_profile()
    cfg = SimConfig("colocated", colocated=PoolPlan(1, 1, 1, 1 << 20, 512, 64))
    r = simulate(prof, cfg, [RequestSpec(0.0, 1000, 5)]).records[0]
    assert r.ttft_s == pytest.approx(2 * 5e-3 + 1000 * 1e-4)
    assert r.tpot_s == pytest.approx(0.01)


def test_colocated_decode_shares_steps_with_prefill():
    """A decode running beside another request's prefill pays for the mixed steps (interference)."""
    prof = make_profile()
    cfg = SimConfig("colocated", colocated=PoolPlan(1, 1, 1, 1 << 20, 512, 64))
    alone = simulate(prof, cfg, [RequestSpec(0.0, 100, 20)]).records[0]
    mixed = simulate(prof, cfg, [RequestSpec(0.0, 100, 20), RequestSpec(0.05, 4000, 2)]).records[0]
    assert mixed.tpot_s > alone.tpot_s * 1.5


def test_prefill_queueing_delays_the_second_request():
    prof = make_profile()
    res = simulate(prof, disagg(), [RequestSpec(0.0, 2048, 2), RequestSpec(0.0, 2048, 2)])
    a, b = res.records
    assert b.ttft_s > a.ttft_s + 0.1  # the second waits for budget behind the first


def test_decode_memory_limit_serialises_requests():
    """Room for one request's KV only: the second cannot even start prefill until the first finishes."""
    prof = make_profile()
    res = simulate(prof, disagg(decode_capacity=1200), [RequestSpec(0.0, 1000, 20), RequestSpec(0.0, 1000, 20)])
    first, second = sorted(res.records, key=lambda r: r.first_token_s)
    assert second.first_token_s > first.finish_s


@pytest.mark.parametrize("rate,tokens_per_step", [(1.0, 4), (0.0, 1)])
def test_speculation_tokens_per_step_follow_acceptance(rate, tokens_per_step):
    prof = make_profile(rate=rate)
    spec = SpeculationConfig(drafter="self_sparse", k_policy="fixed", k=3)
    res = simulate(prof, disagg(spec), [RequestSpec(0.0, 100, 1 + 8 * tokens_per_step)])
    r = res.records[0]
    assert res.k_counts == {3: 8}
    # each step: 3 draft passes (2 ms) + one verify pass (10 ms)
    assert r.finish_s - r.first_token_s == pytest.approx(8 * (3 * 0.002 + 0.01))
    assert r.draft_tokens == 24 and r.accepted_tokens == 24 * rate


def test_adaptive_policy_speculates_only_when_it_pays():
    cheap_draft, dear_draft = make_profile(rate=0.8, draft_step_s=0.001), make_profile(rate=0.1, draft_step_s=0.009)
    spec = SpeculationConfig(drafter="self_sparse", k_policy="adaptive", max_k=4)
    trace = [RequestSpec(0.0, 100, 60)]
    assert max(simulate(cheap_draft, disagg(spec), trace).k_counts) >= 3
    assert set(simulate(dear_draft, disagg(spec), trace).k_counts) <= {0, 1}  # k=1 only to re-probe


def test_attainment_falls_with_rate_and_unfinished_requests_miss():
    prof = make_profile()
    shape = workload_shape("long_doc")
    shares = [attainment(simulate(prof, disagg(), make_trace(shape, r, 120, seed=3)).outcomes(), 1.0, 0.05).both
              for r in (1.0, 4.0, 16.0)]
    assert shares[0] >= shares[1] >= shares[2] and shares[0] > shares[2]
    res = simulate(prof, disagg(), make_trace(shape, 50.0, 100, seed=3), time_limit_s=0.5)
    assert any(not r.finished for r in res.records)
    assert all(not o.ok for r, o in zip(res.records, res.outcomes()) if not r.finished)


def test_slo_goodput_interpolates():
    assert goodput([1, 2, 3], [1.0, 0.95, 0.85], 0.9) == pytest.approx(2.5)
    assert goodput([1, 2], [0.5, 0.4], 0.9) == 0.0
    assert goodput([1, 2], [1.0, 0.99], 0.9) == 2
    a = attainment([RequestOutcome(True, 1, 0.1), RequestOutcome(True, 3, 0.1), RequestOutcome(False, 0, 0)], 2, 0.2)
    assert (a.both, a.ttft_only, a.tpot_only) == pytest.approx((1 / 3, 1 / 3, 2 / 3))


def test_bad_sim_config_names_the_field():
    with pytest.raises(SimConfigError, match="mode: must be one of"):
        SimConfig("split")
    with pytest.raises(SimConfigError, match="decode: required"):
        SimConfig("disaggregated", prefill=PoolPlan(1))
    with pytest.raises(SimConfigError, match="prefill.instances"):
        SimConfig("disaggregated", prefill=PoolPlan(0), decode=PoolPlan(1))


def test_planner_balances_the_phases():
    """Prefill is 4x dearer per request than decode: with 5 devices the plan gives prefill more instances."""
    prof = make_profile(prefill_per_token=4e-4, step_s=0.004)
    planner = Planner(prof, SLOTarget(3.0, 0.05), Workload(shape=workload_shape("long_doc"), num_requests=80),
                      SearchSpace(devices=5, tensor_parallel=(1,), include_colocated=False), progress=False)
    best = planner.run().best
    assert best.config.mode == "disaggregated"
    assert best.config.prefill.instances > best.config.decode.instances
    assert best.goodput > 0


def test_planner_errors_on_missing_profile_data():
    prof = make_profile(tps=(1,))
    wl = Workload(shape=workload_shape("chat"), num_requests=40)
    with pytest.raises(ProfileError, match="tensor_parallel=2"):
        Planner(prof, SLOTarget(1, 0.1), wl, SearchSpace(devices=4, tensor_parallel=(1, 2)), progress=False).run()
    spec = SpeculationConfig(drafter="self_sparse", budget=64)
    with pytest.raises(ProfileError, match="no acceptance rate"):
        Planner(prof, SLOTarget(1, 0.1), wl, SearchSpace(devices=2, tensor_parallel=(1,), speculation=(spec,)),
                progress=False).run()


def test_speculation_space_comes_from_the_profile():
    specs = speculation_space(make_profile())
    assert specs[0] == NO_SPECULATION
    assert {s.budget for s in specs[1:]} == {256}
    assert {s.k_policy for s in specs[1:]} == {"adaptive", "fixed"}


def test_plan_config_is_a_valid_cluster_config(tmp_path):
    prof = make_profile(tps=(1, 2))
    planner = Planner(prof, SLOTarget(3.0, 0.05), Workload(shape=workload_shape("long_doc"), num_requests=60),
                      SearchSpace(devices=4, tensor_parallel=(1, 2), speculation=speculation_space(prof)[:2]),
                      verify_top=2, progress=False)
    best = planner.run().best
    out = tmp_path / "plan.yaml"
    base = os.path.join(os.path.dirname(__file__), "..", "cluster_configs", "local.yaml")
    raw = plan_config(best, base, str(out), prof, SLOTarget(3.0, 0.05))
    out.write_text(yaml.safe_dump(raw))
    cfg = load_config(str(out))
    assert os.path.isdir(cfg.model_path)  # the model path was re-based to the output directory
    assert cfg.slo.tpot_ms == pytest.approx(50)
    if cfg.mode == "disaggregated":
        assert cfg.prefill.devices_per_instance == cfg.prefill.tensor_parallel * 1
        assert cfg.prefill.instances == best.config.prefill.instances
    assert math.isfinite(best.per_device)


def test_plan_cli_writes_a_config_serve_accepts(tmp_path, capsys):
    from controller.cli import main

    prof = make_profile(prefill_per_token=2e-4, step_s=0.004)
    prof = Profile(**{**prof.__dict__, "device_type": "cpu", "devices_per_node": 3})
    prof.save(str(tmp_path / "p.json"))
    out = tmp_path / "plan.yaml"
    rc = main(["plan", "--profile", str(tmp_path / "p.json"), "--ttft-ms", "3000", "--tpot-ms", "50",
               "--workload", "long_doc", "--num-requests", "60", "--verify-top", "2", "--out", str(out)])
    assert rc == 0
    cfg = load_config(str(out))  # what `magicserve serve --config plan.yaml` loads
    assert cfg.slo.ttft_ms == 3000 and cfg.slo.tpot_ms == 50
    used = (cfg.colocated.instances * cfg.colocated.threads if cfg.mode == "colocated"
            else cfg.prefill.instances * cfg.prefill.threads + cfg.decode.instances * cfg.decode.threads)
    assert used <= 3
    report = (tmp_path / "plan.md").read_text()
    assert "## Candidates" in report and "colocated" in report
    assert out.read_text().startswith("# Generated by `magicserve plan")
    # a profile without what the space needs: a clear error, exit code 2
    rc = main(["plan", "--profile", str(tmp_path / "missing.json"), "--ttft-ms", "1", "--tpot-ms", "1", "--out", str(out)])
    assert rc == 2 and "no such profile file" in capsys.readouterr().err


def test_calibration_fit_recovers_serving_path_terms_and_the_simulator_applies_them():
    from controller.planner.calibrate import fit, kv_tail_s, predicted_decode_s, predicted_prefill_s
    from controller.planner.profile import Calibration

    prof = make_profile(transfer_per_token=1e-5)
    rows = [{"prompt": n, "tokens": t + 1,
             "ttft_s": 0.05 + 1.3 * predicted_prefill_s(prof, n, 512),
             "decode_s": 0.02 + 1.5 * predicted_decode_s(prof, n, t) + kv_tail_s(prof, n, 512)}
            for n, t in ((100, 10), (700, 40), (1500, 20), (3000, 80))]
    cal = fit(prof, "disaggregated", rows, 512)
    assert (cal.ttft_overhead_s, cal.prefill_scale) == pytest.approx((0.05, 1.3), rel=1e-6)
    assert (cal.decode_start_s, cal.decode_scale) == pytest.approx((0.02, 1.5), rel=1e-6)
    plain = simulate(prof, disagg(), [RequestSpec(0.0, 1000, 11)]).records[0]
    calibrated = simulate(prof.with_calibration(cal), disagg(), [RequestSpec(0.0, 1000, 11)]).records[0]
    assert calibrated.ttft_s == pytest.approx(0.05 + 1.3 * plain.ttft_s)
    assert calibrated.finish_s - calibrated.first_token_s == pytest.approx(
        488 * 1e-5 + 0.02 + 1.5 * (plain.finish_s - plain.first_token_s - 488 * 1e-5))
    assert prof.with_calibration(cal).calibration("colocated") == Calibration.identity("colocated")


def test_calibration_never_fits_free_work():
    """Times that do not grow with the predicted work (here they even shrink a little: noise) make the best
    non-negative fit a pure offset with scale 0, which would make simulated prefill and decode free: the
    scale is then fitted alone."""
    from controller.planner.calibrate import _fit_offset_and_scale, fit

    prof = make_profile()
    rows = [{"prompt": n, "tokens": t, "ttft_s": 0.30 - 0.001 * i, "decode_s": 0.50 - 0.001 * i}
            for i, (n, t) in enumerate([(200, 11), (800, 21), (1600, 41), (3000, 81)])]
    assert _fit_offset_and_scale([1.0, 2.0, 3.0], [0.3, 0.299, 0.298])[1] > 0
    cal = fit(prof, "colocated", rows, 512)
    assert cal.prefill_scale > 0 and cal.decode_scale > 0
    assert cal.ttft_overhead_s == 0.0 and cal.decode_start_s == 0.0


def colocated(instances=2, budget=512) -> SimConfig:
    return SimConfig("colocated", colocated=PoolPlan(instances, 1, 1, 1 << 20, budget, 64))


def test_contention_slows_the_steps_of_an_instance_while_another_is_busy():
    """contention_scale 1.5 on two colocated instances: a request alone runs at the profile's speed; of
    two arriving together, the first starts its (single-step) prefill while the other instance is idle,
    the second while the first is busy, so its prefill takes 1.5x as long."""
    import dataclasses

    from controller.planner.profile import Calibration

    prof = make_profile()
    busy = prof.with_calibration(dataclasses.replace(Calibration.identity("colocated"), contention_scale=1.5))
    alone = simulate(busy, colocated(), [RequestSpec(0.0, 400, 5)]).records[0]
    assert alone.ttft_s == pytest.approx(simulate(prof, colocated(), [RequestSpec(0.0, 400, 5)]).records[0].ttft_s)
    first, second = simulate(busy, colocated(), [RequestSpec(0.0, 400, 5), RequestSpec(0.0, 400, 5)]).records
    assert first.ttft_s == pytest.approx(alone.ttft_s)
    assert second.ttft_s == pytest.approx(1.5 * alone.ttft_s)
    # a single instance has no one to contend with
    solo = simulate(busy, colocated(instances=1), [RequestSpec(0.0, 400, 5), RequestSpec(0.0, 400, 5)]).records
    assert solo[0].ttft_s == pytest.approx(alone.ttft_s)


def test_step_noise_spreads_step_times_at_the_same_mean_and_queues_grow_with_it():
    """Step times drawn from the calibrated spread (half the steps 0.5x, half 1.5x): a request alone takes
    one of the two times; near capacity the mean TTFT grows (queueing behind slow steps outweighs the fast
    ones), while at low load it stays about the same; the same seed gives the same run."""
    import dataclasses

    from controller.planner.profile import Calibration

    prof = make_profile()
    noisy = prof.with_calibration(dataclasses.replace(Calibration.identity("colocated"),
                                                      step_noise={"colocated": (0.5, 1.5)}))
    cfg = SimConfig("colocated", colocated=PoolPlan(1, 1, 1, 1 << 20, 512, 64))
    alone = simulate(prof, cfg, [RequestSpec(0.0, 400, 2)]).records[0].ttft_s
    draws = {round(simulate(noisy, cfg, [RequestSpec(0.0, 400, 2)], seed=s).records[0].ttft_s / alone, 6)
             for s in range(20)}
    assert draws == {0.5, 1.5}

    def mean_ttft(p, rate: float, seed: int = 0) -> float:
        trace = [RequestSpec(i / rate, 400, 2) for i in range(300)]  # a prefill of 45 ms + 2 decode steps
        return statistics.fmean(r.ttft_s for r in simulate(p, cfg, trace, seed=seed).records)

    busy_rate = 0.95 / (alone + 0.01)
    assert mean_ttft(noisy, busy_rate) > 1.5 * mean_ttft(prof, busy_rate)
    assert mean_ttft(noisy, 2.0) == pytest.approx(mean_ttft(prof, 2.0), rel=0.15)
    assert mean_ttft(noisy, busy_rate, seed=3) == mean_ttft(noisy, busy_rate, seed=3)
    # the isolated terms alone carry no spread
    assert noisy.calibration("colocated").without_contention().step_noise == {}


def test_per_step_contention_charges_each_busy_instance_for_every_step_completed():
    """contention_step_s on two colocated instances: of two identical single-step prefills arriving
    together, the second starts while the first is busy; each loses contention_step_s per step of either
    (1 / D of its own, 1 / D of the other's over its duration D): D + 2 x contention_step_s. Alone: D."""
    import dataclasses

    from controller.planner.profile import Calibration

    prof = make_profile()
    per_step = 0.004
    busy = prof.with_calibration(dataclasses.replace(Calibration.identity("colocated"), contention_step_s=per_step))
    alone = simulate(busy, colocated(), [RequestSpec(0.0, 400, 5)]).records[0]
    assert alone.ttft_s == pytest.approx(simulate(prof, colocated(), [RequestSpec(0.0, 400, 5)]).records[0].ttft_s)
    first, second = simulate(busy, colocated(), [RequestSpec(0.0, 400, 5), RequestSpec(0.0, 400, 5)]).records
    assert first.ttft_s == pytest.approx(alone.ttft_s)
    assert second.ttft_s == pytest.approx(alone.ttft_s + 2 * per_step)


def test_per_step_contention_prices_fewer_longer_decode_steps_as_less_interference():
    """The same long prompt prefilled while the decode instance serves short requests: with speculation
    (fewer, longer decode steps) the prefill is slowed less than with plain decode steps, under the per-step
    term; the busy-share term cannot tell the two apart."""
    import dataclasses

    from controller.planner.profile import Calibration

    prof = make_profile(prefill_per_token=2e-4)
    trace = [RequestSpec(0.01 * i, 32, 200) for i in range(8)] + [RequestSpec(0.5, 3000, 2)]

    speculative = SpeculationConfig(drafter="self_sparse", k_policy="fixed", k=4)

    def long_prompt_ttft(cal, spec) -> float:
        return simulate(prof.with_calibration(cal), disagg(spec=spec), trace).records[-1].ttft_s

    alone = long_prompt_ttft(Calibration.identity("disaggregated"), NO_SPECULATION)
    per_step = dataclasses.replace(Calibration.identity("disaggregated"), contention_step_s=0.003)
    slowed_plain, slowed_spec = long_prompt_ttft(per_step, NO_SPECULATION), long_prompt_ttft(per_step, speculative)
    assert alone < slowed_spec < slowed_plain
    share = dataclasses.replace(Calibration.identity("disaggregated"), contention_scale=1.3)
    assert long_prompt_ttft(share, speculative) == pytest.approx(long_prompt_ttft(share, NO_SPECULATION), rel=0.02)


def test_contention_fit_recovers_the_term_behind_a_burst():
    """Latencies of a burst simulated with a known per-step contention cost: the calibration's burst rate
    keeps the instances busy, and the grid search finds the cost behind them."""
    import dataclasses

    from controller.planner.calibrate import BURST_UTILISATION, burst_trace, calibration_lengths, fit_contention
    from controller.planner.profile import Calibration

    prof = make_profile(prefill_per_token=2e-4, transfer_per_token=1e-5)
    config = disagg()
    trace = burst_trace(prof, config, calibration_lengths(3000, 24, 1), (17, 33, 65), seed=0)
    util = simulate(prof, config, trace).instance_utilisation
    assert sum(util.values()) / len(util) >= BURST_UTILISATION
    truth = prof.with_calibration(dataclasses.replace(Calibration.identity("disaggregated"), contention_step_s=0.0023))
    rows = [{"prompt": r.prompt_tokens, "tokens": r.completion_tokens, "ttft_s": r.ttft_s,
             "decode_s": r.finish_s - r.first_token_s} for r in simulate(truth, config, trace).records]
    assert rows != [{"prompt": r.prompt_tokens, "tokens": r.completion_tokens, "ttft_s": r.ttft_s,
                     "decode_s": r.finish_s - r.first_token_s} for r in simulate(prof, config, trace).records]
    per_step, err = fit_contention(prof, config, trace, rows, seeds=1)
    assert per_step == pytest.approx(0.0023) and err == pytest.approx(0.0, abs=1e-9)


def test_burst_falls_back_to_the_busiest_rate_when_the_target_is_out_of_reach(monkeypatch):
    """A few small requests may never keep both roles busy enough: the burst then uses the rate at which the
    simulated instances are busiest instead of failing the calibration."""
    import dataclasses

    from controller.planner import calibrate

    prof = make_profile(prefill_per_token=2e-4, transfer_per_token=1e-5)
    config = disagg()
    monkeypatch.setattr(calibrate, "BURST_UTILISATION", 1.01)  # unreachable
    trace = calibrate.burst_trace(prof, config, calibrate.calibration_lengths(512, 6, 1), (17, 33, 65), seed=0)

    def busy(t):
        util = simulate(prof, config, t).instance_utilisation
        return sum(util.values()) / len(util)

    assert len(trace) == 6 and busy(trace) > 0
    for stretch in (2.0, 10.0):  # the same arrivals at lower rates keep the instances less busy
        other = [dataclasses.replace(r, arrival_s=r.arrival_s * stretch) for r in trace]
        assert busy(trace) > busy(other)


@pytest.mark.parametrize("config_name,workload,rate", [("local.yaml", "long_doc", 0.3),  # speculates at long contexts
                                                        ("local-colocated.yaml", "chat", 4.0)])
def test_a_profile_at_speed_f_runs_a_trace_f_times_as_slow(config_name, workload, rate):
    """``Profile.at_speed``: a machine f times as slow serving arrivals f times as far apart is the same run
    with every time multiplied by f. On the recorded CPU profile, whose calibrations carry every term (per-step
    and per-output contention, the spread of step times, speculation with the adaptive policy)."""
    root = os.path.join(os.path.dirname(__file__), "..")
    profile = Profile.load(os.path.join(root, "benchmarks", "results", "profile_local_cpu.json"))
    config = SimConfig.from_cluster_config(load_config(os.path.join(root, "cluster_configs", config_name)))
    trace = make_trace(workload_shape(workload), rate, 20, seed=3)
    f = 1.3
    base = simulate(profile, config, trace, seed=1)
    slow = simulate(profile.at_speed(f), config, [RequestSpec(f * r.arrival_s, r.prompt_tokens, r.output_tokens)
                                                  for r in trace], seed=1)
    assert any(r.accepted_tokens for r in base.records) or config.mode == "colocated"
    for a, b in zip(base.records, slow.records):
        assert b.ttft_s == pytest.approx(f * a.ttft_s, rel=1e-9)
        assert b.tpot_s == pytest.approx(f * a.tpot_s, rel=1e-9)
        assert (b.accepted_tokens, b.completion_tokens) == (a.accepted_tokens, a.completion_tokens)
    assert slow.instance_utilisation == pytest.approx(base.instance_utilisation, rel=1e-9)
    with pytest.raises(ValueError, match="speed factor"):
        profile.at_speed(0.0)


def test_a_cpu_pools_threads_are_its_tensor_parallel_devices_both_ways():
    """``plan_output`` writes a CPU pool of tp t as t threads; a config read back gives the same pool, and a
    profile that measured no t-thread instance refuses it by name rather than simulating something else."""
    from controller.planner.plan_output import _pool_fields

    root = os.path.join(os.path.dirname(__file__), "..")
    config = SimConfig.from_cluster_config(load_config(os.path.join(root, "cluster_configs", "local-prefill2.yaml")))
    assert (config.prefill.tensor_parallel, config.prefill.pipeline_parallel) == (2, 1)
    assert (config.decode.tensor_parallel, config.decode.pipeline_parallel) == (1, 1)
    assert _pool_fields(config.prefill, gpu=False)["threads"] == 2
    profile = Profile.load(os.path.join(root, "benchmarks", "results", "profile_local_cpu.json"))
    with pytest.raises(ProfileError, match="tensor_parallel=2"):
        simulate(profile, config, make_trace(workload_shape("long_doc"), 0.3, 3, seed=0))


def _sharing_profile(prefill_factor: float, decode_factor: float) -> Profile:
    from controller.planner.profile import CoreSharing

    return dataclasses.replace(make_profile(tps=(1, 2)),
                               core_sharing=(CoreSharing(2, 1, 2, prefill_factor, decode_factor, 10, 10),))


def _shared(cores: int = 2) -> SimConfig:
    return SimConfig("disaggregated", prefill=PoolPlan(1, 2, 1, 1 << 20, 512, 16), decode=PoolPlan(1, 1, 1, 1 << 20, 1, 64),
                     speculation=NO_SPECULATION, shared_cores=cores)


def test_instances_sharing_cores_slow_each_other_only_while_both_are_busy():
    """A 2-thread prefill and a 1-thread decode instance on 2 cores (prefill 1.5x, decode 2x slower while the
    other role is busy), by hand: A (1000-token prompt) is prefilled alone in 55 ms (2.5 ms + 0.05 ms/token per
    step at tp 2) and its first decode step (10 ms) runs alone, 55-65 ms. B arrives at 60 ms; its reservation
    waits for that step, so B's prefill runs 65-147.5 ms against A's decode: 55 ms of work at 1.5x. A's decode
    steps take 20 ms meanwhile (65-145 ms), the one started at 145 ms is contended for 2.5 ms (1.25 ms of work)
    and alone for its last 8.75 ms, and the last four take 10 ms: A finishes at 196.25 ms."""
    trace = [RequestSpec(0.0, 1000, 11), RequestSpec(0.06, 1000, 11)]
    a, b = simulate(_sharing_profile(1.5, 2.0), _shared(), trace).records
    # (the 1e-7 s floor of a zero-cost KV transfer shifts the decode steps)
    assert a.ttft_s == pytest.approx(0.055, abs=1e-6)
    assert b.ttft_s == pytest.approx(0.065 - 0.06 + 1.5 * 0.055, abs=1e-6)
    assert a.finish_s == pytest.approx(0.19625, abs=1e-6)
    # factors of 1 are the same cluster on separate cores
    alone = simulate(_sharing_profile(1.0, 1.0), _shared(), trace).records
    separate = simulate(_sharing_profile(1.0, 1.0), dataclasses.replace(_shared(), shared_cores=0), trace).records
    assert alone == separate
    assert b.ttft_s > alone[1].ttft_s and a.finish_s > alone[0].finish_s
    # a calibrated contention term (2x while the other instance is busy) applies on top of a two-process
    # sharing, not on top of one measured in place, which holds it already: the hand timings above again
    contended = dataclasses.replace(Calibration.identity("disaggregated"), contention_scale=2.0)
    processes = _sharing_profile(1.5, 2.0).with_calibration(contended)
    in_place = dataclasses.replace(processes, core_sharing=tuple(
        dataclasses.replace(c, source="burst") for c in processes.core_sharing))
    assert in_place.sharing(2, 1).measured_in_place and not processes.sharing(2, 1).measured_in_place
    assert simulate(in_place, _shared(), trace).records == [a, b]
    slower = simulate(processes, _shared(), trace).records
    assert slower[1].ttft_s > b.ttft_s and slower[0].finish_s > a.finish_s


def test_a_prefill_that_yields_threads_to_busy_decode_runs_the_step_on_fewer_threads_from_its_start():
    """The run above with the prefill on 1 thread while decode is busy (2 + 1 threads on 2 cores shares them at
    1.5x / 2x; 1 + 1 fits them: no slowdown). B's prefill starts at 65 ms beside A's decode, so both of its
    steps run on 1 thread, twice their 2-thread time (56.2 + 53.8 ms: B's first token at 175 ms) and A's decode
    is never slowed (10 steps of 10 ms from 55 ms). A's prefill started with decode idle: 2 threads, 55 ms."""
    config = dataclasses.replace(_shared(), prefill=dataclasses.replace(_shared().prefill, threads_when_decode_busy=1))
    a, b = simulate(_sharing_profile(1.5, 2.0), config, [RequestSpec(0.0, 1000, 11), RequestSpec(0.06, 1000, 11)]).records
    assert a.ttft_s == pytest.approx(0.055, abs=1e-6)
    assert a.finish_s == pytest.approx(0.155, abs=1e-6)
    assert b.first_token_s == pytest.approx(0.065 + 2 * 0.055, abs=1e-6)
    assert b.finish_s == pytest.approx(0.175 + 0.1, abs=1e-6)
    with pytest.raises(SimConfigError, match="threads_when_decode_busy"):
        PoolPlan(1, 2, threads_when_decode_busy=3).validate("prefill")
    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "cluster_configs", "local-prefill2-yield.yaml"))
    assert SimConfig.from_cluster_config(cfg, cores=2).prefill.threads_when_decode_busy == 1


def test_shared_cores_configs_are_validated_and_need_a_measured_pair():
    assert _shared().devices == 2  # per-core goodput counts the cores, not the threads
    with pytest.raises(SimConfigError, match="more threads than cores"):
        _shared(cores=3)
    with pytest.raises(SimConfigError, match="one prefill and one decode instance"):
        SimConfig("disaggregated", prefill=PoolPlan(2, 2, 1), decode=PoolPlan(1, 1, 1), shared_cores=2)
    with pytest.raises(ProfileError, match="--add-threads"):
        simulate(make_profile(tps=(1, 2)), _shared(), [RequestSpec(0.0, 100, 2)])
    root = os.path.join(os.path.dirname(__file__), "..")
    cfg = load_config(os.path.join(root, "cluster_configs", "local-prefill2.yaml"))
    assert SimConfig.from_cluster_config(cfg, cores=2).shared_cores == 2
    assert SimConfig.from_cluster_config(cfg, cores=4).shared_cores == 0  # 3 threads fit on 4 cores
    assert SimConfig.from_cluster_config(cfg).shared_cores == 0


def test_plan_shares_cores_when_the_measured_sharing_pays_and_serve_accepts_the_plan(tmp_path):
    """A CPU profile of 1- and 2-thread instances on 2 cores: a 2-thread prefill beside a 1-thread decode
    instance is a candidate only through its measured core sharing. Sharing for free, it beats every
    arrangement that fits the cores (prefill twice as fast, decode as fast); the plan is written as 2 + 1
    threads on 2 cores. The dearer the measured sharing, the lower its simulated goodput."""
    from controller.cli import main
    from controller.planner.profile import CoreSharing

    base = make_profile(prefill_per_token=2e-4, step_s=0.004, tps=(1, 2))
    base = dataclasses.replace(base, device_type="cpu", devices_per_node=2, source="measured")

    def profile(factor: float) -> Profile:
        return dataclasses.replace(base, core_sharing=(CoreSharing(2, 1, 2, factor, factor),))

    prof_path = tmp_path / "p.json"
    profile(1.0).save(str(prof_path))
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--profile", str(prof_path), "--ttft-ms", "3000", "--tpot-ms", "50", "--workload", "long_doc",
                 "--num-requests", "60", "--verify-top", "2", "--no-speculation", "--out", str(out)]) == 0
    cfg = load_config(str(out))
    assert (cfg.mode, cfg.prefill.threads, cfg.decode.threads) == ("disaggregated", 2, 1)
    assert cfg.prefill.cpus_per_instance + cfg.decode.cpus_per_instance <= 2
    assert SimConfig.from_cluster_config(cfg, cores=2).shared_cores == 2
    assert "sharing 2 cores" in (tmp_path / "plan.md").read_text()
    # --no-shared-cores: only arrangements with a core per thread
    assert main(["plan", "--profile", str(prof_path), "--ttft-ms", "3000", "--tpot-ms", "50", "--workload", "long_doc",
                 "--num-requests", "60", "--verify-top", "2", "--no-speculation", "--no-shared-cores",
                 "--out", str(out)]) == 0
    assert "sharing" not in (tmp_path / "plan.md").read_text().split("## Per-phase screening")[1]

    def sharing_goodput(factor: float) -> float:
        planner = Planner(profile(factor), SLOTarget(3.0, 0.05), Workload(shape=workload_shape("long_doc"),
                                                                          num_requests=60),
                          SearchSpace(devices=2, tensor_parallel=(1, 2), shared_cores=2), verify_top=1, progress=False)
        (cand,) = [c for c in planner.run().candidates
                   if c.config.shared_cores and not c.config.prefill.threads_when_decode_busy]
        return cand.goodput

    assert sharing_goodput(1.0) > sharing_goodput(3.0) > 0

    # a 2-thread prefill 3x slower beside busy decode: yielding to 1 thread (2x its 2-thread time) pays
    planner = Planner(profile(3.0), SLOTarget(3.0, 0.05), Workload(shape=workload_shape("long_doc"), num_requests=60),
                      SearchSpace(devices=2, tensor_parallel=(1, 2), shared_cores=2), verify_top=1, progress=False)
    shared = {c.config.prefill.threads_when_decode_busy: c for c in planner.run().candidates if c.config.shared_cores}
    assert set(shared) == {0, 1} and "1 thread(s) while decode is busy" in shared[1].describe()
    assert shared[1].goodput > shared[0].goodput


def _wall_s(start: float, work: float, busy_from: float, busy_to: float, factor: float) -> float:
    """Wall time of ``work`` seconds of alone-speed work started at ``start`` that progresses ``factor`` times
    slower inside [busy_from, busy_to] (the simulator's processor sharing)."""
    t, left = start, work
    if t < busy_from:  # alone until busy_from
        step = min(left, busy_from - t)
        t, left = t + step, left - step
    if left > 0 and t < busy_to:  # shared until busy_to
        step = min(left * factor, busy_to - t)
        t, left = t + step, left - step / factor
    return t + left - start


def test_core_sharing_in_place_reads_each_roles_slowdown_from_a_served_pass_log():
    """A synthetic served timeline of a 2-thread prefill and a 1-thread decode instance under processor
    sharing: decode steps from 0 (profiled speed alone, 1.2x slower while prefill runs), prefill passes
    back to back from 0.5 s (1.5x the profile alone, 2x slower while decode runs). Passes that straddle the
    other role's start or end are slowed for the overlapped part only; the fit on overlaps recovers prefill
    2x, decode 1.2x, prefill scale 1.5, and the simulator takes the served entry over the two-process one."""
    from controller.planner.core_sharing import in_place
    from controller.planner.interference import predicted_s, prefill_features
    from controller.planner.profile import CoreSharing

    prof = make_profile(tps=(1, 2))
    tps = {"prefill": 2, "decode": 1}
    prefill_start, rows, t = 0.503, [], 0.0
    while t < 1.0:
        verify = {"kind": "verify", "worker": 1, "passes": 1, "seqs": 4, "kv_tokens": 4000, "new_tokens": 8, "k": 1}
        verify["seconds"] = _wall_s(t, predicted_s(prof, verify, None, tps), prefill_start, math.inf, 1.2)
        verify["end_s"] = t + verify["seconds"]
        rows += [verify, {**verify, "kind": "step"}]
        t = verify["end_s"]
    decode_end, t, n = t, prefill_start, 0
    while t < 2.0:
        n += 1
        row = {"kind": "prefill", "worker": 0, **prefill_features([(0, 50 + 10 * (n % 7))])}
        row["seconds"] = _wall_s(t, 1.5 * predicted_s(prof, row, None, tps), 0.0, decode_end, 2.0)
        row["end_s"] = t + row["seconds"]
        rows.append(row)
        t = row["end_s"]
    served = in_place(prof, rows, 2, 1, 2)
    assert (served.source, served.prefill_threads, served.decode_threads) == ("served", 2, 1)
    assert served.prefill_factor == pytest.approx(2.0, rel=2e-3) and served.decode_factor == pytest.approx(1.2, rel=2e-3)
    assert served.prefill_scale == pytest.approx(1.5, rel=2e-3)
    # classed by whether the other role was busy as a pass started, the straddling passes would blur it
    assert served.prefill_units == sum(r["kind"] == "prefill" and r["end_s"] - r["seconds"] < decode_end for r in rows)
    both = dataclasses.replace(prof, core_sharing=(CoreSharing(2, 1, 2, 3.0, 1.4), served))
    assert both.sharing(2, 1) is served
    with pytest.raises(ValueError, match="no prefill passes with the other role idle"):
        in_place(prof, [r for r in rows if r["kind"] != "prefill" or r["end_s"] <= decode_end], 2, 1, 2)