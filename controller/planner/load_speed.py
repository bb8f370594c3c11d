"""How fast a serving cluster ran under load, relative to its profile, from the workers' own pass logs.

A profile describes the machine when it was taken; a shared machine drifts (15-26 % in 90 minutes on the
CPU VM, ``benchmarks/results/same_session_13``). Lone requests on an idle server (``benchmarks/_speed_probe.py``)
measure the drift between rates, but not while the rate runs: in one recorded run they said 13-20 % faster
than the loaded run turned out to be (``benchmarks/results/same_session_14``). This module measures the speed
*during* the load, from the passes the workers timed then (``modeling/pass_log.py``, drained through the
``DrainPassLog`` RPC by ``benchmarks/slo_sweep.py``).

Each role's time is priced exactly as the simulator prices its steps (``sim_instances``), given what the
rest of the cluster measurably did meanwhile:

* a prefill pass: profiled time x ``prefill_busy_scale``;
* a decode step: its verify (or plain decode) and draft passes, each profiled time x its kind's scale
  (``verify_pass_scale``, ``draft_pass_scale``), summed, x ``decode_scale``; measured as the whole step
  (the worker's ``step`` records: passes plus the step's own work, which ``decode_scale`` covers);
* a colocated (mixed) step: ``mixed_pass_seconds`` with both scales;

each times the contention factor ``1 + (contention_scale - 1) x busy share + F x (contention_step_s x
steps/s + contention_output_s x outputs/s)``, with the other workers' busy share, steps and outputs measured
from their logged passes (``interference.activities``; the per-step terms are seconds per step and scale
with the speed F, as in ``Profile.at_speed``). The step-time spread the simulator draws has mean 1.

A role's **speed factor** is its measured time over its priced time (1.0: as the simulator assumes; 0.8:
20 % faster). ``LoadSpeed.apply`` rescales the profile role by role (``Profile.at_role_speeds``): the prefill
model, the KV transfer and the TTFT overhead by the prefill role's factor, the target and draft models and
the decode start by the decode role's, the per-step contention terms by the time-weighted factor of all
roles (``factor``, the fixed point F above). Colocated instances are one role.

It reads what the rate itself did (its passes), not its latencies: the simulator still has to get the
queueing, batching, transfers and attainment right from those speeds.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.planner.interference import (ROLE_OF_KIND, PassActivity, activities, contention_variable,
                                             output_variable, timed_rows)
from controller.planner.profile import Calibration, Profile, mixed_pass_seconds

FIXED_POINT_ITERATIONS = 50
FIXED_POINT_TOLERANCE = 1e-12


@dataclass(frozen=True)
class LoadSpeed:
    """The speed of the machine over a window of passes relative to what the simulator assumes (1.0: as
    profiled; 1.2: 20 % slower): ``by_role`` per role (measured / priced time), ``factor`` over all of them
    (time-weighted)."""

    factor: float
    by_role: dict[str, float]
    passes: int
    busy_s: dict[str, float]  # measured seconds per role (decode: its whole steps)

    def apply(self, profile: Profile) -> Profile:
        """``profile`` on the machine as it ran: each role at its own factor."""
        if "prefill" in self.by_role or "decode" in self.by_role:
            return profile.at_role_speeds(self.by_role.get("prefill", self.factor),
                                          self.by_role.get("decode", self.factor), self.factor)
        return profile.at_speed(self.factor)


def kind_scale(cal: Calibration, kind: str) -> float:
    """The calibrated in-place speed of a decode-role pass kind relative to a plain decode pass."""
    return {"verify": cal.verify_pass_scale, "draft": cal.draft_pass_scale}.get(kind, 1.0)


def _contention(cal: Calibration, a: PassActivity, speed: float) -> float:
    return (1.0 + (cal.contention_scale - 1.0) * a.other_busy_share
            + speed * (cal.contention_step_s * contention_variable(a) + cal.contention_output_s * output_variable(a)))


def simulated_price(profile: Profile, cal: Calibration, row: dict, activity: PassActivity) -> float:
    """What the simulator charges for a logged pass before contention: its profiled time (``activity``'s
    measured time over its ratio) times the step scales of its role and kind."""
    profiled = activity.seconds / activity.ratio
    if row["kind"] == "prefill":
        return profiled * cal.prefill_busy_scale
    if row["kind"] == "mixed":
        return mixed_pass_seconds(profile.prefill_model(1), profile.target_model(1), row, int(row["decode_seqs"]),
                                  int(row["decode_kv_tokens"]), cal.prefill_busy_scale, cal.decode_scale)
    return profiled * kind_scale(cal, row["kind"]) * cal.decode_scale


def measured_by_role(rows: list[dict]) -> dict[str, float]:
    """Seconds each role spent: prefill and mixed passes; the decode role's whole steps (``step`` records),
    or its passes where it logged no steps."""
    out: dict[str, float] = {}
    stepped = any(r["kind"] == "step" for r in rows)
    for r in rows:
        role = ROLE_OF_KIND[r["kind"]]
        if role == "decode" and (r["kind"] == "step") != stepped:
            continue
        out[role] = out.get(role, 0.0) + r["seconds"]
    return out


def load_speed(profile: Profile, mode: str, rows: list[dict], drafter: str | None = None) -> LoadSpeed:
    """The speed factors of ``rows`` (``interference.pass_row`` rows with ``worker`` indices: every worker's
    passes over one window, e.g. one rate of an SLO sweep) against ``profile``'s calibration of ``mode``.
    ``drafter``: the decode pool's drafter, when the rows hold draft passes."""
    cal = profile.calibration(mode)
    acts = activities(profile, rows, drafter)
    if not acts:
        raise ValueError("load speed: no timed passes to read")
    timed = [r for _, mine in timed_rows(rows) for r in mine]  # the order activities() lists them in
    priced = [(a, simulated_price(profile, cal, r, a)) for a, r in zip(acts, timed)]
    measured = measured_by_role(rows)

    def modelled(speed: float) -> dict[str, float]:
        out: dict[str, float] = {}
        for a, price in priced:
            role = ROLE_OF_KIND[a.kind]
            out[role] = out.get(role, 0.0) + price * _contention(cal, a, speed)
        return out

    speed = 1.0
    for _ in range(FIXED_POINT_ITERATIONS):
        new = sum(measured.values()) / sum(modelled(speed).values())
        done = abs(new - speed) <= FIXED_POINT_TOLERANCE * new
        speed = new
        if done:
            break
    per_role = modelled(speed)
    return LoadSpeed(speed, {role: measured[role] / per_role[role] for role in sorted(per_role)}, len(priced),
                     {role: measured[role] for role in sorted(per_role)})
