"""Prefill ahead end to end on a real local Ray cluster: a prompt that waits for room on a full decode instance is
computed ahead by the idle prefill instance, which then computes only its last block once the decode instance has
room; both requests' tokens equal the reference engine's, and the prompt counts as found only what was cached
before it arrived."""

from __future__ import annotations

import concurrent.futures

import pytest

from frontend.client import Client
from modeling.sampling import SamplingParams
from tests.serving import e2e_config, prompts_of, running_server, stream_ids

BLOCK = 16


def _prefill_chunks(address) -> list[list[int]]:
    with Client(address) as c:
        drained = c.drain_pass_log()
    return [chunk for inst in drained if inst["role"] == "prefill" for r in inst["records"]
            for chunk in r["shape"]["chunks"]]


@pytest.mark.parametrize("ahead", [True, False])
def test_a_prompt_waiting_for_decode_room_is_computed_ahead(llama_dir, reference, ahead):
    """``ahead`` False (``prefix_caching.prefill_ahead: false``): the prompt waits whole."""
    cfg = e2e_config(
        llama_dir,
        prefill={"kv_cache_tokens": 1024, "attention_backend": "torch", "token_budget": 128},
        decode={"kv_cache_tokens": 640, "attention_backend": "torch",
                "speculation": {"k_policy": "fixed", "k": 3, "budget": 32, "sink_tokens": 4}},
        kv_tiers={"host_memory_mb": 0, "disk_mb": 0},
        server={"port": 0, "http_port": None, "pass_log_rpc": True},
        prefix_caching={"prefill_ahead": ahead},
    )
    long_running, waiting = prompts_of([400, 300], seed=41)
    params = [dict(max_tokens=180, ignore_eos=True), dict(max_tokens=12, ignore_eos=True)]
    with running_server(cfg) as address:
        _prefill_chunks(address)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            with Client(address) as c:  # the first holds most of the decode pool until its 180 tokens are out
                stream = c.generate_stream(long_running, **params[0])
                first = list(next(stream).token_ids)
                second = pool.submit(stream_ids, address, waiting, **params[1])
                first += [t for chunk in stream for t in chunk.token_ids]
            second_ids, second_final = second.result(timeout=120)
        chunks = _prefill_chunks(address)
    expected = reference.generate([long_running, waiting], [SamplingParams(**p) for p in params])
    assert [first, second_ids] == [c.token_ids for c in expected]
    if not ahead:
        assert chunks[-3:] == [[0, 128], [128, 128], [256, 44]] and sum(n for _, n in chunks) == 700
        return
    ahead_end = (len(waiting) - 1) // BLOCK * BLOCK + 1  # the pass: the full blocks a lookup covers, and a token
    assert sum(n for _, n in chunks) == len(long_running) + ahead_end + len(waiting) - (ahead_end - 1)
    assert chunks[-1] == [ahead_end - 1, len(waiting) - (ahead_end - 1)]  # the request itself: its last block
    assert second_final.usage["cached_prompt_tokens"] == 0  # computed for it ahead, not found
