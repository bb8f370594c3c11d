"""The CPU extension's kernels as torch custom operators, so ``torch.compile`` keeps them in its graph.

Eager code calls the extension directly (a custom operator's dispatch costs microseconds per call, which a
decode step of small layers would feel); compiled code (:mod:`modeling.compiled_step`) goes through these:
``magicserve::cpu_paged_attention``, ``magicserve::write_kv`` (the cache write, in place) and
``magicserve::skinny_linear``. Each has a fake implementation giving the output's shape, so the compiler
traces them without running them. :func:`register_cpu_ops` registers them once, on first need.
"""

from __future__ import annotations

import threading

import torch

from modeling.attention.cpu_kernel import load_cpu_kernel
from modeling.kv_cache import write_layer

_lock = threading.Lock()
_registered = False


def register_cpu_ops() -> None:
    """Register the three operators under ``torch.ops.magicserve`` (idempotent; builds the extension)."""
    global _registered
    with _lock:
        if _registered:
            return
        ext = load_cpu_kernel()

        @torch.library.custom_op("magicserve::cpu_paged_attention", mutates_args=())
        def cpu_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                                sink_len: int, window_starts: torch.Tensor, scale: float,
                                sliding_window: int) -> torch.Tensor:
            return ext.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, sink_len,
                                       window_starts, scale, sliding_window)

        @cpu_paged_attention.register_fake
        def _(q, k_cache, v_cache, block_tables, seq_lens, query_start, sink_len, window_starts, scale,
              sliding_window):
            return torch.empty_like(q)

        @torch.library.custom_op("magicserve::write_kv", mutates_args=("kv",))
        def write_kv(kv: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            # the whole cache is the mutated argument (a graph input mutated in place): a view of it would be
            # copied back only where the compiler tracks views
            write_layer(kv, layer, slots, k, v)

        @write_kv.register_fake
        def _(kv, layer, slots, k, v):
            return None

        @torch.library.custom_op("magicserve::skinny_linear", mutates_args=())
        def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return ext.skinny_linear(x, w, bias)

        @skinny_linear.register_fake
        def _(x, w, bias):
            return x.new_empty(x.shape[0], w.shape[0])

        _registered = True
