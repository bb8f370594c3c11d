"""SLO attainment and goodput: one definition shared by the sweep (measured requests) and the
simulator (simulated requests), DistServe's.

A request attains the SLO when it finished, its TTFT <= ttft_slo and its mean TPOT (time per output
token after the first) <= tpot_slo. Failed or unfinished requests never attain. Goodput at a target
attainment (e.g. 90 %) is the highest request rate at which the attainment is still >= the target,
interpolated linearly between the swept rates.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestOutcome:
    """What attainment needs to know about one request (seconds)."""

    ok: bool  # finished normally (stop or length); False for errors and aborts
    ttft_s: float
    tpot_s: float  # mean over output tokens after the first; 0 for single-token outputs


@dataclass(frozen=True)
class Attainment:
    both: float
    ttft_only: float
    tpot_only: float
    requests: int


def attainment(outcomes: list[RequestOutcome], ttft_slo_s: float, tpot_slo_s: float) -> Attainment:
    """Shares of requests meeting both SLOs, only the TTFT one, only the TPOT one."""
    if not outcomes:
        return Attainment(0.0, 0.0, 0.0, 0)
    n = len(outcomes)
    ttft = [o.ok and o.ttft_s <= ttft_slo_s for o in outcomes]
    tpot = [o.ok and o.tpot_s <= tpot_slo_s for o in outcomes]
    return Attainment(sum(a and b for a, b in zip(ttft, tpot)) / n, sum(ttft) / n, sum(tpot) / n, n)


class AttainmentWatch:
    """Decides whether a trace of ``requests`` requests attains ``target`` (a share, as ``attainment``'s) as
    soon as the requests settled so far decide it: ``finished`` settles a finished request, ``miss`` one that
    cannot attain any more (each request settles once). ``verdict`` is None until enough of either are in.

    ``slo``: which attainment is watched, ``both``, ``ttft_only`` or ``tpot_only`` (the fields of
    ``Attainment``); the watched share is hits / requests, so the verdict is exactly
    ``getattr(attainment(outcomes), slo) >= target`` of the finished trace."""

    SLOS = ("both", "ttft_only", "tpot_only")

    def __init__(self, requests: int, ttft_slo_s: float, tpot_slo_s: float, target: float, slo: str = "both"):
        if slo not in self.SLOS:
            raise ValueError(f"slo: must be one of {', '.join(self.SLOS)}, got {slo!r}")
        if requests < 1:
            raise ValueError(f"requests: must be >= 1, got {requests}")
        self.requests, self.target = requests, target
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self.checks_ttft, self.checks_tpot = slo in ("both", "ttft_only"), slo in ("both", "tpot_only")
        self._settled: set[int] = set()
        self.hits = self.misses = 0
        self.ttft_misses = self.tpot_misses = 0  # misses by the SLO they missed (a request may miss both)

    def finished(self, request: int, ttft_s: float, tpot_s: float) -> None:
        """A request finished with these latencies: a hit or a miss (nothing if it already missed)."""
        late_first = self.checks_ttft and ttft_s > self.ttft_slo_s
        late_tokens = self.checks_tpot and tpot_s > self.tpot_slo_s
        if late_first or late_tokens:
            self.miss(request, late_first, late_tokens)
        elif request not in self._settled:
            self._settled.add(request)
            self.hits += 1

    def miss(self, request: int, ttft: bool = False, tpot: bool = False) -> None:
        """A request cannot attain: its first token (``ttft``) or its tokens (``tpot``) are or will be late."""
        if request not in self._settled:
            self._settled.add(request)
            self.misses += 1
            self.ttft_misses += ttft
            self.tpot_misses += tpot

    @property
    def binding(self) -> str:
        """The SLO that more of the misses so far missed: ``TTFT`` or ``TPOT`` (``-``: no miss yet)."""
        if not self.misses:
            return "-"
        return "TTFT" if self.ttft_misses > self.tpot_misses else "TPOT"

    @property
    def verdict(self) -> bool | None:
        if self.hits / self.requests >= self.target:
            return True
        if (self.requests - self.misses) / self.requests < self.target:
            return False
        return None


def goodput(rates: list[float], attained: list[float], target: float) -> float:
    """Highest rate with attainment >= target, interpolating between the first passing rate and the
    first failing rate above it; 0 when even the lowest rate misses. Rates must be ascending."""
    if any(b <= a for a, b in zip(rates, rates[1:])):
        raise ValueError("rates must be strictly ascending")
    best = 0.0
    for i, (r, a) in enumerate(zip(rates, attained)):
        if a >= target:
            best = r
            continue
        if i > 0 and attained[i - 1] >= target:
            prev_r, prev_a = rates[i - 1], attained[i - 1]
            best = prev_r + (r - prev_r) * (prev_a - target) / (prev_a - a)
        break
    return best
