"""Paged attention backends against the dense masked oracle."""

from __future__ import annotations

import random

import pytest
import torch

from modeling.attention import AttentionMetadata, TorchAttentionBackend
from modeling.attention.torch_backend import dense_reference_attention


def make_case(dtype, seq_lens, q_lens, hq=8, hkv=2, d=32, bs=16, nb=400, sparse=False, seed=0):
    """Random cache, fragmented block tables; new k/v are the cache's last q_len tokens per sequence."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kc = torch.randn(nb, bs, hkv, d, dtype=dtype)
    vc = torch.randn(nb, bs, hkv, d, dtype=dtype)
    free = list(range(nb))
    tables = []
    for i, n in enumerate(seq_lens):
        need = -(-n // bs)
        if i % 2 == 0:  # contiguous run
            tables.append(free[:need]); free = free[need:]
        else:  # shuffled blocks
            pick = rng.sample(free, need); tables.append(pick); free = [b for b in free if b not in pick]
    qs = [0]
    for q in q_lens:
        qs.append(qs[-1] + q)
    windows = [max(0, n - q - rng.randint(10, 300)) for n, q in zip(seq_lens, q_lens)] if sparse else None
    meta = AttentionMetadata(query_start=qs, seq_lens=list(seq_lens), block_tables=tables,
                             slot_mapping=torch.zeros(qs[-1], dtype=torch.long), block_size=bs,
                             sink_len=4 if sparse else 0, window_starts=windows)
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, n, q in zip(tables, seq_lens, q_lens) for p in range(n - q, n)])
    q = torch.randn(qs[-1], hq, d, dtype=dtype)
    return q, flat_k[slots], flat_v[slots], kc, vc, meta


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("sparse", [False, True])
def test_torch_backend_matches_dense(dtype, tol, fused, sparse):
    # decode (1), verification (k+1 = 4, 6) and a prefill chunk (40) in one step
    q, k, v, kc, vc, meta = make_case(dtype, seq_lens=[700, 333, 1000, 45, 1], q_lens=[1, 4, 40, 6, 1], sparse=sparse)
    ref = dense_reference_attention(q, kc, vc, meta)
    out = TorchAttentionBackend(use_fused_cpu_kernel=fused).forward(q, k, v, kc, vc, meta)
    assert (out.float() - ref.float()).abs().max().item() < tol


def test_metadata_rejects_hidden_new_tokens():
    with pytest.raises(ValueError, match="window_starts must not hide"):
        AttentionMetadata(query_start=[0, 2], seq_lens=[10], block_tables=[[0]], slot_mapping=torch.zeros(2),
                          block_size=16, sink_len=0, window_starts=[9])


def test_prefix_ranges_sparse_view():
    meta = AttentionMetadata(query_start=[0, 1], seq_lens=[100], block_tables=[[0] * 7], slot_mapping=torch.zeros(1),
                             block_size=16, sink_len=4, window_starts=[60])
    assert meta.prefix_ranges(0) == [(0, 4), (60, 99)]
    meta.window_starts = [2]
    assert meta.prefix_ranges(0) == [(0, 4), (4, 99)]
