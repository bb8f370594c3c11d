"""Prefill worker in one process: chunked-prefill scheduling (pure Python), first tokens against the
reference engine, request validation. Cross-process transfer is in test_prefill_disagg.py."""

from __future__ import annotations

import pytest

from modeling.block_pool import BlockPool, BlockTable
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.errors import InvalidRequestError
from modeling.sampling import RequestSampler, SamplingParams
from modeling.sequence import Sequence
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.worker import PrefillWorker
from prefill_worker.messages import PrefillRequest
from prefill_worker.messages import KVDestination
from prefill_worker.scheduler import PrefillScheduler


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(n)), RequestSampler(SamplingParams()), frozenset(), BlockTable(4), 1024)


def test_scheduler_batches_under_budget_and_holds_blocks_until_release():
    pool = BlockPool(12, 4)
    sched = PrefillScheduler(PrefillWorkerConfig(token_budget=10, max_num_seqs=8), pool)
    a, b, c = _seq("a", 13), _seq("b", 6), _seq("c", 30)
    for s in (a, b, c):
        sched.add(s)
    step = sched.schedule()  # a: 10 tokens; whole-prompt blocks allocated at admission
    assert [(ch.seq.request_id, ch.start, ch.num_tokens, ch.sample) for ch in step] == [("a", 0, 10, False)]
    assert pool.num_used == 4
    a.num_computed = 10
    step = sched.schedule()  # a finishes (3), b fits (6), c (8 blocks) does not fit the pool yet
    assert [(ch.seq.request_id, ch.start, ch.num_tokens, ch.sample) for ch in step] == [("a", 10, 3, True),
                                                                                         ("b", 0, 6, True)]
    for ch in step:
        ch.seq.num_computed += ch.num_tokens
        sched.hand_off(ch.seq)
    assert sched.schedule() == []  # c waits: a and b still hold their blocks (transfer not acknowledged)
    assert pool.num_used == 6
    sched.release("a")
    sched.release("b")
    step = sched.schedule()
    assert [(ch.seq.request_id, ch.num_tokens) for ch in step] == [("c", 10)] and pool.num_used == 8


def test_first_tokens_match_reference_without_handoff(llama_dir):
    prompts = [list(range(2 + 50 * i, 2 + 50 * i + n)) for i, n in enumerate((5, 23, 40))]  # no shared prefix
    params = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, temperature=0.8, seed=11),
              SamplingParams(max_tokens=1, temperature=1.0, top_k=20, seed=3)]
    ref = ReferenceEngine(llama_dir, EngineConfig(block_size=4, attention_backend="torch")).generate(prompts, params)
    worker = PrefillWorker(llama_dir, PrefillWorkerConfig(block_size=4, kv_cache_tokens=256, token_budget=16,
                                                          attention_backend="torch"))
    for i, (p, sp) in enumerate(zip(prompts, params)):
        worker.add_request(PrefillRequest(f"r{i}", tuple(p), sp, None))
    firsts, steps = {}, 0
    while worker.has_work():
        for ft in worker.step().first_tokens:
            firsts[ft.request_id] = ft
        steps += 1
    assert steps >= 5  # 68 tokens under a 16-token budget: chunked over several steps
    assert [firsts[f"r{i}"].token_id for i in range(3)] == [c.token_ids[0] for c in ref]
    assert all(ft.ttft_s > 0 for ft in firsts.values())
    assert worker.pool.num_free == worker.pool.num_blocks


