"""Interference between the workers of a cluster sharing one machine, measured from their own pass logs.

Every prefill and decode worker times its passes where they run (``modeling/pass_log.py``): kind, shape,
duration and wall-clock end, so the passes of different processes line up on one time axis. Under a
burst of overlapping requests a pass runs slower than the profile says, and the slowdown follows what
the other role does meanwhile. Measured on the CPU cluster (``benchmarks/serving_interference.py``),
a prefill pass's slowdown follows the decode role's *step rate* (each step's outputs are polled,
streamed and received by processes on the same cores), not its busy share: speculative decode steps,
fewer and longer, slow the prefill worker less than plain ones at the same busy share.

This module turns a burst's pass log into the simulator's contention term (``Calibration.contention_step_s``,
applied in ``sim_instances._Instance._contention``): every busy instance loses ``contention_step_s`` per
step completed by itself or by the other busy instances while no core is idle.

Pass rows are flat dicts (``pass_row``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from controller.planner.profile import Profile, prefill_features
from decode_worker.policy import PassShape

ROLE_OF_KIND = {"prefill": "prefill", "decode": "decode", "draft": "decode", "verify": "decode", "step": "decode"}
PASS_KINDS = ("prefill", "decode", "draft", "verify")  # timed passes ("step" records wrap a decode step's passes)
STEP_END_KINDS = ("prefill", "step")  # what ends a worker step (its outputs go out)
IDLE_SHARE = 0.1  # a pass the other role covers less than this runs "alone": its kind's reference ratio
MIN_REFERENCE = 5  # passes a kind needs below IDLE_SHARE for a reference of its own
MAX_STEP_S = 0.02  # the fit's range of contention_step_s (seconds per step)
DECODE_FIELDS = ("seqs", "kv_tokens", "new_tokens", "k")  # k: step records only


def pass_row(record: dict) -> dict:
    """A pass-log record (``PassRecord`` as a dict) as a flat row: ``kind``, ``seconds``, ``end_s`` and its
    shape: a prefill pass its ``prefill_features``, decode-role records ``passes`` and ``DECODE_FIELDS``."""
    shape = record["shape"]
    if record["kind"] == "prefill":
        fields = prefill_features([tuple(c) for c in shape["chunks"]])
    else:
        fields = {"passes": shape.get("passes", 1), **{f: shape.get(f, 0) for f in DECODE_FIELDS}}
    return {"kind": record["kind"], "seconds": record["seconds"], "end_s": record["end_s"], **fields}


def predicted_s(profile: Profile, row: dict, drafter: str | None = None) -> float:
    """The profile's time for a logged pass (one device per instance, as on the CPU cluster)."""
    if row["kind"] == "prefill":
        return profile.prefill_model(1).predict(row)
    shape = PassShape(int(row["seqs"]), int(row["kv_tokens"]), int(row["new_tokens"]), int(row.get("passes", 1)))
    if row["kind"] == "draft":
        if drafter is None:
            raise ValueError("draft passes need the drafter's name")
        return profile.draft_model(drafter, 1).predict_pass(shape)
    return profile.target_model(1).predict_pass(shape)


def intervals(rows: list[dict]) -> list[tuple[float, float]]:
    return sorted((r["end_s"] - r["seconds"], r["end_s"]) for r in rows)


def covered(start: float, end: float, spans: list[tuple[float, float]]) -> float:
    """Share of [start, end] covered by ``spans``, summed and capped at 1: exact for the passes of one
    worker (disjoint); with several workers of the other role, overlapping passes count twice."""
    if end <= start:
        return 0.0
    total = sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans if b > start and a < end)
    return min(1.0, total / (end - start))


@dataclass(frozen=True)
class PassActivity:
    """One pass of a burst against what the other role did meanwhile."""

    kind: str
    seconds: float
    ratio: float  # measured / profiled time
    other_busy_share: float  # share of the pass the other role spent in passes
    other_step_rate: float  # the other role's steps completed per second during the pass


def activities(profile: Profile, rows: list[dict], drafter: str | None = None) -> list[PassActivity]:
    """Every timed pass of ``rows`` with the other role's activity during it."""
    out = []
    for role in ("prefill", "decode"):
        others = [r for r in rows if ROLE_OF_KIND[r["kind"]] != role]
        spans = intervals([r for r in others if r["kind"] in PASS_KINDS])
        ends = sorted(r["end_s"] for r in others if r["kind"] in STEP_END_KINDS)
        for r in rows:
            if r["kind"] not in PASS_KINDS or ROLE_OF_KIND[r["kind"]] != role:
                continue
            start, end = r["end_s"] - r["seconds"], r["end_s"]
            steps = sum(start < t <= end for t in ends)
            out.append(PassActivity(r["kind"], r["seconds"], r["seconds"] / predicted_s(profile, r, drafter),
                                    covered(start, end, spans), steps / max(end - start, 1e-9)))
    return out


