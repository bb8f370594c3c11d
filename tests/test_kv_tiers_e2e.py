"""KV tiers end to end on a real local Ray cluster: a document evicted from every pool is served again from the
disk tiers (the prefill instance computes only the new tokens, the decode instance receives only them), with
the reference engine's tokens, and ``magicserve status`` shows the tiers' hits."""

from __future__ import annotations

from frontend.client import Client
from modeling.sampling import SamplingParams
from tests.serving import e2e_config, prompts_of, running_server, stream_ids

BLOCK = 16


def _instances(address):
    with Client(address) as c:
        return {i.name: i for i in c.status().instances}


def test_a_document_evicted_from_every_pool_is_served_from_the_tiers(llama_dir, reference, tmp_path):
    cfg = e2e_config(
        llama_dir,
        prefill={"kv_cache_tokens": 640, "attention_backend": "torch", "token_budget": 128},
        decode={"kv_cache_tokens": 1280, "attention_backend": "torch",
                "speculation": {"k_policy": "fixed", "k": 3, "budget": 32, "sink_tokens": 4}},
        kv_tiers={"host_memory_mb": 0, "disk_dir": str(tmp_path), "disk_mb": 64},
    )
    doc, q1, q2, *others = prompts_of([320, 20, 24, 500, 500, 500], seed=31)
    greedy = dict(max_tokens=16, ignore_eos=True)
    with running_server(cfg) as address:
        first, _ = stream_ids(address, doc + q1, **greedy)
        for other in others:  # 1500 prompt tokens through pools of 640 and 1280: the document is evicted from both
            stream_ids(address, other, **greedy)
        before = _instances(address)
        assert all(i.kv_tiers and i.kv_tiers[0].tier == "disk" for i in before.values())
        second, _ = stream_ids(address, doc + q2, **greedy)
        after = _instances(address)
    assert [first, second] == [c.token_ids for c in reference.generate([doc + q1, doc + q2], SamplingParams(**greedy))]
    grew = {n: after[n].prefix_cache_tier_hits - before[n].prefix_cache_tier_hits for n in after}
    doc_tokens = len(doc) // BLOCK * BLOCK
    # the prefill instance loaded the document and computed only the question
    assert after["prefill-0"].prefix_cache_queries - before["prefill-0"].prefix_cache_queries == len(doc + q2)
    assert grew["prefill-0"] == doc_tokens
    assert after["prefill-0"].prefix_cache_hits - before["prefill-0"].prefix_cache_hits == doc_tokens
    # the decode instance loaded it from its own tier: the transfer skipped those blocks
    assert grew["decode-0"] == doc_tokens
    loaded = {n: sum(t.hits for t in after[n].kv_tiers) - sum(t.hits for t in before[n].kv_tiers) for n in after}
    assert loaded == {"prefill-0": doc_tokens // BLOCK, "decode-0": doc_tokens // BLOCK}
    assert all(t.corrupt == 0 and t.bytes <= t.capacity_bytes for i in after.values() for t in i.kv_tiers)
