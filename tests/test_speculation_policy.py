"""The adaptive speculation-length policy on hand-set cost models (no model runs)."""

from __future__ import annotations

from decode_worker.policy import (
    AcceptanceEstimator, AdaptiveK, LinearCostModel, PassShape, StepCorrection, expected_tokens,
)


def fitted_cost(per_pass: float, per_new_token: float) -> LinearCostModel:
    """A cost model fitted to exact observations of t = per_pass + per_new_token * new_tokens."""
    model = LinearCostModel()
    for seqs, kv, new in [(1, 100, 1), (2, 300, 4), (4, 900, 8), (8, 2000, 24), (3, 50, 3), (6, 700, 18)]:
        model.observe(PassShape(seqs, kv, new), per_pass + per_new_token * new)
    model.fit()
    return model


def shapes(batch: int, context: int):
    return (lambda k: PassShape(batch, batch * (context + k), batch * (k + 1)),
            lambda step: PassShape(batch, batch * (64 + step + 1), batch))


def test_policy_speculates_when_the_models_say_it_pays():
    policy = AdaptiveK(4, fitted_cost(0.010, 0.0001), fitted_cost(0.001, 0.0), AcceptanceEstimator(prior=0.8))
    assert policy.choose(*shapes(4, 1000)).k >= 2


def test_measured_step_times_correct_a_biased_model():
    """The models promise cheap verification, but every speculative step really takes 3x as long:
    after a few measured steps the policy stops speculating for that shape, and only for it."""
    policy = AdaptiveK(4, fitted_cost(0.010, 0.0001), fitted_cost(0.001, 0.0), AcceptanceEstimator(prior=0.8))
    target, draft = shapes(4, 1000)
    for _ in range(40):
        choice = policy.choose(target, draft)
        slow = 3.0 if choice.k > 0 else 1.0
        policy.observe_step(choice, choice.raw_draft_s * slow, choice.raw_verify_s * slow)
    assert policy.choose(target, draft).k == 0
    # a shape in another cell (batch 32, long context) has not been corrected
    assert policy.choose(*shapes(32, 8000)).k > 0


def test_step_correction_cells_and_clamping():
    corr = StepCorrection(smoothing=0.5)
    cell = StepCorrection.cell(4, 4 * 1000)
    assert cell == StepCorrection.cell(7, 7 * 1023) != StepCorrection.cell(8, 8 * 1000)
    assert corr.factor(2, cell) == 1.0
    corr.observe(2, cell, predicted_s=1.0, measured_s=100.0)  # clamped
    assert corr.factor(2, cell) == corr.hi
    corr.observe(2, cell, predicted_s=1.0, measured_s=3.5)
    assert corr.factor(2, cell) == (corr.hi + 3.5) / 2
    before = corr.factor(2, cell)
    corr.observe(2, cell, predicted_s=1.0, measured_s=1.0)  # a jump: clipped to 1 / OUTLIER_CLIP of the factor
    assert abs(corr.factor(2, cell) - before * (1 + 1 / corr.OUTLIER_CLIP) / 2) < 1e-12
    # an unmeasured speculative k borrows the nearest measured one; plain decoding and other cells do not
    assert corr.factor(3, cell) == corr.factor(5, cell) == corr.factor(2, cell)
    assert corr.factor(0, cell) == 1.0
    assert corr.factor(3, StepCorrection.cell(64, 64 * 1000)) == 1.0
    corr.observe(4, cell, predicted_s=1.0, measured_s=0.5)
    assert corr.factor(5, cell) == 0.5 and corr.factor(3, cell) == corr.factor(2, cell)  # tie -> lower k


