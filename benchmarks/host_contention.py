"""Host contention: an optional simulator plug-in for instances that share one small machine.

    python benchmarks/host_contention.py --config cluster_configs/local.yaml --profile PROFILE.json \
        --out runs/host_contention_local.json [--burst-workload long_doc]
    python benchmarks/sim_validate.py ... --host-contention runs/host_contention_local.json

When several instances run on one machine's cores and memory bandwidth (the CPU cluster: workers, router,
gRPC server and clients on two cores), a step runs slower while the other instances are busy. That is a
property of the host, not of the deployment a user plans on GPUs, so ``magicserve plan`` never applies it;
``benchmarks/sim_validate.py --host-contention FILE`` does, to compare the simulator with sweeps served on
such a machine. The simulator takes it through its one hook (``Simulation.step_factor``).

Measured by this script (``measure``; the profile must hold the config mode's calibration): a burst of overlapping
requests served for real (lengths drawn from a workload's shape with ``--burst-workload``, else log-uniform
prompts plus a burst of long outputs that fills the decode batch); every worker times its passes where they
run (``modeling/pass_log.py``), so the passes of different processes line up on one time axis. Each pass's
slowdown over the profile is fitted, non-negative, on three variables: the share of the pass the other
workers were busy (``scale``), the steps they and it completed meanwhile (``step_s`` each: every step's
outputs are polled, streamed and received by processes on the same cores) and the sequence outputs those
steps carried (``output_s``); the passes' spread about the fit is kept as ``step_noise``. The result is one
JSON file (``HostContention.save`` / ``load``).

The simulator applies it per step (``HostContention.step_factor``):
``1 + (scale - 1) x busy share + step_s x steps/s + output_s x outputs/s``, times one draw of the spread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import random
import statistics
import threading
import time
from dataclasses import dataclass, field

from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from planner.calibrate import ROLE_OF_KIND, predicted_s  # noqa: E402
from planner.profile import Profile, ProfileError  # noqa: E402
from planner.workload import RequestSpec  # noqa: E402



# -- the plug-in ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HostContention:
    """The contention terms of one mode at one thread count (see the module docstring)."""

    mode: str
    threads: int
    scale: float = 1.0
    step_s: float = 0.0
    output_s: float = 0.0
    requests: int = 0  # burst requests behind the fit
    fit_error: float = 0.0  # time-weighted RMS of the passes' slowdowns about the fit
    workload: str = ""  # the workload shape the burst was drawn from ("": generic lengths)
    step_noise: dict[str, tuple[float, ...]] = field(default_factory=dict)  # role -> quantiles, mean 1

    def __post_init__(self) -> None:
        from planner.workload import WORKLOADS

        for name in ("scale", "step_s", "output_s", "fit_error"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ProfileError(f"host_contention.{name}: must be a finite number >= 0, got {value!r}")
        if self.scale < 1.0:
            raise ProfileError(f"host_contention.scale: must be >= 1, got {self.scale}")
        if self.workload not in ("", *WORKLOADS):
            raise ProfileError(f"host_contention.workload: must be one of {['', *sorted(WORKLOADS)]}, "
                               f"got {self.workload!r}")

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)
            f.write("\n")

    @staticmethod
    def load(path: str) -> "HostContention":
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            noise = {str(r): tuple(float(q) for q in qs) for r, qs in raw.pop("step_noise", {}).items()}
            return HostContention(**raw, step_noise=noise)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise ProfileError(f"{path}: not a host contention file ({e})") from None

    def summary(self) -> str:
        """The terms in words, e.g. '1.30x + 2.4 ms per step' (for reports)."""
        parts = ([f"{self.scale:.2f}x"] if self.scale != 1.0 else []) + \
                ([f"{1e3 * self.step_s:.1f} ms per step"] if self.step_s else []) + \
                ([f"{1e3 * self.output_s:.2f} ms per output"] if self.output_s else [])
        return " + ".join(parts) or "none"

    def step_factor(self, inst, duration: float, instances: list, rng: random.Random) -> float:
        """The factor on a simulated step of ``inst`` (of ``duration`` alone) for what the other ``instances``
        do as it starts, times one draw of the role's spread. Instances expose ``busy``, ``step_s`` (their
        current step's duration), ``step_outputs`` and ``role``."""
        quantiles = self.step_noise.get(inst.role)
        noise = rng.choice(quantiles) if quantiles else 1.0
        busy_others = [i for i in instances if i is not inst and i.busy]
        if not busy_others:
            return noise
        factor = 1.0 + (self.scale - 1.0) * len(busy_others) / (len(instances) - 1)
        if self.step_s > 0.0:
            factor += self.step_s * (1.0 / max(duration, 1e-6) + sum(1.0 / max(i.step_s, 1e-6) for i in busy_others))
        if self.output_s > 0.0:
            factor += self.output_s * (inst.step_outputs / max(duration, 1e-6)
                                       + sum(i.step_outputs / max(i.step_s, 1e-6) for i in busy_others))
        return factor * noise


