"""The C++ CPU paged-attention kernel against the dense oracle (and the torch backend's dispatch)."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from modeling.attention import make_backend
from modeling.attention.metadata import AttentionMetadata
from modeling.attention.torch_backend import dense_reference_attention

cpu_kernel = pytest.importorskip("modeling.attention.cpu_kernel")

if not cpu_kernel.cpu_kernel_available():
    pytest.skip(f"cpu attention kernel unavailable: {cpu_kernel.cpu_kernel_error()}", allow_module_level=True)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_step(seq_lens, q_lens, hkv, g, d, dtype, block_size=16, sink_len=0, windows=None, seed=0, shuffle=True):
    """Random cache + metadata: each sequence owns a shuffled (fragmented) set of physical blocks."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    n_blocks = [-(-n // block_size) for n in seq_lens]
    total = sum(n_blocks) + 7  # a few unused blocks
    ids = list(range(total))
    if shuffle:
        rng.shuffle(ids)
    tables, at = [], 0
    for nb in n_blocks:
        tables.append(ids[at : at + nb])
        at += nb
    k_cache = torch.randn(total, block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(total, block_size, hkv, d, generator=gen).to(dtype)
    qs = [0]
    for ql in q_lens:
        qs.append(qs[-1] + ql)
    q = (torch.randn(qs[-1], hkv * g, d, generator=gen) * 1.5).to(dtype)
    slots = []
    for b, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        for p in range(n - ql, n):
            slots.append(tables[b][p // block_size] * block_size + p % block_size)
    meta = AttentionMetadata(
        query_start=qs, seq_lens=list(seq_lens), block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_size=block_size,
        sink_len=sink_len, window_starts=windows,
    )
    return q, k_cache, v_cache, meta


def check(q, k_cache, v_cache, meta, dtype):
    ref = dense_reference_attention(q, k_cache, v_cache, meta).float()
    out = cpu_kernel.paged_attention(q, k_cache, v_cache, meta)
    assert out.dtype == q.dtype and out.shape == q.shape
    err = (out.float() - ref).abs().max().item()
    assert err <= TOL[dtype], f"max abs err {err} > {TOL[dtype]}"


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g", [1, 4])
def test_mixed_batch_full_view(dtype, g):
    # q_len 1 (decode) and k+1 (verification) mixed; lengths from 1 to ~3000, fragmented tables
    seq_lens = [1, 2, 17, 100, 511, 1024, 1999, 3001, 6]
    q_lens = [1, 2, 1, 5, 1, 3, 6, 4, 6]
    q, kc, vc, meta = make_step(seq_lens, q_lens, hkv=2, g=g, d=64, dtype=dtype, seed=g)
    check(q, kc, vc, meta, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g", [1, 4])
def test_sparse_sink_window(dtype, g):
    seq_lens = [40, 300, 2500, 1030, 64, 9]
    q_lens = [1, 4, 1, 6, 2, 3]
    sink = 8
    # window starts: inside the prefix, at the new tokens, before the sink (= full view), odd offsets
    windows = [20, 300 - 4, 2500 - 700, 1030 - 6 - 333, 0, 5]
    q, kc, vc, meta = make_step(seq_lens, q_lens, hkv=2, g=g, d=64, dtype=dtype, sink_len=sink,
                                windows=windows, seed=10 + g)
    check(q, kc, vc, meta, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sink_only_and_no_sink_window(dtype):
    seq_lens = [1000, 777]
    q_lens = [3, 1]
    q, kc, vc, meta = make_step(seq_lens, q_lens, hkv=2, g=4, d=64, dtype=dtype, sink_len=0,
                                windows=[1000 - 3 - 100, 776], seed=3)
    check(q, kc, vc, meta, dtype)
    q, kc, vc, meta = make_step(seq_lens, q_lens, hkv=2, g=4, d=64, dtype=dtype, sink_len=64,
                                windows=[997, 776], seed=4)  # sink + only the new tokens
    check(q, kc, vc, meta, dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_split_long_sequences(dtype, threads):
    # With 2 threads long sequences are split into KV chunks merged by log-sum-exp.
    torch.set_num_threads(threads)
    seq_lens = [9000, 3, 2049]
    q_lens = [1, 3, 5]
    q, kc, vc, meta = make_step(seq_lens, q_lens, hkv=2, g=4, d=64, dtype=dtype, seed=5)
    check(q, kc, vc, meta, dtype)
    q, kc, vc, meta = make_step(seq_lens, q_lens, hkv=2, g=4, d=64, dtype=dtype, seed=6, sink_len=16,
                                windows=[5000, 0, 1500])
    check(q, kc, vc, meta, dtype)


def test_work_items_run_on_torchs_threads():
    """The build has OpenMP (ATen's parallel_for is inline OpenMP: without it the items run serially), and
    with 2 torch threads a long step keeps more than one core busy; with 1 thread, one."""
    import resource

    assert "openmp" in cpu_kernel.load_cpu_kernel().build_info()
    q, kc, vc, meta = make_step([8192] * 4, [1] * 4, hkv=2, g=4, d=64, dtype=torch.bfloat16, shuffle=False)
    busy = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        cpu_kernel.paged_attention(q, kc, vc, meta)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(30):
            cpu_kernel.paged_attention(q, kc, vc, meta)
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        busy[threads] = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / (t1 - t0)
    assert busy[1] < 1.2, busy
    if (os.cpu_count() or 1) >= 2:
        assert busy[2] > 1.3, busy


@pytest.mark.parametrize("d,block_size", [(128, 16), (32, 8), (40, 16), (64, 1), (64, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims_and_block_sizes(d, block_size, dtype):
    # D=40 exercises the portable scalar path; block sizes 1 and 12 the block-table walk.
    seq_lens = [70, 333, 5]
    q_lens = [1, 4, 2]
    q, kc, vc, meta = make_step(seq_lens, q_lens, hkv=2, g=4, d=d, dtype=dtype, block_size=block_size, seed=7)
    check(q, kc, vc, meta, dtype)


def test_contiguous_physical_blocks_and_empty_sequences():
    # unshuffled tables; a sequence with no new tokens this step (q_len 0) is skipped
    seq_lens = [50, 20, 130]
    q_lens = [2, 0, 1]
    q, kc, vc, meta = make_step(seq_lens, q_lens, hkv=1, g=8, d=64, dtype=torch.float32, shuffle=False, seed=8)
    check(q, kc, vc, meta, torch.float32)


def test_cache_views_from_paged_kv_cache():
    # the backend is fed per-layer views of PagedKVCache.kv (non-zero storage offset)
    from modeling.kv_cache import KVCacheSpec, PagedKVCache

    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    cache = PagedKVCache(spec, num_blocks=80)
    cache.kv.normal_()
    q, _, _, meta = make_step([400, 63], [1, 5], hkv=2, g=4, d=64, dtype=torch.bfloat16, seed=9)
    k_cache, v_cache = cache.layer(2)
    check(q, k_cache, v_cache, meta, torch.bfloat16)


def test_backend_matches_torch_backend_and_delegates_prefill():
    backend = make_backend("cpu", "cpu", 16)
    assert backend.name == "cpu"
    torch_backend = make_backend("torch", "cpu", 16)
    for q_lens in ([1, 3, 6], [1, 40, 2]):  # the second step has a prefill chunk -> torch backend
        seq_lens = [300, 120, 50]
        q, kc, vc, meta = make_step(seq_lens, q_lens, hkv=2, g=4, d=64, dtype=torch.float32, seed=11)
        k_new = kc.view(-1, 2, 64)[meta.slot_mapping]
        v_new = vc.view(-1, 2, 64)[meta.slot_mapping]
        out = backend.forward(q, k_new, v_new, kc, vc, meta)
        ref = torch_backend.forward(q, k_new, v_new, kc, vc, meta)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_make_backend_names():
    assert make_backend("auto", "cpu", 16).name == "cpu"
    with pytest.raises(ValueError):
        make_backend("cpu", "cuda", 16)
    with pytest.raises(ValueError):
        make_backend("nope", "cpu", 16)


# ---- end to end: the model through the paged cache with the cpu backend vs Hugging Face


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2_bias"])
def test_model_prefill_and_decode_match_hf(checkpoint_dir, family):
    # prefill (70 tokens: torch backend via delegation) then 20 decode steps on the kernel, fp32, 1e-4
    from tests.test_model_hf import check_prefill_and_decode

    check_prefill_and_decode(checkpoint_dir(family), backend="cpu")


def test_engine_greedy_matches_torch_backend(checkpoint_dir):
    from modeling.engine import EngineConfig, ReferenceEngine
    from modeling.sampling import SamplingParams
    from tests.test_model_hf import random_prompts

    directory = checkpoint_dir("llama_gqa")
    prompts = random_prompts([3, 17, 150], seed=7)
    outs = {}
    for backend in ("cpu", "torch"):
        engine = ReferenceEngine(directory, EngineConfig(token_budget=16, kv_cache_tokens=4096, attention_backend=backend))
        outs[backend] = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
    assert outs["cpu"] == outs["torch"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verification_rows_equal_decode_steps_bit_for_bit(dtype):
    """Speculation is lossless only if verifying k + 1 tokens scores each of them exactly as a decode step
    at that position would: every query row is computed alone (the same operations in the same order,
    whatever the number of rows beside it), so on one thread the outputs agree to the bit."""
    seq_len, q_len = 1500, 6
    q, kc, vc, meta = make_step([seq_len], [q_len], hkv=2, g=4, d=64, dtype=dtype, seed=3)
    verify = cpu_kernel.paged_attention(q, kc, vc, meta)
    for i in range(q_len):
        step = AttentionMetadata(query_start=[0, 1], seq_lens=[seq_len - q_len + 1 + i],
                                 block_tables=meta.block_tables, slot_mapping=meta.slot_mapping[i : i + 1],
                                 block_size=meta.block_size)
        decode = cpu_kernel.paged_attention(q[i : i + 1], kc, vc, step)
        assert torch.equal(decode[0], verify[i]), f"row {i}"
