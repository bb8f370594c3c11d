"""Layer-wise streaming: an attention context that reports each layer as soon as its KV is written.

The prefill worker runs its forward with :class:`LayerStreamingContext`; the callback posts that
layer's KV sends (asynchronous), so layer ``i`` travels while layers ``i+1 ..`` compute (Splitwise).
"""

from __future__ import annotations

from typing import Callable

import torch

from modeling.attention import AttentionBackend, AttentionMetadata, PagedAttentionContext
from modeling.kv_cache import PagedKVCache


class LayerStreamingContext(PagedAttentionContext):
    """PagedAttentionContext that calls ``on_layer_written(layer)`` between the cache write and the
    attention of each layer (the layer's KV for this step is final from that point on)."""

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata, backend: AttentionBackend,
                 on_layer_written: Callable[[int], None]):
        super().__init__(cache, meta, backend)
        self.on_layer_written = on_layer_written

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer, self.meta.slot_mapping, k, v)
        self.on_layer_written(layer)
        k_cache, v_cache = self.cache.layer(layer)
        return self.backend.forward(q, k, v, k_cache, v_cache, self.meta)