def fit(profile: Profile, mode: str, threads: int, passes: list[dict], requests: int,
        workload: str = "") -> HostContention:
    """The host contention of ``mode`` fitted to a burst's pass rows (``pass_row``; each with its ``worker``)."""
    tps = {"colocated": threads} if mode == "colocated" else {"prefill": threads, "decode": threads}
    fitted = fit_contention_terms(activities(profile, passes, tps=tps))
    return HostContention(mode, threads, fitted.busy_scale, fitted.step_s, fitted.output_s, requests, fitted.rms,
                          workload, fitted.noise)


# -- the burst -------------------------------------------------------------------------------------------

BURST_UTILISATION = 0.6  # mean busy share of the instances the burst's rate aims at (simulated)
OUTPUT_BURST_REQUESTS = 32  # the generic burst's second part: short prompts, long outputs, arriving together
OUTPUT_BURST_RATE = 16.0  # requests per second
OUTPUT_BURST_TOKENS = 129


def burst_lengths(config, requests: int, seed: int, workload: str | None) -> tuple[list[int], tuple[int, ...]]:
    """(prompt lengths, output lengths) of a burst: drawn from ``workload``'s shape, capped at the config's
    limits, or, without one, prompts log-uniform up to 4096 tokens with the calibration's short outputs."""
    from planner.calibrate import OUTPUT_TOKENS, calibration_lengths, max_calibration_prompt
    from planner.workload import workload_shape

    if workload is None:
        return calibration_lengths(max_calibration_prompt(config), requests, seed + 1), OUTPUT_TOKENS
    shape, rng = workload_shape(workload), random.Random(seed + 1)
    lengths = [shape.sample(rng) for _ in range(requests)]
    prompts = [min(p, config.limits.max_prompt_tokens) for p, _ in lengths]
    outputs = tuple(max(2, min(o, config.limits.max_tokens)) for _, o in lengths)
    return prompts, outputs


def burst_trace(profile: Profile, sim_config, lengths: list[int], output_tokens: tuple[int, ...],
                seed: int) -> list[RequestSpec]:
    """Poisson arrivals of the given prompt lengths at the lowest rate of a geometric grid whose simulated
    mean instance utilisation reaches BURST_UTILISATION; if no rate does, the rate of the highest one."""
    from planner.simulator import simulate

    rng = random.Random(seed)
    gaps = [rng.expovariate(1.0) for _ in lengths]  # unit-rate gaps, scaled per candidate rate
    outputs = [output_tokens[i % len(output_tokens)] for i in range(len(lengths))]

    def trace_at(rate: float) -> list[RequestSpec]:
        t, out = 0.0, []
        for gap, n, o in zip(gaps, lengths, outputs):
            out.append(RequestSpec(t, n, o))
            t += gap / rate
        return out

    rate, best = 0.05, (0.0, None)
    while rate < 1e3:
        trace = trace_at(rate)
        util = simulate(profile, sim_config, trace, seed=0).instance_utilisation
        mean = sum(util.values()) / max(1, len(util))
        if mean >= BURST_UTILISATION:
            return trace
        best = max(best, (mean, trace), key=lambda b: b[0])
        rate *= 1.25
    if best[1] is None or best[0] <= 0.0:
        raise RuntimeError("host contention burst: no request rate keeps the simulated instances busy")
    return best[1]


def output_burst_trace(config, requests: int, seed: int) -> list[RequestSpec]:
    """A burst that fills the decode batch: prompts of 64-512 tokens each generating ``OUTPUT_BURST_TOKENS``,
    Poisson arrivals at ``OUTPUT_BURST_RATE``: decode steps carry many sequences, so the fit can tell a cost
    per sequence output from one per step."""
    from planner.calibrate import calibration_lengths, max_calibration_prompt

    rng = random.Random(seed + 11)
    lengths = calibration_lengths(min(512, max_calibration_prompt(config)), requests, seed + 11)
    tokens = min(OUTPUT_BURST_TOKENS, config.limits.max_tokens)
    t, trace = 0.0, []
    for n in lengths:
        trace.append(RequestSpec(t, n, tokens))
        t += rng.expovariate(OUTPUT_BURST_RATE)
    return trace


def send_burst(client, trace: list[RequestSpec], prompts: list[list[int]]) -> None:
    """Send ``trace`` (one thread per request, started at its arrival); every request must succeed."""
    from planner.calibrate import timed_stream

    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def send(i: int) -> None:
        try:
            time.sleep(max(0.0, t0 + trace[i].arrival_s - time.perf_counter()))
            timed_stream(client, prompts[i], trace[i].output_tokens)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after every thread ends
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(trace))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"host contention burst: {len(errors)} of {len(trace)} requests failed: {errors[0]!r}")


