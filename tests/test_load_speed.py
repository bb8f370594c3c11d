"""controller/planner/load_speed.py: the machine's speed under load, read from the workers' pass logs against
the calibrated pass model; and interference.activities (what it reads) against a brute-force oracle.

The recorded profile of session 14 keeps its calibration bursts' passes: real timelines with contention."""

from __future__ import annotations

import os
import random

import pytest

from controller.planner import interference
from controller.planner.calibrate import BURST_PASS_KINDS, burst_passes_kind, passes_key
from controller.planner.load_speed import LoadSpeed, load_speed
from controller.planner.profile import Profile

ROOT = os.path.join(os.path.dirname(__file__), "..")
PROFILE = os.path.join(ROOT, "benchmarks", "results", "same_session_14", "profile_local_cpu.json")


def burst_rows(profile: Profile, mode: str) -> list[dict]:
    """The calibration burst's passes of ``mode`` kept in the profile: a real cluster's timeline."""
    return [{"kind": kind, **row} for kind in BURST_PASS_KINDS
            for row in profile.samples.get(passes_key(mode, burst_passes_kind(kind)), [])]


@pytest.fixture(scope="module")
def profile() -> Profile:
    return Profile.load(PROFILE)


def slowed(rows: list[dict], factor: float) -> list[dict]:
    """The same passes on a machine ``factor`` times as slow: every duration, and every time since the
    first pass began, times ``factor``."""
    t0 = min(r["end_s"] - r["seconds"] for r in rows)
    return [{**r, "seconds": factor * r["seconds"], "end_s": t0 + factor * (r["end_s"] - t0)} for r in rows]


def priced_timeline(profile: Profile, prefill_factor: float, decode_factor: float, step_extra_s: float = 0.0):
    """A disaggregated window whose passes take ``prefill_factor`` / ``decode_factor`` times what the simulator
    charges (no contention in ``profile``): prefill passes on worker 0; on worker 1, speculative steps of a
    verify pass and a k = 2 draft record, then the step record (its passes' time plus ``step_extra_s``)."""
    cal = profile.calibration("disaggregated")
    rows, t = [], 1.8e9
    for n in range(1, 41):
        row = {"kind": "prefill", "worker": 0, **interference.prefill_features([(0, 16 * n)])}
        row["seconds"] = prefill_factor * interference.predicted_s(profile, row) * cal.prefill_busy_scale
        row["end_s"] = t + row["seconds"]
        t = row["end_s"]
        rows.append(row)
    t = 1.8e9
    for n in range(1, 81):
        seqs = 1 + n % 6
        verify = {"kind": "verify", "worker": 1, "passes": 1, "seqs": seqs, "kv_tokens": 300 * seqs,
                  "new_tokens": 3 * seqs, "k": 0}
        draft = {"kind": "draft", "worker": 1, "passes": 2, "seqs": 2 * seqs, "kv_tokens": 64 * seqs,
                 "new_tokens": 2 * seqs, "k": 0}
        step_s = 0.0
        for row, scale in ((draft, cal.draft_pass_scale), (verify, cal.verify_pass_scale)):
            row["seconds"] = decode_factor * interference.predicted_s(profile, row, DRAFTER) * scale * cal.decode_scale
            row["end_s"] = t + step_s + row["seconds"]
            step_s += row["seconds"]
        step = {"kind": "step", "worker": 1, "passes": 1, "seqs": seqs, "kv_tokens": 0, "new_tokens": 0, "k": 2,
                "seconds": step_s + step_extra_s, "end_s": t + step_s + step_extra_s}
        t = step["end_s"]
        rows += [draft, verify, step]
    return rows


DRAFTER = "self_sparse"  # the recorded profile's drafter


def test_passes_at_the_simulators_price_read_their_factor_per_role(profile):
    quiet = profile.without_contention()
    est = load_speed(quiet, "disaggregated", priced_timeline(quiet, 0.8, 1.3), DRAFTER)
    assert est.by_role == {"decode": pytest.approx(1.3), "prefill": pytest.approx(0.8)}
    assert min(est.by_role.values()) < est.factor < max(est.by_role.values())  # time-weighted between them
    assert est.passes == 40 + 2 * 80
    # the decode role's time is its whole steps: work beyond the passes reads as a slower decode role
    slower = load_speed(quiet, "disaggregated", priced_timeline(quiet, 0.8, 1.3, step_extra_s=0.01), DRAFTER)
    assert slower.by_role["decode"] > 1.35 and slower.by_role["prefill"] == pytest.approx(0.8)


