"""Choosing the speculation length k each step.

Cost model: the time of one forward pass is linear in what it moves and computes,
    t = c0 + c_seq * B + c_kv * (KV tokens read) + c_tok * (new tokens),
fitted by least squares on steps profiled at start and refreshed online from measured steps (one model
for target passes, one for draft passes). For a batch of B sequences with contexts L_b and acceptance
rate a, a step with k drafts costs  T(k) = k * t_draft + t_verify(k)  and yields  B * E(k)  tokens,
E(k) = (1 - a^(k+1)) / (1 - a)  (accepted drafts + one recovered/bonus token). The adaptive policy picks
the k in 0..max_k maximising B * E(k) / T(k) (SmartSpec's goodput; MagicDec's bottleneck analysis is the
same trade-off), with k = 0 meaning a plain decode step, and never picks a k whose step time exceeds the
TPOT SLO when one is set.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

FEATURES = ("passes", "seqs", "kv_tokens", "new_tokens")


@dataclass(frozen=True)
class PassShape:
    """What forward passes process. The model is linear, so several passes timed together are one
    observation whose features are the sums (``passes`` counts them)."""

    seqs: int
    kv_tokens: int
    new_tokens: int
    passes: int = 1

    def features(self) -> list[float]:
        return [float(self.passes), float(self.seqs), float(self.kv_tokens), float(self.new_tokens)]

    def __add__(self, other: "PassShape") -> "PassShape":
        return PassShape(self.seqs + other.seqs, self.kv_tokens + other.kv_tokens,
                         self.new_tokens + other.new_tokens, self.passes + other.passes)


class LinearCostModel:
    """Least-squares fit of pass time (seconds) to PassShape features, over a sliding window."""

    def __init__(self, window: int = 512, refit_every: int = 16):
        self._obs: deque[tuple[list[float], float]] = deque(maxlen=window)
        self._coef: list[float] | None = None
        self._since_fit = 0
        self.refit_every = refit_every
        self.fit_error = float("nan")  # relative RMS error of the last fit

    @property
    def ready(self) -> bool:
        return self._coef is not None

    def observe(self, shape: PassShape, seconds: float) -> None:
        self._obs.append((shape.features(), seconds))
        self._since_fit += 1
        if self._since_fit >= self.refit_every or self._coef is None:
            self.fit()

    def fit(self) -> None:
        if len(self._obs) < len(FEATURES):
            return
        x = torch.tensor([f for f, _ in self._obs], dtype=torch.float64)
        y = torch.tensor([t for _, t in self._obs], dtype=torch.float64)
        # scale columns so the solve is well conditioned, ridge-regularise lightly
        scale = x.abs().amax(dim=0).clamp(min=1.0)
        xs = x / scale
        coef = torch.linalg.solve(xs.T @ xs + 1e-6 * torch.eye(xs.shape[1], dtype=torch.float64), xs.T @ y) / scale
        # negative marginal costs are fitting noise: clamp them
        coef = coef.clamp(min=0.0)
        pred = x @ coef
        self.fit_error = float(torch.sqrt(torch.mean(((pred - y) / y.clamp(min=1e-9)) ** 2)))
        self._coef = coef.tolist()
        self._since_fit = 0

    def predict(self, shape: PassShape) -> float:
        if self._coef is None:
            raise RuntimeError("cost model has no observations yet")
        return max(1e-6, sum(c * f for c, f in zip(self._coef, shape.features())))

    def coefficients(self) -> dict[str, float]:
        return dict(zip(FEATURES, self._coef or [float("nan")] * len(FEATURES)))


class AcceptanceEstimator:
    """Per-token acceptance rate, an exponential moving average over verification steps."""

    def __init__(self, prior: float = 0.7, smoothing: float = 0.1):
        self.rate = prior
        self.smoothing = smoothing

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed > 0:
            self.rate += self.smoothing * (accepted / proposed - self.rate)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens per sequence from one step with k drafts at per-token acceptance ``rate``."""
    rate = min(max(rate, 0.0), 0.999)
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


@dataclass(frozen=True)
class KChoice:
    k: int
    expected_tokens_per_s: float
    predicted_step_s: float


class AdaptiveK:
    """Maximises expected tokens/s under the cost models, the acceptance estimate and the SLO."""

    # After this many k = 0 steps in a row, try k = 1 once so the acceptance estimate stays fresh.
    EXPLORE_AFTER = 64

    def __init__(self, max_k: int, target_cost: LinearCostModel, draft_cost: LinearCostModel,
                 acceptance: AcceptanceEstimator, tpot_slo_s: float | None = None):
        self.max_k = max_k
        self.target_cost = target_cost
        self.draft_cost = draft_cost
        self.acceptance = acceptance
        self.tpot_slo_s = tpot_slo_s
        self._zero_streak = 0

    def choose(self, target_pass, draft_pass) -> KChoice:
        """target_pass(k) -> PassShape of the verify pass (k = 0: plain decode); draft_pass(step) ->
        PassShape of draft step ``step``."""
        if not (self.target_cost.ready and self.draft_cost.ready):
            return KChoice(min(1, self.max_k), 0.0, 0.0)  # speculate once to get observations
        best: KChoice | None = None
        draft_time = 0.0
        for k in range(self.max_k + 1):
            if k > 0:
                draft_time += self.draft_cost.predict(draft_pass(k - 1))
            step = draft_time + self.target_cost.predict(target_pass(k))
            if self.tpot_slo_s is not None and step > self.tpot_slo_s and k > 0:
                break  # larger k only costs more
            seqs = target_pass(k).seqs
            rate = seqs * expected_tokens(self.acceptance.rate, k) / step
            if best is None or rate > best.expected_tokens_per_s:
                best = KChoice(k, rate, step)
        assert best is not None
        if best.k == 0:
            self._zero_streak += 1
            if self._zero_streak >= self.EXPLORE_AFTER and self.max_k > 0:
                self._zero_streak = 0
                return KChoice(1, best.expected_tokens_per_s, best.predicted_step_s)
        else:
            self._zero_streak = 0
        return best