def test_neighbour_exploration_finds_the_k_the_models_underrate():
    """The models overrate the cost of longer speculation (true step = predicted x (1 - 0.12 k)), so they
    pick a small k; exploring the neighbours of the chosen k and correcting the predictions with the
    measured times walks the policy to the k that is best in fact."""
    policy = AdaptiveK(5, fitted_cost(0.010, 0.0004), fitted_cost(0.002, 0.0), AcceptanceEstimator(prior=0.8))
    target, draft = shapes(4, 1000)


    first = policy.choose(target, draft)
    # the truly best k under the same acceptance, from the true step times of every candidate
    from decode_worker.policy import expected_tokens

    def true_rate(k):
        raw = sum(policy.draft_cost.predict(draft(j)) for j in range(k)) + policy.target_cost.predict(target(k))
        return expected_tokens(0.8, k) / (raw * (1.0 - 0.12 * k))

    truly_best = max(range(6), key=true_rate)
    assert first.k < truly_best  # the premise: the uncorrected models pick too small a k
    for _ in range(600):
        choice = policy.choose(target, draft)
        factor = 1.0 - 0.12 * choice.k
        policy.observe_step(choice, choice.raw_draft_s * factor, choice.raw_verify_s * factor)
    picks = [policy.choose(target, draft).k for _ in range(15)]  # 15 < EXPLORE_EVERY: no exploration
    assert max(set(picks), key=picks.count) == truly_best


def _draw_accepted(rng, rates_by_depth: list[float], k: int) -> int:
    """Accepted drafts of one k-token proposal whose depth-i draft is accepted with rates_by_depth[i-1]."""
    a = 0
    while a < k and rng.random() < rates_by_depth[a]:
        a += 1
    return a


def test_acceptance_estimate_is_unbiased_for_long_speculation():
    """Steps drawn from the geometric model at rate 0.88 with k = 5: every depth's estimate recovers 0.88
    (the accepted / proposed ratio would read about 0.69), and so do the expected tokens."""
    import random

    rng = random.Random(0)
    est = AcceptanceEstimator(prior=0.5, smoothing=0.01)
    accepted_total = 0
    for _ in range(5000):
        a = _draw_accepted(rng, [0.88] * 5, 5)
        accepted_total += a
        est.observe(5, a)
    assert abs(est.rate - 0.88) < 0.03  # depth 1: every step tries it
    for depth in range(2, 6):  # fewer trials per depth, so a looser bound
        assert abs(est.rate_at(depth) - 0.88) < 0.06, depth
    assert abs(est.expected_tokens(5) - expected_tokens(0.88, 5)) < 0.25
    assert abs(accepted_total / (5 * 5000) - 0.69) < 0.03  # the biased ratio, for contrast


def test_acceptance_falling_with_depth_is_measured_and_steers_k_down():
    """Drafts whose acceptance falls with depth (0.9, then 0.55, 0.5, ...; the self-speculative draft at
    batch 1, 8K) with a draft step costing 0.6 of a target step: the per-depth estimate recovers the
    expected tokens of every k, and the policy, deciding in a closed loop with these rates, settles on
    the k that is truly best (1) -- a constant rate of 0.9 (the first depth's) would prefer 2-3."""
    import random

    truth = [0.9, 0.55, 0.5, 0.5, 0.5]
    chain, true_tokens = 1.0, [1.0]
    for r in truth:
        chain *= r
        true_tokens.append(true_tokens[-1] + chain)
    rng = random.Random(1)
    est = AcceptanceEstimator(prior=0.7, smoothing=0.01)
    for i in range(6000):
        k = 1 + i % 5
        est.observe(k, _draw_accepted(rng, truth, k))
    for k in range(6):
        assert abs(est.expected_tokens(k) - true_tokens[k]) < 0.12, k

    target, draft = fitted_cost(0.010, 0.0), fitted_cost(0.006, 0.0)
    step_s = {k: 0.010 + 0.006 * k for k in range(6)}
    true_rate = {k: true_tokens[k] / step_s[k] for k in range(6)}
    truly_best = max(true_rate, key=true_rate.get)
    assert truly_best == 1
    geometric_best = max(range(6), key=lambda k: expected_tokens(truth[0], k) / step_s[k])
    assert geometric_best >= 2  # what a constant-rate belief would run
    shapes_b1 = (lambda k: PassShape(1, 8192 + k, k + 1)), (lambda step: PassShape(1, 272 + step, 1))
    policy = AdaptiveK(5, target, draft, AcceptanceEstimator(prior=0.7, smoothing=0.02))
    picks = []
    for _ in range(400):
        choice = policy.choose(*shapes_b1)
        if choice.k > 0:
            policy.acceptance.observe(choice.k, _draw_accepted(rng, truth, choice.k))
        policy.observe_step(choice, 0.006 * choice.k, 0.010)
        picks.append(choice.k)
    late = picks[200:]
    assert max(set(late), key=late.count) == truly_best
    assert sum(true_rate[k] for k in late) / len(late) > 0.95 * true_rate[truly_best]


