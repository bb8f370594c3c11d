"""The global rescheduling policy end to end (``migration.enabled``): a real local Ray cluster, real gRPC, live
migration over gloo, started by the router's own policy rounds."""

from __future__ import annotations

import pytest

from frontend.client import Client
from modeling.sampling import SamplingParams
from tests.serving import Stream, e2e_config, prompts_of, running_server


def test_rescheduling_policy_moves_load_off_a_crowded_instance(llama_dir, reference):
    """``migration.enabled``: with decode-1 drained, two long requests crowd decode-0; once decode-1 is back
    in service the policy's next round moves one of them there, and both stream the reference's tokens."""
    cfg = e2e_config(
        llama_dir,
        ray={"num_cpus": 6, "num_gpus": 0},
        prefill={"kv_cache_tokens": 4096, "attention_backend": "torch", "token_budget": 256},
        decode={"instances": 2, "kv_cache_tokens": 1024, "attention_backend": "torch",
                "speculation": {"k_policy": "fixed", "k": 2, "budget": 32, "sink_tokens": 4}},
        kv_transfer={"timeout_s": 5},
        migration={"enabled": True, "interval_s": 0.2, "cooldown_s": 60},
    )
    prompts = prompts_of([400, 400], seed=25)
    params = dict(max_tokens=100, ignore_eos=True)
    want = [c.token_ids for c in reference.generate(prompts, SamplingParams(**params))]
    with running_server(cfg) as address, Client(address) as c:
        assert c.drain("decode-1", timeout_s=5).drained  # nothing there: drained at once, out of placement
        streams = [Stream(address, p, f"crowd-{i}", **params) for i, p in enumerate(prompts)]
        for s in streams:
            s.wait_tokens(3)
        assert {i.name: i.running for i in c.status().instances}["decode-0"] == 2
        c.drain("decode-1", undo=True)
        assert [s.join() for s in streams] == want
        assert c.status().migrations_committed >= 1
