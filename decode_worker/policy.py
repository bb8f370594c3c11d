"""Choosing the speculation length k each step.

Cost model: the time of one forward pass is linear in what it moves and computes,
    t = c0 + c_seq * B + c_kv * (KV tokens read) + c_tok * (new tokens) + c_att * (KV tokens x queries),
(the last term is attention's arithmetic: each of a sequence's k+1 verify queries attends to its whole
KV, so the cost of a verify pass grows with k times the context),
fitted by least squares on steps profiled at start and refreshed online from measured steps (one model
for target passes, one for draft passes). For a batch of B sequences with contexts L_b and acceptance
conditional acceptance rates a_1, a_2, ... by draft depth (measured online), a step with k drafts costs
T(k) = k * t_draft + t_verify(k)  and yields  B * E(k)  tokens,  E(k) = 1 + sum_{i<=k} a_1 ... a_i
(accepted drafts + one recovered/bonus token). The adaptive policy picks
the k in 0..max_k maximising B * E(k) / T(k) (SmartSpec's goodput; MagicDec's bottleneck analysis is the
same trade-off), with k = 0 meaning a plain decode step, and never picks a k whose step time exceeds the
TPOT SLO when one is set.

A single linear model over all shapes is biased in places (it can overpredict the gain of speculating at
short contexts and batch 1). :class:`StepCorrection` removes that bias from measurements,
separately for the two parts of a step, because their biases differ and combine differently with k:
the draft passes get one EMA of measured / predicted time per (batch bucket, context bucket), which
applies to every k (k draft passes of the same shape share their bias); the verify pass gets one per
(k, batch bucket, context bucket). One factor for the whole step per k would mix the two: a k not yet
measured would borrow the factor of one that was, with the wrong share of draft time in it (an
underrated draft inflates a long k's factor; k = 1, borrowing it, would look as bad as that k, while
plain decoding, with its own factor, looks better than both).
Unmeasured cells keep factor 1, which makes them look as good as the model says, so the policy tries
them and learns their factor.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from decode_worker.config import SpeculationConfig

FEATURES = ("passes", "seqs", "kv_tokens", "new_tokens", "kv_queries")


@dataclass(frozen=True)
class PassShape:
    """What forward passes process. The model is linear, so several passes timed together are one
    observation whose features are the sums (``passes`` counts them).

    ``kv_queries`` = sum over sequences of (KV tokens read) x (new tokens); when not given it is derived
    assuming every sequence has the same number of new tokens (true of decode, verify and draft passes)."""

    seqs: int
    kv_tokens: int
    new_tokens: int
    passes: int = 1
    kv_queries: int | None = None

    def __post_init__(self) -> None:
        if self.kv_queries is None:
            per_seq = self.new_tokens / self.seqs if self.seqs else 0.0
            object.__setattr__(self, "kv_queries", int(round(self.kv_tokens * per_seq)))

    def features(self) -> list[float]:
        return [float(self.passes), float(self.seqs), float(self.kv_tokens), float(self.new_tokens),
                float(self.kv_queries)]

    def __add__(self, other: "PassShape") -> "PassShape":
        return PassShape(self.seqs + other.seqs, self.kv_tokens + other.kv_tokens,
                         self.new_tokens + other.new_tokens, self.passes + other.passes,
                         self.kv_queries + other.kv_queries)


def fit_nonnegative_relative(x: list[list[float]], y: list[float]) -> tuple[list[float], float]:
    """Coefficients c >= 0 minimising the relative error sum(((x @ c) / y - 1)^2) (a 1 ms pass counts as
    much as a 1 s one; a negative marginal cost is fitting noise), and the relative RMS error. With a
    handful of features the exact non-negative optimum is found by solving on every subset of the columns
    and keeping the best solution that is >= 0 throughout. The subsets are solved on the small Gram matrix
    (features x features), so a refit costs well under a millisecond (the worker refits online)."""
    xt = np.asarray(x, dtype=np.float64)
    yt = np.maximum(np.asarray(y, dtype=np.float64), 1e-12)
    a = xt / yt[:, None]  # relative residual: a @ c - 1
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    a = a / scale
    gram, rhs, n = a.T @ a, a.sum(axis=0), a.shape[1]
    ridge = 1e-12 * max(1.0, float(np.trace(gram)))  # rank-deficient subsets (collinear columns)
    best, best_loss = np.zeros(n), float("inf")
    for size in range(1, n + 1):
        for cols in itertools.combinations(range(n), size):
            idx = list(cols)
            g = gram[np.ix_(idx, idx)] + ridge * np.eye(size)
            sol = np.linalg.solve(g, rhs[idx])
            if (sol < 0).any() or not np.isfinite(sol).all():
                continue
            loss = float(sol @ g @ sol - 2 * rhs[idx] @ sol)  # + len(y), the same for every subset
            if loss < best_loss:
                best_loss, best = loss, np.zeros(n)
                best[idx] = sol
    coef = best / scale
    err = float(np.sqrt(np.mean(((xt @ coef - yt) / yt) ** 2)))
    return coef.tolist(), err


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
        # refit every refit_every observations, or every 1/8 of the window once it is larger (a fit costs
        # ~1 ms of numpy; a full window changes little in 1/8 of its points)
        if self._since_fit >= max(self.refit_every, len(self._obs) // 8) or self._coef is None:
            self.fit()

    # fewer points than features is fine: the non-negative subset fit picks the columns they support
    MIN_POINTS = 3

    def fit(self) -> None:
        if len(self._obs) < self.MIN_POINTS:
            return
        coef, self.fit_error = fit_nonnegative_relative([f for f, _ in self._obs], [t for _, t in self._obs])
        self._coef = coef
        self._since_fit = 0

    def predict(self, shape: PassShape) -> float:
        if self._coef is None:
            raise RuntimeError("cost model has no observations yet")
        return max(1e-6, sum(c * f for c, f in zip(self._coef, shape.features())))

    def coefficients(self) -> dict[str, float]:
        return dict(zip(FEATURES, self._coef or [float("nan")] * len(FEATURES)))


class AcceptanceEstimator:
    """Acceptance of draft tokens by depth: ``rate_at(i)`` = P(draft i accepted | drafts 1 .. i-1 accepted).

    A sequence's step with k proposals and a accepted is a successes at depths 1 .. a and, when a < k, one
    failure at depth a + 1 (deeper drafts are never tried). Each depth keeps an exponentially smoothed
    success rate over its own trials, starting from a prior pseudo-trial of weight ``prior_weight``; a depth
    never tried borrows the rate of the depth above it. Expected tokens of a step with k drafts are
    1 + sum_{i <= k} prod_{j <= i} rate_at(j) (accepted drafts plus one recovered / bonus token).

    Why by depth: a self-speculative draft writes its own (sparse-attention) KV for the tokens it proposes,
    so its errors compound along a proposal and the conditional acceptance falls with depth. On the bundled
    model's phase-3 weights at batch 1, 8K context, budget 256, depth 1 is accepted 0.90 of the time but a 5-token proposal
    yields 2.25 accepted tokens, not the 3.69 of a constant 0.90 (the geometric model); with one pooled rate
    the policy chose k = 4-5 there and ran at 0.7x autoregressive speed."""

    MAX_DEPTH = 32

    # smoothing is per trial: 0.02 remembers ~50 of them (50 steps at batch 1, 12 at batch 4). A whole
    # step's trials (observe_step) move an estimate by at most max_step_weight, so that the memory is also
    # at least ~1 / max_step_weight steps: per trial alone, a batch of 32 would remember 1.5 steps, and
    # acceptance varies along the text, so the chosen k would follow the last step's luck (at 32 x 4K the
    # policy went k = 5, 1, 5 between the four decisions of a 16-step run; benchmarks/spec_decode.py at
    # commit ee09e41).
    def __init__(self, prior: float = 0.7, smoothing: float = 0.02, prior_weight: float = 0.1,
                 max_step_weight: float = 0.125):
        self.smoothing = smoothing
        self.max_step_weight = max_step_weight
        self.prior = prior
        self.prior_weight = prior_weight
        self._hits: list[float] = []    # smoothed successes per depth (index 0 = depth 1), tried depths only
        self._weight: list[float] = []  # smoothed trials per depth

    def rate_at(self, depth: int) -> float:
        """Conditional acceptance rate of draft ``depth`` (1-based)."""
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        i = min(depth, len(self._hits))
        return self.prior if i == 0 else self._hits[i - 1] / self._weight[i - 1]

    @property
    def rate(self) -> float:
        """Acceptance rate of the first draft token (what a one-token proposal would see)."""
        return self.rate_at(1)

    @rate.setter
    def rate(self, value: float) -> None:
        """Set every depth to ``value`` outright (the geometric model; a simulator feeding known rates).
        Later observations move the estimates."""
        self._hits = [float(value)] * self.MAX_DEPTH
        self._weight = [1.0] * self.MAX_DEPTH

    def expected_tokens(self, k: int) -> float:
        """Tokens per sequence from one step with k drafts: 1 + sum_i prod_{j <= i} rate_at(j)."""
        return self.expected_tokens_upto(k)[k]

    def expected_tokens_upto(self, max_k: int) -> list[float]:
        """``expected_tokens(k)`` for k = 0 .. max_k, in one pass."""
        out = [1.0]
        total, chain = 1.0, 1.0
        for depth in range(1, max_k + 1):
            chain *= min(max(self.rate_at(depth), 0.0), 1.0)
            total += chain
            out.append(total)
        return out

    def observe(self, proposed: int, accepted: int) -> None:
        """One sequence's verification: ``accepted`` of ``proposed`` drafts (a prefix) were accepted."""
        self.observe_step([(proposed, accepted)])

    def observe_step(self, verdicts: list[tuple[int, int]]) -> None:
        """One step's verifications, ``(proposed, accepted)`` per sequence (accepted drafts are a prefix).

        Each depth's estimate moves towards the step's success share at that depth with the weight of its
        n trials, 1 - (1 - smoothing)^n (the same as n single updates with equal outcomes), capped at
        ``max_step_weight``."""
        trials = [0] * self.MAX_DEPTH
        successes = [0] * self.MAX_DEPTH
        for proposed, accepted in verdicts:
            if not 0 <= accepted <= proposed:
                raise ValueError(f"accepted must be in [0, proposed={proposed}], got {accepted}")
            for i in range(min(proposed, accepted + 1, self.MAX_DEPTH)):
                trials[i] += 1
                successes[i] += i < accepted
        for i, n in enumerate(trials):
            if n == 0:
                break  # depth i + 1 untried, so are the deeper ones
            if i >= len(self._hits):  # first trial at this depth: prior = the depth above it
                start = self.rate_at(i + 1)
                self._hits.append(start * self.prior_weight)
                self._weight.append(self.prior_weight)
            lam = min(1.0 - (1.0 - self.smoothing) ** n, self.max_step_weight)
            self._hits[i] += lam * (successes[i] / n - self._hits[i])
            self._weight[i] += lam * (1.0 - self._weight[i])


