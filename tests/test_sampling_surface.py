"""vLLM's sampling surface: logits processors against a per-position reference, log-probabilities against
transformers' log-softmax, and speculation lossless under penalties, bias and min_p (greedy: token-identical
to plain decoding; sampling: the same distribution, chi-square with a negative control)."""

from __future__ import annotations

import math

import pytest
import torch

import decode_worker.speculation as speculation_module
from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
from decode_worker.worker import DecodeWorker
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.params import SamplingParams
from modeling.sampling import RequestSampler, processed_logits, target_probs, token_logprobs
from tests.checkpoints import VOCAB, build_checkpoint
from tests.test_decode_worker import run_worker

PENALISED = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={5: 3.0, 9: -4.0})


# -- logits processors on plain tensors -------------------------------------------------------------


def reference_processed(logits_row: torch.Tensor, params: SamplingParams, prompt: list[int], history: list[int],
                        eos: set[int]) -> torch.Tensor:
    """One position, the slow way: bias, min_tokens, then vLLM's penalties token by token."""
    out = logits_row.clone()
    for tok, bias in params.logit_bias:
        out[tok] += bias
    if len(history) < params.min_tokens:
        for tok in set(params.stop_token_ids) | (set() if params.ignore_eos else eos):
            out[tok] = -math.inf
    for tok in set(prompt) | set(history):
        if params.repetition_penalty != 1.0:
            out[tok] = out[tok] / params.repetition_penalty if out[tok] > 0 else out[tok] * params.repetition_penalty
    for tok in set(history):
        out[tok] -= params.frequency_penalty * history.count(tok) + params.presence_penalty
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(**PENALISED),
    SamplingParams(min_tokens=3, stop_token_ids=[7], max_tokens=8),
    SamplingParams(min_tokens=3, stop_token_ids=[7], max_tokens=8, ignore_eos=True, frequency_penalty=-0.5),
])
def test_processed_logits_match_the_per_position_reference(params):
    g = torch.Generator().manual_seed(0)
    vocab, prompt, output, drafts = 24, [1, 2, 3, 5, 5], [5, 9, 9], [4, 9, 1]
    logits = torch.randn(len(drafts) + 1, vocab, generator=g) * 3
    sampler = RequestSampler(params, prompt_ids=prompt, eos_token_ids=frozenset({2}))
    got = processed_logits(sampler, logits, prompt + output, drafts)
    for j in range(len(drafts) + 1):
        want = reference_processed(logits[j], params, prompt, output + drafts[:j], {2})
        assert torch.equal(torch.isinf(got[j]), torch.isinf(want))
        finite = ~torch.isinf(want)
        assert torch.allclose(got[j][finite], want[finite], atol=1e-6), j
        # a draft step: one row after the drafts so far, as the verification pass's row j sees them
        alone = processed_logits(sampler, logits[j : j + 1], prompt + output, drafts[:j])[0]
        assert torch.equal(torch.isinf(alone), torch.isinf(want)) and torch.allclose(alone[finite], want[finite], atol=1e-6)


def test_plain_params_leave_logits_untouched_and_min_p_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0, -3.0]])
    sampler = RequestSampler(SamplingParams(temperature=1.0))
    assert processed_logits(sampler, logits, [0, 1]) is logits
    probs = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))
    full = torch.softmax(logits, dim=-1)
    assert probs[0, 3] == 0 and probs[0, 2] == 0  # below 0.2 x the top probability
    assert torch.allclose(probs[0, :2], full[0, :2] / full[0, :2].sum())


def test_token_logprobs_rank_and_top():
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 0.0]])
    out = token_logprobs(logits, [2, 0], num_top=2)
    ref = torch.log_softmax(logits, dim=-1)
    assert out[0].rank == 2 and out[1].rank == 1
    assert abs(out[0].logprob - ref[0, 2].item()) < 1e-6
    assert [t for t, _ in out[0].top] == [1, 2]


# -- against transformers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: row p is the log-softmax predicting tokens[p + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def assert_logprobs_match(ref: torch.Tensor, tokens: list[int], start: int, lps, num_top: int) -> None:
    """lps[j] scores tokens[start + j] (row start + j - 1 of ref)."""
    for j, lp in enumerate(lps):
        row = ref[start + j - 1]
        assert lp.token_id == tokens[start + j]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-3
        assert lp.rank == int((row > row[lp.token_id]).sum()) + 1
        top_ids = torch.topk(row, num_top).indices.tolist()
        assert [t for t, _ in lp.top] == top_ids
        assert all(abs(v - row[t].item()) < 1e-3 for t, v in lp.top)


