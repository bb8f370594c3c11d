"""Load-aware disaggregation on plain objects: the router's decision (``controller/load_aware.py``) and the decode
worker's budget of local-prefill tokens per step (``decode_worker/prefill_budget.py``)."""

from __future__ import annotations

import math

import pytest

from controller.config import ConfigError, load_config
from controller.load_aware import (BACKLOG, LATE, MEETS_SLO, NO_SLACK, OFF, UNMEASURED, DecodeOption,
                                   LoadAwarePolicy, LoadAwareState, PrefillRate, decide, prefill_ttft_s)
from decode_worker.prefill_budget import (MIN_PACE_STEPS, PACE_HORIZON_TOKENS, PROBE_TOKENS, RATE_WINDOW_S, Pace,
                                         PrefillBudget, arrival_limit_s, pace_limit_s)

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


def test_a_prompt_past_the_slo_wherever_it_goes_is_late_where_it_comes_soonest():
    policy = LoadAwarePolicy(enabled=True, ttft_s=1.0, late_s=2.0)  # target 1 s, SLO 2 s
    predicted = prefill_ttft_s(3000, 300, rate(0.001))  # 3.3 s behind the prompts that are not late: past the SLO
    options = [DecodeOption("d0", 300, 0, 0.0), DecodeOption("d1", 300, 0, 50.0)]  # no slack; 6 s
    prefill = decide(policy, predicted, options)  # the prefill instance's late lane, behind nothing late: 3.3 s
    assert (prefill.decode, prefill.reason, prefill.late, prefill.decode_ttft_s) == (None, LATE, True,
                                                                                    pytest.approx(6.0))
    behind_late = prefill_ttft_s(8000, 300, rate(0.001))  # 8.3 s behind every queued prompt, the late ones too
    decode = decide(policy, predicted, options, behind_late)
    assert (decode.decode, decode.reason, decode.late) == ("d1", LATE, True)
    sooner_but_late = decide(policy, predicted, [DecodeOption("d0", 300, 0, 120.0)])  # 2.5 s: sooner, still past
    assert (sooner_but_late.decode, sooner_but_late.reason) == ("d0", LATE)
    in_time = decide(policy, predicted, [DecodeOption("d0", 300, 0, 200.0)])  # 1.5 s: within the SLO, not late
    assert (in_time.decode, in_time.reason, in_time.late) == ("d0", BACKLOG, False)
    # within the SLO at the prefill pool (past the target only): where it is sooner, as without the lane
    near = prefill_ttft_s(1500, 300, rate(0.001))  # 1.8 s
    assert decide(policy, near, [DecodeOption("d0", 300, 0, 50.0)]).reason == NO_SLACK
    # no decode instance computes prompts now: the prefill instance's late lane
    no_slack = decide(policy, predicted, [DecodeOption("d0", 300, 0, 0.0)], behind_late)
    assert (no_slack.decode, no_slack.reason, no_slack.decode_ttft_s) == (None, LATE, None)
    assert decide(policy, predicted, []).late
    assert decide(POLICY, predicted, options[1:]).reason == NO_SLACK  # no lane: late_s None


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
    assert cfg.load_aware.policy(cfg.slo) == LoadAwarePolicy(True, 1.5, 3.0)
    off = load_config(overrides={"slo": {"ttft_ms": 3000}, "load_aware": {"late_lane": False}})
    assert off.load_aware.policy(off.slo).late_s is None
    assert cfg.decode.prefill_tpot_slo_ms == 25
    for bad, field in (({"slo_margin": 0}, "load_aware.slo_margin"), ({"slo_margin": 1.5}, "load_aware.slo_margin"),
                       ({"enabled": "yes"}, "load_aware.enabled"), ({"late_lane": 1}, "load_aware.late_lane")):
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
    """The chunk rides in the decode pass, which pays the per-pass cost: only its per-token cost counts."""
    b = measured_budget(0.1)
    b.observe_step(0.02)  # the decode pass 20 ms of the 100 ms a step may take (one token each at the least)
    n = b.tokens(0, decoding=True)
    assert 780 <= n <= 800  # 80 ms / 0.1 ms per token = 800; the 2 ms a pass of its own adds is not paid
    assert b.fused_s(0, n) <= b.slack_s() < b.fused_s(0, n + 1)
    deep = b.tokens(2000, decoding=True)  # deeper into a prompt, each position attends to more
    assert deep < n and b.fused_s(2000, deep) <= b.slack_s() < b.fused_s(2000, deep + 1)
    assert b.fused_s(0, n) < b.prefill_s(0, n)
    assert b.tokens_per_s(0, decoding=True) == pytest.approx(n / (b.fused_s(0, n) + 0.02))
    assert b.tokens_per_s(0, decoding=False) == pytest.approx(1024 / b.prefill_s(0, 1024))  # a pass of its own


