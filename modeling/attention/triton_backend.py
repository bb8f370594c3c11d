"""Triton paged attention: the GPU backend that needs nothing beyond PyTorch's own Triton.

Runs on CUDA, and on CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is first
imported), which is how CI checks the kernel on every commit. The kernel
(:mod:`modeling.attention.triton_kernels`) covers every step: decode, k + 1 verification, prefill chunks,
the sparse sink + window view at any alignment, sliding windows and grouped-query heads, with float32
accumulation over bf16, fp16 or fp32 caches.

Decode and verification steps over long contexts are split along the keys (flash-decoding), so the GPU has
programs enough at small batch: split ``s`` takes the keys at positions ``[s * split_keys, (s + 1) *
split_keys)`` and writes a float32 partial output and log-sum-exp, merged by a second kernel. The chunk size
is the backend's, not the step's, so each query row is computed alike in every step: decode or verification,
whatever sequences share the step, eager or replayed from a captured graph whose split count is fixed for
its longest context (tested bit for bit). Prefill chunks are not split (their partials would be large).
The host reads only the step's Python metadata (no device synchronisation), and the kernel takes every
per-sequence value from device tensors, so a captured step replays with new lengths and block tables
written into the same buffers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from modeling.attention.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634
# Keys per split of decode and verification steps (vLLM's paged attention v2 partitions by 512 too), doubled
# for long models until their longest sequence needs at most MAX_SPLITS splits (``split_keys_for``): a float32
# partial per split and query row is what a split step holds besides the cache.
SPLIT_KEYS = 512
MAX_SPLITS = 32
_UNSPLIT = 1 << 30  # split_keys of a one-split launch: beyond every position
# Steps whose sequences have at most this many new tokens each use the decode tile shape (and are split).
SHORT_QUERY = 16
BLOCK_N = 64  # keys per inner iteration of the kernel


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (the environment flag Triton reads)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_import_error() -> str | None:
    """None when Triton imports, else why not (one line)."""
    try:
        import triton  # noqa: F401 - optional: ships with PyTorch's CUDA wheels, in the test extras on CPU
    except ImportError as err:
        return f"{type(err).__name__}: {err}"
    return None


def triton_available(device: torch.device | str) -> bool:
    """True when the Triton backend can run on ``device``: CUDA with Triton installed, or CPU under the
    interpreter."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and triton_import_error() is None
    return device.type == "cpu" and interpreter_enabled() and triton_import_error() is None


@dataclass(frozen=True)
class LaunchShape:
    """Tile sizes and grid of one step (pure function of the step's shape: see :func:`launch_shape`)."""

    g_pad: int  # query heads per KV head, rounded up to a power of two
    block_q: int  # query tokens per program
    block_n: int  # keys per inner iteration
    block_d: int  # head_dim rounded up to a power of two
    num_splits: int  # key splits per (sequence, KV head, query tile)
    split_keys: int  # keys per split (a multiple of block_n; beyond every position when num_splits is 1)
    num_seqs: int
    num_kv_heads: int
    query_tiles: int  # query tiles per sequence

    def grid(self) -> tuple[int, int, int]:
        """(sequences, KV heads, query tiles x splits)."""
        return (self.num_seqs, self.num_kv_heads, self.query_tiles * self.num_splits)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def split_keys_for(max_len: int | None) -> int:
    """Keys per split for sequences of up to ``max_len`` tokens: :data:`SPLIT_KEYS`, doubled until
    :data:`MAX_SPLITS` splits cover ``max_len`` (None: :data:`SPLIT_KEYS`)."""
    keys = SPLIT_KEYS
    while max_len is not None and keys * MAX_SPLITS < max_len:
        keys *= 2
    return keys


def check_split_keys(split_keys: int) -> None:
    """Keys per split must be a positive multiple of the kernel's key tile (chunks align to tiles)."""
    if split_keys <= 0 or split_keys % BLOCK_N:
        raise ValueError(f"split_keys: must be a positive multiple of {BLOCK_N}, got {split_keys}")


