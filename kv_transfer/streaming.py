"""Layer-wise streaming: an attention context that reports each layer as soon as its KV is written.

The prefill worker runs its forward with :class:`LayerStreamingContext`; the callback posts that
layer's KV sends (asynchronous), so layer ``i`` travels while layers ``i+1 ..`` compute (Splitwise).
"""

from __future__ import annotations

from typing import Callable

import torch

from kv_transfer.sender import KVSender, LegTarget
from modeling.attention import AttentionBackend, AttentionMetadata, PagedAttentionContext
from modeling.config import ModelConfig
from modeling.heads import legs_from, plan_transfer, rank_peer_id
from modeling.kv_cache import PagedKVCache
from modeling.runner import ModelRunner, StepInput


class LayerStreamingContext(PagedAttentionContext):
    """PagedAttentionContext that calls ``on_layer_written(layer)`` between the cache write and the
    attention of each layer (the layer's KV for this step is final from that point on)."""

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata, backend: AttentionBackend,
                 on_layer_written: Callable[[int], None]):
        super().__init__(cache, meta, backend)
        self.on_layer_written = on_layer_written

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None = None) -> torch.Tensor:
        self.cache.write(layer, self.meta.slot_mapping, k, v)
        self.on_layer_written(layer)
        k_cache, v_cache = self.cache.layer(layer)
        return self.backend.forward(q, k, v, k_cache, v_cache, self.meta, sliding_window)


def forward_streaming(runner: ModelRunner, sender: KVSender, inputs: list[StepInput], ready: dict[str, int],
                      layerwise: bool) -> tuple[torch.Tensor, list[int]]:
    """Run a prefill forward over ``runner``'s cache and send the KV of each prompt's ``ready`` blocks:
    each layer as soon as it is written (``layerwise``), or all layers after the pass. Returns the final
    hidden states and the logit rows (``ModelRunner.forward``'s result)."""
    ids, positions, meta, rows = runner.build(inputs)
    if layerwise:
        group = sender.open_group(ready)
        hidden = runner.model(ids, positions, LayerStreamingContext(runner.cache, meta, runner.backend, group.send_layer))
        group.close()
    else:
        hidden = runner.model(ids, positions, LayerStreamingContext(runner.cache, meta, runner.backend, lambda layer: None))
        group = sender.open_group(ready)
        for layer in range(runner.model.config.num_hidden_layers):
            group.send_layer(layer)
        group.close()
    return hidden, rows


def leg_targets(config: ModelConfig, rank: int, tp: int, decode_id: str, decode_tp: int,
                reserved: bool) -> list[LegTarget]:
    """The legs prefill rank ``rank`` of ``tp`` sends for one prompt to a decode instance of ``decode_tp``
    ranks (the N x M plan of :mod:`modeling.heads`); ``reserved``: the decode instance holds room for
    the request already. May be empty: with replicated heads, some prefill ranks send nothing."""
    legs = legs_from(plan_transfer(config.num_key_value_heads, tp, decode_tp), rank)
    return [LegTarget(rank_peer_id(decode_id, leg.dst_rank, decode_tp), leg.heads, reserved) for leg in legs]
