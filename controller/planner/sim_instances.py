"""Instance models of the cluster simulator: what one prefill, decode or colocated instance does each
step, and how long the step takes under the profile's cost models. They mirror the real schedulers:

* prefill (``prefill_worker/scheduler.py``): a token budget per step, prompts mid-prefill first, new
  prompts admitted while the budget, ``max_num_seqs`` and free blocks allow; a prompt holds its blocks
  until its KV transfer is acknowledged. KV streams chunk by chunk over a channel per (prefill, decode)
  pair, serialised on that channel.
* decode (``decode_worker/worker.py``): reservation of prompt + 1 tokens before prefill, admission at step
  boundaries once the KV is complete, k chosen by the configured policy (the real ``AdaptiveK`` over the
  profile's cost models), acceptance sampled per sequence from the profile's measured rates, blocks for
  len + k per sequence, k lowered to 0 and then the newest sequences preempted when memory runs short.
* colocated (``modeling/scheduler.py``, the reference engine): decode tokens first, then prefill chunks,
  under one token budget per step, in one forward pass.

A prefill and a decode instance sharing cores with more threads than cores (``CoreShareGroup``) progress
through their steps more slowly while the other role is busy, at the profile's measured factors.

Times are seconds of simulated time. No torch, no real work: each step is one event.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from controller.planner.profile import CoreSharing, FittedModel, Profile, mixed_pass_seconds, prefill_features
from decode_worker.config import SpeculationConfig
from decode_worker.policy import AcceptanceEstimator, AdaptiveK, PassShape


@dataclass(eq=False)  # identity: requests are looked up in lists by object
class SimRequest:
    """One request as it moves through the simulated cluster."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    computed: int = 0  # prompt tokens prefilled so far
    generated: int = 0  # output tokens produced (the first one comes from prefill)
    first_token_s: float = math.nan
    finish_s: float = math.nan
    kv_ready_s: float = math.nan
    prefill_latency_s: float = 0.0  # TTFT latency beyond the prefill worker's busy time (Calibration.prefill_pass_scale)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    preemptions: int = 0
    placed: list = field(default_factory=list)  # instances whose ``assigned`` holds this request
    decode: "DecodeSim | None" = None  # disaggregated: the decode instance holding its KV reservation

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        return self.output_tokens - self.generated


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class _Instance:
    """Shared step loop: ``kick`` starts a step when idle and there is work; ``_plan_step`` returns
    (duration, completion callback) or None when nothing can run now."""

    def __init__(self, sim, name: str, capacity_tokens: int, block_size: int):
        self.sim = sim
        self.name = name
        self.block_size = block_size
        self.total_blocks = capacity_tokens // block_size
        self.free_blocks = self.total_blocks
        self.busy = False
        self.assigned: set[int] = set()
        self.steps = 0
        self.busy_s = 0.0
        self.step_s = 0.0  # duration of the step in progress (or of the last one)
        self.step_end_s = 0.0  # when the step in progress (or the last one) ends
        self.step_outputs = 1  # sequences the step being planned / in progress gives an output to
        self.sharing: CoreShareGroup | None = None  # set when this instance shares cores with the other role
        self.step_start_s = 0.0
        self.work_left_s = 0.0  # sharing cores: the step's remaining time at its alone speed
        self.slowdown = 1.0  # sharing cores: the factor the step progresses at now
        self._generation = 0  # sharing cores: which scheduled end of the step is current
        self._step_waiters: list = []  # sharing cores: what runs when the step in progress ends

    def kick(self) -> None:
        if self.busy:
            return
        planned = self._plan_step()
        if planned is None:
            return
        duration, done = planned
        in_place = self.sharing is not None and self.sharing.sharing.measured_in_place  # contention inside it
        duration *= (1.0 if in_place else self._contention(duration)) * self._noise() * self._speed()
        self.step_s = duration
        self.busy = True
        self.steps += 1

        def finish() -> None:
            self.busy = False
            if self.sharing is not None:  # the others' steps speed up from now
                self.busy_s += self.sim.now - self.step_start_s
                self.sharing.stopped(self)
            done()
            self.kick()
            waiters, self._step_waiters = self._step_waiters, []
            for fn in waiters:
                fn()

        if self.sharing is None:
            self.step_end_s = self.sim.now + duration
            self.busy_s += duration
            self.sim.at(self.step_end_s, finish)
        else:
            self.step_start_s = self.sim.now
            self.sharing.started(self, duration, finish)

    def after_step(self, fn) -> None:
        """Run ``fn`` when the step in progress ends (a call into a busy worker is answered between steps)."""
        if self.sharing is None:
            self.sim.at(self.step_end_s, fn)
        else:
            self._step_waiters.append(fn)

    def _schedule_end(self, finish) -> None:
        """Sharing cores: (re)schedule the step's end from its remaining work at the current slowdown; an
        end scheduled before is dropped (its generation is no longer current)."""
        self._generation += 1
        generation = self._generation
        self.step_end_s = self.sim.now + self.work_left_s * self.slowdown

        def end() -> None:
            if generation == self._generation:
                finish()

        self.sim.at(self.step_end_s, end)

    def _plan_step(self):
        raise NotImplementedError

    def _noise(self) -> float:
        """This step's draw of the calibrated spread of step times about the fitted time (mean 1;
        ``Calibration.step_noise`` of this instance's role); 1 where none was measured."""
        quantiles = self.sim.calibration.step_noise.get(self.role)
        return self.sim.noise_rng.choice(quantiles) if quantiles else 1.0

    def _speed(self) -> float:
        """The machine's speed for this role as the step starts, relative to the profile (the simulation's
        ``speed`` timeline; 1 without one)."""
        timeline = self.sim.speed
        return 1.0 if timeline is None else timeline.factor(self.role, self.sim.now)

    def _contention(self, duration: float) -> float:
        """Step-time factor for what the other instances do as this step (of ``duration`` alone) starts;
        1 when no other instance is busy. Three calibrated terms (``Calibration``), each may be off:

        * ``contention_scale``: (scale - 1) x the share of the other instances that are busy;
        * ``contention_step_s``: every step of a worker sends its outputs through processes that share the
          cores (the router's poll, gRPC, the client); while another instance is busy no core is idle, so that
          work slows each busy instance by ``contention_step_s`` per step completed. The factor is
          1 + contention_step_s x (this step's rate, 1 / duration, plus the rate of each busy other
          instance, 1 / its current step's duration): many short steps (plain decode) slow a prefill
          instance more than fewer, longer ones (speculative steps), at the same busy share;
        * ``contention_output_s``: the same per sequence output (a step's batch; a prefill step's chunks):
          a decode step over many sequences streams many outputs."""
        cal = self.sim.calibration
        scale, per_step, per_output = cal.contention_scale, cal.contention_step_s, cal.contention_output_s
        if (scale == 1.0 and per_step == 0.0 and per_output == 0.0) or len(self.sim.instances) < 2:
            return 1.0  # the common case (GPU profiles, one instance) builds nothing per step
        busy_others = [i for i in self.sim.instances if i is not self and i.busy]
        if not busy_others:
            return 1.0
        factor = 1.0 + (scale - 1.0) * len(busy_others) / (len(self.sim.instances) - 1)
        if per_step > 0.0:
            rate = 1.0 / max(duration, 1e-6) + sum(1.0 / max(i.step_s, 1e-6) for i in busy_others)
            factor += per_step * rate
        if per_output > 0.0:
            rate = self.step_outputs / max(duration, 1e-6) + sum(i.step_outputs / max(i.step_s, 1e-6) for i in busy_others)
            factor += per_output * rate
        return factor

    def _take(self, blocks: int) -> bool:
        if blocks > self.free_blocks:
            return False
        self.free_blocks -= blocks
        return True

    def _give(self, blocks: int) -> None:
        self.free_blocks += blocks
        assert self.free_blocks <= self.total_blocks, f"{self.name}: freed more blocks than it has"


