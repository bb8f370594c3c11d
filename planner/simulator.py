"""Discrete-event simulator of a magicserve cluster: per-request TTFT and TPOT for a trace, from a
profile's cost models, without running the model.

What it models (and mirrors from the real router, ``controller/router.py``):

    arrival -> admission (at most ``max_concurrent`` in flight, FIFO queue beyond)
            -> disaggregated: KV reservation (prompt + 1 tokens) on a decode instance in the rescheduling
               policy's placement order (``controller/placement.py``): on the first, together with
               prefill, when it has room; else each in turn, answered when that instance's step in
               progress ends (a call into a busy worker), and when none has room, wait until memory frees;
               prefill on the prefill instance with the fewest assigned requests, KV streamed chunk by
               chunk, admission into the decode batch at a step boundary, speculative decode steps
            -> colocated: the instance with the fewest assigned requests runs chunked prefill and decode
               in the same steps (the reference engine)
            -> finish: the request's slot and memory free, the next queued request is admitted
            -> with ``SimConfig.migration``: the global rescheduling policy's rounds live-migrate decoding
               requests between decode instances (``sim_migration``)
            -> resizes (``add_instance``, ``retire_instance``, and ``switch_instance``: an instance changing
               role in place; ``planner/sim_elastic.py`` drives them with the
               online planner): a new instance holds its devices from the resize and takes requests after
               its start-up time; a leaving one takes no new requests, a decode instance live-migrates its
               running requests away, a prefill one finishes its prompts, and its devices return once empty
            -> with ``SimConfig.prefix_caching``: every pool keeps computed KV (the real prefix cache over the
               requests' token ids), instances are chosen by cached prefix against load
               (``controller/kv_index.cached_first`` and ``cheapest``, with a perfect index), and a decode
               instance holding all of a prompt but ``local_prefill_tokens`` prefills it itself; a trace with reuse
               (``planner/reuse_workload.py``) sends a conversation's next turn a think time after the
               previous one ends
            -> with ``SimConfig.load_aware``: a prompt the prefill pool would serve past the TTFT target goes to
               the decode instance whose TPOT slack computes it sooner (``controller/load_aware.decide`` over
               the simulated instances' queues and speeds), each decode step prefilling only what its
               budget allows beside the batch (``decode_worker/prefill_budget.py``, the worker's own), the
               chunk riding in the decode pass (``StepCosts.fused_prefill_chunk``)
            -> with ``prefix_caching.prefill_ahead``: a prefill instance with nothing queued computes the full
               blocks of a request waiting for decode room ahead (``controller/prefill_ahead.py``), in steps of
               their own that give way to any prompt (the worker's scheduler lanes)

Instance behaviour lives in ``sim_instances`` (the real schedulers, run on plain objects). A step's time is
its profiled cost times the mode's calibration (``sim_instances.StepCosts``): the serving path's own costs
(Ray and gRPC hops, worker loops) enter as a request-path delay, scales on prefill and decode step times
and a delay before a transferred request joins the decode batch. An optional plug-in multiplies each step
by a factor (``host_contention``: instances slowing each other on one small shared machine; off unless
given). Not modelled: failures and retries.
"""

from __future__ import annotations


import heapq
import itertools
import math
import random
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Protocol

from controller.kv_index import PrefixRouting
from controller.load_aware import LoadAwarePolicy
from planner.profile import Profile, calibration_threads
from planner.sim_instances import ColocatedSim, DecodeSim, PrefillSim, SimRequest, StepCosts
from planner.reuse_workload import ReuseRequest
from planner.sim_ahead import compute_ahead
from planner.sim_load_aware import prefill_on_decode
from planner.sim_migration import MigrationSim, MigrationStats, SimMigration
from planner.sim_reuse import distinct_requests, reuse_requests
from planner.sim_routing import cheapest_for, decode_order, hold_on_decode
from planner.slo import AttainmentWatch, RequestOutcome
from planner.sim_tiers import SimTierConfig, SimTiers
from planner.workload import RequestSpec
from decode_worker.config import SpeculationConfig



