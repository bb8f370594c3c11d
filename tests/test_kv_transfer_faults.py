"""KV transfer failure handling between real processes over gloo: mismatched layouts are refused,
and a peer that dies or stalls mid-transfer makes the survivor free its blocks within the timeout and
report a retryable TransferError. Misbehaving peers speak the real wire protocol through PairChannel
and then kill themselves (SIGKILL) or stop (sleep) part-way through.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

from kv_transfer import (FingerprintMismatchError, HeadRange, KVFingerprint, KVReceiver, KVSender, LegTarget,
                         PairChannel, PeerHello, PoolReserver, Rendezvous, TransferConfig, TransferDescriptor)
from kv_transfer.channel import DECODE_RANK, DESCRIPTOR, FIRST_TOKEN, PIECES, PREFILL_RANK, REPLY
from kv_transfer.descriptors import Piece, PromptEnd, Reply, decode_descriptor, decode_prompt_end, decode_reply, encode
from modeling.block_pool import BlockPool
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from tests.kv_procs import run_procs

TIMEOUT = 2.0
SLACK = 6.0  # process scheduling on a loaded 2-core CI machine
LAYERS, HEADS, HEAD_DIM = 2, 2, 16  # the llama_gqa test checkpoint's KV layout


def fingerprint(block_size: int = 4) -> KVFingerprint:
    return KVFingerprint("llama", 64, 384, LAYERS, HEADS, HEAD_DIM, block_size, "float32")


def cache(block_size: int = 4, blocks: int = 32) -> PagedKVCache:
    return PagedKVCache(KVCacheSpec(LAYERS, HEADS, HEAD_DIM, block_size, torch.float32), blocks)


def _die(mode: str) -> None:
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # stall: alive, silent


# -- fingerprint ------------------------------------------------------------------------------------

def mismatch_proc(role, block_size, rdv):
    fp = fingerprint(block_size)
    cfg = TransferConfig(timeout_s=10)
    try:
        if role == "prefill":
            KVSender(cache(block_size), "p", fp, HeadRange(0, HEADS), cfg).connect("d", rdv)
        else:
            KVReceiver(cache(block_size), PoolReserver(BlockPool(32, block_size)), "d", fp, HeadRange(0, HEADS),
                       cfg).connect("p", rdv)
    except FingerprintMismatchError as err:
        return {"error": str(err), "retryable": err.retryable}
    return {"error": None}


def test_mismatched_fingerprint_is_refused_on_both_ends():
    store, rdv = Rendezvous.host_store()
    out = run_procs({"prefill": (mismatch_proc, dict(role="prefill", block_size=4, rdv=rdv)),
                     "decode": (mismatch_proc, dict(role="decode", block_size=8, rdv=rdv))}, timeout_s=60)
    assert "block_size: ours 4, peer 8" in out["prefill"]["error"]
    assert "block_size: ours 8, peer 4" in out["decode"]["error"]
    assert "refusing" in out["prefill"]["error"] and out["prefill"]["retryable"] is False
    del store


def test_fingerprint_diff_names_every_field():
    a = fingerprint()
    b = KVFingerprint("qwen2", 64, 384, LAYERS, HEADS, HEAD_DIM, 4, "bfloat16")
    with pytest.raises(FingerprintMismatchError, match=r"model_type: ours 'llama', peer 'qwen2'.*dtype"):
        a.require_same(b, "r1")
    with pytest.raises(ValueError, match="cache.num_kv_heads: expected 1"):
        KVSender(cache(), "p", a, HeadRange(0, 1))


# -- receiver side: back-pressure without processes -----------------------------------------------

def test_reserve_applies_back_pressure_and_release_frees():
    pool = BlockPool(10, 4)
    receiver = KVReceiver(cache(blocks=10), PoolReserver(pool), "d", fingerprint(), HeadRange(0, HEADS))
    assert len(receiver.reserve("a", 17)) == 5
    assert receiver.reserve("b", 21) is None  # 6 blocks needed, 5 free: no room, nothing taken
    assert pool.num_free == 5
    assert len(receiver.reserve("c", 20)) == 5
    assert receiver.reserve("d", 1) is None
    receiver.release("a")
    assert pool.num_free == 5 and receiver.reserved() == ["c"]
    with pytest.raises(ValueError, match="request_id"):
        receiver.reserve("c", 4)


# -- a receiver dies or stalls while the prefill worker streams ------------------------------------

def bad_receiver_proc(rdv, mode):
    store = rdv.connect()
    ch = PairChannel.open(store, "prefill-0", "decode-0", DECODE_RANK,
                          PeerHello("decode-0", "decode", fingerprint(), HeadRange(0, HEADS)),
                          torch.device("cpu"), TransferConfig(timeout_s=60))
    kind, payload = ch.recv_frame()
    assert kind == DESCRIPTOR
    desc = decode_descriptor(payload)
    ch.send_frame(REPLY, encode(Reply("accept", desc.transfer_id)))
    kind, payload = ch.recv_frame()
    assert kind == PIECES
    ch.recv_data(torch.empty(3, 4, HEADS, HEAD_DIM))  # layer 0 keys of the first 3 blocks, then gone
    _die(mode)


def prefill_victim_proc(ckpt, rdv):
    from modeling.sampling import SamplingParams
    from prefill_worker.config import PrefillWorkerConfig
    from prefill_worker.worker import PrefillWorker
    from prefill_worker.messages import KVDestination, PrefillRequest

    worker = PrefillWorker(ckpt, PrefillWorkerConfig(block_size=4, kv_cache_tokens=256, token_budget=12,
                                                     attention_backend="torch",
                                                     transfer=TransferConfig(timeout_s=TIMEOUT)), "prefill-0")
    worker.connect("decode-0", rdv)
    worker.add_request(PrefillRequest("r", tuple(range(2, 42)), SamplingParams(max_tokens=4),
                                      KVDestination("decode-0")))
    t0 = time.monotonic()
    failures, held = [], 0
    while not failures and time.monotonic() - t0 < 60:
        out = worker.step()
        held = max(held, worker.pool.num_used)
        failures += out.failed
        time.sleep(0.005)
    return {"elapsed": time.monotonic() - t0, "failures": [(f.request_id, f.retryable, f.reason) for f in failures],
            "held": held, "free_after": worker.pool.num_free == worker.pool.num_blocks,
            "has_work": worker.has_work()}


@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_receiver_lost_mid_transfer_frees_sender_blocks(llama_dir, mode):
    store, rdv = Rendezvous.host_store()
    out = run_procs({"prefill": (prefill_victim_proc, dict(ckpt=llama_dir, rdv=rdv)),
                     "bad": (bad_receiver_proc, dict(rdv=rdv, mode=mode))}, timeout_s=90, expect_death=("bad",))
    res = out["prefill"]
    assert [(rid, retry) for rid, retry, _ in res["failures"]] == [("r", True)], res
    assert res["held"] == 10 and res["free_after"] and not res["has_work"]
    assert res["elapsed"] < TIMEOUT + SLACK
    del store


# -- a sender dies or stalls while the receiver is writing ----------------------------------------

def bad_sender_proc(rdv, mode):
    store = rdv.connect()
    ch = PairChannel.open(store, "prefill-0", "decode-0", PREFILL_RANK,
                          PeerHello("prefill-0", "prefill", fingerprint(), HeadRange(0, HEADS)),
                          torch.device("cpu"), TransferConfig(timeout_s=60))
    ch.send_frame(DESCRIPTOR, encode(TransferDescriptor("r", 1, fingerprint(), 40, HeadRange(0, HEADS))))
    kind, payload = ch.recv_frame()
    assert kind == REPLY and decode_reply(payload).kind == "accept"
    ch.send_frame(PIECES, encode([Piece(1, 0, 10)]))
    ch.send_data(torch.ones(10, 4, HEADS, HEAD_DIM)).wait()  # layer 0 keys only
    _die(mode)


def receiver_victim_proc(rdv):
    pool = BlockPool(32, 4)
    receiver = KVReceiver(cache(), PoolReserver(pool), "decode-0", fingerprint(), HeadRange(0, HEADS),
                          TransferConfig(timeout_s=TIMEOUT))
    receiver.connect("prefill-0", rdv)
    t0 = time.monotonic()
    failed, held = [], 0
    while not failed and time.monotonic() - t0 < 60:
        ev = receiver.poll()
        held = max(held, pool.num_used)
        failed += ev.failed
        time.sleep(0.005)
    return {"elapsed": time.monotonic() - t0, "failed": [(f.request_id, f.error.retryable) for f in failed],
            "held": held, "free_after": pool.num_free == pool.num_blocks, "reserved": receiver.reserved()}


@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_sender_lost_mid_transfer_frees_receiver_blocks(mode):
    store, rdv = Rendezvous.host_store()
    out = run_procs({"decode": (receiver_victim_proc, dict(rdv=rdv)),
                     "bad": (bad_sender_proc, dict(rdv=rdv, mode=mode))}, timeout_s=90, expect_death=("bad",))
    res = out["decode"]
    assert res["failed"] == [("r", True)], res
    assert res["held"] == 10 and res["free_after"] and res["reserved"] == []
    assert res["elapsed"] < TIMEOUT + SLACK
    del store


# -- a reservation released mid-transfer (request cancelled on the decode side) --------------------

def _pair_in_process(cfg: TransferConfig, reserver: PoolReserver, src: PagedKVCache):
    """A sender over ``src`` and a receiver into a fresh cache, both in this process (a real gloo pair formed
    from two threads); returns (the store to keep alive, sender, receiver)."""
    store, rdv = Rendezvous.host_store()
    receiver = KVReceiver(cache(), reserver, "d", fingerprint(), HeadRange(0, HEADS), cfg)
    sender = KVSender(src, "p", fingerprint(), HeadRange(0, HEADS), cfg)
    t = threading.Thread(target=receiver.connect, args=("p", rdv))
    t.start()
    sender.connect("d", rdv)
    t.join(timeout=30)
    return store, sender, receiver


def test_release_during_transfer_drains_and_frees():
    """Both ends in this process (two threads, a real gloo pair): the receiver drops the reservation
    after accepting; the bytes still sent are drained (or land in blocks freed once they are in), the
    sender gets its acknowledgement, and every block is back in both pools."""
    pool = BlockPool(32, 4)
    src = cache()
    src.kv.fill_(1.0)
    store, sender, receiver = _pair_in_process(TransferConfig(timeout_s=10, handshake_wait_s=10), PoolReserver(pool), src)
    try:
        assert receiver.reserve("r", 40) is not None
        sender.begin("r", 40, list(range(10)), [LegTarget("d", HeadRange(0, HEADS), reserved=True)])
        group = sender.open_group({"r": 10})  # waits for ACCEPT, then announces the piece
        assert not group.empty
        receiver.release("r")
        for layer in range(LAYERS):
            group.send_layer(layer)
        group.close()
        done, deadline = [], time.monotonic() + 20
        while not done and time.monotonic() < deadline:
            receiver.poll()
            ev = sender.poll()
            assert not ev.failed, ev.failed
            done += ev.done
            time.sleep(0.005)
        for _ in range(100):  # a cancelled reservation is freed by poll() once its receives end
            if pool.num_free == pool.num_blocks:
                break
            receiver.poll()
            time.sleep(0.01)
        assert done == ["r"]
        assert pool.num_free == pool.num_blocks and receiver.reserved() == []
    finally:
        sender.close()
        receiver.close()
    del store


def test_a_transfer_is_arriving_from_its_acceptance_until_it_is_handed_over():
    """What a decode worker holds its steps short for (``KVReceiver.arriving``): a reservation whose sender has
    begun (its prompt is being computed, the first token may come at any moment), until the receiver hands it
    over with that token; not a reservation nothing is sent to yet."""
    reserver = PoolReserver(BlockPool(32, 4))
    store, sender, receiver = _pair_in_process(TransferConfig(timeout_s=10), reserver, cache())
    try:
        assert receiver.reserve("r", 10) is not None and receiver.arriving() == set()
        sender.begin("r", 10, [5, 6, 7], [LegTarget("d", HeadRange(0, HEADS), reserved=True)])
        group = sender.open_group({"r": 3})  # returns once the receiver accepted
        assert receiver.arriving() == {"r"}
        for layer in range(LAYERS):
            group.send_layer(layer)
        group.close()
        sender.finish_prompt("r", 42)
        completed, deadline = [], time.monotonic() + 20
        while not completed and time.monotonic() < deadline:
            assert receiver.arriving() == {"r"}
            completed += receiver.poll().completed
            assert not sender.poll().failed
            time.sleep(0.005)
        assert [kv.first_token for kv in completed] == [42] and receiver.arriving() == set()
    finally:
        sender.close()
        receiver.close()
    del store


def test_long_control_frames_continue_in_a_second_message():
    """A control frame larger than the fixed frame (a migration's end: the request's state, its output
    tokens included) arrives whole, and the frame after it is read normally."""
    from kv_transfer.channel import FRAME_BYTES

    store, rdv = Rendezvous.host_store()
    cfg = TransferConfig(timeout_s=10)
    ends = {}

    def open_end(rank, name):
        ends[rank] = PairChannel.open(rdv.connect(), "p", "d", rank,
                                      PeerHello(name, name, fingerprint(), HeadRange(0, HEADS)),
                                      torch.device("cpu"), cfg)

    t = threading.Thread(target=open_end, args=(DECODE_RANK, "d"))
    t.start()
    open_end(PREFILL_RANK, "p")
    t.join(timeout=30)
    big = PromptEnd("r", 1, num_tokens=24000, state=json.dumps({"output_ids": list(range(100000, 106000))}))
    payload = encode(big)
    assert len(payload) > FRAME_BYTES
    first = ends[PREFILL_RANK].send_frame(FIRST_TOKEN, payload, wait=False)
    second = ends[PREFILL_RANK].send_frame(PIECES, encode([Piece(1, 0, 3)]), wait=False)
    kind, got = ends[DECODE_RANK].recv_frame(timeout_s=10)
    assert kind == FIRST_TOKEN and decode_prompt_end(got) == big
    kind, got = ends[DECODE_RANK].recv_frame(timeout_s=10)
    assert kind == PIECES and got == encode([Piece(1, 0, 3)])
    first.wait()
    second.wait()
    for ch in ends.values():
        ch.abort("test over")
    del store


def test_descriptor_before_the_reservation_waits_for_it():
    """The router contacts the prefill and decode instances at once, so a transfer that names a reservation
    (``reserved``) may reach the receiver before its owner reserved: the receiver answers BUSY until the
    reservation exists, then accepts, and the KV lands in it byte for byte."""
    reserver = PoolReserver(BlockPool(32, 4))
    src = cache()
    src.kv.copy_(torch.randn(src.kv.shape, generator=torch.Generator().manual_seed(3)))
    store, sender, receiver = _pair_in_process(TransferConfig(timeout_s=10, retry_interval_s=0.02), reserver, src)
    try:
        sender.begin("r", 10, [5, 6, 7], [LegTarget("d", HeadRange(0, HEADS), reserved=True)])
        group = sender.open_group({"r": 3})  # the forward pass: its KV waits for the ACCEPT
        for layer in range(LAYERS):
            group.send_layer(layer)
        group.close()
        sender.finish_prompt("r", 42)
        deadline = time.monotonic() + 20
        while receiver.num_busy < 2 and time.monotonic() < deadline:  # asked, and asked again
            receiver.poll()
            assert not sender.poll().failed
            time.sleep(0.005)
        assert receiver.num_busy >= 2 and receiver.reserved() == []
        assert receiver.reserve("r", 10) is not None  # the owner's hold comes now
        done, completed = [], []
        while not (done and completed) and time.monotonic() < deadline:
            completed += receiver.poll().completed
            ev = sender.poll()
            assert not ev.failed, ev.failed
            done += ev.done
            time.sleep(0.005)
        assert done == ["r"] and [kv.first_token for kv in completed] == [42]
        table = reserver.take("r")
        assert torch.equal(receiver.cache.kv[:, :, table.blocks[:3]], src.kv[:, :, [5, 6, 7]])
    finally:
        sender.close()
        receiver.close()
    del store