def test_step_correction_shrugs_off_one_outlier():
    """One step slowed 5x (a GC pause) moves a measured cell's factor by at most the clip, not to 4x."""
    corr = StepCorrection()
    cell = StepCorrection.cell(1, 8192)
    for _ in range(10):
        corr.observe(2, cell, 0.010, 0.010)
    corr.observe(2, cell, 0.010, 0.050)
    assert corr.factor(2, cell) < 1.0 + corr.smoothing * (corr.OUTLIER_CLIP - 1.0) + 1e-9


def _true_rates(truth: list[float], draft_s: float, verify_s: dict[int, float]) -> dict[int, float]:
    """Tokens per second of each k in 0..5 given acceptance by depth, draft pass and verify times."""
    tokens, chain, rates = 1.0, 1.0, {}
    for k in range(6):
        if k:
            chain *= truth[k - 1]
            tokens += chain
        rates[k] = tokens / (draft_s * k + verify_s[k])
    return rates


def test_draft_and_verify_biases_are_corrected_apart():
    """Batch 1 at 8K on a CPU: the draft cost model underrates a draft pass 3x (0.002 s predicted, 0.006 s
    true, 0.6 of a target step), the verify model is right. The uncorrected models pick a long
    speculation (k = 5); one measured step later the policy runs k = 1, the truly best, and stays there.
    A single factor per k for the whole step fails here: k = 1 borrows k = 5's factor, which carries five
    draft passes' worth of bias, while plain decoding keeps its own factor of 1, so the policy decodes
    plainly (0.87x of k = 1's rate) until exploration finds k = 1."""
    import random

    truth = [0.9, 0.6, 0.52, 0.5, 0.5]
    verify_s = {k: 0.010 * (1 + 0.05 * k) for k in range(6)}
    true_rate = _true_rates(truth, 0.006, verify_s)
    assert max(true_rate, key=true_rate.get) == 1

    target, draft = fitted_cost(0.010, 0.00025), fitted_cost(0.002, 0.0)
    acceptance = AcceptanceEstimator(prior=0.7, smoothing=0.02)
    for k in range(1, 6):  # an acceptance estimate already warm, as on a running worker
        for _ in range(40):
            acceptance.observe(k, _draw_accepted(random.Random(k), truth, k))
    policy = AdaptiveK(5, target, draft, acceptance)
    shapes_b1 = (lambda k: PassShape(1, 8192 + k, k + 1)), (lambda step: PassShape(1, 272 + step, 1))
    assert policy.choose(*shapes_b1).k >= 2  # the premise: the draft looks cheap, so speculate long
    rng = random.Random(2)
    picks = []
    for _ in range(100):
        choice = policy.choose(*shapes_b1)
        if choice.k > 0:
            policy.acceptance.observe(choice.k, _draw_accepted(rng, truth, choice.k))
        policy.observe_step(choice, 0.006 * choice.k, verify_s[choice.k])
        picks.append(choice.k)
    # a neighbour not yet measured in this cell is tried once (k = 0, k = 2), then k = 1 for good
    # each k not yet measured in this cell and predicted within the margin is tried once (k = 0, 2, 3),
    # then k = 1 for good
    assert sorted(picks[1:4]) == [0, 2, 3] and picks[4:16] == [1] * 12
    assert sum(true_rate[k] for k in picks[1:]) / len(picks[1:]) > 0.95 * true_rate[1]
    cell = StepCorrection.cell(1, 8192)
    assert abs(policy.correction.draft_factor(cell) - 3.0) < 0.2


