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