def expected_tokens(rate: float, k: int) -> float:
    """Tokens per sequence from one step with k drafts at per-token acceptance ``rate``."""
    rate = min(max(rate, 0.0), 0.999)
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


@dataclass(frozen=True)
class KChoice:
    k: int
    expected_tokens_per_s: float
    predicted_step_s: float  # corrected prediction
    raw_draft_s: float = 0.0  # the draft cost model's prediction for the k draft passes, before correction
    raw_verify_s: float = 0.0  # the target cost model's prediction for the verify (k = 0: decode) pass
    cell: tuple = ()  # StepCorrection cell of this step's shape (without k)


class StepCorrection:
    """EMAs of measured / predicted time, 1.0 until measured: for draft passes per cell, for the verify
    pass per (k, cell). Cells bucket the batch and the mean context by powers of two (batch 1, 2-3, 4-7,
    ...; context 512-1023, 1024-2047, ...)."""

    def __init__(self, smoothing: float = 0.2, lo: float = 0.25, hi: float = 4.0):
        self.smoothing = smoothing
        self.lo, self.hi = lo, hi  # clamp: one pathological step (a GC pause) must not dominate
        self._ratio: dict[tuple, float] = {}  # verify: (k, *cell) -> ratio
        self._draft_ratio: dict[tuple, float] = {}  # draft: cell -> ratio

    @staticmethod
    def cell(seqs: int, kv_tokens: int) -> tuple:
        return (seqs.bit_length(), (kv_tokens // max(1, seqs)).bit_length())

    def factor(self, k: int, cell: tuple) -> float:
        """The verify pass's measured/predicted ratio for (k, cell). A speculative k not measured yet in
        this cell borrows the ratio of the nearest measured speculative k (a verify pass's bias varies
        slowly with its number of queries); plain decoding (k = 0) has its own ratio, 1.0 until measured,
        so that an unmeasured k = 0 is tried rather than written off with speculation's bias."""
        ratio = self._ratio.get((k, *cell))
        if ratio is not None or k == 0:
            return 1.0 if ratio is None else ratio
        measured = [kk for (kk, *c) in self._ratio if kk > 0 and tuple(c) == cell]
        if not measured:
            return 1.0
        return self._ratio[(min(measured, key=lambda kk: (abs(kk - k), kk)), *cell)]

    def summary(self) -> dict:
        """The measured factors, keyed ``"b<batch bucket>/c<context bucket>"`` (bit lengths, as in
        :meth:`cell`): ``{"draft": {cell: f}, "verify": {cell: {k: f}}}``."""
        name = lambda cell: "b%d/c%d" % tuple(cell)  # noqa: E731
        verify: dict[str, dict[int, float]] = {}
        for (k, *cell), ratio in sorted(self._ratio.items()):
            verify.setdefault(name(cell), {})[k] = ratio
        return {"draft": {name(c): r for c, r in sorted(self._draft_ratio.items())}, "verify": verify}

    def measured(self, k: int, cell: tuple) -> bool:
        """Whether (k, cell) has a verify factor of its own (else :meth:`factor` borrows or assumes 1)."""
        return (k, *cell) in self._ratio

    def draft_factor(self, cell: tuple) -> float:
        """The draft passes' measured/predicted ratio in ``cell`` (any k), 1.0 until measured."""
        return self._draft_ratio.get(cell, 1.0)

    # Once a cell has a ratio, one observation may move it by at most this factor before smoothing: a
    # step slowed 5x by a GC pause or a busy neighbour must not make the policy shun that k for good
    # (a k that is not chosen is not measured again, so an inflated ratio would stick).
    OUTLIER_CLIP = 1.5

    def observe(self, k: int, cell: tuple, predicted_s: float, measured_s: float) -> None:
        """A verify (k > 0) or decode (k = 0) pass of ``cell`` took ``measured_s``; predicted ``predicted_s``."""
        self._update(self._ratio, (k, *cell), predicted_s, measured_s)

    def observe_draft(self, cell: tuple, predicted_s: float, measured_s: float) -> None:
        """The draft passes of one step in ``cell`` took ``measured_s`` together; predicted ``predicted_s``."""
        self._update(self._draft_ratio, cell, predicted_s, measured_s)

    def _update(self, ratios: dict[tuple, float], key: tuple, predicted_s: float, measured_s: float) -> None:
        ratio = min(self.hi, max(self.lo, measured_s / max(predicted_s, 1e-9)))
        old = ratios.get(key)
        if old is not None:
            ratio = min(old * self.OUTLIER_CLIP, max(old / self.OUTLIER_CLIP, ratio))
        ratios[key] = ratio if old is None else old + self.smoothing * (ratio - old)


# Deciding k costs ~0.1 ms of Python, a few per cent of a batch-1 step on CPU. While the batch holds the same
# sequences, a decision is reused for this many steps (by the decode worker, and so by its simulation):
# contexts grow by a few tokens per step and the acceptance estimate moves slowly, so the best k rarely
# changes within that span.
CHOICE_REUSE_STEPS = 4


class AdaptiveK:
    """Maximises expected tokens/s under the cost models, the acceptance estimate and the SLO."""

    # After this many k = 0 steps in a row, try k = 1 once so the acceptance estimate stays fresh.
    EXPLORE_AFTER = 64
    # Every EXPLORE_EVERY decisions, take a neighbour of the best k (k + 1 and k - 1 in turn) when its
    # predicted rate is within EXPLORE_MARGIN of the best: its measured step time then corrects its
    # prediction (StepCorrection), so the policy settles on the k that is best in fact, not only in the
    # cost models. Bounded cost: one decision in EXPLORE_EVERY, predicted at most 1 - EXPLORE_MARGIN slower.
    EXPLORE_EVERY = 16
    EXPLORE_MARGIN = 0.9
    # A k whose verify factor this cell has not measured (it borrows another k's, or assumes 1 for
    # k = 0) is tried at once when its predicted rate is within UNMEASURED_MARGIN of the best, nearest
    # to the best k first: its prediction rests on a guess that one measured decision replaces. Bounded
    # cost: at most max_k such decisions per cell, each predicted at most 1 - UNMEASURED_MARGIN slower.
    # Without it, a policy that decides a few dozen times per cell could sit on a k whose neighbours it
    # never measured (benchmarks/spec_decode.py at commit 4d05058, batch 1 at 8K: k = 3 at 0.91x, where
    # fixed k = 1 gave 1.05x). Trying only the neighbours k +- 1 is not enough when the verify model
    # underrates how verification grows with k: once the long k's are measured, the short ones borrow
    # their inflated factor and are never tried (tests/test_speculation_policy.py,
    # test_unmeasured_k_beyond_the_neighbours_is_tried).
    UNMEASURED_MARGIN = 0.75
    # The k last chosen on the merits (not an exploration) is kept while its predicted rate stays within
    # STICK_MARGIN of the best and its factor in this cell is measured: predictions of neighbouring k's
    # differ by a few per cent on a noisy acceptance estimate and step-time correction, so without it
    # the choice flips between near-equal k's, and each flip lands on a k picked by the last steps' luck.
    STICK_MARGIN = 0.03

    def __init__(self, max_k: int, target_cost: LinearCostModel, draft_cost: LinearCostModel,
                 acceptance: AcceptanceEstimator, tpot_slo_s: float | None = None,
                 correction: StepCorrection | None = None, explore: bool = True):
        """``explore=False``: always the best k under the cost models (no exploration, no incumbent), for
        costs that are exact by construction and never corrected by ``observe_step`` (the cluster
        simulator): there every k stays unmeasured, and the unmeasured-k rule would pick a neighbour of
        the best k at every decision."""
        self.explore = explore
        self.max_k = max_k
        self.target_cost = target_cost
        self.draft_cost = draft_cost
        self.acceptance = acceptance
        self.tpot_slo_s = tpot_slo_s
        self.correction = correction or StepCorrection()
        self._zero_streak = 0
        self._decisions = 0
        self._explore_up = False
        self._incumbent: tuple[int, tuple] | None = None  # (k, cell) of the last choice on the merits

    def observe_step(self, choice: KChoice, draft_s: float, verify_s: float) -> None:
        """Feed back the measured times of a step taken with ``choice`` (same k, same batch): its draft
        passes together (0 when k = 0) and the rest of the step (the verify or decode pass and the
        acceptance test)."""
        if not choice.cell:
            return
        if choice.k > 0 and choice.raw_draft_s > 0:
            self.correction.observe_draft(choice.cell, choice.raw_draft_s, draft_s)
        if choice.raw_verify_s > 0:
            self.correction.observe(choice.k, choice.cell, choice.raw_verify_s, verify_s)

    def choose(self, target_pass, draft_pass) -> KChoice:
        """target_pass(k) -> PassShape of the verify pass (k = 0: plain decode); draft_pass(step) ->
        PassShape of draft step ``step``."""
        if not (self.target_cost.ready and self.draft_cost.ready):
            return KChoice(min(1, self.max_k), 0.0, 0.0)  # speculate once to get observations
        best: KChoice | None = None
        candidates: dict[int, KChoice] = {}
        draft_time = 0.0
        plain = target_pass(0)
        cell = StepCorrection.cell(plain.seqs, plain.kv_tokens)
        draft_factor = self.correction.draft_factor(cell)
        expected = self.acceptance.expected_tokens_upto(self.max_k)
        for k in range(self.max_k + 1):
            if k > 0:
                draft_time += self.draft_cost.predict(draft_pass(k - 1))
            verify_time = self.target_cost.predict(target_pass(k))
            step = draft_time * draft_factor + verify_time * self.correction.factor(k, cell)
            if self.tpot_slo_s is not None and step > self.tpot_slo_s and k > 0:
                break  # larger k only costs more
            rate = plain.seqs * expected[k] / step
            candidates[k] = KChoice(k, rate, step, draft_time, verify_time, cell)
            if best is None or rate > best.expected_tokens_per_s:
                best = candidates[k]
        assert best is not None
        if not self.explore:
            return best
        self._decisions += 1
        for k in sorted(candidates, key=lambda kk: (abs(kk - best.k), kk)):
            near = candidates[k]
            if (k != best.k and not self.correction.measured(k, cell)
                    and near.expected_tokens_per_s >= self.UNMEASURED_MARGIN * best.expected_tokens_per_s):
                return near
        if self._decisions % self.EXPLORE_EVERY == 0:
            self._explore_up = not self._explore_up
            for k in (best.k + 1, best.k - 1) if self._explore_up else (best.k - 1, best.k + 1):
                near = candidates.get(k)
                if near is not None and near.expected_tokens_per_s >= self.EXPLORE_MARGIN * best.expected_tokens_per_s:
                    return near
        best = self._stick(best, candidates, cell)
        self._incumbent = (best.k, cell)
        if best.k == 0:
            self._zero_streak += 1
            if self._zero_streak >= self.EXPLORE_AFTER and self.max_k > 0:
                self._zero_streak = 0
                draft1, verify1 = self.draft_cost.predict(draft_pass(0)), self.target_cost.predict(target_pass(1))
                step1 = draft1 * draft_factor + verify1 * self.correction.factor(1, cell)
                return KChoice(1, best.expected_tokens_per_s, step1, draft1, verify1, cell)
        else:
            self._zero_streak = 0
        return best

    def _stick(self, best: KChoice, candidates: dict[int, KChoice], cell: tuple) -> KChoice:
        """The incumbent k instead of ``best`` when it is measured here and predicted nearly as good."""
        if self._incumbent is None or self._incumbent[1] != cell:
            return best
        kept = candidates.get(self._incumbent[0])
        if (kept is None or kept.k == best.k or not self.correction.measured(kept.k, cell)
                or kept.expected_tokens_per_s < (1.0 - self.STICK_MARGIN) * best.expected_tokens_per_s):
            return best
        return kept


class StepK:
    """Each step's speculation length, decided the same way by the decode worker and by its simulation
    (``planner/sim_instances.py``): 0 without speculation, ``k`` under the fixed policy, else the adaptive
    policy's choice for the batch, reused for CHOICE_REUSE_STEPS steps while the batch holds the same
    sequences."""

    def __init__(self, spec: SpeculationConfig, policy: AdaptiveK | None):
        self.spec = spec
        self.policy = policy
        self._cached: tuple[tuple, int, KChoice] | None = None  # (batch key, reuses left, choice)

    def choose(self, key: tuple, lens: list[int], draft_kv_tokens: Callable[[int, int], int]) -> tuple[int, KChoice | None]:
        """(k, the adaptive policy's choice behind it or None) for a batch: ``key`` names its sequences in
        admission order, ``lens`` are their lengths, ``draft_kv_tokens(n, step)`` the KV tokens draft step
        ``step`` reads for a sequence of length n."""
        if not self.spec.enabled:
            return 0, None
        if self.spec.k_policy == "fixed" or self.policy is None:
            return self.spec.k, None
        cached = self._cached
        if cached is not None and cached[0] == key and cached[1] > 0:
            self._cached = (key, cached[1] - 1, cached[2])
            return cached[2].k, cached[2]
        b, total = len(lens), sum(lens)
        choice = self.policy.choose(lambda k: PassShape(b, total + b * k, b * (k + 1)),
                                    lambda step: PassShape(b, sum(draft_kv_tokens(n, step) for n in lens), b))
        self._cached = (key, CHOICE_REUSE_STEPS - 1, choice)
        return choice.k, choice

    def forget(self) -> None:
        """The batch changed outside a step: decide afresh."""
        self._cached = None
