"""controller/planner/load_speed.py: the machine's speed under load, read from the workers' pass logs against
the calibrated pass model; and interference.activities (what it reads) against a brute-force oracle.

The recorded profile of session 14 keeps its calibration bursts' passes (the model's baseline)."""

from __future__ import annotations

import os
import random

import pytest

from controller.planner import interference
from controller.planner.load_speed import burst_rows, load_speed, role_baselines
from controller.planner.profile import Profile, ProfileError

ROOT = os.path.join(os.path.dirname(__file__), "..")
PROFILE = os.path.join(ROOT, "benchmarks", "results", "same_session_14", "profile_local_cpu.json")
MODES = ("disaggregated", "colocated")


@pytest.fixture(scope="module")
def profile() -> Profile:
    return Profile.load(PROFILE)


def slowed(rows: list[dict], factor: float) -> list[dict]:
    """The same passes on a machine ``factor`` times as slow: every duration, and every time since the
    first pass began, times ``factor``."""
    t0 = min(r["end_s"] - r["seconds"] for r in rows)
    return [{**r, "seconds": factor * r["seconds"], "end_s": t0 + factor * (r["end_s"] - t0)} for r in rows]


@pytest.mark.parametrize("mode", MODES)
def test_the_calibration_burst_itself_runs_at_speed_one(profile, mode):
    est = load_speed(profile, mode, burst_rows(profile, mode))
    assert est.factor == pytest.approx(1.0, abs=1e-9)
    assert all(v == pytest.approx(1.0, abs=1e-9) for v in est.by_role.values())
    assert set(est.by_role) == ({"prefill", "decode"} if mode == "disaggregated" else {"colocated"})
    assert est.passes == sum(r["kind"] != "step" for r in burst_rows(profile, mode))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("factor", [0.8, 1.3])
def test_a_uniformly_slower_machine_reads_as_that_factor(profile, mode, factor):
    """Busy shares are unchanged, steps per second fall by the factor; the per-step contention terms are
    seconds per step and scale with the machine (Profile.at_speed): the fixed point is exactly the factor."""
    est = load_speed(profile, mode, slowed(burst_rows(profile, mode), factor))
    assert est.factor == pytest.approx(factor, rel=1e-6)
    assert all(v == pytest.approx(factor, rel=1e-6) for v in est.by_role.values())


def test_one_slower_role_moves_its_own_ratio_most(profile):
    rows = [{**r, "seconds": 1.4 * r["seconds"]} if r["kind"] == "prefill" else r
            for r in burst_rows(profile, "disaggregated")]
    est = load_speed(profile, "disaggregated", rows)
    assert est.by_role["prefill"] > 1.3 and est.by_role["decode"] < 1.1
    assert 1.0 < est.factor < est.by_role["prefill"]  # time-weighted between the roles


def test_missing_inputs_are_errors_that_say_what_to_do(profile):
    bare = Profile.load(os.path.join(ROOT, "benchmarks", "results", "profile_local_cpu.json"))  # no stored bursts
    with pytest.raises(ProfileError, match="--calibrate-only"):
        role_baselines(bare, "colocated")
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
