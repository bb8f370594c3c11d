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

The speed also drifts *within* a rate: on the CPU VM the prefill passes of one 150-second rate ran 2-10 %
slower than the rate's mean for its first 80 s and up to 13 % faster after
(``benchmarks/results/same_session_17/drift_within_rate.txt``), and a queue built in the slow stretch drains
in the fast one. ``speed_timeline`` reads the same factors window by
window (``SpeedTimeline``, applied per step by the simulator on top of ``LoadSpeed.apply``'s profile).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from controller.planner.interference import (ROLE_OF_KIND, PassActivity, activities, contention_variable,
                                             output_variable, timed_rows)
from controller.planner.profile import (Calibration, CoreSharing, Profile, calibration_threads, instance_tps,
                                        mixed_pass_seconds)
from controller.planner.simulator import SimConfig

FIXED_POINT_ITERATIONS = 50
FIXED_POINT_TOLERANCE = 1e-12
MIN_WINDOW_PASSES = 10  # a role's steps a window needs for a factor of its own (else the rate's)
ONE_PER_STEP_KINDS = ("prefill", "mixed", "decode", "verify")  # pass kinds that count a role's steps


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


def arrangement(profile: Profile, config: SimConfig) -> tuple[dict[str, int], CoreSharing | None]:
    """Each role's instance shape (``tps``) and the core sharing of ``config``, as ``load_speed`` takes them."""
    if config.mode == "colocated":
        return {"colocated": config.colocated.tensor_parallel}, None
    if config.shared_cores and config.prefill.threads_when_decode_busy:
        raise ValueError("load speed: a prefill instance whose threads follow decode's busy flag logs passes on two "
                         "thread counts the pass log does not tell apart; simulate it with --speed none")
    tps = {"prefill": config.prefill.tensor_parallel, "decode": config.decode.tensor_parallel}
    return tps, (profile.sharing(tps["prefill"], tps["decode"]) if config.shared_cores else None)


def kind_scale(cal: Calibration, kind: str) -> float:
    """The calibrated in-place speed of a decode-role pass kind relative to a plain decode pass."""
    return {"verify": cal.verify_pass_scale, "draft": cal.draft_pass_scale}.get(kind, 1.0)


def _contention(cal: Calibration, a: PassActivity, speed: float, sharing: CoreSharing | None = None) -> float:
    if sharing is not None and sharing.measured_in_place:
        factor = 1.0  # the sharing holds the contention (as the simulator charges it)
    else:
        factor = (1.0 + (cal.contention_scale - 1.0) * a.other_busy_share
                  + speed * (cal.contention_step_s * contention_variable(a) + cal.contention_output_s * output_variable(a)))
    if sharing is not None:  # the simulator's processor sharing: ``f`` x slower for the work done while the
        # other role is busy; a pass of wall-clock share s contended took 1 / (1 - s + s / f) x its alone time
        s, f = a.other_busy_share, sharing.factor(ROLE_OF_KIND[a.kind])
        factor /= 1.0 - s + s / f
        if ROLE_OF_KIND[a.kind] == "prefill":
            factor *= sharing.prefill_scale
    return factor


