"""Triton kernel for paged attention; imported only by :mod:`modeling.attention.triton_backend`.

One kernel serves every step shape: decode (1 query token per sequence), verification (k + 1), prefill
chunks, the sparse sink + window draft view (any alignment) and sliding-window layers, with grouped-query
heads. Each program owns one sequence, one KV head and a tile of ``BLOCK_Q`` query tokens, and holds the
``G`` query heads of that KV head for each of those tokens as rows (row ``r`` is token ``r // G_PAD``,
head ``r % G_PAD``), so every key is read once for all the heads that share it. Keys are walked in tiles
of ``BLOCK_N`` positions through the block table (a gather per position, so no alignment is needed) with
an online softmax in float32 (FlashAttention-2's loop, in base 2).

The visible keys of a query tile are at most two position ranges: range A (the sink, or the whole causal
prefix in a full view) then range B (the view's recent window), each walked in key tiles aligned to
multiples of ``BLOCK_N`` positions. Long contexts are split along the keys (flash-decoding): split ``s``
takes the visible keys at positions ``[s * split_keys, (s + 1) * split_keys)`` and writes a float32 partial
output and its log-sum-exp (base 2), which ``merge_splits_kernel`` combines. The chunks are fixed in
absolute positions, so a query row meets the same keys in the same tiles and chunks whatever the step
around it: the batch beside it, its own step's query count (decode or verification) or the number of
splits in the grid (a captured step's is fixed for its longest context; chunks past a row's keys are
empty and add exact zeros).
The per-row mask applies the visibility rule of :mod:`modeling.attention.metadata`: key ``j`` at or
before the row's position ``p`` and, on a windowed layer, ``j > p - W``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, DOT_MODE: tl.constexpr):
    # 0: the inputs' own precision (bf16/fp16 tensor cores); 1: exact float32 (fp32 caches, no TF32);
    # 2: both upcast to float32 first, the same products as 0 (the interpreter's bf16 dot is broken)
    if DOT_MODE == 0:
        return tl.dot(a, b)
    elif DOT_MODE == 1:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr, window_starts_ptr,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt,
    scale_log2, sink_len, sliding_window, page_size, num_splits, split_keys,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    SPARSE: tl.constexpr, WINDOWED: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_MODE: tl.constexpr,
):
    # q: [T, Hq, D]; k_cache, v_cache: [blocks, page_size, Hkv, D]; out: [S, T, Hq, D] (stride_os 0 when
    # num_splits == 1: the final output); lse: [S, T, Hq] float32 (base 2), written when WRITE_LSE.
    # split_keys: keys per split, a multiple of BLOCK_N (any value >= every sequence's length for one split)
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # cached tokens before this step's

    rows = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + rows // G_PAD  # query token within the sequence
    g = rows % G_PAD
    row_ok = (qi < q_len) & (g < G)
    row_pos = ctx + qi  # [BLOCK_M] position of each row's token
    head = kv_head * G + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    # keys any row of the tile may see: positions lo .. hi - 1, less what the sparse view hides
    hi = ctx + tl.minimum(q_len, (tile + 1) * BLOCK_Q)
    lo = 0
    if WINDOWED:
        lo = tl.maximum(ctx + tile * BLOCK_Q - sliding_window + 1, 0)
    a_lo = lo
    if SPARSE:
        a_hi = tl.minimum(sink_len, hi)
        b_lo = tl.maximum(tl.maximum(tl.load(window_starts_ptr + seq), sink_len), lo)
    else:
        a_hi = hi
        b_lo = hi
    # key tiles start at multiples of BLOCK_N positions, whatever the query tile: a row then meets its keys in
    # the same tiles in a decode step and in a verification step (tiles it does not see add exact zeros)
    # this split's chunk of positions [c_lo, c_hi), a multiple of BLOCK_N wide: each range is cut to it
    c_lo = split * split_keys
    c_hi = c_lo + split_keys
    a_lo = tl.maximum(a_lo, c_lo)
    a_hi = tl.minimum(a_hi, c_hi)
    b_lo = tl.maximum(b_lo, c_lo)
    b_hi = tl.minimum(hi, c_hi)
    a_first = (a_lo // BLOCK_N) * BLOCK_N
    b_first = (b_lo // BLOCK_N) * BLOCK_N
    n_a_tiles = tl.where(a_hi > a_lo, tl.cdiv(a_hi - a_first, BLOCK_N), 0)
    n_tiles = n_a_tiles + tl.where(b_hi > b_lo, tl.cdiv(b_hi - b_first, BLOCK_N), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for it in range(0, n_tiles):
        in_a = it < n_a_tiles
        first = tl.where(in_a, a_first + it * BLOCK_N, b_first + (it - n_a_tiles) * BLOCK_N)
        pos = first + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        key_ok = (pos >= tl.where(in_a, a_lo, b_lo)) & (pos < tl.where(in_a, a_hi, b_hi))
        # int64: page * stride_kb passes 2^31 once a layer's cache holds that many elements
        page = tl.load(table + pos // page_size, mask=key_ok, other=0).to(tl.int64)
        slot_in_page = pos % page_size
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + page[:, None] * stride_kb + slot_in_page[:, None] * stride_ks
                    + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = _dot(q, tl.trans(k), DOT_MODE) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = key_ok[None, :] & (pos[None, :] <= row_pos[:, None])
        if WINDOWED:
            visible = visible & (pos[None, :] > row_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vals = tl.load(v_cache_ptr + page[:, None] * stride_vb + slot_in_page[:, None] * stride_vs
                       + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(vals.dtype), vals, DOT_MODE)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that saw no key: 0
    token = q_start + qi
    tl.store(out_ptr + split * stride_os + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(lse_ptr + split * stride_ls + token * stride_lt + head, lse, mask=row_ok)


@triton.jit
def merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # part: [S, T, Hq, D] float32 partial outputs over disjoint key chunks; lse: [S, T, Hq] their base-2
    # log-sum-exps (-inf: the chunk held no key of the row, its partial 0); out: [T, Hq, D]. One program per
    # (token, query head), the splits taken in order: an empty split adds exact zeros, so a row's result
    # does not depend on how many splits follow its last key, and one nonempty split is returned as it is
    # (weight exp2(0) = 1).
    token = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse_row = lse_ptr + token * stride_lt + head
    m = tl.load(lse_row)
    for s in range(1, num_splits):
        m = tl.maximum(m, tl.load(lse_row + s * stride_ls))
    total = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    part_row = part_ptr + token * stride_pt + head * stride_ph + d
    for s in range(0, num_splits):
        w = tl.exp2(tl.load(lse_row + s * stride_ls) - m)  # finite m: every token sees at least itself
        total += w
        acc += w * tl.load(part_row + s * stride_ps, mask=d_ok, other=0.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, (acc / total).to(out_ptr.dtype.element_ty),
             mask=d_ok)