def launch_shape(num_seqs: int, num_kv_heads: int, group: int, head_dim: int, max_q_len: int, max_keys: int,
                 split_keys: int = SPLIT_KEYS, num_splits: int | None = None) -> LaunchShape:
    """Tiles and grid for a step. Rows of a program are ``block_q`` tokens x ``g_pad`` heads: 16 (the
    smallest ``tl.dot``) in steps of at most :data:`SHORT_QUERY` tokens per sequence (decode, verification),
    so that a row is computed by products of one shape in both, and 64 in longer steps (prefill chunks).
    Short steps split their keys in chunks of ``split_keys`` positions: as many splits as the longest
    sequence (``max_keys``) needs, or ``num_splits`` when given (a captured step's, which must cover it)."""
    check_split_keys(split_keys)
    g_pad = _pow2(group)
    short = max_q_len <= SHORT_QUERY
    rows = max(16 if short else 64, g_pad)
    block_q = rows // g_pad
    tiles = -(-max_q_len // block_q)
    needed = -(-max_keys // split_keys) if short else 1
    splits = needed if num_splits is None else num_splits
    if splits < needed:
        raise ValueError(f"num_splits: {splits} splits of {split_keys} keys cannot cover {max_keys} keys")
    return LaunchShape(g_pad=g_pad, block_q=block_q, block_n=BLOCK_N, block_d=max(16, _pow2(head_dim)),
                       num_splits=splits, split_keys=split_keys if splits > 1 else _UNSPLIT, num_seqs=num_seqs,
                       num_kv_heads=num_kv_heads, query_tiles=tiles)


class TritonAttentionBackend:
    """Paged attention through one Triton kernel (and a merge kernel for split steps). ``split_keys``: keys
    per split of decode and verification steps; ``num_splits`` fixes their split count (captured steps: it
    must cover the longest sequence a step may hold), by default as many as each step's longest sequence
    needs. Prefill chunks (more than :data:`SHORT_QUERY` new tokens per sequence) are never split."""

    name = "triton"

    def __init__(self, split_keys: int = SPLIT_KEYS, num_splits: int | None = None):
        from modeling.attention import triton_kernels  # imports triton: only when this backend is made

        check_split_keys(split_keys)
        self._kernel = triton_kernels.paged_attention_kernel
        self.split_keys = split_keys
        self.num_splits = num_splits

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] (already in the cache, unused here); k_cache, v_cache:
        [num_blocks, block_size, Hkv, D], last dim contiguous. Returns [T, Hq, D] in q's dtype."""
        n_tokens, hq, d = q.shape
        hkv = k_cache.shape[2]
        if n_tokens == 0:
            return torch.empty_like(q)
        max_q = max(meta.q_len(b) for b in range(meta.num_seqs))
        shape = launch_shape(meta.num_seqs, hkv, hq // hkv, d, max_q, max(meta.seq_lens), self.split_keys,
                             self.num_splits if max_q <= SHORT_QUERY else None)
        splits = shape.num_splits
        t = meta.tensors(q.device)
        if splits == 1:
            out = torch.empty_like(q)
            lse = out  # not written
            o_strides = (0, out.stride(0), out.stride(1))
            l_strides = (0, 0)
        else:
            out = torch.empty(splits, n_tokens, hq, d, dtype=torch.float32, device=q.device)
            lse = torch.empty(splits, n_tokens, hq, dtype=torch.float32, device=q.device)
            o_strides = (out.stride(0), out.stride(1), out.stride(2))
            l_strides = (lse.stride(0), lse.stride(1))
        self._kernel[shape.grid()](
            q, k_cache, v_cache, out, lse,
            t["block_tables"], t["seq_lens"], t["query_start"], t["window_starts"],
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            t["block_tables"].stride(0),
            *o_strides, *l_strides,
            _LOG2E / math.sqrt(d), meta.sink_len, sliding_window or 0, meta.block_size, splits, shape.split_keys,
            G=hq // hkv, G_PAD=shape.g_pad, BLOCK_Q=shape.block_q, BLOCK_N=shape.block_n,
            HEAD_DIM=d, BLOCK_D=shape.block_d,
            SPARSE=meta.window_starts is not None, WINDOWED=sliding_window is not None,
            WRITE_LSE=splits > 1, DOT_MODE=_dot_mode(k_cache),
        )
        if splits == 1:
            return out
        return merge_splits(out, lse, q.dtype)


def _dot_mode(k_cache: torch.Tensor) -> int:
    """The kernel's ``DOT_MODE`` for a cache (see ``triton_kernels._dot``)."""
    if k_cache.dtype == torch.float32:
        return 1
    if k_cache.dtype == torch.bfloat16 and k_cache.device.type == "cpu":
        return 2  # the interpreter
    return 0


def merge_splits(parts: torch.Tensor, lse2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """parts: [S, T, Hq, D] float32 partials over disjoint key sets; lse2: [S, T, Hq] their base-2
    log-sum-exps (-inf where a split saw no key of the row, its partial then 0). Returns [T, Hq, D] in
    ``dtype``: the softmax-weighted sum, each row's splits added in order (``merge_splits_kernel``)."""
    from modeling.attention.triton_kernels import merge_splits_kernel

    s, t, hq, d = parts.shape
    out = torch.empty(t, hq, d, dtype=dtype, device=parts.device)
    if t:
        merge_splits_kernel[(t, hq)](parts, lse2, out, s, parts.stride(0), parts.stride(1), parts.stride(2),
                                     lse2.stride(0), lse2.stride(1), out.stride(0), out.stride(1),
                                     HEAD_DIM=d, BLOCK_D=max(16, _pow2(d)))
    return out
