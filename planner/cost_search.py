"""Cost-aware heterogeneous planning (``magicserve plan --objective cost``): for a workload at a target rate,
the cheapest GPU types, parallelism, instance counts and decode speculation per pool that meet the SLOs.

Mélange's method on a disaggregated cluster (Splitwise: prefill and decode may run on different GPU types):

1. **Profiles**: one analytical profile per GPU type of the catalogue (``planner/analytical.py``
   from ``gpu_catalog.yaml``'s specs); shapes whose weights leave too little memory are left out.
2. **Slices**: the workload's requests cut by request size into prompt x output length buckets (quantile
   edges), each with its share of the target rate.
3. **Capacities by simulation**: for every option (pool, GPU type, tensor-parallel degree, and for decode a
   speculation setting) and slice, the highest rate one instance sustains for that slice's requests within
   the SLO attainment target (the other pool made non-binding, as in ``search.Planner``'s screening):
   prefill on TTFT alone, decode and colocated on both SLOs.
4. **Integer program** (``cost_milp``): the cheapest instance counts and slice shares, under the mixing rule
   the serving side supports: one option per pool (``one_per_pool``, servable today), one GPU type overall
   (the single-type baseline), a colocated single type (the vLLM-like baseline), and any mix within a pool
   (``mixed``: an estimate of what a capacity-weighted router would save; not servable).
5. **Verification**: each servable plan is simulated whole, on the workload at the rate; while it misses
   the attainment target, an instance is added to the pool of the binding SLO (TTFT: prefill, TPOT: decode).
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from tqdm import tqdm

from planner.analytical import AnalyticalOptions, analytical_profile
from planner.cost_milp import InstanceOption, Packing, PackingProblem, Slice, solve_packing
from planner.gpu_catalog import GPUCatalog, GPUType
from planner.profile import AcceptanceEntry, Profile, ProfileError
from planner.search import NO_SPECULATION, PlanError, SLOTarget, Workload, describe_spec
from planner.simulator import PoolPlan, SimConfig, simulate
from planner.slo import AttainmentWatch, attainment
from planner.workload import RequestSpec, arrival_times
from decode_worker.config import SpeculationConfig

POOLS = ("prefill", "decode")
NON_BINDING = 64  # instances of the other pool while one option is screened
BURST = 64  # requests arriving at once, whose throughput is the first guess of an option's capacity ...
BURST_FINISHED = 16  # ... until this many of them finish
BRACKET_SPAN = 4.0  # capacity is bracketed in factors of this, then bisected CostSpace.bisect_steps times
# Arrivals of a simulation at a rate span at least this many lifetimes of a request that just meets the SLOs
# (TTFT + mean output x TPOT): a shorter span is a transient, whose batch never grows to the rate's steady
# state and whose queue never waits longer than the TTFT SLO allows, so an overload would pass.
STEADY_LIFETIMES = 2.0


def steady_span_s(slo: SLOTarget, mean_output_tokens: float) -> float:
    """How long arrivals at a rate must span to measure that rate sustained (``STEADY_LIFETIMES``)."""
    return STEADY_LIFETIMES * (slo.ttft_s + max(0.0, mean_output_tokens - 1) * slo.tpot_s)


@dataclass(frozen=True)
class CostSpace:
    """What the cost search may choose, and how finely it looks."""

    catalog: GPUCatalog
    model: str  # a built-in shape (llama-3.1-8b, llama-3.1-70b) or an HF checkpoint dir
    tensor_parallel: tuple[int, ...] = (1, 2, 4, 8)
    speculation: tuple[SpeculationConfig, ...] = (NO_SPECULATION,)
    acceptance: tuple[AcceptanceEntry, ...] = ()
    acceptance_note: str = ""
    include_colocated: bool = True
    prompt_buckets: int = 2
    output_buckets: int = 2
    prefill_token_budget: int = 2048
    prefill_max_prompts: int = 16
    decode_max_num_seqs: int = 128
    max_concurrent: int = 1024
    transfer_gbps: float = 25.0
    screen_duration_s: float = 10.0  # arrivals per screening simulation span at least this long (and
    # at least steady_span_s)
    screen_max_requests: int = 1500
    bisect_steps: int = 5  # capacities to a factor of BRACKET_SPAN ** (1 / 2 ** bisect_steps): 4.4 %
    workers: int = 2  # processes screening in parallel

    def __post_init__(self) -> None:
        for name in ("prompt_buckets", "output_buckets", "bisect_steps", "workers", "screen_max_requests"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name}: must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class RequestSlice:
    """Requests whose prompt and output lengths fall in one bucket; ``share``: of all requests."""

    name: str
    prompt_bucket: int  # slices of one prompt bucket share a prefill capacity (it depends on prompts only)
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    share: float
    lengths: tuple[tuple[int, int], ...]


def make_slices(lengths: list[tuple[int, int]], prompt_buckets: int, output_buckets: int) -> list[RequestSlice]:
    """Cut (prompt, output) lengths into buckets at quantile edges (prompt first, then output within each
    prompt bucket); empty buckets are dropped."""
    def cut(values: list[int], parts: int) -> list[int]:
        s = sorted(values)
        return sorted({s[min(len(s) - 1, (len(s) * i) // parts)] for i in range(1, parts)})

    out: list[RequestSlice] = []
    p_edges = cut([p for p, _ in lengths], prompt_buckets)
    for i, p_group in enumerate(_split(lengths, p_edges, key=lambda r: r[0])):
        if not p_group:
            continue
        o_edges = cut([o for _, o in p_group], output_buckets)
        for j, group in enumerate(_split(p_group, o_edges, key=lambda r: r[1])):
            if group:
                ps, os_ = [p for p, _ in group], [o for _, o in group]
                out.append(RequestSlice(f"p{i}o{j}", i, (min(ps), max(ps)), (min(os_), max(os_)),
                                        len(group) / len(lengths), tuple(group)))
    return out


def _split(items, edges: list[int], key) -> list[list]:
    groups: list[list] = [[] for _ in range(len(edges) + 1)]
    for it in items:
        groups[sum(key(it) >= e for e in edges)].append(it)
    return groups


class SliceWorkload:
    """A slice's requests at a rate: Poisson arrivals spanning at least ``duration_s`` (at most
    ``max_requests``), lengths drawn from the slice (seeded)."""

    def __init__(self, lengths: tuple[tuple[int, int], ...], seed: int, duration_s: float, max_requests: int,
                 min_requests: int = 60):
        self.lengths, self.seed = lengths, seed
        self.duration_s, self.max_requests, self.min_requests = duration_s, max_requests, min_requests

    def at_rate(self, rate: float) -> list[RequestSpec]:
        n = int(min(self.max_requests, max(self.min_requests, math.ceil(rate * self.duration_s))))
        rng = random.Random(self.seed)
        drawn = [self.lengths[rng.randrange(len(self.lengths))] for _ in range(n)]
        return [RequestSpec(t, p, o) for t, (p, o) in zip(arrival_times(rate, n, self.seed + 1), drawn)]


@dataclass(frozen=True)
class ScreenTask:
    """One option's capacity for one group of requests (run in a worker process)."""

    gpu: str
    pool: str  # prefill | decode | colocated
    tp: int
    spec: SpeculationConfig | None
    lengths: tuple[tuple[int, int], ...]
    kv_tokens: int


