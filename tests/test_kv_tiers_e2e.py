"""KV tiers end to end on a real local Ray cluster: a document evicted from every pool is served again from the
disk tiers or the cluster's store (the prefill instance computes only the new tokens, the decode instance
receives only them), with the reference engine's tokens; a new cluster's instances serve a document the last
one computed, from the store; ``magicserve status`` shows the tiers' hits."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import pytest

from frontend.client import Client
from modeling.kv_tiers.store import client_problem
from modeling.sampling import SamplingParams
from tests.serving import e2e_config, prompts_of, running_server, stream_ids

BLOCK = 16


def _instances(address):
    with Client(address) as c:
        return {i.name: i for i in c.status().instances}


@pytest.mark.parametrize("tp", [1, 2])
def test_a_document_evicted_from_every_pool_is_served_from_the_tiers(llama_dir, reference, tmp_path, tp):
    """The router's index knows each instance's disk tier holds the evicted document: a short question after it
    is prefilled on the decode instance, which loads the document from its tier (no prefill instance involved);
    a long question goes to the prefill instance, which loads the document from its own tier and computes only
    the question, written layer by layer beside its pass (``layered_loads`` on, as on GPUs). With ``tp`` 2, every
    instance's ranks each hold half the KV heads: rank 0 gathers and scatters whole blocks for its tiers, before
    the pass."""
    cfg = e2e_config(
        llama_dir,
        prefill={"tensor_parallel": tp, "kv_cache_tokens": 640, "attention_backend": "torch", "token_budget": 128},
        decode={"tensor_parallel": tp, "kv_cache_tokens": 1280, "attention_backend": "torch",
                "speculation": {"k_policy": "fixed", "k": 3, "budget": 32, "sink_tokens": 4}},
        kv_tiers={"host_memory_mb": 0, "disk_dir": str(tmp_path), "disk_mb": 64, "layered_loads": True},
    )
    doc, q1, q2, q3, *others = prompts_of([320, 20, 24, 280, 500, 500, 500], seed=31)
    greedy = dict(max_tokens=16, ignore_eos=True)
    doc_tokens = len(doc) // BLOCK * BLOCK
    with running_server(cfg) as address:
        first, first_final = stream_ids(address, doc + q1, **greedy)
        for other in others:  # 1500 prompt tokens through pools of 640 and 1280: the document is evicted from both
            stream_ids(address, other, **greedy)
        before = _instances(address)
        assert all(i.kv_tiers and i.kv_tiers[0].tier == "disk" for i in before.values())
        second, second_final = stream_ids(address, doc + q2, **greedy)
        between = _instances(address)
        third, third_final = stream_ids(address, doc + q3, **greedy)
        after = _instances(address)
    expected = reference.generate([doc + q1, doc + q2, doc + q3], SamplingParams(**greedy))
    assert [first, second, third] == [c.token_ids for c in expected]

    def grew(a, b, field):
        return {n: getattr(b[n], field) - getattr(a[n], field) for n in b}

    def loaded(a, b):
        return {n: sum(t.hits for t in b[n].kv_tiers) - sum(t.hits for t in a[n].kv_tiers) for n in b}

    # the short question: the decode instance loaded the document from its tier; the prefill instance saw nothing
    assert grew(before, between, "prefix_cache_tier_hits") == {"prefill-0": 0, "decode-0": doc_tokens}
    assert grew(before, between, "prefix_cache_queries")["prefill-0"] == 0
    assert loaded(before, between) == {"prefill-0": 0, "decode-0": doc_tokens // BLOCK}
    # the long question: the prefill instance loaded the document and computed only the question; the decode
    # instance held the document in its pool since, so the transfer skipped those blocks
    assert grew(between, after, "prefix_cache_queries")["prefill-0"] == len(doc + q3)
    assert grew(between, after, "prefix_cache_tier_hits") == {"prefill-0": doc_tokens, "decode-0": 0}
    assert grew(between, after, "prefix_cache_hits")["prefill-0"] == doc_tokens
    assert all(t.corrupt == 0 and t.bytes <= t.capacity_bytes for i in after.values() for t in i.kv_tiers)
    # each request's usage: what the instance that computed its prompt found of it (the decode instance for the
    # short question, the prefill instance for the long one)
    assert [f.usage["cached_prompt_tokens"] for f in (first_final, second_final, third_final)] == [0, doc_tokens,
                                                                                               doc_tokens]


needs_store = pytest.mark.skipif(client_problem() is not None, reason=f"Mooncake Store: {client_problem()}")


def _store_only_config(llama_dir, master_address: str = ""):
    """1 prefill + 1 decode instance whose only tier is the store (``master_address`` empty: the cluster
    starts one)."""
    return e2e_config(
        llama_dir,
        prefill={"kv_cache_tokens": 1024, "attention_backend": "torch", "token_budget": 128},
        decode={"kv_cache_tokens": 2048, "attention_backend": "torch",
                "speculation": {"k_policy": "fixed", "k": 3, "budget": 32, "sink_tokens": 4}},
        kv_tiers={"host_memory_mb": 0, "disk_mb": 0,
                  "store": {"backend": "mooncake", "master_address": master_address, "segment_mb": 256}},
    )


@needs_store
def test_a_new_cluster_serves_a_document_the_last_one_computed_from_the_store(llama_dir, reference):
    """Two clusters one after the other over one store: the second one's instances (new processes, empty pools,
    no disk) load the document the first one computed, and its prefill computes only the question."""
    from controller.kv_store import MooncakeStoreService
    from modeling.instance_config import KVStoreConfig

    doc, q1, q2 = prompts_of([320, 20, 24], seed=41)
    greedy = dict(max_tokens=16, ignore_eos=True)
    store = MooncakeStoreService.start(KVStoreConfig(backend="mooncake", segment_mb=256))
    try:
        with running_server(_store_only_config(llama_dir, store.master_address)) as address:
            first, _ = stream_ids(address, doc + q1, **greedy)
        with running_server(_store_only_config(llama_dir, store.master_address)) as address:
            before = _instances(address)
            second, _ = stream_ids(address, doc + q2, **greedy)
            after = _instances(address)
    finally:
        store.stop()
    assert [first, second] == [c.token_ids for c in reference.generate([doc + q1, doc + q2], SamplingParams(**greedy))]
    doc_tokens = len(doc) // BLOCK * BLOCK
    grew = {n: after[n].prefix_cache_tier_hits - before[n].prefix_cache_tier_hits for n in after}
    assert grew == {"prefill-0": doc_tokens, "decode-0": doc_tokens}
    assert after["prefill-0"].prefix_cache_hits - before["prefill-0"].prefix_cache_hits == doc_tokens
    assert {n: [t.tier for t in i.kv_tiers] for n, i in after.items()} == {"prefill-0": ["store"], "decode-0": ["store"]}


@needs_store
def test_serve_starts_the_store_when_no_master_is_named(llama_dir, reference):
    """``kv_tiers.store.master_address`` empty: the cluster starts a master and a segment server, the instances
    write to it, and a document evicted from both pools comes back from it."""
    doc, q1, q2, *others = prompts_of([320, 20, 24, 500, 500, 500, 500], seed=43)
    greedy = dict(max_tokens=16, ignore_eos=True)
    with running_server(_store_only_config(llama_dir)) as address:
        first, _ = stream_ids(address, doc + q1, **greedy)
        for other in others:  # 2000 prompt tokens through pools of 1024 and 2048: the document is evicted
            stream_ids(address, other, **greedy)
        before = _instances(address)
        second, _ = stream_ids(address, doc + q2, **greedy)
        after = _instances(address)
    assert [first, second] == [c.token_ids for c in reference.generate([doc + q1, doc + q2], SamplingParams(**greedy))]
    stored = {n: i.kv_tiers[0].stored for n, i in after.items()}
    assert all(v > 0 for v in stored.values()), stored
    # the router's index learned from the instances' writes that the store holds the document: the decode
    # instance (which reaches the store) prefills the short question itself, loading the document from the store
    grew = {n: after[n].prefix_cache_tier_hits - before[n].prefix_cache_tier_hits for n in after}
    assert grew == {"prefill-0": 0, "decode-0": len(doc) // BLOCK * BLOCK}


@needs_store
def test_a_request_resumed_after_its_decode_instance_died_loads_its_kv_from_the_store(llama_dir, reference):
    """The decode instance serving a request is killed mid-stream: the instance that resumes it (the other one,
    or the same one restarted, both without its KV) loads the prompt and the tokens decoded so far from the store
    instead of computing them, and the client gets the reference's tokens."""
    import ray

    from controller.kv_store import MooncakeStoreService
    from modeling.instance_config import KVStoreConfig

    prompt = prompts_of([330], seed=47)[0]
    greedy = dict(max_tokens=240, ignore_eos=True)
    expected = reference.generate([prompt], SamplingParams(**greedy))[0].token_ids
    store = MooncakeStoreService.start(KVStoreConfig(backend="mooncake", segment_mb=256))
    cfg = _store_only_config(llama_dir, store.master_address)
    cfg = dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, instances=2))
    try:
        with running_server(cfg) as address:
            before = _instances(address)
            actors = [ray.get_actor(f"magicserve-decode-{j}", namespace="magicserve") for j in range(2)]
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                future = pool.submit(stream_ids, address, prompt, **greedy)
                deadline, victim = time.monotonic() + 60, None
                while victim is None:  # the instance decoding it, 64 tokens in (4 full blocks of output stored)
                    for a in actors:
                        if ray.get(a.request_loads.remote()).holds and \
                                ray.get(a.status.remote())["tokens_generated"] >= 64:
                            victim = a
                    assert time.monotonic() < deadline, "the request never reached 64 tokens on a decode instance"
                    time.sleep(0.02)
                ray.kill(victim, no_restart=False)
                ids, _ = future.result(timeout=240)
            after = _instances(address)
    finally:
        store.stop()
    assert ids == expected
    resumed_from_store = sum(after[n].prefix_cache_tier_hits for n in after if n.startswith("decode")) - \
        sum(before[n].prefix_cache_tier_hits for n in before if n.startswith("decode"))
    assert resumed_from_store >= len(prompt) // BLOCK * BLOCK, resumed_from_store