def simulated_price(profile: Profile, cal: Calibration, row: dict, activity: PassActivity,
                    tps: dict[str, int] | None = None) -> float:
    """What the simulator charges for a logged pass before contention: its profiled time (``activity``'s
    measured time over its ratio) times the step scales of its role and kind."""
    profiled = activity.seconds / activity.ratio
    if row["kind"] == "prefill":
        return profiled * cal.prefill_busy_scale
    if row["kind"] == "mixed":
        tp = (tps or {}).get("colocated", 1)
        return mixed_pass_seconds(profile.prefill_model(tp), profile.target_model(tp), row, int(row["decode_seqs"]),
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


def load_speed(profile: Profile, mode: str, rows: list[dict], drafter: str | None = None,
               tps: dict[str, int] | None = None, sharing: CoreSharing | None = None) -> LoadSpeed:
    """The speed factors of ``rows`` (``interference.pass_row`` rows with ``worker`` indices: every worker's
    passes over one window, e.g. one rate of an SLO sweep) against ``profile``'s calibration of ``mode``.
    ``drafter``: the decode pool's drafter, when the rows hold draft passes; ``tps``: each role's instance
    shape (CPU: threads; default 1); ``sharing``: the two roles shared the cores (``SimConfig.shared_cores``)."""
    cal = profile.calibration(mode, calibration_threads(tps or instance_tps(mode, 1)))
    acts = activities(profile, rows, drafter, tps)
    if not acts:
        raise ValueError("load speed: no timed passes to read")
    timed = [r for _, mine in timed_rows(rows) for r in mine]  # the order activities() lists them in
    priced = [(a, simulated_price(profile, cal, r, a, tps)) for a, r in zip(acts, timed)]
    measured = measured_by_role(rows)

    def modelled(speed: float) -> dict[str, float]:
        out: dict[str, float] = {}
        for a, price in priced:
            role = ROLE_OF_KIND[a.kind]
            out[role] = out.get(role, 0.0) + price * _contention(cal, a, speed, sharing)
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


@dataclass(frozen=True)
class SpeedTimeline:
    """The machine's speed window by window through one rate, relative to the rate's own ``LoadSpeed``:
    ``factors[i]`` (role -> factor; 1.15 = 15 % slower than the rate's mean for that role) holds from
    simulated time ``starts_s[i]`` to the next start (the first from the beginning, the last to the end).
    A role missing from a window runs at the rate's factor (1.0)."""

    window_s: float
    starts_s: tuple[float, ...]
    factors: tuple[dict[str, float], ...]

    def __post_init__(self):
        if len(self.starts_s) != len(self.factors) or not self.starts_s:
            raise ValueError("speed timeline: one factor set per window start, at least one window")
        if any(b <= a for a, b in zip(self.starts_s, self.starts_s[1:])):
            raise ValueError("speed timeline: window starts must increase")
        for f in self.factors:
            for role, v in f.items():
                if not (v > 0 and v < float("inf")):
                    raise ValueError(f"speed timeline: factor of {role!r} must be positive and finite, got {v!r}")

    def factor(self, role: str, t: float) -> float:
        """The factor on a step of ``role`` starting at simulated time ``t``."""
        i = max(0, bisect.bisect_right(self.starts_s, t) - 1)
        return self.factors[i].get(role, 1.0)


def speed_timeline(profile: Profile, mode: str, rows: list[dict], window_s: float, origin_s: float,
                   drafter: str | None = None, rate: LoadSpeed | None = None, tps: dict[str, int] | None = None,
                   sharing: CoreSharing | None = None) -> SpeedTimeline:
    """``load_speed`` of ``rows`` (one rate's passes) window by window: windows of ``window_s`` seconds of the
    passes' wall clock from the first pass's start, each role's factor over its factor for the whole rate
    (``rate``, computed when not given) where the window holds at least ``MIN_WINDOW_PASSES`` of that role's
    steps. ``origin_s``: the simulated time of the first pass's start (the first request's arrival in the
    trace replayed; the wall clock of the passes and the trace's clock differ by a constant)."""
    if not (window_s > 0 and window_s < float("inf")):
        raise ValueError(f"speed window: expected a positive number of seconds, got {window_s!r}")
    rate = rate or load_speed(profile, mode, rows, drafter, tps, sharing)
    timed = [r for _, mine in timed_rows(rows) for r in mine]
    if not timed:
        raise ValueError("speed timeline: no timed passes to read")
    t0 = min(r["end_s"] - r["seconds"] for r in rows)
    last = max(r["end_s"] for r in rows)
    windows = max(1, int((last - t0) // window_s) + 1)
    by_window: list[list[dict]] = [[] for _ in range(windows)]
    for r in rows:  # step records too: they are the decode role's measured time
        by_window[min(windows - 1, int((r["end_s"] - r["seconds"] - t0) // window_s))].append(r)
    factors = []
    for window in by_window:
        counts: dict[str, int] = {}
        for r in window:
            if r["kind"] in ONE_PER_STEP_KINDS:
                counts[ROLE_OF_KIND[r["kind"]]] = counts.get(ROLE_OF_KIND[r["kind"]], 0) + 1
        here: dict[str, float] = {}
        if any(n >= MIN_WINDOW_PASSES for n in counts.values()):
            est = load_speed(profile, mode, window, drafter, tps, sharing)
            here = {role: est.by_role[role] / rate.by_role[role] for role, n in counts.items()
                    if n >= MIN_WINDOW_PASSES and role in est.by_role and role in rate.by_role}
        factors.append(here)
    return SpeedTimeline(window_s, tuple(origin_s + i * window_s for i in range(windows)), tuple(factors))
