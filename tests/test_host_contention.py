"""The host-contention plug-in (benchmarks/host_contention.py): its fit on pass logs, on synthetic
timelines whose slowdowns follow its per-step model with a known cost, and the simulator applying it
(off unless given)."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from benchmarks import host_contention
from benchmarks.host_contention import (HostContention, activities, fit_contention_terms, outputs_of,
                                        reference_ratios)
from planner.calibrate import pass_row, predicted_s
from planner.profile import (PREFILL_FEATURES, TRANSFER_FEATURES, FittedModel, InstanceCosts, Profile,
                                        mixed_pass_seconds, prefill_features)
from planner.simulator import simulate
from planner.search import NO_SPECULATION
from planner.workload import RequestSpec
from decode_worker.config import SpeculationConfig
from planner.simulator import PoolPlan, SimConfig
from tests.test_planner_sim import disagg, make_profile

PASS = ("passes", "seqs", "kv_tokens", "new_tokens")
DECODE_S = 0.005  # profiled plain decode pass
PREFILL_PER_TOKEN = 1e-4


def profile() -> Profile:
    costs = (InstanceCosts(1, FittedModel(PREFILL_FEATURES, (0.0, 0.0, PREFILL_PER_TOKEN, 0.0, 0.0), 0.0, 0),
                           FittedModel(PASS, (DECODE_S, 0.0, 0.0, 0.0), 0.0, 0), {}, 1 << 20),)
    return Profile("test", "cpu", 1, "m", 1000, 64, "measured", costs,
                   FittedModel(TRANSFER_FEATURES, (0.0, 0.0), 0.0, 0), ())


def prefill_row(start: float, seconds: float, tokens: int) -> dict:
    return {"kind": "prefill", "worker": 0, "seconds": seconds, "end_s": start + seconds,
            **prefill_features([(0, tokens)])}


def decode_rows(start: float, seconds: float) -> list[dict]:
    shape = {"passes": 1, "seqs": 1, "kv_tokens": 100, "new_tokens": 1, "k": 0}
    return [{"kind": "decode", "worker": 1, "seconds": seconds, "end_s": start + seconds, **shape},
            {"kind": "step", "worker": 1, "seconds": seconds, "end_s": start + seconds, **shape}]


def covered(start: float, end: float, spans: list[tuple[float, float]], workers: int = 1) -> float:
    """Oracle: the share of [start, end] covered by ``spans`` (the passes of ``workers`` workers), as the
    mean over those workers, capped at 1."""
    if end <= start:
        return 0.0
    total = sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans if b > start and a < end)
    return min(1.0, total / (end - start) / max(1, workers))


def timeline(step_s: float, decode_gap_s: float) -> list[dict]:
    """1000-token prefill passes back to back over [0, 4) s; decode steps of 5 ms over [0, 1) s and of
    20 ms over [1, 2) s (plain and speculative-like steps), each followed by ``decode_gap_s`` idle, none
    after 2 s. Each prefill pass is stretched by the per-step model with cost ``step_s``: the decode steps
    completed during it, plus its own step (1 / its duration) times the share of it the decode role was busy,
    as rates over its (stretched) duration: duration / alone - 1 = step_s x (steps + share) / duration."""
    rows: list[dict] = []
    for begin, end, decode_s in ((0.0, 1.0, DECODE_S), (1.0, 2.0, 4 * DECODE_S)):
        t = begin
        while t + decode_s <= end:
            rows += decode_rows(t, decode_s)
            t += decode_s + decode_gap_s
    decode_spans = [(r["end_s"] - r["seconds"], r["end_s"]) for r in rows if r["kind"] == "decode"]
    step_ends = [r["end_s"] for r in rows if r["kind"] == "step"]
    alone = 1000 * PREFILL_PER_TOKEN
    t = 0.0
    while t < 4.0:
        # the stretched duration depends on the steps inside it: iterate to the fixed point
        seconds = alone
        for _ in range(50):
            share = covered(t, t + seconds, decode_spans)
            steps = sum(t < e <= t + seconds for e in step_ends)
            seconds = alone * (1 + step_s * (steps + share) / seconds)
        rows.append(prefill_row(t, seconds, 1000))
        t += seconds
    return rows


def test_covered_share():
    spans = [(0.0, 1.0), (2.0, 3.0)]
    assert covered(0.5, 2.5, spans) == pytest.approx(0.5)
    assert covered(0.5, 2.5, spans + [(0.5, 2.5)], workers=2) == pytest.approx(0.75)  # mean over two workers
    assert covered(3.0, 4.0, spans) == 0.0
    assert covered(1.0, 1.0, spans) == 0.0


@pytest.mark.parametrize("gap", [0.0, 0.005])
def test_fit_recovers_the_per_step_cost_behind_a_timeline(gap):
    acts = activities(profile(), timeline(0.002, gap))
    refs = reference_ratios(acts)
    assert refs["prefill"] == pytest.approx(1.0)  # the uncontended half of the prefill passes
    prefill = [a for a in acts if a.kind == "prefill"]
    assert max(a.ratio for a in prefill) > 1.1  # the contended ones are visibly slower
    fit = fit_contention_terms([a for a in acts if a.kind == "prefill"])
    assert fit.step_s == pytest.approx(0.002, rel=0.1) and fit.busy_scale == pytest.approx(1.0, abs=0.03)


def test_no_contention_fits_zero():
    rows = [prefill_row(0.1 * i, 0.1, 1000) for i in range(20)]
    for i in range(100):
        rows += decode_rows(0.02 * i, DECODE_S)
    fit = fit_contention_terms(activities(profile(), rows))
    assert fit.step_s == pytest.approx(0.0, abs=1e-9) and fit.busy_scale == pytest.approx(1.0)
    assert fit.rms == pytest.approx(0.0, abs=1e-9)


def test_a_slowdown_that_follows_the_busy_share_fits_the_busy_share_term():
    """Prefill passes slowed by 30 % whenever the decode role is busy, whatever its step rate (slow and
    fast decode steps): the fit puts it on the busy-share term, not on the step term."""
    rows = []
    t = 0.0
    for i in range(40):  # prefill passes of 0.1 s alone; [0, 2): contended by 5 ms steps, [2, 4): by 25 ms steps
        contended = t < 4.0 and i % 2 == 0
        seconds = 0.1 * (1.3 if contended else 1.0)
        if contended:
            step = 0.005 if t < 2.0 else 0.025
            s = t
            while s + step <= t + seconds:
                rows += decode_rows(s, step)
                s += step
        rows.append(prefill_row(t, seconds, 1000))
        t += seconds + 0.001
    fit = fit_contention_terms([a for a in activities(profile(), rows) if a.kind == "prefill"])
    assert fit.busy_scale == pytest.approx(1.3, abs=0.03) and fit.step_s < 2e-4


def mixed_row(worker: int, start: float, seconds: float, chunks: list[tuple[int, int]], decode_seqs: int,
              decode_kv_tokens: int) -> dict:
    """A colocated instance's step as ``pass_row`` makes it from the engine's pass log."""
    record = {"kind": "mixed", "seconds": seconds, "end_s": start + seconds,
              "shape": {"chunks": [list(c) for c in chunks], "decode_seqs": decode_seqs,
                        "decode_kv_tokens": decode_kv_tokens}}
    return pass_row(record, worker)


def test_mixed_passes_are_priced_as_the_simulator_prices_a_colocated_step():
    p = profile()
    row = mixed_row(0, 0.0, 0.1, [(0, 500), (100, 200)], 3, 600)
    expected = mixed_pass_seconds(p.prefill_model(1), p.target_model(1), prefill_features([(0, 500), (100, 200)]), 3, 600)
    assert predicted_s(p, row) == pytest.approx(expected)
    assert expected == pytest.approx(700 * PREFILL_PER_TOKEN + DECODE_S)  # (this profile's prefill has no fixed cost)
    assert predicted_s(p, mixed_row(0, 0.0, 0.1, [], 2, 300)) == pytest.approx(DECODE_S)
    assert outputs_of(row) == 5  # three decode tokens and two prefill chunks


def test_colocated_instances_contend_with_each_other():
    """Two colocated instances whose steps run 40 % slower while the other one is in a step: grouped by
    worker, each pass is measured against the other instance's activity, and the fit finds the factor."""
    rows = []
    for worker, (begin, end) in enumerate([(0.0, 3.0), (1.5, 4.5)]):  # overlapping over [1.5, 3)
        t = begin
        while t < end:
            overlap = 1.5 <= t < 3.0
            seconds = (400 * PREFILL_PER_TOKEN + DECODE_S) * (1.4 if overlap else 1.0)  # alone: as profiled
            rows.append(mixed_row(worker, t, seconds, [(0, 400)], 1, 500))
            t += seconds
    acts = activities(profile(), rows)
    assert {a.kind for a in acts} == {"mixed"} and len(acts) == len(rows)
    assert reference_ratios(acts)["mixed"] == pytest.approx(1.0, rel=1e-6)
    fit = fit_contention_terms(acts)
    assert fit.busy_scale == pytest.approx(1.4, abs=0.05)
    # one worker's passes alone: there is nobody to contend with
    alone = activities(profile(), [{**r, "worker": 0} for r in rows])
    assert all(a.other_busy_share == 0.0 for a in alone)


