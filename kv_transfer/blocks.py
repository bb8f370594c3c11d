"""Moving one layer's K or V of some blocks between a paged cache and a channel.

A region is ``cache.kv[layer, kv_index]`` ([num_blocks, block_size, Hkv_local, D]) restricted to some
blocks and a local head slice. When the blocks are consecutive and the slice covers every local head,
the region is one contiguous slab and goes on the wire zero-copy; otherwise it is gathered into (on
send) or scattered from (on receive) a staging tensor of shape [n, block_size, heads, D]. A channel whose
data path is gloo carries host tensors only: a CUDA cache's regions are always staged in host memory.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from kv_transfer.channel import PairChannel, PendingSend


def consecutive(blocks: list[int]) -> bool:
    return all(b == blocks[0] + i for i, b in enumerate(blocks))


def region_for_send(kv: torch.Tensor, layer: int, kv_index: int, blocks: list[int], heads: slice) -> torch.Tensor:
    """Contiguous [n, block_size, heads, D] tensor with the region's bytes (a view when possible)."""
    t = kv[layer, kv_index]  # [num_blocks, block_size, H, D]
    if consecutive(blocks):
        region = t[blocks[0] : blocks[0] + len(blocks)]
    else:
        region = t.index_select(0, torch.tensor(blocks, dtype=torch.int64, device=t.device))
    region = region[:, :, heads]
    return region if region.is_contiguous() else region.contiguous()


def send_region(channel: PairChannel, kv: torch.Tensor, layer: int, kv_index: int, blocks: list[int],
                heads: slice) -> PendingSend:
    return channel.send_data(region_for_send(kv, layer, kv_index, blocks, heads).to(channel.device))


def post_recv_region(channel: PairChannel, kv: torch.Tensor, layer: int, kv_index: int, blocks: list[int],
                     heads: slice) -> tuple[dist.Work, Callable[[], None]]:
    """Post the receive of a region sent by :func:`send_region`; returns the work and a function to
    call once it has completed (scatters a staged region into the cache; no-op for a direct one)."""
    t = kv[layer, kv_index]  # [num_blocks, block_size, H, D]
    full_heads = heads.start == 0 and heads.stop == t.shape[2]
    if consecutive(blocks) and full_heads and t.device == channel.device:
        return channel.post_recv(t[blocks[0] : blocks[0] + len(blocks)]), _nothing
    n_heads = heads.stop - heads.start
    buf = torch.empty(len(blocks), t.shape[1], n_heads, t.shape[3], dtype=t.dtype, device=channel.device)

    def scatter() -> None:
        write_region(t, blocks, heads, buf.to(t.device))

    return channel.post_recv(buf), scatter


def write_region(t: torch.Tensor, blocks: list[int], heads: slice, src: torch.Tensor) -> None:
    """Write ``src`` [n, block_size, heads, D] into the ``heads`` of ``blocks`` of one layer's K or V ``t``
    [num_blocks, block_size, H, D], touching nothing else: the legs of one prompt from several sending ranks land
    in the same blocks (each its own heads) on their channels' reading threads at the same time, so a write that
    read and rewrote whole blocks could put back another leg's heads as they were before it wrote them."""
    if consecutive(blocks):
        t[blocks[0] : blocks[0] + len(blocks), :, heads].copy_(src)
    else:
        t[:, :, heads].index_copy_(0, torch.tensor(blocks, dtype=torch.int64, device=t.device), src)


def post_discard_region(channel: PairChannel, kv: torch.Tensor, num_blocks: int,
                        n_heads: int) -> tuple[dist.Work, Callable[[], None]]:
    """Post the receive of a region to drop (its reservation was released mid-transfer)."""
    shape = (num_blocks, kv.shape[3], n_heads, kv.shape[5])
    return channel.post_recv(torch.empty(shape, dtype=kv.dtype, device=channel.device)), _nothing


def _nothing() -> None:
    pass
