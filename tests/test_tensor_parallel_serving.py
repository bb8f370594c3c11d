"""Tensor-parallel pools served end to end: a real local Ray cluster places each instance's ranks in its
placement-group bundles, real gRPC over localhost, KV moved rank to rank over gloo. Greedy output equals
the single-process reference engine; a dead or hung rank fails its instance's requests cleanly (never a
hang) and the instance restarts as a whole."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import time

import grpc
import pytest

from controller.config import ConfigError, parse_config
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.sampling import SamplingParams
from tests.serving import e2e_config, prompts_of, running_server, stream_ids, wait_all_alive, wait_all_free

PROMPTS_LENGTHS = [5, 40, 130, 21]


def _config(path: str, prefill_tp: int, decode_tp: int):
    return e2e_config(
        path,
        ray={"num_cpus": 6, "num_gpus": 0},
        prefill={"tensor_parallel": prefill_tp, "kv_cache_tokens": 4096, "attention_backend": "torch",
                 "token_budget": 64},
        decode={"tensor_parallel": decode_tp, "kv_cache_tokens": 4096, "attention_backend": "torch",
                "speculation": {"k_policy": "fixed", "k": 3, "budget": 32, "sink_tokens": 4}},
        kv_transfer={"timeout_s": 10},
        server={"port": 0, "http_port": None},
    )


@pytest.mark.parametrize("value", [0, -1.5])
def test_bad_collective_timeout_is_a_config_error_naming_the_field(value):
    with pytest.raises(ConfigError) as info:
        parse_config({"model": {"path": "m"}, "decode": {"collective_timeout_s": value}})
    assert str(info.value).startswith(f"decode.collective_timeout_s: must be > 0, got {value}"), str(info.value)


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
        # next turns from the KV the decode instance kept: a short one prefilled there (every rank computes
        # its heads), a long one transferred without the blocks it holds (each rank skips its heads of them)
        short, long = prompts_of([20, 300], seed=8)
        for new in (short, long):
            turn = prompts[2] + expected[2] + new
            want = reference.generate([turn], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
            assert stream_ids(address, turn, max_tokens=30, ignore_eos=True)[0] == want
        assert wait_all_free(address)  # the drivers' pools; followers mirror them


def _stream_or_code(address, prompt, max_tokens):
    try:
        return stream_ids(address, prompt, max_tokens=max_tokens, ignore_eos=True)[0]
    except grpc.RpcError as err:
        return err.code().name


def _fault_during_streams(address, prompts, fault) -> list:
    """Stream ``prompts`` (400 tokens each), apply ``fault()`` mid-stream, return each outcome."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_stream_or_code, address, p, 400) for p in prompts]
        time.sleep(2.0)
        fault()
        return [f.result(timeout=120) for f in futures]


def test_dead_or_hung_rank_restarts_the_instance_whole_and_its_requests_resume(llama_dir):
    import ray

    cfg = _config(llama_dir, 2, 2)
    cfg = dataclasses.replace(cfg, prefill=dataclasses.replace(cfg.prefill, collective_timeout_s=5.0),
                              decode=dataclasses.replace(cfg.decode, collective_timeout_s=5.0))
    prompts = prompts_of([50, 60, 70], seed=8)
    reference = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=16384, attention_backend="torch"))
    expected = [c.token_ids for c in reference.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))]
    whole = [c.token_ids for c in reference.generate(prompts, SamplingParams(max_tokens=400, ignore_eos=True))]

    def serves_the_reference(address) -> bool:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: _stream_or_code(address, p, 30), prompts)) == expected

    def actor(name):
        return ray.get_actor(name, namespace="magicserve")

    with running_server(cfg) as address:
        # a decode rank dies: every rank of its instance is replaced, its group and KV channels re-form, and
        # the streams it was serving resume there from the tokens they had streamed: the reference output
        kill = lambda: ray.kill(actor("magicserve-decode-0-rank1"), no_restart=True)  # noqa: E731
        outcomes = _fault_during_streams(address, prompts, kill)
        assert outcomes == whole
        assert wait_all_alive(address)
        assert serves_the_reference(address)
        assert wait_all_free(address)

        # a decode rank hangs (stopped, never answers): bounded by collective_timeout_s, then the same
        pid = ray.get(actor("magicserve-decode-0-rank1-g1").pid.remote())
        t0 = time.monotonic()
        outcomes = _fault_during_streams(address, prompts, lambda: os.kill(pid, signal.SIGSTOP))
        assert outcomes == whole
        assert time.monotonic() - t0 < 90
        assert wait_all_alive(address)
        assert serves_the_reference(address)

        # a prefill rank dies while the instance is idle: found by the rank check, replaced before it is needed
        ray.kill(actor("magicserve-prefill-0-rank1"), no_restart=True)
        time.sleep(3.0)
        assert wait_all_alive(address)
        assert ray.get(actor("magicserve-prefill-0-rank1-g1").ping.remote())  # replaced, not merely alive
        assert serves_the_reference(address)
        blocks = wait_all_free(address)  # the drivers' pools; the replaced followers held no blocks of their own
        assert all(free == total for free, total in blocks.values()), blocks
