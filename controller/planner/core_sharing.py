"""How much a prefill and a decode instance slow each other down when their threads outnumber the cores
(CPU only): the ``CoreSharing`` entries of a profile (``magicserve profile --add-threads``).

On the 2-core machine a 2-thread prefill instance beside a 1-thread decode instance
(``cluster_configs/local-prefill2.yaml``) prefills a lone long prompt on both cores while decode is idle;
when both are busy the OS time-slices three threads over two cores, and a torch parallel region of the
prefill waits for its slowest thread. How much slower each role then runs is a property of the machine,
so it is measured, not assumed: two plain processes (no Ray, no gRPC), each a reference engine with its
role's torch threads on the profiled model. A *victim* process repeats its role's unit of work and times
it, alone and while an *aggressor* process does the other role's work without pause:

* prefill unit: one ``PREFILL_TOKENS``-token prompt to its first token, in chunks of the config's
  ``chunk_tokens`` (the prefill worker's steps);
* decode unit: one decode step of ``DECODE_SEQS`` sequences from about ``DECODE_CONTEXT`` tokens of context
  (both capped for a model with a shorter context).

A role's factor is the median contended unit over the mean of its two alone medians (one measured before
the contended windows, one after: the machine drifts). Processes are not pinned to cores (Ray workers are
not). ``benchmarks/cpu_contention.py`` uses the same processes for its single-thread table.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import statistics
import time
from dataclasses import dataclass

from controller.planner.profile import CoreSharing, Profile

PREFILL_TOKENS = 2048
DECODE_SEQS, DECODE_CONTEXT = 16, 1024
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Worker:
    """What one timing process runs: a role's unit of work (``idle``: nothing) on ``threads`` torch threads."""

    role: str  # "prefill" | "decode" | "idle"
    threads: int = 1
    model: str = ""
    dtype: str = "bfloat16"
    chunk_tokens: int = 512

    def __post_init__(self) -> None:
        if self.role not in ROLES + ("idle",):
            raise ValueError(f"role: must be one of {list(ROLES) + ['idle']}, got {self.role!r}")
        if self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads}")


def _engine(w: Worker):
    import torch

    torch.set_num_threads(w.threads)
    from modeling.engine import EngineConfig, ReferenceEngine

    return ReferenceEngine(w.model, EngineConfig(dtype=w.dtype, kv_cache_tokens=80000, token_budget=w.chunk_tokens))


class _Prefill:
    """One unit: a fresh prompt of ``PREFILL_TOKENS`` (at most the model's length) prefilled to its first token."""

    def __init__(self, engine, rng: random.Random, vocab: int):
        self.engine, self.rng, self.vocab = engine, rng, vocab
        self.tokens = min(PREFILL_TOKENS, engine.max_model_len - 1)

    def __call__(self) -> None:
        from modeling.sampling import SamplingParams

        prompt = [self.rng.randrange(1, self.vocab) for _ in range(self.tokens)]
        self.engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))


