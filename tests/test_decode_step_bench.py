"""benchmarks/decode_step.py's breakdown of a step into attention, linear layers and the rest."""

from __future__ import annotations

import pytest
import torch

from benchmarks.decode_step import PartTimer, median_parts, served_linears, timed_parts
from modeling.attention import make_backend
from modeling.block_pool import BlockPool, BlockTable
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.checkpoint import load_model
from modeling.runner import ModelRunner, StepInput

BLOCK = 16


def runner_and_inputs(llama_dir, backend: str, batch: int = 2, context: int = 40):
    loaded = load_model(llama_dir, "float32", "cpu")
    mc = loaded.config
    spec = KVCacheSpec(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, BLOCK, torch.float32)
    pool = BlockPool(32, BLOCK)
    runner = ModelRunner(loaded.model, PagedKVCache(spec, 32), make_backend(backend, "cpu", BLOCK))
    tables = [BlockTable(BLOCK) for _ in range(batch)]
    for t in tables:
        t.ensure_capacity(pool, context + 1)
    return runner, [StepInput([1], context, t.blocks) for t in tables]


def test_part_timer_times_every_attention_and_linear_call_then_removes_itself(llama_dir):
    runner, inputs = runner_and_inputs(llama_dir, "torch")
    model = runner.model
    expected = runner.run(inputs)
    layers = model.config.num_hidden_layers
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    with PartTimer(runner) as timer:
        logits = runner.run(inputs)
    assert timer.calls == {"attention": layers, "linear": linears}  # lm_head among the linears
    assert timer.seconds["attention"] > 0 and timer.seconds["linear"] > 0
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)  # timing changes nothing computed
    # nothing left installed: the backend's own forward, no hooks
    assert "forward" not in vars(runner.backend)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    parts = timed_parts(runner, inputs)  # the parts lie within the step they were timed in, with more besides
    assert set(parts) == {"attention", "linear", "step"}
    assert 0 < parts["attention"] and 0 < parts["linear"] and parts["attention"] + parts["linear"] < parts["step"]
    rest = median_parts([parts, parts])["rest"]  # what the parts leave of the step
    assert rest == pytest.approx(parts["step"] - parts["attention"] - parts["linear"]) and rest > 0


def test_served_linears_routes_only_for_the_cpu_kernel_and_restores(llama_dir):
    from modeling.cpu_linear import routed_layers, skinny_linear_available

    runner, _ = runner_and_inputs(llama_dir, "torch")
    with served_linears(runner):
        assert routed_layers(runner.model) == 0
    if not skinny_linear_available():
        pytest.skip("no skinny_linear on this CPU (no AVX512-BF16 or no kernel): torch's linear layers serve the cpu "
                    "backend too")
    runner, _ = runner_and_inputs(llama_dir, "cpu")
    runner.model.to(torch.bfloat16)
    with served_linears(runner):
        assert routed_layers(runner.model) > 0
    assert routed_layers(runner.model) == 0
