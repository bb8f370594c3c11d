"""The Triton attention backend against the dense float32 oracle, in Triton's interpreter on CPU (conftest sets
``TRITON_INTERPRET=1`` without CUDA), so the GPU kernel's code is checked on every commit.

Covered: decode, k + 1 verification and prefill chunks in one step, the sparse sink + window view at any
alignment, sliding windows, grouped-query heads (1, 3 and 8 query heads per KV head), head dims and block
sizes that are not powers of two, key splits (flash-decoding) and their merge, rows computed alike whatever
the step around them (batch, query count, split count), and the model end to end: greedy generation and
speculative decoding token-identical to the torch backend."""

from __future__ import annotations

import math

import pytest
import torch

from modeling.attention import make_backend
from modeling.attention.torch_backend import dense_reference_attention
from modeling.attention.triton_backend import (SPLIT_KEYS, TritonAttentionBackend, launch_shape, merge_splits,
                                               split_keys_for, triton_available)
from tests.test_sliding_window import make_step

if not triton_available("cpu"):
    pytest.skip("triton is not installed (the test extras) or TRITON_INTERPRET is off", allow_module_level=True)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# decode (1), verification (4 and 6), a prefill chunk (40) and a first token in one step
MIXED = dict(seq_lens=[300, 133, 200, 45, 1], q_lens=[1, 4, 40, 6, 1])


def check(q, kc, vc, meta, dtype, window=None, split_keys=SPLIT_KEYS, k=None, v=None):
    ref = dense_reference_attention(q, kc, vc, meta, window).float()
    out = TritonAttentionBackend(split_keys).forward(q, k, v, kc, vc, meta, window)
    assert out.dtype == q.dtype and out.shape == q.shape
    err = (out.float() - ref).abs().max().item()
    assert err <= TOL[dtype], f"max abs err {err} > {TOL[dtype]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("window", [None, 5, 37])
def test_mixed_step_matches_dense_oracle(dtype, sparse, window):
    q, k, v, kc, vc, meta = make_step(**MIXED, sparse=sparse, dtype=dtype, seed=1)
    check(q, kc, vc, meta, dtype, window, k=k, v=v)


@pytest.mark.parametrize("split_keys", [64, 192, 448])
@pytest.mark.parametrize("sparse,window", [(False, None), (True, None), (False, 37), (True, 300)])
def test_key_splits_merge_to_the_same_attention(split_keys, sparse, window):
    # long decode and verification rows, split along their keys; a split may see none of a row's keys
    q, k, v, kc, vc, meta = make_step([700, 333, 520], [1, 4, 1], sparse=sparse, seed=2)
    check(q, kc, vc, meta, torch.float32, window, split_keys=split_keys)


@pytest.mark.parametrize("sink,starts", [
    (4, [5, 70, 190]),  # window starts off block boundaries
    (20, [9, 33, 12]),  # a sink longer than some windows' starts (the view is then the full prefix there)
    (0, [150, 1, 198]),  # no sink: recent window only
    (7, [299, 133, 200]),  # the window holds only the step's own tokens: sink + new tokens
])
def test_sparse_views_at_any_alignment(sink, starts):
    q, _, _, kc, vc, meta = make_step([300, 137, 204], [1, 4, 4], sparse=True, seed=3)
    meta.sink_len, meta.window_starts = sink, [min(s, meta.context_len(b)) for b, s in enumerate(starts)]
    for window in (None, 11):
        check(q, kc, vc, meta, torch.float32, window)


@pytest.mark.parametrize("g,d,bs", [(1, 64, 16), (3, 40, 12), (8, 32, 8), (4, 128, 1), (2, 16, 5)])
def test_group_sizes_head_dims_and_block_sizes(g, d, bs):
    q, _, _, kc, vc, meta = make_step(**MIXED, g=g, d=d, bs=bs, sparse=True, dtype=torch.float16, seed=4)
    check(q, kc, vc, meta, torch.float16, window=9)


@pytest.mark.parametrize("dtype,split_keys", [(torch.float32, SPLIT_KEYS), (torch.float16, SPLIT_KEYS),
                                              (torch.float16, 128)])
