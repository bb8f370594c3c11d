"""Sampling: filters give the right distribution, seeds reproduce, stop conditions stop."""

from __future__ import annotations

import pytest
import torch

from modeling.engine import EngineConfig, ReferenceEngine
from modeling.sampling import SamplingParams, make_generator, sample_from, target_probs
from modeling.sequence import FinishReason, find_stop_string


def test_target_probs_filters():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[5 / 7, 2 / 7, 0, 0, 0]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))  # 0.5+0.2 < 0.8 -> keep 3
    assert torch.allclose(p, torch.tensor([[0.5, 0.2, 0.15, 0, 0]]) / 0.85)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.01))  # at least the top token
    assert torch.allclose(p, torch.tensor([[1.0, 0, 0, 0, 0]]))
    hot = target_probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(logits / 2.0, -1))


def test_sampling_frequencies_match_distribution():
    """Chi-square-style check: 20k draws from a known distribution."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    gen = make_generator(123)
    counts = torch.zeros(4)
    n = 20000
    for t in torch.multinomial(probs.expand(n, 4), 1, generator=gen).flatten():
        counts[t] += 1
    expected = probs * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 16.3  # p = 0.001 for 3 degrees of freedom
    assert sample_from(torch.tensor([0.0, 1.0, 0.0]), gen) == 1


def test_seed_reproducible_regardless_of_batch(llama_dir):
    cfg = EngineConfig(kv_cache_tokens=4096, token_budget=32, attention_backend="torch")
    params = SamplingParams(max_tokens=24, temperature=1.0, top_k=50, top_p=0.95, seed=42, ignore_eos=True)
    alone = ReferenceEngine(llama_dir, cfg).generate([[5, 6, 7, 8]], params)[0].token_ids
    others = [SamplingParams(max_tokens=30, temperature=0.7, seed=s, ignore_eos=True) for s in (1, 2)]
    batch = ReferenceEngine(llama_dir, cfg).generate([[9, 10] * 20, [5, 6, 7, 8], [11] * 7], [others[0], params, others[1]])
    assert batch[1].token_ids == alone
    different = ReferenceEngine(llama_dir, cfg).generate([[5, 6, 7, 8]], SamplingParams(
        max_tokens=24, temperature=1.0, top_k=50, top_p=0.95, seed=43, ignore_eos=True))[0].token_ids
    assert different != alone


def test_stop_token_ids_and_max_tokens(llama_dir):
    engine = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=4096, attention_backend="torch"))
    free_run = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert len(free_run.token_ids) == 20 and free_run.finish_reason is FinishReason.LENGTH
    stop_tok = free_run.token_ids[6]
    first = free_run.token_ids.index(stop_tok)
    stopped = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=20, stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert stopped.token_ids == free_run.token_ids[: first + 1]
    assert stopped.finish_reason is FinishReason.STOP


def test_stop_strings_cut_text(llama_dir):
    engine = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=4096, attention_backend="torch"))
    prompt = "def add(a, b):"
    free_text = engine.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    assert len(free_text) > 8
    stop = free_text[5:8]
    out = engine.generate([prompt], SamplingParams(max_tokens=40, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == free_text[: free_text.index(stop)]


def test_stop_string_kept_with_include_stop_str_in_output_and_held_off_by_min_tokens(llama_dir):
    engine = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=4096, attention_backend="torch"))
    prompt = "def add(a, b):"
    free = engine.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    stop = free.text[5:8]
    kept = engine.generate([prompt], SamplingParams(max_tokens=40, stop=[stop], include_stop_str_in_output=True,
                                                    ignore_eos=True))[0]
    assert kept.finish_reason is FinishReason.STOP
    assert kept.text == free.text[: free.text.index(stop) + len(stop)]
    # with min_tokens past the stop string's first appearance, generation goes on beyond it
    late = engine.generate([prompt], SamplingParams(max_tokens=40, stop=[stop], min_tokens=len(free.token_ids) - 1,
                                                    ignore_eos=True))[0]
    assert len(late.token_ids) >= len(free.token_ids) - 1 and late.text.startswith(free.text[: free.text.index(stop)])


def test_special_tokens_in_the_text_as_asked(llama_dir):
    engine = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=4096, attention_backend="torch"))
    eos = engine.tokenizer.decode([1], skip_special_tokens=False)  # the tiny checkpoints' EOS id is 1
    assert eos
    for skip in (True, False):
        out = engine.generate(["x"], SamplingParams(max_tokens=3, ignore_eos=True, logit_bias={1: 100.0},
                                                    skip_special_tokens=skip))[0]
        assert out.token_ids == [1, 1, 1]
        assert out.text == ("" if skip else eos * 3)


def test_streamed_deltas_add_up_to_the_text(llama_dir):
    engine = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=4096, attention_backend="torch"))
    rid = engine.add_request("import os", SamplingParams(max_tokens=30, ignore_eos=True, stop=["zzz"]))
    text, tokens = "", []
    while engine.has_unfinished():
        for out in engine.step():
            text += out.new_text
            tokens += out.new_token_ids
    assert text == engine.tokenizer.decode(tokens)
    assert rid


@pytest.mark.parametrize("text,stops,new,expected", [
    ("hello world", ("wor",), 3, (6, 3)),
    ("hello world", ("wor",), 1, (-1, 0)),  # could not have been completed by the last char only
    ("abcabc", ("c", "b"), 6, (1, 1)),
    ("abc", (), 3, (-1, 0)),
])
def test_find_stop_string(text, stops, new, expected):
    assert find_stop_string(text, stops, new) == expected
