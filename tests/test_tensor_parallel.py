"""Tensor parallelism over gloo between real processes: TP 2 must reproduce TP 1.

Each rank is its own process (forkserver, one torch thread), forming its instance's group from a TCP
store hosted here. Greedy output must be token-identical to the single-process engine in float32 (the
row-parallel sums round differently, far below what moves an argmax of these models); seeded sampling
must draw the same tokens.
"""

from __future__ import annotations

import time

import pytest
import torch

from kv_transfer import Rendezvous
from modeling.checkpoint import load_model
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.params import SamplingParams
from modeling.prefix_hash import block_hashes
from modeling.tp import TPShard, slice_plan
from tests.kv_procs import run_procs

ENGINE = EngineConfig(dtype="float32", block_size=4, kv_cache_tokens=1024, token_budget=24, max_num_seqs=8,
                      attention_backend="torch")
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], list(range(3, 40)), [200, 201, 7, 9] * 5]


def _params():
    # the last request decodes two sequences forked from its prompt (their partly filled block copied on every rank)
    return [SamplingParams(max_tokens=12, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
            SamplingParams(max_tokens=9, temperature=1.0, top_k=20, seed=3, n=2, ignore_eos=True)]


def _sequences(completions) -> list[list[int]]:
    """Every sequence's tokens, request by request."""
    return [s.token_ids for c in completions for s in (c.sequences or [c])]


def _form(rdv, instance, rank, size):
    from modeling.tp_group import TPGroup

    return TPGroup.form(rdv.connect(), instance, TPShard(rank, size), "cpu")


def engine_driver(path, rdv, size):
    engine = ReferenceEngine(path, ENGINE, tp=_form(rdv, "engine", 0, size))
    try:
        outs = engine.generate(PROMPTS, _params())
        blocks_free = engine.pool.num_free == engine.pool.num_blocks
    finally:
        engine.close()
    return {"tokens": _sequences(outs), "blocks_free": blocks_free,
            "all_reduces": engine.runner.group.collectives.calls}


def engine_follower(path, rdv, rank, size):
    from modeling.engine import follower

    return follower(path, ENGINE, _form(rdv, "engine", rank, size)).serve()


def run_engine_tp(path: str, size: int) -> dict:
    store, rdv = Rendezvous.host_store()
    specs = {"r0": (engine_driver, dict(path=path, rdv=rdv, size=size))}
    specs.update({f"r{r}": (engine_follower, dict(path=path, rdv=rdv, rank=r, size=size)) for r in range(1, size)})
    out = run_procs(specs, timeout_s=120)
    del store
    return out


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2_bias"])
def test_engine_tp2_matches_tp1(checkpoint_dir, family):
    path = checkpoint_dir(family)
    reference = _sequences(ReferenceEngine(path, ENGINE).generate(PROMPTS, _params()))
    out = run_engine_tp(path, 2)
    assert out["r0"]["tokens"] == reference
    assert out["r0"]["blocks_free"]
    # every forward ran on the follower too, with two all-reduces per layer each
    assert out["r1"] > 0
    assert out["r0"]["all_reduces"] == 2 * 2 * out["r1"]


def test_engine_tp_beyond_kv_heads_replicates_them(checkpoint_dir):
    """llama3_rope has one KV head: with TP 2 each rank holds a replica of it."""
    path = checkpoint_dir("llama3_rope")
    reference = _sequences(ReferenceEngine(path, ENGINE).generate(PROMPTS, _params()))
    assert run_engine_tp(path, 2)["r0"]["tokens"] == reference


def test_shards_cover_the_model_once(checkpoint_dir):
    """Concatenating the ranks' column/row slices gives back every full weight; replicated ones are whole;
    a row-parallel bias lives on rank 0 only."""
    path = checkpoint_dir("qwen2_bias")
    full = load_model(path).model.state_dict()
    shards = [load_model(path, shard=TPShard(r, 2)) for r in range(2)]
    assert [s.kv_heads.size for s in shards] == [1, 1]
    plan = slice_plan(shards[0].config, TPShard(0, 2))
    for name, tensor in full.items():
        parts = [s.model.state_dict().get(name) for s in shards]
        if name in plan and plan[name] is not None:
            assert torch.equal(torch.cat(parts, dim=plan[name].dim), tensor), name
        elif name in plan:
            assert parts[0] is not None and parts[1] is None, name
        else:
            assert all(torch.equal(p, tensor) for p in parts), name


def test_unsplittable_model_is_refused_naming_the_field(checkpoint_dir):
    with pytest.raises(ValueError, match="tensor_parallel: 3 does not divide the model's num_attention_heads"):
        load_model(checkpoint_dir("llama_gqa"), shard=TPShard(0, 3))


# -- decode worker -------------------------------------------------------------------------------------

DECODE_PROMPTS = [list(range(5, 45)), [9, 8, 7, 6, 5, 4, 3, 2] * 12, [100 + i % 50 for i in range(150)]]


def _decode_config(drafter: str, draft_dir: str | None):
    from decode_worker.config import DecodeWorkerConfig, SpeculationConfig

    spec = SpeculationConfig(drafter=drafter, budget=24, sink_tokens=4, k_policy="fixed", k=3,
                             draft_model=draft_dir if drafter == "draft_model" else None)
    return DecodeWorkerConfig(dtype="float32", kv_cache_tokens=2048, block_size=4, attention_backend="torch",
                              profile_on_start=False, speculation=spec)


def _decode_all(worker) -> dict:
    outs: dict[tuple[str, int], list[int]] = {}
    for i, (prompt, params) in enumerate(zip(DECODE_PROMPTS, _params())):
        for d in worker.add_local(f"r{i}", prompt, params):
            outs.setdefault((d.request_id, d.index), []).extend(d.token_ids)
    while worker.has_work():
        for d in worker.step():
            outs.setdefault((d.request_id, d.index), []).extend(d.token_ids)
    m = worker.metrics.summary()
    return {"tokens": [outs[key] for key in sorted(outs)], "draft_tokens": m["draft_tokens"],
            "blocks_free": worker.pool.num_free == worker.pool.num_blocks}


def decode_driver(path, draft_dir, drafter, rdv):
    from decode_worker.worker import DecodeWorker

    worker = DecodeWorker(path, _decode_config(drafter, draft_dir), tp=_form(rdv, "decode", 0, 2))
    try:
        return _decode_all(worker)
    finally:
        worker.close()


def decode_follower(path, draft_dir, drafter, rdv):
    from decode_worker.worker import follower

    return follower(path, _decode_config(drafter, draft_dir), _form(rdv, "decode", 1, 2)).serve()


@pytest.mark.parametrize("drafter", ["none", "self_sparse", "draft_model"])
def test_decode_worker_tp2_matches_tp1(checkpoint_dir, drafter):
    """Plain decoding, self-speculation over the sparse view and a draft model (whole on the driver):
    greedy and seeded-sampled tokens are those of the one-rank worker, and no block is left held."""
    from decode_worker.worker import DecodeWorker

    path, draft_dir = checkpoint_dir("llama_gqa"), checkpoint_dir("llama_tied")
    expected = _decode_all(DecodeWorker(path, _decode_config(drafter, draft_dir)))
    store, rdv = Rendezvous.host_store()
    kw = dict(path=path, draft_dir=draft_dir, drafter=drafter, rdv=rdv)
    out = run_procs({"r0": (decode_driver, kw), "r1": (decode_follower, kw)}, timeout_s=120)
    del store
    assert out["r0"] == expected
    assert (expected["draft_tokens"] > 0) == (drafter != "none")
    assert out["r1"] > 0


# -- prefill TP p -> decode TP d, KV moved rank to rank ---------------------------------------------------

def _prefill_config():
    from prefill_worker.config import PrefillWorkerConfig

    return PrefillWorkerConfig(dtype="float32", block_size=4, kv_cache_tokens=1024, token_budget=32,
                               attention_backend="torch")


def _remote_decode_config():
    # plain decoding: seeded sampling then draws exactly the engine's tokens (speculation draws differently)
    return _decode_config("none", None)


def prefill_rank(path, rdv, rank, p, d, handoff, firsts_q):
    """Rank ``rank`` of the prefill instance; rank 0 takes prompts (with their decode blocks) from
    ``handoff`` and reports first tokens on ``firsts_q``."""
    from prefill_worker.messages import KVDestination, PrefillRequest
    from prefill_worker.worker import PrefillWorker, follower

    group = _form(rdv, "prefill-0", rank, p)
    if rank:
        f = follower(path, _prefill_config(), group, "prefill-0")
        f.connect("decode-0", rdv, 0, decode_tp=d)
        f.serve()
        return {"blocks_free": None}
    worker = PrefillWorker(path, _prefill_config(), "prefill-0", tp=group if p > 1 else None)
    worker.connect("decode-0", rdv, 0, decode_tp=d)
    transferred = set()
    try:
        for _ in PROMPTS:
            rid, prompt, params, reserved = handoff.get(timeout=60)
            worker.add_request(PrefillRequest(rid, prompt, params, KVDestination("decode-0", reserved=reserved)))
        while len(transferred) < len(PROMPTS):
            out = worker.step()
            assert not out.failed, out.failed
            for ft in out.first_tokens:
                firsts_q.put((ft.request_id, [ft.token_id] + [token for _, token, _, _ in ft.forks]))
            transferred.update(out.transferred)
        return {"blocks_free": worker.pool.num_free == worker.pool.num_blocks}
    finally:
        worker.close()


def decode_rank(path, rdv, rank, p, d, handoff):
    from decode_worker.messages import DecodeRequest
    from decode_worker.worker import DecodeWorker, follower
    from kv_transfer.channel import TransferConfig

    transfer = TransferConfig(timeout_s=30)
    group = _form(rdv, "decode-0", rank, d)
    if rank:
        f = follower(path, _remote_decode_config(), group, "decode-0", transfer)
        f.connect("prefill-0", rdv, 0, prefill_tp=p)
        return {"steps": f.serve()}
    worker = DecodeWorker(path, _remote_decode_config(), "decode-0", transfer, tp=group if d > 1 else None)
    worker.connect("prefill-0", rdv, 0, prefill_tp=p)
    outs: dict[tuple[str, int], list[int]] = {}
    try:
        for i, (prompt, params) in enumerate(zip(PROMPTS, _params())):
            reserved = worker.add_remote(DecodeRequest(f"r{i}", tuple(prompt), params))
            handoff.put((f"r{i}", prompt, params, reserved))
        finished = set()
        while len(finished) < sum(p.num_sequences for p in _params()):
            for d_ in worker.step():
                assert hasattr(d_, "token_ids"), d_  # a DecodeFailure fails the test
                outs.setdefault((d_.request_id, d_.index), []).extend(d_.token_ids)
                if d_.finished:
                    finished.add((d_.request_id, d_.index))
        return {"tokens": outs, "blocks_free": worker.pool.num_free == worker.pool.num_blocks}
    finally:
        worker.close()


@pytest.mark.parametrize("p,d", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_prefill_tp_to_decode_tp_matches_the_engine(checkpoint_dir, p, d):
    """Each decode rank receives exactly its KV heads from the prefill rank holding them (2 KV heads: with
    d = 4 each head lives on two decode ranks, with p = 4 on two prefill ranks, one of which sends it);
    greedy and seeded-sampled tokens equal the engine's."""
    from tests.kv_procs import context

    path = checkpoint_dir("llama_gqa")
    reference = _sequences(ReferenceEngine(path, ENGINE).generate(PROMPTS, _params()))
    store, rdv = Rendezvous.host_store()
    ctx = context()
    handoff, firsts_q = ctx.Queue(), ctx.Queue()
    specs = {f"p{r}": (prefill_rank, dict(path=path, rdv=rdv, rank=r, p=p, d=d, handoff=handoff, firsts_q=firsts_q))
             for r in range(p)}
    specs.update({f"d{r}": (decode_rank, dict(path=path, rdv=rdv, rank=r, p=p, d=d, handoff=handoff))
                  for r in range(d)})
    out = run_procs(specs, timeout_s=180)
    del store
    firsts = dict(firsts_q.get(timeout=5) for _ in PROMPTS)
    got = [[firsts[rid][index]] + tokens for (rid, index), tokens in sorted(out["d0"]["tokens"].items())]
    assert got == reference
    assert out["p0"]["blocks_free"] and out["d0"]["blocks_free"]



# -- a refused transfer withdrawn on every rank ----------------------------------------------------------------

def _small_prefill_config():
    from kv_transfer.channel import TransferConfig
    from prefill_worker.config import PrefillWorkerConfig

    return PrefillWorkerConfig(dtype="float32", block_size=4, kv_cache_tokens=32, token_budget=32,
                               attention_backend="torch", transfer=TransferConfig(timeout_s=20, retry_interval_s=0.02))


HELD, WAITING = tuple(range(10, 34)), tuple(range(50, 66))  # 6 blocks of the prefill pool's 8, then 4


def refusing_prefill_rank(path, rdv, rank, stop):
    """Rank ``rank`` of a TP-2 prefill instance of 8 blocks: rank 0 prefills "held" for the decode instance (which
    has no room) and then "next", which needs held's blocks; returns what it saw, and rank 1 the legs it still
    holds once rank 0 closes."""
    from prefill_worker import worker as worker_module
    from prefill_worker.messages import KVDestination, PrefillRequest
    from prefill_worker.worker import PrefillWorker, follower

    group = _form(rdv, "prefill-0", rank, 2)
    if rank:
        f = follower(path, _small_prefill_config(), group, "prefill-0")
        f.connect("decode-0", rdv, 0, decode_tp=1)
        f.serve()
        return {"legs": f.sender.pending()}
    worker_module.REFUSED_TRANSFER_S = 0.3
    worker = PrefillWorker(path, _small_prefill_config(), "prefill-0", tp=group)
    worker.connect("decode-0", rdv, 0, decode_tp=1)
    failed, firsts = [], []
    try:
        # placed at once on both instances, the decode one without room: its reservation never comes
        worker.add_request(PrefillRequest("held", HELD, SamplingParams(max_tokens=2),
                                          KVDestination("decode-0", reserved=True)))
        worker.add_request(PrefillRequest("next", WAITING, SamplingParams(max_tokens=1), None))
        deadline = time.monotonic() + 30
        while "next" not in firsts and time.monotonic() < deadline:
            out = worker.step()
            failed += [(f.request_id, f.retryable, f.reason) for f in out.failed]
            firsts += [ft.request_id for ft in out.first_tokens]
            time.sleep(0.005)
        return {"failed": failed, "firsts": firsts, "pending": worker.transfers_pending(),
                "cached": worker.pool.cached_run(block_hashes(list(HELD), 4, worker.prefix_cache.salt))}
    finally:
        stop.set()
        worker.close()


def full_decode_rank(path, rdv, stop):
    """A decode instance that holds no room for "held": it answers its transfer BUSY until ``stop``."""
    from decode_worker.worker import DecodeWorker
    from kv_transfer.channel import TransferConfig

    worker = DecodeWorker(path, _remote_decode_config(), "decode-0", TransferConfig(timeout_s=20))
    worker.connect("prefill-0", rdv, 0, prefill_tp=2)
    while not stop.is_set():
        worker.step()
        time.sleep(0.005)
    held = "held" in worker.requests
    worker.close()
    return {"held": held, "busy": worker.inbox.receiver.num_busy}


def test_a_refused_transfer_is_withdrawn_on_every_rank_of_a_tp_prefill_instance(checkpoint_dir):
    """TP 2 prefill, its decode instance full: "held"'s transfer is refused on both ranks' legs. "next" needs its
    blocks with nothing else to run, so rank 0 withdraws it (failed, retryable) and tells rank 1 to drop its legs:
    "next" runs, and once the driver closes the follower holds no leg."""
    from tests.kv_procs import context

    path = checkpoint_dir("llama_gqa")
    store, rdv = Rendezvous.host_store()
    stop = context().Event()
    specs = {f"p{r}": (refusing_prefill_rank, dict(path=path, rdv=rdv, rank=r, stop=stop)) for r in range(2)}
    specs["d0"] = (full_decode_rank, dict(path=path, rdv=rdv, stop=stop))
    out = run_procs(specs, timeout_s=120)
    del store
    p0 = out["p0"]
    assert [(rid, retryable) for rid, retryable, _ in p0["failed"]] == [("held", True)], p0["failed"]
    assert "withdrawn" in p0["failed"][0][2]
    assert sorted(p0["firsts"]) == ["held", "next"] and p0["pending"] == 0
    assert p0["cached"] >= 2  # what "next" left of held's blocks stays cached
    assert out["p1"]["legs"] == 0 and not out["d0"]["held"] and out["d0"]["busy"] >= 2  # both ranks' legs asked

# -- CUDA: NCCL all-reduces, flash-attn where installed ---------------------------------------------------

def cuda_engine_rank(path, rdv, rank, size):
    import dataclasses

    from modeling.engine import follower
    from modeling.tp_group import TPGroup

    device = f"cuda:{rank}"
    cfg = dataclasses.replace(ENGINE, device=device, attention_backend="auto", block_size=256, kv_cache_tokens=8192)
    group = TPGroup.form(rdv.connect(), "cuda-engine", TPShard(rank, size), device)
    if rank:
        return follower(path, cfg, group).serve()
    engine = ReferenceEngine(path, cfg, tp=group)
    try:
        return [c.token_ids for c in engine.generate(PROMPTS, _params()[:1] * len(PROMPTS))]
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_engine_tp2_on_cuda_matches_tp1(checkpoint_dir):
    import dataclasses

    path = checkpoint_dir("llama_gqa")
    cfg = dataclasses.replace(ENGINE, device="cuda", attention_backend="auto", block_size=256, kv_cache_tokens=8192)
    reference = [c.token_ids for c in ReferenceEngine(path, cfg).generate(PROMPTS, _params()[:1] * len(PROMPTS))]
    store, rdv = Rendezvous.host_store()
    out = run_procs({f"r{r}": (cuda_engine_rank, dict(path=path, rdv=rdv, rank=r, size=2)) for r in range(2)},
                    timeout_s=300)
    del store
    assert out["r0"] == reference
