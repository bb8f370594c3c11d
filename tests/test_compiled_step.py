"""Compiled decode, verification and draft steps (``compile_steps``) against eager steps: identical logits,
identical greedy tokens, seeded sampling that repeats exactly, and eager fallback when compiling fails.

Identity holds in bfloat16 where the bf16 linear layers run on the CPU extension's ``skinny_linear`` (AVX512-BF16:
a row is computed alike whatever the step around it, compiled or not); without it, torch's bf16 GEMM (oneDNN,
which may emulate bf16) runs the compiled and eager steps through different kernels, so those machines compare
float32 steps."""

from __future__ import annotations

import pytest
import torch

from modeling.engine import EngineConfig, ReferenceEngine
from modeling.sampling import SamplingParams
from tests.test_model_hf import random_prompts

cpu_kernel = pytest.importorskip("modeling.attention.cpu_kernel")
if not cpu_kernel.cpu_kernel_available():
    pytest.skip(f"cpu attention kernel unavailable: {cpu_kernel.cpu_kernel_error()}", allow_module_level=True)


def _identity_dtype() -> str:
    from modeling.cpu_linear import skinny_linear_available

    return "bfloat16" if skinny_linear_available() else "float32"


DTYPE = _identity_dtype()


def engine(directory: str, compile_steps: bool) -> ReferenceEngine:
    return ReferenceEngine(directory, EngineConfig(dtype=DTYPE, token_budget=32, kv_cache_tokens=4096,
                                                   attention_backend="cpu", compile_steps=compile_steps))


def test_compiled_engine_equals_eager_greedy_and_seeded(checkpoint_dir):
    """Batched chunked prefill (eager) then decode steps of 1-4 sequences (compiled): greedy and seeded
    sampled outputs equal the eager engine's token for token, every decode step having gone compiled."""
    directory = checkpoint_dir("llama_gqa")
    prompts = random_prompts([5, 40, 90, 23], seed=2)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.9, seed=40 + i)
               for i in range(len(prompts))]
    eager, compiled = engine(directory, False), engine(directory, True)
    assert eager.runner.compiled is None and compiled.runner.compiled is not None
    for params in (greedy, sampled):
        want = [c.token_ids for c in eager.generate(prompts, params)]
        assert [c.token_ids for c in compiled.generate(prompts, params)] == want
    steps = compiled.runner.compiled
    assert steps.failed is None and steps.steps >= 2 * 11  # every decode step of both runs


def test_compiled_speculation_equals_eager_autoregressive(checkpoint_dir):
    """Self-speculation with compiled draft (sparse view) and verification (k + 1 rows) steps gives the greedy
    tokens of eager plain decoding on the same kernels."""
    from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
    from decode_worker.worker import DecodeWorker
    from tests.test_decode_worker import run_worker

    directory = checkpoint_dir("llama_gqa")
    prompts = random_prompts([30, 70], seed=3)
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    def worker(compile_steps: bool, **spec) -> DecodeWorker:
        return DecodeWorker(directory, DecodeWorkerConfig(
            dtype=DTYPE, kv_cache_tokens=2048, attention_backend="cpu", compile_steps=compile_steps,
            profile_on_start=False, speculation=SpeculationConfig(**spec)))

    want = run_worker(worker(False, drafter="none"), prompts, params)
    worker = worker(True, drafter="self_sparse", k_policy="fixed", k=3, budget=24, sink_tokens=4)
    assert run_worker(worker, prompts, params) == want
    assert worker.metrics.draft_tokens > 0 and worker.runner.compiled.steps > 0
    assert worker.runner.compiled.failed is None


def test_a_failing_compile_falls_back_to_eager(checkpoint_dir, monkeypatch):
    directory = checkpoint_dir("llama_gqa")
    prompts = random_prompts([9, 30], seed=4)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [c.token_ids for c in engine(directory, False).generate(prompts, params)]
    broken = engine(directory, True)

    def fail(*args, **kwargs):
        raise RuntimeError("inductor: no C++ compiler\nmore lines")

    monkeypatch.setattr(broken.runner.compiled, "_fn", fail)
    assert [c.token_ids for c in broken.generate(prompts, params)] == want
    assert broken.runner.compiled.failed == "RuntimeError: inductor: no C++ compiler"


@pytest.mark.parametrize("fields,message", [
    (dict(compile_steps="yes"), "compile_steps: must be true or false"),
    (dict(compile_steps=True, attention_backend="torch"), "compile_steps: runs with the triton .* got 'torch'"),
    (dict(compile_steps=True, devices_per_instance=1, attention_backend="cpu"), "attention_backend auto or triton"),
])
def test_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)
