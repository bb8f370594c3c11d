"""The rejection-sampling rule preserves the target distribution (statistical tests, fixed seeds)."""

from __future__ import annotations

import pytest
import torch

from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
from decode_worker.verify import Verdict, verify_greedy, verify_sampled
from decode_worker.worker import DecodeWorker
from modeling.sampling import SamplingParams
from tests.checkpoints import build_checkpoint

P = torch.tensor([[0.40, 0.30, 0.10, 0.10, 0.05, 0.05],
                  [0.05, 0.05, 0.20, 0.20, 0.30, 0.20],
                  [0.10, 0.50, 0.10, 0.10, 0.10, 0.10]], dtype=torch.float64)
Q = torch.tensor([[0.10, 0.10, 0.40, 0.20, 0.10, 0.10],
                  [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]], dtype=torch.float64)
TRIALS = 20000
# chi-square critical value at p = 0.001 for 5 degrees of freedom
CHI2_CRIT_5DOF = 20.52


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float((((counts - expected) ** 2) / expected).sum())


def run_trials(rule) -> tuple[torch.Tensor, torch.Tensor]:
    """Histograms of output token 0 and (when produced) output token 1 over many trials."""
    gen = torch.Generator().manual_seed(1234)
    first, second = torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    for _ in range(TRIALS):
        draft = [int(torch.multinomial(Q[i], 1, generator=gen)) for i in range(2)]
        verdict = rule(draft, Q, P, gen)
        first[verdict.tokens[0]] += 1
        if len(verdict.tokens) > 1:
            second[verdict.tokens[1]] += 1
    return first, second


def resample_from_target_on_reject(draft, q, p, gen) -> Verdict:
    """A classic wrong rule: on rejection, draw from p instead of the residual norm(max(0, p - q))."""
    for i, tok in enumerate(draft):
        if torch.rand(1, generator=gen, dtype=torch.float64).item() * q[i, tok] >= p[i, tok]:
            return Verdict(i, draft[:i] + [int(torch.multinomial(p[i], 1, generator=gen))])
    return Verdict(len(draft), draft + [int(torch.multinomial(p[len(draft)], 1, generator=gen))])


def test_rejection_sampling_matches_target_distribution():
    first, second = run_trials(verify_sampled)
    assert chi_square(first, P[0]) < CHI2_CRIT_5DOF
    assert second.sum() > 2000  # enough second tokens to test
    assert chi_square(second, P[1]) < CHI2_CRIT_5DOF


def test_the_statistical_test_catches_a_wrong_rule():
    first, _ = run_trials(resample_from_target_on_reject)
    assert chi_square(first, P[0]) > 10 * CHI2_CRIT_5DOF


def test_accept_when_draft_equals_target():
    gen = torch.Generator().manual_seed(0)
    same = P[:2]
    for _ in range(200):
        draft = [int(torch.multinomial(same[i], 1, generator=gen)) for i in range(2)]
        assert verify_sampled(draft, same, P, gen).num_accepted == 2  # p/q = 1: always accepted


def test_greedy_rule_terms():
    assert verify_greedy([5, 6, 7], [5, 6, 7, 8]) == Verdict(3, [5, 6, 7, 8])  # all accepted + bonus
    assert verify_greedy([5, 9, 7], [5, 6, 7, 8]) == Verdict(1, [5, 6])  # recovered at the mismatch
    assert verify_greedy([], [4]) == Verdict(0, [4])


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory):
    return build_checkpoint("llama_gqa", str(tmp_path_factory.mktemp("v16")), seed=3, vocab=16)


def output_histograms(directory, spec: SpeculationConfig, n: int, position: int):
    worker = DecodeWorker(directory, DecodeWorkerConfig(dtype="float32", kv_cache_tokens=65536, max_num_seqs=n,
                                                        attention_backend="torch", profile_on_start=False,
                                                        speculation=spec))
    outs: dict[str, list[int]] = {}
    for i in range(n):
        params = SamplingParams(max_tokens=position + 1, temperature=1.0, seed=10_000 + i, ignore_eos=True)
        for d in worker.add_local(f"r{i}", [3, 1, 4, 1, 5], params):
            outs.setdefault(d.request_id, []).extend(d.token_ids)
    while worker.has_work():
        for d in worker.step():
            outs.setdefault(d.request_id, []).extend(d.token_ids)
    counts = torch.zeros(16, dtype=torch.float64)
    for toks in outs.values():
        counts[toks[position]] += 1
    return counts, worker.metrics


def test_speculative_sampling_end_to_end_matches_plain_decoding(small_vocab_dir):
    """Two-sample chi-square on the 4th output token: speculative vs plain decoding of a real model."""
    n = 1500
    plain, _ = output_histograms(small_vocab_dir, SpeculationConfig(drafter="none"), n, position=3)
    spec, metrics = output_histograms(small_vocab_dir, SpeculationConfig(drafter="self_sparse", k_policy="fixed", k=3,
                                                                budget=4, sink_tokens=1), n, position=3)
    assert 0 < metrics.accepted_tokens < metrics.draft_tokens  # both accepted and recovered tokens occur
    keep = (plain + spec) >= 10  # merge rare tokens into one bin
    rows = torch.stack([torch.cat([plain[keep], plain[~keep].sum().view(1)]),
                        torch.cat([spec[keep], spec[~keep].sum().view(1)])])
    rows = rows[:, rows.sum(0) > 0]
    expected = rows.sum(1, keepdim=True) * rows.sum(0, keepdim=True) / rows.sum()
    chi2 = float((((rows - expected) ** 2) / expected).sum())
    dof = rows.shape[1] - 1
    # critical value at p = 0.001 (Wilson-Hilferty approximation)
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    assert chi2 < crit, (chi2, crit, rows)
