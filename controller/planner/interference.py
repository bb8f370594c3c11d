"""Interference between the workers of a cluster sharing one machine, measured from their own pass logs.

Every prefill and decode worker times its passes where they run (``modeling/pass_log.py``): kind, shape,
duration and wall-clock end, so the passes of different processes line up on one time axis. Under a
burst of overlapping requests a pass runs slower than the profile says, and the slowdown depends on what
the other role does meanwhile: whether it is busy, how many steps it completes (each step's outputs are
polled, streamed and received by processes on the same cores) and how many sequence outputs those steps
carry. Which of these carries the slowdown differed between runs on the CPU cluster
(``benchmarks/serving_interference.py``): one pair of bursts followed the decode role's step rate, the
recorded ones its busy share, and a burst of long outputs adds a cost per sequence output.

This module turns a burst's pass log into the simulator's three contention terms (``Calibration``'s
``contention_scale``, ``contention_step_s`` and ``contention_output_s``, applied in
``sim_instances._Instance._contention``), fitted non-negative so that the burst decides between them.

Colocated instances log one ``mixed`` record per step (prefill chunks and decode tokens in one pass), and
there the other instances are what a pass contends with: the passes are grouped by the worker that ran
them (a row's ``worker``; rows without one, stored before it was logged, by role).

Pass rows are flat dicts (``pass_row``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from controller.planner.profile import Profile, mixed_pass_seconds, prefill_features
from decode_worker.policy import PassShape

ROLE_OF_KIND = {"prefill": "prefill", "decode": "decode", "draft": "decode", "verify": "decode", "step": "decode",
                "mixed": "colocated"}
PASS_KINDS = ("prefill", "decode", "draft", "verify", "mixed")  # timed passes ("step" records wrap a decode step's)
STEP_END_KINDS = ("prefill", "step", "mixed")  # what ends a worker step (its outputs go out)
IDLE_SHARE = 0.1  # a pass the other role covers less than this runs "alone": its kind's reference ratio
MIN_REFERENCE = 5  # passes a kind needs below IDLE_SHARE for a reference of its own
MAX_STEP_S = 0.02  # the fit's range of contention_step_s (seconds per step)
DECODE_FIELDS = ("seqs", "kv_tokens", "new_tokens", "k")  # k: step records only
MIXED_DECODE_FIELDS = ("decode_seqs", "decode_kv_tokens")  # a mixed pass's decode part
NOISE_QUANTILES = 40  # quantiles kept of each role's pass-time spread about the contention fit
MIN_NOISE_PASSES = 2 * NOISE_QUANTILES  # passes a role needs for its spread to be kept
NOISE_RANGE = (0.2, 5.0)  # a pass at most 5x its fitted time (a stall) and at least a fifth of it


def pass_row(record: dict, worker: int | None = None) -> dict:
    """A pass-log record (``PassRecord`` as a dict) as a flat row: ``kind``, ``seconds``, ``end_s``, the
    ``worker`` that logged it (an index, when given) and its shape: a prefill pass its ``prefill_features``,
    decode-role records ``passes`` and ``DECODE_FIELDS``, a mixed pass the ``prefill_features`` of its
    chunks and ``MIXED_DECODE_FIELDS``."""
    shape = record["shape"]
    if record["kind"] in ("prefill", "mixed"):
        fields = prefill_features([tuple(c) for c in shape["chunks"]])
        if record["kind"] == "mixed":
            fields.update({f: shape[f] for f in MIXED_DECODE_FIELDS})
    else:
        fields = {"passes": shape.get("passes", 1), **{f: shape.get(f, 0) for f in DECODE_FIELDS}}
    row = {"kind": record["kind"], "seconds": record["seconds"], "end_s": record["end_s"], **fields}
    if worker is not None:
        row["worker"] = worker
    return row


def worker_of(row: dict):
    """Which worker ran a row's pass: its ``worker`` index, else (rows stored without one) its role."""
    return row.get("worker", ROLE_OF_KIND[row["kind"]])


def predicted_s(profile: Profile, row: dict, drafter: str | None = None, tps: dict[str, int] | None = None) -> float:
    """The profile's time for a logged pass on an instance of ``tps[role]`` devices (CPU: threads; default
    1, as on the CPU cluster)."""
    tp = (tps or {}).get(ROLE_OF_KIND[row["kind"]], 1)
    if row["kind"] == "prefill":
        return profile.prefill_model(tp).predict(row)
    if row["kind"] == "mixed":
        return mixed_pass_seconds(profile.prefill_model(tp), profile.target_model(tp), row, int(row["decode_seqs"]),
                                  int(row["decode_kv_tokens"]))
    shape = PassShape(int(row["seqs"]), int(row["kv_tokens"]), int(row["new_tokens"]), int(row.get("passes", 1)))
    if row["kind"] == "draft":
        if drafter is None:
            raise ValueError("draft passes need the drafter's name")
        return profile.draft_model(drafter, tp).predict_pass(shape)
    return profile.target_model(tp).predict_pass(shape)


