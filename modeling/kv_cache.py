"""The paged KV cache tensors.

Layout: one tensor ``kv`` of shape [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = keys, 1 = values). Per layer, keys and values are each [num_blocks, block_size, Hkv, D]: the
paged layout flash-attn's ``flash_attn_with_kvcache`` reads, and a run of consecutive blocks is one
contiguous [n_tokens, Hkv, D] slab. kv_transfer moves ``kv[layer, :, blocks]`` layer by layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of a paged KV cache; two caches can exchange blocks iff their specs match."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_in(self, memory_bytes: int) -> int:
        """How many blocks fit in ``memory_bytes``."""
        return memory_bytes // self.bytes_per_block


class PagedKVCache:
    """Preallocated KV storage for ``num_blocks`` blocks of ``spec.block_size`` tokens, plus ``scratch_blocks``
    after them that no block pool hands out (captured steps write their padding tokens' KV there)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu", scratch_blocks: int = 0):
        self.spec = spec
        self.num_blocks = num_blocks
        self.scratch_blocks = scratch_blocks
        # kv: [L, 2, num_blocks + scratch_blocks, block_size, Hkv, D]
        self.kv = torch.zeros(
            spec.num_layers, 2, num_blocks + scratch_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim,
            dtype=spec.dtype, device=device,
        )

    @property
    def scratch_slot(self) -> int:
        """The first slot of the scratch blocks (ValueError when there are none)."""
        if not self.scratch_blocks:
            raise ValueError("this cache has no scratch block")
        return self.num_blocks * self.spec.block_size

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of one layer, each [num_blocks, block_size, Hkv, D]."""
        return self.kv[layer, 0], self.kv[layer, 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens. slots: int64 [T] flat slot ids; k, v: [T, Hkv, D]."""
        write_layer(self.kv, layer, slots, k, v)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, keys and values): [(source, destination), ...]."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=self.kv.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=self.kv.device)
        self.kv.index_copy_(2, dst, self.kv.index_select(2, src))

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """Whole blocks' KV, one block per row: [n, L, 2, block_size, Hkv, D] (a copy, on the cache's device)."""
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.kv.device)
        return self.kv.index_select(2, idx).movedim(2, 0)

    def write_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        """Write whole blocks' KV, [n, L, 2, block_size, Hkv, D] as :meth:`read_blocks` gives it, into ``blocks``."""
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.kv.device)
        self.kv.index_copy_(2, idx, kv.movedim(0, 2).to(self.kv.device, non_blocking=True))


def write_layer(kv: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new tokens of one layer into ``kv`` [L, 2, blocks, block_size, Hkv, D] in place. slots: int64 [T]
    flat slot ids; k, v: [T, Hkv, D] (cast to the cache's dtype)."""
    hkv, d = kv.shape[4], kv.shape[5]
    kv[layer, 0].view(-1, hkv, d).index_copy_(0, slots, k.to(kv.dtype))
    kv[layer, 1].view(-1, hkv, d).index_copy_(0, slots, v.to(kv.dtype))