def test_fused_chunks_slower_than_the_fit_shrink_the_chunk():
    """The chunks add twice what the fit predicts to the decode pass (a contended host, a context deeper than it
    saw): the prediction follows within a few steps, and the chunk halves."""
    b = measured_budget(0.1)
    b.observe_step(0.02)
    before = b.tokens(0, decoding=True)
    for _ in range(20):
        b.observe_fused([(0, 256)], 2 * 1e-4 * 256)
    assert b.fused_s(0, 256) == pytest.approx(2 * 1e-4 * 256, rel=0.1)
    assert b.tokens(0, decoding=True) == pytest.approx(before / 2, rel=0.15)
    for _ in range(20):  # passes of their own follow their own measurements
        b.observe_prefill(0, 256, 2 * (0.002 + 1e-4 * 256))
    assert b.prefill_s(0, 256) == pytest.approx(2 * (0.002 + 1e-4 * 256), rel=0.1)


def test_a_long_first_gap_holds_the_chunks_back_until_the_next_tokens_make_up_for_it():
    """A request's TPOT counts its first gap: one that arrived 300 ms after its first token (at a 40 ms target)
    leaves the step less than the target, over its next PACE_HORIZON_TOKENS tokens."""
    target, decode = 0.04, 0.01
    late = Pace(since_first_s=0.3, tokens_since_first=0, remaining=500)
    limit = pace_limit_s([late], target, decode)
    assert limit == pytest.approx((target * PACE_HORIZON_TOKENS - 0.3) / PACE_HORIZON_TOKENS)
    assert decode < limit < target
    # its steps at that limit bring its mean to the target over the horizon
    assert (0.3 + PACE_HORIZON_TOKENS * limit) / PACE_HORIZON_TOKENS == pytest.approx(target)
    on_time = Pace(since_first_s=0.2, tokens_since_first=10, remaining=100)  # 20 ms a token so far
    assert pace_limit_s([on_time], target, decode) > target  # ahead of the target: it affords a longer step
    assert pace_limit_s([late, on_time], target, decode) == pytest.approx(limit)
    b = measured_budget(target)
    b.observe_step(decode)
    # without a pace, one token a step at the target
    assert b.tokens(0, True, [late]) < b.tokens(0, True) < b.tokens(0, True, [on_time])
    fresh = Pace(since_first_s=0.0, tokens_since_first=0, remaining=500)  # its first token's time unknown
    assert b.tokens(0, True, [fresh]) == b.tokens(0, True)


def test_speculative_steps_that_give_several_tokens_afford_a_longer_step():
    """A sequence whose steps here gave it 3 tokens each takes a third of the steps over the horizon, so each
    may be three times as long at the same mean time per token; a run of rejected drafts shows in its pace
    (tokens behind the time) and pulls the bound back; too few steps measured count as one token a step."""
    target, decode = 0.05, 0.04
    on_pace = dict(since_first_s=0.5, tokens_since_first=10, remaining=500)
    one = Pace.measured(**on_pace, steps_here=20, tokens_here=20)
    three = Pace.measured(**on_pace, steps_here=20, tokens_here=60)
    assert three.tokens_per_step == 3.0 and one.tokens_per_step == 1.0
    assert pace_limit_s([three], target, decode) == pytest.approx(3 * pace_limit_s([one], target, decode))
    assert pace_limit_s([three], target, decode) == pytest.approx(3 * target)  # on pace: 3 tokens' worth
    assert Pace.measured(**on_pace, steps_here=MIN_PACE_STEPS - 1, tokens_here=30).tokens_per_step == 1.0
    # the steps ran long: 10 tokens in 1.6 s (160 ms a token) leave less than one token's worth per step
    behind = Pace.measured(since_first_s=1.6, tokens_since_first=10, remaining=500, steps_here=20, tokens_here=60)
    assert decode < pace_limit_s([behind], target, decode) < target
    b = measured_budget(target)
    b.observe_step(decode)  # 10 ms of slack at one token a step
    assert b.tokens(0, True, [one]) == b.tokens(0, True) < b.tokens(0, True, [three])
    assert b.tokens(0, True, [three, one]) == b.tokens(0, True, [one])  # the slowest sequence bounds the step
    assert b.tokens(0, True, [behind]) < b.tokens(0, True)