def test_request_validation_names_the_field(llama_dir):
    worker = PrefillWorker(llama_dir, PrefillWorkerConfig(block_size=4, kv_cache_tokens=64, attention_backend="torch"))
    dest = KVDestination("decode-0")
    with pytest.raises(InvalidRequestError, match=r"prompt_ids\[1\]"):
        worker.add_request(PrefillRequest("a", (1, 999), SamplingParams(), dest))
    with pytest.raises(InvalidRequestError, match="prompt_ids: 100 tokens exceed"):
        worker.add_request(PrefillRequest("a", tuple([1] * 100), SamplingParams(), dest))
    with pytest.raises(InvalidRequestError, match="temperature"):
        worker.add_request(PrefillRequest("a", (1,), SamplingParams(temperature=-1.0), dest))
    worker.add_request(PrefillRequest("a", (1, 2), SamplingParams(), dest))
    with pytest.raises(InvalidRequestError, match="request_id"):
        worker.add_request(PrefillRequest("a", (1, 2), SamplingParams(), dest))
    with pytest.raises(ValueError, match="token_budget: must be >= 1, got 0"):
        PrefillWorkerConfig(token_budget=0)
    # no channel to decode-0: the request fails at its first step with a retryable error, blocks freed
    out = worker.step()
    assert [(f.request_id, f.retryable) for f in out.failed] == [("a", True)]
    assert worker.pool.num_free == worker.pool.num_blocks and not worker.has_work()


def test_prefill_then_send_mode_is_lossless_in_process(llama_dir):
    """Both ends in one process (a real gloo pair between two threads' connects), KV sent after each
    prompt's last chunk instead of layer by layer; greedy decoding over the received blocks matches
    the reference engine."""
    import threading
    import time

    import torch

    from kv_transfer import HeadRange, KVFingerprint, KVReceiver, PoolReserver, Rendezvous, TransferConfig
    from modeling.attention import make_backend
    from modeling.kv_cache import KVCacheSpec, PagedKVCache
    from modeling.runner import ModelRunner, StepInput

    store, rdv = Rendezvous.host_store()
    cfg = TransferConfig(timeout_s=20)
    worker = PrefillWorker(llama_dir, PrefillWorkerConfig(block_size=4, kv_cache_tokens=512, token_budget=16,
                                                          attention_backend="torch", layerwise_streaming=False,
                                                          transfer=cfg), "prefill-0")
    mc = worker.loaded.config
    cache = PagedKVCache(KVCacheSpec(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, 4, torch.float32), 64)
    pool = BlockPool(64, 4)
    reserver = PoolReserver(pool, extra_tokens=4)
    receiver = KVReceiver(cache, reserver, "decode-0", KVFingerprint.of(mc, 4, torch.float32),
                          HeadRange(0, mc.num_key_value_heads), cfg)
    t = threading.Thread(target=receiver.connect, args=("prefill-0", rdv))
    t.start()
    worker.connect("decode-0", rdv)
    t.join(timeout=30)
    prompts = {f"q{i}": list(range(3 + i, 3 + i + n)) for i, n in enumerate((7, 30, 45))}
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for rid, ids in prompts.items():
        worker.add_request(PrefillRequest(rid, tuple(ids), params, KVDestination("decode-0")))
    runner = ModelRunner(worker.loaded.model, cache, make_backend("torch", "cpu", 4))
    firsts, outputs, deadline = {}, {}, time.monotonic() + 30
    try:
        while len(outputs) < len(prompts) and time.monotonic() < deadline:
            out = worker.step()
            assert not out.failed, out.failed
            firsts.update({ft.request_id: ft.token_id for ft in out.first_tokens})
            events = receiver.poll()
            assert not events.failed, events.failed
            for kv in events.completed:
                # the first token ends the transfer, with the generator's state after it
                assert kv.first_token == firsts[kv.request_id] and len(kv.sampler_state) > 0
                table = reserver.take(kv.request_id)
                tokens = prompts[kv.request_id] + [kv.first_token]
                while len(tokens) - kv.num_tokens < params.max_tokens:
                    logits = runner.run([StepInput([tokens[-1]], len(tokens) - 1, table.blocks)])
                    tokens.append(int(torch.argmax(logits[0])))
                outputs[kv.request_id] = tokens[kv.num_tokens:]
                table.release(pool)
            time.sleep(0.001)
    finally:
        worker.sender.close()
        receiver.close()
    ref = ReferenceEngine(llama_dir, EngineConfig(block_size=4, attention_backend="torch")).generate(
        list(prompts.values()), params)
    assert outputs == {rid: c.token_ids for rid, c in zip(prompts, ref)}
    del store
