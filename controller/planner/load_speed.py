"""How fast a serving cluster ran under load, relative to its profile, from the workers' own pass logs.

A profile describes the machine when it was taken; a shared machine drifts (15-26 % in 90 minutes on the
CPU VM, ``benchmarks/results/same_session_13``). Lone requests on an idle server (``benchmarks/_speed_probe.py``)
measure the drift between rates, but not while the rate runs: in one recorded run they said 13-20 % faster
than the loaded run turned out to be (``benchmarks/results/same_session_14``). This module measures the speed
*during* the load, from the passes the workers timed then (``modeling/pass_log.py``, drained through the
``DrainPassLog`` RPC by ``benchmarks/slo_sweep.py``).

Each timed pass is priced by the calibrated pass model, the one the simulator runs, given what the rest of
the cluster measurably did during it:

    modelled = profiled time (``interference.predicted_s``) x kind scale x contention x role baseline

* kind scale: ``verify_pass_scale`` / ``draft_pass_scale`` for speculative passes (1 otherwise);
* contention: ``1 + (contention_scale - 1) x busy share + F x (contention_step_s x steps/s +
  contention_output_s x outputs/s)`` with the other workers' busy share, steps and outputs measured from
  their logged passes (``interference.activities``; the per-step terms are seconds per step, so they scale
  with the speed F, as in ``Profile.at_speed``);
* role baseline: measured / modelled of the same role's passes in the calibration burst the contention terms
  were fitted to (stored in the profile's samples): what the model leaves out on average at the profile's
  own speed (the reference ratio of passes that ran alone, the skew of the spread), so that the burst itself
  reads exactly 1.

The **load speed factor** F solves F = sum(measured) / sum(modelled(F)) over every timed pass of the window
(time-weighted: a role counts as long as it was busy); ``Profile.at_speed(F)`` is then the profile of the
machine as it ran. It uses what the rate itself did (its passes), not its latencies: the simulator still has
to get the queueing, batching and attainment right from that speed.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.planner.interference import (ROLE_OF_KIND, PassActivity, activities, contention_variable,
                                             output_variable, predicted_s)
from controller.planner.profile import Calibration, Profile, ProfileError

FIXED_POINT_ITERATIONS = 50
FIXED_POINT_TOLERANCE = 1e-12


@dataclass(frozen=True)
class LoadSpeed:
    """The speed of the machine over a window of passes, relative to the profile (1.0: as profiled; 1.2:
    20 % slower). ``by_role``: the same ratio over one role's passes alone (reported, not applied)."""

    factor: float
    by_role: dict[str, float]
    passes: int
    busy_s: dict[str, float]  # seconds of timed passes per role


def burst_rows(profile: Profile, mode: str) -> list[dict]:
    """The calibration burst's pass rows of ``mode`` stored in ``profile`` (``calibrate.calibrate``)."""
    from controller.planner.calibrate import BURST_PASS_KINDS, burst_passes_kind, passes_key

    rows = [{"kind": kind, **row} for kind in BURST_PASS_KINDS
            for row in profile.samples.get(passes_key(mode, burst_passes_kind(kind)), [])]
    if not any(r["kind"] != "step" for r in rows):
        raise ProfileError(f"profile has no calibration-burst passes for mode {mode!r} (samples "
                           f"'{passes_key(mode, 'burst_*')}'); calibrate it with `magicserve profile --calibrate-only`")
    return rows


def kind_scale(cal: Calibration, kind: str) -> float:
    """The calibrated in-place speed of a pass kind relative to the profile's plain passes."""
    return {"verify": cal.verify_pass_scale, "draft": cal.draft_pass_scale}.get(kind, 1.0)


def _contention(cal: Calibration, a: PassActivity, speed: float) -> float:
    return (1.0 + (cal.contention_scale - 1.0) * a.other_busy_share
            + speed * (cal.contention_step_s * contention_variable(a) + cal.contention_output_s * output_variable(a)))


def _priced(profile: Profile, cal: Calibration, rows: list[dict], drafter: str | None
            ) -> list[tuple[PassActivity, float]]:
    """Each timed pass's activity and its profiled time times its kind scale."""
    acts = activities(profile, rows, drafter)
    return [(a, a.seconds / a.ratio * kind_scale(cal, a.kind)) for a in acts]


def _ratios(cal: Calibration, priced: list[tuple[PassActivity, float]], speed: float,
            baseline: dict[str, float]) -> dict[str, tuple[float, float]]:
    """Per role: (measured seconds, modelled seconds at ``speed``)."""
    out: dict[str, tuple[float, float]] = {}
    for a, base in priced:
        role = ROLE_OF_KIND[a.kind]
        measured, modelled = out.get(role, (0.0, 0.0))
        out[role] = (measured + a.seconds, modelled + base * _contention(cal, a, speed) * baseline.get(role, 1.0))
    return out


def role_baselines(profile: Profile, mode: str) -> dict[str, float]:
    """Per role, measured / modelled time of the calibration burst's passes at the profile's speed."""
    cal = profile.calibration(mode)
    return {role: m / p for role, (m, p) in _ratios(cal, _priced(profile, cal, burst_rows(profile, mode), None),
                                                    1.0, {}).items() if p > 0}


def load_speed(profile: Profile, mode: str, rows: list[dict], drafter: str | None = None) -> LoadSpeed:
    """The load speed factor of ``rows`` (``interference.pass_row`` rows with ``worker`` indices: every
    worker's passes over one window, e.g. one rate of an SLO sweep) against ``profile``'s calibration of
    ``mode``. ``drafter``: the decode pool's drafter, when the rows hold draft passes."""
    cal = profile.calibration(mode)
    baseline = role_baselines(profile, mode)
    priced = _priced(profile, cal, rows, drafter)
    if not priced:
        raise ValueError("load speed: no timed passes to read")
    missing = {ROLE_OF_KIND[a.kind] for a, _ in priced} - set(baseline)
    if missing:
        raise ProfileError(f"profile's calibration burst for mode {mode!r} has no passes of role(s) "
                           f"{sorted(missing)}: cannot place them against it")
    speed = 1.0
    for _ in range(FIXED_POINT_ITERATIONS):
        per_role = _ratios(cal, priced, speed, baseline)
        new = sum(m for m, _ in per_role.values()) / sum(p for _, p in per_role.values())
        done = abs(new - speed) <= FIXED_POINT_TOLERANCE * new
        speed = new
        if done:
            break
    per_role = _ratios(cal, priced, speed, baseline)
    return LoadSpeed(speed, {role: m / p for role, (m, p) in sorted(per_role.items())}, len(priced),
                     {role: m for role, (m, _) in sorted(per_role.items())})
