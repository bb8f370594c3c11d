"""KV transfer into a decode worker that holds part of the prompt cached: two real processes over gloo, a
PrefillWorker and a DecodeWorker. The decode worker served an earlier turn of the conversation, so it holds
that turn's KV; the next turn's transfer skips those blocks (fewer bytes on the wire, counted by the
sender) and the output is token for token the reference engine's. With a disk tier below a pool too small to keep
that turn, the decode worker loads its blocks from disk while the rest of the prompt is prefilled and sent."""

from __future__ import annotations

import time

import pytest
import torch

from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
from kv_transfer import Rendezvous, TransferConfig
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.sampling import SamplingParams
from tests.kv_procs import context, run_procs

BLOCK = 16
CONFIG = TransferConfig(timeout_s=30.0)
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


def turns() -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(11)
    first = torch.randint(2, 384, (90,), generator=g).tolist()
    question = torch.randint(2, 384, (40,), generator=g).tolist()
    return first, question


def prefill_proc(ckpt, rdv, prompt_q, done_q):
    from prefill_worker.config import PrefillWorkerConfig
    from prefill_worker.messages import KVDestination, PrefillRequest
    from prefill_worker.worker import PrefillWorker

    worker = PrefillWorker(ckpt, PrefillWorkerConfig(kv_cache_tokens=2048, token_budget=64, attention_backend="torch",
                                                     transfer=CONFIG), "prefill-0")
    worker.connect("decode-0", rdv)
    rid, prompt = prompt_q.get(timeout=60)  # the decode worker holds the request already (the router's order)
    worker.add_request(PrefillRequest(rid, tuple(prompt), PARAMS, KVDestination("decode-0", reserved=True)))
    transferred, failed = [], []
    deadline = time.monotonic() + 60
    while not (transferred or failed) and time.monotonic() < deadline:
        out = worker.step()
        transferred += out.transferred
        failed += [f.reason for f in out.failed]
        if out.empty:
            time.sleep(0.002)
    done_q.get(timeout=60)
    return {"transferred": transferred, "failed": failed, "bytes": worker.sender.stats.bytes}


DISK_READ_DELAY_S = 0.04  # per block: a disk slower than this VM's page cache, so the load visibly runs beside


def decode_proc(ckpt, rdv, prompt_q, done_q, disk_dir=None):
    from decode_worker.messages import DecodeRequest
    from decode_worker.worker import DecodeWorker
    from modeling.instance_config import KVTiersConfig

    tiers = {} if disk_dir is None else \
        {"kv_cache_tokens": 384, "kv_tiers": KVTiersConfig(host_memory_mb=0, disk_dir=disk_dir, disk_mb=16)}
    cfg = DecodeWorkerConfig(**{"dtype": "float32", "kv_cache_tokens": 2048, "attention_backend": "torch",
                                "profile_on_start": False, **tiers,
                                "speculation": SpeculationConfig(budget=32, sink_tokens=4, k_policy="fixed", k=3)})
    worker = DecodeWorker(ckpt, cfg, "decode-0", CONFIG)
    worker.connect("prefill-0", rdv)

    def drain(rid):
        out = []
        deadline = time.monotonic() + 60
        while worker.has_work() and time.monotonic() < deadline:
            out += [t for d in worker.step() if d.request_id == rid for t in d.token_ids]
            time.sleep(0.001)
        return out

    first, question = turns()
    out1 = [t for d in worker.add_local("turn-1", first, PARAMS) for t in d.token_ids] + drain("turn-1")
    second = first + out1 + question
    tiers = worker.prefix_cache.tiers
    if tiers is not None:  # two other prompts push turn 1 out of the pool: it is left on disk, read slowly
        g = torch.Generator().manual_seed(5)
        for i in range(2):
            worker.add_local(f"other-{i}", torch.randint(2, 384, (200,), generator=g).tolist(), PARAMS)
            drain(f"other-{i}")
        tiers.flush()
        read = tiers.disk.read
        tiers.disk.read = lambda block_hash, n: (time.sleep(DISK_READ_DELAY_S), read(block_hash, n))[1]
    hits, tier_hits = worker.prefix_cache.stats.hits, worker.prefix_cache.stats.tier_hits
    t0 = time.perf_counter()
    assert worker.add_remote(DecodeRequest("turn-2", tuple(second), PARAMS))
    admit_s = time.perf_counter() - t0
    held = len(worker.requests["turn-2"].seq.block_table.blocks)
    prompt_q.put(("turn-2", second))
    out2 = drain("turn-2")  # the first token came with the KV: the deltas carry the rest
    done_q.put(True)
    disk = tiers.disk.stats if tiers is not None else None
    return {"out1": out1, "second": second, "out2": out2, "cached": worker.prefix_cache.stats.hits - hits,
            "tier_hits": worker.prefix_cache.stats.tier_hits - tier_hits, "admit_s": admit_s,
            "read_in_background": disk.read_ahead if disk else 0, "disk_hits": disk.hits if disk else 0,
            "held": held, "free": worker.pool.num_free == worker.pool.num_blocks,
            "idle": worker.prefix_cache.num_tracked == 0 and (tiers is None or tiers.read_ahead_held() == (0, 0))}


@pytest.mark.parametrize("from_disk", [False, True], ids=["pool", "disk-tier"])
def test_a_transfer_skips_the_blocks_the_decode_worker_holds_cached(llama_dir, tmp_path, from_disk):
    store, rdv = Rendezvous.host_store()
    ctx = context()
    args = dict(ckpt=llama_dir, rdv=rdv, prompt_q=ctx.Queue(), done_q=ctx.Queue())
    decode_args = {**args, "disk_dir": str(tmp_path) if from_disk else None}
    out = run_procs({"prefill": (prefill_proc, args), "decode": (decode_proc, decode_args)}, timeout_s=150)
    pre, dec = out["prefill"], out["decode"]
    assert pre["failed"] == [] and pre["transferred"] == ["turn-2"] and dec["free"] and dec["idle"]
    assert dec["held"] == -(-(len(dec["second"]) + 1) // BLOCK)  # cached blocks + new ones: prompt and a step

    engine = ReferenceEngine(llama_dir, EngineConfig(dtype="float32", attention_backend="torch", prefix_caching=False))
    first, question = turns()
    assert dec["out1"] == engine.generate([first], PARAMS)[0].token_ids
    ref2 = engine.generate([dec["second"]], PARAMS)[0].token_ids
    assert dec["out2"] == ref2[1:]

    # turn 1 left its final blocks (prompt and every output token but the last) cached on the decode worker
    skipped = (len(first) + len(dec["out1"]) - 1) // BLOCK
    assert dec["cached"] == skipped * BLOCK
    loaded_config = engine.loaded.config
    per_block = 2 * loaded_config.num_hidden_layers * BLOCK * loaded_config.num_key_value_heads * \
        loaded_config.head_dim * 4  # K and V, every layer, float32
    prompt_blocks = -(-len(dec["second"]) // BLOCK)
    assert pre["bytes"] == (prompt_blocks - skipped) * per_block  # only the blocks it lacked went over the wire
    if from_disk:  # every one of them from disk, read and written beside the worker's steps, not in its admission
        assert dec["tier_hits"] == skipped * BLOCK and dec["read_in_background"] == skipped == dec["disk_hits"]
        assert dec["admit_s"] < skipped * DISK_READ_DELAY_S / 2, dec["admit_s"]
    del store