def measure(config, profile: Profile, requests: int = 40, seed: int = 0, progress: bool = True,
            workload: str | None = None) -> HostContention:
    """Serve ``config`` (speculation off, as the calibration serves it) for real, send a burst of ``requests``
    overlapping requests (and, without ``workload``, the output burst) and fit the host contention to the
    workers' passes meanwhile. ``profile`` must hold the mode's calibration (the burst's rate is chosen by
    simulating it)."""
    from frontend.server import serve_with_client
    from planner.calibrate import calibration_config, config_threads, drain_passes, random_prompts
    from planner.simulator import SimConfig

    if requests < 4:
        raise ProfileError(f"--burst-requests: must be >= 4, got {requests}")
    run_config = calibration_config(config)
    lengths, outputs = burst_lengths(run_config, requests, seed, workload)
    trace = burst_trace(profile, SimConfig.from_cluster_config(run_config), lengths, outputs, seed)
    extra = output_burst_trace(run_config, OUTPUT_BURST_REQUESTS, seed) if workload is None else []
    rng = random.Random(seed + 1)
    prompts = random_prompts(run_config, [r.prompt_tokens for r in trace + extra], rng)
    with serve_with_client(run_config) as client:
        for _ in client.generate_stream(prompts[0][:64], max_tokens=4, ignore_eos=True):
            pass  # warm-up
        drain_passes(run_config)
        send_burst(client, trace, prompts[: len(trace)])
        if extra:
            send_burst(client, extra, prompts[len(trace):])
        passes = drain_passes(run_config)
    if progress:
        tqdm.write(f"host contention: {len(trace) + len(extra)} overlapping requests, {len(passes)} passes timed")
    return fit(profile, run_config.mode, config_threads(run_config), passes, len(trace) + len(extra), workload or "")


# -- pass logs -------------------------------------------------------------------------------------------

PASS_KINDS = ("prefill", "decode", "draft", "verify", "mixed")  # timed passes ("step" records wrap a decode step's)
STEP_END_KINDS = ("prefill", "step", "mixed")  # what ends a worker step (its outputs go out)
IDLE_SHARE = 0.1  # a pass the other role covers less than this runs "alone": its kind's reference ratio
MIN_REFERENCE = 5  # passes a kind needs below IDLE_SHARE for a reference of its own
MAX_STEP_S = 0.02  # the fit's range of contention_step_s (seconds per step)
NOISE_QUANTILES = 40  # quantiles kept of each role's pass-time spread about the contention fit
MIN_NOISE_PASSES = 2 * NOISE_QUANTILES  # passes a role needs for its spread to be kept
NOISE_RANGE = (0.2, 5.0)  # a pass at most 5x its fitted time (a stall) and at least a fifth of it


def worker_of(row: dict):
    """Which worker ran a row's pass: its ``worker`` index."""
    return row["worker"]


def intervals(rows: list[dict]) -> list[tuple[float, float]]:
    return sorted((r["end_s"] - r["seconds"], r["end_s"]) for r in rows)


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
    during it, in the order of ``rows`` grouped by worker (workers in
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
    """The contention terms fitted to a burst's passes (``fit_contention_terms``)."""

    busy_scale: float  # 1 + slowdown while the other role is busy throughout
    step_s: float  # seconds per step completed while no core is idle
    output_s: float  # seconds per sequence output while no core is idle
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
    the subsets of variables whose own fit is): the burst decides which variable carries the slowdown.
    Slowdowns are clipped to [-0.5, 2] so that a few passes stalled by something else (a garbage
    collection, the OS) do not steer it."""
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
    steps vary about the fitted time as the measured passes did. Empty with fewer than ``MIN_NOISE_PASSES``."""
    import numpy as np

    if len(factors) < MIN_NOISE_PASSES:
        return ()
    bounded = np.clip(np.asarray(factors, dtype=float), *NOISE_RANGE)
    qs = np.quantile(bounded, (np.arange(NOISE_QUANTILES) + 0.5) / NOISE_QUANTILES)  # linear interpolation
    return tuple(float(q) for q in qs / qs.mean())


# -- command line ----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    from controller.config import load_config
    from planner.workload import WORKLOADS

    ap = argparse.ArgumentParser(description="Measure the host contention plug-in of a config's mode on this machine "
                                             "(a burst of overlapping requests through the real cluster).")
    ap.add_argument("--config", required=True, help="cluster config YAML to serve")
    ap.add_argument("--profile", required=True, help="measured profile holding the config mode's calibration")
    ap.add_argument("--out", required=True, help="host contention JSON to write")
    ap.add_argument("--burst-requests", type=int, default=40, help="overlapping requests of the burst")
    ap.add_argument("--burst-workload", choices=sorted(WORKLOADS), default=None,
                    help="draw the burst's lengths from this workload's shape (default: generic lengths plus a burst "
                         "of long outputs)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    contention = measure(load_config(args.config), Profile.load(args.profile), args.burst_requests, args.seed,
                         workload=args.burst_workload)
    contention.save(args.out)
    print(f"host contention ({contention.mode}, {contention.threads} thread(s)): {contention.summary()} while other "
          f"instances are busy ({contention.requests}-request burst, fit RMS {contention.fit_error:.2f}); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
