"""Writing received KV regions into a paged cache (``kv_transfer/blocks.py``)."""

from __future__ import annotations

import threading

import torch

from kv_transfer.blocks import write_region

BLOCKS, BLOCK, HEADS, DIM = 64, 16, 2, 64


def test_a_region_write_touches_only_its_blocks_and_heads():
    t = torch.zeros(BLOCKS, BLOCK, HEADS, DIM)
    write_region(t, [9, 2, 40], slice(1, 2), torch.ones(3, BLOCK, 1, DIM))
    write_region(t, [5, 6], slice(0, 2), torch.full((2, BLOCK, 2, DIM), 2.0))
    want = torch.zeros_like(t)
    want[[9, 2, 40], :, 1] = 1.0
    want[5:7] = 2.0
    assert torch.equal(t, want)


def test_legs_of_different_heads_written_at_once_into_scattered_blocks_keep_each_other():
    """Two sending ranks' legs of one prompt land in the same scattered blocks, each its own head, on two reading
    threads at once: each leg's head holds exactly what that leg last wrote, whatever the other thread does."""
    t = torch.zeros(BLOCKS, BLOCK, HEADS, DIM)
    blocks = list(range(0, BLOCKS, 2))  # scattered: the staged path
    rounds = 300
    lost: list[tuple[int, int, float]] = []

    def leg(head: int) -> None:
        for i in range(1, rounds + 1):
            held = t[blocks, :, head].min().item()
            if held != i - 1:  # nothing but this leg writes this head
                lost.append((head, i, held))
            write_region(t, blocks, slice(head, head + 1), torch.full((len(blocks), BLOCK, 1, DIM), float(i)))

    threads = [threading.Thread(target=leg, args=(h,)) for h in range(HEADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not lost, lost[:5]
    assert torch.equal(t[blocks], torch.full((len(blocks), BLOCK, HEADS, DIM), float(rounds)))