class HostContention(Protocol):
    """A plug-in slowing each step by instances sharing one small machine (``benchmarks/host_contention.py``)."""

    def step_factor(self, inst, duration: float, instances: list, rng) -> float: ...

MODES = ("disaggregated", "colocated")
# a watched request misses once it is this much later than its SLO allows: far above float rounding of the
# times (~1e-13 s), far below any latency
DEADLINE_MARGIN_S = 1e-9


class SimConfigError(ValueError):
    pass


@dataclass(frozen=True)
class PoolPlan:
    """One pool: ``instances`` instances of ``tensor_parallel`` rank processes of ``threads`` torch threads
    each (a device per thread on a CPU; ``threads`` is 1 on GPUs)."""

    instances: int
    tensor_parallel: int = 1
    kv_cache_tokens: int = 65536  # per instance
    token_budget: int = 512  # prefill / colocated: tokens per step
    max_num_seqs: int = 64
    threads: int = 1

    @property
    def shape(self) -> tuple[int, int]:
        return self.tensor_parallel, self.threads

    @property
    def devices(self) -> int:
        return self.instances * self.tensor_parallel * self.threads

    def validate(self, name: str, may_empty: bool = False) -> None:
        """``may_empty``: the pool may have no instance (the prefill pool: decode instances then prefill)."""
        for f in ("instances", "tensor_parallel", "kv_cache_tokens", "token_budget", "max_num_seqs", "threads"):
            if getattr(self, f) < (0 if may_empty and f == "instances" else 1):
                raise SimConfigError(f"{name}.{f}: must be >= {0 if may_empty and f == 'instances' else 1}, "
                                     f"got {getattr(self, f)}")