def test_a_timeline_reads_each_windows_speed_against_the_rates(profile):
    """A rate whose passes ran at the simulator's price for its first half and 1.5x that for its second: each
    role's window factors are their window's speed over the rate's, 1.5 apart, aligned at ``origin_s``."""
    from controller.planner.load_speed import speed_timeline

    quiet = profile.without_contention()
    rows = priced_timeline(quiet, 1.0, 1.0)
    t0 = min(r["end_s"] - r["seconds"] for r in rows)
    half = (max(r["end_s"] for r in rows) - t0) / 2

    def later_slower(r: dict) -> dict:  # each pass keeps its start; those from half on take 1.5x as long
        start = r["end_s"] - r["seconds"]
        seconds = r["seconds"] * (1.5 if start - t0 >= half else 1.0)
        return {**r, "seconds": seconds, "end_s": start + seconds}

    rows = [later_slower(r) for r in rows]
    rate = load_speed(quiet, "disaggregated", rows, DRAFTER)
    timeline = speed_timeline(quiet, "disaggregated", rows, half, 7.0, DRAFTER)
    assert timeline.starts_s[:2] == (7.0, 7.0 + half)
    first, second = timeline.factors[:2]
    for role in ("prefill", "decode"):
        assert second[role] / first[role] == pytest.approx(1.5, rel=1e-6)
        # the rate's factor lies between its windows'
        assert min(first[role], second[role]) < 1.0 < max(first[role], second[role])
        assert timeline.factor(role, 0.0) == first[role] and timeline.factor(role, 1e9) == timeline.factors[-1].get(role, 1.0)
    assert rate.by_role["prefill"] == pytest.approx(1.25, rel=0.05)
    # a window with too few of a role's steps (here: none) leaves that role at the rate's speed
    early_prefill = [r for r in rows if r["kind"] != "prefill" or r["end_s"] - r["seconds"] - t0 < half]
    few = speed_timeline(quiet, "disaggregated", early_prefill, half, 0.0, DRAFTER)
    assert "prefill" in few.factors[0] and "prefill" not in few.factors[1] and "decode" in few.factors[1]
    assert few.factor("prefill", half + 1.0) == 1.0
    with pytest.raises(ValueError, match="positive"):
        speed_timeline(quiet, "disaggregated", rows, 0.0, 0.0, DRAFTER)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
@pytest.mark.parametrize("factor", [0.8, 1.3])
def test_a_uniformly_slower_machine_reads_that_much_slower(profile, mode, factor):
    """Busy shares are unchanged, steps per second fall by the factor; the per-step contention terms are
    seconds per step and scale with the machine (Profile.at_speed): the fixed point moves by the factor."""
    rows = burst_rows(profile, mode)
    base, est = load_speed(profile, mode, rows), load_speed(profile, mode, slowed(rows, factor))
    assert est.factor == pytest.approx(factor * base.factor, rel=1e-6)
    assert est.by_role == {role: pytest.approx(factor * v, rel=1e-4) for role, v in base.by_role.items()}
    assert set(est.by_role) == ({"prefill", "decode"} if mode == "disaggregated" else {"colocated"})


def test_role_speeds_rescale_their_own_terms(profile):
    assert profile.at_role_speeds(1.2, 1.2, 1.2) == profile.at_speed(1.2)
    faster_prefill = profile.at_role_speeds(0.5, 1.0, 1.0)
    assert faster_prefill.prefill_model(1).coefficients == tuple(0.5 * c for c in profile.prefill_model(1).coefficients)
    assert faster_prefill.target_model(1) == profile.target_model(1)
    assert faster_prefill.kv_transfer.coefficients == tuple(0.5 * c for c in profile.kv_transfer.coefficients)
    cal, new = profile.calibration("disaggregated"), faster_prefill.calibration("disaggregated")
    assert (new.ttft_overhead_s, new.decode_start_s) == (0.5 * cal.ttft_overhead_s, cal.decode_start_s)
    est = LoadSpeed(0.9, {"prefill": 0.5, "decode": 1.0}, 1, {})
    assert est.apply(profile).calibration("disaggregated").contention_output_s == pytest.approx(
        0.9 * cal.contention_output_s)
    with pytest.raises(ValueError, match="decode"):
        profile.at_role_speeds(1.0, 0.0, 1.0)


def test_missing_inputs_are_errors(profile):
    with pytest.raises(ValueError, match="no timed passes"):
        load_speed(profile, "colocated", [])
    draft = {"kind": "draft", "seconds": 0.01, "end_s": 1e9, "passes": 2, "seqs": 1, "kv_tokens": 60,
             "new_tokens": 2, "k": 0, "worker": 1}
    with pytest.raises(ValueError, match="drafter"):
        load_speed(profile, "disaggregated", [draft])


