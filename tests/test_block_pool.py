"""Block pool, block tables and the scheduler's bookkeeping (no model needed for most)."""

from __future__ import annotations

import random

import pytest
import torch

from modeling.attention import physical_runs
from modeling.block_pool import BlockPool, BlockTable
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.errors import OutOfBlocksError
from modeling.sampling import SamplingParams


def test_allocate_free_and_refcounts():
    pool = BlockPool(8, 4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 5
    pool.incref(a[:2])
    assert pool.refcount(0) == 2 and pool.refcount(2) == 1
    pool.free(a)
    assert pool.num_free == 6 and pool.refcount(0) == 1 and pool.refcount(2) == 0
    pool.free(a[:2])
    assert pool.num_free == 8
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([0])
    with pytest.raises(ValueError, match="is free"):
        pool.incref([5])


def test_out_of_blocks_takes_nothing():
    pool = BlockPool(4, 4)
    pool.allocate(3)
    with pytest.raises(OutOfBlocksError, match="need 2 KV blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_growth_prefers_the_next_block():
    pool = BlockPool(16, 4)
    t1, t2 = BlockTable(4), BlockTable(4)
    t1.ensure_capacity(pool, 8)   # blocks 0, 1
    t2.ensure_capacity(pool, 4)   # block 2
    t1.ensure_capacity(pool, 12)  # 2 is taken: lowest free is 3
    t2.ensure_capacity(pool, 8)   # after 2 comes 3 (taken) -> 4
    assert t1.blocks == [0, 1, 3] and t2.blocks == [2, 4]
    t2.release(pool)
    t1.ensure_capacity(pool, 16)  # after 3 comes 4, free again
    assert t1.blocks == [0, 1, 3, 4]
    t1.truncate(pool, 5)
    assert t1.blocks == [0, 1] and pool.num_free == 14


def test_slots_and_physical_runs():
    table = BlockTable(4, [5, 6, 2, 3, 9])
    assert table.slots(3, 6) == [23, 24, 25]
    # positions 2..17 -> blocks 5,6 contiguous, then 2,3 contiguous, then 9
    assert physical_runs(table.blocks, 4, 2, 18) == [(22, 6), (8, 8), (36, 2)]


def test_random_alloc_free_never_leaks():
    rng = random.Random(0)
    pool = BlockPool(64, 4)
    tables: list[BlockTable] = []
    for _ in range(2000):
        if tables and (rng.random() < 0.4 or pool.num_free == 0):
            t = tables.pop(rng.randrange(len(tables)))
            t.release(pool)
        else:
            t = BlockTable(4)
            try:
                t.ensure_capacity(pool, rng.randint(1, 40))
                tables.append(t)
            except OutOfBlocksError:
                pass
        used = sum(len(t.blocks) for t in tables)
        assert pool.num_used == used
        assert len({b for t in tables for b in t.blocks}) == used  # no block owned twice
    for t in tables:
        t.release(pool)
    assert pool.num_free == pool.num_blocks


def test_engine_frees_every_block_after_many_requests(llama_dir):
    """Many requests with aborts and a pool small enough to force preemption: nothing leaks."""
    engine = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=512, block_size=16, token_budget=64,
                                                     attention_backend="torch"))
    g = torch.Generator().manual_seed(0)
    ids = []
    for i in range(24):
        prompt = torch.randint(2, 300, (int(torch.randint(4, 120, (1,), generator=g)),), generator=g).tolist()
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True)))
    steps = 0
    finished = set()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        steps += 1
        if steps == 5:
            for rid in ids[::5]:
                engine.abort(rid)
        assert engine.pool.num_used <= engine.pool.num_blocks
    assert engine.scheduler.num_preemptions > 0
    assert engine.pool.num_free == engine.pool.num_blocks
    assert len(finished) + len(ids[::5]) >= len(ids)