def intervals(rows: list[dict]) -> list[tuple[float, float]]:
    return sorted((r["end_s"] - r["seconds"], r["end_s"]) for r in rows)


def covered(start: float, end: float, spans: list[tuple[float, float]], workers: int = 1) -> float:
    """Share of [start, end] covered by ``spans``, the passes of ``workers`` workers (each worker's passes
    are disjoint), as the mean over those workers: the simulator's share of the other instances that are
    busy. Capped at 1."""
    if end <= start:
        return 0.0
    total = sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans if b > start and a < end)
    return min(1.0, total / (end - start) / max(1, workers))


@dataclass(frozen=True)
class PassActivity:
    """One pass of a burst against what the other role did meanwhile."""

    kind: str
    seconds: float
    ratio: float  # measured / profiled time
    other_busy_share: float  # share of the other workers busy in passes during the pass (their mean)
    other_step_rate: float  # the other workers' steps completed per second during the pass
    outputs: int  # sequences this pass's step gives an output to (decode: its batch; prefill: its chunks)
    other_output_rate: float  # outputs per second of the other workers' steps completed during the pass


def activities(profile: Profile, rows: list[dict], drafter: str | None = None,
               tps: dict[str, int] | None = None) -> list[PassActivity]:
    """Every timed pass of ``rows`` (priced by ``predicted_s`` at ``tps``) with the other workers' activity
    during it (``worker_of``: the other
    role's workers for rows stored without a worker), in the order of ``rows`` grouped by worker (workers in
    order of appearance). The same as ``covered`` and a count of step ends per pass, computed from sorted
    arrays and prefix sums: a sweep's rate logs tens of thousands of passes."""
    import numpy as np

    out = []
    workers = list(dict.fromkeys(worker_of(r) for r in rows))  # in order of appearance (deterministic)
    # times relative to the first pass: prefix sums of Unix times (1.8e9 s) would lose milliseconds
    t0 = min((r["end_s"] - r["seconds"] for r in rows), default=0.0)
    for worker, mine in timed_rows(rows):
        others = [r for r in rows if worker_of(r) != worker]
        busy = _OverlapIntegral([(a - t0, b - t0) for a, b in intervals([r for r in others if r["kind"] in PASS_KINDS])])
        ends = sorted((r["end_s"] - t0, outputs_of(r)) for r in others if r["kind"] in STEP_END_KINDS)
        end_t = np.array([t for t, _ in ends], dtype=float)
        end_outputs = np.concatenate([[0.0], np.cumsum([n for _, n in ends], dtype=float)])
        end = np.array([r["end_s"] - t0 for r in mine], dtype=float)
        start = end - np.array([r["seconds"] for r in mine], dtype=float)
        lo, hi = np.searchsorted(end_t, start, side="right"), np.searchsorted(end_t, end, side="right")
        span = np.maximum(end - start, 1e-9)
        share = np.minimum(1.0, busy.between(start, end) / span / max(1, len(workers) - 1))
        share[end <= start] = 0.0
        steps, outputs = (hi - lo) / span, (end_outputs[hi] - end_outputs[lo]) / span
        for j, r in enumerate(mine):
            out.append(PassActivity(r["kind"], r["seconds"], r["seconds"] / predicted_s(profile, r, drafter, tps),
                                    float(share[j]), float(steps[j]), outputs_of(r), float(outputs[j])))
    return out


def timed_rows(rows: list[dict]) -> list[tuple[object, list[dict]]]:
    """The timed passes of ``rows`` per worker (``worker_of``), workers in order of appearance, each worker's
    in the order of ``rows``; workers without timed passes left out. ``activities`` lists its passes in
    this order."""
    by_worker: dict = {}
    for r in rows:
        by_worker.setdefault(worker_of(r), [])
        if r["kind"] in PASS_KINDS:
            by_worker[worker_of(r)].append(r)
    return [(worker, mine) for worker, mine in by_worker.items() if mine]


class _OverlapIntegral:
    """Total overlap of a set of spans (possibly overlapping each other) with query intervals:
    F(x) = sum over spans of clip(x - a, 0, b - a), so the overlap with [s, e] is F(e) - F(s)."""

    def __init__(self, spans: list[tuple[float, float]]):
        import numpy as np

        self.starts = np.sort(np.array([a for a, _ in spans], dtype=float))
        self.ends = np.sort(np.array([b for _, b in spans], dtype=float))
        self.start_sums = np.concatenate([[0.0], np.cumsum(self.starts)])
        self.end_sums = np.concatenate([[0.0], np.cumsum(self.ends)])

    def _f(self, x):
        import numpy as np

        ns, ne = np.searchsorted(self.starts, x, side="right"), np.searchsorted(self.ends, x, side="right")
        return (ns * x - self.start_sums[ns]) - (ne * x - self.end_sums[ne])

    def between(self, start, end):
        return self._f(end) - self._f(start)


