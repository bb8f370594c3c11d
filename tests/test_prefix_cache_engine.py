"""Prefix caching in the colocated engine: a prompt that shares a prefix with earlier ones computes only the
rest, and the tokens equal those of an engine without caching (float32, greedy and seeded sampling)."""

from __future__ import annotations

import random

import pytest

from modeling.engine import EngineConfig, ReferenceEngine
from modeling.sampling import SamplingParams

BLOCK = 16
CFG = EngineConfig(kv_cache_tokens=4096, block_size=BLOCK, token_budget=128, attention_backend="torch")


def _prompts(seed: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    doc = [rng.randrange(3, 380) for _ in range(200)]  # a shared document, then a question per request
    return doc, [doc + [rng.randrange(3, 380) for _ in range(rng.randint(1, 40))] for _ in range(3)]


@pytest.fixture(scope="module")
def engines(llama_dir):
    return ReferenceEngine(llama_dir, CFG), ReferenceEngine(llama_dir, EngineConfig(**{**CFG.__dict__,
                                                                                      "prefix_caching": False}))


def _run(engine, prompts, params):
    return [c.token_ids for c in engine.generate(prompts, params)]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12),
                                    SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)],
                         ids=["greedy", "seeded"])
def test_later_prompts_reuse_the_cached_document_with_the_same_tokens(engines, params):
    cached, plain = engines
    doc, prompts = _prompts(0)
    hits0 = cached.prefix_cache.stats.hits
    first = _run(cached, prompts[:1], params)
    rest = _run(cached, prompts[1:], params)  # the document's 12 full blocks (192 tokens) are cached now
    assert cached.prefix_cache.stats.hits - hits0 >= 2 * (len(doc) // BLOCK) * BLOCK
    assert first + rest == _run(plain, prompts, params)
    assert plain.prefix_cache.stats.hits == 0
    assert cached.pool.num_free == cached.pool.num_blocks  # idle: every block free (cached ones evictable)
    assert cached.prefix_cache.num_tracked == 0


def test_a_conversation_continues_from_its_cached_output(engines):
    """The next turn's prompt is the last turn's prompt and output plus a new message: both are cached."""
    cached, plain = engines
    _, prompts = _prompts(1)
    turn1 = _run(cached, prompts[:1], SamplingParams(max_tokens=40))[0]
    turn2_prompt = prompts[0] + turn1 + [5, 6, 7]
    hits0 = cached.prefix_cache.stats.hits
    turn2 = _run(cached, [turn2_prompt], SamplingParams(max_tokens=10))
    # every full block of turn 1's prompt and output, except the last partly filled one, was found
    assert cached.prefix_cache.stats.hits - hits0 == (len(prompts[0]) + len(turn1) - 1) // BLOCK * BLOCK
    assert turn2 == _run(plain, [turn2_prompt], SamplingParams(max_tokens=10))


def test_prompt_logprobs_compute_the_whole_prompt_and_eviction_makes_room(llama_dir):
    small = ReferenceEngine(llama_dir, EngineConfig(**{**CFG.__dict__, "kv_cache_tokens": 512}))
    doc, prompts = _prompts(2)
    _run(small, prompts[:1], SamplingParams(max_tokens=4))
    hits0 = small.prefix_cache.stats.hits
    scored = small.generate(prompts[:1], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert small.prefix_cache.stats.hits == hits0 and len(scored.prompt_logprobs) == len(prompts[0])
    # prompts that need the whole cache evict the cached blocks (never one in use) and still run
    other = [[random.Random(i).randrange(3, 380) for _ in range(400)] for i in range(2)]
    assert all(len(t) == 4 for t in _run(small, other, SamplingParams(max_tokens=4)))
    assert small.pool.num_evictions > 0 and small.pool.num_free == small.pool.num_blocks
    assert small.prefix_cache.num_tracked == 0
