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
from planner.plan_output import plan_config
from planner.profile import (PREFILL_FEATURES, TRANSFER_FEATURES, AcceptanceEntry, Calibration,
                                        FittedModel, InstanceCosts, Profile, ProfileError)
from planner.search import (NO_SPECULATION, Planner, SearchSpace, SLOTarget, Workload,
                                       speculation_space)
from planner.simulator import PoolPlan, SimConfig, SimConfigError, simulate
from planner.slo import AttainmentWatch, RequestOutcome, attainment, goodput
from planner.workload import RequestSpec, WorkloadError, load_trace, make_trace, save_trace, workload_shape
from decode_worker.config import SpeculationConfig

PASS = ("passes", "seqs", "kv_tokens", "new_tokens")


def fitted(features, coefs) -> FittedModel:
    return FittedModel(tuple(features), tuple(coefs), 0.0, 0)


def make_profile(prefill_per_token=1e-4, step_s=0.01, rate=0.7, tps=(1,), transfer_per_token=0.0,
                 capacity=1 << 20, draft_step_s=0.002, per_seq_s=0.0) -> Profile:
    """prefill: 5 ms + per-token cost; decode pass: ``step_s`` + ``per_seq_s`` per sequence; draft pass:
    ``draft_step_s`` flat; TP t divides every cost by t."""
    costs = tuple(InstanceCosts(
        t,
        fitted(PREFILL_FEATURES, (5e-3 / t, 0.0, prefill_per_token / t, 0.0, 0.0)),
        fitted(PASS, (step_s / t, per_seq_s / t, 0.0, 0.0)),
        {"self_sparse": fitted(PASS, (draft_step_s / t, 0.0, 0.0, 0.0))},
        capacity * t) for t in tps)
    return Profile("test hardware", "gpu-test", 8, "test-model", 1000, 64, "analytical", costs,
                   fitted(TRANSFER_FEATURES, (0.0, transfer_per_token)),
                   (AcceptanceEntry("self_sparse", 256, 0, 1 << 30, rate, 1000),))


def disagg(spec=NO_SPECULATION, np_=1, nd=1, decode_capacity=1 << 20, budget=512, tp=1) -> SimConfig:
    return SimConfig("disaggregated", prefill=PoolPlan(np_, tp, 1 << 20, budget, 16),
                     decode=PoolPlan(nd, tp, decode_capacity, 1, 64), speculation=spec)


def test_single_request_timings_match_the_cost_models():
    prof = make_profile(transfer_per_token=1e-5)
    res = simulate(prof, disagg(), [RequestSpec(0.0, 1000, 11)])
    r = res.records[0]
    # two prefill steps (512 + 488 tokens), 5 ms + 0.1 ms/token each
    assert r.ttft_s == pytest.approx(2 * 5e-3 + 1000 * 1e-4)
    # the last chunk's KV (488 tokens) arrives 4.88 ms after the first token, then 10 steps of 10 ms
    assert r.finish_s - r.first_token_s == pytest.approx(488 * 1e-5 + 10 * 0.01)
    assert r.completion_tokens == 11 and r.finished


def test_a_cached_prefix_is_not_computed_again_but_its_kv_is_still_sent(tmp_path):
    """700 of 1000 prompt tokens cached on the prefill instance: one 300-token step (5 ms + 30 ms) instead
    of two; the KV transfer still carries all 1000 tokens' KV. A trace file keeps the cached tokens."""
    prof = make_profile(transfer_per_token=1e-5)
    r = simulate(prof, disagg(), [RequestSpec(0.0, 1000, 11, cached_tokens=700)]).records[0]
    assert r.ttft_s == pytest.approx(5e-3 + 300 * 1e-4)
    assert r.finish_s - r.first_token_s == pytest.approx(1000 * 1e-5 + 10 * 0.01)
    path = str(tmp_path / "trace.jsonl")
    save_trace([RequestSpec(0.0, 1000, 11, 700), RequestSpec(0.5, 20, 3)], path)
    assert [r.cached_tokens for r in load_trace(path)] == [700, 0]
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"arrival_s": 1.0, "prompt_tokens": 10, "output_tokens": 2, "cached_tokens": 10}\n')
    with pytest.raises(WorkloadError, match=r"trace.jsonl:3: cached_tokens must be in \[0, prompt_tokens\)"):
        load_trace(path)


