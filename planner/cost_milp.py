"""Mélange's cost-minimising GPU allocation as a mixed-integer program (no torch; solved with
``scipy.optimize.milp``, i.e. HiGHS).

The workload is cut into *slices* by request size (prompt x output length buckets), each with its share of
the target rate. An *option* is one kind of instance a pool may run: a GPU type, a parallelism shape and
(for decode) a speculation setting, with its price per hour and, per slice, the highest rate one instance
sustains for that slice's requests within the SLOs (taken from the simulator by the caller; 0: it cannot
serve them). The program chooses how many instances of each option to rent and which share of each
slice's load each option serves:

    minimise    sum_o price_o * n_o
    subject to  sum_{o in pool p} x[o, s] = 1                   every pool serves every slice
                sum_s x[o, s] * rate_s / capacity[o, s] <= n_o   an option's load fits its instances
                sum_{o on GPU g} gpus_o * n_o <= limit_g        availability
                n_o integer >= 0, x[o, s] in [0, 1]

The second line is Mélange's bin packing: a slice's load on an option uses ``rate / capacity`` of an
instance, and loads add up. ``mixing`` restricts the solution to what the serving side can run:

* ``mixed``: any options in a pool (needs a router that weighs instances by capacity);
* ``one_per_pool``: one option per pool (each pool one GPU type and shape; pools may differ);
* ``one_type``: one GPU type for the whole deployment (the single-type baseline).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass, field

import numpy as np

MIXING = ("mixed", "one_per_pool", "one_type")


class PackingError(ValueError):
    """A malformed problem; the message starts with the field."""


@dataclass(frozen=True)
class Slice:
    """A request-size bucket of the workload and its arrival rate (req/s)."""

    name: str
    rate: float


@dataclass(frozen=True)
class InstanceOption:
    """One kind of instance a pool may run. ``capacity[s]``: req/s of slice ``s`` one instance sustains
    within the SLOs (0: cannot serve it); ``price_per_hour``: the whole instance's (all its GPUs)."""

    key: str
    pool: str
    gpu: str
    gpus: int
    price_per_hour: float
    capacity: tuple[float, ...]


@dataclass(frozen=True)
class PackingProblem:
    slices: tuple[Slice, ...]
    options: tuple[InstanceOption, ...]
    pools: tuple[str, ...]  # every one must serve every slice
    gpu_limits: dict[str, int] = field(default_factory=dict)  # GPU type -> most GPUs available
    mixing: str = "mixed"

    def __post_init__(self) -> None:
        if self.mixing not in MIXING:
            raise PackingError(f"mixing: must be one of {', '.join(MIXING)}, got {self.mixing!r}")
        if not self.slices or not self.pools:
            raise PackingError("slices, pools: need at least one of each")
        for s in self.slices:
            if not (s.rate >= 0 and math.isfinite(s.rate)):
                raise PackingError(f"slices.{s.name}.rate: must be >= 0, got {s.rate}")
        keys = set()
        for o in self.options:
            if o.key in keys:
                raise PackingError(f"options.{o.key}: named twice")
            keys.add(o.key)
            if o.pool not in self.pools:
                raise PackingError(f"options.{o.key}.pool: must be one of {', '.join(self.pools)}, got {o.pool!r}")
            if len(o.capacity) != len(self.slices) or any(c < 0 or not math.isfinite(c) for c in o.capacity):
                raise PackingError(f"options.{o.key}.capacity: need {len(self.slices)} finite values >= 0")
            if o.gpus < 1 or not o.price_per_hour > 0:
                raise PackingError(f"options.{o.key}: gpus must be >= 1 and price_per_hour > 0")


@dataclass(frozen=True)
class Packing:
    """A solution: instances per option (only those rented), each option's share of each slice, and cost."""

    counts: dict[str, int]
    shares: dict[tuple[str, str], float]  # (option key, slice name) -> share of the slice's load
    cost_per_hour: float

    def load(self, problem: PackingProblem, key: str) -> float:
        """Instances' worth of load on option ``key`` (at most its count)."""
        opt = next(o for o in problem.options if o.key == key)
        return sum(self.shares.get((key, s.name), 0.0) * s.rate / c
                   for s, c in zip(problem.slices, opt.capacity) if c > 0)


