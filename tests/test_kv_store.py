"""The cluster-wide KV store tier (Mooncake Store, its master and segment server started for real): an
instance serves a document another instance computed, from the store, with the tokens of an engine without
caching (float32, greedy); a corrupt object is recomputed, never served; a store that is down degrades to
computing, and serving heals when it returns; a block kept in two segments survives the loss of a node."""

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


def _engine(llama_dir, master_address: str, name: str, replicas: int = 1) -> ReferenceEngine:
    """An engine whose only tier is the store (no host or disk tier), writing ``replicas`` copies of a block."""
    store = dataclasses.replace(STORE, master_address=master_address, replicas=replicas)
    tiers = KVTiersConfig(host_memory_mb=0, disk_mb=0, store=store)
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


def test_a_block_kept_in_two_segments_survives_the_loss_of_a_node(llama_dir, plain):
    """A Ray cluster of two nodes (two raylets on this machine), a segment server on each. A document written
    with ``replicas: 2`` is served whole from the store after the second node is removed (its segment server
    dies with its actor, and the master drops the segment once its heartbeats stop); one written with a single
    copy loses the blocks that lived there, and those are computed again. Both serve the reference's tokens."""
    import ray
    from ray.cluster_utils import Cluster as RayCluster

    nodes = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1})
    second = nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    ray.init(address=nodes.address)
    service = MooncakeStoreService.start(STORE, node=nodes.head_node.node_id)
    try:
        assert service.cover([second.node_id]) == [second.node_id]
        assert sorted(service.segments.values()) == sorted([nodes.head_node.node_id, second.node_id])
        (doc2, first2, second2), (doc1, first1, second1) = _prompts(20), _prompts(21)
        for replicas, prompt in ((2, first2), (1, first1)):
            writer = _engine(llama_dir, service.master_address, "colocated-0", replicas=replicas)
            _run(writer, prompt)
            writer.close()  # its writes finish
        occupancy = service.occupancy()
        assert occupancy.objects == len(doc2) // BLOCK + len(doc1) // BLOCK
        assert all(s.used_bytes > 0 for s in occupancy.segments)

        nodes.remove_node(second)
        deadline = time.monotonic() + 60
        while not (lost := service.forget_lost()):
            assert time.monotonic() < deadline, "the master kept the lost node's segment"
            time.sleep(0.5)
        assert lost == [second.node_id] and list(service.segments.values()) == [nodes.head_node.node_id]

        reader = _engine(llama_dir, service.master_address, "colocated-1")
        try:
            assert _run(reader, second2) == _run(plain, second2)
            assert reader.prefix_cache.stats.tier_hits == len(doc2) // BLOCK * BLOCK  # every block, from the copy
            assert _run(reader, second1) == _run(plain, second1)
            found_single = reader.prefix_cache.stats.tier_hits - len(doc2) // BLOCK * BLOCK
            assert found_single < len(doc1) // BLOCK * BLOCK, "no block of the single-copy document was lost"
        finally:
            reader.close()
    finally:
        service.stop()
        ray.shutdown()
        nodes.shutdown()