@dataclass
class PoolChoice:
    """One pool of a plan: its option and instance count."""

    option: str
    gpu: GPUType
    tp: int
    instances: int
    kv_tokens: int
    spec: SpeculationConfig | None = None
    role: str = "decode"  # prefill | decode | colocated

    @property
    def gpus(self) -> int:
        return self.instances * self.tp

    @property
    def cost_per_hour(self) -> float:
        return self.gpus * self.gpu.price_per_gpu_hour

    def describe(self) -> str:
        spec = f", {describe_spec(self.spec)}" if self.spec is not None else ""
        return f"{self.instances} x {self.gpu.name} tp{self.tp}{spec}"


@dataclass
class CostPlan:
    """A plan the search compared: its pools, cost, and what the full simulation at the rate showed."""

    name: str  # heterogeneous | single_type | colocated | mixed
    mode: str  # disaggregated | colocated
    pools: dict[str, PoolChoice]
    milp_cost_per_hour: float
    meets_slo: bool = False  # the simulation met the attainment target
    attainment: float = math.nan
    ttft_attainment: float = math.nan
    tpot_attainment: float = math.nan
    added: int = 0  # instances verification added beyond the integer program's
    goodput: float = math.nan  # req/s: the highest rate the plan serves within the target (simulated)
    binding: str = "-"  # the SLO that fails first above the goodput: TTFT or TPOT ("-": none failed)
    goodput_capped: bool = False  # the plan met the target at the highest rate tried (goodput is at least that)
    note: str = ""

    @property
    def cost_per_hour(self) -> float:
        return sum(p.cost_per_hour for p in self.pools.values())

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.pools.values())

    def describe(self) -> str:
        if self.mode == "colocated":
            return f"colocated {self.pools['colocated'].describe()}"
        return " + ".join(f"{'P' if p.role == 'prefill' else 'D'} {p.describe()}" for p in self.pools.values())


