"""Instance models of the cluster simulator: what one prefill, decode or colocated instance does each
step, and how long the step takes.

Scheduling decisions come from the real schedulers, run on plain objects (``SimSequence`` stands where a
``modeling.sequence.Sequence`` does, over a ``CountingBlockPool``, the real pool counting blocks without naming them):

* prefill: ``prefill_worker.scheduler.PrefillScheduler`` (a token budget per step, prompts mid-prefill first,
  a prompt holds its blocks until its KV transfer is acknowledged). KV streams chunk by chunk over a
  channel per (prefill, decode) pair, serialised on that channel.
* colocated: ``modeling.scheduler.ChunkedPrefillScheduler`` (the reference engine: decode tokens first, then
  prefill chunks, under one token budget per step, in one forward pass; preemption by recompute).
* decode: ``decode_worker.scheduler.DecodeScheduler`` (reservation of prompt + 1 tokens before prefill, blocks
  for len + k per sequence each step, k lowered to 0 and then the newest sequences preempted when memory
  runs short, the preempted resumed first in first out), admission at step boundaries once the KV is
  complete, k chosen by the configured policy (the real ``AdaptiveK`` over the profile's cost models),
  acceptance sampled per sequence from the profile's measured rates.

Step times come from one interface, ``StepCosts``: the profile's fitted cost of the step's passes times the
mode's calibration (``profile.Calibration``); the simulation may multiply each step by a plug-in's factor
(``Simulation.step_factor``: host contention, off by default).

Prefix caching (``SimConfig.prefix_caching``): the instances run the real block pool and prefix cache
(``modeling/prefix_cache.py``) over the requests' token ids (synthetic ones: ``planner/sim_reuse.py``), so a
prompt starts from its longest cached prefix on every pool, a decode instance keeps finished requests' KV, a
transfer carries only what the decode instance lacks, and a decode instance prefills a request itself when
it holds all of it but a short suffix (``DecodeSim.hold_prefill``).

Times are seconds of simulated time. No torch, no real work: each step is one event.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from controller.kv_index import NOTHING, Cached
from controller.migration_policy import InstanceLoad, RequestLoad
from decode_worker.config import SpeculationConfig
from controller.load_aware import PrefillRate
from decode_worker.policy import AcceptanceEstimator, AdaptiveK, PassShape, StepK
from decode_worker.prefill_budget import PROBE_TOKENS, Pace, PrefillBudget
from decode_worker.scheduler import DecodeScheduler
from modeling.block_pool import BlockPool, BlockTable
from modeling.errors import OutOfBlocksError
from modeling.prefix_cache import CachedPrompt, PrefixCache
from planner.sim_tiers import SimTiers
from modeling.prefix_hash import block_hashes
from modeling.scheduler import ChunkedPrefillScheduler, ScheduledChunk, SchedulerLimits
from modeling.sequence import FinishReason, SequenceStatus
from planner.profile import (Calibration, FittedModel, Profile, mixed_pass_seconds, prefill_features,
                             shared_pass_s)
from prefill_worker.scheduler import PrefillScheduler


@dataclass(eq=False)  # identity: requests are looked up in lists by object
class SimRequest:
    """One request as it moves through the simulated cluster."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    generated: int = 0  # output tokens produced (the first one comes from prefill)
    first_token_s: float = math.nan
    finish_s: float = math.nan
    prefill_latency_s: float = 0.0  # TTFT latency beyond the prefill worker's busy time (Calibration)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_rejections: int = 0  # speculative steps that rejected a draft
    preemptions: int = 0
    placed: list = field(default_factory=list)  # instances whose ``assigned`` holds this request
    decode: "DecodeSim | None" = None  # disaggregated: the decode instance holding its KV reservation
    # with prefix caching: the token ids of the prompt and of the output the model will produce (synthetic)
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None
    next_turn: "SimRequest | None" = None  # multi_turn: sent ``next_turn.think_s`` after this one ends
    think_s: float = 0.0
    hashes: dict = field(default_factory=dict)  # block size -> the prompt's block hashes (cache lookups)
    decode_cached: int = 0  # prompt tokens its decode instance held cached when it took the request
    cached_tokens: int = 0  # prompt tokens its prefill instance holds cached (the trace says; not computed)
    ahead_on: str = ""  # the prefill instance given its prompt to compute ahead while it waited for decode room
    found_ahead: CachedPrompt | None = None  # what that pass found of the prompt cached there
    late: bool = False  # its prompt misses the TTFT SLO wherever it goes: computed in a late lane (load_aware)

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        return self.output_tokens - self.generated


