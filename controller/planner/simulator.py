"""Discrete-event simulator of a magicserve cluster: per-request TTFT and TPOT for a trace, from a
profile's cost models, without running the model.

What it models (and mirrors from the real router, ``controller/router.py``):

    arrival -> admission (at most ``max_concurrent`` in flight, FIFO queue beyond)
            -> disaggregated: KV reservation (prompt + 1 tokens) on the decode instance with the fewest
               assigned requests that has room (else wait until memory frees), answered when that
               instance's step in progress ends (a call into a busy worker), prefill on the prefill
               instance with the fewest assigned requests, KV streamed chunk by chunk, admission into
               the decode batch at a step boundary, speculative decode steps
            -> colocated: the instance with the fewest assigned requests runs chunked prefill and decode
               in the same steps (the reference engine)
            -> finish: the request's slot and memory free, the next queued request is admitted

Instance behaviour lives in ``sim_instances``. The serving path's own costs (Ray and gRPC hops, worker
loops, the workers sharing memory bandwidth) enter through the profile's calibration of the mode
(``calibrate.py``): a request-path delay, scales on prefill and decode step times, a delay before a
transferred request joins the decode batch, and a contention factor on the steps of an instance while
others are busy (instances sharing one machine's cores and memory bandwidth). On a CPU, a prefill and a
decode instance whose threads outnumber the cores (``SimConfig.shared_cores``) run their steps at the
profile's measured core-sharing slowdown while both are busy (``sim_instances.CoreShareGroup``). Not
modelled: failures and retries.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from controller.planner.profile import Profile, calibration_threads
from controller.planner.sim_instances import ColocatedSim, CoreShareGroup, DecodeSim, PrefillSim, SimRequest
from controller.planner.slo import RequestOutcome
from controller.planner.workload import RequestSpec
from decode_worker.config import SpeculationConfig

if TYPE_CHECKING:
    from controller.planner.load_speed import SpeedTimeline

MODES = ("disaggregated", "colocated")


class SimConfigError(ValueError):
    pass


@dataclass(frozen=True)
class PoolPlan:
    """One pool: ``instances`` instances of ``tensor_parallel`` x ``pipeline_parallel`` devices each."""

    instances: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    kv_cache_tokens: int = 65536  # per instance
    token_budget: int = 512  # prefill / colocated: tokens per step
    max_num_seqs: int = 64
    # prefill sharing cores (SimConfig.shared_cores): threads of a step started while decode is busy (0: all)
    threads_when_decode_busy: int = 0

    @property
    def devices(self) -> int:
        return self.instances * self.tensor_parallel * self.pipeline_parallel

    def validate(self, name: str) -> None:
        for f in ("instances", "tensor_parallel", "pipeline_parallel", "kv_cache_tokens", "token_budget", "max_num_seqs"):
            if getattr(self, f) < 1:
                raise SimConfigError(f"{name}.{f}: must be >= 1, got {getattr(self, f)}")
        if not 0 <= self.threads_when_decode_busy <= self.tensor_parallel:
            raise SimConfigError(f"{name}.threads_when_decode_busy: must be in [0, tensor_parallel "
                                 f"({self.tensor_parallel})], got {self.threads_when_decode_busy}")


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
    # CPU: the cores one prefill and one decode instance share when their threads (tensor_parallel) outnumber
    # them (the profile's ``CoreSharing`` for the pair times their steps); 0: every instance has devices of its own
    shared_cores: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SimConfigError(f"mode: must be one of {list(MODES)}, got {self.mode!r}")
        pools = ("prefill", "decode") if self.mode == "disaggregated" else ("colocated",)
        for name in pools:
            pool = getattr(self, name)
            if pool is None:
                raise SimConfigError(f"{name}: required in {self.mode} mode")
            pool.validate(name)
        if self.max_concurrent < 1:
            raise SimConfigError(f"max_concurrent: must be >= 1, got {self.max_concurrent}")
        if self.shared_cores:
            self._validate_shared_cores()

    def _validate_shared_cores(self) -> None:
        p, d, cores = self.prefill, self.decode, self.shared_cores
        if self.mode != "disaggregated" or cores < 1:
            raise SimConfigError(f"shared_cores: a disaggregated configuration's cores (>= 1), got {cores} in "
                                 f"{self.mode} mode")
        if (p.instances, d.instances, p.pipeline_parallel, d.pipeline_parallel) != (1, 1, 1, 1):
            raise SimConfigError("shared_cores: one prefill and one decode instance without pipeline parallelism "
                                 f"(the measured arrangement), got {p.instances} prefill x pp{p.pipeline_parallel} and "
                                 f"{d.instances} decode x pp{d.pipeline_parallel}")
        if max(p.tensor_parallel, d.tensor_parallel) > cores or p.tensor_parallel + d.tensor_parallel <= cores:
            raise SimConfigError(f"shared_cores: {cores} cores for {p.tensor_parallel} prefill + {d.tensor_parallel} "
                                 "decode threads; sharing means more threads than cores, and none more than all of them")

    @property
    def devices(self) -> int:
        """Devices (GPUs, or worker threads on CPU) the configuration uses."""
        if self.mode == "colocated":
            return self.colocated.devices
        if self.shared_cores:
            return self.shared_cores
        return self.prefill.devices + self.decode.devices

    def calibration_threads(self) -> int:
        """The thread count whose calibration the simulation takes (``profile.calibration_threads``)."""
        tps = ({"colocated": self.colocated.tensor_parallel} if self.mode == "colocated" else
               {"prefill": self.prefill.tensor_parallel, "decode": self.decode.tensor_parallel})
        return calibration_threads(tps)

    @staticmethod
    def from_cluster_config(cfg, cores: int | None = None) -> "SimConfig":
        """The simulation of a ``controller.config.ClusterConfig``. A CPU instance's threads are its
        ``tensor_parallel`` devices, as ``plan_output`` writes a CPU plan (so per-device goodput is per-core
        goodput there, and a profile must hold costs measured at that many threads). ``cores``: the CPU
        machine's cores; a CPU disaggregated config whose threads outnumber them shares them (``shared_cores``)."""

        def pool(section, budget: int, seqs: int) -> PoolPlan:
            if not section.devices_per_instance:
                return PoolPlan(section.instances, section.threads, 1, section.kv_cache_tokens, budget, seqs)
            tp = section.tensor_parallel
            return PoolPlan(section.instances, tp, max(1, section.devices_per_instance // tp), section.kv_cache_tokens,
                            budget, seqs)

        common = dict(block_size=cfg.decode.block_size, max_concurrent=cfg.limits.max_concurrent_requests)
        if getattr(cfg, "mode", "disaggregated") == "colocated":
            c = cfg.colocated
            return SimConfig("colocated", colocated=pool(c, c.chunk_tokens, c.max_num_seqs), **common)
        prefill = dataclasses.replace(pool(cfg.prefill, cfg.prefill.chunk_tokens, cfg.prefill.max_batch_prompts),
                                      threads_when_decode_busy=cfg.prefill.threads_when_decode_busy)
        decode = pool(cfg.decode, 1, cfg.decode.max_num_seqs)
        cpu = not cfg.prefill.devices_per_instance and not cfg.decode.devices_per_instance
        shared = cores if cpu and cores and prefill.devices + decode.devices > cores else 0
        return SimConfig("disaggregated", prefill=prefill, decode=decode, speculation=cfg.decode.speculation,
                         shared_cores=shared, **common)


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

    def outcomes(self) -> list[RequestOutcome]:
        return [r.outcome() for r in self.records]


class Simulation:
    """One run of one configuration over one trace. ``run`` may be called once."""

    def __init__(self, profile: Profile, config: SimConfig, seed: int = 0, speed: SpeedTimeline | None = None):
        self.profile = profile
        self.config = config
        self.speed = speed  # the machine's speed through the run, relative to ``profile`` (None: constant)
        self.now = 0.0
        self._events: list = []
        self._order = itertools.count()
        self._queue: deque[SimRequest] = deque()  # admitted later (concurrency limit)
        self._unplaced: deque[SimRequest] = deque()  # admitted, waiting for decode KV room
        self._in_flight = 0
        # serving-path terms of the mode at the instances' thread count (identity if unmeasured)
        self.calibration = profile.calibration(config.mode, config.calibration_threads())
        rng = random.Random(seed)
        self.noise_rng = random.Random(seed + 104729)  # step-time spread: its own stream, apart from acceptance
        c, bs = config, config.block_size
        if c.mode == "colocated":
            p = c.colocated
            self.colocated = [ColocatedSim(self, f"colocated-{i}", profile, p.tensor_parallel, p.pipeline_parallel,
                                           p.kv_cache_tokens, bs, p.token_budget, p.max_num_seqs)
                              for i in range(p.instances)]
            self.prefill, self.decode = [], []
        else:
            p, d = c.prefill, c.decode
            busy_threads = p.threads_when_decode_busy if c.shared_cores else 0  # yielding matters only there
            self.prefill = [PrefillSim(self, f"prefill-{i}", profile, p.tensor_parallel, p.pipeline_parallel,
                                       p.kv_cache_tokens, bs, p.token_budget, p.max_num_seqs, busy_threads)
                            for i in range(p.instances)]
            self.decode = [DecodeSim(self, f"decode-{i}", profile, d.tensor_parallel, d.pipeline_parallel,
                                     d.kv_cache_tokens, bs, d.max_num_seqs, c.speculation, random.Random(rng.random()))
                           for i in range(d.instances)]
            self.colocated = []
            if c.shared_cores:
                fewer = p.threads_when_decode_busy  # the yielded pair shares the cores only if it outnumbers them
                yielded = profile.sharing(fewer, d.tensor_parallel) if fewer and fewer + d.tensor_parallel > c.shared_cores else None
                sharing = profile.sharing(p.tensor_parallel, d.tensor_parallel)
                CoreShareGroup(self, sharing, self.prefill + self.decode, yielded)
                for inst in self.prefill:
                    inst.place_scale = sharing.prefill_scale
        self.instances = self.prefill + self.decode + self.colocated

    # -- the event loop ------------------------------------------------------------------------------

    def at(self, t: float, fn) -> None:
        heapq.heappush(self._events, (t, next(self._order), fn))

    def run(self, trace: list[RequestSpec], time_limit_s: float | None = None) -> SimResult:
        """Simulate ``trace``; requests unfinished at ``time_limit_s`` after the last arrival count as
        unfinished (they never attain the SLO)."""
        reqs = [SimRequest(i, r.arrival_s, r.prompt_tokens, r.output_tokens) for i, r in enumerate(trace)]
        for req in reqs:
            self.at(req.arrival_s, lambda req=req: self._arrive(req))
        end = (max(r.arrival_s for r in reqs) + time_limit_s) if (reqs and time_limit_s is not None) else math.inf
        while self._events and self._events[0][0] <= end:
            t, _, fn = heapq.heappop(self._events)
            self.now = t
            fn()
        duration = self.now
        instances = self.instances
        k_counts: dict[int, int] = {}
        for d in self.decode:
            for k, n in d.k_counts.items():
                k_counts[k] = k_counts.get(k, 0) + n
        # what the client sees: every token later by the request path's latency (routing before prefill,
        # delivery after each step), which moves TTFT but not the gaps between tokens
        delay = self.config.overhead_s + self.calibration.ttft_overhead_s
        return SimResult(
            [SimRecord(r.index, r.arrival_s, r.prompt_tokens, r.output_tokens, r.generated,
                       r.first_token_s + delay, r.finish_s + delay, r.draft_tokens, r.accepted_tokens, r.preemptions)
             for r in reqs],
            duration, {i.name: (i.busy_s / duration if duration > 0 else 0.0) for i in instances}, k_counts)

    # -- the router ------------------------------------------------------------------------------------

    def _arrive(self, req: SimRequest) -> None:
        if self._in_flight >= self.config.max_concurrent:
            self._queue.append(req)
            return
        self._in_flight += 1
        self._place(req)

    def _place(self, req: SimRequest) -> None:
        if self.config.mode == "colocated":
            inst = min(self.colocated, key=lambda i: len(i.assigned))
            self._assign(req, inst)
            inst.add(req)
            return
        if self._unplaced:  # FIFO behind requests already waiting for decode memory
            self._unplaced.append(req)
            return
        first = min(self.decode, key=lambda i: len(i.assigned))  # the router's first try
        if first.busy:
            # the reservation is a call into the decode worker, which answers it between steps
            # (controller/step_gate.py): the prompt reaches a prefill instance once this step ends
            first.after_step(lambda: self._reserve_or_queue(req))
        else:
            self._reserve_or_queue(req)

    def _reserve_or_queue(self, req: SimRequest) -> None:
        if self._unplaced or not self._reserve(req):
            self._unplaced.append(req)

    def _reserve(self, req: SimRequest) -> bool:
        for d in sorted(self.decode, key=lambda i: len(i.assigned)):
            if d.reserve(req):
                req.decode = d
                self._assign(req, d)
                p = min(self.prefill, key=lambda i: len(i.assigned))
                self._assign(req, p)
                p.add(req)
                return True
        return False

    @staticmethod
    def _assign(req: SimRequest, inst) -> None:
        inst.assigned.add(req.index)
        req.placed.append(inst)

    def on_first_token(self, req: SimRequest, t: float) -> None:
        req.first_token_s = t
        if self.config.mode == "disaggregated":
            req.generated = 1
            if req.remaining <= 0:  # single-token request: done at prefill, its reservation freed
                req.decode.release(req)
                self.on_finish(req, t)

    def on_kv_ready(self, req: SimRequest) -> None:
        req.kv_ready_s = self.now
        if not math.isnan(req.finish_s):
            return
        start = self.calibration.decode_start_s  # acknowledgement, router admit call, next decode-loop turn
        if start > 0:
            self.at(self.now + start, lambda: req.decode.admit(req))
        else:
            req.decode.admit(req)

    def on_finish(self, req: SimRequest, t: float) -> None:
        req.finish_s = t
        for inst in req.placed:
            inst.assigned.discard(req.index)
        self._in_flight -= 1
        while self._unplaced and self._reserve(self._unplaced[0]):
            self._unplaced.popleft()
        while self._queue and self._in_flight < self.config.max_concurrent:
            self._in_flight += 1
            self._place(self._queue.popleft())


def simulate(profile: Profile, config: SimConfig, trace: list[RequestSpec], seed: int = 0,
             time_limit_s: float | None = None, speed: SpeedTimeline | None = None) -> SimResult:
    """Convenience: one fresh :class:`Simulation` over ``trace``; ``speed``: the machine's speed through
    the run relative to ``profile`` (``load_speed.speed_timeline``), each step scaled by its role's factor
    when it starts."""
    return Simulation(profile, config, seed, speed).run(trace, time_limit_s)

