"""Passes computed ahead on a prefill worker (``PrefillRequest.ahead``): a prompt that waits for room on a decode
instance has its full blocks computed in steps no other prompt needs, so that the request, arriving under the same
id, computes only the rest. The scheduler's lane on plain sequences; the worker against the reference engine."""

from __future__ import annotations

import pytest

from modeling.block_pool import BlockPool, BlockTable
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.prefix_cache import PrefixCache
from modeling.prefix_hash import block_hashes
from modeling.sampling import RequestSampler, SamplingParams
from modeling.sequence import Sequence
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.messages import PrefillRequest
from prefill_worker.scheduler import PrefillScheduler
from prefill_worker.worker import PrefillWorker


def _seq(rid: str, n: int, first: int = 0) -> Sequence:
    return Sequence(rid, list(range(first, first + n)), RequestSampler(SamplingParams()), frozenset(), BlockTable(4),
                    1024)


def _run(sched: PrefillScheduler) -> list[tuple[str, int]]:
    """One step: the chunks as (request, tokens), each computed (a last chunk hands a prompt off)."""
    chunks = sched.schedule()
    for c in chunks:
        c.seq.num_computed += c.num_tokens
        if sched.prefix_cache is not None:
            sched.prefix_cache.commit(c.seq, c.seq.num_computed)
        if c.sample and c.seq in sched.running:
            sched.hand_off(c.seq)
        elif c.sample:
            sched.release(c.seq.request_id)
    return [(c.seq.request_id, c.num_tokens) for c in chunks]


def test_a_pass_ahead_runs_only_in_steps_no_prompt_needs():
    pool = BlockPool(32, 4)
    sched = PrefillScheduler(PrefillWorkerConfig(token_budget=8, max_num_seqs=8), pool)
    sched.add(_seq("ahead", 20), ahead=True)
    assert _run(sched) == [("ahead", 8)]
    sched.add(_seq("p", 6, first=100))
    assert _run(sched) == [("p", 6)]  # the prompt's step has no chunk of the pass, though budget was left
    assert _run(sched) == [("ahead", 8)]
    assert _run(sched) == [("ahead", 4)] and not sched.running_ahead and pool.num_used == 2  # p's, in transfer
    assert sched.take_dropped() == []


def test_a_prompt_that_needs_the_blocks_of_passes_ahead_drops_them_and_they_stay_cached():
    pool = BlockPool(8, 4)
    cache = PrefixCache(pool, b"salt")
    sched = PrefillScheduler(PrefillWorkerConfig(token_budget=8, max_num_seqs=8), pool, cache)
    sched.add(_seq("a1", 24), ahead=True)  # 6 blocks
    sched.add(_seq("a2", 8, first=500), ahead=True)  # waits: only 2 blocks left, it fits
    assert _run(sched) == [("a1", 8)] and pool.num_free == 2
    sched.add(_seq("p", 12, first=900))  # 3 blocks: more than are free
    assert _run(sched) == [("p", 8)]
    dropped = sched.take_dropped()
    assert sorted(s.request_id for s, _ in dropped) == ["a1", "a2"] and not sched.waiting_ahead
    assert pool.num_cached >= 2  # the two blocks a1 computed stayed cached
    back = _seq("a1", 24)
    sched.add(back, ahead=True)
    sched.release("p")
    assert _run(sched) == [("a1", 8)] and back.block_table.blocks and cache.found("a1").tokens == 8


@pytest.fixture(scope="module")
def reference(llama_dir):
    return ReferenceEngine(llama_dir, EngineConfig(block_size=4, attention_backend="torch"))


def _worker(llama_dir, **overrides) -> PrefillWorker:
    config = dict(block_size=4, kv_cache_tokens=256, token_budget=16, attention_backend="torch")
    return PrefillWorker(llama_dir, PrefillWorkerConfig(**{**config, **overrides}))


def _drain(worker: PrefillWorker) -> tuple[dict, list[str], int]:
    """Step until idle: the first tokens by request, the passes ahead that ended, the prompt tokens computed."""
    firsts, ended, computed = {}, [], 0
    while worker.has_work():
        out = worker.step()
        firsts.update({ft.request_id: ft for ft in out.first_tokens})
        ended += out.ahead_ended
        computed += out.tokens_computed
    return firsts, ended, computed


def test_a_request_after_its_pass_ahead_computes_only_its_last_block_and_samples_as_the_reference(llama_dir,
                                                                                                   reference):
    doc = list(range(7, 7 + 40))  # 10 blocks of 4; a lookup covers its first 39 tokens: 9 blocks
    params = SamplingParams(max_tokens=1, temperature=0.9, seed=5)
    want = reference.generate([doc], [params])[0].token_ids[0]
    worker = _worker(llama_dir)
    worker.add_request(PrefillRequest("r", tuple(doc), SamplingParams(), None, ahead=True))
    firsts, ended, computed = _drain(worker)
    assert not firsts and ended == ["r"] and computed == 37  # 9 blocks, and one token to make the last final
    assert worker.prefix_cache.stats.queries == 0  # a pass ahead is counted when its request is served
    worker.add_request(PrefillRequest("r", tuple(doc), params, None))
    firsts, ended, computed = _drain(worker)
    assert firsts["r"].token_id == want and computed == 4 and not ended
    assert firsts["r"].cached.tokens == 0  # what was computed for it ahead is not counted as found
    assert (worker.prefix_cache.stats.queries, worker.prefix_cache.stats.hits) == (40, 0)
    assert worker.pool.num_free == worker.pool.num_blocks and worker.prefix_cache.num_tracked == 0


