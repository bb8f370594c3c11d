"""The load-aware benchmark's workloads and TTFT floor (``benchmarks/load_aware.py``), on plain rows."""

from __future__ import annotations

import argparse

from benchmarks.load_aware import PROFILE, distinct_rows, floor_summary, resize_text, ttft_floors
from planner.profile import Profile, prefill_features


def _args(**edge) -> argparse.Namespace:
    values = dict(edge_requests=10, edge_min=128, edge_max=256, edge_output=8, edge_span_s=5.0)
    return argparse.Namespace(seed=0, chunk=64, **{**values, **edge})


def test_distinct_prompts_arrive_evenly_share_no_block_and_keep_their_bounds():
    rows = distinct_rows(_args(), "edge")
    assert [r["timestamp"] for r in rows] == [i * 0.5 for i in range(10)]
    assert all(128 <= r["input_length"] <= 256 and r["input_length"] % 64 == 0 for r in rows)
    assert all(len(r["hash_ids"]) * 64 == r["input_length"] and r["output_length"] == 8 for r in rows)
    hashes = [h for r in rows for h in r["hash_ids"]]
    assert len(hashes) == len(set(hashes))


def test_a_prompt_whose_prefix_an_earlier_one_computed_is_floored_by_its_new_tokens_only():
    model = Profile.load(PROFILE).prefill_model(1, 1)
    first = {"input_length": 1024, "hash_ids": list(range(16))}
    again = {"input_length": 1024 + 64, "hash_ids": list(range(16)) + [99]}  # the same 1024 tokens, then 64 new
    cold, warm = ttft_floors([first, again], 64, PROFILE, 512)
    assert cold == model.predict(prefill_features([(0, 512)])) + model.predict(prefill_features([(512, 512)]))
    assert warm == model.predict(prefill_features([(1024, 64)])) < cold / 4
    summary = floor_summary([cold, warm, 5.0], 3000.0)
    assert summary["over_slo"] == 1 and summary["max_s"] == 5.0 and summary["requests"] == 3


def test_a_resize_is_worded_with_its_seconds_and_the_prompts_it_handed_back():
    switch = {"pool": "decode", "desired": 2, "switched": ["prefill-0"], "seconds": 4.74, "handed_back": 5, "error": ""}
    assert resize_text(switch) == "decode -> 2 (role change of prefill-0, 4.7 s, 5 prompts handed back)"
    grow = {"pool": "prefill", "desired": 1, "switched": [], "seconds": 30.0, "error": "RouterError: no room"}
    assert resize_text(grow) == "prefill -> 1 (30.0 s), failed: RouterError: no room"  # older records: no count