def test_a_sequence_past_saving_does_not_hold_the_others_back_nor_falls_further_behind():
    """Two tokens left and a first gap of a second: even pure decode steps cannot bring it within the target.
    It does not hold the step to pure decoding, but each step stays within the target per token it gives."""
    lost = Pace(since_first_s=1.0, tokens_since_first=1, remaining=2)
    assert pace_limit_s([lost], 0.04, 0.01) == pytest.approx(0.04)
    lost_fast = Pace.measured(1.0, 1, 2, steps_here=MIN_PACE_STEPS, tokens_here=3 * MIN_PACE_STEPS)
    assert pace_limit_s([lost_fast], 0.04, 0.01) == pytest.approx(3 * 0.04)  # three tokens a step
    ahead = Pace(since_first_s=0.1, tokens_since_first=10, remaining=500)  # 10 ms a token so far
    assert pace_limit_s([ahead], 0.04, 0.01) > 0.04
    assert pace_limit_s([ahead, lost], 0.04, 0.01) == pytest.approx(0.04)  # the lost one bounds the step
    tight = Pace(since_first_s=0.0595, tokens_since_first=0, remaining=2)  # just within reach: holds
    assert pace_limit_s([tight], 0.04, 0.01) == pytest.approx((0.04 * 2 - 0.0595) / 2)


def test_a_request_whose_kv_arrives_holds_the_steps_to_what_its_few_tokens_afford():
    """Sequences ahead of their pace afford a long step; a request whose KV is arriving has its first token
    streamed and nothing banked: it waits out the step under way and its own first, so the steps are held so
    that two of them and its next tokens at ``decode_s`` fit its target. Four tokens to come bound the step hard,
    many hardly; one output token (nothing to come) not at all."""
    target, decode = 0.05, 0.03
    assert arrival_limit_s([3], target, decode) == pytest.approx((3 * target - 2 * decode) / 2)  # 45 ms
    many = arrival_limit_s([500], target, decode)
    assert many == pytest.approx((PACE_HORIZON_TOKENS * target - (PACE_HORIZON_TOKENS - 1) * decode) / 2)
    assert many > 4 * target
    assert arrival_limit_s([500, 3], target, decode) == arrival_limit_s([3], target, decode)
    assert arrival_limit_s([0], target, decode) == math.inf == arrival_limit_s([], target, decode)
    # its first gap (two steps at the limit) and two decode steps: a mean of the target over its three gaps
    assert (2 * arrival_limit_s([3], target, decode) + 2 * decode) / 3 == pytest.approx(target)
    b = measured_budget(target, per_token_s=1e-3)
    b.observe_step(decode)
    ahead = Pace(since_first_s=0.1, tokens_since_first=400, remaining=500)  # 0.25 ms a token: a long step
    long_step = b.tokens(0, True, [ahead])
    assert long_step > b.tokens(0, True, [ahead], arriving=[500]) > b.tokens(0, True, [ahead], arriving=[3]) > 0
    assert b.fused_s(0, b.tokens(0, True, [ahead], arriving=[3])) <= arrival_limit_s([3], target, decode) - decode
    assert b.tokens(0, True, [ahead], arriving=[0]) == long_step


def test_a_high_quantile_of_the_recent_errors_sizes_the_chunk():
    """On a shared host the fused chunks' error swings from step to step: one in eight ran twice as long as
    predicted. The correction is the 90th percentile of the recent ratios (2x), not their mean, so the chunk is
    sized for the slow steps rather than overrunning the bound on each of them."""
    b = measured_budget(0.1)
    b.observe_step(0.02)
    for i in range(32):
        b.observe_fused([(0, 256)], (2.0 if i % 8 == 7 else 1.0) * 1e-4 * 256)
    assert b.fused_correction == pytest.approx(2.0)
    assert b.fused_s(0, 256) == pytest.approx(2 * 1e-4 * 256)
    for _ in range(32):  # the slow steps age out of the window
        b.observe_fused([(0, 256)], 1e-4 * 256)
    assert b.fused_correction == pytest.approx(1.0)


