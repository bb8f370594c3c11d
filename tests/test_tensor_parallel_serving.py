"""Tensor-parallel pools served end to end: a real local Ray cluster places each instance's ranks in its
placement-group bundles, real gRPC over localhost, KV moved rank to rank over gloo. Greedy output equals
the single-process reference engine; a killed rank fails its instance's requests cleanly (never a hang)."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest

from modeling.engine import EngineConfig, ReferenceEngine
from modeling.sampling import SamplingParams
from tests.serving import e2e_config, prompts_of, running_server, stream_ids, wait_all_free

PROMPTS_LENGTHS = [5, 40, 130, 21]


def _config(path: str, prefill_tp: int, decode_tp: int):
    return e2e_config(
        path,
        ray={"num_cpus": 6, "num_gpus": 0},
        prefill={"tensor_parallel": prefill_tp, "kv_cache_tokens": 4096, "attention_backend": "torch",
                 "chunk_tokens": 64},
        decode={"tensor_parallel": decode_tp, "kv_cache_tokens": 4096, "attention_backend": "torch",
                "speculation": {"k_policy": "fixed", "k": 3, "budget": 32, "sink_tokens": 4}},
        kv_transfer={"timeout_s": 10},
        server={"port": 0},
    )


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_tp_pools_serve_the_reference_output(llama_dir, prefill_tp, decode_tp):
    prompts = prompts_of(PROMPTS_LENGTHS, seed=7)
    reference = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=16384, attention_backend="torch"))
    expected = [c.token_ids for c in reference.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))]
    with running_server(_config(llama_dir, prefill_tp, decode_tp)) as address:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: stream_ids(address, p, max_tokens=30, ignore_eos=True), prompts))
        assert [ids for ids, _ in results] == expected
        assert all(final.usage["draft_tokens"] > 0 for _, final in results)  # speculation ran on TP ranks
        assert wait_all_free(address)  # the drivers' pools; followers mirror them


def test_killed_decode_rank_fails_requests_cleanly(llama_dir):
    import ray

    prompts = prompts_of([50, 60, 70], seed=8)
    with running_server(_config(llama_dir, 1, 2)) as address:

        def call(p):
            try:
                return stream_ids(address, p, max_tokens=400, ignore_eos=True)[0]
            except grpc.RpcError as err:
                return err.code().name

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(call, p) for p in prompts]
            time.sleep(2.0)
            ray.kill(ray.get_actor("magicserve-decode-0-rank1", namespace="magicserve"), no_restart=True)
            outcomes = [f.result(timeout=120) for f in futures]
    # the only decode instance lost a rank: every request still streaming is told so, none hangs
    assert all(out == "UNAVAILABLE" or len(out) == 400 for out in outcomes), outcomes
    assert "UNAVAILABLE" in outcomes