def solve_packing(problem: PackingProblem, time_limit_s: float = 30.0) -> Packing | None:
    """The cheapest packing, or None when no allocation serves every slice (within the GPU limits)."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # a third of a second: only the packing needs it
    slices, options = problem.slices, problem.options
    live = [s for s in range(len(slices)) if slices[s].rate > 0]
    pairs = [(o, s) for o, opt in enumerate(options) for s in live if opt.capacity[s] > 0]
    gpus = sorted({o.gpu for o in options})
    n_o, n_x = len(options), len(pairs)
    # variables: n (one per option), x (one per servable pair), then the selectors of the mixing rule
    selectors = {"mixed": [], "one_per_pool": list(range(n_o)), "one_type": gpus}[problem.mixing]
    n_var = n_o + n_x + len(selectors)
    x_at = {pair: n_o + i for i, pair in enumerate(pairs)}
    # an option never needs more instances than serving every slice alone takes
    upper = [sum(math.ceil(slices[s].rate / opt.capacity[s]) for s in live if opt.capacity[s] > 0)
             for opt in options]
    rows, lo, hi = [], [], []

    def row(coefs: dict[int, float], low: float, high: float) -> None:
        r = np.zeros(n_var)
        for i, v in coefs.items():
            r[i] += v
        rows.append(r)
        lo.append(low)
        hi.append(high)

    for pool in problem.pools:
        for s in live:
            cover = {x_at[(o, s)]: 1.0 for o, opt in enumerate(options) if opt.pool == pool and (o, s) in x_at}
            if not cover:
                return None  # no option of this pool can serve this slice
            row(cover, 1.0, 1.0)
    for o, opt in enumerate(options):
        load = {x_at[(o, s)]: slices[s].rate / opt.capacity[s] for s in live if (o, s) in x_at}
        load[o] = -1.0
        row(load, -np.inf, 0.0)
    for g in gpus:
        limit = problem.gpu_limits.get(g)
        if limit is not None:
            row({o: float(opt.gpus) for o, opt in enumerate(options) if opt.gpu == g}, -np.inf, float(limit))
    if problem.mixing == "one_per_pool":  # y_o = 1 for the option a pool runs
        for o in range(n_o):
            row({o: 1.0, n_o + n_x + o: -float(max(1, upper[o]))}, -np.inf, 0.0)
        for pool in problem.pools:
            row({n_o + n_x + o: 1.0 for o, opt in enumerate(options) if opt.pool == pool}, 0.0, 1.0)
    elif problem.mixing == "one_type":  # z_g = 1 for the deployment's GPU type
        for o, opt in enumerate(options):
            row({o: 1.0, n_o + n_x + gpus.index(opt.gpu): -float(max(1, upper[o]))}, -np.inf, 0.0)
        row({n_o + n_x + i: 1.0 for i in range(len(gpus))}, 0.0, 1.0)

    cost = np.zeros(n_var)
    cost[:n_o] = [opt.price_per_hour for opt in options]
    integrality = np.zeros(n_var)
    integrality[:n_o] = 1
    integrality[n_o + n_x:] = 1
    lower = np.zeros(n_var)
    upper_b = np.concatenate([np.array(upper, dtype=float), np.ones(n_x), np.ones(len(selectors))])
    with _native_stdout_silenced():
        res = milp(cost, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
                   bounds=Bounds(lower, upper_b), options={"time_limit": time_limit_s})
    if res.x is None or res.status not in (0, 1):  # 0: optimal; 1: time limit with a feasible point
        return None
    counts = {options[o].key: int(round(res.x[o])) for o in range(n_o) if round(res.x[o]) > 0}
    shares = {(options[o].key, slices[s].name): float(res.x[x_at[(o, s)]]) for (o, s) in pairs
              if res.x[x_at[(o, s)]] > 1e-9}
    return Packing(counts, shares, sum(options[o].price_per_hour * n for o, n in
                                       ((i, counts.get(opt.key, 0)) for i, opt in enumerate(options))))


@contextlib.contextmanager
def _native_stdout_silenced():
    """HiGHS (C++) may print solver diagnostics straight to file descriptor 1, past ``disp=False``: keep
    them out of the planner's output."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
