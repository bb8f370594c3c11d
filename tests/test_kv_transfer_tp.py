"""KV transfer between real processes over gloo: TP resharding (N senders -> M receivers), byte-exact.

The model has no tensor parallelism yet, so a TP rank is modelled as a cache holding a contiguous
slice of the KV heads. Every rank's shard is cut from one reference cache filled from a seed; after the
transfer each receiver shard must equal the reference's heads at its reserved blocks, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from kv_transfer import (HeadRange, KVFingerprint, KVReceiver, KVSender, LegTarget, PoolReserver, Rendezvous,
                         TransferConfig, plan_transfer, shard_heads)
from modeling.block_pool import BlockPool
from modeling.heads import legs_from, legs_to
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from tests.kv_procs import context, run_procs

NUM_KV_HEADS, LAYERS, HEAD_DIM, BLOCK, NUM_BLOCKS = 4, 3, 8, 4, 24
FP = KVFingerprint("llama", 64, 384, LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK, "bfloat16")
# request -> (num_tokens, sender block ids): scattered blocks exercise the staged (gather/scatter) path
REQUESTS = {"r-short": (5, [7, 3]), "r-long": (21, [10, 11, 12, 13, 14, 15]), "r-scattered": (9, [20, 2, 17])}
CONFIG = TransferConfig(timeout_s=20.0)


def reference_cache() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(LAYERS, 2, NUM_BLOCKS, BLOCK, NUM_KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)


def shard_cache(heads: HeadRange, fill: bool) -> PagedKVCache:
    cache = PagedKVCache(KVCacheSpec(LAYERS, heads.size, HEAD_DIM, BLOCK, torch.bfloat16), NUM_BLOCKS)
    if fill:
        cache.kv.copy_(reference_cache()[:, :, :, :, heads.start : heads.end])
    return cache


def sender_proc(rank, src_tp, dst_tp, rdv, plans, dst_blocks_q, finished):
    heads = shard_heads(NUM_KV_HEADS, src_tp, rank)
    sender = KVSender(shard_cache(heads, fill=True), f"p{rank}", FP, heads, CONFIG)
    legs = legs_from(plans, rank)
    for d in sorted({leg.dst_rank for leg in legs}):
        sender.connect(f"d{d}", rdv)
    for _ in range(len(REQUESTS) * dst_tp):  # every receiver rank has reserved for every request
        dst_blocks_q.get(timeout=30)
    for rid, (n, src_blocks) in REQUESTS.items():
        targets = [LegTarget(f"d{leg.dst_rank}", leg.heads, reserved=True) for leg in legs]
        sender.begin(rid, n, src_blocks, targets)
        sender.finish_prompt(rid, 7, b"\x01\x02")  # every transfer ends with its first token
    done, failed = [], []
    import time
    deadline = time.monotonic() + 30
    while len(done) + len(failed) < len(REQUESTS) and time.monotonic() < deadline:
        ev = sender.poll()
        # all blocks are ready at once (no forward pass here): open a group covering them
        group = sender.open_group({rid: len(b) for rid, (_, b) in REQUESTS.items()})
        for layer in range(LAYERS):
            group.send_layer(layer)
        group.close()
        done += ev.done
        failed += [str(f.error) for f in ev.failed]
        time.sleep(0.002)
    finished.wait(timeout=30)  # every process stays up until all are done (acks in flight)
    return {"done": sorted(done), "failed": failed}


def receiver_proc(rank, dst_tp, src_tp, rdv, plans, dst_blocks_qs, finished):
    import time
    heads = shard_heads(NUM_KV_HEADS, dst_tp, rank)
    cache = shard_cache(heads, fill=False)
    pool = BlockPool(NUM_BLOCKS, BLOCK)
    pool.allocate(3)  # fragment the pool: reservations start at block 3
    reserver = PoolReserver(pool)
    receiver = KVReceiver(cache, reserver, f"d{rank}", FP, heads, CONFIG)
    for s in sorted({leg.src_rank for leg in legs_to(plans, rank)}):
        receiver.connect(f"p{s}", rdv)
    reserved = {rid: receiver.reserve(rid, n) for rid, (n, _) in REQUESTS.items()}
    for q in dst_blocks_qs:
        for rid, blocks in reserved.items():
            q.put((rank, rid, blocks))
    completed, deadline = {}, time.monotonic() + 30
    while len(completed) < len(REQUESTS) and time.monotonic() < deadline:
        ev = receiver.poll()
        assert not ev.failed, ev.failed
        for kv in ev.completed:
            assert (kv.first_token, kv.sampler_state) == (7, b"\x01\x02")  # the prompt end came with the KV
            completed[kv.request_id] = kv
        time.sleep(0.002)
    finished.wait(timeout=30)
    ref = reference_cache()[:, :, :, :, heads.start : heads.end]
    exact = {}
    for rid, kv in completed.items():
        n, src_blocks = REQUESTS[rid]
        dst = list(kv.block_ids[: len(src_blocks)])
        exact[rid] = torch.equal(cache.kv[:, :, dst].view(torch.int16), ref[:, :, src_blocks].view(torch.int16))
    return {"exact": exact, "blocks": {rid: list(kv.block_ids) for rid, kv in completed.items()}}


@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2)])
def test_tp_resharding_byte_exact(src_tp, dst_tp):
    store, rdv = Rendezvous.host_store()
    plans = plan_transfer(NUM_KV_HEADS, src_tp, dst_tp)
    ctx = context()
    queues = [ctx.Queue() for _ in range(src_tp)]
    finished = ctx.Barrier(src_tp + dst_tp)
    specs = {f"p{r}": (sender_proc, dict(rank=r, src_tp=src_tp, dst_tp=dst_tp, rdv=rdv, plans=plans,
                                         dst_blocks_q=queues[r], finished=finished)) for r in range(src_tp)}
    specs.update({f"d{r}": (receiver_proc, dict(rank=r, dst_tp=dst_tp, src_tp=src_tp, rdv=rdv, plans=plans,
                                                dst_blocks_qs=queues, finished=finished)) for r in range(dst_tp)})
    out = run_procs(specs, timeout_s=90)
    for r in range(src_tp):
        assert out[f"p{r}"] == {"done": sorted(REQUESTS), "failed": []}
    for r in range(dst_tp):
        assert out[f"d{r}"]["exact"] == {rid: True for rid in REQUESTS}
        # the pool was fragmented, so the reservations are not the senders' block ids
        assert out[f"d{r}"]["blocks"]["r-short"][0] == 3
    del store


def test_plan_covers_each_destination_head_once():
    for h, s, d in [(4, 1, 2), (4, 2, 1), (4, 4, 2), (2, 4, 1), (2, 1, 4), (8, 2, 4)]:
        legs = plan_transfer(h, s, d)
        for dst in range(d):
            want = shard_heads(h, d, dst)
            got = sorted((leg.heads.start, leg.heads.end) for leg in legs_to(legs, dst))
            covered = [x for a, b in got for x in range(a, b)]
            assert covered == list(range(want.start, want.end)), (h, s, d, dst, got)
            for leg in legs_to(legs, dst):
                assert shard_heads(h, s, leg.src_rank).contains(leg.heads)
    # replicated heads (tp > num_kv_heads) are spread over the replicas
    assert {leg.src_rank for leg in plan_transfer(2, 4, 2)} == {0, 3}
    with pytest.raises(ValueError, match="tp: 3 does not divide"):
        shard_heads(4, 3, 0)