@dataclass
class CostPlanResult:
    rate: float
    slices: list[RequestSlice]
    options: list[InstanceOption]
    plans: list[CostPlan]
    skipped: dict[str, str] = field(default_factory=dict)  # GPU type -> why it was left out

    @property
    def best(self) -> CostPlan:
        """The cheapest plan that met the target in simulation and that today's router serves (a GPU type per
        pool, one type, or colocated)."""
        ok = [p for p in self.plans if p.meets_slo and p.name in ("heterogeneous", "single_type", "colocated")]
        if not ok:
            raise PlanError("no plan met the SLO attainment target in simulation at this rate (see the report)")
        return min(ok, key=lambda p: (p.cost_per_hour, p.name != "heterogeneous"))


_PROFILES: dict = {}  # a worker process's analytical profiles, built once per GPU type


def _worker_profile(gpu: GPUType, model: str, tps: tuple[int, ...], transfer_gbps: float,
                    acceptance: tuple[AcceptanceEntry, ...]) -> Profile:
    key = (gpu.spec, model, tps, transfer_gbps, acceptance)
    if key not in _PROFILES:
        _PROFILES[key] = analytical_profile(gpu.spec, model, AnalyticalOptions(tensor_parallel=tps,
                                                                               transfer_bandwidth=transfer_gbps * 1e9),
                                            acceptance)
    return _PROFILES[key]