class _Decode:
    """One unit: one decode step of a steady batch of ``DECODE_SEQS`` sequences from ``DECODE_CONTEXT`` tokens
    (at most a quarter of the model's length), prefilled before the first unit and again, inside a unit,
    whenever the batch reaches the model's length (never on the bundled model within a measurement)."""

    def __init__(self, engine, rng: random.Random, vocab: int):
        self.engine, self.rng, self.vocab = engine, rng, vocab
        self.context = min(DECODE_CONTEXT, engine.max_model_len // 4)
        self._fill()

    def _fill(self) -> None:
        from modeling.sampling import SamplingParams

        params = SamplingParams(max_tokens=self.engine.max_model_len - self.context - 1, ignore_eos=True)
        waiting = {self.engine.add_request([self.rng.randrange(1, self.vocab) for _ in range(self.context)], params)
                   for _ in range(DECODE_SEQS)}
        while waiting:  # chunked prefill until every sequence has its first token
            waiting -= {out.request_id for out in self.engine.step() if out.new_token_ids}

    def __call__(self) -> None:
        if not self.engine.has_unfinished():
            self._fill()
        self.engine.step()


def _work(w: Worker, stop, ready, results) -> None:
    """A process: build ``w``'s work, signal ready, time units until told to stop."""
    unit = None
    if w.role != "idle":
        engine = _engine(w)
        vocab = engine.loaded.config.vocab_size
        unit = (_Prefill if w.role == "prefill" else _Decode)(engine, random.Random(w.role), vocab)
        unit()  # warm-up
    ready.set()
    times = []
    while not stop.is_set():
        if unit is None:
            time.sleep(0.05)
            continue
        t0 = time.perf_counter()
        unit()
        times.append(time.perf_counter() - t0)
    results.put(times)


def time_pair(victim: Worker, aggressor: Worker, seconds: float) -> list[float]:
    """The victim's unit times (seconds) over ``seconds`` while the aggressor runs (it starts first and
    stops last). Raises RuntimeError if a process dies or the victim completes no unit."""
    ctx = mp.get_context("spawn")
    stop_a, ready_a, stop_v, ready_v = (ctx.Event() for _ in range(4))
    out_a, out_v = ctx.Queue(), ctx.Queue()
    procs = []
    try:
        for w, stop, ready, out in ((aggressor, stop_a, ready_a, out_a), (victim, stop_v, ready_v, out_v)):
            p = ctx.Process(target=_work, args=(w, stop, ready, out), daemon=True)
            p.start()
            procs.append(p)
            while not ready.wait(1.0):
                if not p.is_alive():
                    raise RuntimeError(f"core sharing: the {w.role} process ({w.threads} threads) died while loading")
        time.sleep(seconds)
        stop_v.set()
        times = out_v.get(timeout=600)
        stop_a.set()
        out_a.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if not times:
        raise RuntimeError(f"core sharing: the {victim.role} process completed no unit in {seconds:g} s")
    return times


def measure(model: str, prefill_threads: int, decode_threads: int, seconds: float = 8.0, dtype: str = "bfloat16",
            chunk_tokens: int = 512, cores: int | None = None, progress: bool = True) -> CoreSharing:
    """The core sharing of a ``prefill_threads`` prefill and a ``decode_threads`` decode instance on this
    machine (``cores``: os.cpu_count()). Six timed windows of ``seconds``: each role alone, each role
    against the other, each role alone again."""
    from tqdm import tqdm

    cores = cores or os.cpu_count() or 1
    workers = {"prefill": Worker("prefill", prefill_threads, model, dtype, chunk_tokens),
               "decode": Worker("decode", decode_threads, model, dtype, chunk_tokens)}
    other = {"prefill": "decode", "decode": "prefill"}
    idle = Worker("idle")
    plan = [(r, None) for r in ROLES] + [(r, other[r]) for r in ROLES] + [(r, None) for r in ROLES]
    alone: dict[str, list[float]] = {r: [] for r in ROLES}
    contended: dict[str, list[float]] = {}
    for role, against in tqdm(plan, desc=f"core sharing P{prefill_threads}+D{decode_threads} on {cores} cores",
                              disable=not progress, dynamic_ncols=True):
        times = time_pair(workers[role], workers[against] if against else idle, seconds)
        if against:
            contended[role] = times
        else:
            alone[role].append(statistics.median(times))
    factors = {r: statistics.median(contended[r]) / statistics.fmean(alone[r]) for r in ROLES}
    return CoreSharing(prefill_threads, decode_threads, cores, factors["prefill"], factors["decode"],
                       len(contended["prefill"]), len(contended["decode"]), statistics.fmean(alone["prefill"]),
                       statistics.fmean(alone["decode"]))


def fit_processor_sharing(ratios: list[float], overlaps: list[float]) -> tuple[float, float]:
    """(scale, factor) of passes that ran ``ratios`` times their profiled time while the other role was busy
    for the share ``overlaps`` of their wall time, under the simulator's processor sharing: a pass's work
    ``scale`` x profiled progresses at full speed while the other role is idle and ``factor`` times slower
    while it is busy, so its wall time is scale x profiled / (1 - f + f / factor). Fitted by least absolute
    log error (robust to the heavy tail of served step times): for each factor on a grid the best scale is
    the median, and the factor with the smallest error wins."""
    import torch

    r = torch.tensor(ratios, dtype=torch.float64).log()
    f = torch.tensor(overlaps, dtype=torch.float64)

    def error(factors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # log(scale) + residual = log r + log(1 - f + f / F), per factor (rows) and pass (columns)
        adjusted = r[None, :] + torch.log(1 - f[None, :] + f[None, :] / factors[:, None])
        log_scale = adjusted.median(dim=1).values
        return (adjusted - log_scale[:, None]).abs().sum(dim=1), log_scale

    coarse = torch.arange(1.0, 8.0001, 0.05, dtype=torch.float64)
    best = coarse[error(coarse)[0].argmin()]
    fine = torch.arange(max(1.0, best.item() - 0.05), best.item() + 0.05001, 0.001, dtype=torch.float64)
    err, log_scale = error(fine)
    i = int(err.argmin())
    return float(log_scale[i].exp()), float(fine[i])


def in_place(profile: Profile, rows: list[dict], prefill_threads: int, decode_threads: int, cores: int,
             drafter: str | None = None, source: str = "served") -> CoreSharing:
    """The core sharing of a served cluster, from its workers' pass logs (``interference.pass_row`` rows of
    one prefill and one decode instance, any number of rates pooled). Each role's timed passes (prefill
    passes; the decode worker's target passes), measured over profiled time at the role's threads, against
    the share of each pass's wall time the other role was busy (decode: inside a ``step`` record; prefill:
    inside a prefill pass), fitted to the simulator's processor sharing (``fit_processor_sharing``): the
    role's factor while the other is busy, and its in-place scale while the other is idle. ``prefill_scale``
    is the prefill's scale over the calibration's prefill pass scale (what the simulator already charges).
    Timing two processes (``measure``) leaves out everything else the cores run while serving (the KV
    transfer, the router, gRPC, the load generator). ``source``: "served" (an SLO sweep's logs) or "burst"
    (a calibration burst's, ``calibrate_sharing``).

    A pass that starts while the other role is busy is not slowed for all of its time: a long prefill pass
    overlaps decode steps for part of it. Fitting on the overlap (not on whether the other role was busy as
    the pass started) gives a factor that does not depend on how long the other role's busy periods were,
    which differs between a calibration burst and the workload served."""
    import bisect

    from controller.planner.interference import intervals, predicted_s

    tps = {"prefill": prefill_threads, "decode": decode_threads}
    spans = {"prefill": intervals([r for r in rows if r["kind"] == "prefill"]),
             "decode": intervals([r for r in rows if r["kind"] == "step"])}
    ends = {role: [b for _, b in sp] for role, sp in spans.items()}  # one worker per role: disjoint, sorted

    def covered(start: float, end: float, role: str) -> float:
        """Share of [start, end] that ``role`` was busy."""
        busy, sp = 0.0, spans[role]
        for a, b in sp[bisect.bisect_right(ends[role], start):]:
            if a >= end:
                break
            busy += min(b, end) - max(a, start)
        return min(1.0, busy / (end - start)) if end > start else 0.0
    ratios: dict[str, list[float]] = {r: [] for r in ROLES}
    overlaps: dict[str, list[float]] = {r: [] for r in ROLES}
    for r in rows:
        if r["kind"] not in ("prefill", "verify", "decode"):  # one timed target pass per step and role
            continue
        role = "prefill" if r["kind"] == "prefill" else "decode"
        other = "decode" if role == "prefill" else "prefill"
        ratios[role].append(r["seconds"] / predicted_s(profile, r, drafter, tps))
        overlaps[role].append(covered(r["end_s"] - r["seconds"], r["end_s"], other))
    short = [f"{role} passes {'overlapping the other role busy' if busy else 'with the other role idle'}"
             for role in ROLES for busy in (False, True)
             if not any((o >= 0.5) == busy for o in overlaps[role])]
    if short:
        raise ValueError(f"core sharing in place: no {', no '.join(short)} in the pass log")
    fitted = {role: fit_processor_sharing(ratios[role], overlaps[role]) for role in ROLES}
    scale = fitted["prefill"][0] / profile.calibration("disaggregated").prefill_busy_scale
    return CoreSharing(prefill_threads, decode_threads, cores, fitted["prefill"][1], fitted["decode"][1],
                       sum(o > 0 for o in overlaps["prefill"]), sum(o > 0 for o in overlaps["decode"]),
                       source=source, prefill_scale=scale)