def test_the_spread_of_passes_about_the_fit_is_kept_per_role():
    """Prefill passes alone, half at 0.8x and half at 1.2x the profile: the contention terms fit none,
    and the spread about the fit is kept for the simulator with mean 1 (0.8 / 1.2 about a median of 1)."""
    from benchmarks.host_contention import NOISE_QUANTILES, step_noise

    rows = [prefill_row(0.2 * i, 0.1 * (0.8 if i % 2 else 1.2), 1000) for i in range(200)]
    fit = fit_contention_terms(activities(profile(), rows))
    spread = fit.noise["prefill"]
    assert len(spread) == NOISE_QUANTILES and sum(spread) / len(spread) == pytest.approx(1.0)
    assert spread[0] == pytest.approx(0.8, abs=0.01) and spread[-1] == pytest.approx(1.2, abs=0.01)
    assert "decode" not in fit.noise  # no decode passes
    assert step_noise([1.0] * 10) == ()  # too few passes to say
    # a stall beyond the range is kept as the range's end; the mean stays 1
    tail = step_noise([1.0] * 200 + [50.0] * 20)
    assert max(tail) / min(tail) == pytest.approx(5.0) and sum(tail) / len(tail) == pytest.approx(1.0)


def colocated(instances=2, budget=512) -> SimConfig:
    return SimConfig("colocated", colocated=PoolPlan(instances, 1, 1 << 20, budget, 64))


