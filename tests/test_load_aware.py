"""Load-aware disaggregation on plain objects: the router's decision (``controller/load_aware.py``) and the decode
worker's budget of local-prefill tokens per step (``decode_worker/prefill_budget.py``)."""

from __future__ import annotations

import pytest

from controller.config import ConfigError, load_config
from controller.load_aware import (BACKLOG, MEETS_SLO, NO_SLACK, OFF, UNMEASURED, DecodeOption, LoadAwarePolicy,
                                   LoadAwareState, PrefillRate, decide, prefill_ttft_s)
from decode_worker.prefill_budget import PROBE_TOKENS, PrefillBudget

POLICY = LoadAwarePolicy(enabled=True, ttft_s=1.0)


def rate(seconds_per_token: float) -> PrefillRate:
    r = PrefillRate()
    r.observe(1000, 1000 * seconds_per_token)
    return r


def test_the_prefill_rate_weighs_recent_steps_most():
    r = PrefillRate()
    assert r.seconds_per_token is None
    r.observe(100, 1.0)
    assert r.seconds_per_token == pytest.approx(0.01)
    for _ in range(30):  # the instance got 4x slower (a longer context, a contended host)
        r.observe(100, 4.0)
    assert r.seconds_per_token == pytest.approx(0.04, rel=0.01)
    r.observe(0, 0.0)  # a step that computed nothing leaves it unchanged
    assert r.seconds_per_token == pytest.approx(0.04, rel=0.01)


def test_the_prefill_pool_keeps_prompts_it_serves_within_the_target():
    # 500 tokens queued + 300 of the prompt at 1 ms each: 0.8 s, within 1 s
    predicted = prefill_ttft_s(500, 300, rate(0.001))
    assert predicted == pytest.approx(0.8)
    d = decide(POLICY, predicted, [DecodeOption("d0", 300, 0, 10_000.0)])
    assert (d.decode, d.reason, d.prefill_ttft_s) == (None, MEETS_SLO, pytest.approx(0.8))


def test_a_backlog_sends_the_prompt_to_the_decode_instance_that_is_soonest():
    predicted = prefill_ttft_s(5000, 300, rate(0.001))  # 5.3 s
    options = [DecodeOption("d0", 300, 2000, 1000.0),  # 2.3 s
               DecodeOption("d1", 100, 0, 500.0),  # 0.2 s (it holds most of the prompt cached)
               DecodeOption("d2", 300, 0, 0.0)]  # no slack: never
    d = decide(POLICY, predicted, options)
    assert (d.decode, d.reason) == ("d1", BACKLOG)
    assert d.decode_ttft_s == pytest.approx(0.2) and d.prefill_ttft_s == pytest.approx(5.3)


def test_no_decode_instance_takes_a_prompt_it_would_serve_later_or_has_no_slack_for():
    predicted = prefill_ttft_s(3000, 300, rate(0.001))  # 3.3 s: misses the target
    slower = decide(POLICY, predicted, [DecodeOption("d0", 300, 0, 50.0)])  # 6 s
    assert (slower.decode, slower.reason, slower.decode_ttft_s) == (None, NO_SLACK, pytest.approx(6.0))
    no_slack = decide(POLICY, predicted, [DecodeOption("d0", 300, 0, 0.0)])
    assert (no_slack.decode, no_slack.reason, no_slack.decode_ttft_s) == (None, NO_SLACK, None)
    assert decide(POLICY, predicted, []).reason == NO_SLACK


def test_unmeasured_or_off_goes_to_the_prefill_pool():
    options = [DecodeOption("d0", 300, 0, 10_000.0)]
    assert prefill_ttft_s(100, 300, None) is None and prefill_ttft_s(100, 300, PrefillRate()) is None
    assert decide(POLICY, None, options).reason == UNMEASURED
    assert decide(LoadAwarePolicy(enabled=False), 100.0, options).reason == OFF


def test_local_prefills_count_queued_until_the_instance_reports_them():
    state = LoadAwareState()
    state.placing("d0", "a", 300)
    state.placing("d0", "b", 200)
    state.placing("d0", "c", 100)
    live = {"a", "b", "c"}
    assert state.placed_since_report("d0", frozenset(), live) == 600
    assert state.placed_since_report("d0", frozenset({"a"}), live) == 300  # its report counts "a" now
    live.discard("c")  # cancelled before any report counted it
    assert state.placed_since_report("d0", frozenset(), live) == 200
    state.forget("d0", "b")  # refused
    assert state.placed_since_report("d0", frozenset(), live) == 0
    assert state.placed_local["d0"] == {}
    state.count(decide(POLICY, 5.0, [DecodeOption("d0", 10, 0, 1000.0)]))
    state.count(decide(POLICY, 0.1, []))
    assert state.counts == {("decode", BACKLOG): 1, ("prefill", MEETS_SLO): 1}


