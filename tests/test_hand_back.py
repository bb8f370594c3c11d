"""A draining instance gives back the prompts it has not begun (``hand_back``), so that its drain waits only for
what it has computed part of: on a decode instance the local prefills no step has taken a chunk of, on a prefill
instance the prompts still waiting for their first step. What it gives back is freed there; what it keeps ends
with the reference engine's tokens. The router's side (each handed-back request placed anew, not counted as a
retry) runs end to end in ``test_role_change_e2e.py``."""

from __future__ import annotations

from decode_worker.messages import DecodeRequest
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.sampling import SamplingParams
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.messages import PrefillRequest
from prefill_worker.worker import PrefillWorker
from tests.test_decode_worker import prompts_of, reference
from tests.test_local_prefill_budget import worker_with_slo
from tests.test_prefix_cache_decode import assert_idle, drain

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def test_a_decode_instance_hands_back_the_local_prefills_it_has_not_begun(llama_dir):
    """Three prompts queued for local prefill, 512-token chunks, no sequence decoding: the first step computes a
    chunk of the shortest (the queue runs fewest remaining first), which the instance keeps and finishes with the
    reference's tokens; the other two go back, their blocks freed, and a second call finds nothing more."""
    short, middle, long = prompts_of([600, 800, 950], seed=5)
    worker = worker_with_slo(llama_dir, tpot_slo_ms=None)
    for rid, prompt in (("long", long), ("short", short), ("middle", middle)):
        assert worker.add_prefill(DecodeRequest(rid, tuple(prompt), PARAMS))
    used_by_all = worker.pool.num_used
    assert worker.prefills.unbegun() == ["long", "short", "middle"]
    outs = {}
    for d in worker.step():
        outs.setdefault(d.request_id, []).extend(d.token_ids)
    assert worker.requests["short"].seq.num_computed == 512  # begun, not done
    assert worker.hand_back() == ["middle", "long"]  # queue order: fewest remaining first
    assert set(worker.requests) == {"short"} and worker.pool.num_used < used_by_all
    assert worker.hand_back() == []
    drain(worker, outs)
    assert outs == {"short": reference(llama_dir, [short], PARAMS)[0]}
    assert_idle(worker)


def test_a_prefill_instance_hands_back_the_prompts_still_waiting(llama_dir):
    """One prompt at a time (``max_num_seqs`` 1): after a step the first is running, the rest wait. The waiting
    ones go back, except a request for its prompt's log-probabilities, which only a prefill instance serves; the
    kept ones sample the reference's first tokens, and every block is free at the end."""
    prompts = prompts_of([40, 30, 50, 20], seed=6)
    worker = PrefillWorker(llama_dir, PrefillWorkerConfig(block_size=4, kv_cache_tokens=512, token_budget=16,
                                                          max_num_seqs=1, attention_backend="torch"))
    params = [SamplingParams(max_tokens=1)] * 3 + [SamplingParams(max_tokens=1, prompt_logprobs=1)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        worker.add_request(PrefillRequest(f"r{i}", tuple(p), sp, None))
    firsts = {ft.request_id: ft for ft in worker.step().first_tokens}
    assert worker.hand_back() == ["r1", "r2"]
    assert worker.hand_back() == []
    while worker.has_work():
        for ft in worker.step().first_tokens:
            firsts[ft.request_id] = ft
    assert sorted(firsts) == ["r0", "r3"]
    ref = ReferenceEngine(llama_dir, EngineConfig(block_size=4, attention_backend="torch"))
    want = ref.generate([prompts[0], prompts[3]], [SamplingParams(max_tokens=1)] * 2)
    assert [firsts["r0"].token_id, firsts["r3"].token_id] == [c.token_ids[0] for c in want]
    assert worker.pool.num_free == worker.pool.num_blocks
