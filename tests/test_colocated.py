"""Colocated mode end to end: a real local Ray cluster of two reference-engine instances behind the same
gRPC API, real gRPC over localhost. Outputs equal the single-process reference engine's, streaming and
cancellation work as in disaggregated mode, status reports colocated instances, a bad ``mode`` is a
ConfigError naming the field."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os

import grpc
import pytest

from controller.config import CONFIG_DIR, LOCAL_CONFIG, ConfigError, load_config, parse_config
from frontend.client import AsyncClient, Client
from modeling.engine import EngineConfig, ReferenceEngine
from modeling.sampling import SamplingParams
from tests.serving import e2e_config, prompts_of, running_server, stream_ids, wait_all_alive, wait_all_free

INSTANCES = 2
KV_TOKENS = 4096
BLOCK = 16


# -- config (no cluster) ------------------------------------------------------------------------------

@pytest.mark.parametrize("raw,message", [
    ({"mode": "both"}, "mode: must be one of disaggregated, colocated, got 'both'"),
    ({"mode": 1}, "mode: must be a string, got 1"),
    ({"mode": "colocated", "colocated": {"token_budget": 0}}, "colocated.token_budget: must be >= 1, got 0"),
    ({"colocated": {"speculation": {}}}, "colocated.speculation: unknown field; allowed: instances,"),
    # the gRPC server runs on asyncio, with no thread pool to size
    ({"server": {"workers": 16}}, "server.workers: unknown field; allowed: host,"),
])
def test_bad_mode_and_colocated_fields_are_config_errors(raw, message):
    with pytest.raises(ConfigError) as info:
        parse_config({"model": {"path": "m"}, **raw})
    assert str(info.value).startswith(message), str(info.value)


def test_local_colocated_uses_the_cores_of_local_yaml():
    disagg = load_config(LOCAL_CONFIG)
    colo = load_config(os.path.join(CONFIG_DIR, "local-colocated.yaml"))
    assert disagg.mode == "disaggregated" and colo.mode == "colocated"
    assert list(colo.pools) == ["colocated"] and colo.model_path == disagg.model_path

    def cores(cfg):
        return sum(p.instances * p.threads for p in cfg.pools.values())

    assert cores(colo) == cores(disagg) == 2


def test_shipped_configs_load_and_the_prefill2_pair_reserves_the_cores_of_local_yaml():
    """Every magicserve config under cluster_configs/ passes the loader ``serve`` uses (ray-cluster-gpu.yaml
    is a ``ray up`` launcher file, not one). local-prefill2*.yaml run 3 threads but reserve local.yaml's 2 CPUs
    and differ from each other only in speculation."""
    names = sorted(n for n in os.listdir(CONFIG_DIR) if n.endswith(".yaml") and n != "ray-cluster-gpu.yaml")
    assert {"local.yaml", "local-prefill2.yaml", "local-prefill2-no-spec.yaml"} <= set(names)
    loaded = {n: load_config(os.path.join(CONFIG_DIR, n)) for n in names}
    spec, no_spec = loaded["local-prefill2.yaml"], loaded["local-prefill2-no-spec.yaml"]
    for cfg in (spec, no_spec):
        assert (cfg.prefill.threads, cfg.decode.threads) == (2, 1)
        assert sum(p.instances * p.cpus_per_instance for p in cfg.pools.values()) == 2
    assert spec.decode.speculation == loaded["local.yaml"].decode.speculation
    assert no_spec.decode.speculation.drafter == "none"
    assert spec.prefill.token_budget == no_spec.prefill.token_budget == loaded["local.yaml"].prefill.token_budget
    one_by_two = loaded["local-colocated-1x2.yaml"].colocated
    assert (one_by_two.instances, one_by_two.threads, one_by_two.cpus_per_instance) == (1, 2, 2)
    f32, default = loaded["local-float32.yaml"], loaded["local.yaml"]
    assert f32.model.dtype == "float32"
    assert dataclasses.replace(f32, model=default.model, source="") == dataclasses.replace(default, source="")


# -- served (one cluster for the module) ---------------------------------------------------------------

@pytest.fixture(scope="module")
def server(llama_dir):
    """Two colocated instances, one torch thread each."""
    cfg = e2e_config(llama_dir, mode="colocated",
                     colocated={"instances": INSTANCES, "kv_cache_tokens": KV_TOKENS, "block_size": BLOCK,
                                "attention_backend": "torch", "token_budget": 64})
    with running_server(cfg) as address:
        yield address


def test_status_shows_colocated_instances(server):
    with Client(server) as c:
        st = c.status()
    assert sorted(i.name for i in st.instances) == [f"colocated-{k}" for k in range(INSTANCES)]
    assert (st.dtype, st.dtype_reason) == ("float32", "set in the config")  # e2e_config's model.dtype
    for i in st.instances:
        assert i.role == "colocated" and i.alive and i.device == "cpu"
        assert i.total_kv_blocks == KV_TOKENS // BLOCK


def test_engine_logs_each_step_as_one_mixed_pass(llama_dir):
    """modeling/engine.py: one "mixed" record per step, prompt chunks as prefill, the tokens after the first
    as decode tokens reading their KV positions: the shape the simulator prices a colocated step by."""
    engine = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=4096, token_budget=64, attention_backend="torch"))
    prompts = prompts_of([100, 30], seed=4)
    done = engine.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert [len(c.token_ids) for c in done] == [5, 5]
    records = engine.pass_log.drain()
    assert {r["kind"] for r in records} == {"mixed"} and all(r["seconds"] > 0 for r in records)
    shapes = [r["shape"] for r in records]
    # budget 64: [0, 64) of the first prompt, then [64, 100) with most of the second prompt
    assert [s["chunks"] for s in shapes[:2]] == [[[0, 64]], [[64, 36], [0, 28]]]
    assert [s["chunks"] for s in shapes[2:]] == [[[28, 2]]] + [[]] * (len(shapes) - 3)  # then decode only
    assert sum(s["decode_seqs"] for s in shapes) == 2 * 4  # every token after the first
    # decode tokens read their whole context: positions 100..103 and 30..33, one more each step
    assert sum(s["decode_kv_tokens"] for s in shapes) == sum(range(101, 105)) + sum(range(31, 35))
    assert len(engine.pass_log) == 0


def test_instances_hand_over_their_mixed_passes(server):
    """The colocated actors hand over their engines' pass logs (what the calibration's contention fit reads)."""
    import ray

    actors = [ray.get_actor(f"magicserve-colocated-{k}", namespace="magicserve") for k in range(INSTANCES)]
    for actor in actors:
        ray.get(actor.pass_log.remote())  # drop the passes of earlier tests
    ids, _ = stream_ids(server, prompts_of([100], seed=7)[0], max_tokens=12, ignore_eos=True)
    assert len(ids) == 12
    records = [r for actor in actors for r in ray.get(actor.pass_log.remote())]
    assert {r["kind"] for r in records} == {"mixed"}
    # token_budget 64: [0, 64), [64, 100), then one decode token per step for the 11 tokens after the first
    assert [c for r in records for c in r["shape"]["chunks"]] == [[0, 64], [64, 36]]
    assert [r["shape"]["decode_kv_tokens"] for r in records if r["shape"]["decode_seqs"]] == list(range(101, 112))


def test_a_repeated_prompt_goes_to_the_instance_that_holds_it_cached(server, reference):
    """The colocated router places by cached prefix: the second and third time, the prompt goes to the instance
    the first run left it on (even with the other one idle), starts from its cached blocks, and the tokens are
    the reference's; each request's usage says what was found of its prompt."""
    prompt = prompts_of([90], seed=11)[0]
    want = reference.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids

    def counters():
        with Client(server) as c:
            return {i.name: (i.prefix_cache_queries, i.prefix_cache_hits) for i in c.status().instances}

    before = counters()
    ids, final = stream_ids(server, prompt, max_tokens=10, ignore_eos=True)
    assert ids == want and final.usage["cached_prompt_tokens"] == 0
    first = counters()
    holder = next(n for n in first if first[n][0] != before[n][0])
    for _ in range(2):
        ids, final = stream_ids(server, prompt, max_tokens=10, ignore_eos=True)
        assert ids == want and final.usage["cached_prompt_tokens"] == 80
    after = counters()
    assert after[holder][1] - first[holder][1] == 2 * 80  # 5 of its 6 blocks, both times
    assert all(after[n] == first[n] for n in after if n != holder)


def test_pass_log_rpc_is_off_unless_configured(server):
    with Client(server) as c, pytest.raises(grpc.RpcError) as info:
        c.drain_pass_log()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "server.pass_log_rpc" in info.value.details() and "--pass-log-rpc" in info.value.details()


def test_concurrent_greedy_equals_reference(server, reference):
    prompts = prompts_of([4, 33, 120, 9], seed=1)
    expected = [c.token_ids for c in reference.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: stream_ids(server, p, max_tokens=24, ignore_eos=True), prompts))
    for (ids, final), exp in zip(results, expected):
        assert ids == exp
        assert final.finish_reason == "length" and final.usage["completion_tokens"] == 24
        assert final.usage["prompt_tokens"] > 0 and final.usage["ttft_ms"] > 0
        assert final.usage["draft_tokens"] == 0 and final.usage["accepted_draft_tokens"] == 0


def test_stop_token_and_seeded_sampling_match_reference(server, reference):
    prompt = prompts_of([40], seed=2)[0]
    greedy = reference.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    stop = SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=(greedy[5],))
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    for params, kw in [(stop, dict(stop_token_ids=[greedy[5]])),
                       (sampled, dict(temperature=0.9, top_p=0.95, seed=1234))]:
        exp = reference.generate([prompt], params)[0]
        ids, final = stream_ids(server, prompt, max_tokens=16, ignore_eos=True, **kw)
        assert ids == exp.token_ids
        assert final.finish_reason == exp.finish_reason.value


def test_text_streams_token_by_token_and_agrees_with_unary(server):
    with Client(server) as c:
        unary = c.generate("def add(a, b):", max_tokens=12, ignore_eos=True)
        chunks = list(c.generate_stream("def add(a, b):", max_tokens=12, ignore_eos=True))
    deltas, final = chunks[:-1], chunks[-1]
    assert len(deltas) >= 2 and all(ch.finish_reason is None for ch in deltas)
    assert [len(ch.token_ids) for ch in deltas] == [1] * 12  # one engine step, one token
    assert unary.token_ids == [t for ch in deltas for t in ch.token_ids]
    assert unary.text == "".join(ch.text for ch in chunks) and unary.text
    assert final.finish_reason == "length" and final.usage["completion_tokens"] == 12


def test_requests_spread_over_instances_and_cancellation_frees_them(server):
    """Two long requests land on different instances (least loaded); closing their streams aborts
    them there: KV blocks all free, nothing running."""
    async def two_streams_then_cancel():
        async with AsyncClient(server) as c:
            streams = [c.generate_stream(p, max_tokens=400, ignore_eos=True) for p in prompts_of([200, 150], seed=3)]
            for s in streams:
                await s.__anext__()  # first token: prefill done, the request is running
            busy = {i.name: i.running + i.queue_length for i in (await c.status()).instances}
            for s in streams:
                await s.aclose()  # closing the stream cancels the call
            return busy
    busy = asyncio.run(two_streams_then_cancel())
    assert busy == {f"colocated-{k}": 1 for k in range(INSTANCES)}
    blocks = wait_all_free(server)
    assert all(free == total for free, total in blocks.values()), blocks
    with Client(server) as c:
        st = c.status()
    assert st.running_requests == 0 and all(i.running == 0 and i.queue_length == 0 for i in st.instances)


def test_the_engine_resumes_each_sequence_from_the_tokens_it_streamed(llama_dir):
    """``ReferenceEngine.add_resume`` (what a colocated instance runs when another one died): both sequences of
    a seeded n = 2 request, continued from a cut of an undisturbed run's output (its text sent so far and its
    generator's state there), end with that run's tokens and text."""
    from modeling.forks import split_sequence_id
    from modeling.resume import ResumedSequence, ResumeRequest

    engine = ReferenceEngine(llama_dir, EngineConfig(kv_cache_tokens=KV_TOKENS, attention_backend="torch"))
    prompt = prompts_of([40], seed=9)[0]
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=3, n=2)
    cut = 10

    def run(request_id: str) -> tuple[dict, dict, dict]:
        tokens, text, at_cut = {0: [], 1: []}, {0: "", 1: ""}, {}
        while engine.has_unfinished():
            for out in engine.step():
                _, i = split_sequence_id(out.request_id)
                tokens[i] += out.new_token_ids
                text[i] += out.new_text
                if len(tokens[i]) == cut:
                    at_cut[i] = ResumedSequence(i, tokens[i], len(text[i]), engine.sampler_state(out.request_id))
                if out.finished:
                    engine.release(out.request_id)
        return tokens, text, at_cut

    engine.add_request(prompt, params, "whole")
    whole, whole_text, at_cut = run("whole")
    engine.add_resume(ResumeRequest("rest", prompt, params, (at_cut[0], at_cut[1])))
    rest, rest_text, _ = run("rest")
    assert whole[0] != whole[1] and all(len(whole[i]) == 24 for i in (0, 1))
    for i in (0, 1):
        assert whole[i][:cut] + rest[i] == whole[i]
        assert whole_text[i][:at_cut[i].text_sent] + rest_text[i] == whole_text[i]


def test_killed_instance_resumes_its_request_elsewhere_and_rejoins(server, reference):
    """Kill the instance running a request mid-stream: that request continues on the other instance from the
    tokens it streamed (seeded sampling: its generator's state follows), with the tokens of an undisturbed
    run; the other instance's request completes exactly; the actor restarts and rejoins."""
    import ray

    prompts = prompts_of([50, 60], seed=5)
    seeded = dict(max_tokens=400, ignore_eos=True, temperature=0.9, seed=7)
    expected = reference.generate(prompts[:1], SamplingParams(max_tokens=400, ignore_eos=True))[0].token_ids
    undisturbed = reference.generate(prompts[1:], SamplingParams(**seeded))[0].token_ids
    with Client(server) as c:
        streams = [c.generate_stream(prompts[0], max_tokens=400, ignore_eos=True), c.generate_stream(prompts[1], **seeded)]
        firsts = [next(s) for s in streams]  # placed: prompts[0] on colocated-0, prompts[1] on colocated-1
        ray.kill(ray.get_actor("magicserve-colocated-1", namespace="magicserve"), no_restart=False)
        survivor = firsts[0].token_ids + [t for ch in streams[0] for t in ch.token_ids]
        resumed = firsts[1].token_ids + [t for ch in streams[1] for t in ch.token_ids]
    assert survivor == expected
    assert resumed == undisturbed
    assert stream_ids(server, prompts[0], max_tokens=10, ignore_eos=True)[0] == expected[:10]
    assert wait_all_alive(server)
    again = reference.generate(prompts, SamplingParams(max_tokens=100, ignore_eos=True))
    with Client(server) as c:  # two at once: the second one runs on the restarted colocated-1
        streams = [c.generate_stream(p, max_tokens=100, ignore_eos=True) for p in prompts]
        firsts = [next(s) for s in streams]
        outputs = [f.token_ids + [t for ch in s for t in ch.token_ids] for f, s in zip(firsts, streams)]
        generated = {i.name: i.tokens_generated for i in c.status().instances}
    assert outputs == [a.token_ids for a in again]
    assert generated["colocated-1"] == 100, generated  # counted since its restart
