"""The online SLO planner: from what the router saw over a sliding window, the pool sizes that meet the SLOs
with headroom, found with the offline planner's simulator, and when to act on them.

* :class:`LoadWindow` keeps each request the router admitted over the last ``window_s`` seconds: when it
  arrived, its prompt length, how much of the prompt the instance computing it held cached (a prefix-cache
  hit is not computed again: the simulated prefill skips it), and its output length (the tokens it
  generated; a request still running counts what it has generated so far, or the window's mean output if
  more). :meth:`LoadWindow.trace` is
  those requests as a simulator trace, replayed ``headroom`` times faster.
* The simulator's latencies are corrected by what the router measured (Dynamo's SLA planner does the same):
  the current shape is simulated on the window's trace, and the ratios of the measured to the simulated
  median TTFT and TPOT of the window's finished requests (at least 1, at most 10) divide the SLO targets
  the shapes are held to. A profile that misses the host's contention then no longer keeps an overloaded
  shape. Only requests that arrived since the last resize (``LoadWindow.shape_changed``) are compared:
  requests that queued behind a smaller shape measured that shape, not the current one (taking them
  would inflate the correction tenfold right after a step up in load and overshoot to the bounds).
* With speculative decoding, the draft acceptance rate measured over the window (``LoadWindow.acceptance``)
  replaces the profile's for the served drafter, so a workload the draft predicts worse than the profiled
  one gets the decode instances it needs.
* :class:`OnlinePlanner.decide` simulates the trace on the profile, starting from the current shape, and
  walks one instance at a time: while the shape meets the target (predicted attainment of both SLOs), it
  tries one instance fewer in each pool and moves to the one that still meets it with the fewest devices;
  while it does not, it tries one more in each pool and moves to the one that meets it, or else to the one
  predicted to attain more (within a point of each other, as when a backlog makes every candidate miss:
  the pool of the SLO the current shape misses more often, prefill for TTFT, decode for TPOT; where that
  pool is at its bound and no instance elsewhere helps, the walk stops). The walk ends at the smallest
  shape that meets the target next to one that does not, or at the bounds. It costs two simulations a step whatever the bounds (a cluster of 64 GPUs
  is planned as fast as one of 2). A simulation stops as soon as its verdict is decided
  (``planner.slo.AttainmentWatch``), and the whole decision stops at ``time_limit_s``: then the shape the
  walk has reached wins.
* Where an instance can change pools (``switchable``: the pools' instances hold the same devices), the walk
  also tries moving one instance from a pool to the other when the shape misses the target: the same devices,
  so a move that meets it is preferred to an instance more; :meth:`ScalePolicy.switch` makes such a decision
  a role change (``magicserve scale POOL N --from OTHER``) rather than an addition and a removal.
* :class:`ScalePolicy` turns decisions into actions: a pool grows as soon as a decision asks for more
  (after ``cooldown_s`` since it last shrank; a growth may follow a growth at once, as a load that keeps
  rising needs); it shrinks, one instance at a time, only after ``scale_down_after`` consecutive decisions
  asked for fewer and ``cooldown_s`` after its last resize (hysteresis: a dip in load does not churn it).
  A resize that failed (no room, an instance that did not come up) doubles that pool's cooldown, up to
  ``max_backoff_s``, until one succeeds.

No torch, no Ray, no asyncio here: the scaler (``controller/scaling.py``) runs it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from planner.profile import CONTEXT_UNBOUNDED, AcceptanceEntry
from planner.search import SLOTarget
from planner.simulator import SimConfig, simulate
from planner.slo import AttainmentWatch, attainment
from planner.workload import RequestSpec

MIN_ACCEPTANCE_STEPS = 64  # draft outcomes before the window's acceptance replaces the profile's


@dataclass
class _Seen:
    arrival: float
    prompt_tokens: int
    output_tokens: int = 0
    finished: bool = False
    ttft_s: float | None = None  # measured, once finished
    tpot_s: float | None = None
    cached_tokens: int = 0  # prompt tokens the instance that computes its prompt held cached
    accepted: int = 0  # draft tokens accepted over its speculative steps
    rejections: int = 0  # speculative steps that rejected a draft (accepted < k)


class LoadWindow:
    """The requests admitted over the last ``window_s`` seconds (``clock``: time.monotonic)."""

    def __init__(self, window_s: float, clock=time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._seen: deque[tuple[str, _Seen]] = deque()
        self._by_id: dict[str, _Seen] = {}
        self.measured_since = -math.inf  # requests that arrived before it do not correct the simulation

    def shape_changed(self) -> None:
        """The cluster's shape changed now: the latencies of requests admitted before no longer describe it."""
        self.measured_since = self.clock()

    def admitted(self, request_id: str, prompt_tokens: int) -> None:
        seen = _Seen(self.clock(), prompt_tokens)
        self._seen.append((request_id, seen))
        self._by_id[request_id] = seen
        self._expire()

    def generated(self, request_id: str, tokens: int, finished: bool = False, ttft_s: float | None = None,
                  tpot_s: float | None = None) -> None:
        """``request_id`` has generated ``tokens`` so far (all of them once ``finished``, with the TTFT and
        TPOT it was served at)."""
        seen = self._by_id.get(request_id)
        if seen is not None:
            seen.output_tokens = max(seen.output_tokens, tokens)
            seen.finished = seen.finished or finished
            if finished:
                seen.ttft_s, seen.tpot_s = ttft_s, tpot_s

    def cached(self, request_id: str, tokens: int) -> None:
        """The instance chosen to compute ``request_id``'s prompt holds ``tokens`` of it cached (a prefix-cache
        hit: computed there no more)."""
        seen = self._by_id.get(request_id)
        if seen is not None:
            seen.cached_tokens = tokens

    def speculated(self, request_id: str, accepted: int, rejections: int) -> None:
        """Speculative steps of ``request_id`` kept ``accepted`` drafts, and ``rejections`` of them rejected one
        (a step that kept all k drafts rejected none)."""
        seen = self._by_id.get(request_id)
        if seen is not None:
            seen.accepted += accepted
            seen.rejections += rejections

    def acceptance(self, min_steps: int = MIN_ACCEPTANCE_STEPS) -> float | None:
        """The per-draft acceptance rate over the window's speculative steps (each draft kept with this
        probability until the first rejection, as the simulator draws it: accepted / (accepted +
        rejections), its maximum-likelihood estimate); None with fewer than ``min_steps`` rejections and
        acceptances together."""
        self._expire()
        accepted = sum(s.accepted for _, s in self._seen)
        trials = accepted + sum(s.rejections for _, s in self._seen)
        return accepted / trials if trials >= min_steps else None

    def plan_inputs(self, headroom: float = 1.0) -> tuple[list[RequestSpec], list[tuple[int, float, float]]]:
        """``trace(headroom)`` and, for the requests of it that finished and arrived since the shape last
        changed, (index in the trace, measured TTFT, measured TPOT)."""
        trace = self.trace(headroom)
        measured = [(i, s.ttft_s, s.tpot_s) for i, (_, s) in enumerate(self._seen)
                    if s.finished and s.ttft_s is not None and s.tpot_s is not None
                    and s.arrival >= self.measured_since]
        return trace, measured

    def _expire(self) -> None:
        edge = self.clock() - self.window_s
        while self._seen and self._seen[0][1].arrival < edge:
            rid, _ = self._seen.popleft()
            self._by_id.pop(rid, None)

    def summary(self) -> dict:
        """Requests, arrival rate (req/s), mean prompt and output tokens and the prefix-cache hit rate (cached
        share of prompt tokens) over the window."""
        self._expire()
        seen = [s for _, s in self._seen]
        if not seen:
            return {"requests": 0, "rate": 0.0, "mean_prompt_tokens": 0.0, "mean_output_tokens": 0.0,
                    "prefix_hit_rate": 0.0}
        done = [s.output_tokens for s in seen if s.finished] or [s.output_tokens for s in seen]
        prompt = sum(s.prompt_tokens for s in seen)
        return {"requests": len(seen), "rate": len(seen) / self.window_s, "mean_prompt_tokens": prompt / len(seen),
                "mean_output_tokens": sum(done) / len(done),
                "prefix_hit_rate": sum(s.cached_tokens for s in seen) / prompt}

    def trace(self, headroom: float = 1.0) -> list[RequestSpec]:
        """The window's requests as a trace from the window's start, arrivals ``headroom`` times faster
        (a running request's output: what it has generated, or the finished ones' mean if that is more)."""
        self._expire()
        seen = [s for _, s in self._seen]
        finished = [s.output_tokens for s in seen if s.finished]
        mean_out = round(sum(finished) / len(finished)) if finished else 1
        start = self.clock() - self.window_s
        return [RequestSpec(max(0.0, s.arrival - start) / headroom, s.prompt_tokens,
                            max(1, s.output_tokens if s.finished else max(s.output_tokens, mean_out)),
                            min(s.cached_tokens, s.prompt_tokens - 1))
                for s in seen]


