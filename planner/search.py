"""Placement search (``magicserve plan``): the parallelism, instance counts and decode speculation settings
that maximise per-device goodput under TTFT/TPOT SLOs, by simulation.

DistServe's algorithm, extended with speculation:

1. Screen each prefill shape (tensor_parallel, and threads per rank on a CPU) alone: the highest rate one
   instance sustains with TTFT attainment >= target (decode made non-binding).
2. Screen each decode shape x speculation setting alone: the highest rate one instance sustains with
   attainment >= target on both SLOs (prefill made non-binding: many instances of the fastest prefill
   shape; decode admission control turns an overloaded decode instance into queueing before prefill,
   i.e. TTFT).
3. Replicate: for every (prefill shape, count, decode shape + speculation, count) that fits the devices,
   the estimated goodput is min(n_p * r_p, n_d * r_d); keep the best estimates per device.
4. Verify the best ``verify_top`` estimates (and the colocated baselines) with full-cluster simulations
   on both SLOs together; the winner is the best *verified* per-device goodput.

Goodput of a configuration = the highest Poisson rate at which >= ``target`` of the requests meet the
SLO, found by doubling then bisection over simulations of the same request lengths at different rates; each
simulation stops as soon as its settled requests decide whether the rate passes (``AttainmentWatch``).
Profile data missing for a candidate is an error (``ProfileError``), never a silently dropped candidate.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace

from tqdm import tqdm

from controller.kv_index import PrefixRouting
from planner.profile import Profile, describe_shape
from planner.reuse_workload import ReuseRequest, prompt_lengths, reuse_trace
from planner.simulator import PoolPlan, SimConfig, simulate
from planner.slo import AttainmentWatch, attainment
from planner.workload import RequestSpec, WorkloadShape, make_trace, scale_trace
from decode_worker.config import SpeculationConfig

NO_SPECULATION = SpeculationConfig(drafter="none")


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class SLOTarget:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise PlanError(f"slo: ttft and tpot must be > 0, got {self.ttft_s}, {self.tpot_s}")
        if not 0 < self.attainment <= 1:
            raise PlanError(f"slo.attainment: must be in (0, 1], got {self.attainment}")


@dataclass(frozen=True)
class Workload:
    """A shape (lengths drawn per seed) or a fixed trace (replayed at each rate), and the arrival cv."""

    shape: WorkloadShape | None = None
    trace: tuple[RequestSpec, ...] = ()
    num_requests: int = 200
    cv: float = 1.0
    seed: int = 0
    # A fixed number of requests at a high rate is one burst that a large cluster clears within the SLO
    # whatever the rate: arrivals must span at least this long to measure a sustained rate.
    min_duration_s: float = 30.0
    max_requests: int = 20000  # bound on simulation cost
    # a workload with reuse (``planner/reuse_workload.REUSE_WORKLOADS``) instead of a shape: simulated with
    # prefix caching, conversations' later turns sent as the earlier ones end
    reuse: str = ""

    def at_rate(self, rate: float) -> list[RequestSpec] | list[ReuseRequest]:
        if self.trace:
            return scale_trace(list(self.trace), rate)
        if self.reuse:
            return reuse_trace(self.reuse, rate, self.num_requests, self.seed, self.min_duration_s)
        n = min(self.max_requests, max(self.num_requests, math.ceil(rate * self.min_duration_s)))
        return make_trace(self.shape, rate, n, self.seed, self.cv)

    def prompt_lengths(self, rate: float = 1.0) -> list[int]:
        trace = self.at_rate(rate)
        return prompt_lengths(trace) if self.reuse else [r.prompt_tokens for r in trace]

    def describe(self) -> str:
        if self.trace:
            return f"trace of {len(self.trace)} requests"
        if self.reuse:
            return (f"{self.reuse} (at least {self.num_requests} requests and {self.min_duration_s:g} s of arrivals, "
                    f"seed {self.seed}; prefix caching on)")
        return (f"{self.shape.name} (at least {self.num_requests} requests and {self.min_duration_s:g} s of arrivals, "
                f"arrival cv {self.cv}, seed {self.seed})")


@dataclass(frozen=True)
class SearchSpace:
    """What the planner may choose. Devices are GPUs, or cores on a CPU profile. Instance shapes are
    (tensor_parallel, threads per rank): ``shapes`` when given (a CPU profile's measured shapes, e.g. one
    2-thread process and two 1-thread ranks), else every tensor_parallel degree at 1 thread."""

    devices: int
    tensor_parallel: tuple[int, ...] = (1, 2, 4, 8)
    shapes: tuple[tuple[int, int], ...] = ()
    speculation: tuple[SpeculationConfig, ...] = (NO_SPECULATION,)
    include_colocated: bool = True
    prefill_token_budget: int = 512
    prefill_max_prompts: int = 16
    decode_max_num_seqs: int = 64
    max_concurrent: int = 256
    block_size: int = 16


@dataclass
class Candidate:
    """One configuration the planner compared."""

    config: SimConfig
    estimate: float = math.nan  # req/s from the per-phase screening (disaggregated only)
    goodput: float = math.nan  # req/s verified by full simulation (nan: not verified)
    note: str = ""

    @property
    def devices(self) -> int:
        return self.config.devices

    @property
    def per_device(self) -> float:
        return self.goodput / self.devices if not math.isnan(self.goodput) else math.nan

    def describe(self) -> str:
        c = self.config
        if c.mode == "colocated":
            p = c.colocated
            return f"colocated {p.instances} x ({describe_shape(*p.shape)})"
        p, d = c.prefill, c.decode
        return (f"P {p.instances} x ({describe_shape(*p.shape)}) + "
                f"D {d.instances} x ({describe_shape(*d.shape)}), {describe_spec(c.speculation)}")


def describe_spec(spec: SpeculationConfig) -> str:
    if not spec.enabled:
        return "no speculation"
    k = f"adaptive k<={spec.max_k}" if spec.k_policy == "adaptive" else f"k={spec.k}"
    return f"{spec.drafter} budget {spec.budget} {k}"


@dataclass
class PlanResult:
    best: Candidate
    candidates: list[Candidate]
    screening: dict = field(default_factory=dict)  # phase -> {shape description: req/s}


class Planner:
    """Searches ``space`` for ``workload`` under ``slo`` on ``profile``'s hardware."""

    def __init__(self, profile: Profile, slo: SLOTarget, workload: Workload, space: SearchSpace,
                 verify_top: int = 4, bisect_steps: int = 7, time_limit_s: float = 600.0, progress: bool = True):
        self.profile, self.slo, self.workload, self.space = profile, slo, workload, space
        self.verify_top = verify_top
        self.bisect_steps = bisect_steps
        self.time_limit_s = time_limit_s
        self.progress = progress
        self._max_prompt = max(workload.prompt_lengths())
        # workloads with reuse are planned for the cluster as it serves them: prefix caching on
        self._caching = PrefixRouting() if workload.reuse else None

    # -- goodput by simulation -------------------------------------------------------------------------

    def goodput(self, config: SimConfig, metric: str = "both") -> float:
        """Highest rate (req/s) with ``metric`` attainment >= the target; 0 if even a trickle misses."""

        def ok(rate: float) -> bool:
            trace = self.workload.at_rate(rate)
            if self.workload.reuse:  # later turns arrive as earlier ones end: no watch, the whole trace runs
                res = simulate(self.profile, config, trace, seed=self.workload.seed, time_limit_s=self.time_limit_s)
                a = attainment(res.outcomes(), self.slo.ttft_s, self.slo.tpot_s)
                return getattr(a, metric) >= self.slo.attainment
            # the run stops once the requests settled so far decide the verdict: an overloaded probe, the
            # costliest to simulate, ends at its first misses beyond the target's allowance
            watch = AttainmentWatch(len(trace), self.slo.ttft_s, self.slo.tpot_s, self.slo.attainment, metric)
            return simulate(self.profile, config, trace, seed=self.workload.seed, time_limit_s=self.time_limit_s,
                            watch=watch).verdict

        lo, hi = 0.0, 0.05
        while ok(hi):  # double until it fails
            lo, hi = hi, hi * 2
            if hi > 1e5:
                return lo
        if lo == 0.0:  # the first probe failed: look lower before giving up
            probe = hi
            for _ in range(6):
                probe /= 4
                if ok(probe):
                    lo, hi = probe, probe * 4
                    break
            else:
                return 0.0
        for _ in range(self.bisect_steps):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo

    # -- shapes -----------------------------------------------------------------------------------------

    def _shapes(self) -> list[tuple[int, int]]:
        """(tp, threads) shapes of the space that fit on the devices and hold the longest prompt; a shape the
        profile lacks is an error."""
        space = self.space.shapes or [(tp, 1) for tp in self.space.tensor_parallel]
        shapes = []
        for shape in space:
            if math.prod(shape) > self.space.devices:
                continue
            costs = self.profile.costs(*shape)  # raises ProfileError naming the shape
            if costs.kv_capacity_tokens < self._max_prompt + 1:
                continue  # the weights leave too little memory for one prompt's KV
            shapes.append(tuple(shape))
        if not shapes:
            raise PlanError(f"no instance shape of {', '.join(describe_shape(*s) for s in space)} fits "
                            f"{self.space.devices} devices with room for a {self._max_prompt}-token prompt")
        return shapes

    def _pool(self, instances: int, shape: tuple[int, int], budget: int, seqs: int) -> PoolPlan:
        tp, threads = shape
        return PoolPlan(instances, tp, self.profile.costs(*shape).kv_capacity_tokens, budget, seqs, threads)

    def _disaggregated(self, pshape, np_, dshape, nd, spec) -> SimConfig:
        s = self.space
        return SimConfig("disaggregated", prefill=self._pool(np_, pshape, s.prefill_token_budget, s.prefill_max_prompts),
                         decode=self._pool(nd, dshape, 1, s.decode_max_num_seqs),
                         speculation=spec, block_size=s.block_size, max_concurrent=s.max_concurrent,
                         prefix_caching=self._caching)

    # -- the search ---------------------------------------------------------------------------------------

    def run(self) -> PlanResult:
        shapes = self._shapes()
        for spec in self.space.speculation:  # missing acceptance / draft costs: fail before any work
            if spec.enabled:
                self.profile.acceptance_rate(spec.drafter, spec.budget, 0)
                for shape in shapes:
                    self.profile.draft_model(spec.drafter, *shape)
        bar = tqdm(total=len(shapes) * (1 + len(self.space.speculation)), desc="plan: screening",
                   disable=not self.progress, dynamic_ncols=True)
        prefill_rate, decode_rate = {}, {}
        big = max(1, self.space.devices) * 4  # "non-binding" pools for screening
        for shape in shapes:
            cfg = self._disaggregated(shape, 1, shape, big, NO_SPECULATION)
            prefill_rate[shape] = self.goodput(cfg, "ttft_only")
            bar.update()
        # the decode screening's non-binding prefill pool: the shape that screened fastest (the cheapest among
        # equals), so that TTFT misses come from decode admission, not from a prefill shape too slow for the
        # longest prompts even alone
        fastest = max(shapes, key=lambda s: (prefill_rate[s], -math.prod(s)))
        for shape in shapes:
            for spec in self.space.speculation:
                cfg = self._disaggregated(fastest, big, shape, 1, spec)
                # both SLOs: an overloaded decode instance shows up in TTFT too (requests wait for its KV
                # slots before prefill starts), not only in TPOT
                decode_rate[(shape, spec)] = self.goodput(cfg, "both")
                bar.update()
        bar.close()

        candidates = self._replicate(prefill_rate, decode_rate)
        candidates.sort(key=lambda c: c.estimate / c.devices, reverse=True)
        to_verify = candidates[: self.verify_top]
        if self.space.include_colocated:
            colocated = [Candidate(SimConfig("colocated", colocated=self._pool(self.space.devices // math.prod(shape),
                                                                                  shape, self.space.prefill_token_budget,
                                                                                  self.space.decode_max_num_seqs),
                                             block_size=self.space.block_size, max_concurrent=self.space.max_concurrent,
                                             prefix_caching=self._caching),
                                   note="colocated baseline")
                         for shape in shapes]
            candidates += colocated
            to_verify = to_verify + colocated
        for cand in tqdm(to_verify, desc="plan: verifying", disable=not self.progress, dynamic_ncols=True):
            cand.goodput = self.goodput(cand.config, "both")
        verified = [c for c in to_verify if not math.isnan(c.goodput)]
        best = max(verified, key=lambda c: (c.per_device, -c.devices))
        if best.goodput <= 0:
            raise PlanError("no configuration meets the SLOs even at a trickle of requests: "
                            f"TTFT {self.slo.ttft_s * 1e3:.0f} ms / TPOT {self.slo.tpot_s * 1e3:.0f} ms at "
                            f"{self.slo.attainment:.0%} may be below what this hardware can do for this workload")
        screening = {"prefill": {describe_shape(*shape): r for shape, r in prefill_rate.items()},
                     "decode": {f"{describe_shape(*shape)}, {describe_spec(s)}": r
                                for (shape, s), r in decode_rate.items()}}
        return PlanResult(best, candidates, screening)

    def _replicate(self, prefill_rate: dict, decode_rate: dict) -> list[Candidate]:
        """Every instance-count combination that fits, with its per-phase estimate; for each device
        count and phase shapes only the best speculation setting is kept."""
        n = self.space.devices
        out: dict[tuple, Candidate] = {}
        best_rd: dict[tuple, float] = {}
        for pshape, rp in prefill_rate.items():
            pdev = math.prod(pshape)
            for (dshape, spec), rd in decode_rate.items():
                ddev = math.prod(dshape)
                for np_ in range(1, n // pdev + 1):
                    for nd in range(1, (n - np_ * pdev) // ddev + 1):
                        est = min(np_ * rp, nd * rd)
                        key = (pshape, np_, dshape, nd)
                        # ties (prefill-bound estimates) go to the faster decode setting: lower TPOT
                        if key not in out or (est, rd) > (out[key].estimate, best_rd[key]):
                            out[key] = Candidate(self._disaggregated(pshape, np_, dshape, nd, spec), estimate=est)
                            best_rd[key] = rd
        return list(out.values())


def speculation_space(profile: Profile, max_ks: tuple[int, ...] = (4,), fixed_ks: tuple[int, ...] = (1, 2, 3),
                      sink_tokens: int = 16) -> tuple[SpeculationConfig, ...]:
    """No speculation, plus every measured (drafter, budget) of the profile with adaptive k and fixed k."""
    return speculation_settings(profile.acceptance, max_ks, fixed_ks, sink_tokens)


def speculation_settings(acceptance, max_ks: tuple[int, ...] = (4,), fixed_ks: tuple[int, ...] = (1, 2, 3),
                         sink_tokens: int = 16) -> tuple[SpeculationConfig, ...]:
    """No speculation, plus every (drafter, budget) with acceptance entries, with adaptive k and fixed k."""
    out = [NO_SPECULATION]
    for drafter, budget in sorted({(e.drafter, e.budget) for e in acceptance}):
        if drafter == "draft_model":
            continue  # needs a draft checkpoint path in the config; plan it explicitly
        base = SpeculationConfig(drafter=drafter, budget=budget, sink_tokens=min(sink_tokens, budget // 2))
        out += [replace(base, k_policy="adaptive", max_k=m) for m in max_ks]
        out += [replace(base, k_policy="fixed", k=k, max_k=max(k, base.max_k)) for k in fixed_ks]
    return tuple(out)


def spec_to_dict(spec: SpeculationConfig) -> dict:
    d = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    return {k: v for k, v in d.items() if v is not None}
