"""Numerical equivalence with Hugging Face transformers (the oracle) on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from modeling.attention import make_backend
from modeling.block_pool import BlockPool, BlockTable
from modeling.checkpoint import load_model
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.runner import ModelRunner, StepInput
from modeling.sampling import SamplingParams
from tests.checkpoints import TINY_CONFIGS, VOCAB

FAMILIES = list(TINY_CONFIGS)


def hf_model(directory: str, dtype=torch.float32, device="cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()


def make_runner(directory: str, dtype="float32", device="cpu", backend="torch", block_size=16, blocks=256):
    loaded = load_model(directory, dtype, device)
    c = loaded.config
    spec = KVCacheSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block_size, loaded.dtype)
    cache = PagedKVCache(spec, blocks, device)
    runner = ModelRunner(loaded.model, cache, make_backend(backend, device, block_size))
    return runner, BlockPool(blocks, block_size)


def random_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def check_prefill_and_decode(directory, device="cpu", backend="torch", block_size=16):
    """Prefill a prompt through the paged cache, then feed tokens one at a time; every logit row must
    match HF's full forward within 1e-4."""
    runner, pool = make_runner(directory, device=device, backend=backend, block_size=block_size)
    hf = hf_model(directory, device=device)
    tokens = random_prompts([90], seed=1)[0]
    n_prefill = 70
    with torch.no_grad():
        ref = hf(torch.tensor([tokens], device=device)).logits[0].float()
    table = BlockTable(block_size)
    table.ensure_capacity(pool, n_prefill)
    out = runner.run([StepInput(tokens[:n_prefill], 0, table.blocks, num_logits=n_prefill)])
    assert (out - ref[:n_prefill]).abs().max().item() < 1e-4
    for pos in range(n_prefill, len(tokens)):
        table.ensure_capacity(pool, pos + 1)
        out = runner.run([StepInput([tokens[pos]], pos, table.blocks)])
        assert (out[0] - ref[pos]).abs().max().item() < 1e-4, f"decode position {pos}"


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_logits_match_hf(checkpoint_dir, family):
    check_prefill_and_decode(checkpoint_dir(family))


def test_dense_forward_matches_hf(checkpoint_dir):
    directory = checkpoint_dir("llama3_rope")
    ours = load_model(directory).model
    ids = torch.tensor(random_prompts([200, 200], seed=3))
    with torch.no_grad():
        diff = (ours.forward_dense(ids) - hf_model(directory)(ids).logits).abs().max().item()
    assert diff < 1e-4


def hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["llama_gqa", "llama3_rope", "qwen2_bias"])
@pytest.mark.parametrize("chunk", [16, 64, 100_000])
def test_greedy_64_tokens_match_hf_batched(checkpoint_dir, family, chunk):
    """A batch of prompts of different lengths, continuous batching with the given prefill chunk size."""
    directory = checkpoint_dir(family)
    prompts = random_prompts([3, 17, 64, 150, 333], seed=7)
    engine = ReferenceEngine(directory, EngineConfig(token_budget=chunk, kv_cache_tokens=8192, attention_backend="torch"))
    outs = engine.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True))
    hf = hf_model(directory)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 64)
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.gpu
def test_cuda_torch_backend_matches_hf(checkpoint_dir):
    """float32 on CUDA against HF (flash-attn has half-precision kernels only: tests/test_gpu.py compares it
    with the torch oracle in the same dtype)."""
    check_prefill_and_decode(checkpoint_dir("llama_gqa"), device="cuda", backend="torch", block_size=16)
