"""A decode worker prefilling prompts beside its decoding batch (load-aware disaggregation's worker side): each
step computes only the prompt tokens that fit in the decoding sequences' TPOT slack
(``decode_worker/prefill_budget.py``), and every request's tokens are the reference engine's whichever way its
prompt was computed (float32, speculation on)."""

from __future__ import annotations

import time

import pytest

from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
from decode_worker.messages import DecodeRequest
from decode_worker.prefill_budget import PROBE_TOKENS
from decode_worker.worker import DecodeWorker
from modeling.forks import SequenceStarts, decode_starts, encode_starts
from modeling.sampling import SamplingParams
from tests.test_decode_worker import prompts_of, reference
from tests.test_prefix_cache_decode import assert_idle, drain

PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


def worker_with_slo(directory, tpot_slo_ms, drafter="self_sparse"):
    spec = SpeculationConfig(drafter=drafter, k_policy="fixed", k=3, budget=32, sink_tokens=4)
    return DecodeWorker(directory, DecodeWorkerConfig(
        dtype="float32", kv_cache_tokens=16384, attention_backend="torch", profile_on_start=False,
        prefill_chunk=512, prefill_tpot_slo_ms=tpot_slo_ms, speculation=spec))


def prefill_passes(worker) -> list[tuple[str, int]]:
    """(kind, prompt tokens) of each local-prefill chunk so far, in order: ``prefill`` in a pass of its own,
    ``mixed`` riding in a decode pass."""
    return [(r["kind"], c[1]) for r in worker.pass_log.drain() if r["kind"] in ("prefill", "mixed")
            for c in r["shape"]["chunks"]]


def prefill_chunks(worker) -> list[int]:
    """The prompt tokens of each local-prefill chunk so far, in order."""
    return [n for _, n in prefill_passes(worker)]


@pytest.mark.parametrize("drafter", ["self_sparse", "none"])
def test_prompts_prefilled_beside_decoding_sequences_give_the_reference_tokens(llama_dir, drafter):
    """A generous SLO: the long prompt's chunks grow from a probe as their cost is measured, while the short
    request decodes; both requests' tokens are the reference engine's."""
    short, long = prompts_of([40, 900], seed=11)
    worker = worker_with_slo(llama_dir, tpot_slo_ms=60_000, drafter=drafter)
    outs = {}
    for d in worker.add_local("short", short, PARAMS):
        outs.setdefault(d.request_id, []).extend(d.token_ids)
    prefill_chunks(worker)
    assert worker.add_prefill(DecodeRequest("long", tuple(long), PARAMS))
    drain(worker, outs)
    assert [outs["short"], outs["long"]] == reference(llama_dir, [short, long], PARAMS)
    passes = prefill_passes(worker)  # beside "short": each at most twice the largest pass measured before it
    assert passes[0][0] == "mixed"  # the first chunks ride in short's decode pass
    chunks = [n for _, n in passes]
    assert sum(chunks) == 900 and chunks[0] <= max(PROBE_TOKENS, 2 * len(short)) and len(chunks) >= 3
    assert all(n <= 2 * max([len(short), *chunks[:i]]) for i, n in enumerate(chunks))
    assert_idle(worker)


def test_without_slack_a_prompt_waits_for_the_decoding_batch(llama_dir):
    """An SLO no step can meet: nothing is prefilled while a sequence decodes (its TPOT is not spent on the
    prompt), and the prompt is computed whole once the batch is empty; the tokens are the reference's."""
    short, long = prompts_of([40, 700], seed=12)
    worker = worker_with_slo(llama_dir, tpot_slo_ms=0.001)
    outs = {}
    for d in worker.add_local("short", short, PARAMS):
        outs.setdefault(d.request_id, []).extend(d.token_ids)
    prefill_chunks(worker)
    assert worker.add_prefill(DecodeRequest("long", tuple(long), PARAMS))
    steps_beside = 0
    while "short" in worker.scheduler.running:
        for d in worker.step():
            outs.setdefault(d.request_id, []).extend(d.token_ids)
        steps_beside += 1
        assert worker.requests["long"].seq.num_computed == 0
    assert steps_beside > 1 and worker.request_loads().prefill_tokens_per_s == 0.0
    assert worker.request_loads().prefill_queued_tokens == 700
    drain(worker, outs)
    assert [outs["short"], outs["long"]] == reference(llama_dir, [short, long], PARAMS)
    assert prefill_chunks(worker) == [512, 700 - 512]
    assert_idle(worker)


