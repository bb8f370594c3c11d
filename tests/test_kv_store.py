"""The cluster-wide KV store tier (Mooncake Store, its master and segment server started for real): an
instance serves a document another instance computed, from the store, with the tokens of an engine without
caching (float32, greedy); a corrupt object is recomputed, never served; a store that is down degrades to
computing, and serving heals when it returns."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from modeling.engine import EngineConfig, ReferenceEngine
from modeling.instance_config import KVStoreConfig, KVTiersConfig
from modeling.kv_tiers.store import client_problem
from modeling.sampling import SamplingParams

if client_problem() is not None:
    pytest.skip(f"Mooncake Store cannot load here: {client_problem()}", allow_module_level=True)

from controller.kv_store import MooncakeStoreService  # noqa: E402

BLOCK = 16
CFG = EngineConfig(kv_cache_tokens=512, block_size=BLOCK, token_budget=128, attention_backend="torch")
GREEDY = SamplingParams(max_tokens=8)
STORE = KVStoreConfig(backend="mooncake", segment_mb=256, retry_s=0.5)


@pytest.fixture(scope="module")
def store():
    service = MooncakeStoreService.start(STORE)
    yield service
    service.stop()


@pytest.fixture(scope="module")
def plain(llama_dir):
    return ReferenceEngine(llama_dir, dataclasses.replace(CFG, prefix_caching=False))


def _engine(llama_dir, master_address: str, name: str) -> ReferenceEngine:
    """An engine whose only tier is the store (no host or disk tier)."""
    tiers = KVTiersConfig(host_memory_mb=0, disk_mb=0, store=dataclasses.replace(STORE, master_address=master_address))
    return ReferenceEngine(llama_dir, dataclasses.replace(CFG, kv_tiers=tiers), instance_id=name)


def _prompts(seed: int) -> tuple[list[int], list[int], list[int]]:
    rng = random.Random(seed)
    doc = [rng.randrange(3, 380) for _ in range(320)]
    return doc, doc + [rng.randrange(3, 380) for _ in range(7)], doc + [rng.randrange(3, 380) for _ in range(9)]


def _run(engine, prompt):
    return engine.generate([prompt], GREEDY)[0].token_ids


def test_an_instance_serves_a_document_another_computed(llama_dir, store, plain):
    doc, first, second = _prompts(0)
    a = _engine(llama_dir, store.master_address, "colocated-0")
    out = [_run(a, first)]
    a.close()  # its writes finish; the blocks stay in the store's segment server
    b = _engine(llama_dir, store.master_address, "colocated-1")
    try:
        out.append(_run(b, second))
        assert b.prefix_cache.stats.tier_hits == len(doc) // BLOCK * BLOCK
        assert b.core.tiers.store.stats.hits == len(doc) // BLOCK
        assert out == [_run(plain, first), _run(plain, second)]
    finally:
        b.close()


def test_a_corrupt_object_is_recomputed_not_served(llama_dir, store, plain):
    from modeling.kv_tiers.store import encode
    from modeling.prefix_hash import block_hashes

    doc, first, second = _prompts(1)
    a = _engine(llama_dir, store.master_address, "colocated-0")
    tier = a.core.tiers.store
    first_block = block_hashes(doc, BLOCK, a.prefix_cache.salt)[0]
    # the document's first object is there already, cut off: the engine's own write leaves it as it is
    assert tier._writer.put(tier.prefix + f"{first_block:016x}", encode(first_block, b"\0" * 100)[:-5]) == 0
    out = [_run(a, first)]
    a.close()
    b = _engine(llama_dir, store.master_address, "colocated-1")
    try:
        out.append(_run(b, second))
        assert out == [_run(plain, first), _run(plain, second)]
        assert b.core.tiers.store.stats.corrupt == 1 and b.prefix_cache.stats.tier_hits == 0
    finally:
        b.close()


def test_a_store_that_is_down_degrades_to_computing_and_heals(llama_dir, plain):
    service = MooncakeStoreService.start(STORE)
    port = int(service.master_address.rsplit(":", 1)[1])
    engine = _engine(llama_dir, service.master_address, "colocated-0")
    try:
        service.stop()
        _, first, _ = _prompts(2)
        t0 = time.perf_counter()
        assert _run(engine, first) == _run(plain, first)  # computed: the store is not asked while it is down
        assert engine.prefix_cache.stats.tier_hits == 0 and time.perf_counter() - t0 < 30
        service = MooncakeStoreService.start(STORE, master_port=port)  # back (empty) on the same address
        tier = engine.core.tiers.store
        deadline = time.monotonic() + 60
        for seed in range(10, 1000):  # fresh documents until writes go through again
            _run(engine, _prompts(seed)[1])
            engine.core.tiers.flush()
            if tier.stats.stored or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert tier.stats.stored > 0, "the store did not take writes again"
        time.sleep(STORE.retry_s)
        doc, first, second = _prompts(1000)
        _run(engine, first)
        engine.core.tiers.flush()
        other = _engine(llama_dir, service.master_address, "colocated-1")
        try:
            assert _run(other, second) == _run(plain, second)
            assert other.prefix_cache.stats.tier_hits == len(doc) // BLOCK * BLOCK
        finally:
            other.close()
    finally:
        engine.close()
        service.stop()