def test_a_decode_instance_with_room_is_contacted_with_prefill_even_mid_step():
    """A decodes in 10 ms steps from 15 ms on (its 15 ms prefill); B arrives mid-step at 50.1 ms. The decode
    instance has room, so the router sends B to it and to prefill at once: B's 15 ms prefill starts on arrival
    (the hold, answered when the step ends at 55 ms, is in place long before B's KV lands)."""
    prof = make_profile()
    a, b = simulate(prof, disagg(), [RequestSpec(0.0, 100, 11), RequestSpec(0.0501, 100, 4)]).records
    prefill_s = 5e-3 + 100 * 1e-4
    assert a.ttft_s == pytest.approx(prefill_s)
    assert b.ttft_s == pytest.approx(prefill_s, abs=1e-6)  # (+ the 0.1 us floor of a free transfer)


def test_without_room_a_request_waits_for_memory_to_free():
    """Decode-first when the decode instance has no room (one sequence at most): B's hold is answered when A's
    step ends and refused; B is held, and prefilled, once A finishes (15 ms + 10 steps of 10 ms)."""
    prof = make_profile()
    cfg = SimConfig("disaggregated", prefill=PoolPlan(1, 1, 1 << 20, 512, 16), decode=PoolPlan(1, 1, 1 << 20, 1, 1),
                    speculation=NO_SPECULATION)
    a, b = simulate(prof, cfg, [RequestSpec(0.0, 100, 11), RequestSpec(0.0501, 100, 4)]).records
    prefill_s = 5e-3 + 100 * 1e-4
    assert a.ttft_s == pytest.approx(prefill_s)
    assert b.ttft_s == pytest.approx(a.finish_s + prefill_s - 0.0501, abs=1e-6)
    # an idle decode instance answers at once
    (alone,) = simulate(prof, disagg(), [RequestSpec(0.0501, 100, 4)]).records
    assert alone.ttft_s == pytest.approx(prefill_s)


def test_colocated_single_request():
    prof = make_profile()
    cfg = SimConfig("colocated", colocated=PoolPlan(1, 1, 1 << 20, 512, 64))
    r = simulate(prof, cfg, [RequestSpec(0.0, 1000, 5)]).records[0]
    assert r.ttft_s == pytest.approx(2 * 5e-3 + 1000 * 1e-4)
    assert r.tpot_s == pytest.approx(0.01)


def test_colocated_decode_shares_steps_with_prefill():
    """A decode running beside another request's prefill pays for the mixed steps (interference)."""
    prof = make_profile()
    cfg = SimConfig("colocated", colocated=PoolPlan(1, 1, 1 << 20, 512, 64))
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


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
@pytest.mark.parametrize("slo", ["both", "ttft_only", "tpot_only"])
def test_a_watched_simulation_stops_early_with_the_full_runs_verdict(mode, slo):
    prof = make_profile(prefill_per_token=1e-5, step_s=0.01, per_seq_s=0.002)
    cfg = disagg(SpeculationConfig(k=2), decode_capacity=400_000) if mode == "disaggregated" else SimConfig(
        "colocated", colocated=PoolPlan(1, 1, 40_000, 512, 64))
    shape = workload_shape("long_doc")
    verdicts, stopped = [], 0
    for rate in (4.0, 8.0, 16.0, 32.0, 64.0):
        trace = make_trace(shape, rate, 80, seed=5)
        full = getattr(attainment(simulate(prof, cfg, trace, seed=1).outcomes(), 1.0, 0.03), slo)
        for target in (0.5, 0.95):
            watch = AttainmentWatch(len(trace), 1.0, 0.03, target, slo)
            res = simulate(prof, cfg, trace, seed=1, watch=watch)
            assert res.verdict == (full >= target), (rate, target, full)
            verdicts.append(res.verdict)
            stopped += sum(not r.finished for r in res.records) > 0
    assert True in verdicts and False in verdicts  # the rates span both answers
    assert stopped >= 4  # decided runs stop before every request finishes