def outputs_of(row: dict) -> int:
    """Sequences a step (or the step a pass belongs to) gives an output to: its batch (prefill: its
    chunks, an upper bound on the first tokens it emits; mixed: both)."""
    if row["kind"] == "mixed":
        return max(1, int(row["decode_seqs"] + row["seqs"]))
    return max(1, int(row.get("seqs", 1)))


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


def output_variable(a: PassActivity) -> float:
    """Outputs per second that cost this pass time under the simulator's model: the other role's steps',
    and its own step's while the other role is busy."""
    return a.other_output_rate + a.other_busy_share * a.outputs / max(a.seconds, 1e-6)


@dataclass(frozen=True)
class ContentionFit:
    """The simulator's contention terms fitted to a burst's passes (``fit_contention_terms``)."""

    busy_scale: float  # Calibration.contention_scale: 1 + slowdown while the other role is busy throughout
    step_s: float  # Calibration.contention_step_s: seconds per step completed while no core is idle
    output_s: float  # Calibration.contention_output_s: seconds per sequence output while no core is idle
    rms: float  # time-weighted RMS of (slowdown - fitted slowdown) over the passes
    passes: int
    # per role (ROLE_OF_KIND), the spread of the passes about the fit: NOISE_QUANTILES equal-probability
    # quantiles of measured / fitted time, scaled to mean 1 (``step_noise``); empty for fewer passes
    noise: dict[str, tuple[float, ...]] = field(default_factory=dict)


def fit_contention_terms(acts: list[PassActivity]) -> ContentionFit:
    """Weighted least squares (through the origin, weights = pass durations) of each pass's slowdown over
    its kind's reference ratio, ``ratio / reference - 1``, on the simulator's three contention variables:
    the share of the pass the other role was busy (``contention_scale`` - 1 per unit), the steps that cost
    it time (``contention_variable``; ``contention_step_s`` each) and the sequence outputs that do
    (``output_variable``; ``contention_output_s`` each). Coefficients are non-negative (the best fit over
    the subsets of variables whose own fit is). Slowdowns are clipped to [-0.5, 2] so that a few passes
    stalled by something else (a garbage collection, the OS) do not steer it.

    Which variable carries the slowdown is an empirical question the bursts answer: in pairs of runs on
    the CPU cluster (``benchmarks/serving_interference.py`` with and without ``--speculation``), one pair
    followed the decode role's step rate, the later ones its busy share."""
    import itertools

    import numpy as np

    refs = reference_ratios(acts)
    x = np.array([[a.other_busy_share, contention_variable(a), output_variable(a)] for a in acts], dtype=float)
    y = np.array([min(2.0, max(-0.5, a.ratio / refs[a.kind] - 1.0)) for a in acts], dtype=float)
    w = np.array([a.seconds for a in acts], dtype=float)  # by time: a slowdown matters as long as its pass
    if not len(acts) or w.sum() <= 0:
        return ContentionFit(1.0, 0.0, 0.0, 0.0, len(acts))
    sw = np.sqrt(w)
    best_coef, best_sse = np.zeros(3), float((w * y * y).sum())
    for size in (1, 2, 3):
        for cols in itertools.combinations(range(3), size):
            sub = x[:, cols]
            coef = np.linalg.lstsq(sub * sw[:, None], y * sw, rcond=None)[0]
            if (coef < 0).any():
                continue
            sse = float((w * (y - sub @ coef) ** 2).sum())
            if sse < best_sse - 1e-12:
                best_coef, best_sse = np.zeros(3), sse
                best_coef[list(cols)] = coef
    step_s, output_s = min(float(best_coef[1]), MAX_STEP_S), min(float(best_coef[2]), MAX_STEP_S)
    coef = np.array([best_coef[0], step_s, output_s])
    # the spread about the fit, unclipped (stalls included: they are what queues behind a slow pass)
    factors = np.array([a.ratio / refs[a.kind] for a in acts]) / np.maximum(1.0 + x @ coef, 1e-6)
    return ContentionFit(1.0 + float(best_coef[0]), step_s, output_s, (best_sse / w.sum()) ** 0.5, len(acts),
                         {role: step_noise([f for f, a in zip(factors, acts) if ROLE_OF_KIND[a.kind] == role])
                          for role in sorted({ROLE_OF_KIND[a.kind] for a in acts})})


def step_noise(factors: list[float]) -> tuple[float, ...]:
    """``NOISE_QUANTILES`` equal-probability quantiles (the midpoints of as many bins) of measured / fitted
    pass times, bounded to ``NOISE_RANGE`` and scaled to mean 1: the simulator draws one per step, so its
    steps vary about the fitted time as the measured passes did, at the same mean. Empty (no spread
    modelled) with fewer than ``MIN_NOISE_PASSES`` passes."""
    import numpy as np

    if len(factors) < MIN_NOISE_PASSES:
        return ()
    bounded = np.clip(np.asarray(factors, dtype=float), *NOISE_RANGE)
    qs = np.quantile(bounded, (np.arange(NOISE_QUANTILES) + 0.5) / NOISE_QUANTILES)  # linear interpolation
    return tuple(float(q) for q in qs / qs.mean())
