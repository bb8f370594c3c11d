"""Decode worker: speculative decoding is lossless, memory is never leaked, the policy behaves."""

from __future__ import annotations

import pytest
import torch

from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
from decode_worker.messages import DecodeRequest
from decode_worker.worker import DecodeWorker
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.errors import InvalidRequestError
from modeling.sampling import SamplingParams
from tests.checkpoints import VOCAB


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def reference(directory, prompts, params):
    engine = ReferenceEngine(directory, EngineConfig(kv_cache_tokens=16384, attention_backend="torch"))
    return [c.token_ids for c in engine.generate(prompts, params)]


def run_worker(worker: DecodeWorker, prompts, params, k=None, join_every=0):
    """Decode all prompts; with join_every > 0, sequences join one at a time mid-run."""
    outs: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))

    def take(deltas):
        for d in deltas:
            outs.setdefault(d.request_id, []).extend(d.token_ids)

    steps = 0
    while pending or worker.has_work():
        if pending and (join_every == 0 or steps % join_every == 0):
            batch = pending if join_every == 0 else pending[:1]
            for i, p in batch:
                take(worker.add_local(f"r{i}", p, params[i] if isinstance(params, list) else params))
            pending = pending[len(batch):]
        take(worker.step(k))
        steps += 1
    return [outs[f"r{i}"] for i in range(len(prompts))]


def worker_for(directory, **spec):
    budget = spec.pop("budget", 64)
    kv = spec.pop("kv_cache_tokens", 16384)
    cfg = DecodeWorkerConfig(dtype="float32", kv_cache_tokens=kv, attention_backend="torch", profile_on_start=False,
                             speculation=SpeculationConfig(budget=budget, sink_tokens=4, **spec))
    return DecodeWorker(directory, cfg)


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("budget", [16, 128])
def test_greedy_self_speculation_is_lossless(llama_dir, k, budget):
    prompts = prompts_of([3, 30, 130, 400, 90], seed=k)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = reference(llama_dir, prompts, params)
    worker = worker_for(llama_dir, drafter="self_sparse", k_policy="fixed", k=k, budget=budget)
    assert run_worker(worker, prompts, params) == expected
    assert worker.pool.num_free == worker.pool.num_blocks
    assert worker.metrics.draft_tokens > 0


@pytest.mark.parametrize("batch", [1, 7])
def test_greedy_lossless_with_joins_and_adaptive_k(llama_dir, batch):
    prompts = prompts_of([5 + 37 * i for i in range(batch)], seed=11)
    params = SamplingParams(max_tokens=33, ignore_eos=True)
    expected = reference(llama_dir, prompts, params)
    worker = worker_for(llama_dir, drafter="self_sparse", k_policy="adaptive", max_k=4)
    worker.profile(batches=(1, 4), contexts=(64, 512), ks=(0, 2))
    assert run_worker(worker, prompts, params, join_every=3) == expected
    assert worker.pool.num_free == worker.pool.num_blocks
    # the policy fed back what it measured: draft and verify factors, reported by cell
    corrections = worker.status()["step_correction"]
    assert corrections["verify"] and all(f > 0 for ks in corrections["verify"].values() for f in ks.values())
    if any(k > 0 for k in worker.metrics.k_counts):
        assert corrections["draft"]


def test_greedy_draft_model_is_lossless(checkpoint_dir):
    target, draft = checkpoint_dir("llama_gqa"), checkpoint_dir("llama_tied")
    prompts = prompts_of([9, 100, 250], seed=5)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = reference(target, prompts, params)
    worker = worker_for(target, drafter="draft_model", draft_model=draft, k_policy="fixed", k=3, budget=48)
    long_prompt = prompts_of([600], seed=6)[0]
    worker.add_local("long", long_prompt, params)
    # the draft's StreamingLLM cache stays bounded: blocks behind the window were evicted
    assert worker.drafter.pool.num_used <= 2 * 48 // 16 + 4 < len(long_prompt) // 16
    worker.abort("long")
    assert run_worker(worker, prompts, params) == expected
    assert worker.pool.num_free == worker.pool.num_blocks
    assert worker.drafter.pool.num_free == worker.drafter.pool.num_blocks


def test_a_draft_model_admits_a_long_context_from_its_sink_and_last_windows(checkpoint_dir):
    """Building a sequence's draft cache computes the sink and the last two windows only, whatever the context
    (a view never reaches further back), and speculation stays lossless from there."""
    target, draft = checkpoint_dir("llama_gqa"), checkpoint_dir("llama_tied")
    worker = worker_for(target, drafter="draft_model", draft_model=draft, k_policy="fixed", k=3, budget=48)
    fed = []
    run = worker.drafter.runner.run

    def counting(inputs, **kw):
        fed.append(sum(len(i.token_ids) for i in inputs))
        return run(inputs, **kw)

    worker.drafter.runner.run = counting
    prompt = prompts_of([900], seed=12)[0]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    out = [t for d in worker.add_local("long", prompt, params) for t in d.token_ids]  # the target's prefill, then admit
    window = 48 - 4
    assert sum(fed) <= 16 + 2 * window + 16  # the sink's block, two windows, a block of rounding
    while worker.has_work():
        out += [t for d in worker.step() for t in d.token_ids]
    assert out == reference(target, [prompt], params)[0]
    assert worker.metrics.draft_tokens > 0
    assert worker.drafter.pool.num_free == worker.drafter.pool.num_blocks