def test_attainment_watch_decides_once_the_settled_requests_do():
    w = AttainmentWatch(10, 1.0, 0.1, 0.8)
    for i in range(7):
        w.finished(i, 0.5, 0.05)
    assert w.verdict is None and w.binding == "-"
    w.finished(7, 2.0, 0.05)  # late first token
    w.finished(7, 0.5, 0.05)  # settled already: not a hit
    assert w.verdict is None and (w.hits, w.misses) == (7, 1)
    w.miss(8, tpot=True)
    w.miss(9, ttft=True)
    assert w.verdict is False and w.binding == "TTFT"
    w = AttainmentWatch(10, 1.0, 0.1, 0.8, "ttft_only")
    for i in range(8):
        w.finished(i, 0.5, 9.0)  # TPOT is not watched
    assert w.verdict is True
    with pytest.raises(ValueError, match="slo: must be one of both, ttft_only, tpot_only"):
        AttainmentWatch(10, 1.0, 0.1, 0.8, "p99")


def test_the_simulators_block_pool_counts_blocks_as_the_real_one_does():
    from planner.sim_instances import CountingBlockPool
    from modeling.block_pool import BlockTable
    from modeling.errors import OutOfBlocksError
    pool = CountingBlockPool(10, 16)
    table = BlockTable(16)
    assert table.ensure_capacity(pool, 100) and pool.num_free == 3 and len(table.blocks) == 7
    with pytest.raises(OutOfBlocksError, match="need 4 KV blocks, 3 free of 10"):
        pool.allocate(4)
    assert pool.num_free == 3  # a refused allocation takes nothing
    table.truncate(pool, 40)
    assert pool.num_free == 7
    table.release(pool)
    assert pool.num_free == 10
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([0])


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
    with pytest.raises(SimConfigError, match="prefill.instances: must be >= 0, got -1"):
        SimConfig("disaggregated", prefill=PoolPlan(-1), decode=PoolPlan(1))
    with pytest.raises(SimConfigError, match="decode.instances: must be >= 1, got 0"):
        SimConfig("disaggregated", prefill=PoolPlan(1), decode=PoolPlan(0))
    assert SimConfig("disaggregated", prefill=PoolPlan(0), decode=PoolPlan(1)).devices == 1  # decode prefills


def test_planner_balances_the_phases():
    """Prefill is 4x dearer per request than decode: with 5 devices the plan gives prefill more instances."""
    prof = make_profile(prefill_per_token=4e-4, step_s=0.004)
    planner = Planner(prof, SLOTarget(3.0, 0.05), Workload(shape=workload_shape("long_doc"), num_requests=80),
                      SearchSpace(devices=5, tensor_parallel=(1,), include_colocated=False), progress=False)
    best = planner.run().best
    assert best.config.mode == "disaggregated"
    assert best.config.prefill.instances > best.config.decode.instances
    assert best.goodput > 0