def test_a_step_of_several_chunks_sizes_each_at_its_own_depth():
    """The head of the queue is a short prompt at its start, the next one deep into a long prompt, where each
    position costs more: the step's chunks together stay within the slack (the second sized at its own
    start), where tokens counted at the head's start would overrun it."""
    from collections import deque
    from types import SimpleNamespace

    from decode_worker.prefill_queue import PrefillQueue

    b = PrefillBudget(4096, 0.1)
    for start in (0, 2048, 8192):  # an attention term: deeper positions attend to more
        for n in (64, 256, 1024):
            b.observe_prefill(start, n, 0.002 + 1e-5 * n + 2e-8 * (n * start + n * (n + 1) // 2))
    b.observe_step(0.02)

    def held(computed, prompt):
        return SimpleNamespace(seq=SimpleNamespace(num_computed=computed, num_prompt=prompt), late=False)

    requests = {"short": held(0, 100), "deep": held(6000, 8000)}
    queue = PrefillQueue(None, requests, deque(["short", "deep"]), None, b, None, None)
    chunks = queue.plan(True)
    assert [(c.start, c.end) for c in chunks][0] == (0, 100)
    spent = sum(b.fused_s(c.start, c.end - c.start) for c in chunks)
    assert spent <= b.slack_s() + 1e-9
    head_tokens = b.tokens(0, True)
    assert chunks[1].end - chunks[1].start < head_tokens - 100  # what the head's start would have given it
    assert b.fused_s(0, 100) + b.fused_s(6000, head_tokens - 100) > b.slack_s()


def test_the_local_queue_computes_late_prompts_after_every_other():
    """Fewest remaining tokens first, but a late prompt (``LocalPrefill.late``) after every prompt that is not,
    however short it is; the late among themselves fewest remaining first too."""
    from collections import deque
    from types import SimpleNamespace

    from decode_worker.prefill_queue import PrefillQueue

    def held(prompt, late=False):
        return SimpleNamespace(seq=SimpleNamespace(num_computed=0, num_prompt=prompt), late=late)

    requests = {"late_short": held(50, late=True), "late_long": held(900, late=True), "long": held(2000),
                "short": held(200)}
    queue = PrefillQueue(None, requests, deque(requests), None, PrefillBudget(1000, 0.1), None, None)
    chunks = queue.plan(False)  # nothing decodes: the whole chunk, in queue order
    assert list(queue.order) == ["short", "long", "late_short", "late_long"]
    assert [(c.held, c.start, c.end) for c in chunks] == [(requests["short"], 0, 200), (requests["long"], 0, 800)]


def test_the_reported_rate_counts_the_steps_held_back():
    """The rate the router plans with is what recent steps did (or could have done), not one step's slack:
    steps held back by a late sequence's pace lower it; they age out of the window."""
    b = measured_budget(0.1)
    b.observe_step(0.02)
    ideal = b.tokens_per_s(0, True, now=0.0)  # nothing sampled yet: one step's slack
    # just within reach at pure decode steps (0.1 * (10 + 32) - 32 * 0.02 = 3.56 s): it holds every chunk back
    late = Pace(since_first_s=3.559, tokens_since_first=10, remaining=500)
    for i in range(10):
        b.observe_rate(0.1 * i, 0.02, None, paces=[late])  # nothing queued: what the steps could have done
    assert b.tokens(0, True, [late]) == 0 and b.tokens_per_s(0, True, now=1.0) == 0.0
    for i in range(10):  # queued steps that prefilled 400 tokens in 40 ms beside 20 ms of decoding
        b.observe_rate(1.0 + 0.06 * i, 0.02, 400, 0.04)
    assert b.tokens_per_s(0, True, now=1.6) == pytest.approx(4000 / (10 * 0.02 + 10 * 0.06))  # half held back
    assert b.tokens_per_s(0, True, now=0.95 + RATE_WINDOW_S) == pytest.approx(400 / 0.06)  # those aged out
    assert b.tokens_per_s(0, True, now=100.0) == pytest.approx(ideal)  # the window emptied


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