def _screen(args: tuple) -> float:
    """Capacity (req/s) of one instance of the task's option on its requests (a worker process's job): the
    highest Poisson rate whose simulation meets the attainment target, bracketed from the throughput of one
    simulated burst and found by geometric bisection. Each simulation stops once its verdict is decided
    (``AttainmentWatch``)."""
    task, gpu, space, slo, seed = args
    profile = _worker_profile(gpu, space.model, space.tensor_parallel, space.transfer_gbps, space.acceptance)
    # prefill is screened on TTFT alone: one output token each, so the (idle) decode pool simulates no steps
    lengths = tuple((p, 1) for p, _ in task.lengths) if task.pool == "prefill" else task.lengths
    span = max(space.screen_duration_s, steady_span_s(slo, sum(o for _, o in lengths) / len(lengths)))
    workload = SliceWorkload(lengths, seed, span, space.screen_max_requests)
    cap = task.kv_tokens
    if task.pool == "colocated":
        cfg = SimConfig("colocated", colocated=PoolPlan(1, task.tp, cap, space.prefill_token_budget,
                                                        space.decode_max_num_seqs),
                        max_concurrent=space.max_concurrent)
    else:
        prefill = PoolPlan(1 if task.pool == "prefill" else NON_BINDING, task.tp, cap, space.prefill_token_budget,
                           space.prefill_max_prompts)
        decode = PoolPlan(NON_BINDING if task.pool == "prefill" else 1, task.tp, cap, 1, space.decode_max_num_seqs)
        cfg = SimConfig("disaggregated", prefill=prefill, decode=decode,
                        speculation=task.spec if task.spec is not None else NO_SPECULATION,
                        max_concurrent=space.max_concurrent)
    metric = "ttft_only" if task.pool == "prefill" else "both"

    def ok(rate: float) -> bool:
        trace = workload.at_rate(rate)
        watch = AttainmentWatch(len(trace), slo.ttft_s, slo.tpot_s, slo.attainment, metric)
        return simulate(profile, cfg, trace, seed=seed, watch=watch).verdict

    burst = [RequestSpec(0.0, r.prompt_tokens, r.output_tokens)
             for r in SliceWorkload(lengths, seed, 0.0, BURST, BURST).at_rate(1.0)]
    # the burst runs until BURST_FINISHED of its requests finish (a watch with no SLO and that target)
    res = simulate(profile, cfg, burst, seed=seed,
                   watch=AttainmentWatch(len(burst), math.inf, math.inf, BURST_FINISHED / len(burst)))
    if not any(r.finished for r in res.records):
        return 0.0
    # the throughput until then guesses the capacity. It is no bound: the bisection brackets the capacity
    # above the guess as well as below it. A guess too high costs a failing simulation, which stops early.
    throughput = sum(r.finished for r in res.records) / max(r.finish_s for r in res.records if r.finished)
    return geometric_bisection(ok, throughput, space.bisect_steps, span=BRACKET_SPAN, grow=4, shrink=4)


def geometric_bisection(ok, guess: float, steps: int, span: float = 64.0, grow: int = 0,
                        shrink: int = 2) -> float:
    """The highest ``x`` > 0 with ``ok(x)`` (``ok`` monotone: true below some threshold), to a factor of
    ``span ** (1 / 2 ** steps)``. The threshold is first bracketed from ``guess`` in factors of ``span``:
    upwards at most ``grow`` times (past that, the highest passing rate tried is returned: the threshold is at
    least that), downwards at most ``shrink`` times (0 when even ``guess / span ** shrink`` fails)."""
    if ok(guess):
        lo = guess
        for _ in range(grow):
            if not ok(lo * span):
                break
            lo *= span
        else:
            return lo
        hi = lo * span
    else:
        hi = guess
        for _ in range(shrink):
            if ok(hi / span):
                break
            hi /= span
        else:
            return 0.0
        lo = hi / span
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _reconcile(plans: list[CostPlan]) -> None:
    """Verification adds instances, so verified costs need not keep the programs' order. The single-type plans
    are among the per-pool ones: where the verified per-pool plan runs one GPU type and is cheaper, it is also
    the best single-type plan; where the verified single-type plan is cheaper, it is also the best per-pool one."""
    by = {p.name: p for p in plans}
    hetero, single = by.get("heterogeneous"), by.get("single_type")
    if hetero is None or single is None or not hetero.meets_slo and not single.meets_slo:
        return

    def cheaper(a: CostPlan, b: CostPlan) -> bool:
        return a.meets_slo and (not b.meets_slo or a.cost_per_hour < b.cost_per_hour)

    one_type = len({p.gpu.name for p in hetero.pools.values()}) == 1
    if one_type and cheaper(hetero, single):
        plans[plans.index(single)] = dataclasses.replace(hetero, name="single_type", pools=_copy(hetero.pools),
                                                         note="the per-pool search's plan (one GPU type)")
    elif cheaper(single, hetero):
        plans[plans.index(hetero)] = dataclasses.replace(single, name="heterogeneous", pools=_copy(single.pools),
                                                         note="the single-type plan (cheaper once verified)")


def _copy(pools: dict[str, PoolChoice]) -> dict[str, PoolChoice]:
    return {k: dataclasses.replace(v) for k, v in pools.items()}