def test_the_config_sets_the_targets_from_the_slo_section():
    cfg = load_config(overrides={"slo": {"ttft_ms": 3000, "tpot_ms": 50}, "load_aware": {"slo_margin": 0.5}})
    assert cfg.load_aware.policy(cfg.slo) == LoadAwarePolicy(True, 1.5)
    assert cfg.decode.prefill_tpot_slo_ms == 25
    for bad, field in (({"slo_margin": 0}, "load_aware.slo_margin"), ({"slo_margin": 1.5}, "load_aware.slo_margin"),
                       ({"enabled": "yes"}, "load_aware.enabled")):
        with pytest.raises(ConfigError, match=field):
            load_config(overrides={"load_aware": bad})
    with pytest.raises(ConfigError, match="prefill_tpot_slo_ms"):  # set from slo.tpot_ms, not by hand
        load_config(overrides={"decode": {"prefill_tpot_slo_ms": 10}})


# -- the decode worker's budget ------------------------------------------------------------------------------


def measured_budget(slo_s: float | None, per_token_s: float = 1e-4, overhead_s: float = 0.002,
                    chunk: int = 1024) -> PrefillBudget:
    """A budget whose prefill passes cost ``overhead_s + per_token_s * n`` (measured at three sizes)."""
    b = PrefillBudget(chunk, slo_s)
    for n in (64, 256, 1024):
        b.observe_prefill(0, n, overhead_s + per_token_s * n)
    return b


def test_with_nothing_decoding_or_no_slo_a_step_computes_the_whole_chunk():
    assert PrefillBudget(1024, None).tokens(0, decoding=True) == 1024
    b = measured_budget(0.05)
    b.observe_step(0.049)
    assert b.tokens(0, decoding=False) == 1024


def test_a_step_prefills_what_fits_in_the_decoding_sequences_tpot_slack():
    b = measured_budget(0.1)
    b.observe_step(0.02)  # the decode pass 20 ms of the 100 ms a step may take (one token each at the least)
    n = b.tokens(0, decoding=True)
    assert 700 <= n <= 800  # (80 ms - 2 ms) / 0.1 ms per token = 780
    assert b.prefill_s(0, n) <= b.slack_s() < b.prefill_s(0, n + 1)
    assert b.tokens_per_s(0, decoding=True) == pytest.approx(n / (b.prefill_s(0, n) + 0.02))


def test_prefill_passes_slower_than_the_fit_shrink_the_chunk():
    """The passes take twice what the fit predicts (a contended host, a context deeper than it saw): the
    prediction follows within a few passes, and the chunk halves."""
    b = measured_budget(0.1)
    b.observe_step(0.02)
    before = b.tokens(0, decoding=True)
    for _ in range(20):
        b.observe_prefill(0, 256, 2 * (0.002 + 1e-4 * 256))
    assert b.prefill_s(0, 256) == pytest.approx(2 * (0.002 + 1e-4 * 256), rel=0.1)
    assert b.tokens(0, decoding=True) == pytest.approx(before / 2, rel=0.15)


def test_no_slack_prefills_nothing_while_sequences_decode():
    b = measured_budget(0.05)
    b.observe_step(0.06)  # the decode pass alone exceeds the SLO
    assert b.tokens(0, decoding=True) == 0 and b.tokens_per_s(0, decoding=True) == 0.0
    assert b.tokens(0, decoding=False) == 1024  # once the batch is empty, the prompt goes on


def test_unmeasured_chunks_grow_from_a_probe():
    b = PrefillBudget(1024, 10.0)  # a generous SLO, nothing measured: a probe, then twice the largest measured
    assert b.tokens(0, decoding=True) == 0  # the decode pass not measured yet: its slack is unknown
    b.observe_step(0.01)
    assert b.tokens(0, decoding=True) == PROBE_TOKENS
    assert b.tokens_per_s(0, decoding=True) == 0.0  # no rate to promise before a pass is measured
    sizes = []
    for _ in range(6):
        n = b.tokens(0, decoding=True)
        sizes.append(n)
        b.observe_prefill(0, n, 1e-4 * n)
    assert sizes == [64, 128, 256, 512, 1024, 1024]