def reference_ratios(acts: list[PassActivity]) -> dict[str, float]:
    """Per kind, the median ratio of its passes that ran (nearly) alone; kinds with fewer than
    MIN_REFERENCE such passes take the least-covered quarter of their passes instead."""
    refs = {}
    for kind in {a.kind for a in acts}:
        mine = sorted((a for a in acts if a.kind == kind), key=lambda a: a.other_busy_share)
        alone = [a.ratio for a in mine if a.other_busy_share < IDLE_SHARE]
        if len(alone) < MIN_REFERENCE:
            alone = [a.ratio for a in mine[: max(1, len(mine) // 4)]]
        refs[kind] = statistics.median(alone)
    return refs


def contention_variable(a: PassActivity) -> float:
    """Steps per second that cost this pass time under the simulator's model: the other role's, and its
    own (one per pass) while the other role is busy."""
    return a.other_step_rate + a.other_busy_share / max(a.seconds, 1e-6)


@dataclass(frozen=True)
class ContentionFit:
    """The simulator's two contention terms fitted to a burst's passes (``fit_contention_terms``)."""

    busy_scale: float  # Calibration.contention_scale: 1 + slowdown while the other role is busy throughout
    step_s: float  # Calibration.contention_step_s: seconds per step completed while no core is idle
    rms: float  # time-weighted RMS of (slowdown - fitted slowdown) over the passes
    passes: int


def fit_contention_terms(acts: list[PassActivity]) -> ContentionFit:
    """Weighted least squares (through the origin, weights = pass durations) of each pass's slowdown over
    its kind's reference ratio, ``ratio / reference - 1``, on the simulator's two contention variables:
    the share of the pass the other role was busy (``contention_scale`` - 1 per unit), and the steps that
    cost it time (``contention_variable``; ``contention_step_s`` per step). Both coefficients are kept
    non-negative (a negative one is dropped and the other refitted alone). Slowdowns are clipped to
    [-0.5, 2] so that a few passes stalled by something else (a garbage collection, the OS) do not steer it.

    Which variable carries the slowdown is an empirical question the burst answers: in two pairs of runs
    on the CPU cluster (``benchmarks/serving_interference.py`` with and without ``--speculation``), one
    pair followed the decode role's step rate, the other its busy share as well."""
    refs = reference_ratios(acts)
    share = [a.other_busy_share for a in acts]
    steps = [contention_variable(a) for a in acts]
    ys = [min(2.0, max(-0.5, a.ratio / refs[a.kind] - 1.0)) for a in acts]
    ws = [a.seconds for a in acts]  # by time: a slowdown matters for as long as the pass it stretches
    coef = _nonnegative_fit([share, steps], ys, ws)
    coef[1] = min(coef[1], MAX_STEP_S)
    total = sum(ws)
    fitted = [coef[0] * a + coef[1] * b for a, b in zip(share, steps)]
    rms = (sum(w * (y - f) ** 2 for w, y, f in zip(ws, ys, fitted)) / total) ** 0.5 if total > 0 else 0.0
    return ContentionFit(1.0 + coef[0], coef[1], rms, len(acts))


def _nonnegative_fit(columns: list[list[float]], ys: list[float], ws: list[float]) -> list[float]:
    """Weighted least squares through the origin with non-negative coefficients, for one or two columns."""
    def solve(idx: list[int]) -> list[float]:
        a = [[sum(w * columns[i][n] * columns[j][n] for n, w in enumerate(ws)) for j in idx] for i in idx]
        b = [sum(w * columns[i][n] * y for n, (w, y) in enumerate(zip(ws, ys))) for i in idx]
        if len(idx) == 1:
            return [b[0] / a[0][0] if a[0][0] > 0 else 0.0]
        det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
        if abs(det) < 1e-18:
            return [float("nan"), float("nan")]
        return [(b[0] * a[1][1] - b[1] * a[0][1]) / det, (a[0][0] * b[1] - a[1][0] * b[0]) / det]

    both = solve([0, 1])
    if all(c >= 0 for c in both):
        return both
    best, best_sse = [0.0, 0.0], sum(w * y * y for w, y in zip(ws, ys))
    for i in (0, 1):
        c = max(0.0, solve([i])[0])
        sse = sum(w * (y - c * columns[i][n]) ** 2 for n, (w, y) in enumerate(zip(ws, ys)))
        if sse < best_sse:
            best, best_sse = [c if j == i else 0.0 for j in (0, 1)], sse
    return best
