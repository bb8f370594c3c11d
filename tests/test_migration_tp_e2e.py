"""Live migration between tensor-parallel decode instances end to end: a real local Ray cluster (1 prefill
instance + 2 decode instances of 2 ranks each), real gRPC over localhost, each rank's KV heads moved to the
destination rank that holds them over gloo. Output equals the reference engine across migrations there and
back, an aborted migration leaves the request on its source, and a drain empties a busy instance; every
instance's blocks are free afterwards."""

from __future__ import annotations

import pytest

from frontend.client import Client
from modeling.sampling import SamplingParams
from tests.serving import Stream, assert_all_free, migration_config, prompts_of, running_server


@pytest.fixture(scope="module")
def server(llama_dir):
    cfg = migration_config(llama_dir, decode_tp=2)
    with running_server(cfg) as address:
        yield address


def test_tp_request_migrates_there_and_back_with_identical_output(server, reference):
    prompt = prompts_of([150], seed=31)[0]
    params = dict(max_tokens=160, ignore_eos=True)
    want = reference.generate([prompt], SamplingParams(**params))[0].token_ids
    stream = Stream(server, prompt, "tp-mig", **params)
    stream.wait_tokens(20)
    with Client(server) as c:
        there = c.migrate("tp-mig")
        assert there.committed, there.reason
        stream.wait_tokens(len(stream.tokens) + 20)
        back = c.migrate("tp-mig", there.source)
        assert back.committed, back.reason
        assert (back.source, back.destination) == (there.destination, there.source)
    assert stream.join() == want
    assert_all_free(server)


def test_tp_migration_aborted_mid_rounds_stays_on_its_source(server, reference):
    prompt = prompts_of([500], seed=32)[0]
    params = dict(max_tokens=120, ignore_eos=True)
    want = reference.generate([prompt], SamplingParams(**params))[0].token_ids
    stream = Stream(server, prompt, "tp-aborted", **params)
    stream.wait_tokens(10)
    with Client(server) as c:
        res = c.migrate("tp-aborted", timeout_s=0.001)
        assert not res.committed and "not committed within" in res.reason
        stream.wait_tokens(len(stream.tokens) + 10)
        res = c.migrate("tp-aborted")  # the channels of every rank still work after the abort
        assert res.committed, res.reason
    assert stream.join() == want
    assert_all_free(server)


def test_tp_drain_empties_a_busy_instance(server, reference):
    prompts = prompts_of([60, 90, 120], seed=33)
    params = dict(max_tokens=120, ignore_eos=True)
    want = [c.token_ids for c in reference.generate(prompts, SamplingParams(**params))]
    streams = [Stream(server, p, f"tp-drain-{i}", **params) for i, p in enumerate(prompts)]
    for s in streams:
        s.wait_tokens(5)
    with Client(server) as c:
        out = c.drain("decode-0")
        assert out.drained, out
        assert {i.name: i for i in c.status().instances}["decode-0"].running == 0
        assert [s.join() for s in streams] == want
        c.drain("decode-0", undo=True)
    assert_all_free(server)