class CountingBlockPool(BlockPool):
    """The real schedulers' block pool as the simulator runs it: blocks are counted, not named. The schedulers'
    decisions depend on how many blocks are free, never on which, so every block id is 0 and a free returns
    its count (no block is shared in simulation). A sequence's blocks cost O(1) to take and to return, not the
    real pool's lowest-id-first bookkeeping per block (which dominated long-context simulations)."""

    def __init__(self, num_blocks: int, block_size: int):  # no per-block state
        self._check_size(num_blocks, block_size)
        self.num_blocks, self.block_size, self._num_free = num_blocks, block_size, num_blocks

    def refcount(self, block: int) -> int:
        raise NotImplementedError("the simulator names no blocks")

    def allocate(self, num_blocks: int, after: int | None = None) -> list[int]:
        if num_blocks < 0:
            raise ValueError(f"num_blocks: must be >= 0, got {num_blocks}")
        if num_blocks > self._num_free:
            raise OutOfBlocksError(f"need {num_blocks} KV blocks, {self._num_free} free of {self.num_blocks}")
        self._num_free -= num_blocks
        return [0] * num_blocks

    def free(self, blocks: list[int]) -> None:
        if self._num_free + len(blocks) > self.num_blocks:
            raise ValueError("blocks freed more often than allocated")
        self._num_free += len(blocks)

    def incref(self, blocks: list[int]) -> None:
        raise NotImplementedError("the simulator shares no blocks")


class SimSequence:
    """A request on one instance as the real schedulers see a ``Sequence``: its token count, computed
    tokens, block table and status; with prefix caching, its token ids too (the simulator never runs the
    model: they only identify the KV)."""

    ahead = False  # a pass computing the prompt's full blocks ahead (``PrefillSim.add_ahead``)
    late = False  # prefilled on a decode instance past its TTFT SLO (``LocalPrefill.late``)

    def __init__(self, req: SimRequest, block_size: int):
        self.req = req
        self.request_id = str(req.index)
        self.num_prompt = req.prompt_tokens
        self.num_tokens = req.prompt_tokens  # prompt + tokens sampled on this instance
        self.num_computed = 0
        self.block_table = BlockTable(block_size)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.prompt_ids = req.prompt_ids
        self.tokens = None if req.prompt_ids is None else list(req.prompt_ids)
        self.steps_here = 0  # decode steps on this instance, and the tokens they gave (its pace's tokens per step)
        self.tokens_here = 0

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def sync_tokens(self) -> None:
        """Extend ``tokens`` (where kept) to the ``num_tokens`` the sequence has now."""
        if self.tokens is not None and len(self.tokens) < self.num_tokens:
            done = len(self.tokens) - self.num_prompt
            self.tokens.extend(self.req.output_ids[done:self.num_tokens - self.num_prompt])


SIM_SALT = b"simulated"