@dataclass(frozen=True)
class SimConfig:
    """What to simulate: the pools, the speculation setting and the router's limits."""

    mode: str = "disaggregated"
    prefill: PoolPlan | None = None
    decode: PoolPlan | None = None
    colocated: PoolPlan | None = None
    speculation: SpeculationConfig = SpeculationConfig()
    block_size: int = 16
    max_concurrent: int = 64
    overhead_s: float = 0.0  # added to every TTFT (request path latency outside the workers)
    migration: SimMigration | None = None  # the global rescheduling policy (disaggregated); None: off
    prefix_caching: PrefixRouting | None = None  # keep computed KV and route to it; None: off
    decode_prefill_chunk: int = 1024  # tokens per step a decode instance prefills itself
    tiers: SimTierConfig | None = None  # KV tiers below each instance's pool (with prefix_caching); None: none
    # load-aware disaggregation (controller/load_aware.py): a prompt the prefill pool would serve late goes to a
    # decode instance with TPOT slack; None: off
    load_aware: LoadAwarePolicy | None = None
    # what a decode instance's local prefill may push its decoding sequences' TPOT to (decode_worker/
    # prefill_budget.py); None: a whole decode_prefill_chunk every step
    decode_prefill_tpot_s: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SimConfigError(f"mode: must be one of {list(MODES)}, got {self.mode!r}")
        pools = ("prefill", "decode") if self.mode == "disaggregated" else ("colocated",)
        for name in pools:
            pool = getattr(self, name)
            if pool is None:
                raise SimConfigError(f"{name}: required in {self.mode} mode")
            pool.validate(name, may_empty=name == "prefill")
        if self.max_concurrent < 1:
            raise SimConfigError(f"max_concurrent: must be >= 1, got {self.max_concurrent}")
        if self.migration is not None and self.mode != "disaggregated":
            raise SimConfigError("migration: live migration moves requests between decode instances "
                                 "(disaggregated mode only)")
        if self.migration is not None and self.prefix_caching is not None:
            raise SimConfigError("prefix_caching: not simulated together with migration")
        if self.tiers is not None and self.prefix_caching is None:
            raise SimConfigError("tiers: sit below the prefix cache; set prefix_caching too")
        if self.decode_prefill_chunk < 1:
            raise SimConfigError(f"decode_prefill_chunk: must be >= 1, got {self.decode_prefill_chunk}")
        if self.load_aware is not None and self.mode != "disaggregated":
            raise SimConfigError("load_aware: places prompts between the prefill and decode pools "
                                 "(disaggregated mode only)")
        if self.decode_prefill_tpot_s is not None and not self.decode_prefill_tpot_s > 0:
            raise SimConfigError(f"decode_prefill_tpot_s: must be > 0 or None, got {self.decode_prefill_tpot_s}")

    @property
    def devices(self) -> int:
        """Devices (GPUs, or cores on a CPU: every rank's threads) the configuration uses."""
        if self.mode == "colocated":
            return self.colocated.devices
        return self.prefill.devices + self.decode.devices

    def calibration_threads(self) -> int:
        """The thread count whose calibration the simulation takes (``profile.calibration_threads``)."""
        threads = ({"colocated": self.colocated.threads} if self.mode == "colocated" else
                   {"prefill": self.prefill.threads, "decode": self.decode.threads})
        return calibration_threads(threads)

    @staticmethod
    def from_cluster_config(cfg) -> "SimConfig":
        """The simulation of a ``controller.config.ClusterConfig``. A CPU instance is ``tensor_parallel``
        rank processes of ``threads`` threads, a device per thread (so per-device goodput is per-core goodput
        there, and a profile must hold costs measured for that shape); a GPU instance is ``tensor_parallel``
        GPUs, one per rank."""

        def pool(name: str, section, budget: int, seqs: int) -> PoolPlan:
            tp = section.tensor_parallel
            if not section.devices_per_instance:
                return PoolPlan(section.instances, tp, section.kv_cache_tokens, budget, seqs, section.threads)
            if section.devices_per_instance != tp:
                raise SimConfigError(f"{name}.devices_per_instance: the simulator models a GPU instance as one GPU "
                                     f"per rank, so it must equal tensor_parallel ({tp}), got "
                                     f"{section.devices_per_instance}")
            return PoolPlan(section.instances, tp, section.kv_cache_tokens, budget, seqs)

        common = dict(block_size=cfg.decode.block_size, max_concurrent=cfg.limits.max_concurrent_requests)
        mig = getattr(cfg, "migration", None)
        if getattr(cfg, "mode", "disaggregated") == "colocated":
            c = cfg.colocated
            return SimConfig("colocated", colocated=pool("colocated", c, c.token_budget, c.max_num_seqs), **common)
        prefill = pool("prefill", cfg.prefill, cfg.prefill.token_budget, cfg.prefill.max_num_seqs)
        decode = pool("decode", cfg.decode, 1, cfg.decode.max_num_seqs)
        migration = SimMigration(mig.policy(), mig.interval_s) if mig is not None and mig.enabled else None
        la = getattr(cfg, "load_aware", None)
        tpot = getattr(cfg.decode, "prefill_tpot_slo_ms", None)
        return SimConfig("disaggregated", prefill=prefill, decode=decode, speculation=cfg.decode.speculation,
                         migration=migration, decode_prefill_chunk=cfg.decode.prefill_chunk,
                         load_aware=la.policy(cfg.slo) if la is not None and la.enabled else None,
                         decode_prefill_tpot_s=tpot / 1e3 if tpot else None, **common)