@needs_store
def test_every_node_an_instance_runs_on_holds_a_segment_of_the_store(llama_dir, reference, capsys):
    """A Ray cluster of two nodes (two raylets on this machine, one CPU each): the prefill and the decode instance
    land on different nodes, the server's segment server runs on the head node and a Ray actor starts one on the
    other. ``magicserve status`` shows both segments with their nodes, the blocks the instances wrote and the
    memory they take; stopping the server leaves no store process behind."""
    import subprocess

    import ray
    from ray.cluster_utils import Cluster as RayCluster

    from frontend.cli import main as cli_main

    nodes = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    doc, q1 = prompts_of([320, 20], seed=53)
    greedy = dict(max_tokens=16, ignore_eos=True)
    cfg = _store_only_config(llama_dir)
    cfg = dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray, address=nodes.address, num_cpus=None))
    try:
        with running_server(cfg) as address:
            ids, _ = stream_ids(address, doc + q1, **greedy)
            time.sleep(1.0)  # the instances' writer threads put the blocks
            with Client(address) as c:
                st = c.status()
            placed = {i["NodeID"] for i in ray.nodes() if i["Alive"]}
            capsys.readouterr()
            assert cli_main(["status", "--address", address]) == 0
            printed = capsys.readouterr().out
        after = subprocess.run(["pgrep", "-f", "mooncake_"], capture_output=True, text=True).stdout.split()
    finally:
        ray.shutdown()
        nodes.shutdown()
    assert ids == reference.generate([doc + q1], SamplingParams(**greedy))[0].token_ids
    segments = list(st.kv_store_segments)
    assert len(segments) == 2 and {g.node for g in segments} == placed, segments
    assert all(g.capacity_bytes == 256 << 20 for g in segments)
    assert st.kv_store_objects >= len(doc) // BLOCK and sum(g.used_bytes for g in segments) > 0
    assert after == [], after  # the master and both segment servers stopped with the server
    assert f"kv store: {st.kv_store_objects} blocks" in printed and "in 2 segment servers" in printed, printed
