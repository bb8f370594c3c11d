"""Tier loads written into the cache layer by layer beside the pass that reads them
(``modeling/kv_tiers/layer_load.py``): each layer is in before the pass reaches it, loads apply in order, a failed
copy fails the pass instead of serving what the block held before; a prefill worker serving a document evicted
from its pool to the host tier samples the reference's first token with the same log-probability, loaded layer
by layer or at once."""

from __future__ import annotations

import random

import pytest
import torch

from modeling.engine import EngineConfig, ReferenceEngine
from modeling.instance_config import KVTiersConfig
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.kv_tiers.layer_load import LayerLoads
from modeling.prefix_hash import block_hashes
from modeling.sampling import SamplingParams
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.messages import PrefillRequest
from prefill_worker.worker import PrefillWorker

SPEC = KVCacheSpec(num_layers=6, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)


def _parts(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SPEC.num_layers, 2, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim, generator=g)
            for _ in range(n)]


def _layer(cache: PagedKVCache, layer: int, blocks: list[int]) -> torch.Tensor:
    """[n, 2, bs, H, D]: what the cache's layer holds of ``blocks``."""
    return cache.kv[layer][:, blocks].transpose(0, 1)


def test_each_layer_is_in_before_the_pass_reaches_it_and_loads_apply_in_order(device="cpu"):
    cache = PagedKVCache(SPEC, num_blocks=16, device=device)
    loads = LayerLoads(cache)
    try:
        first, second = _parts(3, seed=1), _parts(2, seed=2)
        loads.add([3, 7, 9], first)
        loads.add([9, 2], second)  # block 9 again: freed and handed out before the pass, the later load wins
        assert len(loads) == 2
        for layer in range(SPEC.num_layers):
            loads.wait_for_layer_load(layer)
            got = _layer(cache, layer, [3, 7, 9, 2]).cpu()
            want = torch.stack([first[0][layer], first[1][layer], second[0][layer], second[1][layer]])
            assert torch.equal(got, want), layer
        loads.finish()
        assert len(loads) == 0 and loads.loads_added == 2
        loads.finish()  # nothing pending: returns at once
        assert torch.count_nonzero(cache.kv[:, :, [0, 1, 4, 5, 6, 8, 10]]) == 0  # no other block was written
    finally:
        loads.close()


def test_a_copy_that_fails_fails_the_pass():
    cache = PagedKVCache(SPEC, num_blocks=8)
    loads = LayerLoads(cache)
    try:
        loads.add([1], [torch.zeros(SPEC.num_layers, 2, SPEC.block_size + 1, SPEC.num_kv_heads, SPEC.head_dim)])
        with pytest.raises(RuntimeError, match="writing a loaded block"):
            loads.wait_for_layer_load(0)
        with pytest.raises(RuntimeError, match="writing a loaded block"):
            loads.finish()
        assert len(loads) == 0
        good = _parts(1, seed=3)
        loads.add([2], good)  # the copier goes on with the next load
        loads.finish()
        assert torch.equal(cache.kv[:, :, 2], good[0])
    finally:
        loads.close()


BLOCK = 16
GREEDY_WITH_LOGPROB = SamplingParams(max_tokens=1, logprobs=3)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 380) for _ in range(n)]


def _first(worker: PrefillWorker, rid: str, prompt: list[int]):
    worker.add_request(PrefillRequest(rid, tuple(prompt), GREEDY_WITH_LOGPROB, None))
    firsts = []
    while worker.has_work():
        firsts += worker.step().first_tokens
    (first,) = firsts
    return first


@pytest.fixture(scope="module")
def reference(llama_dir):
    return ReferenceEngine(llama_dir, EngineConfig(block_size=BLOCK, attention_backend="torch", prefix_caching=False))


def _served_after_eviction(llama_dir, reference, layered: bool, device: str = "cpu"):
    """A prefill worker with a 512-token pool over a host tier serves a 320-token document with a question, two
    400-token prompts push the document out of the pool, and a second question on it comes back: its document
    loaded from the host tier. Returns (the worker, the second prompt's first token, the reference's)."""
    tiers = KVTiersConfig(host_memory_mb=16, disk_mb=0, layered_loads=layered)
    worker = PrefillWorker(llama_dir, PrefillWorkerConfig(
        block_size=BLOCK, kv_cache_tokens=512, token_budget=128, attention_backend="torch", kv_tiers=tiers,
        device=device), "prefill-0")
    rng = random.Random(7)
    doc = _tokens(rng, 320)
    _first(worker, "q1", doc + _tokens(rng, 9))
    for i in range(2):
        _first(worker, f"other-{i}", _tokens(rng, 400))
    assert worker.pool.cached_run(block_hashes(doc, BLOCK, worker.prefix_cache.salt)) == 0  # gone from the pool
    second = doc + _tokens(rng, 11)
    got = _first(worker, "q2", second)
    want = reference.generate([second], [GREEDY_WITH_LOGPROB])[0].logprobs[0]
    return worker, got, want


@pytest.mark.parametrize("layered", [True, False], ids=["layer-by-layer", "at-once"])
def test_a_document_evicted_to_the_host_tier_is_loaded_and_sampled_as_the_reference(llama_dir, reference, layered):
    worker, got, want = _served_after_eviction(llama_dir, reference, layered)
    try:
        assert got.cached.from_tiers == 320 and got.cached.tokens == 320  # the document's 20 blocks, loaded
        assert got.token_id == want.token_id and got.logprob.logprob == pytest.approx(want.logprob, abs=1e-4)
        loads = worker.core.tiers.layer_loads
        assert (loads is not None and loads.loads_added == 1 and len(loads) == 0) if layered else loads is None
        assert worker.pool.num_free == worker.pool.num_blocks and worker.prefix_cache.num_tracked == 0
    finally:
        worker.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_each_layer_is_in_before_the_pass_reaches_it():
    test_each_layer_is_in_before_the_pass_reaches_it_and_loads_apply_in_order(device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_document_evicted_to_the_host_tier_is_loaded_layer_by_layer(llama_dir, reference):
    worker, got, want = _served_after_eviction(llama_dir, reference, layered=True, device="cuda")
    try:
        assert got.cached.from_tiers == 320 and worker.core.tiers.layer_loads.loads_added == 1
        assert got.token_id == want.token_id and got.logprob.logprob == pytest.approx(want.logprob, abs=2e-3)
    finally:
        worker.close()