class CoreShareGroup:
    """A prefill and a decode instance whose threads outnumber the cores they share (``CoreSharing``): a
    step progresses at its alone speed while no instance of the other role is busy, and ``factor(role)``
    times slower while one is (processor sharing: every start and end of a step in the group re-times the
    steps in progress, so a long prefill step is slowed only for the part of it that decode steps overlap).

    A prefill instance that yields threads to a busy decode instance (``PrefillSim.busy_threads``, the
    served ``prefill.threads_when_decode_busy``) decides as a step starts, as the worker does: a step started
    while decode is busy runs entirely on the fewer threads (its alone time times ``PrefillSim.yield_ratio``)
    and then shares the cores as that pair does: ``yielded``, or not at all (None) where it fits them."""

    def __init__(self, sim, sharing: CoreSharing, members: list[_Instance], yielded: CoreSharing | None = None):
        self.sim = sim
        self.sharing = sharing
        self.yielded = yielded
        self.members = members
        self._finish: dict[int, object] = {}  # id(member) -> its step's finish callback
        self._last_s = 0.0
        for m in members:
            m.sharing = self

    def started(self, inst: _Instance, work_s: float, finish) -> None:
        self._advance()
        if getattr(inst, "yield_cost", None) is not None:
            inst.yielded = any(o.busy and o.role == "decode" for o in self.members)
            if inst.yielded:
                work_s *= inst.yield_ratio
        inst.work_left_s = work_s
        inst.slowdown = 0.0  # not yet timed: rescheduled below
        self._finish[id(inst)] = finish
        self._retime()

    def stopped(self, inst: _Instance) -> None:
        """``inst``'s step ended (it is no longer busy): the others' steps speed up from now."""
        self._advance()
        inst.work_left_s = 0.0
        self._finish.pop(id(inst), None)
        self._retime()

    def _advance(self) -> None:
        elapsed = self.sim.now - self._last_s
        for m in self.members:
            if m.busy and id(m) in self._finish and m.slowdown > 0:
                m.work_left_s = max(0.0, m.work_left_s - elapsed / m.slowdown)
        self._last_s = self.sim.now

    def _retime(self) -> None:
        for m in self.members:
            if not (m.busy and id(m) in self._finish):
                continue
            others = [o for o in self.members if o.busy and o.role != m.role]
            prefill = m if m.role == "prefill" else (others[0] if others else None)
            pair = self.yielded if getattr(prefill, "yielded", False) else self.sharing
            slowdown = pair.factor(m.role) if others and pair is not None else 1.0
            if slowdown != m.slowdown:
                m.slowdown = slowdown
                m._schedule_end(self._finish[id(m)])