@pytest.mark.parametrize("sparse,window", [(False, None), (True, None), (False, 50)])
def test_verification_rows_equal_decode_steps_bit_for_bit(dtype, split_keys, sparse, window):
    """Each query row meets its keys in the same position-aligned tiles and split chunks, in products of the
    same shape, whatever the rows beside it, so verifying k + 1 tokens scores each exactly as a decode step
    at that position (700 keys: 2 and 6 splits)."""
    from modeling.attention import AttentionMetadata

    q, _, _, kc, vc, meta = make_step([700], [6], sparse=sparse, dtype=dtype, seed=6)
    backend = TritonAttentionBackend(split_keys)
    verify = backend.forward(q, None, None, kc, vc, meta, window)
    for i in range(6):
        step = AttentionMetadata(query_start=[0, 1], seq_lens=[700 - 5 + i], block_tables=meta.block_tables,
                                 slot_mapping=meta.slot_mapping[i : i + 1], block_size=meta.block_size,
                                 sink_len=meta.sink_len, window_starts=meta.window_starts)
        decode = backend.forward(q[i : i + 1], None, None, kc, vc, step, window)
        assert torch.equal(decode[0], verify[i]), f"row {i}"


@pytest.mark.parametrize("dtype,sparse,window", [(torch.float32, False, None), (torch.float16, False, None),
                                                (torch.float16, True, None), (torch.float16, False, 50)])
def test_a_row_is_computed_alike_whatever_the_step_around_it(dtype, sparse, window):
    """Batch invariance: a decode row alone (300 keys: one split, written directly), beside longer sequences
    (three splits, merged) and in a step with a fixed larger split count (a captured step's) is the same bit
    for bit, so eager and graph-replayed steps, and any batching, give the same tokens."""
    from modeling.attention import AttentionMetadata

    q, _, _, kc, vc, meta = make_step([300, 700, 1500], [1, 1, 1], sparse=sparse, dtype=dtype, seed=7)
    batched = TritonAttentionBackend().forward(q, None, None, kc, vc, meta, window)
    fixed = TritonAttentionBackend(num_splits=5).forward(q, None, None, kc, vc, meta, window)
    for b in range(3):
        alone = AttentionMetadata(query_start=[0, 1], seq_lens=[meta.seq_lens[b]], block_tables=[meta.block_tables[b]],
                                  slot_mapping=meta.slot_mapping[b : b + 1], block_size=meta.block_size,
                                  sink_len=meta.sink_len,
                                  window_starts=None if meta.window_starts is None else [meta.window_starts[b]])
        single = TritonAttentionBackend().forward(q[b : b + 1], None, None, kc, vc, alone, window)
        assert torch.equal(single[0], batched[b]) and torch.equal(fixed[b], batched[b]), f"sequence {b}"


def test_strided_queries_are_read_in_place():
    # q as the model hands it over: a view of a wider projection (token stride > Hq * D)
    q, _, _, kc, vc, meta = make_step(**MIXED, seed=5)
    wide = torch.cat([q, torch.randn_like(q)], dim=1)[:, : q.shape[1]]
    assert not wide.is_contiguous()
    check(wide, kc, vc, meta, torch.float32)


def test_merge_of_partials_is_the_softmax_over_all_keys():
    torch.manual_seed(0)
    scores = torch.randn(5, 3, 40)  # [T, H, keys]
    values = torch.randn(40, 8)
    parts = [(0, 13), (13, 14), (14, 40)]
    outs = torch.stack([torch.softmax(scores[..., a:b], -1) @ values[a:b] for a, b in parts])
    lses = torch.stack([torch.logsumexp(scores[..., a:b], -1) for a, b in parts])
    lses[1, 0, 0] = float("-inf")  # a split that saw no key of a row: weight 0
    outs[1, 0, 0] = 0.0
    full = torch.softmax(scores, -1) @ values
    full_without = torch.softmax(torch.cat([scores[0, 0, :13], scores[0, 0, 14:]]), -1) @ torch.cat(
        [values[:13], values[14:]])
    merged = merge_splits(outs, lses / math.log(2), torch.float32)  # base-2 log-sum-exps
    torch.testing.assert_close(merged[0, 0], full_without)
    torch.testing.assert_close(merged[1:], full[1:])
    # a row with one nonempty split comes out as that split's partial, bit for bit, whatever follows
    lses[1:, 2, 1] = float("-inf")
    outs[1:, 2, 1] = 0.0
    assert torch.equal(merge_splits(outs, lses / math.log(2), torch.float32)[2, 1], outs[0, 2, 1])


