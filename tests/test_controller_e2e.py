"""End to end on a real local Ray cluster (logical resources), real gRPC over localhost, real workers
and real KV transfer over gloo: outputs equal the reference engine's, cancellation frees KV, a killed
decode actor does not take the service down, bad input is rejected with the field's name."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import grpc
import pytest

from frontend.client import AsyncClient, Client
from modeling.sampling import SamplingParams
from tests.checkpoints import VOCAB
from tests.serving import e2e_config, prompts_of, running_server, stream_ids, wait_all_alive, wait_all_free



@pytest.fixture(scope="module")
def server(llama_dir):
    """1 prefill + 2 decode instances, each pinned to one torch thread."""
    cfg = e2e_config(
        llama_dir,
        ray={"num_cpus": 6, "num_gpus": 0},
        prefill={"kv_cache_tokens": 4096, "attention_backend": "torch", "token_budget": 64},
        decode={"instances": 2, "kv_cache_tokens": 4096, "attention_backend": "torch",
                "speculation": {"k_policy": "fixed", "k": 3, "budget": 32, "sink_tokens": 4}},
        kv_transfer={"timeout_s": 5},
        server={"port": 0, "http_port": None, "pass_log_rpc": True},
    )
    with running_server(cfg) as address:
        yield address


def test_concurrent_streams_equal_reference_greedy(server, reference):
    prompts = prompts_of([4, 33, 120, 257, 70, 9], seed=1)
    expected = [c.token_ids for c in reference.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda p: stream_ids(server, p, max_tokens=40, ignore_eos=True), prompts))
    for (ids, final), exp in zip(results, expected):
        assert ids == exp
        assert final.finish_reason == "length" and final.usage["completion_tokens"] == 40
        assert final.usage["draft_tokens"] > 0


def test_text_prompt_unary_and_stream_agree(server):
    with Client(server) as c:
        unary = c.generate("def add(a, b):", max_tokens=24, ignore_eos=True)
        streamed = list(c.generate_stream("def add(a, b):", max_tokens=24, ignore_eos=True))
    assert unary.token_ids == [t for ch in streamed for t in ch.token_ids]
    assert unary.text == "".join(ch.text for ch in streamed)


def test_the_first_token_streams_with_its_text(server, reference):
    """The prefill instance streams the first token with its text (one route for every token): the client's
    first delta is the token and its text, and the decode instance continues after them, repeating neither."""
    prompt = "def add(a, b):"
    want = reference.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    with Client(server) as c:
        streamed = [ch for ch in c.generate_stream(prompt, max_tokens=12, ignore_eos=True) if ch.token_ids or ch.text]
    first = streamed[0]
    assert first.token_ids == want.token_ids[:1] and first.text and want.text.startswith(first.text)
    assert [t for ch in streamed for t in ch.token_ids] == want.token_ids
    assert "".join(ch.text for ch in streamed) == want.text


def _instances(address):
    with Client(address) as c:
        return {i.name: i for i in c.status().instances}


def _grew(before, after, field):
    """{instance: how much ``field`` grew} for the instances where it did."""
    return {n: getattr(after[n], field) - getattr(before[n], field) for n in after
            if getattr(after[n], field) != getattr(before[n], field)}


def test_seeded_sampling_is_reproducible(server):
    """Same seed, same output (speculative sampling draws its randomness from the request's seeded
    generator, continued across the prefill -> decode hand-off), also when the repeat is prefilled on the
    decode instance from the KV the first run left there (no prefill instance involved)."""
    prompt = prompts_of([40], seed=2)[0]
    kw = dict(max_tokens=30, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    a, _ = stream_ids(server, prompt, **kw)
    before = _instances(server)
    b, _ = stream_ids(server, prompt, **kw)  # 2 of its 3 blocks cached where a decoded
    after = _instances(server)
    assert a == b
    assert _grew(before, after, "prefix_cache_queries") == {name: 40 for name in _grew(before, after, "prefix_cache_hits")}
    assert list(_grew(before, after, "prefix_cache_hits").values()) == [32]
    assert "prefill-0" not in _grew(before, after, "prefix_cache_queries")
    c, _ = stream_ids(server, prompt, **{**kw, "seed": 4321})
    assert c != a


def test_a_conversations_next_turn_is_prefilled_where_the_last_one_decoded(server, reference):
    """Turn 2 (turn 1's prompt + its output + a new message) goes back to the decode instance that served turn 1
    and is prefilled there from the KV turn 1 left, computing only the new tokens: the prefill instance sees
    nothing of it, and the tokens equal the reference engine's. A turn whose new part is longer than
    ``local_prefill_tokens`` goes through the prefill instance, which computes it from its own cached prefix."""
    p1, question, long_question = prompts_of([100, 30, 300], seed=12)
    greedy = dict(max_tokens=40, ignore_eos=True)
    before = _instances(server)
    out1, _ = stream_ids(server, p1, **greedy)
    assert out1 == reference.generate([p1], SamplingParams(**greedy))[0].token_ids
    served = list(_grew(before, _instances(server), "tokens_generated"))
    p2 = p1 + out1 + question
    before = _instances(server)
    out2, _ = stream_ids(server, p2, **greedy)
    after = _instances(server)
    assert out2 == reference.generate([p2], SamplingParams(**greedy))[0].token_ids
    hits = _grew(before, after, "prefix_cache_hits")
    assert list(hits) == served[:1] and len(served) == 1  # where turn 1 decoded
    assert hits[served[0]] == (len(p1) + len(out1) - 1) // 16 * 16  # every final block of turn 1
    assert "prefill-0" not in _grew(before, after, "prefix_cache_queries")

    p3 = p1 + out1 + long_question
    before = _instances(server)
    out3, _ = stream_ids(server, p3, **greedy)
    after = _instances(server)
    assert out3 == reference.generate([p3], SamplingParams(**greedy))[0].token_ids
    assert _grew(before, after, "prefix_cache_queries")["prefill-0"] == len(p3)
    assert _grew(before, after, "prefix_cache_hits")["prefill-0"] == len(p1) // 16 * 16  # turn 1's prompt


def test_cancellation_frees_kv_on_both_workers(server):
    async def cancel_midway():
        async with AsyncClient(server) as c:
            n = 0
            async for chunk in c.generate_stream(prompts_of([300], seed=3)[0], max_tokens=400, ignore_eos=True):
                n += len(chunk.token_ids)
                if n >= 5:
                    break  # closing the stream cancels the call
    asyncio.run(cancel_midway())
    blocks = wait_all_free(server)
    assert all(free == total for free, total in blocks.values()), blocks


@pytest.mark.parametrize("kwargs,field", [
    (dict(prompt="x", max_tokens=0), "sampling.max_tokens"),
    (dict(prompt="x", max_tokens=10_000), "sampling.max_tokens"),
    (dict(prompt="x", max_tokens=5, temperature=-1.0), "sampling.temperature"),
    (dict(prompt="x", max_tokens=5, top_p=1.5), "sampling.top_p"),
    (dict(prompt=[1, 2, VOCAB + 5], max_tokens=5), "prompt_token_ids.ids[2]"),
    (dict(prompt=[7] * 700, max_tokens=5), "prompt"),
    (dict(prompt="x", max_tokens=5, stop_token_ids=[VOCAB]), "sampling.stop_token_ids[0]"),
    (dict(prompt="x", max_tokens=5, request_id="bad id!"), "request_id"),
    (dict(prompt="", max_tokens=5), "prompt"),
])
def test_invalid_requests_name_the_field(server, kwargs, field):
    prompt = kwargs.pop("prompt")
    with Client(server) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.generate(prompt, **kwargs)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(field + ":"), info.value.details()
        assert c.generate([5, 6], max_tokens=2).finish_reason in ("length", "stop")  # still serving


@pytest.mark.parametrize("method,streaming", [("Generate", True), ("GenerateUnary", False),
                                              ("GetClusterStatus", False)])
def test_undecodable_request_is_invalid_argument(server, method, streaming):
    """Bytes that are not the method's message: INVALID_ARGUMENT naming the expected type; still serving."""
    garbage = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length-delimited, length past the end
    with grpc.insecure_channel(server) as ch:
        call = (ch.unary_stream if streaming else ch.unary_unary)(f"/magicserve.v1.MagicServe/{method}")
        with pytest.raises(grpc.RpcError) as info:
            result = call(garbage, timeout=30)
            if streaming:
                list(result)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid magicserve.v1." in info.value.details()
    with Client(server) as c:
        assert c.generate([5, 6], max_tokens=2).finish_reason in ("length", "stop")


def test_health_and_reflection(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="magicserve.v1.MagicServe"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        answers = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in answers[0].list_services_response.service}
        assert {"magicserve.v1.MagicServe", "grpc.health.v1.Health"} <= names


def test_queue_limit_gives_resource_exhausted(server):
    """8 running + 4 queued fit; the rest are refused, none is lost."""
    prompt = prompts_of([20], seed=4)[0]

    served = []  # (client-side seconds, the server's own TTFT + decode time in its usage report)

    def call(_):
        try:
            with Client(server) as c:
                t0 = time.perf_counter()
                result = c.generate(prompt, max_tokens=150, ignore_eos=True)
                u = result.usage
                served.append((time.perf_counter() - t0, (u["ttft_ms"] + 149 * u["mean_tpot_ms"]) / 1e3))
                return result.finish_reason
        except grpc.RpcError as err:
            return err.code().name

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        outcomes = list(pool.map(call, range(20)))
    assert outcomes.count("length") >= 12
    assert set(outcomes) <= {"length", "RESOURCE_EXHAUSTED"}
    assert "RESOURCE_EXHAUSTED" in outcomes
    # the queued requests waited about a whole request for a slot: the server's TTFT counts that wait
    for client_s, server_s in served:
        assert server_s >= 0.8 * client_s, served


def test_workers_hand_over_their_timed_passes(server):
    """modeling/pass_log.py through the DrainPassLog RPC (what benchmarks/slo_sweep.py reads) and through
    the actors (what the calibration and benchmarks/host_contention.py read)."""
    import ray

    prefill = ray.get_actor("magicserve-prefill-0", namespace="magicserve")
    with Client(server) as c:
        c.drain_pass_log()  # drop the passes of earlier tests
        ids, last = stream_ids(server, prompts_of([100], seed=7)[0], max_tokens=12, ignore_eos=True)
        drained = c.drain_pass_log()
        assert all(not inst["records"] for inst in c.drain_pass_log())  # handed over once
    assert len(ids) == 12 and last.finish_reason == "length"
    assert [(i["name"], i["role"], i["dropped"]) for i in drained] == [
        ("prefill-0", "prefill", 0), ("decode-0", "decode", 0), ("decode-1", "decode", 0)]
    passes = drained[0]["records"]
    assert {r["kind"] for r in passes} == {"prefill"} and all(r["seconds"] > 0 for r in passes)
    assert all(abs(r["end_s"] - time.time()) < 300 for r in passes)  # wall-clock ends
    # token_budget 64: the 100-token prompt is prefilled as [0, 64) then [64, 100)
    assert [c for r in passes for c in r["shape"]["chunks"]] == [[0, 64], [64, 36]]
    logs = [inst["records"] for inst in drained[1:]]
    records = [r for log in logs for r in log]
    steps = [r for r in records if r["kind"] == "step"]
    decoded = [r for r in records if r["kind"] in ("decode", "verify")]
    drafts = [r for r in records if r["kind"] == "draft"]
    assert "verify" in {r["kind"] for r in decoded} and {r["kind"] for r in records} <= {"decode", "verify", "draft", "step"}
    # fixed k = 3: each speculative step logs its three draft passes as one record, its verify pass, then the step
    assert len(drafts) == sum(r["kind"] == "verify" for r in decoded)
    assert all(r["shape"]["passes"] == 3 and r["shape"]["seqs"] == 3 for r in drafts)
    assert len(steps) == len(decoded) and all(r["shape"]["k"] in (0, 3) for r in steps)
    order = [r["kind"] for r in records]
    assert all(order[i + 1] in ("verify", "decode") and order[i + 2] == "step"
               for i, kind in enumerate(order) if kind == "draft")
    # a step takes at least as long as its passes
    for log in logs:
        since_step = 0.0
        for r in log:
            if r["kind"] == "step":
                assert r["seconds"] >= since_step
                since_step = 0.0
            else:
                since_step += r["seconds"]
    assert all(r["shape"]["seqs"] == 1 and r["shape"]["kv_tokens"] > 100 for r in decoded)
    assert sum(r["shape"]["new_tokens"] for r in decoded) >= 11  # every token after the first was verified
    # the actors hand over the same logs directly
    stream_ids(server, prompts_of([20], seed=8)[0], max_tokens=2, ignore_eos=True)
    assert [c for r in ray.get(prefill.pass_log.remote()) for c in r["shape"]["chunks"]] == [[0, 20]]
    assert ray.get(prefill.pass_log.remote()) == []


def test_killed_decode_actor_loses_no_request(server, reference):
    """A decode actor killed while requests stream: the router continues each of its requests on the other
    decode instance from the tokens already streamed, every sequence of a request of several (n = 2)
    included; every client gets the reference's tokens, no error."""
    import ray

    prompts = prompts_of([50, 60, 70, 80, 40, 45], seed=5)
    expected = [c.token_ids for c in reference.generate(prompts, SamplingParams(max_tokens=200, ignore_eos=True))]
    expected[4:] = [{0: ids, 1: ids} for ids in expected[4:]]  # n = 2, greedy: two copies of the reference

    def call(i, p):
        try:
            if i < 4:
                return stream_ids(server, p, max_tokens=200, ignore_eos=True)[0]
            with Client(server) as c:
                per: dict[int, list[int]] = {}
                for ch in c.generate_stream(p, max_tokens=200, ignore_eos=True, n=2, request_id=f"multi-{i}"):
                    per.setdefault(ch.index, []).extend(ch.token_ids)
                return per
        except grpc.RpcError as err:
            return err.code().name

    actors = [ray.get_actor(f"magicserve-decode-{j}", namespace="magicserve") for j in range(2)]
    before = [ray.get(a.status.remote())["tokens_generated"] for a in actors]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(call, i, p) for i, p in enumerate(prompts)]
        deadline, victim = time.monotonic() + 30, None
        while victim is None:  # the instance decoding a request of two sequences, mid-stream
            for a, b in zip(actors, before):
                holds = ray.get(a.request_loads.remote()).holds
                if any(h.startswith("multi-") for h in holds) and ray.get(a.status.remote())["tokens_generated"] >= b + 20:
                    victim = a
            assert time.monotonic() < deadline, "no request of two sequences reached a decode instance"
            time.sleep(0.02)
        ray.kill(victim, no_restart=False)
        outcomes = [f.result(timeout=240) for f in futures]
    assert outcomes == expected
    # the service keeps serving, and the restarted actor rejoins
    assert stream_ids(server, prompts[0], max_tokens=20, ignore_eos=True)[0] == expected[0][:20]
    assert wait_all_alive(server)