class PrefillSim(_Instance):
    """A prefill instance: chunks of queued prompts up to its token budget per step, then the KV transfer."""

    role = "prefill"  # Calibration.step_noise key

    def __init__(self, sim, name: str, profile: Profile, tp: int, pp: int, capacity_tokens: int, block_size: int,
                 token_budget: int, max_num_seqs: int, busy_threads: int = 0):
        super().__init__(sim, name, capacity_tokens, block_size)
        self.cost = profile.prefill_model(tp, pp)
        # sharing cores: a step started while decode is busy runs on ``busy_threads`` (0: never yields)
        self.yield_cost = profile.prefill_model(busy_threads, pp) if busy_threads else None
        self.yield_ratio = 1.0  # the planned step's time on busy_threads over its time on tp
        self.yielded = False  # the step in progress runs on busy_threads
        self.place_scale = 1.0  # sharing cores: CoreSharing.prefill_scale (the served pair's steps, decode idle)
        self.transfer = profile.kv_transfer
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.channel_free_at: dict[str, float] = {}  # decode instance name -> when its channel is idle

    def add(self, req: SimRequest) -> None:
        if blocks_for(req.prompt_tokens, self.block_size) > self.total_blocks:
            raise ValueError(f"{self.name}: a {req.prompt_tokens}-token prompt does not fit in its KV cache "
                             f"({self.total_blocks * self.block_size} tokens)")
        self.waiting.append(req)
        self.kick()

    def _plan_step(self):
        budget = self.token_budget
        chunks: list[tuple[SimRequest, int, int]] = []  # (request, start, length)
        for req in self.running:
            if budget == 0:
                break
            n = min(req.prompt_tokens - req.computed, budget)
            chunks.append((req, req.computed, n))
            budget -= n
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self._take(blocks_for(req.prompt_tokens, self.block_size)):
                break  # back-pressure: blocks are held by prompts whose KV is still in transfer
            self.waiting.popleft()
            self.running.append(req)
            n = min(req.prompt_tokens, budget)
            chunks.append((req, 0, n))
            budget -= n
        if not chunks:
            return None
        cal = self.sim.calibration
        features = prefill_features([(s, n) for _, s, n in chunks])
        duration = self.cost.predict(features) * cal.prefill_busy_scale * self.place_scale
        if self.yield_cost is not None:
            self.yield_ratio = self.yield_cost.predict(features) / self.cost.predict(features)
        # what the isolated TTFT scale has beyond the worker's own passes: latency of the request, not busy time
        latency_scale = cal.prefill_scale - cal.prefill_busy_scale
        if latency_scale > 0:
            for req, s, n in chunks:
                req.prefill_latency_s += latency_scale * self.cost.predict(prefill_features([(s, n)]))
        self.step_outputs = len(chunks)
        return duration, lambda: self._done(chunks)

    def _done(self, chunks: list[tuple[SimRequest, int, int]]) -> None:
        now = self.sim.now
        for req, start, n in chunks:
            req.computed = start + n
            last = req.computed == req.prompt_tokens
            dest = req.decode.name
            begin = max(now, self.channel_free_at.get(dest, 0.0))
            end = begin + self.transfer.predict({"passes": 1.0 if last else 0.0, "tokens": float(n)})
            self.channel_free_at[dest] = end
            if last:
                self.running.remove(req)
                self.sim.on_first_token(req, now + req.prefill_latency_s)
                self.sim.at(end, lambda req=req: self._transferred(req))

    def _transferred(self, req: SimRequest) -> None:
        self._give(blocks_for(req.prompt_tokens, self.block_size))
        self.sim.on_kv_ready(req)
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
    """A decode instance: one (speculative) step over its running batch at a time."""

    role = "decode"  # Calibration.step_noise key

    def __init__(self, sim, name: str, profile: Profile, tp: int, pp: int, capacity_tokens: int, block_size: int,
                 max_num_seqs: int, spec: SpeculationConfig, rng: random.Random):
        super().__init__(sim, name, capacity_tokens, block_size)
        self.profile = profile
        self.target = profile.target_model(tp, pp)
        self.spec = spec
        self.rng = rng
        self.max_num_seqs = max_num_seqs
        self.draft = profile.draft_model(spec.drafter, tp, pp) if spec.enabled else None
        self._rates: dict[int, float] = {}  # context bucket (64 tokens) -> acceptance rate
        if spec.enabled:
            self._rate(0)  # fail now, not mid-run, if the profile lacks it
        # the policy's acceptance belief: set to the profile's rates before every choice (``_choose_k``),
        # so the simulated verdicts are not fed back into it
        self.acceptance = AcceptanceEstimator()
        cal = sim.calibration
        # in-place speed of speculative passes relative to plain decode ones (Calibration): the real policy
        # learns its costs online, in place, so the simulated one chooses k with the same relative costs
        self.verify_scale, self.draft_scale = cal.verify_pass_scale, cal.draft_pass_scale
        self.policy = (AdaptiveK(spec.max_k, _FittedCost(self.target, self.verify_scale),
                                 _FittedCost(self.draft, self.draft_scale), self.acceptance,
                                 spec.tpot_slo_ms / 1000 if spec.tpot_slo_ms else None, explore=False)
                       if spec.enabled and spec.k_policy == "adaptive" else None)
        self.recompute = profile.costs(tp, pp).prefill  # recompute after preemption (None: use target)
        self.held: dict[int, int] = {}  # request index -> blocks held (reserved or live)
        self.ready: list[SimRequest] = []  # KV complete, joins at the next step
        self.live: list[SimRequest] = []
        self.preempted: deque[SimRequest] = deque()
        self.k_counts: dict[int, int] = {}

    def reserve(self, req: SimRequest) -> bool:
        blocks = blocks_for(req.prompt_tokens + 1, self.block_size)
        if len(self.live) >= self.max_num_seqs or not self._take(blocks):
            return False
        self.held[req.index] = blocks
        return True

    def admit(self, req: SimRequest) -> None:
        self.ready.append(req)
        self.kick()

    def _grow(self, req: SimRequest, tokens: int) -> bool:
        need = blocks_for(tokens, self.block_size) - self.held[req.index]
        if need <= 0:
            return True
        if not self._take(need):
            return False
        self.held[req.index] += need
        return True

    def release(self, req: SimRequest) -> None:
        """Free the request's blocks (reserved or live)."""
        self._give(self.held.pop(req.index))

    def _plan_step(self):
        recompute_s = self._resume_preempted()
        self.live.extend(self.ready)
        self.ready.clear()
        if not self.live:
            return None
        k = self._choose_k()
        k = self._make_room(k)
        if not self.live:
            return None
        lens = [r.context for r in self.live]
        b = len(lens)
        target = self.target.predict_pass(PassShape(b, sum(lens) + b * k, b * (k + 1)))
        duration = recompute_s + target * (self.verify_scale if k else 1.0)
        for step in range(k):
            duration += self.draft_scale * self.draft.predict_pass(
                PassShape(b, sum(min(n, self.spec.budget) + step + 1 for n in lens), b))
        batch = list(self.live)
        self.k_counts[k] = self.k_counts.get(k, 0) + 1
        self.step_outputs = b
        return duration * self.sim.calibration.decode_scale, lambda: self._done(batch, k)

    def _choose_k(self) -> int:
        if not self.spec.enabled:
            return 0
        if self.policy is None:
            return self.spec.k
        self.acceptance.rate = self._mean_rate()
        lens = [r.context for r in self.live]
        b = len(lens)
        choice = self.policy.choose(
            lambda k: PassShape(b, sum(lens) + b * k, b * (k + 1)),
            lambda step: PassShape(b, sum(min(n, self.spec.budget) + step + 1 for n in lens), b))
        return choice.k

    def _mean_rate(self) -> float:
        rates = [self._rate(r.context) for r in self.live]
        return sum(rates) / len(rates)

    def _rate(self, context: int) -> float:
        """The profile's acceptance rate at ``context``, looked up once per 64-token bucket."""
        bucket = context >> 6
        if bucket not in self._rates:
            self._rates[bucket] = self.profile.acceptance_rate(self.spec.drafter, self.spec.budget, bucket << 6)
        return self._rates[bucket]

    def _make_room(self, k: int) -> int:
        while self.live:
            if all(self._grow(r, r.context + k) for r in self.live):
                return k
            if k > 0:
                k = 0
                continue
            victim = self.live.pop()
            self.release(victim)
            victim.preemptions += 1
            self.preempted.append(victim)
        return 0

    def _resume_preempted(self) -> float:
        seconds = 0.0
        while self.preempted and len(self.live) < self.max_num_seqs:
            req = self.preempted[0]
            blocks = blocks_for(req.context + 1, self.block_size)
            if not self._take(blocks):
                break
            self.preempted.popleft()
            self.held[req.index] = blocks
            self.live.append(req)
            if self.recompute is not None:
                seconds += self.recompute.predict(prefill_features([(0, req.context)]))
            else:
                seconds += self.target.predict_pass(PassShape(1, req.context, req.context, kv_queries=req.context ** 2 // 2))
        return seconds

    def _done(self, batch: list[SimRequest], k: int) -> None:
        now = self.sim.now
        for req in batch:  # nothing leaves ``live`` between planning a step and its end
            accepted = 0
            if k > 0:
                rate = self._rate(req.context)
                accepted = accepted_drafts(self.rng, rate, k)
                req.draft_tokens += k
                req.accepted_tokens += accepted
            req.generated += min(accepted + 1, req.remaining)
            if req.remaining <= 0:
                self.live.remove(req)
                self.release(req)
                self.sim.on_finish(req, now)


class ColocatedSim(_Instance):
    """The reference engine: decode tokens and prefill chunks share each step's token budget."""

    role = "colocated"  # Calibration.step_noise key

    def __init__(self, sim, name: str, profile: Profile, tp: int, pp: int, capacity_tokens: int, block_size: int,
                 token_budget: int, max_num_seqs: int):
        super().__init__(sim, name, capacity_tokens, block_size)
        self.prefill_cost = profile.prefill_model(tp, pp)
        self.decode_cost = profile.target_model(tp, pp)
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.held: dict[int, int] = {}

    def add(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self.kick()

    def _grow(self, req: SimRequest, tokens: int) -> bool:
        need = blocks_for(tokens, self.block_size) - self.held.get(req.index, 0)
        if need > 0 and not self._take(need):
            return False
        self.held[req.index] = self.held.get(req.index, 0) + max(0, need)
        return True

    def _preempt(self, req: SimRequest) -> None:
        self._give(self.held.pop(req.index, 0))
        self.running.remove(req)
        req.computed = 0
        req.preemptions += 1
        self.waiting.appendleft(req)

    def _plan_step(self):
        budget = self.token_budget
        decodes: list[SimRequest] = []
        for req in list(self.running):
            if budget == 0 or req.computed < req.prompt_tokens + max(0, req.generated - 1):
                continue
            while not self._grow(req, req.context):
                victims = [r for r in self.running if r is not req and r not in decodes]
                self._preempt(victims[-1] if victims else req)
                if not victims:
                    break
            if req in self.running:
                decodes.append(req)
                budget -= 1
        chunks: list[tuple[SimRequest, int, int]] = []
        for req in self.running:
            if budget == 0:
                break
            todo = self._uncomputed(req)
            if req not in decodes and todo > 0:
                budget -= self._chunk(req, budget, chunks)
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(self._uncomputed(req), budget)
            if blocks_for(req.computed + n, self.block_size) - self.held.get(req.index, 0) > self.free_blocks:
                break
            self.waiting.popleft()
            self.running.append(req)
            budget -= self._chunk(req, budget, chunks)
        if not decodes and not chunks:
            return None
        duration = self._step_seconds(decodes, chunks)
        self.step_outputs = len(decodes) + len(chunks)
        return duration, lambda: self._done(decodes, chunks)

    @staticmethod
    def _uncomputed(req: SimRequest) -> int:
        # after preemption the generated tokens (but the last) are recomputed with the prompt
        return req.prompt_tokens + max(0, req.generated - 1) - req.computed

    def _chunk(self, req: SimRequest, budget: int, chunks: list) -> int:
        n = min(self._uncomputed(req), budget)
        if not self._grow(req, req.computed + n):
            return 0
        chunks.append((req, req.computed, n))
        return n

    def _step_seconds(self, decodes: list[SimRequest], chunks: list) -> float:
        """One forward pass over decode tokens and prefill chunks: the decode part priced by the target-pass
        model, the prefill part by the prefill model, the fixed per-pass cost counted once."""
        cal = self.sim.calibration
        prefill = prefill_features([(s, n) for _, s, n in chunks]) if chunks else None
        return mixed_pass_seconds(self.prefill_cost, self.decode_cost, prefill, len(decodes),
                                  sum(r.context for r in decodes), cal.prefill_busy_scale, cal.decode_scale)

    def _done(self, decodes: list[SimRequest], chunks: list) -> None:
        now = self.sim.now
        for req, start, n in chunks:
            req.computed = start + n
            if self._uncomputed(req) == 0 and req.generated == 0:
                self.sim.on_first_token(req, now)
                req.generated = 1
                self._maybe_finish(req, now)
        for req in decodes:
            req.computed += 1
            req.generated += 1
            self._maybe_finish(req, now)

    def _maybe_finish(self, req: SimRequest, now: float) -> None:
        if req.remaining <= 0 and req in self.running:
            self.running.remove(req)
            self._give(self.held.pop(req.index, 0))
            self.sim.on_finish(req, now)