def test_the_worker_reports_how_fast_it_would_prefill(llama_dir):
    """After the start-up profile, an idle worker reports a prefill rate (the router's prediction needs it),
    and with a request decoding a lower one that still fits the SLO."""
    worker = worker_with_slo(llama_dir, tpot_slo_ms=5_000)
    assert worker.request_loads().prefill_tokens_per_s == 0.0  # nothing measured yet
    worker.profile(batches=(1,), contexts=(256,), ks=(0,))
    idle = worker.request_loads().prefill_tokens_per_s
    assert idle > 0
    (short,) = prompts_of([40], seed=13)
    worker.add_local("short", short, SamplingParams(max_tokens=8, ignore_eos=True))
    worker.step()
    busy = worker.request_loads()
    assert 0 < busy.prefill_tokens_per_s <= idle * 1.05 and busy.prefill_queued_tokens == 0
    drain(worker)


def test_a_requests_pace_counts_from_the_first_token_its_client_got(llama_dir):
    """The step bound's pace rule reads each running sequence's time since its first token: sampled here for a
    local prefill, stamped by the prefill instance for a transferred prompt (the transfer's end carries it),
    carried along by a live migration (``MigrationState.first_token_at``)."""
    starts = SequenceStarts((), (3,), 1.75e9)
    assert decode_starts(encode_starts(starts)) == starts
    with pytest.raises(ValueError, match="first_token_at"):
        decode_starts('{"forks":[],"text_sent":[],"first_token_at":"nan"}')
    worker = worker_with_slo(llama_dir, tpot_slo_ms=1000)
    (prompt,) = prompts_of([40], seed=14)
    before = time.time()
    worker.add_local("r", prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    held = worker.requests["r"]
    assert before <= held.first_token_at <= time.time()
    worker.step()
    worker.step()
    (pace,) = worker._paces([held])
    out = len(held.seq.tokens) - held.seq.num_prompt
    assert out >= 3 and pace.tokens_since_first == out - 1 and pace.remaining == 10 - out
    assert 0 <= pace.since_first_s <= time.time() - before
    # its tokens after the first came from the two decode steps here: too few to count (one token a step)
    assert held.steps_here == 2 and held.tokens_here == out - 1 and pace.tokens_per_step == 1.0
    drain(worker)


def test_a_late_prompt_is_prefilled_after_the_prompts_that_are_not(llama_dir):
    """``add_prefill(late=True)`` (the router's load-aware decision for a prompt past its TTFT SLO wherever it goes):
    a short late prompt waits while a longer one that is not late takes the 512-token chunks (fewest remaining
    first would have put the short one ahead), then both end with the reference engine's tokens."""
    late, on_time = prompts_of([200, 900], seed=11)
    worker = worker_with_slo(llama_dir, tpot_slo_ms=None)
    assert worker.add_prefill(DecodeRequest("late", tuple(late), PARAMS), late=True)
    assert worker.add_prefill(DecodeRequest("on_time", tuple(on_time), PARAMS))
    outs = {}

    def step():
        for d in worker.step():
            outs.setdefault(d.request_id, []).extend(d.token_ids)

    step()
    assert (worker.requests["on_time"].seq.num_computed, worker.requests["late"].seq.num_computed) == (512, 0)
    step()  # the rest of the one not late (its first token out), then the late one from what the chunk has left
    assert "on_time" in outs and "late" not in outs and worker.requests["late"].seq.num_computed == 512 - 388
    drain(worker, outs)
    assert outs == dict(zip(["late", "on_time"], reference(llama_dir, [late, on_time], PARAMS)))
    assert_idle(worker)