def test_contention_slows_the_steps_of_an_instance_while_another_is_busy():
    """contention_scale 1.5 on two colocated instances: a request alone runs at the profile's speed; of
    two arriving together, the first starts its (single-step) prefill while the other instance is idle,
    the second while the first is busy, so its prefill takes 1.5x as long."""
    prof = make_profile()
    busy = HostContention("colocated", 1, scale=1.5)
    alone = simulate(prof, colocated(), [RequestSpec(0.0, 400, 5)], host_contention=busy).records[0]
    assert alone.ttft_s == pytest.approx(simulate(prof, colocated(), [RequestSpec(0.0, 400, 5)]).records[0].ttft_s)
    first, second = simulate(prof, colocated(), [RequestSpec(0.0, 400, 5), RequestSpec(0.0, 400, 5)],
                             host_contention=busy).records
    assert first.ttft_s == pytest.approx(alone.ttft_s)
    assert second.ttft_s == pytest.approx(1.5 * alone.ttft_s)
    # off by default: the same trace without the plug-in runs both at the profile's speed
    plain = simulate(prof, colocated(), [RequestSpec(0.0, 400, 5), RequestSpec(0.0, 400, 5)]).records
    assert plain[1].ttft_s == pytest.approx(alone.ttft_s)
    # a single instance has no one to contend with
    solo = simulate(prof, colocated(instances=1), [RequestSpec(0.0, 400, 5), RequestSpec(0.0, 400, 5)],
                    host_contention=busy).records
    assert solo[0].ttft_s == pytest.approx(alone.ttft_s)


def test_step_noise_spreads_step_times_at_the_same_mean_and_queues_grow_with_it():
    """Step times drawn from the calibrated spread (half the steps 0.5x, half 1.5x): a request alone takes
    one of the two times; near capacity the mean TTFT grows (queueing behind slow steps outweighs the fast
    ones), while at low load it stays about the same; the same seed gives the same run."""
    prof = make_profile()
    noisy = HostContention("colocated", 1, step_noise={"colocated": (0.5, 1.5)})
    cfg = SimConfig("colocated", colocated=PoolPlan(1, 1, 1 << 20, 512, 64))
    alone = simulate(prof, cfg, [RequestSpec(0.0, 400, 2)]).records[0].ttft_s
    draws = {round(simulate(prof, cfg, [RequestSpec(0.0, 400, 2)], seed=s, host_contention=noisy).records[0].ttft_s
                   / alone, 6)
             for s in range(20)}
    assert draws == {0.5, 1.5}

    def mean_ttft(plugin, rate: float, seed: int = 0) -> float:
        trace = [RequestSpec(i / rate, 400, 2) for i in range(300)]  # a prefill of 45 ms + 2 decode steps
        return statistics.fmean(r.ttft_s for r in simulate(prof, cfg, trace, seed=seed, host_contention=plugin).records)

    busy_rate = 0.95 / (alone + 0.01)
    assert mean_ttft(noisy, busy_rate) > 1.5 * mean_ttft(None, busy_rate)
    assert mean_ttft(noisy, 2.0) == pytest.approx(mean_ttft(None, 2.0), rel=0.15)
    assert mean_ttft(noisy, busy_rate, seed=3) == mean_ttft(noisy, busy_rate, seed=3)


