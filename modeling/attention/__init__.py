"""Attention over the paged KV cache, behind one small backend interface.

A backend implements ``forward(q, k, v, k_cache, v_cache, meta, sliding_window=None) -> out`` (shapes in
:class:`TorchAttentionBackend`); ``sliding_window`` is the layer's window (the visibility rule of
:mod:`modeling.attention.metadata`). :class:`PagedAttentionContext` adapts a backend to the model's
AttentionContext: for each layer it writes the new keys/values into the cache, then attends;
:class:`LayerHookContext` also calls a KV connector's layer hook around each write
(:mod:`modeling.kv_connector`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from modeling.attention.cpu_kernel import CpuPagedAttentionBackend, cpu_kernel_available, cpu_kernel_error
from modeling.attention.flash_backend import (FLASH_BLOCK_MULTIPLE, FLASH_DTYPES, FlashAttentionBackend,
                                              flash_attn_available)
from modeling.attention.metadata import AttentionMetadata, physical_runs
from modeling.attention.torch_backend import TorchAttentionBackend
from modeling.attention.triton_backend import (TritonAttentionBackend, split_keys_for, triton_available,
                                               triton_import_error)
from modeling.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from modeling.kv_connector import LayerHook

BACKENDS = ("torch", "flash", "triton", "cpu", "auto")

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "LayerHookContext",
    "PagedAttentionContext",
    "TorchAttentionBackend",
    "make_backend",
    "physical_runs",
]


class AttentionBackend(Protocol):
    name: str

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        sliding_window: int | None = None,
    ) -> torch.Tensor: ...


def make_backend(name: str, device: torch.device | str, block_size: int,
                 dtype: torch.dtype = torch.bfloat16, max_len: int | None = None) -> AttentionBackend:
    """'torch' | 'flash' | 'triton' | 'cpu' | 'auto'. ``max_len``: the longest sequence the cache may hold
    (sizes Triton's key splits, ``triton_backend.split_keys_for``).

    'cpu' is the C++ CPU kernel (built by ``magicserve build``, else on first use); 'triton' runs on CUDA (on
    CPU only under Triton's interpreter, for tests). 'auto' picks, on CUDA, flash when installed and the block
    size and ``dtype`` (the KV cache's: flash-attn has half-precision kernels only) allow, else triton when it
    imports; on CPU the cpu kernel when it builds; else torch."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend: unknown {name!r}; allowed: {', '.join(BACKENDS)}")
    device = torch.device(device)
    if name == "flash":
        if device.type != "cuda":
            raise ValueError("attention_backend: 'flash' runs on CUDA only; use 'torch' on CPU")
        return FlashAttentionBackend(block_size)
    if name == "triton":
        if not triton_available(device):
            reason = triton_import_error() or (
                f"device {device}: Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1 (tests only)")
            raise ValueError(f"attention_backend: 'triton' unavailable ({reason}); use 'torch'")
        return TritonAttentionBackend(split_keys_for(max_len))
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend: 'cpu' runs on CPU only, got device {device}")
        if not cpu_kernel_available():
            raise ValueError(f"attention_backend: 'cpu' kernel unavailable ({cpu_kernel_error()}); use 'torch'")
        return CpuPagedAttentionBackend()
    if (name == "auto" and device.type == "cuda" and block_size % FLASH_BLOCK_MULTIPLE == 0
            and dtype in FLASH_DTYPES and flash_attn_available()):
        return FlashAttentionBackend(block_size)
    if name == "auto" and device.type == "cuda" and triton_available(device):
        return TritonAttentionBackend(split_keys_for(max_len))
    if name == "auto" and device.type == "cpu" and cpu_kernel_available():
        return CpuPagedAttentionBackend()
    return TorchAttentionBackend()


class PagedAttentionContext:
    """The model's AttentionContext for one step over a paged cache."""

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata, backend: AttentionBackend):
        self.cache = cache
        self.meta = meta
        self.backend = backend

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None = None) -> torch.Tensor:
        self.cache.write(layer, self.meta.slot_mapping, k, v)
        k_cache, v_cache = self.cache.layer(layer)
        return self.backend.forward(q, k, v, k_cache, v_cache, self.meta, sliding_window)


class LayerHookContext(PagedAttentionContext):
    """PagedAttentionContext that calls ``hook.wait_for_layer_load(layer)`` before each layer's cache write and
    ``hook.save_kv_layer(layer)`` right after it, before the layer's attention (its KV for this step is final
    from that point on, so a connector may send it while the later layers compute). ``loads``: False when the
    caller has waited for every layer's loads already (a compiled step that fell back to eager)."""

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata, backend: AttentionBackend, hook: "LayerHook",
                 loads: bool = True):
        super().__init__(cache, meta, backend)
        self.hook = hook
        self.loads = loads

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None = None) -> torch.Tensor:
        if self.loads:
            self.hook.wait_for_layer_load(layer)
        self.cache.write(layer, self.meta.slot_mapping, k, v)
        self.hook.save_kv_layer(layer)
        k_cache, v_cache = self.cache.layer(layer)
        return self.backend.forward(q, k, v, k_cache, v_cache, self.meta, sliding_window)
