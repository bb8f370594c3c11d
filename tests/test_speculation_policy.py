"""The adaptive speculation-length policy on hand-set cost models (no model runs)."""

from __future__ import annotations

from decode_worker.policy import AcceptanceEstimator, AdaptiveK, LinearCostModel, PassShape, StepCorrection


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
        true_s = choice.raw_step_s * (3.0 if choice.k > 0 else 1.0)
        policy.observe_step(choice, true_s)
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
    corr.observe(2, cell, predicted_s=1.0, measured_s=2.0)
    assert corr.factor(2, cell) == (corr.hi + 2.0) / 2
    assert corr.factor(3, cell) == 1.0