@dataclass(frozen=True)
class SimRecord:
    """One simulated request (seconds from the trace start)."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    completion_tokens: int
    first_token_s: float
    finish_s: float
    draft_tokens: int
    accepted_tokens: int
    preemptions: int

    @property
    def finished(self) -> bool:
        return not math.isnan(self.finish_s)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        if self.completion_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.completion_tokens - 1)

    def outcome(self) -> RequestOutcome:
        if not self.finished:
            return RequestOutcome(False, math.inf, math.inf)
        return RequestOutcome(True, self.ttft_s, self.tpot_s)


@dataclass(frozen=True)
class SimResult:
    records: list[SimRecord]
    duration_s: float
    instance_utilisation: dict[str, float]  # busy share of the simulated time
    k_counts: dict[int, int]  # decode steps by k (all decode instances)
    migrations: MigrationStats | None = None  # with SimConfig.migration
    # with a watch: whether the trace attains its target; the run stops once that is decided, so requests
    # still in flight then are recorded unfinished
    verdict: bool | None = None
    device_seconds: float = 0.0  # devices x seconds the instances held, resizes counted
    load_aware: dict | None = None  # with SimConfig.load_aware: (prefilled on, reason) -> prompts

    def outcomes(self) -> list[RequestOutcome]:
        return [r.outcome() for r in self.records]


class Simulation:
    """One run of one configuration over one trace. ``run`` may be called once. ``decode_profile``: the decode
    pool's hardware where it differs from the prefill pool's (``profile``; a heterogeneous plan)."""

    def __init__(self, profile: Profile, config: SimConfig, seed: int = 0,
                 host_contention: HostContention | None = None, decode_profile: Profile | None = None):
        self.profile = profile
        self.config = config
        self.host_contention = host_contention  # the optional plug-in (None: every step at its calibrated time)
        self.now = 0.0
        self._events: list = []
        self._order = itertools.count()
        self._queue: deque[SimRequest] = deque()  # admitted later (concurrency limit)
        self._unplaced: deque[SimRequest] = deque()  # admitted, waiting for decode KV room
        self._in_flight = 0
        # serving-path terms of the mode at the instances' thread count (identity if unmeasured)
        self.calibration = profile.calibration(config.mode, config.calibration_threads())
        self._rng = random.Random(seed)  # draws each decode instance its acceptance stream
        self.noise_rng = random.Random(seed + 104729)  # the plug-in's draws: a stream apart from acceptance
        c, cal = config, self.calibration
        self.prefill: list[PrefillSim] = []
        self.decode: list[DecodeSim] = []
        self.colocated: list[ColocatedSim] = []
        self._costs: dict[str, StepCosts] = {}
        self._decode_profile = decode_profile or profile
        if c.mode == "colocated":
            self._costs["colocated"] = StepCosts(profile, cal, c.colocated.shape)
        else:
            self._costs["prefill"] = StepCosts(profile, cal, c.prefill.shape)
            profile.prefill_model(*c.prefill.shape)  # fail now if the profile lacks it
            drafter = c.speculation.drafter if c.speculation.enabled else None
            self._costs["decode"] = StepCosts(self._decode_profile, cal, c.decode.shape, drafter)
        self.instances: list = []  # every instance of the run, those that left included
        self._named: dict[str, int] = {}  # pool -> instances made so far (the next one's number)
        self._shared_tier_blocks: OrderedDict[int, None] = OrderedDict()  # the cluster's store (tiers.shared)
        for pool in self.pools():
            for _ in range(getattr(c, pool).instances):
                getattr(self, pool).append(self._make(pool))
        self.starting: dict[str, list] = {pool: [] for pool in self.pools()}  # added, not serving yet
        self.switching: dict[str, int] = {pool: 0 for pool in self.pools()}  # draining elsewhere to join it
        self.open_requests = 0  # arrived or to arrive, not finished
        self.watch: AttainmentWatch | None = None
        # what the client sees: every token later by the request path's latency (routing before prefill,
        # delivery after each step), which moves TTFT but not the gaps between tokens
        self.client_delay_s = config.overhead_s + self.calibration.ttft_overhead_s
        # the policy's rounds (with SimConfig.migration); drains move requests through it too, or through
        # a mover of the default settings that runs no rounds
        self.migration = None if c.migration is None else self._mover(c.migration)
        self._drain_mover = self.migration
        self.load_aware_counts: Counter = Counter()  # (prefilled on, reason) -> prompts, with SimConfig.load_aware

    @property
    def requests(self) -> list[SimRequest]:
        """The run's requests (arrived or not), by trace index."""
        return self._requests

    def pools(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.config.mode == "disaggregated" else ("colocated",)

    def _make(self, pool: str):
        """A new instance of ``pool`` (not yet serving: the caller puts it in the pool's list)."""
        c, bs, plan = self.config, self.config.block_size, getattr(self.config, pool)
        caching = c.prefix_caching is not None
        n = self._named.get(pool, 0)
        self._named[pool] = n + 1
        name, costs = f"{pool}-{n}", self._costs[pool]
        tiers = None
        if c.tiers is not None:  # one store for the whole cluster, or each instance its own tiers
            tiers = SimTiers(c.tiers, bs, self._shared_tier_blocks if c.tiers.shared else None)
        if pool == "colocated":
            inst = ColocatedSim(self, name, costs, plan.kv_cache_tokens, bs, plan, caching, tiers)
        elif pool == "prefill":
            inst = PrefillSim(self, name, costs, self.profile.kv_transfer, plan.kv_cache_tokens, bs, plan, caching,
                              tiers)
        else:
            inst = DecodeSim(self, name, self._decode_profile, costs, plan.kv_cache_tokens, bs, plan.max_num_seqs,
                             c.speculation, random.Random(self._rng.random()), caching, c.decode_prefill_chunk,
                             tiers, c.decode_prefill_tpot_s)
        inst.devices = plan.tensor_parallel * plan.threads
        self.instances.append(inst)
        return inst

    # -- resizing --------------------------------------------------------------------------------------

    def pool_size(self, pool: str) -> int:
        """Instances of ``pool`` serving or starting up, and those switching into it (leaving ones not
        counted)."""
        return len(getattr(self, pool)) + len(self.starting[pool]) + self.switching[pool]

    def switch_instance(self, from_pool: str, to_pool: str, switch_s: float = 0.0, round_s: float = 0.25) -> str:
        """An instance of ``from_pool`` changes role (``Router.switch``): it drains as ``retire_instance``
        drains it, then, ``switch_s`` later (its worker rebuilt over the weights it holds), serves in ``to_pool``
        on the same devices (held throughout: the new role's instance holds them from the old one's stop).
        Returns the name of the instance that leaves ``from_pool``."""
        self.switching[to_pool] += 1

        def rebuilt() -> None:
            self.switching[to_pool] -= 1
            inst = self._make(to_pool)
            self.starting[to_pool].append(inst)

            def join() -> None:
                self.starting[to_pool].remove(inst)
                getattr(self, to_pool).append(inst)
                if to_pool == "decode":
                    self._place_unplaced()

            self.at(self.now + switch_s, join)

        return self.retire_instance(from_pool, round_s, on_stopped=rebuilt)

    def add_instance(self, pool: str, startup_s: float = 0.0) -> None:
        """Add an instance to ``pool``: it holds its devices from now and takes requests ``startup_s`` later
        (placement, process start, weights, warm-up)."""
        inst = self._make(pool)
        self.starting[pool].append(inst)

        def join() -> None:
            if inst.leaving:
                return  # retired while starting up
            self.starting[pool].remove(inst)
            getattr(self, pool).append(inst)
            if pool == "decode":
                self._place_unplaced()

        self.at(self.now + startup_s, join)

    def retire_instance(self, pool: str, round_s: float = 0.25, on_stopped=None) -> str:
        """Take an instance out of ``pool`` (the fewest assigned requests, the newest of those, as
        ``Scaler._victim``; one still starting up first, stopped at once): it takes no new requests; the prompts
        it has not begun are placed anew (``ControlCalls.hand_back``); a decode instance live-migrates its running
        requests to the others every ``round_s``; its devices return once it holds nothing (then
        ``on_stopped()``). Returns its name."""
        def stop(victim) -> None:
            victim.stopped_s = self.now
            if on_stopped is not None:
                on_stopped()

        if self.starting[pool]:
            victim = self.starting[pool].pop()
            victim.leaving = True
            stop(victim)
            return victim.name
        insts = getattr(self, pool)
        if len(insts) <= 1:
            raise SimConfigError(f"{pool}: cannot retire the pool's last instance")
        victim = min(reversed(insts), key=lambda i: len(i.assigned))
        insts.remove(victim)
        victim.leaving = True
        for req in victim.hand_back():  # the prompts it has not begun: placed anew (``ControlCalls.hand_back``)
            self._place_again(req)
        if self._drain_mover is None:
            self._drain_mover = self._mover(SimMigration())
        mover = self._drain_mover

        def drain() -> None:
            if pool == "decode":
                if not victim.seqs and not victim.busy:
                    stop(victim)
                    return
                for index, seq in list(victim.seqs.items()):
                    if index in mover.moving or seq.request_id not in victim.scheduler.running:
                        continue  # moving already, or its KV not here yet: a later round
                    dst = decode_order(self, seq.req)[0]
                    mover.begin(index, victim, dst)
            elif not victim.busy and not victim.scheduler.has_work():
                stop(victim)
                return
            self.at(self.now + round_s, drain)

        drain()
        return victim.name

    def _mover(self, settings: SimMigration) -> MigrationSim:
        spec = self.config.speculation
        return MigrationSim(self, settings, self.profile.kv_transfer, spec.max_k if spec.enabled else 0)

    def device_seconds(self, until: float) -> float:
        """Devices x seconds every instance held (from its resize, or the start, to its stop or ``until``)."""
        return sum(((until if math.isnan(i.stopped_s) else i.stopped_s) - i.allocated_s) * i.devices
                   for i in self.instances)

    def step_factor(self, inst, duration: float) -> float:
        """The plug-in's factor on a step of ``inst`` (``duration`` at its calibrated time): 1 without one."""
        if self.host_contention is None:
            return 1.0
        return self.host_contention.step_factor(inst, duration, self.instances, self.noise_rng)

    # -- the event loop ------------------------------------------------------------------------------

    def at(self, t: float, fn) -> None:
        heapq.heappush(self._events, (t, next(self._order), fn))

    def run(self, trace: list[RequestSpec] | list[ReuseRequest] | list[SimRequest], time_limit_s: float | None = None,
            watch: AttainmentWatch | None = None, wall_deadline: float | None = None) -> SimResult:
        """Simulate ``trace``; requests unfinished at ``time_limit_s`` after the last arrival count as
        unfinished (they never attain the SLO). With ``watch`` (for the trace's length), the run stops as soon
        as the requests settled so far decide whether the trace attains the watch's target (a request settles
        when it finishes, or misses once its first token or its last is later than its SLO allows). A trace
        with reuse (``ReuseRequest``) sends a conversation's later turns as the earlier ones end (no watch); one of
        ``SimRequest`` with their token ids (a production trace's, ``SimRequest.prompt_ids``) runs as given.
        ``wall_deadline`` (a ``time.perf_counter()`` value) bounds the run's own wall time: past it, the run
        stops where it stands (requests in flight unfinished, an undecided watch's verdict not met)."""
        if trace and isinstance(trace[0], ReuseRequest):
            if watch is not None:
                raise ValueError("watch: not supported on a trace with reuse (its later turns' arrivals are not "
                                 "known in advance)")
            reqs = reuse_requests(trace)
        elif trace and isinstance(trace[0], SimRequest):
            reqs = list(trace)
        else:
            reqs = [SimRequest(i, r.arrival_s, r.prompt_tokens, r.output_tokens) for i, r in enumerate(trace)]
            if self.config.prefix_caching is not None:
                distinct_requests(reqs)  # the caches are simulated: what the trace says is cached is not used
            else:
                for req, r in zip(reqs, trace):
                    req.cached_tokens = min(r.cached_tokens, r.prompt_tokens - 1)
        self._requests = reqs
        if watch is not None and watch.requests != len(reqs):
            raise ValueError(f"watch: made for {watch.requests} requests, the trace has {len(reqs)}")
        self.watch = watch
        for req in reqs:
            if math.isnan(req.arrival_s):
                continue  # a conversation's later turn: sent when the turn before it ends
            self.at(req.arrival_s, lambda req=req: self._arrive(req))
            if watch is not None and watch.checks_ttft:
                self.at(req.arrival_s + watch.ttft_slo_s - self.client_delay_s + DEADLINE_MARGIN_S,
                        lambda req=req: math.isnan(req.first_token_s) and watch.miss(req.index, ttft=True))
        self.open_requests = len(reqs)
        if self.migration is not None:
            self.migration.start()
        arrivals = [r.arrival_s for r in reqs if not math.isnan(r.arrival_s)]
        end = (max(arrivals) + time_limit_s) if (arrivals and time_limit_s is not None) else math.inf
        events = 0
        while self._events and self._events[0][0] <= end and (watch is None or watch.verdict is None):
            t, _, fn = heapq.heappop(self._events)
            self.now = t
            fn()
            events += 1
            if wall_deadline is not None and not events % 1024 and time.perf_counter() > wall_deadline:
                break  # out of time: what settled so far is the result
        duration = self.now
        instances = self.instances
        k_counts: dict[int, int] = {}
        for d in self.decode:
            for k, n in d.k_counts.items():
                k_counts[k] = k_counts.get(k, 0) + n
        delay = self.client_delay_s
        verdict = None
        if watch is not None:
            verdict = watch.verdict if watch.verdict is not None else watch.hits / watch.requests >= watch.target
        return SimResult(
            [SimRecord(r.index, r.arrival_s, r.prompt_tokens, r.output_tokens, r.generated,
                       r.first_token_s + delay, r.finish_s + delay, r.draft_tokens, r.accepted_tokens, r.preemptions)
             for r in reqs],
            duration, {i.name: (i.busy_s / duration if duration > 0 else 0.0) for i in instances}, k_counts,
            None if self.migration is None else self.migration.stats, verdict, self.device_seconds(duration),
            dict(self.load_aware_counts) if self.config.load_aware is not None else None)

    # -- the router ------------------------------------------------------------------------------------

    def _arrive(self, req: SimRequest) -> None:
        if self._in_flight >= self.config.max_concurrent:
            self._queue.append(req)
            return
        self._in_flight += 1
        self._place(req)

    def _place(self, req: SimRequest) -> None:
        if self.config.mode == "colocated":
            inst = cheapest_for(self, req, self.colocated)
            self._assign(req, inst)
            inst.add(req)
            return
        if self._unplaced:  # FIFO behind requests already waiting for decode memory
            self._unplaced.append(req)
            self.compute_ahead()
            return
        first = decode_order(self, req)[0]  # the router's first try
        routing = self.config.prefix_caching
        cached = first.cached(req, routing.tier_load_cost).tokens if routing is not None else 0
        if routing is not None and 0 < cached and req.prompt_tokens - cached <= routing.local_prefill_tokens \
                and first.hold_prefill(req):  # prefilled there, from its cache: no prefill instance
            self._assign(req, first)
            return
        if not self.prefill:  # the prefill pool is empty: decode instances prefill every prompt
            if not hold_on_decode(self, req):
                self._unplaced.append(req)
            return
        if self.config.load_aware is not None and prefill_on_decode(self, req):
            return
        if first.reserve(req, kv_sent=True):
            # contacted together with a prefill instance: prefill starts now, and the hold (answered between
            # decode steps) is in place before the KV can land, which joins the batch at a step boundary anyway
            self._start(req, first)
        elif first.busy:
            # decode first: each hold is a call into the decode worker, answered between steps
            # (controller/step_gate.py); the prompt reaches a prefill instance once one holds it
            first.after_step(lambda: self._reserve_or_queue(req))
        else:
            self._reserve_or_queue(req)

    def _place_again(self, req: SimRequest) -> None:
        """A draining instance handed ``req`` back, freed there: it leaves the instances that held it (its
        reservation on a decode instance freed) and is placed as a new arrival is (``Recovery.handed_back``)."""
        if req.decode is not None and req.index in req.decode.seqs:
            req.decode.release(req)
        for inst in req.placed:
            inst.assigned.discard(req.index)
        req.placed.clear()
        req.decode = None
        self._place(req)

    def _reserve_or_queue(self, req: SimRequest) -> None:
        if self._unplaced or not self._reserve(req):
            self._unplaced.append(req)
            self.compute_ahead()

    def compute_ahead(self) -> None:
        """Prefill ahead for the requests waiting for decode room (``planner/sim_ahead.py``)."""
        compute_ahead(self, self._unplaced)

    def _place_unplaced(self) -> None:
        while self._unplaced and self._reserve(self._unplaced[0]):
            self._unplaced.popleft()

    def _reserve(self, req: SimRequest) -> bool:
        if not self.prefill:
            return hold_on_decode(self, req)
        for d in decode_order(self, req):
            if d.reserve(req, kv_sent=True):
                self._start(req, d)
                return True
        return False

    def _start(self, req: SimRequest, decode: DecodeSim) -> None:
        """``decode`` holds the request: it goes to the prefill instance with the fewest assigned requests."""
        req.decode = decode
        self._assign(req, decode)
        p = cheapest_for(self, req, self.prefill)
        self._assign(req, p)
        p.add(req)

    @staticmethod
    def _assign(req: SimRequest, inst) -> None:
        inst.assigned.add(req.index)
        req.placed.append(inst)

    def on_first_token(self, req: SimRequest, t: float) -> None:
        req.first_token_s = t
        watch = self.watch
        if watch is not None and watch.checks_tpot and req.output_tokens > 1:
            self.at(t + watch.tpot_slo_s * (req.output_tokens - 1) + DEADLINE_MARGIN_S,
                    lambda: math.isnan(req.finish_s) and watch.miss(req.index, tpot=True))
        if self.config.mode == "disaggregated":
            req.generated = 1
            if req.remaining <= 0:  # single-token request: done at prefill, its reservation freed
                req.decode.release(req)
                self.on_finish(req, t)

    def on_kv_ready(self, req: SimRequest) -> None:
        if not math.isnan(req.finish_s):
            return
        start = self.calibration.decode_start_s  # acknowledgement, router admit call, next decode-loop turn
        if start > 0:
            self.at(self.now + start, lambda: req.decode.admit(req))
        else:
            req.decode.admit(req)

    def on_finish(self, req: SimRequest, t: float) -> None:
        req.finish_s = t
        if self.watch is not None:  # as SimRecord.ttft_s / tpot_s
            tpot = (t - req.first_token_s) / (req.generated - 1) if req.generated > 1 else 0.0
            ttft = req.first_token_s + self.client_delay_s - req.arrival_s
            self.watch.finished(req.index, ttft, tpot)
        self.open_requests -= 1
        for inst in req.placed:
            inst.assigned.discard(req.index)
        self._in_flight -= 1
        nxt = req.next_turn
        if nxt is not None:  # the client reads the last token, thinks, and sends the conversation's next turn
            nxt.arrival_s = t + self.client_delay_s + nxt.think_s
            self.at(nxt.arrival_s, lambda: self._arrive(nxt))
        self._place_unplaced()
        while self._queue and self._in_flight < self.config.max_concurrent:
            self._in_flight += 1
            self._place(self._queue.popleft())


def simulate(profile: Profile, config: SimConfig, trace: list[RequestSpec], seed: int = 0,
             time_limit_s: float | None = None, host_contention: HostContention | None = None,
             decode_profile: Profile | None = None, watch: AttainmentWatch | None = None,
             wall_deadline: float | None = None) -> SimResult:
    """Convenience: one fresh :class:`Simulation` over ``trace`` (``host_contention``: the optional plug-in;
    ``decode_profile``: the decode pool's hardware where it differs from the prefill pool's; ``watch``: stop
    once the trace's attainment of its target is decided; ``wall_deadline``: stop by then, see
    ``Simulation.run``)."""
    return Simulation(profile, config, seed, host_contention, decode_profile).run(trace, time_limit_s, watch,
                                                                                 wall_deadline)