def test_draft_model_with_same_weights_accepts_everything(llama_dir):
    """Sanity of the draft pipeline: a draft identical to the target with a view covering the whole
    context must have every greedy draft accepted."""
    prompts = prompts_of([20, 50], seed=2)
    worker = worker_for(llama_dir, drafter="draft_model", draft_model=llama_dir, k_policy="fixed", k=4, budget=512)
    run_worker(worker, prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    assert worker.metrics.accepted_tokens == worker.metrics.draft_tokens > 0


def test_preemption_and_recompute_stay_lossless(llama_dir):
    prompts = prompts_of([100, 120, 90, 110], seed=9)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    expected = reference(llama_dir, prompts, params)
    worker = worker_for(llama_dir, drafter="self_sparse", k_policy="fixed", k=3, kv_cache_tokens=640)
    assert run_worker(worker, prompts, params, join_every=1) == expected
    assert worker.metrics.preemptions > 0
    assert worker.pool.num_free == worker.pool.num_blocks


def test_stop_inside_accepted_drafts(llama_dir):
    prompts = prompts_of([40], seed=4)
    free = reference(llama_dir, prompts, SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop_tok = free[10]
    params = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok])
    worker = worker_for(llama_dir, drafter="self_sparse", k_policy="fixed", k=5, budget=512)
    out = run_worker(worker, prompts, params)[0]
    assert out == free[: free.index(stop_tok) + 1]


def test_waiting_for_kv_admit_abort_and_back_pressure(llama_dir):
    """The decode worker holds a remote request from its reservation on: ``waiting_for_kv`` with blocks for
    the prompt and the first step, then running once its KV and first token arrive (whose delta carries the
    first token's text, not its id), and it frees the blocks on abort in either state."""
    from kv_transfer.channel import TransferConfig
    from kv_transfer.receiver import ReceivedKV
    from modeling.runner import StepInput

    worker = worker_for(llama_dir, drafter="self_sparse", k_policy="fixed", k=2, kv_cache_tokens=256)
    worker = DecodeWorker(worker.loaded, worker.config, "decode-0", TransferConfig())
    prompt = prompts_of([150])[0]
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    assert worker.add_remote(DecodeRequest("a", tuple(prompt), params))
    blocks = worker.requests["a"].seq.block_table.blocks  # the worker's own: no block id leaves it
    assert len(blocks) == 10
    assert worker.num_waiting_for_kv == 1 and worker.num_running == 0 and worker.has_work()
    assert not worker.add_remote(DecodeRequest("b", tuple(prompt), params))  # no room: wait or go elsewhere
    with pytest.raises(InvalidRequestError, match="already on this worker"):
        worker.add_remote(DecodeRequest("a", tuple(prompt), params))
    with pytest.raises(InvalidRequestError, match="not waiting for KV"):
        worker.receiver.reserve("stranger", 10)  # a transfer the worker gave no blocks for is refused
    # the KV is kv_transfer's to write; here the worker's runner prefills the reserved blocks
    worker.runner.run([StepInput(prompt, 0, blocks, num_logits=0)])
    first = worker.kv_received(ReceivedKV("a", tuple(blocks), len(prompt), first_token=7))
    assert [(d.token_ids, d.position, d.finished) for d in first] == [([], 1, False)]  # after prefill's token
    assert worker.num_running == 1 and worker.num_waiting_for_kv == 0
    out = worker.step()
    assert out and all(d.request_id == "a" and d.token_ids for d in out)
    assert worker.abort("a") and not worker.has_work()
    assert worker.pool.num_free == worker.pool.num_blocks
    assert worker.add_remote(DecodeRequest("c", tuple(prompt[:10]), params))
    assert worker.abort("c") and not worker.abort("c")  # waiting for KV: released at once (nothing in flight)
    assert worker.pool.num_free == worker.pool.num_blocks and worker.num_waiting_for_kv == 0


def test_tpot_slo_caps_speculation(llama_dir):
    worker = worker_for(llama_dir, drafter="self_sparse", k_policy="adaptive", max_k=5, tpot_slo_ms=1e-6)
    worker.profile(batches=(1, 4), contexts=(64, 512), ks=(0, 2))
    run_worker(worker, prompts_of([50, 60]), SamplingParams(max_tokens=20, ignore_eos=True))
    assert set(worker.metrics.k_counts) == {0}


@pytest.mark.parametrize("field,kwargs,message", [
    ("drafter", dict(drafter="medusa"), r"speculation\.drafter: must be one of none, self_sparse, draft_model, got 'medusa'"),
    ("k", dict(k=-1), r"speculation\.k: must be in \[0, 16\], got -1"),
    ("sink", dict(sink_tokens=300, budget=256), r"speculation\.sink_tokens: must be < budget \(256\), got 300"),
    ("draft_model", dict(drafter="draft_model"), r"speculation\.draft_model: required"),
    ("slo", dict(tpot_slo_ms=-5), r"speculation\.tpot_slo_ms: must be a positive number"),
])
def test_speculation_config_errors(field, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculationConfig(**kwargs)