def test_unmeasured_neighbours_are_tried_before_a_borrowed_factor_settles_k():
    """The verify model underrates how verification time grows with k (true: 1 + 0.5 k target steps;
    model: about 1 + 0.05 k). The policy starts on k = 2; measuring it inflates the factor that k = 1
    borrows, so k = 1 looks worse than k = 2 although it is truly better (1.12x against 1.02x plain
    decoding). Trying each unmeasured neighbour once walks the policy to k = 1 within a few decisions;
    without that it stays on k = 2 until the periodic exploration (every EXPLORE_EVERY decisions)."""
    truth = [0.9, 0.6, 0.5, 0.5, 0.5]
    verify_s = {k: 0.010 * (1 + 0.5 * k) for k in range(6)}
    true_rate = _true_rates(truth, 0.002, verify_s)
    assert max(true_rate, key=true_rate.get) == 1

    without = _closed_loop_b1(truth, verify_s, 0.0005, seed=3, unmeasured_margin=float("inf"))
    assert without == [without[0]] * 15 and without[0] >= 2  # the premise: stuck on its first k
    picks = _closed_loop_b1(truth, verify_s, 0.0005, seed=3)
    assert picks[-10:] == [1] * 10


def _closed_loop_b1(truth: list[float], verify_s: dict[int, float], verify_per_token: float, seed: int,
                    unmeasured_margin: float = AdaptiveK.UNMEASURED_MARGIN, decisions: int = 15) -> list[int]:
    """The k's a policy picks at batch 1 x 8K over ``decisions`` decisions (fewer than EXPLORE_EVERY):
    acceptance warm at ``truth`` by depth, draft passes 2 ms as modelled, verify passes taking
    ``verify_s[k]`` while the model says 10 ms + ``verify_per_token`` per query."""
    import random

    acceptance = AcceptanceEstimator(prior=0.7, smoothing=0.01)
    rng = random.Random(seed)
    for i in range(2000):  # an acceptance estimate already warm, as on a running worker
        acceptance.observe(1 + i % 5, _draw_accepted(rng, truth, 1 + i % 5))
    policy = AdaptiveK(5, fitted_cost(0.010, verify_per_token), fitted_cost(0.002, 0.0), acceptance)
    policy.UNMEASURED_MARGIN = unmeasured_margin
    shapes_b1 = (lambda k: PassShape(1, 8192 + k, k + 1)), (lambda step: PassShape(1, 272 + step, 1))
    picks = []
    for _ in range(decisions):
        choice = policy.choose(*shapes_b1)
        policy.observe_step(choice, 0.002 * choice.k, verify_s[choice.k])
        picks.append(choice.k)
    return picks


def test_unmeasured_k_beyond_the_neighbours_is_tried():
    """Verification grows steeply with k (true 1.05 + 0.5 (k - 1) target steps from k = 1; the model
    says about 1 + 0.01 k) and acceptance after the first draft is high, so the uncorrected models start
    on a long k. Once k = 4 and 5 are measured, k = 1..3 borrow their large verify factor while plain
    decoding keeps its own: trying only the neighbours of the best k (the rule until this test) then
    decodes plainly for good, at 0.78x of k = 1's rate. Every unmeasured k within the margin is tried
    once, nearest first, and the policy ends on k = 1, the truly best."""
    truth = [0.6, 0.95, 0.95, 0.95, 0.95]
    verify_s = {0: 0.010, 1: 0.0105, 2: 0.016, 3: 0.021, 4: 0.026, 5: 0.029}
    true_rate = _true_rates(truth, 0.002, verify_s)
    assert max(true_rate, key=true_rate.get) == 1 and true_rate[5] < 0.8 * true_rate[1]

    picks = _closed_loop_b1(truth, verify_s, 0.0001, seed=5)
    assert picks[0] >= 4  # the premise: the uncorrected models favour a long speculation
    assert sorted(picks[:6]) == [0, 1, 2, 3, 4, 5]  # each k measured once, in the first six decisions
    assert picks[-8:] == [1] * 8


