"""The online SLO planner: from what the router saw over a sliding window, the pool sizes that meet the SLOs
with headroom, found with the offline planner's simulator, and when to act on them.

* :class:`LoadWindow` keeps each request the router admitted over the last ``window_s`` seconds: when it
  arrived, its prompt length and its output length (the tokens it generated; a request still running
  counts what it has generated so far, or the window's mean output if more). :meth:`LoadWindow.trace` is
  those requests as a simulator trace, replayed ``headroom`` times faster.
* The simulator's latencies are corrected by what the router measured (Dynamo's SLA planner does the same):
  the current shape is simulated on the window's trace, and the ratios of the measured to the simulated
  median TTFT and TPOT of the window's finished requests (at least 1, at most 10) divide the SLO targets
  the shapes are held to. A simulation that starts from an idle cluster, or a profile that misses the
  host's contention, then no longer keeps an overloaded shape.
* :class:`OnlinePlanner.decide` simulates the trace on the profile, starting from the current shape: if it
  meets the target (predicted attainment of both SLOs), the shapes with fewer devices are tried, fewest
  first, and the first that meets it wins; if not, the shapes with more devices, fewest first (a shape
  may also move instances between pools). A simulation stops as soon as its verdict is decided
  (``planner.slo.AttainmentWatch``), and the whole decision stops at ``time_limit_s``: then the best
  shape seen so far wins.
* :class:`ScalePolicy` turns decisions into actions: a pool grows as soon as a decision asks for more
  (after ``cooldown_s`` since its last action); it shrinks, one instance at a time, only after
  ``scale_down_after`` consecutive decisions asked for fewer (hysteresis: a dip in load does not churn it).
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

from planner.search import SLOTarget
from planner.simulator import SimConfig, simulate
from planner.slo import AttainmentWatch, attainment
from planner.workload import RequestSpec


@dataclass
class _Seen:
    arrival: float
    prompt_tokens: int
    output_tokens: int = 0
    finished: bool = False
    ttft_s: float | None = None  # measured, once finished
    tpot_s: float | None = None


class LoadWindow:
    """The requests admitted over the last ``window_s`` seconds (``clock``: time.monotonic)."""

    def __init__(self, window_s: float, clock=time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._seen: deque[tuple[str, _Seen]] = deque()
        self._by_id: dict[str, _Seen] = {}

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

    def plan_inputs(self, headroom: float = 1.0) -> tuple[list[RequestSpec], list[tuple[int, float, float]]]:
        """``trace(headroom)`` and, for the requests of it that finished, (index in the trace, measured TTFT,
        measured TPOT)."""
        trace = self.trace(headroom)
        measured = [(i, s.ttft_s, s.tpot_s) for i, (_, s) in enumerate(self._seen)
                    if s.finished and s.ttft_s is not None and s.tpot_s is not None]
        return trace, measured

    def _expire(self) -> None:
        edge = self.clock() - self.window_s
        while self._seen and self._seen[0][1].arrival < edge:
            rid, _ = self._seen.popleft()
            self._by_id.pop(rid, None)

    def summary(self) -> dict:
        """Requests, arrival rate (req/s), mean prompt and output tokens over the window."""
        self._expire()
        seen = [s for _, s in self._seen]
        if not seen:
            return {"requests": 0, "rate": 0.0, "mean_prompt_tokens": 0.0, "mean_output_tokens": 0.0}
        done = [s.output_tokens for s in seen if s.finished] or [s.output_tokens for s in seen]
        return {"requests": len(seen), "rate": len(seen) / self.window_s,
                "mean_prompt_tokens": sum(s.prompt_tokens for s in seen) / len(seen),
                "mean_output_tokens": sum(done) / len(done)}

    def trace(self, headroom: float = 1.0) -> list[RequestSpec]:
        """The window's requests as a trace from the window's start, arrivals ``headroom`` times faster
        (a running request's output: what it has generated, or the finished ones' mean if that is more)."""
        self._expire()
        seen = [s for _, s in self._seen]
        finished = [s.output_tokens for s in seen if s.finished]
        mean_out = round(sum(finished) / len(finished)) if finished else 1
        start = self.clock() - self.window_s
        return [RequestSpec(max(0.0, s.arrival - start) / headroom, s.prompt_tokens,
                            max(1, s.output_tokens if s.finished else max(s.output_tokens, mean_out)))
                for s in seen]


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


class OnlinePlanner:
    """Chooses pool sizes for a trace: ``base`` is the served configuration's simulation
    (``SimConfig.from_cluster_config``), whose pools' instance counts are varied within ``bounds`` (pool ->
    (min, max)); ``time_limit_s`` bounds a decision."""

    def __init__(self, profile, base: SimConfig, slo: SLOTarget, bounds: dict[str, tuple[int, int]],
                 time_limit_s: float = 5.0):
        self.profile = profile
        self.base = base
        self.slo = slo
        self.bounds = bounds
        self.time_limit_s = time_limit_s

    def shapes(self) -> list[dict]:
        """Every shape within the bounds, fewest devices first (then fewest decode instances)."""
        pools = sorted(self.bounds)
        ranges = [range(self.bounds[p][0], self.bounds[p][1] + 1) for p in pools]
        shapes = [dict(zip(pools, counts)) for counts in itertools.product(*ranges)]
        return sorted(shapes, key=lambda s: (self._config(s).devices, s.get("decode", 0), _key(s)))

    def _config(self, shape: dict) -> SimConfig:
        changes = {pool: dataclasses.replace(getattr(self.base, pool), instances=n) for pool, n in shape.items()}
        return dataclasses.replace(self.base, **changes)

    def predict(self, shape: dict, trace: list[RequestSpec], time_limit_s: float | None = None,
                correction: tuple[float, float] = (1.0, 1.0)) -> tuple[bool, float]:
        """Whether ``shape`` meets the target on the trace, and the share of its requests that met both SLOs
        in the simulation (a lower bound where the run stopped once the verdict was known); ``correction``
        divides the TTFT and TPOT targets."""
        ttft, tpot = self.slo.ttft_s / correction[0], self.slo.tpot_s / correction[1]
        watch = AttainmentWatch(len(trace), ttft, tpot, self.slo.attainment)
        result = simulate(self.profile, self._config(shape), trace, time_limit_s=time_limit_s, watch=watch)
        share = attainment(result.outcomes(), ttft, tpot).both
        meets = result.verdict if result.verdict is not None else share >= self.slo.attainment
        return bool(meets), share

    def correction(self, shape: dict, trace: list[RequestSpec], measured: list[tuple[int, float, float]],
                   time_limit_s: float | None = None) -> tuple[float, float]:
        """Measured over simulated median (TTFT, TPOT) of the finished requests of the trace on ``shape``
        (each within [1, 10]; (1, 1) without measurements)."""
        if not measured:
            return 1.0, 1.0
        records = simulate(self.profile, self._config(shape), trace, time_limit_s=time_limit_s).records
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
               measured: list[tuple[int, float, float]] = ()) -> Decision:
        """The shape for ``trace`` (see the module doc); ``current``: pool -> instances in service now;
        ``measured``: (trace index, TTFT, TPOT) of its finished requests (``LoadWindow.measured``)."""
        t0 = time.perf_counter()
        deadline = t0 + self.time_limit_s
        predicted: dict[str, float] = {}
        shapes = self.shapes()
        here = {p: min(max(current.get(p, lo), lo), hi) for p, (lo, hi) in self.bounds.items()}
        correction = self.correction(here, trace, list(measured), self.time_limit_s / 2)

        def meets(shape: dict) -> bool:
            left = max(0.05, deadline - time.perf_counter())
            ok, predicted[_key(shape)] = self.predict(shape, trace, left, correction)
            return ok

        devices = self._config(here).devices
        chosen, met = here, meets(here)
        if met:
            tries = [s for s in shapes if self._config(s).devices < devices]
        else:
            tries = [s for s in shapes if self._config(s).devices > devices]
        for shape in tries:
            if time.perf_counter() > deadline:
                break
            if meets(shape):
                chosen, met = shape, True
                break
        if not met:  # nothing met it in time: the best seen, the larger on a tie
            chosen = max((s for s in shapes if _key(s) in predicted),
                         key=lambda s: (predicted[_key(s)], self._config(s).devices))
        return Decision(chosen, predicted, dict(inputs or {}), time.perf_counter() - t0, met, correction)


@dataclass
class ScalePolicy:
    """When a decision becomes a resize (see the module doc). ``clock``: time.monotonic."""

    cooldown_s: float = 30.0
    scale_down_after: int = 3
    clock: object = time.monotonic
    max_backoff_s: float = 600.0
    _last_action: dict = field(default_factory=dict)  # pool -> when it was last resized
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
            if now - self._last_action.get(pool, -math.inf) < self.cooldown(pool):
                continue
            if want > have:
                out[pool] = want
            elif want < have and self._lower_streak[pool] >= self.scale_down_after:
                out[pool] = have - 1
        return out

    def cooldown(self, pool: str) -> float:
        """Seconds after a resize of ``pool`` before the next: ``cooldown_s``, doubled per failure in a row."""
        return min(self.max_backoff_s, self.cooldown_s * 2 ** self._failures.get(pool, 0))

    def acted(self, pool: str, failed: bool = False) -> None:
        self._last_action[pool] = self.clock()
        self._lower_streak[pool] = 0
        self._failures[pool] = self._failures.get(pool, 0) + 1 if failed else 0