BINDING_POOL = {"TTFT": "prefill", "TPOT": "decode"}  # the pool that adds to each SLO's attainment first


@dataclass(frozen=True)
class Decision:
    """What the planner chose and on what: ``shape`` (pool -> instances), the predicted attainment of each
    shape it simulated, the window's summary, and how long it took."""

    shape: dict
    predicted: dict  # "prefill=1,decode=2" -> attainment
    inputs: dict
    seconds: float
    met: bool  # the chosen shape's predicted attainment reaches the target
    correction: tuple[float, float] = (1.0, 1.0)  # measured / simulated median (TTFT, TPOT) on the current shape

    @property
    def attainment(self) -> float:
        return self.predicted.get(_key(self.shape), math.nan)


def _key(shape: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(shape.items()))


# with role_changes_only, between two shapes that both miss the target the planner moves an instance across
# only for this much more predicted attainment: a move drains the instance (its requests migrate, its cache
# empties), and near-equal shapes would otherwise swap at every decision
MOVE_GAIN = 0.05


class OnlinePlanner:
    """Chooses pool sizes for a trace: ``base`` is the served configuration's simulation
    (``SimConfig.from_cluster_config``), whose pools' instance counts are varied within ``bounds`` (pool ->
    (min, max)); ``time_limit_s`` bounds a decision."""

    def __init__(self, profile, base: SimConfig, slo: SLOTarget, bounds: dict[str, tuple[int, int]],
                 time_limit_s: float = 5.0, switchable: bool = False, role_changes_only: bool = False):
        self.profile = profile
        self.base = base
        self.slo = slo
        self.bounds = bounds
        self.time_limit_s = time_limit_s
        self.switchable = switchable  # an instance can change pools (same devices): the walk tries that too
        # the cluster keeps its instances: the walk only moves one across while the shape misses
        self.role_changes_only = role_changes_only

    def _config(self, shape: dict) -> SimConfig:
        changes = {pool: dataclasses.replace(getattr(self.base, pool), instances=n) for pool, n in shape.items()}
        return dataclasses.replace(self.base, **changes)

    def profile_for(self, acceptance: float | None):
        """The profile with the served drafter's acceptance rate replaced by a measured one (at every context
        and budget), where speculation is on and a rate is given; else the profile."""
        spec = self.base.speculation
        if acceptance is None or not spec.enabled or self.base.mode != "disaggregated":
            return self.profile
        kept = tuple(e for e in self.profile.acceptance if e.drafter != spec.drafter)
        measured = AcceptanceEntry(spec.drafter, spec.budget, 0, CONTEXT_UNBOUNDED, acceptance, 0)
        return dataclasses.replace(self.profile, acceptance=kept + (measured,))

    def predict(self, shape: dict, trace: list[RequestSpec], deadline: float | None = None,
                correction: tuple[float, float] = (1.0, 1.0), acceptance: float | None = None) -> tuple[bool, float]:
        """Whether ``shape`` meets the target on the trace, and the share of its requests that met both SLOs
        in the simulation (a lower bound where the run stopped once the verdict was known); ``deadline``: a
        ``time.perf_counter()`` value the simulation stops by (then it is not known to meet); ``correction``
        divides the TTFT and TPOT targets; ``acceptance``: a measured draft acceptance rate."""
        meets, share, _ = self._simulate(self.profile_for(acceptance), shape, trace, deadline, correction)
        return meets, share

    def _simulate(self, profile, shape: dict, trace: list[RequestSpec], deadline: float | None,
                  correction: tuple[float, float]) -> tuple[bool, float, str]:
        """``predict`` on ``profile``, and the SLO more of the misses missed (``AttainmentWatch.binding``)."""
        ttft, tpot = self.slo.ttft_s / correction[0], self.slo.tpot_s / correction[1]
        watch = AttainmentWatch(len(trace), ttft, tpot, self.slo.attainment)
        result = simulate(profile, self._config(shape), trace, watch=watch, wall_deadline=deadline)
        share = attainment(result.outcomes(), ttft, tpot).both
        meets = result.verdict if result.verdict is not None else share >= self.slo.attainment
        return bool(meets), share, watch.binding

    def correction(self, shape: dict, trace: list[RequestSpec], measured: list[tuple[int, float, float]],
                   deadline: float | None = None, acceptance: float | None = None) -> tuple[float, float]:
        """Measured over simulated median (TTFT, TPOT) of the finished requests of the trace on ``shape``
        (each within [1, 10]; (1, 1) without measurements); ``deadline`` as in ``predict``."""
        if not measured:
            return 1.0, 1.0
        records = simulate(self.profile_for(acceptance), self._config(shape), trace, wall_deadline=deadline).records
        pairs = [(records[i], ttft, tpot) for i, ttft, tpot in measured if i < len(records) and records[i].finished]
        if not pairs:
            return 1.0, 1.0
        out = []
        for sim_of, got_of in ((lambda r: r.ttft_s, lambda p: p[1]), (lambda r: r.tpot_s, lambda p: p[2])):
            sim = statistics.median(sim_of(p[0]) for p in pairs)
            got = statistics.median(got_of(p) for p in pairs)
            out.append(min(10.0, max(1.0, got / sim)) if sim > 0 else 1.0)
        return out[0], out[1]

    def decide(self, trace: list[RequestSpec], current: dict, inputs: dict | None = None,
               measured: list[tuple[int, float, float]] = (), acceptance: float | None = None) -> Decision:
        """The shape for ``trace`` (see the module doc); ``current``: pool -> instances in service now;
        ``measured``: (trace index, TTFT, TPOT) of its finished requests (``LoadWindow.plan_inputs``);
        ``acceptance``: the draft acceptance rate measured over the window (``LoadWindow.acceptance``), which
        replaces the profile's for the served drafter."""
        profile = self.profile_for(acceptance)
        t0 = time.perf_counter()
        deadline = t0 + self.time_limit_s
        predicted: dict[str, float] = {}
        here = {p: min(max(current.get(p, lo), lo), hi) for p, (lo, hi) in self.bounds.items()}
        correction = self.correction(here, trace, list(measured), t0 + self.time_limit_s / 2, acceptance)

        verdicts: dict[str, bool] = {}
        binding: dict[str, str] = {}

        def meets(shape: dict) -> bool:
            key = _key(shape)
            if key not in verdicts:
                verdicts[key], predicted[key], binding[key] = self._simulate(profile, shape, trace, deadline, correction)
            return verdicts[key]

        def steps(shape: dict, by: int) -> list[dict]:  # one instance more (by=1) or fewer in each pool
            if self.role_changes_only:
                return switches(shape) if by > 0 and self.switchable else []
            out = []
            for pool, (lo, hi) in sorted(self.bounds.items()):
                n = shape[pool] + by
                if lo <= n <= hi:
                    out.append({**shape, pool: n})
            if by > 0 and self.switchable:  # or one instance moved from a pool to the other: no device more
                out += [s for s in switches(shape) if s not in out]
            return out

        def switches(shape: dict) -> list[dict]:
            out = []
            for give, take in itertools.permutations(sorted(self.bounds), 2):
                moved = {**shape, give: shape[give] - 1, take: shape[take] + 1}
                if all(lo <= moved[p] <= hi for p, (lo, hi) in self.bounds.items()):
                    out.append(moved)
            return out

        chosen, met = here, meets(here)
        walked = {_key(here)}
        while time.perf_counter() < deadline:
            # never back to a shape walked through: moves across could otherwise swap two shapes until the deadline
            tries = [s for s in steps(chosen, -1 if met else 1) if _key(s) not in walked]
            passing = [s for s in tries if meets(s)]
            if time.perf_counter() > deadline:
                break
            if self.role_changes_only and not passing:  # a move costs a drain: only for a clear gain
                tries = [s for s in tries if predicted[_key(s)] >= predicted[_key(chosen)] + MOVE_GAIN]
            if passing:
                nxt = min(passing, key=lambda s: (self._config(s).devices, -predicted[_key(s)]))
            elif met or not tries:
                break  # nothing smaller meets it, or nothing larger is allowed
            else:
                best = max(predicted[_key(s)] for s in tries)
                pool = BINDING_POOL.get(binding[_key(chosen)])
                close = [s for s in tries if predicted[_key(s)] >= best - 0.01]
                favoured = [s for s in close if s.get(pool, 0) > chosen.get(pool, 0)]
                if best <= predicted[_key(chosen)] + 0.01 and not favoured:
                    break  # an instance more helps nowhere (the binding pool is at its bound)
                nxt = (favoured or sorted(close, key=lambda s: (-predicted[_key(s)], self._config(s).devices)))[0]
            chosen, met = nxt, bool(passing)
            walked.add(_key(chosen))
        return Decision(chosen, predicted, dict(inputs or {}), time.perf_counter() - t0, met, correction)

    def smallest(self, inputs: dict | None = None, current: dict | None = None) -> Decision:
        """The smallest shape the bounds allow, decided without simulating (too little load to plan for); with
        ``role_changes_only``, ``current`` as it is."""
        if self.role_changes_only and current is not None:
            return Decision(dict(current), {}, dict(inputs or {}), 0.0, True)
        return Decision({pool: lo for pool, (lo, _) in self.bounds.items()}, {}, dict(inputs or {}), 0.0, True)