def test_launch_shape_tiles_and_splits():
    decode = launch_shape(num_seqs=1, num_kv_heads=8, group=4, head_dim=128, max_q_len=1, max_keys=16384)
    assert (decode.g_pad, decode.block_q, decode.block_d) == (4, 4, 128)  # 16 rows: the smallest dot
    assert decode.num_splits == 16384 // SPLIT_KEYS and decode.grid() == (1, 8, 32)
    verify = launch_shape(1, 8, 4, 128, 6, 16385, split_keys=4096)
    assert (verify.block_q, verify.grid()) == (4, (1, 8, 2 * 5))  # the decode shape: 2 query tiles x 5 splits
    short = launch_shape(64, 8, 4, 128, 4, SPLIT_KEYS)
    assert short.num_splits == 1 and short.split_keys >= 2**30  # one chunk holds every key
    fixed = launch_shape(3, 8, 4, 128, 1, 1000, num_splits=6)  # a captured step's count, for 3000 keys
    assert fixed.num_splits == 6 and fixed.split_keys == SPLIT_KEYS and fixed.grid() == (3, 8, 6)
    with pytest.raises(ValueError, match="num_splits: 1 splits of 512 keys cannot cover 1000 keys"):
        launch_shape(3, 8, 4, 128, 1, 1000, num_splits=1)
    with pytest.raises(ValueError, match="split_keys: must be a positive multiple of 64, got 100"):
        TritonAttentionBackend(split_keys=100)
    # long models: bigger chunks, at most MAX_SPLITS of them (the backend make_backend gives for the cache)
    assert [split_keys_for(n) for n in (None, 16384, 16385, 131072)] == [512, 512, 1024, 4096]
    assert make_backend("triton", "cpu", 16, max_len=131072).split_keys == 4096
    prefill = launch_shape(2, 8, 3, 80, 1000, 100_000)
    assert (prefill.g_pad, prefill.block_q, prefill.block_d) == (4, 16, 128)
    assert prefill.grid() == (2, 8, 63) and prefill.num_splits == 1  # prefill chunks are never split


def test_make_backend_needs_cuda_or_the_interpreter(monkeypatch):
    assert make_backend("triton", "cpu", 16).name == "triton"
    assert make_backend("auto", "cpu", 16).name != "triton"  # on CPU auto keeps the CPU paths
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="'triton' unavailable.*TRITON_INTERPRET=1"):
        make_backend("triton", "cpu", 16)


# -- the model end to end -----------------------------------------------------------------------------------

def test_engine_greedy_tokens_equal_the_torch_backend(checkpoint_dir):
    from modeling.engine import EngineConfig, ReferenceEngine
    from modeling.sampling import SamplingParams
    from tests.test_model_hf import random_prompts

    directory = checkpoint_dir("llama_gqa")
    prompts = random_prompts([3, 17, 45], seed=7)
    outs = {}
    for backend in ("triton", "torch"):
        engine = ReferenceEngine(directory, EngineConfig(token_budget=16, kv_cache_tokens=2048,
                                                         attention_backend=backend))
        assert engine.runner.backend.name == backend
        outs[backend] = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))]
    assert outs["triton"] == outs["torch"]


