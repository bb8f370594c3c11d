"""The contention fit on pass logs (controller/planner/interference.py), on synthetic timelines whose
slowdowns follow the simulator's per-step model with a known cost."""

from __future__ import annotations

import pytest

from controller.planner.interference import activities, covered, fit_step_contention, reference_ratios
from controller.planner.profile import (PREFILL_FEATURES, TRANSFER_FEATURES, FittedModel, InstanceCosts, Profile,
                                        prefill_features)

PASS = ("passes", "seqs", "kv_tokens", "new_tokens")
DECODE_S = 0.005  # profiled plain decode pass
PREFILL_PER_TOKEN = 1e-4


def profile() -> Profile:
    costs = (InstanceCosts(1, 1, FittedModel(PREFILL_FEATURES, (0.0, 0.0, PREFILL_PER_TOKEN, 0.0, 0.0), 0.0, 0),
                           FittedModel(PASS, (DECODE_S, 0.0, 0.0, 0.0), 0.0, 0), {}, 1 << 20),)
    return Profile("test", "cpu", 1, "m", 1000, 64, "measured", costs,
                   FittedModel(TRANSFER_FEATURES, (0.0, 0.0), 0.0, 0), ())


def prefill_row(start: float, seconds: float, tokens: int) -> dict:
    return {"kind": "prefill", "seconds": seconds, "end_s": start + seconds, **prefill_features([(0, tokens)])}


def decode_rows(start: float, seconds: float) -> list[dict]:
    shape = {"passes": 1, "seqs": 1, "kv_tokens": 100, "new_tokens": 1, "k": 0}
    return [{"kind": "decode", "seconds": seconds, "end_s": start + seconds, **shape},
            {"kind": "step", "seconds": seconds, "end_s": start + seconds, **shape}]


def timeline(step_s: float, decode_gap_s: float) -> list[dict]:
    """1000-token prefill passes back to back over [0, 4) s; decode steps over [0, 2) s only, each followed
    by ``decode_gap_s`` idle. While both run, each pass is stretched by the per-step model with cost
    ``step_s``: its own rate (1 / its duration, the other role busy throughout) plus the other's steps."""
    rows: list[dict] = []
    # decode: contended by the prefill (busy throughout [0, 2)): 1 + step_s / DECODE_S (own) + prefill rate
    prefill_alone = 1000 * PREFILL_PER_TOKEN
    decode_s = DECODE_S * (1 + step_s / DECODE_S + step_s / prefill_alone)
    t = 0.0
    while t + decode_s < 2.0:
        rows += decode_rows(t, decode_s)
        t += decode_s + decode_gap_s
    decode_rate = 1.0 / (decode_s + decode_gap_s)
    busy_share = decode_s / (decode_s + decode_gap_s)
    t = 0.0
    while t < 4.0:
        contended = t + prefill_alone < 2.0
        seconds = prefill_alone * (1 + step_s * (decode_rate + busy_share / prefill_alone)) if contended else prefill_alone
        rows.append(prefill_row(t, seconds, 1000))
        t += seconds
    return rows


def test_covered_share():
    spans = [(0.0, 1.0), (2.0, 3.0)]
    assert covered(0.5, 2.5, spans) == pytest.approx(0.5)
    assert covered(3.0, 4.0, spans) == 0.0
    assert covered(1.0, 1.0, spans) == 0.0


@pytest.mark.parametrize("gap", [0.0, 0.005])
def test_fit_recovers_the_per_step_cost_behind_a_timeline(gap):
    acts = activities(profile(), timeline(0.002, gap))
    refs = reference_ratios(acts)
    assert refs["prefill"] == pytest.approx(1.0)  # the uncontended half of the prefill passes
    prefill = [a for a in acts if a.kind == "prefill"]
    assert max(a.ratio for a in prefill) > 1.1  # the contended ones are visibly slower
    fit = fit_step_contention([a for a in acts if a.kind == "prefill"])
    assert fit.step_s == pytest.approx(0.002, rel=0.1)


def test_no_contention_fits_zero():
    rows = [prefill_row(0.1 * i, 0.1, 1000) for i in range(20)]
    for i in range(100):
        rows += decode_rows(0.02 * i, DECODE_S)
    fit = fit_step_contention(activities(profile(), rows))
    assert fit.step_s == pytest.approx(0.0, abs=1e-9) and fit.rms == pytest.approx(0.0, abs=1e-9)