def _brute_activities(profile, rows):
    """interference.activities as first written: every pass against every other pass (quadratic)."""
    out = []
    workers = list(dict.fromkeys(interference.worker_of(r) for r in rows))
    for worker in workers:
        others = [r for r in rows if interference.worker_of(r) != worker]
        spans = interference.intervals([r for r in others if r["kind"] in interference.PASS_KINDS])
        ends = sorted((r["end_s"], interference.outputs_of(r)) for r in others
                      if r["kind"] in interference.STEP_END_KINDS)
        for r in rows:
            if r["kind"] not in interference.PASS_KINDS or interference.worker_of(r) != worker:
                continue
            start, end = r["end_s"] - r["seconds"], r["end_s"]
            done = [n for t, n in ends if start < t <= end]
            span = max(end - start, 1e-9)
            out.append((r["kind"], interference.covered(start, end, spans, len(workers) - 1), len(done) / span,
                        sum(done) / span))
    return out


def test_activities_equal_the_quadratic_definition(profile):
    """Three workers (a prefill worker, two decode workers with steps) on Unix-time timestamps: busy shares,
    step and output rates as the pairwise definition gives them."""
    rng = random.Random(3)
    rows = []
    for worker in range(3):
        t = 1.8e9 + rng.random()
        for _ in range(300):
            seconds = rng.uniform(0.005, 0.2)
            if worker == 0:
                rows.append({"kind": "prefill", "seconds": seconds, "end_s": t + seconds, "worker": worker,
                             **interference.prefill_features([(0, rng.randrange(16, 512))])})
            else:
                shape = {"passes": 1, "seqs": rng.randrange(1, 9), "kv_tokens": 500, "new_tokens": 1, "k": 0}
                rows += [{"kind": "decode", "seconds": seconds, "end_s": t + seconds, "worker": worker, **shape},
                         {"kind": "step", "seconds": seconds, "end_s": t + seconds + 1e-4, "worker": worker, **shape}]
            t += seconds + rng.uniform(0.0, 0.05)
    fast = interference.activities(profile, rows)
    slow = _brute_activities(profile, rows)
    assert [a.kind for a in fast] == [k for k, *_ in slow] and len(fast) == 900
    for a, (_, share, steps, outputs) in zip(fast, slow):
        assert a.other_busy_share == pytest.approx(share, abs=1e-5)
        assert a.other_step_rate == pytest.approx(steps, rel=1e-4)  # spans from Unix times: 1e-7 s apart
        assert a.other_output_rate == pytest.approx(outputs, rel=1e-4)
    assert max(a.other_busy_share for a in fast) > 0.5  # the timeline overlaps


def test_passes_slowed_by_sharing_cores_read_as_the_machines_speed_once_sharing_is_priced(profile):
    """Prefill passes that all ran while a decode worker was busy, each ``f`` = 2.5 times the simulator's
    price: read without the core sharing they say the prefill role ran 2.5x slow; priced with a measured
    sharing of 2.5x for prefill (what the simulator applies while decode is busy) the machine ran as profiled."""
    from controller.planner.profile import CoreSharing

    quiet = profile.without_contention()
    cal = quiet.calibration("disaggregated")
    t0, rows = 1.8e9, []
    for i in range(800):  # decode busy throughout, 8 s
        rows.append({"kind": "decode", "worker": 1, "passes": 1, "seqs": 4, "kv_tokens": 2000, "new_tokens": 4, "k": 0,
                     "seconds": 0.01, "end_s": t0 + 0.01 * (i + 1)})
    t = t0 + 0.2
    for n in range(1, 11):
        row = {"kind": "prefill", "worker": 0, **interference.prefill_features([(0, 64 * n)])}
        row["seconds"] = 2.5 * interference.predicted_s(quiet, row) * cal.prefill_busy_scale
        row["end_s"] = t = t + row["seconds"]
        rows.append(row)
    assert t < t0 + 8.0  # every prefill pass overlapped by decode passes
    plain = load_speed(quiet, "disaggregated", rows)
    shared = load_speed(quiet, "disaggregated", rows, sharing=CoreSharing(1, 2, 2, 2.5, 1.0))
    assert plain.by_role["prefill"] == pytest.approx(2.5, rel=1e-3)
    assert shared.by_role["prefill"] == pytest.approx(1.0, rel=1e-3)
    # a 2-thread decode instance's passes are priced by the profile's tp 2 model: missing, it names what is
    with pytest.raises(Exception, match="tensor_parallel=2"):
        load_speed(quiet, "disaggregated", rows, tps={"decode": 2})