def test_per_step_contention_charges_each_busy_instance_for_every_step_completed():
    """contention_step_s on two colocated instances: of two identical single-step prefills arriving
    together, the second starts while the first is busy; each loses contention_step_s per step of either
    (1 / D of its own, 1 / D of the other's over its duration D): D + 2 x contention_step_s. Alone: D."""
    prof = make_profile()
    per_step = 0.004
    busy = HostContention("colocated", 1, step_s=per_step)
    alone = simulate(prof, colocated(), [RequestSpec(0.0, 400, 5)], host_contention=busy).records[0]
    assert alone.ttft_s == pytest.approx(simulate(prof, colocated(), [RequestSpec(0.0, 400, 5)]).records[0].ttft_s)
    first, second = simulate(prof, colocated(), [RequestSpec(0.0, 400, 5), RequestSpec(0.0, 400, 5)],
                             host_contention=busy).records
    assert first.ttft_s == pytest.approx(alone.ttft_s)
    assert second.ttft_s == pytest.approx(alone.ttft_s + 2 * per_step)


def test_per_step_contention_prices_fewer_longer_decode_steps_as_less_interference():
    """The same long prompt prefilled while the decode instance serves short requests: with speculation
    (fewer, longer decode steps) the prefill is slowed less than with plain decode steps, under the per-step
    term; the busy-share term cannot tell the two apart."""
    prof = make_profile(prefill_per_token=2e-4)
    trace = [RequestSpec(0.01 * i, 32, 200) for i in range(8)] + [RequestSpec(0.5, 3000, 2)]

    speculative = SpeculationConfig(drafter="self_sparse", k_policy="fixed", k=4)

    def long_prompt_ttft(plugin, spec) -> float:
        return simulate(prof, disagg(spec=spec), trace, host_contention=plugin).records[-1].ttft_s

    alone = long_prompt_ttft(None, NO_SPECULATION)
    per_step = HostContention("disaggregated", 1, step_s=0.003)
    slowed_plain, slowed_spec = long_prompt_ttft(per_step, NO_SPECULATION), long_prompt_ttft(per_step, speculative)
    assert alone < slowed_spec < slowed_plain
    share = HostContention("disaggregated", 1, scale=1.3)
    assert long_prompt_ttft(share, speculative) == pytest.approx(long_prompt_ttft(share, NO_SPECULATION), rel=0.02)


def test_burst_falls_back_to_the_busiest_rate_when_the_target_is_out_of_reach(monkeypatch):
    """A few small requests may never keep both roles busy enough: the burst then uses the rate at which the
    simulated instances are busiest instead of failing the measurement."""
    from planner.calibrate import calibration_lengths

    prof = make_profile(prefill_per_token=2e-4, transfer_per_token=1e-5)
    config = disagg()
    trace = host_contention.burst_trace(prof, config, calibration_lengths(3000, 24, 1), (17, 33, 65), seed=0)
    util = simulate(prof, config, trace).instance_utilisation
    assert sum(util.values()) / len(util) >= host_contention.BURST_UTILISATION
    monkeypatch.setattr(host_contention, "BURST_UTILISATION", 1.01)  # unreachable
    trace = host_contention.burst_trace(prof, config, calibration_lengths(512, 6, 1), (17, 33, 65), seed=0)

    def busy(t):
        util = simulate(prof, config, t).instance_utilisation
        return sum(util.values()) / len(util)

    assert len(trace) == 6 and busy(trace) > 0
    for stretch in (2.0, 10.0):  # the same arrivals at lower rates keep the instances less busy
        other = [dataclasses.replace(r, arrival_s=r.arrival_s * stretch) for r in trace]
        assert busy(trace) > busy(other)
