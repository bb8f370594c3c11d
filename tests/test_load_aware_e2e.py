"""Load-aware disaggregation end to end on a real local Ray cluster: under a prefill backlog, prompts are
prefilled on the decode instance beside its decoding batch, with the reference engine's tokens, and the
decisions show in ``magicserve status``."""

from __future__ import annotations

import concurrent.futures

import pytest

from frontend.client import Client
from modeling.sampling import SamplingParams
from tests.serving import e2e_config, prompts_of, running_server, stream_ids


@pytest.mark.parametrize("late_lane", [False, True])
def test_a_prefill_backlog_is_prefilled_on_the_decode_instance(llama_dir, reference, late_lane):
    """A TTFT target no queue meets (1 ms) and a TPOT target every step meets (60 s): once the prefill instance
    has measured its speed, a burst of long prompts is split between it and the decode instance; every request
    has the reference's tokens (float32, speculation on). With the late lane, every prompt is late wherever it
    goes (past 1 ms): each is computed in the late lane of the instance predicted sooner, some on the decode
    instance."""
    cfg = e2e_config(
        llama_dir,
        prefill={"kv_cache_tokens": 4096, "attention_backend": "torch", "token_budget": 64},
        decode={"kv_cache_tokens": 8192, "attention_backend": "torch",
                "speculation": {"k_policy": "fixed", "k": 3, "budget": 32, "sink_tokens": 4}},
        slo={"ttft_ms": 1, "tpot_ms": 60_000},
        load_aware={"late_lane": late_lane},
    )
    warm, *burst = prompts_of([300, 500, 480, 460, 440, 420, 400], seed=41)
    greedy = dict(max_tokens=16, ignore_eos=True)
    with running_server(cfg) as address:
        first, _ = stream_ids(address, warm, **greedy)  # the prefill instance measures its speed
        with concurrent.futures.ThreadPoolExecutor(len(burst)) as pool:
            outs = list(pool.map(lambda p: stream_ids(address, p, **greedy)[0], burst))
        with Client(address) as c:
            status = c.status()
    expected = reference.generate([warm, *burst], SamplingParams(**greedy))
    assert [first, *outs] == [c.token_ids for c in expected]
    counts = {(p.prefilled_on, p.reason): p.count for p in status.load_aware_placements}
    assert counts.get(("prefill", "unmeasured"), 0) >= 1  # the first prompt: nothing measured yet
    assert counts.get(("decode", "prefill_late" if late_lane else "prefill_backlog"), 0) >= 1
    assert not late_lane or not {reason for _, reason in counts} & {"prefill_backlog", "no_decode_slack"}
    assert sum(counts.values()) == 1 + len(burst)
