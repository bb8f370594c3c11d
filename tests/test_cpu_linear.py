"""The CPU extension's bf16 linear kernel for small steps, against float32 math and torch's bf16 path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modeling.cpu_linear import MAX_ROWS, routed_layers, skinny_linear_available, unroute, use_skinny_linear

if not skinny_linear_available():
    pytest.skip("CPU extension unavailable or no AVX512-BF16 on this CPU", allow_module_level=True)

from modeling.attention.cpu_kernel import load_cpu_kernel  # noqa: E402

op = load_cpu_kernel().skinny_linear


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16])
@pytest.mark.parametrize("k,n", [(512, 384), (96, 70), (1536, 129)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float32_math_within_bf16_rounding(m, k, n, bias):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    out = op(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # the exact sum rounded once to bf16 (half an ulp: 2^-8 relative), plus fp32 summation-order noise
    assert ((out.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-4).all()


def test_rows_are_computed_alike_whatever_the_row_count():
    """A verification step's row equals the decode step of that token bit for bit."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 256, generator=gen).bfloat16()
    w = torch.randn(300, 256, generator=gen).bfloat16()
    full = op(x, w)
    for i in range(7):
        assert torch.equal(op(x[i : i + 1], w)[0], full[i])
    assert torch.equal(op(x[2:6], w), full[2:6])


def test_strided_rows_and_bad_input():
    x = torch.randn(3, 128).bfloat16()
    w = torch.randn(64, 128).bfloat16()
    wide = torch.cat([x, x], dim=1)[:, :128]  # rows with a stride of 256
    assert torch.equal(op(wide, w), op(x, w))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.randn(2, 100).bfloat16(), torch.randn(4, 100).bfloat16())
    with pytest.raises(RuntimeError, match="bf16 only"):
        op(x.float(), w.float())


def test_routing_sends_small_steps_only(checkpoint_dir):
    from modeling.checkpoint import load_model

    model = load_model(checkpoint_dir("llama_gqa"), "bfloat16", "cpu").model
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(MAX_ROWS + 1, layer.in_features).bfloat16()
    with torch.inference_mode():
        before_small, before_big = layer(x[:3]), layer(x)
        assert use_skinny_linear(model) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        assert routed_layers(model) == use_skinny_linear(model)  # idempotent
        unroute(model)
        assert routed_layers(model) == 0 and torch.equal(layer(x[:3]), before_small)
        use_skinny_linear(model)
        after_small, after_big = layer(x[:3]), layer(x)
    assert torch.equal(after_big, before_big)  # more than MAX_ROWS rows: torch's GEMM, as before
    assert torch.equal(after_small, op(x[:3], layer.weight, layer.bias))
    assert (after_small.float() - before_small.float()).abs().max() <= 0.02 * before_small.float().abs().max()


def test_bf16_speculation_on_the_cpu_kernels_equals_autoregressive(checkpoint_dir):
    """bf16 with the cpu backend (attention kernel + this kernel for every small step): self-speculation's
    greedy tokens equal plain decoding's on the same worker setup, verification rows being computed as
    decode rows are, and the target's linear layers are routed."""
    from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
    from decode_worker.worker import DecodeWorker
    from modeling.sampling import SamplingParams
    from tests.test_decode_worker import run_worker
    from tests.test_model_hf import random_prompts

    directory = checkpoint_dir("llama_gqa")
    prompts = random_prompts([30, 70], seed=3)
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    def worker(**spec):
        cfg = DecodeWorkerConfig(dtype="bfloat16", kv_cache_tokens=2048, attention_backend="cpu",
                                 profile_on_start=False, speculation=SpeculationConfig(**spec))
        return DecodeWorker(directory, cfg)

    plain = worker(drafter="none")
    assert routed_layers(plain.runner.model) == sum(isinstance(m, torch.nn.Linear) for m in plain.runner.model.modules())
    expected = run_worker(plain, prompts, params)
    spec = worker(drafter="self_sparse", k_policy="fixed", k=3, budget=24, sink_tokens=4)
    assert run_worker(spec, prompts, params) == expected
    assert spec.metrics.draft_tokens > 0