def _goodput_by_full_simulations(prof, cfg, workload, slo, metric, bisect_steps):
    """The planner's doubling-then-bisection, each probe a whole simulation (no early stop): the oracle."""
    def ok(rate):
        res = simulate(prof, cfg, workload.at_rate(rate), seed=workload.seed, time_limit_s=600.0)
        return getattr(attainment(res.outcomes(), slo.ttft_s, slo.tpot_s), metric) >= slo.attainment

    lo, hi = 0.0, 0.05
    while ok(hi):
        lo, hi = hi, hi * 2
    assert lo > 0, "the oracle's first probe failed: pick an easier configuration"
    for _ in range(bisect_steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


@pytest.mark.parametrize("metric", ["both", "ttft_only"])
def test_planner_goodput_with_early_stops_equals_the_search_over_whole_simulations(metric):
    prof = make_profile(prefill_per_token=2e-4, step_s=0.01, per_seq_s=0.002)
    slo = SLOTarget(1.0, 0.04)
    workload = Workload(shape=workload_shape("chat"), num_requests=60, min_duration_s=10.0)
    planner = Planner(prof, slo, workload, SearchSpace(devices=2, tensor_parallel=(1,)), bisect_steps=4,
                      progress=False)
    cfg = disagg(SpeculationConfig(k=2), decode_capacity=200_000)
    assert planner.goodput(cfg, metric) == _goodput_by_full_simulations(prof, cfg, workload, slo, metric, 4) > 0


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
    planner = Planner(prof, SLOTarget(3.0, 0.05), Workload(shape=workload_shape("long_doc"), num_requests=60, min_duration_s=5.0),
                      SearchSpace(devices=4, tensor_parallel=(1, 2), speculation=speculation_space(prof)[:2]),
                      verify_top=2, bisect_steps=3, progress=False)
    best = planner.run().best
    out = tmp_path / "plan.yaml"
    base = os.path.join(os.path.dirname(__file__), "..", "cluster_configs", "local.yaml")
    raw = plan_config(best, base, str(out), prof, SLOTarget(3.0, 0.05))
    out.write_text(yaml.safe_dump(raw))
    cfg = load_config(str(out))
    assert os.path.isdir(cfg.model_path)  # the model path was re-based to the output directory
    assert cfg.slo.tpot_ms == pytest.approx(50)
    if cfg.mode == "disaggregated":
        assert cfg.prefill.devices_per_instance == cfg.prefill.tensor_parallel
        assert cfg.prefill.instances == best.config.prefill.instances
    assert math.isfinite(best.per_device)


def test_plan_cli_writes_a_config_serve_accepts(tmp_path, capsys):
    from frontend.cli import main

    prof = make_profile(prefill_per_token=2e-4, step_s=0.004)
    prof = Profile(**{**prof.__dict__, "device_type": "cpu", "devices_per_node": 3})
    prof.save(str(tmp_path / "p.json"))
    out = tmp_path / "plan.yaml"
    rc = main(["plan", "--profile", str(tmp_path / "p.json"), "--ttft-ms", "3000", "--tpot-ms", "50",
               "--workload", "long_doc", "--num-requests", "60", "--min-duration-s", "5", "--verify-top", "2",
               "--out", str(out)])
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
    with pytest.raises(SystemExit, match="--min-duration-s must be > 0, got 0.0"):
        main(["plan", "--profile", str(tmp_path / "p.json"), "--ttft-ms", "1", "--tpot-ms", "1", "--min-duration-s", "0",
              "--out", str(out)])


def test_calibration_fit_recovers_serving_path_terms_and_the_simulator_applies_them():
    from planner.calibrate import fit, kv_tail_s, predicted_decode_s, predicted_prefill_s
    from planner.profile import Calibration

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
    from planner.calibrate import _fit_offset_and_scale, fit

    prof = make_profile()
    rows = [{"prompt": n, "tokens": t, "ttft_s": 0.30 - 0.001 * i, "decode_s": 0.50 - 0.001 * i}
            for i, (n, t) in enumerate([(200, 11), (800, 21), (1600, 41), (3000, 81)])]
    assert _fit_offset_and_scale([1.0, 2.0, 3.0], [0.3, 0.299, 0.298])[1] > 0
    cal = fit(prof, "colocated", rows, 512)
    assert cal.prefill_scale > 0 and cal.decode_scale > 0
    assert cal.ttft_overhead_s == 0.0 and cal.decode_start_s == 0.0


def test_a_cpu_pool_is_ranks_times_threads_both_ways():
    """A CPU pool is ``tensor_parallel`` rank processes of ``threads`` threads, a device per thread:
    ``plan_output`` writes a shape as it reads back, and a profile that measured no such shape refuses it by
    name rather than simulating something else."""
    from planner.plan_output import _pool_fields

    root = os.path.join(os.path.dirname(__file__), "..")
    config = SimConfig.from_cluster_config(load_config(os.path.join(root, "cluster_configs", "local-prefill2.yaml")))
    assert config.prefill.shape == (1, 2) and config.decode.shape == (1, 1)
    assert config.prefill.devices == 2
    assert _pool_fields(config.prefill, gpu=False) | {"kv_cache_tokens": 0} == {
        "instances": 1, "kv_cache_tokens": 0, "tensor_parallel": 1, "devices_per_instance": 0, "threads": 2,
        "cpus_per_instance": 2.0}
    ranks = PoolPlan(1, 2, 4096, 512, 16, threads=1)
    fields = _pool_fields(ranks, gpu=False)
    assert (fields["tensor_parallel"], fields["threads"], fields["cpus_per_instance"]) == (2, 1, 2.0)
    with pytest.raises(ProfileError, match="threads=2"):
        simulate(make_profile(), config, make_trace(workload_shape("long_doc"), 0.3, 3, seed=0))


def test_a_gpu_pool_is_one_gpu_per_rank():
    root = os.path.join(os.path.dirname(__file__), "..")
    cfg = load_config(os.path.join(root, "cluster_configs", "gpu-8xa100-llama3.1-8b.yaml"))
    config = SimConfig.from_cluster_config(cfg)
    assert config.prefill.shape == config.decode.shape == (1, 1) and config.devices == 8
    spread = dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, devices_per_instance=2))
    with pytest.raises(SimConfigError, match="decode.devices_per_instance"):
        SimConfig.from_cluster_config(spread)