class CostPlanner:
    """Searches ``space`` for the cheapest plans serving ``workload`` within ``slo``: ``screen`` once (the
    options' capacities do not depend on the rate), then ``plan`` for each target rate."""

    def __init__(self, space: CostSpace, slo: SLOTarget, workload: Workload, progress: bool = True,
                 verify_rounds: int = 12):
        self.sample = workload.at_rate(1.0)  # the request sizes the slices and the screening draw from
        if workload.shape is not None:  # a verification at a rate measures that rate sustained
            mean_output = sum(r.output_tokens for r in self.sample) / len(self.sample)
            workload = dataclasses.replace(workload, min_duration_s=max(workload.min_duration_s,
                                                                        steady_span_s(slo, mean_output)))
        self.space, self.slo, self.workload = space, slo, workload
        self.progress = progress
        self.verify_rounds = verify_rounds
        self.profiles: dict[str, Profile] = {}
        self.skipped: dict[str, str] = {}
        self.slices = make_slices([(r.prompt_tokens, r.output_tokens) for r in self.sample], space.prompt_buckets,
                                  space.output_buckets)
        self._screened: tuple[list[InstanceOption], dict[str, ScreenTask]] | None = None
        longest = workload.shape.longest() if workload.shape is not None else \
            max(r.prompt_tokens + r.output_tokens for r in self.sample)
        for t in space.catalog.types:
            try:
                prof = analytical_profile(t.spec, space.model, AnalyticalOptions(
                    tensor_parallel=space.tensor_parallel, transfer_bandwidth=space.transfer_gbps * 1e9,
                    min_kv_tokens=max(16384, longest + 1)), space.acceptance, space.acceptance_note)
            except ProfileError as err:
                self.skipped[t.name] = str(err)
                continue
            self.profiles[t.name] = prof
        if not self.profiles:
            raise PlanError("no GPU type of the selection holds the model with room for the longest request: "
                            + "; ".join(f"{k}: {v}" for k, v in self.skipped.items()))

    def _tps(self, gpu: str) -> list[int]:
        return sorted(c.tensor_parallel for c in self.profiles[gpu].instances)

    def _tasks(self, slices: list[RequestSlice]) -> list[tuple[str, ScreenTask, list[int]]]:
        """(option key, task, indices of the slices its capacity stands for)."""
        tasks = []
        for gpu in self.profiles:
            for tp in self._tps(gpu):
                kv = self.profiles[gpu].costs(tp).kv_capacity_tokens
                # prefill capacity depends on the prompts only: one task per prompt bucket
                by_prompt: dict[int, list[int]] = {}
                for i, s in enumerate(slices):
                    by_prompt.setdefault(s.prompt_bucket, []).append(i)
                for idx in by_prompt.values():
                    lengths = tuple(x for i in idx for x in slices[i].lengths)
                    tasks.append((f"prefill {gpu} tp{tp}", ScreenTask(gpu, "prefill", tp, None, lengths, kv), idx))
                for spec in self.space.speculation:
                    for i, s in enumerate(slices):
                        tasks.append((f"decode {gpu} tp{tp} {describe_spec(spec)}",
                                      ScreenTask(gpu, "decode", tp, spec, s.lengths, kv), [i]))
                if self.space.include_colocated:
                    for i, s in enumerate(slices):
                        tasks.append((f"colocated {gpu} tp{tp}", ScreenTask(gpu, "colocated", tp, None, s.lengths, kv),
                                      [i]))
        return tasks

    def screen(self) -> tuple[list[InstanceOption], dict[str, ScreenTask]]:
        """Every option's capacity per slice, by simulation (computed once)."""
        if self._screened is not None:
            return self._screened
        slices = self.slices
        tasks = self._tasks(slices)
        gpus = {t.name: t for t in self.space.catalog.types}
        jobs = [(task, gpus[task.gpu], self.space, self.slo, self.workload.seed) for _, task, _ in tasks]
        # roughly the longest jobs first, so that no worker is left with a long one at the end: decode and
        # colocated jobs before prefill ones (which simulate no decode steps), cheaper instances first (slower
        # ones tend to hold fewer requests at once, so their simulations step through more batches)
        order = sorted(range(len(jobs)), key=lambda i: (tasks[i][1].pool == "prefill",
                                                        gpus[tasks[i][1].gpu].price_per_gpu_hour * tasks[i][1].tp))
        ordered = [jobs[i] for i in order]
        if self.space.workers > 1:
            # spawned, not forked: the caller may hold threads (Ray, gRPC) a forked child would inherit mid-lock
            with ProcessPoolExecutor(self.space.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                done = list(tqdm(pool.map(_screen, ordered), total=len(jobs), desc="plan: screening options",
                                 disable=not self.progress, dynamic_ncols=True))
        else:
            done = [_screen(j) for j in tqdm(ordered, desc="plan: screening options", disable=not self.progress,
                                              dynamic_ncols=True)]
        caps = [0.0] * len(jobs)
        for i, cap in zip(order, done):
            caps[i] = cap
        capacity: dict[str, list[float]] = {}
        info: dict[str, ScreenTask] = {}
        for (key, task, idx), cap in zip(tasks, caps):
            capacity.setdefault(key, [0.0] * len(slices))
            info.setdefault(key, task)
            for i in idx:
                capacity[key][i] = cap
        options = [InstanceOption(key, info[key].pool, info[key].gpu, info[key].tp,
                                  info[key].tp * gpus[info[key].gpu].price_per_gpu_hour, tuple(cap))
                   for key, cap in capacity.items()]
        self._screened = options, info
        return self._screened

    def plan(self, rate: float) -> CostPlanResult:
        """The cheapest plans for ``rate`` req/s under each mixing rule, each verified by simulation."""
        if not (rate > 0 and math.isfinite(rate)):
            raise PlanError(f"rate: must be > 0 requests/s, got {rate}")
        options, info = self.screen()
        gpus = {t.name: t for t in self.space.catalog.types}
        slices = self.slices
        rated = tuple(Slice(s.name, s.share * rate) for s in slices)
        limits = {t.name: t.max_gpus for t in self.space.catalog.types if t.max_gpus is not None}
        disagg = tuple(o for o in options if o.pool in POOLS)
        plans: list[CostPlan] = []
        for name, opts, pools, mixing in (("heterogeneous", disagg, POOLS, "one_per_pool"),
                                          ("single_type", disagg, POOLS, "one_type"),
                                          ("colocated", tuple(o for o in options if o.pool == "colocated"),
                                           ("colocated",), "one_type"),
                                          ("mixed", disagg, POOLS, "mixed")):
            if not opts:
                continue
            packing = solve_packing(PackingProblem(rated, opts, pools, limits, mixing))
            if packing is None:
                plans.append(CostPlan(name, "colocated" if name == "colocated" else "disaggregated", {}, math.nan,
                                      note="infeasible: no allocation serves every slice within the GPU limits"))
                continue
            plans.append(self._plan(name, packing, info, gpus))
        for plan in tqdm([p for p in plans if p.pools and p.name != "mixed"], desc="plan: verifying",
                         disable=not self.progress, dynamic_ncols=True):
            self._verify(plan, limits, rate)
        _reconcile(plans)
        return CostPlanResult(rate, slices, options, plans, dict(self.skipped))

    def _plan(self, name: str, packing: Packing, info: dict[str, ScreenTask], gpus: dict[str, GPUType]) -> CostPlan:
        pools: dict[str, PoolChoice] = {}
        for key, n in packing.counts.items():
            t = info[key]
            pool_name = t.pool if name != "mixed" else f"{t.pool} {t.gpu} tp{t.tp}"
            pools[pool_name] = PoolChoice(key, gpus[t.gpu], t.tp, n, t.kv_tokens, t.spec, t.pool)
        note = ("estimate only: any mix within a pool, which needs a router that weighs instances by capacity"
                if name == "mixed" else "")
        mode = "colocated" if name == "colocated" else "disaggregated"
        return CostPlan(name, mode, dict(sorted(pools.items(), key=lambda kv: kv[1].role != "prefill")),
                        packing.cost_per_hour, note=note)

    def simulate_plan(self, plan: CostPlan, rate: float):
        """The whole plan on the workload at ``rate`` req/s: its attainment."""
        res = self._run_plan(plan, self.workload.at_rate(rate))
        return attainment(res.outcomes(), self.slo.ttft_s, self.slo.tpot_s)

    def _run_plan(self, plan: CostPlan, trace: list[RequestSpec], watch: AttainmentWatch | None = None):
        """The whole plan on ``trace``: the simulation's result."""
        s = self.space
        if plan.mode == "colocated":
            c = plan.pools["colocated"]
            cfg = SimConfig("colocated", colocated=PoolPlan(c.instances, c.tp, c.kv_tokens, s.prefill_token_budget,
                                                            s.decode_max_num_seqs), max_concurrent=s.max_concurrent)
            return simulate(self.profiles[c.gpu.name], cfg, trace, seed=self.workload.seed, watch=watch)
        else:
            p, d = plan.pools["prefill"], plan.pools["decode"]
            cfg = SimConfig("disaggregated",
                            prefill=PoolPlan(p.instances, p.tp, p.kv_tokens, s.prefill_token_budget,
                                             s.prefill_max_prompts),
                            decode=PoolPlan(d.instances, d.tp, d.kv_tokens, 1, s.decode_max_num_seqs),
                            speculation=d.spec or NO_SPECULATION, max_concurrent=s.max_concurrent)
            return simulate(self.profiles[p.gpu.name], cfg, trace, seed=self.workload.seed,
                            decode_profile=self.profiles[d.gpu.name], watch=watch)

    def _goodput(self, plan: CostPlan, rate: float, steps: int = 3, span: float = 2.0) -> None:
        """The plan's goodput above the target rate (geometric bisection up to ``span`` x the rate), and the
        SLO that more requests missed at the lowest failing rate tried (each simulation stops once its verdict
        is decided)."""
        failing: list = []

        def ok(r: float) -> bool:
            trace = self.workload.at_rate(r)
            watch = AttainmentWatch(len(trace), self.slo.ttft_s, self.slo.tpot_s, self.slo.attainment)
            if not self._run_plan(plan, trace, watch).verdict:
                failing.append((r, watch.binding))
                return False
            return True

        plan.goodput = geometric_bisection(ok, rate * span, steps, span)
        plan.goodput_capped = not failing
        if failing:
            plan.binding = min(failing)[1]  # just above the goodput

    def _verify(self, plan: CostPlan, limits: dict[str, int], rate: float) -> None:
        """Simulate the plan whole; while it misses the target, add an instance where it helps most: a TPOT
        miss is decode's; a TTFT miss is prefill's or, when requests wait for decode KV room, decode's (both
        are tried, the better attainment kept)."""
        a = self.simulate_plan(plan, rate)
        for _ in range(self.verify_rounds):
            if a.both >= self.slo.attainment:
                break
            if plan.mode == "colocated":
                roles = ["colocated"]
            else:
                roles = ["prefill", "decode"] if a.ttft_only < a.tpot_only else ["decode"]
            tried = []
            for role in roles:
                grow = plan.pools[role]
                used = sum(p.gpus for p in plan.pools.values() if p.gpu.name == grow.gpu.name)
                if grow.gpu.name in limits and used + grow.tp > limits[grow.gpu.name]:
                    continue
                grow.instances += 1
                tried.append((self.simulate_plan(plan, rate), -grow.cost_per_hour, role))
                grow.instances -= 1
            if not tried:
                break
            a, _, role = max(tried, key=lambda t: (t[0].both, t[1]))
            plan.pools[role].instances += 1
            plan.added += 1
        plan.attainment, plan.ttft_attainment, plan.tpot_attainment = a.both, a.ttft_only, a.tpot_only
        if a.both >= self.slo.attainment:
            plan.meets_slo = True
            self._goodput(plan, rate)
            return
        plan.note = (f"misses the {self.slo.attainment:.0%} target in simulation ({plan.attainment:.1%}) after "
                     f"{plan.added} added instances")
