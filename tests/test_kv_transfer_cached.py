"""KV transfer into a decode worker that holds part of the prompt cached: two real processes over gloo, a
PrefillWorker and a DecodeWorker. The decode worker served an earlier turn of the conversation, so it holds
that turn's KV; the next turn's transfer skips those blocks (fewer bytes on the wire, counted by the
sender) and the output is token for token the reference engine's."""

from __future__ import annotations

import time

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


def decode_proc(ckpt, rdv, prompt_q, done_q):
    from decode_worker.messages import DecodeRequest
    from decode_worker.worker import DecodeWorker

    cfg = DecodeWorkerConfig(dtype="float32", kv_cache_tokens=2048, attention_backend="torch", profile_on_start=False,
                             speculation=SpeculationConfig(budget=32, sink_tokens=4, k_policy="fixed", k=3))
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
    hits = worker.prefix_cache.stats.hits
    assert worker.add_remote(DecodeRequest("turn-2", tuple(second), PARAMS))
    held = len(worker.requests["turn-2"].seq.block_table.blocks)
    prompt_q.put(("turn-2", second))
    out2 = drain("turn-2")  # the first token came with the KV: the deltas carry the rest
    done_q.put(True)
    return {"out1": out1, "second": second, "out2": out2, "cached": worker.prefix_cache.stats.hits - hits,
            "held": held, "free": worker.pool.num_free == worker.pool.num_blocks}


def test_a_transfer_skips_the_blocks_the_decode_worker_holds_cached(llama_dir):
    store, rdv = Rendezvous.host_store()
    ctx = context()
    args = dict(ckpt=llama_dir, rdv=rdv, prompt_q=ctx.Queue(), done_q=ctx.Queue())
    out = run_procs({"prefill": (prefill_proc, args), "decode": (decode_proc, args)}, timeout_s=150)
    pre, dec = out["prefill"], out["decode"]
    assert pre["failed"] == [] and pre["transferred"] == ["turn-2"] and dec["free"]
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
    del store