@dataclass
class ScalePolicy:
    """When a decision becomes a resize (see the module doc). ``clock``: time.monotonic."""

    cooldown_s: float = 30.0
    scale_down_after: int = 3
    clock: object = time.monotonic
    max_backoff_s: float = 600.0
    _last_action: dict = field(default_factory=dict)  # pool -> when it was last resized
    _last_grew: dict = field(default_factory=dict)  # pool -> whether that resize was a successful growth
    _lower_streak: dict = field(default_factory=dict)  # pool -> consecutive decisions for fewer instances
    _failures: dict = field(default_factory=dict)  # pool -> resizes failed in a row

    def actions(self, decision: Decision, current: dict) -> dict:
        """Pool -> the size to resize it to now (pools left alone are absent)."""
        now, out = self.clock(), {}
        for pool, want in decision.shape.items():
            have = current.get(pool, want)
            if want < have:
                self._lower_streak[pool] = self._lower_streak.get(pool, 0) + 1
            else:
                self._lower_streak[pool] = 0
            cooling = now - self._last_action.get(pool, -math.inf) < self.cooldown(pool)
            if cooling and not (want > have and self._last_grew.get(pool, False)):
                continue
            if want > have:
                out[pool] = want
            elif want < have and self._lower_streak[pool] >= self.scale_down_after:
                out[pool] = have - 1
        return out

    def switch(self, decision: Decision, current: dict) -> tuple[str, int, str] | None:
        """The role change that reaches the decision's shape, as (pool to grow, its size, pool that gives the
        instances), where the shape moves instances from one pool to the other at the same total and neither
        pool is cooling down (a switch grows one pool at once, as a growth does); else None."""
        grow = [p for p, n in decision.shape.items() if n > current.get(p, n)]
        give = [p for p, n in decision.shape.items() if n < current.get(p, n)]
        if len(grow) != 1 or len(give) != 1 or sum(decision.shape.values()) != sum(current.get(p, 0)
                                                                                   for p in decision.shape):
            return None
        now = self.clock()
        if any(now - self._last_action.get(p, -math.inf) < self.cooldown(p) for p in (grow[0], give[0])):
            return None
        return grow[0], decision.shape[grow[0]], give[0]

    def cooldown(self, pool: str) -> float:
        """Seconds after a resize of ``pool`` before the next: ``cooldown_s``, doubled per failure in a row."""
        return min(self.max_backoff_s, self.cooldown_s * 2 ** self._failures.get(pool, 0))

    def acted(self, pool: str, failed: bool = False, grew: bool = False) -> None:
        """``pool`` was resized now (``grew``: to more instances), successfully unless ``failed``."""
        self._last_action[pool] = self.clock()
        self._last_grew[pool] = grew and not failed
        self._lower_streak[pool] = 0
        self._failures[pool] = self._failures.get(pool, 0) + 1 if failed else 0
