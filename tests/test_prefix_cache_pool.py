"""Prefix caching in the block pool, on plain objects: content hashes, cached blocks kept after release and
found again, LRU eviction only when space is needed, never a referenced block, no leak."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from modeling.block_pool import BlockPool, BlockTable
from modeling.errors import OutOfBlocksError
from modeling.prefix_hash import block_hashes, kv_salt


def test_hashes_chain_over_the_prefix_and_the_salt():
    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2  # the partly filled third block has none
    assert block_hashes(list(range(8)) + [99, 98], 4) == a  # what follows the full blocks does not matter
    b = block_hashes([0, 1, 2, 7] + list(range(4, 10)), 4)
    assert b[0] != a[0] and b[1] != a[1]  # block 1 has the same tokens but another prefix
    assert block_hashes(list(range(10)), 4, salt=kv_salt("model", "float32")) != a
    # resuming from a parent gives the same chain
    assert block_hashes(list(range(12)), 4, parent=a[1], start_block=2) == block_hashes(list(range(12)), 4)[2:]
    # the same in another process (the router matches hashes reported by every instance)
    code = "from modeling.prefix_hash import block_hashes; print(block_hashes(list(range(10)), 4))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str(a)


def test_a_released_cached_block_stays_findable_until_space_is_needed():
    pool = BlockPool(4, 4)
    t = BlockTable(4)
    t.ensure_capacity(pool, 8)  # blocks 0, 1
    h = block_hashes(list(range(8)), 4)
    assert pool.cache(0, h[0]) and pool.cache(1, h[1])
    assert not pool.cache(1, h[1])  # cached already
    t.release(pool)
    assert pool.num_free == 4 and pool.num_evictable == 2 and pool.num_cached == 2
    # never-cached blocks go first (2 and 3), then the least recently released cached one
    other = pool.allocate(2)
    assert sorted(other) == [2, 3] and pool.num_cached == 2
    assert pool.cached_prefix(h) == [0, 1] and pool.num_free == 0 and pool.num_evictable == 0
    pool.free([0, 1])  # released last to first: block 1, the chain's end, is the older
    pool.free(other)
    assert pool.allocate(3) == [2, 3, 1] and pool.num_evictions == 1 and pool.cached_hash(1) is None
    assert pool.cached_hash(0) == h[0] and pool.num_evictable == 1
    assert pool.cached_prefix(h) == [0]  # the chain's start is still found


def test_a_referenced_block_is_never_evicted_and_sharing_counts_references():
    pool = BlockPool(3, 2)
    a = pool.allocate(2)
    h = block_hashes([1, 2, 3, 4], 2)
    pool.cache(a[0], h[0])
    pool.cache(a[1], h[1])
    shared = pool.cached_prefix(h)
    assert shared == a and pool.refcount(a[0]) == 2
    pool.free(a)  # one reference left on each: not evictable
    assert pool.num_evictable == 0 and pool.num_free == 1
    pool.allocate(1)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    assert pool.cached_prefix(h) == a  # still cached
    with pytest.raises(ValueError, match="only a referenced block can be cached"):
        BlockPool(2, 2).cache(0, 7)


def test_the_same_content_is_cached_once():
    pool = BlockPool(4, 2)
    a, b = pool.allocate(1), pool.allocate(1)
    h = block_hashes([5, 6], 2)[0]
    assert pool.cache(a[0], h) and not pool.cache(b[0], h)
    pool.free(b)
    assert pool.num_evictable == 0  # b was never cached: plainly free
    assert pool.cached_prefix([h]) == a


def test_random_use_never_leaks_and_free_plus_referenced_is_total():
    rng = random.Random(1)
    pool = BlockPool(32, 4)
    tables: list[tuple[BlockTable, list[int]]] = []
    prompts = [[rng.randrange(50) for _ in range(rng.randint(4, 40))] for _ in range(8)]
    for _ in range(3000):
        if tables and (rng.random() < 0.45 or pool.num_free < 12):
            t, _ = tables.pop(rng.randrange(len(tables)))
            t.release(pool)
        else:
            prompt = rng.choice(prompts)
            hashes = block_hashes(prompt, 4)
            t = BlockTable(4, pool.cached_prefix(hashes))
            try:
                t.ensure_capacity(pool, len(prompt) + 1)
            except OutOfBlocksError:
                t.release(pool)
                continue
            for block, h in zip(t.blocks, hashes):  # its prompt's full blocks are now final
                pool.cache(block, h)
            tables.append((t, prompt))
        referenced = {b for t, _ in tables for b in t.blocks}
        assert pool.num_used == len(referenced)
        assert pool.num_free + len(referenced) == pool.num_blocks
        assert all(pool.refcount(b) == sum(b in t.blocks for t, _ in tables) for b in referenced)
        for t, prompt in tables:  # every cached block a table holds carries its own content's hash
            for block, h in zip(t.blocks, block_hashes(prompt, 4)):
                assert pool.cached_hash(block) in (None, h)
    for t, _ in tables:
        t.release(pool)
    assert pool.num_free == pool.num_blocks and pool.num_evictable == pool.num_cached
