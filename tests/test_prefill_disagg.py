"""Disaggregated prefill -> decode across two real processes over gloo, against the ReferenceEngine.

The prefill process runs a PrefillWorker (chunked prefill, several prompts per step, layer-wise KV
streaming); the decode process receives the KV with a KVReceiver whose pool is too small for every
prompt at once (back-pressure: it answers BUSY and the prefill waits), then decodes greedily with a
plain ModelRunner loop over the received blocks. Outputs must match the reference token for token.
"""

from __future__ import annotations

import time

import torch

from kv_transfer import KVFingerprint, KVReceiver, PoolReserver, Rendezvous, TransferConfig
from modeling.attention import make_backend
from modeling.block_pool import BlockPool
from modeling.checkpoint import load_model
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.heads import HeadRange
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.runner import ModelRunner, StepInput
from modeling.sampling import SamplingParams
from tests.kv_procs import context, run_procs

BLOCK = 4
MAX_TOKENS = 6
LENGTHS = [3, 17, 40, 64, 100, 9]
ROUTER_RESERVED = ("p1", "p5")  # the rest are reserved by the receiver at handshake time
DECODE_BLOCKS = 44  # fits the two largest prompts (+ decode room) only one at a time with others
CONFIG = TransferConfig(timeout_s=30.0)


def prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(7)
    out = {f"p{i}": torch.randint(2, 384, (n,), generator=g).tolist() for i, n in enumerate(LENGTHS)}
    # p4's first 96 tokens and a question of its own: admitted once p4's first chunks are computed, it
    # starts from p4's cached blocks (prefix caching) and still sends its whole prompt's KV
    out["p6"] = out["p4"][:96] + torch.randint(2, 384, (12,), generator=g).tolist()
    return out


def prefill_proc(ckpt, rdv, reserved_q, first_q, finished):
    from prefill_worker.config import PrefillWorkerConfig
    from prefill_worker.messages import KVDestination, PrefillRequest
    from prefill_worker.worker import PrefillWorker

    worker = PrefillWorker(ckpt, PrefillWorkerConfig(block_size=BLOCK, kv_cache_tokens=1024, token_budget=48,
                                                     attention_backend="torch", transfer=CONFIG), "prefill-0")
    worker.connect("decode-0", rdv)
    reserved = dict(reserved_q.get(timeout=60) for _ in ROUTER_RESERVED)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for rid, ids in prompts().items():
        worker.add_request(PrefillRequest(rid, tuple(ids), params, KVDestination("decode-0", reserved=rid in reserved)))
    firsts, transferred, failed, steps, max_concurrent = {}, [], [], 0, 0
    deadline = time.monotonic() + 60
    while worker.has_work() and time.monotonic() < deadline:
        out = worker.step()
        steps += 1
        max_concurrent = max(max_concurrent, worker.sender.pending())
        for ft in out.first_tokens:
            firsts[ft.request_id] = ft.token_id
            first_q.put((ft.request_id, ft.token_id))
        transferred += out.transferred
        failed += [f.reason for f in out.failed]
        if out.empty:
            time.sleep(0.002)
    finished.wait(timeout=30)  # both stay up until both are done (acknowledgements in flight)
    return {"firsts": firsts, "transferred": sorted(transferred), "failed": failed, "steps": steps,
            "max_concurrent": max_concurrent, "free_after": worker.pool.num_free == worker.pool.num_blocks,
            "cached_tokens": worker.prefix_cache.stats.hits, "tracked": worker.prefix_cache.num_tracked}


def decode_proc(ckpt, rdv, reserved_q, first_q, finished):
    loaded = load_model(ckpt, "float32", "cpu")
    mc = loaded.config
    cache = PagedKVCache(KVCacheSpec(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, BLOCK,
                                     torch.float32), DECODE_BLOCKS)
    pool = BlockPool(DECODE_BLOCKS, BLOCK)
    reserver = PoolReserver(pool, extra_tokens=MAX_TOKENS)
    fp = KVFingerprint.of(mc, BLOCK, torch.float32)
    receiver = KVReceiver(cache, reserver, "decode-0", fp, HeadRange(0, mc.num_key_value_heads), CONFIG)
    receiver.connect("prefill-0", rdv)
    all_prompts = prompts()
    for rid in ROUTER_RESERVED:  # the router's reservation, before the prefill starts
        reserved_q.put((rid, tuple(receiver.reserve(rid, len(all_prompts[rid])))))
    runner = ModelRunner(loaded.model, cache, make_backend("torch", "cpu", BLOCK))
    firsts, outputs, failed, max_used = {}, {}, [], 0
    deadline = time.monotonic() + 60
    while len(outputs) + len(failed) < len(all_prompts) and time.monotonic() < deadline:
        events = receiver.poll()
        max_used = max(max_used, pool.num_used)
        failed += [str(f.error) for f in events.failed]
        for kv in events.completed:
            while kv.request_id not in firsts:  # what the prefill worker streamed to the router
                rid, tok = first_q.get(timeout=30)
                firsts[rid] = tok
            assert kv.first_token == firsts[kv.request_id]  # and what reached the decode side with the KV
            table = reserver.take(kv.request_id)
            tokens = all_prompts[kv.request_id] + [kv.first_token]
            while len(tokens) - kv.num_tokens < MAX_TOKENS:  # plain greedy decode over received blocks
                pos = len(tokens) - 1
                table.ensure_capacity(pool, pos + 1)
                logits = runner.run([StepInput([tokens[-1]], pos, table.blocks)])
                tokens.append(int(torch.argmax(logits[0])))
            outputs[kv.request_id] = tokens[kv.num_tokens:]
            table.release(pool)
        if not events.completed:
            time.sleep(0.002)
    finished.wait(timeout=30)
    return {"outputs": outputs, "failed": failed, "busy": receiver.num_busy, "max_used": max_used,
            "free_after": pool.num_free == pool.num_blocks}


def test_disaggregated_greedy_matches_reference(llama_dir):
    store, rdv = Rendezvous.host_store()
    ctx = context()
    reserved_q, first_q = ctx.Queue(), ctx.Queue()
    args = dict(ckpt=llama_dir, rdv=rdv, reserved_q=reserved_q, first_q=first_q, finished=ctx.Barrier(2))
    out = run_procs({"prefill": (prefill_proc, args), "decode": (decode_proc, args)}, timeout_s=120)
    pre, dec = out["prefill"], out["decode"]
    assert pre["failed"] == [] and dec["failed"] == []
    assert pre["transferred"] == sorted(prompts())
    assert pre["free_after"] and dec["free_after"]  # every block released on both sides
    assert pre["max_concurrent"] >= 2  # several prompts in flight at once
    assert pre["cached_tokens"] >= 16 * BLOCK and pre["tracked"] == 0  # p6 was not prefilled from its first token
    assert dec["busy"] >= 1  # the receiver ran out of room and pushed back...
    assert dec["max_used"] <= DECODE_BLOCKS  # ...without overflowing

    engine = ReferenceEngine(llama_dir, EngineConfig(dtype="float32", block_size=BLOCK, attention_backend="torch"))
    ids = list(prompts())
    ref = engine.generate([prompts()[r] for r in ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for rid, completion in zip(ids, ref):
        assert pre["firsts"][rid] == completion.token_ids[0], rid
        assert dec["outputs"][rid] == completion.token_ids, rid
    del store