def test_engine_logprobs_of_prompt_and_output_match_transformers(llama_dir, hf):
    engine = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=4096, attention_backend="torch", token_budget=16))
    prompt = torch.randint(2, VOCAB, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=1, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True, **PENALISED)
    out = engine.generate([prompt], params)[0]
    tokens = prompt + out.token_ids
    ref = hf_logprobs(hf, tokens)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)  # chunked over 3 steps
    assert_logprobs_match(ref, tokens, 1, out.prompt_logprobs[1:], 2)
    assert len(out.logprobs) == len(out.token_ids)
    assert_logprobs_match(ref, tokens, len(prompt), out.logprobs, 3)
    scored = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert scored.token_ids == [] and [lp.token_id for lp in scored.prompt_logprobs[1:]] == prompt[1:]


@pytest.mark.parametrize("drafter", ["none", "self_sparse"])
def test_decode_worker_logprobs_match_transformers_with_and_without_speculation(llama_dir, hf, drafter):
    spec = SpeculationConfig(drafter=drafter, k_policy="fixed", k=3, budget=48, sink_tokens=4)  # some drafts accepted
    worker = DecodeWorker(llama_dir, DecodeWorkerConfig(dtype="float32", kv_cache_tokens=8192, attention_backend="torch",
                                                        profile_on_start=False, speculation=spec))
    prompt = torch.randint(2, VOCAB, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=20, logprobs=4, ignore_eos=True)
    lps, ids = [], []
    for d in worker.add_local("r", prompt, params):
        ids += d.token_ids
        lps += d.logprobs
    while worker.has_work():
        for d in worker.step():
            ids += d.token_ids
            lps += d.logprobs
    if drafter != "none":
        assert worker.metrics.accepted_tokens > 0  # some reported tokens were accepted drafts
    assert len(lps) == len(ids) == 20
    tokens = prompt + ids
    assert_logprobs_match(hf_logprobs(hf, tokens), tokens, len(prompt), lps, 4)


# -- speculation stays lossless under every processor --------------------------------------------------


def spec_worker(directory, drafter: str, max_num_seqs: int = 64, **spec):
    cfg = SpeculationConfig(drafter=drafter, k_policy="fixed", k=spec.pop("k", 3), budget=spec.pop("budget", 16),
                            sink_tokens=spec.pop("sink_tokens", 4), **spec)
    return DecodeWorker(directory, DecodeWorkerConfig(dtype="float32", kv_cache_tokens=65536, attention_backend="torch",
                                                      profile_on_start=False, max_num_seqs=max_num_seqs, speculation=cfg))


def test_greedy_with_penalties_is_token_identical_with_speculation_on_and_off(llama_dir, checkpoint_dir):
    prompts = [torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (20, 45, 70)]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, **PENALISED),
              SamplingParams(max_tokens=40, min_tokens=30, stop_token_ids=[7], presence_penalty=1.5),
              SamplingParams(max_tokens=40, ignore_eos=True, repetition_penalty=1.8, logit_bias={3: 100.0})]
    plain = run_worker(spec_worker(llama_dir, "none"), prompts, params)
    engine = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=16384, attention_backend="torch"))
    assert plain == [c.token_ids for c in engine.generate(prompts, params)]
    assert plain != run_worker(spec_worker(llama_dir, "none"), prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    worker = spec_worker(llama_dir, "self_sparse")
    assert run_worker(worker, prompts, params) == plain
    assert worker.metrics.accepted_tokens > 0
    draft_dir = checkpoint_dir("llama_tied")
    assert run_worker(spec_worker(llama_dir, "draft_model", draft_model=draft_dir), prompts, params) == plain


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory):
    return build_checkpoint("llama_gqa", str(tmp_path_factory.mktemp("v16")), seed=3, vocab=16)


SAMPLED = dict(temperature=1.0, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.8, repetition_penalty=1.5,
               logit_bias={3: 2.0, 11: -1.5}, min_p=0.02)
OUTPUT_LEN = 6