def test_self_sparse_speculation_on_triton_equals_autoregressive(checkpoint_dir):
    """The draft's sparse view (sink 2 + budget 6: unaligned, behind the layer window of 8) and k + 1
    verification on Triton: greedy speculation equals autoregressive decoding on the torch backend."""
    from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
    from decode_worker.worker import DecodeWorker
    from modeling.engine import EngineConfig, ReferenceEngine
    from modeling.sampling import SamplingParams
    from tests.test_decode_worker import run_worker
    from tests.test_model_hf import random_prompts

    directory = checkpoint_dir("mistral_swa")
    prompts = random_prompts([40, 23], seed=7)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = ReferenceEngine(directory, EngineConfig(kv_cache_tokens=2048, attention_backend="torch"))
    expected = [c.token_ids for c in engine.generate(prompts, params)]
    cfg = DecodeWorkerConfig(dtype="float32", kv_cache_tokens=2048, attention_backend="triton", profile_on_start=False,
                             speculation=SpeculationConfig(drafter="self_sparse", k_policy="fixed", k=3, budget=6,
                                                           sink_tokens=2))
    worker = DecodeWorker(directory, cfg)
    assert worker.runner.backend.name == "triton"
    assert run_worker(worker, prompts, params) == expected
    assert worker.metrics.draft_tokens > 0


def test_padded_static_steps_equal_eager_steps(checkpoint_dir):
    """The CUDA-graph path of compile_steps without the capture: decode, verification and sparse draft steps
    padded to a batch bucket and run from static buffers give the eager step's logits (float32, 1e-5) and
    greedy tokens, write the same KV, and write padding only to the scratch block."""
    from modeling.block_pool import BlockPool, BlockTable
    from modeling.checkpoint import load_model
    from modeling.step_graphs import GraphSteps
    from modeling.kv_cache import KVCacheSpec, PagedKVCache
    from modeling.runner import ModelRunner, StepInput
    from tests.test_model_hf import random_prompts

    loaded = load_model(checkpoint_dir("mistral_swa"), "float32", "cpu")
    c = loaded.config
    spec = KVCacheSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 16, torch.float32)
    runners = []
    for graphs in (False, True):
        cache = PagedKVCache(spec, 64, scratch_blocks=1 if graphs else 0)
        runner = ModelRunner(loaded.model, cache, TritonAttentionBackend(num_splits=1))
        if graphs:
            runner.compiled = GraphSteps(loaded.model, cache, max_len=512, capture=False)
        runners.append(runner)
    pool = BlockPool(64, 16)
    prompts = random_prompts([20, 45, 33], seed=9)
    tables = [BlockTable(16) for _ in prompts]
    for t, p in zip(tables, prompts):
        t.ensure_capacity(pool, len(p) + 24)
    # prefill eagerly on both (a long step: never padded)
    for runner in runners:
        runner.run([StepInput(p, 0, t.blocks) for p, t in zip(prompts, tables)])
    eager, padded = runners
    tokens = [[p[-1]] for p in prompts]
    lens = [len(p) for p in prompts]
    steps = [("decode", 1, None), ("verify", 4, None), ("draft", 1, (3, [8, 30, 12])), ("decode", 1, None)]
    for kind, q, view in steps:
        inputs = [StepInput([tok[-1]] * q, n, t.blocks, num_logits=q) for tok, n, t in zip(tokens, lens, tables)]
        sink, starts = view if view else (0, None)
        outs = [r.run(inputs, sink_len=sink, window_starts=starts) for r in runners]
        assert (outs[0] - outs[1]).abs().max().item() < 1e-5, kind
        assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1)), kind
        if kind != "verify":
            for tok, nxt in zip(tokens, outs[0].argmax(-1).tolist()):
                tok.append(nxt)
        lens = [n + q for n in lens]
    assert padded.compiled.steps == len(steps) and padded.compiled.failed is None
    assert set(padded.compiled.graphs) == {(4, 1, False, 0), (4, 4, False, 0), (4, 1, True, 3)}  # 3 seqs -> 4
    # same KV in every pool block; padding wrote the scratch block only
    n = eager.cache.num_blocks
    assert (eager.cache.kv - padded.cache.kv[:, :, :n]).abs().max().item() < 1e-5
    assert padded.cache.kv[:, :, n:].abs().sum().item() > 0