def test_one_large_batch_step_moves_the_acceptance_estimate_by_a_bounded_share():
    """A step's trials weigh like as many single trials (batch 1: the per-trial smoothing), but at most
    ``max_step_weight`` together: after one unlucky step of a batch of 32 (every first draft
    rejected), an estimate warm at 0.9 keeps 1 - 0.125 of its weight, where 32 single trials would
    have dragged it to 0.9 x 0.98^32 = 0.47 (the chosen k would follow the last step's luck)."""
    one = AcceptanceEstimator(prior=0.9)
    one.rate = 0.9
    one.observe_step([(3, 1)])  # depth 1 accepted, depth 2 rejected, depth 3 not tried
    assert abs(one.rate_at(1) - (0.9 + one.smoothing * 0.1)) < 1e-12
    assert abs(one.rate_at(2) - 0.9 * (1 - one.smoothing)) < 1e-12
    assert one.rate_at(3) == 0.9

    warm = AcceptanceEstimator(prior=0.9)
    warm.rate = 0.9
    per_trial = AcceptanceEstimator(prior=0.9)
    per_trial.rate = 0.9
    warm.observe_step([(2, 0)] * 32)
    for _ in range(32):
        per_trial.observe(2, 0)
    assert abs(warm.rate - 0.9 * (1 - warm.max_step_weight)) < 1e-9
    assert per_trial.rate < 0.5
    assert warm.rate_at(2) == 0.9  # depth 2 was not tried in that step
    # a batch of 4 stays under the cap: its weight is that of its 4 trials
    four = AcceptanceEstimator(prior=0.9)
    four.rate = 0.9
    four.observe_step([(1, 0)] * 4)
    assert abs(four.rate - 0.9 * (1 - four.smoothing) ** 4) < 1e-9


def test_the_chosen_k_sticks_while_it_stays_within_the_margin():
    """Once measured, the k chosen on the merits is kept while the best is predicted less than
    STICK_MARGIN faster, and left as soon as it falls further behind."""
    policy = AdaptiveK(5, fitted_cost(0.010, 0.0004), fitted_cost(0.002, 0.0), AcceptanceEstimator(prior=0.8))
    target, draft = shapes(4, 1000)
    for _ in range(8):  # every k within the margin gets measured (exactly as predicted)
        choice = policy.choose(target, draft)
        policy.observe_step(choice, choice.raw_draft_s, choice.raw_verify_s)
    best = policy.choose(target, draft)
    cell = best.cell

    def rate_of(k: int) -> float:
        raw = sum(policy.draft_cost.predict(draft(j)) for j in range(k)) + policy.target_cost.predict(target(k))
        return 4 * policy.acceptance.expected_tokens(k) / raw

    other = max((k for k in range(6) if k != best.k), key=rate_of)
    ratio = rate_of(other) / rate_of(best.k)  # < 1: the runner-up, at its uncorrected prediction
    for _ in range(60):  # its verify pass measured faster ...
        policy.correction.observe(other, cell, 1.0, ratio * 0.9)
    assert policy.choose(target, draft).k == other  # ... makes it the best: it becomes the incumbent

    def slow_down(share_behind: float) -> None:
        # verify factor at which ``other`` is predicted ``share_behind`` slower than ``best``
        draft_s = sum(policy.draft_cost.predict(draft(j)) for j in range(other)) * policy.correction.draft_factor(cell)
        verify_s = policy.target_cost.predict(target(other))
        goal_s = 4 * policy.acceptance.expected_tokens(other) / ((1 - share_behind) * rate_of(best.k))
        for _ in range(200):
            policy.correction.observe(other, cell, verify_s, goal_s - draft_s)

    slow_down(0.5 * AdaptiveK.STICK_MARGIN)
    # decisions 11-14, then 15 (the 16th would explore a neighbour)
    assert [policy.choose(target, draft).k for _ in range(4)] == [other] * 4
    slow_down(2 * AdaptiveK.STICK_MARGIN)
    assert policy.choose(target, draft).k == best.k


def test_policy_without_exploration_always_takes_the_best_k():
    """Costs that are never corrected (the cluster simulator) leave every k unmeasured: an exploring policy
    then takes an untried neighbour of the best k instead of the best; explore=False takes the best k at
    every decision, the k that maximises the predicted rate."""
    args = (5, fitted_cost(0.010, 0.0004), fitted_cost(0.002, 0.0), AcceptanceEstimator(prior=0.8))
    target, draft = shapes(4, 1000)
    exploring, settled = AdaptiveK(*args), AdaptiveK(*args, explore=False)
    rates = {}
    for _ in range(50):
        best = settled.choose(target, draft)
        rates[best.k] = best.expected_tokens_per_s
        assert best.k == settled.choose(target, draft).k
    assert len(rates) == 1
    best_k = next(iter(rates))
    # the exploring policy, never fed back, keeps trying other k's
    assert any(exploring.choose(target, draft).k != best_k for _ in range(50))