def test_cpu_search_compares_ranks_with_threads_and_picks_by_goodput():
    """On two cores the search weighs a TP-2 instance (two 1-thread ranks) against one 2-thread process and
    two 1-thread instances; the faster shape's costs decide, whichever it is."""
    base = make_profile(tps=(1,))
    one = base.instances[0]

    def shape(tp, threads, speedup):
        scaled = lambda fm: FittedModel(fm.features, tuple(c / speedup for c in fm.coefficients), 0.0, 0)  # noqa: E731
        return dataclasses.replace(one, tensor_parallel=tp, threads=threads, prefill=scaled(one.prefill),
                                   target_pass=scaled(one.target_pass),
                                   draft_pass={k: scaled(v) for k, v in one.draft_pass.items()})

    wl = Workload(shape=workload_shape("chat"), num_requests=20, min_duration_s=3.0)
    slo = SLOTarget(2.0, 0.008)  # a TPOT only the faster shape's decode pass (10 ms / 1.9) meets
    for fast in ((2, 1), (1, 2)):
        slow = (1, 2) if fast == (2, 1) else (2, 1)
        prof = dataclasses.replace(base, device_type="cpu", instances=(one, shape(*fast, 1.9), shape(*slow, 1.2)))
        space = SearchSpace(devices=3, shapes=((1, 1), (2, 1), (1, 2)), include_colocated=False)
        result = Planner(prof, slo, wl, space, verify_top=2, bisect_steps=3, progress=False).run()
        assert set(result.screening["prefill"]) == {"tp1", "tp2", "tp1 x 2 threads"}
        best = result.best.config
        assert best.decode.shape == fast and best.prefill.shape == (1, 1)
        assert best.devices == 3


def _skewed_two_decode(migration):
    from planner.sim_migration import SimMigration

    # A (long) -> decode-0, B (short) -> decode-1, C (long) -> decode-0 (the fewest assigned, first by name):
    # two long requests outgrow decode-0's 50 blocks while decode-1 idles once B is done
    trace = [RequestSpec(0.0, 100, 400), RequestSpec(0.001, 100, 5), RequestSpec(0.002, 100, 400)]
    cfg = dataclasses.replace(disagg(nd=2, decode_capacity=800),
                              migration=SimMigration(interval_s=0.05) if migration else None)
    return simulate(make_profile(transfer_per_token=1e-6), cfg, trace)


def test_migration_moves_a_long_request_off_a_crowded_decode_instance():
    without, with_ = _skewed_two_decode(False), _skewed_two_decode(True)
    assert without.migrations is None and sum(r.preemptions for r in without.records) > 0
    assert with_.migrations.committed >= 1 and sum(r.preemptions for r in with_.records) == 0
    assert [r.completion_tokens for r in with_.records] == [400, 5, 400] and all(r.finished for r in with_.records)
    # no preemption and recompute: the long requests finish sooner; each move paused its request for the
    # copy of its last two blocks and the commit
    assert max(r.finish_s for r in with_.records) < max(r.finish_s for r in without.records)
    assert with_.migrations.pauses_s == pytest.approx([32 * 1e-6 + 0.01] * with_.migrations.committed)


def test_migration_needs_disaggregated_mode_and_valid_settings():
    from planner.sim_migration import SimMigration

    with pytest.raises(SimConfigError, match="migration"):
        SimConfig("colocated", colocated=PoolPlan(1, 1, 1 << 20, 512, 16), migration=SimMigration())
    with pytest.raises(ValueError, match="migration.interval_s"):
        SimMigration(interval_s=0)