def pool_and_cache(capacity_tokens: int, block_size: int, caching: bool,
                   tiers: SimTiers | None = None) -> tuple[BlockPool, PrefixCache | None]:
    """An instance's block pool: the counting one, or with caching the real one and its prefix cache (over
    simulated tiers when ``tiers`` is given)."""
    if not caching:
        return CountingBlockPool(capacity_tokens // block_size, block_size), None
    pool = BlockPool(capacity_tokens // block_size, block_size)
    return pool, PrefixCache(pool, SIM_SALT, tiers=tiers)


def cached_prefix(pool: BlockPool, cache: PrefixCache | None, req: SimRequest, tier_load_cost: float) -> Cached:
    """What the instance holds of the prompt (all but the last token), as the router's index would see it: the
    run ``pool`` holds cached, then the run after it the cache's tiers hold."""
    if cache is None or req.prompt_ids is None:
        return NOTHING
    bs = pool.block_size
    hashes = req.hashes.get(bs)
    if hashes is None:
        hashes = req.hashes[bs] = block_hashes(req.prompt_ids[:-1], bs, SIM_SALT)
    in_pool = pool.cached_run(hashes)
    below = cache.tiers.find(hashes[in_pool:]) if cache.tiers is not None else 0
    return Cached(in_pool * bs, below * bs, (in_pool + below * (1.0 - tier_load_cost)) * bs)


class StepCosts:
    """The simulator's one step-time interface: a step's profiled cost x the mode's calibration."""

    def __init__(self, profile: Profile, calibration: Calibration, shape: tuple[int, int],
                 drafter: str | None = None):
        """``shape``: the instance's (tensor_parallel, threads)."""
        self.cal = calibration
        self.prefill = profile.costs(*shape).prefill  # None: a decode-only shape
        self.target = profile.target_model(*shape)
        self.draft = profile.draft_model(drafter, *shape) if drafter else None
        self._shared_pass_s = shared_pass_s(self.target, self.prefill)  # what a chunk riding in a pass saves

    def prefill_step(self, chunks: list[tuple[int, int]]) -> float:
        """A prefill step over (start, length) chunks: the time it holds the prefill worker."""
        return self.prefill.predict(prefill_features(chunks)) * self.cal.prefill_busy_scale

    def prefill_latency(self, start: int, length: int) -> float:
        """What the calibrated TTFT scale charges a chunk beyond the worker's busy time (request-path latency)."""
        extra = self.cal.prefill_scale - self.cal.prefill_busy_scale
        return extra * self.prefill.predict(prefill_features([(start, length)])) if extra > 0 else 0.0

    def decode_step(self, lens: list[int], k: int, budget: int) -> float:
        """A decode step over sequences of ``lens`` tokens: k draft passes over sink + window views of
        ``budget`` tokens and one verify pass of k + 1 new tokens each (k = 0: a plain decode pass)."""
        b, total = len(lens), sum(lens)
        seconds = self.target.predict_pass(PassShape(b, total + b * k, b * (k + 1))) * (
            self.cal.verify_pass_scale if k else 1.0)
        viewed = sum(min(n, budget) for n in lens) if k else 0  # draft step s reads viewed + b * (s + 1)
        for step in range(k):
            seconds += self.cal.draft_pass_scale * self.draft.predict_pass(PassShape(b, viewed + b * (step + 1), b))
        return seconds * self.cal.decode_scale

    def recompute(self, context: int) -> float:
        """Prefilling a preempted sequence's ``context`` tokens again on a decode instance."""
        return self.prefill_chunk(0, context)

    def prefill_chunk(self, start: int, length: int) -> float:
        """Prefilling positions ``start .. start + length`` of one sequence on a decode instance."""
        if self.prefill is not None:
            return self.prefill.predict(prefill_features([(start, length)]))
        return self.target.predict_pass(PassShape(1, start + length, length,
                                                  kv_queries=length * start + length * length // 2))

    def fused_prefill_chunk(self, start: int, length: int) -> float:
        """What prefilling positions ``start .. start + length`` adds to a decode instance's decode pass it
        rides in: the chunk's own pass less the fixed per-pass cost that pass already pays."""
        return max(0.0, self.prefill_chunk(start, length) - self._shared_pass_s)

    def mixed_step(self, chunks: list[tuple[int, int]], decode_kv_tokens: list[int]) -> float:
        """A colocated step: prefill chunks and decode tokens (each reading ``decode_kv_tokens`` positions) in
        one pass, the fixed per-pass cost counted once."""
        prefill = prefill_features(chunks) if chunks else None
        return mixed_pass_seconds(self.prefill, self.target, prefill, len(decode_kv_tokens), sum(decode_kv_tokens),
                                  self.cal.prefill_busy_scale, self.cal.decode_scale)


class _Instance:
    """Shared step loop: ``kick`` starts a step when idle and there is work; ``_plan_step`` returns
    (duration, completion callback) or None when nothing can run now."""

    role = ""
    prefix_cache: PrefixCache | None = None
    devices = 1  # devices the instance holds (its pool's tensor_parallel x threads; set by the simulation)
    loads_beside_pass = False  # tier loads written layer by layer beside the step's pass (``SimTierConfig.layered``)

    def __init__(self, sim, name: str):
        self.sim = sim
        self.name = name
        self.busy = False
        # devices held from ``allocated_s`` (the resize that added it, 0 for the starting shape) until
        # ``stopped_s`` (nan while it runs); a leaving instance takes no new requests
        self.allocated_s = sim.now
        self.stopped_s = math.nan
        self.leaving = False
        self.assigned: set[int] = set()
        self.steps = 0
        self.busy_s = 0.0
        self.step_s = 0.0  # duration of the step in progress (or of the last one)
        self.step_end_s = 0.0  # when the step in progress (or the last one) ends
        self.step_outputs = 1  # sequences the step in progress gives an output to
        self._calls: list = []  # run when the step in progress ends, before the next is planned

    def kick(self) -> None:
        if self.busy:
            return
        planned = self._plan_step()
        if planned is None:
            return
        duration, done = planned
        duration *= self.sim.step_factor(self, duration)
        if self.prefix_cache is not None and self.prefix_cache.tiers is not None:
            load_s = self.prefix_cache.tiers.take_load_seconds()  # on the worker's thread first, or beside the pass
            duration += max(0.0, load_s - duration) if self.loads_beside_pass else load_s
        self.step_s = duration
        self.busy = True
        self.steps += 1
        self.step_end_s = self.sim.now + duration
        self.busy_s += duration

        def finish() -> None:
            done()  # still busy: what the step's outputs set off (a request placed here) waits for the next step
            self.busy = False
            calls, self._calls = self._calls, []
            for call in calls:
                call()
            self.kick()

        self.sim.at(self.step_end_s, finish)

    def after_step(self, fn) -> None:
        """Run ``fn`` when the step in progress ends (a call into a busy worker is answered between steps)."""
        self.sim.at(self.step_end_s, fn)

    def between_steps(self, fn) -> None:
        """Run ``fn`` now if idle, else once the step in progress has ended and before the next one is planned
        (the worker's step gate: a call waiting when a step ends goes before the next step)."""
        if self.busy:
            self._calls.append(fn)
        else:
            fn()

    def cached(self, req: SimRequest, tier_load_cost: float = 0.0) -> Cached:
        """What this instance holds of ``req``'s prompt in its pool and its tiers (nothing without caching)."""
        return cached_prefix(self.scheduler.pool, self.prefix_cache, req, tier_load_cost)

    def _plan_step(self):
        raise NotImplementedError


class PrefillSim(_Instance):
    """A prefill instance: ``PrefillScheduler`` chooses each step's chunks; then the KV transfer."""

    role = "prefill"

    def __init__(self, sim, name: str, costs: StepCosts, transfer: FittedModel, capacity_tokens: int,
                 block_size: int, limits: SchedulerLimits, caching: bool = False, tiers: SimTiers | None = None):
        super().__init__(sim, name)
        self.costs = costs
        self.transfer = transfer
        self.block_size = block_size
        self.pool, self.prefix_cache = pool_and_cache(capacity_tokens, block_size, caching, tiers)
        self.loads_beside_pass = tiers is not None and tiers.config.layered
        self.scheduler = PrefillScheduler(limits, self.pool, self.prefix_cache)  # the worker's own scheduler
        self.channel_free_at: dict[str, float] = {}  # decode instance name -> when its channel is idle
        self.rate = PrefillRate()  # its measured speed, as the router keeps it (``controller/load_aware.py``)

    def queued_tokens(self, late: bool = True) -> int:
        """Prompt tokens placed here and not computed yet (``late`` False: of the prompts that are not late)."""
        return self.scheduler.queued_tokens(late)

    def add(self, req: SimRequest) -> None:
        if self.pool.blocks_for_tokens(req.prompt_tokens) > self.pool.num_blocks:
            raise ValueError(f"{self.name}: a {req.prompt_tokens}-token prompt does not fit in its KV cache "
                             f"({self.pool.num_blocks * self.block_size} tokens)")
        rid = str(req.index)
        if any(s.request_id == rid for s in [*self.scheduler.running_ahead, *self.scheduler.waiting_ahead]):
            req.found_ahead = self._found(rid)  # the request takes its pass ahead over
            self.scheduler.release(rid)
        seq = SimSequence(req, self.block_size)
        seq.num_computed = req.cached_tokens
        if req.found_ahead is not None and req.ahead_on == self.name:
            self.prefix_cache.found_before(rid, req.found_ahead)
        self.scheduler.add(seq, late=req.late)
        self.kick()

    def hand_back(self) -> list[SimRequest]:
        """Give up the prompts still waiting for their first step (``PrefillWorker.hand_back``), freed here."""
        reqs = [seq.req for seq in self.scheduler.waiting]
        for req in reqs:
            self.scheduler.release(str(req.index))
        return reqs

    def idle(self) -> bool:
        """Nothing queued or running here, not even a pass ahead, and in service."""
        s = self.scheduler
        return not (self.leaving or s.waiting or s.running or s.waiting_ahead or s.running_ahead)

    def add_ahead(self, req: SimRequest) -> bool:
        """Compute the full blocks of ``req``'s prompt but its last token ahead, and one token more
        (``PrefillRequest.ahead``, ``prefill_worker/worker.py``): False, nothing queued, when this instance holds
        all but its last block cached already, or keeps no cache."""
        bs = self.block_size
        end = (req.prompt_tokens - 1) // bs * bs + 1
        if self.prefix_cache is None or req.prompt_ids is None or end - 1 - self.cached(req).tokens < bs:
            return False
        seq = SimSequence(req, bs)
        seq.ahead = True
        seq.num_prompt = seq.num_tokens = end
        seq.prompt_ids, seq.tokens = req.prompt_ids[:end], list(req.prompt_ids[:end])
        req.ahead_on = self.name
        self.prefix_cache.count_apart(seq.request_id)
        self.scheduler.add(seq, ahead=True)
        self.kick()
        return True

    def _found(self, rid: str) -> CachedPrompt | None:
        """What a pass ahead found of its prompt (None: not looked up yet)."""
        return self.prefix_cache.found(rid) if self.prefix_cache.looked_up(rid) else None

    def _plan_step(self):
        chunks = self.scheduler.schedule()
        for seq, found in self.scheduler.take_dropped():
            seq.req.found_ahead = found
        if not chunks:
            return None
        for c in chunks:
            if not c.seq.ahead:
                c.seq.req.prefill_latency_s += self.costs.prefill_latency(c.start, c.num_tokens)
                c.seq.req.decode.kv_arriving(c.seq.req)
        self.step_outputs = len(chunks)
        return self.costs.prefill_step([(c.start, c.num_tokens) for c in chunks]), lambda: self._done(chunks)

    def _done(self, chunks: list[ScheduledChunk]) -> None:
        now = self.sim.now
        self.rate.observe(sum(c.num_tokens for c in chunks), self.step_s)
        for c in chunks:
            seq, req = c.seq, c.seq.req
            if seq.ahead and seq not in self.scheduler.running_ahead:
                continue  # taken over by its request while this step ran: what the step computed is not kept
            seq.num_computed += c.num_tokens
            if self.prefix_cache is not None:
                self.prefix_cache.commit(seq, seq.num_computed)
            if seq.ahead:
                if c.sample:  # its blocks are cached
                    req.found_ahead = self._found(seq.request_id)
                    self.scheduler.release(seq.request_id)
                continue
            dest = req.decode.name
            begin = max(now, self.channel_free_at.get(dest, 0.0))
            first = 0 if c.start == req.cached_tokens else c.start  # a cached prefix goes with the first chunk
            sent = max(0, c.start + c.num_tokens - max(first, req.decode_cached))  # the decode side's cache: skipped
            end = begin + self.transfer.predict({"passes": 1.0 if c.sample else 0.0, "tokens": float(sent)})
            self.channel_free_at[dest] = end
            if c.sample:
                self.scheduler.hand_off(seq)
                self.sim.on_first_token(req, now + req.prefill_latency_s)
                self.sim.at(end, lambda seq=seq: self._transferred(seq))
        self.sim.compute_ahead()

    def _transferred(self, seq: SimSequence) -> None:
        self.scheduler.release(seq.request_id)
        self.sim.on_kv_ready(seq.req)
        self.kick()


class _FittedCost:
    """A FittedModel behind the interface AdaptiveK expects from LinearCostModel."""

    ready = True

    def __init__(self, model: FittedModel, speculative_scale: float = 1.0):
        self.model = model
        self.speculative_scale = speculative_scale  # for passes of more than one new token per sequence

    def predict(self, shape: PassShape) -> float:
        scale = self.speculative_scale if shape.new_tokens > shape.seqs else 1.0
        return scale * self.model.predict_pass(shape)


def accepted_drafts(rng: random.Random, rate: float, k: int) -> int:
    """Drafts accepted out of k when each is accepted with probability ``rate`` until the first rejection."""
    n = 0
    while n < k and rng.random() < rate:
        n += 1
    return n


class DecodeSim(_Instance):
    """A decode instance: ``DecodeScheduler`` gives each step its batch, room for k and preemptions, as in
    the worker; one (speculative) step over the batch at a time."""

    role = "decode"

    def __init__(self, sim, name: str, profile: Profile, costs: StepCosts, capacity_tokens: int, block_size: int,
                 max_num_seqs: int, spec: SpeculationConfig, rng: random.Random, caching: bool = False,
                 prefill_chunk: int = 1024, tiers: SimTiers | None = None, prefill_tpot_slo_s: float | None = None):
        super().__init__(sim, name)
        self.profile = profile
        self.costs = costs
        self.block_size = block_size
        pool, self.prefix_cache = pool_and_cache(capacity_tokens, block_size, caching, tiers)
        self.scheduler = DecodeScheduler(pool, max_num_seqs, self.prefix_cache)
        self.prefill_chunk = prefill_chunk
        self.prefilling: deque[SimSequence] = deque()  # requests prefilled here (a cache hit, a prefill backlog)
        self._begun: set[int] = set()  # of them, those a step has computed a chunk of (by request index)
        self._loading: dict[str, float] = {}  # of them, those whose tier load runs beside the steps -> when it ends
        # the worker's own budget of local-prefill tokens per step, its cost model seeded as the start-up profile
        # seeds it (a few chunk sizes, here at a few contexts too: the simulated cost is exact)
        self.budget = PrefillBudget(prefill_chunk, prefill_tpot_slo_s)
        for start in (0, 2048, 8192):
            for n in sorted({min(prefill_chunk, PROBE_TOKENS), max(1, prefill_chunk // 4), prefill_chunk}):
                self.budget.observe_prefill(start, n, costs.prefill_chunk(start, n) * costs.cal.decode_scale)
        self._decode_s = self._planned_s = 0.0  # the decode pass of the step in progress, and the whole step
        self._prefilled: int | None = None  # its local-prefill tokens, begun with prompts queued (else None)
        self._paced: list[Pace] = []  # the running sequences' paces as it was planned
        self._spans: list[tuple[int, int]] = []  # its chunks, (start, tokens)
        self._chunk_s = 0.0  # their seconds
        self.spec = spec
        self.rng = rng
        self._rates: dict[int, float] = {}  # context bucket (64 tokens) -> acceptance rate
        if spec.enabled:
            self._rate(0)  # fail now, not mid-run, if the profile lacks it
        # the policy's acceptance belief: set to the profile's rates before every choice (``_choose_k``),
        # so the simulated verdicts are not fed back into it
        self.acceptance = AcceptanceEstimator()
        cal = costs.cal
        self.policy = (AdaptiveK(spec.max_k, _FittedCost(costs.target, cal.verify_pass_scale),
                                 _FittedCost(costs.draft, cal.draft_pass_scale), self.acceptance,
                                 spec.tpot_slo_ms / 1000 if spec.tpot_slo_ms else None, explore=False)
                       if spec.enabled and spec.k_policy == "adaptive" else None)
        self.step_k = StepK(spec, self.policy)
        self.seqs: dict[int, SimSequence] = {}  # request index -> its sequence here (reserved or live)
        self.ready: list[SimSequence] = []  # KV complete, joins at the next step
        self.arriving: set[int] = set()  # requests whose prefill instance began sending their KV, until it lands
        self.k_counts: dict[int, int] = {}

    def reserve(self, req: SimRequest, kv_sent: bool = False) -> bool:
        """Hold the request with blocks for its prompt and a step, from its cached prefix on; ``kv_sent``: the
        rest of its KV comes from a prefill instance (the tiers' blocks load meanwhile, beside the steps)."""
        seq = SimSequence(req, self.block_size)
        # as the worker admits: the cached prefix (pool, then tiers once the rest fits) in the one allocation
        cached_upto = req.prompt_tokens - 1 if self.prefix_cache is not None else None
        if not self.scheduler.reserve(seq, req.prompt_tokens, cached_upto=cached_upto, load_in_background=kv_sent):
            return False
        req.decode_cached = seq.num_computed
        self.seqs[req.index] = seq
        return True

    def hold_prefill(self, req: SimRequest, late: bool = False) -> bool:
        """Hold the request and prefill the rest of its prompt here (``DecodeWorker.add_prefill``; ``late``: after
        the queued prompts that are not): what the tiers hold of it loads beside the steps, and its first chunk
        waits for that."""
        if not self.reserve(req, kv_sent=True):
            return False
        req.decode = self
        seq = self.seqs[req.index]
        seq.late = late
        self.prefilling.append(seq)
        load_s = self.prefix_cache.tiers.background_seconds(seq.request_id) \
            if self.prefix_cache is not None and self.prefix_cache.tiers is not None else 0.0
        if load_s > 0:
            self._loading[seq.request_id] = self.sim.now + load_s
            self.sim.at(self.sim.now + load_s, self.kick)
        elif self.prefix_cache is not None:
            self.prefix_cache.finish_load(seq)
        self.kick()
        return True

    def hand_back(self) -> list[SimRequest]:
        """Give up the local prefills no step has begun (``DecodeWorker.hand_back``), freed here."""
        reqs = [seq.req for seq in self.prefilling if seq.req.index not in self._begun]
        for req in reqs:
            self.prefilling.remove(self.seqs[req.index])
            self.release(req)
        return reqs

    def prefill_queued_tokens(self) -> int:
        """Prompt tokens its local prefills have still to compute (``PoolLoad.prefill_queued_tokens``)."""
        return sum(seq.num_prompt - seq.num_computed for seq in self.prefilling)

    def prefill_tokens_per_s(self) -> float:
        """How fast its steps compute them now (``PoolLoad.prefill_tokens_per_s``)."""
        start = self.prefilling[0].num_computed if self.prefilling else 0
        return self.budget.tokens_per_s(start, self._decoding(), self.sim.now)

    def _decoding(self) -> bool:
        """Sequences decode here, or will as soon as their KV lands (``DecodeWorker.decoding``)."""
        return len(self.seqs) > len(self.prefilling)

    def load(self, moving: frozenset[int] | set[int] = frozenset()) -> InstanceLoad:
        """This instance as the rescheduling policy reads it, from the scheduler's report as the worker makes
        it (``DecodeScheduler.load``); requests in ``moving`` (migrating away) count as held."""
        report = self.scheduler.load(lambda seq: seq.req.index not in moving)
        running = tuple(RequestLoad(rid, blocks) for rid, blocks in report.running.items())
        return InstanceLoad(self.name, report.total_blocks, running, report.waiting_blocks, False, report.held_blocks)

    def kv_arriving(self, req: SimRequest) -> None:
        """The prefill instance began computing the request: its KV is on its way (``KVReceiver.arriving``)."""
        if req.index in self.seqs:
            self.arriving.add(req.index)

    def admit(self, req: SimRequest) -> None:
        self.arriving.discard(req.index)
        seq = self.seqs[req.index]
        if self.prefix_cache is not None:
            self.prefix_cache.finish_load(seq)  # its blocks from the tiers, cached in the pool from now on
        self.ready.append(seq)
        self.kick()

    def release(self, req: SimRequest) -> None:
        """Free the request's blocks (reserved or live)."""
        self.arriving.discard(req.index)
        self._begun.discard(req.index)
        self._loading.pop(str(req.index), None)
        self.scheduler.finish(self.seqs.pop(req.index))

    def _commit(self, seq: SimSequence, num_final: int) -> None:
        if self.prefix_cache is not None:
            seq.sync_tokens()
            self.prefix_cache.commit(seq, num_final)

    def _plan_step(self):
        for seq in self.ready:  # as the worker's step: arrived KV first, then the preempted that fit
            seq.num_computed = seq.num_tokens = seq.req.context
            self._commit(seq, seq.num_prompt)
            self.scheduler.start(seq)
        self.ready.clear()
        recompute_s = 0.0
        for seq in self.scheduler.resumable():  # from its cached prefix on, with caching
            recompute_s += self.costs.prefill_chunk(seq.num_computed, seq.num_tokens - seq.num_computed)
        batch, k = [], 0
        if self.scheduler.running:
            k, batch, preempted = self.scheduler.make_room(self._choose_k())
            for seq in preempted:
                seq.req.preemptions += 1
        # with a decode pass, the chunk rides in it (``DecodeWorker.step``); else it runs in a pass of its own
        prefill_s, prefilled = self._plan_prefill(fused=bool(batch))
        prefilling = self._prefilled  # a chunk of it is computed this step
        self._chunk_s = prefill_s * self.costs.cal.decode_scale
        if not batch and not prefilling:
            return None
        if batch:
            self.k_counts[k] = self.k_counts.get(k, 0) + 1
        self.step_outputs = len(batch) + len(prefilled)
        duration = (recompute_s + prefill_s) * self.costs.cal.decode_scale
        self._decode_s = self.costs.decode_step([seq.num_tokens for seq in batch], k, self.spec.budget) if batch else 0.0
        duration += self._decode_s
        self._planned_s = duration  # before a contention factor or tier loads stretch it (``kick``)
        return duration, lambda: self._done(batch, k, prefilled)

    def _plan_prefill(self, fused: bool) -> tuple[float, list[SimSequence]]:
        """This step's chunk of the requests prefilled here (what the budget allows beside the decoding batch,
        the fewest remaining tokens first): its time (``fused``: what it adds to the decode pass it rides in),
        and the requests whose prompt it completes (they sample their first token at its end)."""
        seconds, done = 0.0, []
        self._paced = self._paces() if self.budget.tpot_slo_s is not None else []
        self._prefilled = 0 if self.prefilling else None  # the step's local-prefill tokens, begun with a queue
        for seq in [s for s in self.prefilling if self._loading.get(s.request_id, math.inf) <= self.sim.now]:
            del self._loading[seq.request_id]
            self.prefix_cache.finish_load(seq)  # its blocks from the tiers are in (``PrefillQueue``)
        if len(self.prefilling) > 1:  # the fewest remaining tokens first, the late last, as the worker's queue
            self.prefilling = deque(sorted(self.prefilling,
                                           key=lambda seq: (seq.late, seq.num_prompt - seq.num_computed)))
        ready = [seq for seq in self.prefilling if seq.request_id not in self._loading]
        budget = 0
        if ready:
            arriving = ([self.seqs[i].req.output_tokens - 1 for i in self.arriving]
                        if self.budget.tpot_slo_s is not None else [])
            budget = self.budget.tokens(ready[0].num_computed, fused or self._decoding(), self._paced, arriving)
        self._spans = []
        for seq in ready:
            if budget <= 0:
                break
            n = min(seq.num_prompt - seq.num_computed, budget)
            self._spans.append((seq.num_computed, n))
            seconds += (self.costs.fused_prefill_chunk if fused else self.costs.prefill_chunk)(seq.num_computed, n)
            seq.num_computed += n
            budget -= n
            self._prefilled += n
            if seq.num_computed < seq.num_prompt:
                self._begun.add(seq.req.index)
                break
            self._begun.discard(seq.req.index)
            self.prefilling.remove(seq)
            done.append(seq)
        return seconds, done

    def _paces(self) -> list[Pace]:
        """The running sequences' time per output token so far (``DecodeWorker._paces``)."""
        now, paces = self.sim.now, []
        for seq in self.scheduler.running.values():
            req = seq.req
            started = not math.isnan(req.first_token_s)
            since_first, got = (now - req.first_token_s, req.generated - 1) if started else (0.0, 0)
            paces.append(Pace.measured(since_first, got, req.remaining, seq.steps_here, seq.tokens_here))
        return paces

    def _choose_k(self) -> int:
        """The worker's own decision (``StepK``), with the policy's acceptance belief set to the profile's
        rates at the batch's contexts and the self-sparse draft's view (sink + window) modelled."""
        lens = [seq.num_tokens for seq in self.scheduler.running.values()]
        if self.policy is not None:
            self.acceptance.rate = sum(self._rate(n) for n in lens) / len(lens)
        budget = self.spec.budget
        return self.step_k.choose(tuple(self.scheduler.running), lens, lambda n, step: min(n, budget) + step + 1)[0]

    def _rate(self, context: int) -> float:
        """The profile's acceptance rate at ``context``, looked up once per 64-token bucket."""
        bucket = context >> 6
        if bucket not in self._rates:
            self._rates[bucket] = self.profile.acceptance_rate(self.spec.drafter, self.spec.budget, bucket << 6)
        return self._rates[bucket]

    def _done(self, batch: list[SimSequence], k: int, prefilled: list[SimSequence] = ()) -> None:
        now = self.sim.now
        for seq in batch:  # nothing leaves the running batch between planning a step and its end
            req = seq.req
            accepted = 0
            if k > 0:
                accepted = accepted_drafts(self.rng, self._rate(req.context), k)
                req.draft_tokens += k
                req.accepted_tokens += accepted
                req.draft_rejections += accepted < k
            gained = min(accepted + 1, req.remaining)
            req.generated += gained
            seq.steps_here += 1
            seq.tokens_here += gained
            seq.num_computed = seq.num_tokens = req.context  # verified positions; the last token's KV comes next
            self._commit(seq, seq.num_computed)
            if req.remaining <= 0:
                self.release(req)
                self.sim.on_finish(req, now)
        if batch and self.budget.tpot_slo_s is not None:
            # the decode pass as measured: its planned share of the step as it ran
            self.budget.observe_step(self._decode_s * self.step_s / max(self._planned_s, 1e-12))
            # a sample of the local-prefill rate: this step's chunk as it ran, or the one its paces allowed
            stretch = self.step_s / max(self._planned_s, 1e-12)
            prefill_s = self._chunk_s * stretch
            if self._spans:  # what the chunk added to the decode pass, as the worker measures it
                self.budget.observe_fused(self._spans, prefill_s)
            start = self.prefilling[0].num_computed if self.prefilling else 0
            self.budget.observe_rate(now, self._decode_s * stretch, self._prefilled, prefill_s, start, self._paced)
        for seq in prefilled:  # their first token; they join the batch from the next step
            self._commit(seq, seq.num_prompt)
            self.sim.on_first_token(seq.req, now)
            if not math.isnan(seq.req.finish_s):
                continue
            self.ready.append(seq)


class ColocatedSim(_Instance):
    """The reference engine: ``ChunkedPrefillScheduler`` chooses each step's decode tokens and prefill chunks."""

    role = "colocated"

    def __init__(self, sim, name: str, costs: StepCosts, capacity_tokens: int, block_size: int,
                 limits: SchedulerLimits, caching: bool = False, tiers: SimTiers | None = None):
        super().__init__(sim, name)
        self.costs = costs
        self.block_size = block_size
        self.pool, self.prefix_cache = pool_and_cache(capacity_tokens, block_size, caching, tiers)
        self.scheduler = ChunkedPrefillScheduler(limits, self.pool, self.prefix_cache)  # the engine's own scheduler
        preempt = self.scheduler.preempt

        def preempt_and_count(seq: SimSequence) -> None:  # the scheduler's own preemption, counted per request
            preempt(seq)
            seq.req.preemptions += 1

        self.scheduler.preempt = preempt_and_count

    def add(self, req: SimRequest) -> None:
        self.scheduler.add(SimSequence(req, self.block_size))
        self.kick()

    def _plan_step(self):
        chunks = self.scheduler.schedule()
        if not chunks:
            return None
        # as the engine logs its pass: a one-token chunk of a generated token is a decode token
        decodes = [c.start + 1 for c in chunks if c.num_tokens == 1 and c.start >= c.seq.num_prompt]
        prefills = [(c.start, c.num_tokens) for c in chunks if not (c.num_tokens == 1 and c.start >= c.seq.num_prompt)]
        self.step_outputs = len(chunks)
        return self.costs.mixed_step(prefills, decodes), lambda: self._done(chunks)

    def _done(self, chunks: list[ScheduledChunk]) -> None:
        now = self.sim.now
        for c in chunks:  # as ReferenceEngine._process: computed tokens, then a token where the chunk samples
            seq, req = c.seq, c.seq.req
            seq.num_computed += c.num_tokens
            if self.prefix_cache is not None:
                seq.sync_tokens()
                self.prefix_cache.commit(seq, seq.num_computed)
            if not c.sample:
                continue
            seq.num_tokens += 1
            if req.generated == 0:
                self.sim.on_first_token(req, now)
            req.generated = seq.num_tokens - seq.num_prompt
            if req.remaining <= 0:
                self.scheduler.finish(seq, FinishReason.LENGTH)
                self.sim.on_finish(req, now)