def test_a_request_takes_over_its_pass_ahead_and_a_pass_on_a_short_prompt_ends_at_once(llama_dir, reference):
    shared, doc = list(range(300, 316)), list(range(300, 316)) + list(range(40, 72))  # 4 of its blocks cached
    worker = _worker(llama_dir)
    worker.add_request(PrefillRequest("warm", tuple(shared + [9]), SamplingParams(), None))
    _drain(worker)
    worker.add_request(PrefillRequest("r", tuple(doc), SamplingParams(), None, ahead=True))
    worker.add_request(PrefillRequest("tiny", (1, 2, 3), SamplingParams(), None, ahead=True))
    out = worker.step()  # the pass: 16 tokens from block 4 on
    assert out.tokens_computed == 16 and out.ahead_ended == ["tiny"]
    worker.add_request(PrefillRequest("r", tuple(doc), SamplingParams(max_tokens=1), None))
    out = worker.step()
    # the request starts from the 8 blocks cached, the shared 4 and the pass's 4: 16 tokens left, one step
    assert out.ahead_ended == ["r"] and out.tokens_computed == 16
    assert out.first_tokens[0].token_id == reference.generate([doc], [SamplingParams(max_tokens=1)])[0].token_ids[0]
    assert out.first_tokens[0].cached.tokens == 16  # what the pass found, not what it computed
    assert not worker.has_work() and worker.prefix_cache.num_tracked == 0


def test_an_aborted_pass_ahead_frees_its_blocks(llama_dir):
    worker = _worker(llama_dir)
    worker.add_request(PrefillRequest("r", tuple(range(5, 69)), SamplingParams(), None, ahead=True))
    worker.step()
    assert worker.abort("r") is True
    assert worker.step().ahead_ended == ["r"] and not worker.has_work()
    assert worker.pool.num_free == worker.pool.num_blocks and worker.prefix_cache.num_tracked == 0


def test_a_transfer_refused_for_want_of_room_gives_its_blocks_up_to_a_waiting_prompt(llama_dir, monkeypatch):
    """A real receiver over gloo whose pool has no room answers BUSY: the prompt's blocks wait on it. A prompt
    that then needs those blocks, with nothing else to run, has the refused transfer withdrawn (failed, retryable:
    the router runs that request again) once it has been refused for ``REFUSED_TRANSFER_S``; the withdrawn
    prompt's full blocks stay cached."""
    import threading
    import time

    import torch

    from kv_transfer import HeadRange, KVFingerprint, KVReceiver, PoolReserver, Rendezvous, TransferConfig
    from modeling.kv_cache import KVCacheSpec, PagedKVCache
    from prefill_worker import worker as worker_module
    from prefill_worker.messages import KVDestination

    monkeypatch.setattr(worker_module, "REFUSED_TRANSFER_S", 0.3)
    store, rdv = Rendezvous.host_store()
    cfg = TransferConfig(timeout_s=20, retry_interval_s=0.02)
    worker = PrefillWorker(llama_dir, PrefillWorkerConfig(block_size=4, kv_cache_tokens=32, token_budget=32,
                                                          attention_backend="torch", transfer=cfg), "prefill-0")
    mc = worker.loaded.config
    cache = PagedKVCache(KVCacheSpec(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, 4, torch.float32), 8)
    full = BlockPool(8, 4)
    full.allocate(8)  # the decode side's pool is full: every transfer is answered BUSY
    receiver = KVReceiver(cache, PoolReserver(full), "decode-0", KVFingerprint.of(mc, 4, torch.float32),
                          HeadRange(0, mc.num_key_value_heads), cfg)
    t = threading.Thread(target=receiver.connect, args=("prefill-0", rdv))
    t.start()
    worker.connect("decode-0", rdv)
    t.join(timeout=30)
    try:
        held, waiting = list(range(10, 34)), list(range(50, 66))  # 6 blocks of the 8, then 4
        worker.add_request(PrefillRequest("held", tuple(held), SamplingParams(max_tokens=2), KVDestination("decode-0")))
        worker.add_request(PrefillRequest("next", tuple(waiting), SamplingParams(max_tokens=1), None))
        failed, firsts, deadline = [], {}, time.monotonic() + 20
        started = time.monotonic()
        while "next" not in firsts and time.monotonic() < deadline:
            out = worker.step()
            failed += out.failed
            firsts.update({ft.request_id: ft for ft in out.first_tokens})
            receiver.poll()
            time.sleep(0.005)
        waited = time.monotonic() - started
    finally:
        worker.sender.close()
        receiver.close()
    assert [(f.request_id, f.retryable) for f in failed] == [("held", True)] and "withdrawn" in failed[0].reason
    assert set(firsts) == {"held", "next"} and 0.3 <= waited < 10
    assert worker.pool.cached_run(block_hashes(held, 4, worker.prefix_cache.salt)) >= 2  # what "next" left of it
    del store


def test_a_pass_taken_over_before_it_looked_its_prompt_up_leaves_the_requests_count_alone(llama_dir):
    """A pass still queued behind another has found nothing because it has not looked: its request counts what
    its own lookup finds."""
    doc = list(range(7, 7 + 40))
    worker = _worker(llama_dir, max_num_seqs=1)
    worker.add_request(PrefillRequest("warm", tuple(doc + [3]), SamplingParams(), None))
    _drain(worker)
    worker.add_request(PrefillRequest("other", tuple(range(200, 240)), SamplingParams(), None, ahead=True))
    worker.add_request(PrefillRequest("r", tuple(doc + [5, 6]), SamplingParams(), None, ahead=True))
    worker.step()  # "other" runs; "r" waits behind it (one seat)
    worker.add_request(PrefillRequest("r", tuple(doc + [5, 6]), SamplingParams(max_tokens=1), None))
    firsts, _, _ = _drain(worker)
    assert firsts["r"].cached.tokens == 40  # the document, found in the pool