def histograms(directory, drafter: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Over n seeded requests: the histogram of the 4th output token, and of the number of distinct tokens
    among the 6 output tokens (what the penalties shape most)."""
    worker = spec_worker(directory, drafter, max_num_seqs=n, budget=4, sink_tokens=1)
    params = [SamplingParams(max_tokens=OUTPUT_LEN, seed=20_000 + i, **SAMPLED) for i in range(n)]
    outs = run_worker(worker, [[3, 1, 4, 1, 5]] * n, params)
    if drafter != "none":
        assert 0 < worker.metrics.accepted_tokens < worker.metrics.draft_tokens  # accepted and recovered tokens
    token, distinct = torch.zeros(16, dtype=torch.float64), torch.zeros(OUTPUT_LEN + 1, dtype=torch.float64)
    for toks in outs:
        token[toks[3]] += 1
        distinct[len(set(toks))] += 1
    return token, distinct


def two_sample_chi_square(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(chi-square, its critical value at p = 0.001) of two histograms, rare bins merged."""
    keep = (a + b) >= 10
    rows = torch.stack([torch.cat([a[keep], a[~keep].sum().view(1)]), torch.cat([b[keep], b[~keep].sum().view(1)])])
    rows = rows[:, rows.sum(0) > 0]
    expected = rows.sum(1, keepdim=True) * rows.sum(0, keepdim=True) / rows.sum()
    chi2 = float((((rows - expected) ** 2) / expected).sum())
    dof = rows.shape[1] - 1
    return chi2, dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3  # Wilson-Hilferty


def test_sampled_speculation_under_penalties_bias_and_min_p_matches_plain_decoding(small_vocab_dir, monkeypatch):
    n = 800
    plain = histograms(small_vocab_dir, "none", n)
    for a, b in zip(plain, histograms(small_vocab_dir, "self_sparse", n)):
        chi2, crit = two_sample_chi_square(a, b)
        assert chi2 < crit, (chi2, crit, a, b)
    # negative control: verification that forgets the drafts before each position is caught
    real = speculation_module.processed_logits
    monkeypatch.setattr(speculation_module, "processed_logits", lambda sampler, logits, tokens, drafted=(): torch.cat(
        [real(sampler, logits[j : j + 1], tokens) for j in range(logits.shape[0])]))
    _, distinct = histograms(small_vocab_dir, "self_sparse", n)
    chi2, crit = two_sample_chi_square(plain[1], distinct)
    assert chi2 > crit, (chi2, crit)


# -- n sequences per request ------------------------------------------------------------------------


def test_n_sequences_fork_the_prompts_blocks_and_equal_requests_seeded_apart(llama_dir):
    """Sequence i of a seeded request of n is the single request seeded seed + i (vLLM's seeding), in the
    engine and in the speculating decode worker; the sequences share the prompt's full blocks; nothing leaks."""
    prompt = torch.randint(2, VOCAB, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11, n=3, ignore_eos=True, logprobs=1)

    def single(i):
        return SamplingParams(max_tokens=10, temperature=1.0, seed=11 + i, ignore_eos=True)

    engine = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=4096, attention_backend="torch", token_budget=16))
    out = engine.generate([prompt], params)[0]
    assert [s.token_ids for s in out.sequences] == [engine.generate([prompt], single(i))[0].token_ids
                                                    for i in range(3)]
    assert all(len(s.logprobs) == 10 for s in out.sequences)
    assert engine.pool.num_free == engine.pool.num_blocks
    greedy = engine.generate([prompt], SamplingParams(max_tokens=10, n=2, ignore_eos=True))[0]
    assert greedy.sequences[0].token_ids == greedy.sequences[1].token_ids

    worker = spec_worker(llama_dir, "self_sparse", budget=48)
    outs: dict[int, list[int]] = {}
    for d in worker.add_local("r", prompt, params):
        assert d.request_id == "r"
        outs.setdefault(d.index, []).extend(d.token_ids)
    # 37 prompt tokens in blocks of 16: two full blocks shared, the third (and room for a step) per sequence
    assert worker.pool.num_used == 3 + 2 * 1
    while worker.has_work():
        for d in worker.step():
            outs.setdefault(d.index, []).extend(d.token_ids)
    assert worker.pool.num_free == worker.pool.num_blocks
    singles = [run_worker(worker, [prompt], single(i))[0] for i in range(3)]
    assert [outs[i] for i in range(3)] == singles
    worker.add_local("a", prompt, params)
    assert worker.abort("a") and not worker.has_work() and worker.pool.num_free == worker.pool.num_blocks
