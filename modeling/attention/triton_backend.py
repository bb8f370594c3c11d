"""Triton paged attention: the GPU backend that needs nothing beyond PyTorch's own Triton.

Runs on CUDA, and on CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is first
imported), which is how CI checks the kernel on every commit. The kernel
(:mod:`modeling.attention.triton_kernels`) covers every step: decode, k + 1 verification, prefill chunks,
the sparse sink + window view at any alignment, sliding windows and grouped-query heads, with float32
accumulation over bf16, fp16 or fp32 caches.

Long contexts at small batch are split along the keys (flash-decoding) so the GPU has enough programs:
each split writes a float32 partial output and log-sum-exp, merged here. The host reads only the step's
Python metadata (no device synchronisation), and the kernel takes every per-sequence value from device
tensors, so a captured step replays with new lengths and block tables written into the same buffers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from modeling.attention.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634
# Split the keys of a step only when each split still gets this many keys.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 32
# Steps whose sequences have at most this many new tokens each use the decode tile shape.
SHORT_QUERY = 16


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
    num_seqs: int
    num_kv_heads: int
    query_tiles: int  # query tiles per sequence

    def grid(self, num_splits: int | None = None) -> tuple[int, int, int]:
        """(sequences, KV heads, query tiles x splits); ``num_splits`` overrides the shape's own."""
        return (self.num_seqs, self.num_kv_heads, self.query_tiles * (num_splits or self.num_splits))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_shape(num_seqs: int, num_kv_heads: int, group: int, head_dim: int, max_q_len: int, max_keys: int,
                 target_programs: int) -> LaunchShape:
    """Tiles and grid for a step. Rows of a program are ``block_q`` tokens x ``g_pad`` heads: 16 (the
    smallest ``tl.dot``) in steps of at most :data:`SHORT_QUERY` tokens per sequence (decode, verification),
    so that a row is computed by products of one shape in both, and 64 in longer steps (prefill chunks).
    Keys are split until the grid has ``target_programs`` programs, keeping at least
    :data:`MIN_KEYS_PER_SPLIT` keys per split."""
    g_pad = _pow2(group)
    rows = max(16 if max_q_len <= SHORT_QUERY else 64, g_pad)
    block_q = rows // g_pad
    tiles = -(-max_q_len // block_q)
    programs = num_seqs * num_kv_heads * tiles
    splits = 1
    if programs < target_programs:
        splits = min(MAX_SPLITS, -(-target_programs // programs), max(1, max_keys // MIN_KEYS_PER_SPLIT))
    return LaunchShape(g_pad=g_pad, block_q=block_q, block_n=64, block_d=max(16, _pow2(head_dim)),
                       num_splits=splits, num_seqs=num_seqs, num_kv_heads=num_kv_heads, query_tiles=tiles)


class TritonAttentionBackend:
    """Paged attention through one Triton kernel. ``num_splits`` fixes the key splits (tests, captured
    steps); by default they follow the step's shape and the device's multiprocessor count."""

    name = "triton"

    def __init__(self, num_splits: int | None = None):
        from modeling.attention import triton_kernels  # imports triton: only when this backend is made

        self._kernel = triton_kernels.paged_attention_kernel
        self.num_splits = num_splits
        self._target_programs: dict[str, int] = {}

    def _programs_wanted(self, device: torch.device) -> int:
        key = str(device)
        if key not in self._target_programs:
            sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
            self._target_programs[key] = 2 * sms
        return self._target_programs[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] (already in the cache, unused here); k_cache, v_cache:
        [num_blocks, block_size, Hkv, D], last dim contiguous. Returns [T, Hq, D] in q's dtype."""
        n_tokens, hq, d = q.shape
        hkv = k_cache.shape[2]
        if n_tokens == 0:
            return torch.empty_like(q)
        max_q = max(meta.q_len(b) for b in range(meta.num_seqs))
        shape = launch_shape(meta.num_seqs, hkv, hq // hkv, d, max_q, max(meta.seq_lens),
                             self._programs_wanted(q.device))
        splits = self.num_splits or shape.num_splits
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
        self._kernel[shape.grid(splits)](
            q, k_cache, v_cache, out, lse,
            t["block_tables"], t["seq_lens"], t["query_start"], t["window_starts"],
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            t["block_tables"].stride(0),
            *o_strides, *l_strides,
            _LOG2E / math.sqrt(d), meta.sink_len, sliding_window or 0, meta.block_size, splits,
            G=hq // hkv, G_PAD=shape.g_pad, BLOCK_Q=shape.block_q, BLOCK_N=shape.block_n,
            HEAD_DIM=d, BLOCK_D=shape.block_d,
            SPARSE=meta.window_starts is not None, WINDOWED=sliding_window is not None,
            WRITE_LSE=splits > 1, DOT_MODE=_dot_mode(k_cache),
        )
        if splits == 1:
            return out
        return merge_splits(out, lse).to(q.dtype)


def _dot_mode(k_cache: torch.Tensor) -> int:
    """The kernel's ``DOT_MODE`` for a cache (see ``triton_kernels._dot``)."""
    if k_cache.dtype == torch.float32:
        return 1
    if k_cache.dtype == torch.bfloat16 and k_cache.device.type == "cpu":
        return 2  # the interpreter
    return 0


def merge_splits(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """out: [S, T, Hq, D] float32 partials over disjoint key sets; lse: [S, T, Hq] their log-sum-exps
    (-inf: the split saw no key). Returns [T, Hq, D] float32, the softmax-weighted sum."""
    total = torch.logsumexp(lse, dim=0)  # [T, Hq]; finite: every token sees at least itself
    weights = torch.exp(lse - total.unsqueeze(0))  # [S, T, Hq]
    return (weights.unsqueeze(-1) * out).sum(0)
