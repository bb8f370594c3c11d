"""Whole KV blocks of a sharded tensor-parallel instance, read and written from rank 0 (``ShardedBlocks``, what
the KV tiers keep): real ranks in their own processes over gloo, each cache holding only its heads."""

from __future__ import annotations

import pytest
import torch

from kv_transfer import Rendezvous
from modeling.engine import EngineConfig
from modeling.heads import shard_heads
from modeling.tp import TPShard
from tests.kv_procs import run_procs

ENGINE = EngineConfig(dtype="float32", block_size=4, kv_cache_tokens=64, attention_backend="torch")
NUM_KV_HEADS = 2  # llama_gqa
READ, WRITE = [9, 2, 5], [3, 12]


def _fill(cache, heads) -> None:
    """Every element names its layer, K or V, block, slot, global head and lane."""
    L, _, n, bs, h, d = cache.kv.shape
    grid = torch.meshgrid(*(torch.arange(x, dtype=torch.float32) for x in (L, 2, n, bs, h, d)), indexing="ij")
    layer, kv, block, slot, head, lane = grid
    cache.kv.copy_(layer * 1e5 + kv * 1e4 + block * 100 + slot * 10 + (head + heads.start) + lane * 1e-3)


def _whole(blocks, spec, base: float) -> torch.Tensor:
    """What the instance's every head holds in ``blocks`` after ``_fill`` (``base`` 0), or what a write puts there."""
    n = len(blocks)
    out = torch.empty(n, spec.num_layers, 2, spec.block_size, NUM_KV_HEADS, spec.head_dim)
    for i, b in enumerate(blocks):
        grid = torch.meshgrid(*(torch.arange(x, dtype=torch.float32) for x in out.shape[1:]), indexing="ij")
        layer, kv, slot, head, lane = grid
        out[i] = base + layer * 1e5 + kv * 1e4 + b * 100 + slot * 10 + head + lane * 1e-3
    return out


def _form(rdv, rank, size):
    from modeling.tp_group import TPGroup

    return TPGroup.form(rdv.connect(), "blocks", TPShard(rank, size), "cpu")


def driver(path, rdv, size):
    from modeling.engine import ReferenceEngine
    from modeling.tp_runner import ShardedBlocks

    engine = ReferenceEngine(path, ENGINE, tp=_form(rdv, 0, size))
    try:
        cache = engine.runner.cache
        _fill(cache, shard_heads(NUM_KV_HEADS, size, 0))
        blocks = ShardedBlocks(engine.runner, NUM_KV_HEADS)
        read = blocks.read_blocks(READ)
        blocks.write_blocks(WRITE, _whole(WRITE, blocks.spec, base=0.5))
        # numpy: a tensor would cross the result queue as shared memory that dies with the process
        own = cache.read_blocks(WRITE + READ)
        return {"spec_heads": blocks.spec.num_kv_heads, "read": read.numpy(), "own": own.numpy()}
    finally:
        engine.close()


def follower(path, rdv, rank, size):
    from modeling.engine import follower as engine_follower

    rank_follower = engine_follower(path, ENGINE, _form(rdv, rank, size))
    _fill(rank_follower.runner.cache, shard_heads(NUM_KV_HEADS, size, rank))
    rank_follower.serve()
    return {"own": rank_follower.runner.cache.read_blocks(WRITE + READ).numpy()}


@pytest.mark.parametrize("size", [2, 4])  # 4 ranks over 2 KV heads: each head held by two ranks
def test_rank_0_reads_and_writes_every_head_of_whole_blocks(checkpoint_dir, size):
    path = checkpoint_dir("llama_gqa")
    store, rdv = Rendezvous.host_store()
    specs = {"r0": (driver, dict(path=path, rdv=rdv, size=size))}
    specs.update({f"r{r}": (follower, dict(path=path, rdv=rdv, rank=r, size=size)) for r in range(1, size)})
    out = {name: {k: torch.from_numpy(v) if hasattr(v, "shape") else v for k, v in result.items()}
           for name, result in run_procs(specs, timeout_s=120).items()}
    del store
    spec = _spec_of(out["r0"]["read"])
    assert out["r0"]["spec_heads"] == NUM_KV_HEADS
    assert torch.equal(out["r0"]["read"], _whole(READ, spec, base=0.0))  # every rank's heads, in place
    for rank in range(size):  # each rank wrote its heads of the written blocks and kept the others untouched
        heads = shard_heads(NUM_KV_HEADS, size, rank)
        want = torch.cat([_whole(WRITE, spec, base=0.5), _whole(READ, spec, base=0.0)])[..., heads.start : heads.end, :]
        assert torch.equal(out[f"r{rank}"]["own"], want), rank


def _spec_of(kv: torch.Tensor):
    from modeling.kv_cache import KVCacheSpec

    _, layers, _, block_size, heads, dim = kv.shape
    return KVCacheSpec(layers, heads, dim, block_size, kv.dtype)
