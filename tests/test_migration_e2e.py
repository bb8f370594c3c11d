"""Live migration end to end: a real local Ray cluster (1 prefill + 2 decode instances), real gRPC over
localhost, KV between decode instances over gloo. A request migrated mid-stream (there and back) streams the
same tokens as the reference engine; seeded sampling is unchanged; ``magicserve drain`` empties a busy
instance with every request completed elsewhere; bad migrate and drain calls name the field; 24 streams
through a killed prefill instance, a killed decode instance and a drain all end with the reference's tokens."""

from __future__ import annotations

import concurrent.futures
import re
import time

import grpc
import pytest

from frontend.cli import main as cli_main
from frontend.client import Client
from modeling.sampling import SamplingParams
from tests.serving import (Stream, assert_all_free, migration_config, prompts_of, running_server, stream_ids,
                           wait_all_alive)


@pytest.fixture(scope="module")
def server(llama_dir):
    cfg = migration_config(llama_dir)
    with running_server(cfg) as address:
        yield address


def test_request_migrates_there_and_back_mid_stream_with_identical_output(server, reference):
    prompt = prompts_of([150], seed=21)[0]
    params = dict(max_tokens=160, ignore_eos=True)
    want = reference.generate([prompt], SamplingParams(**params))[0].token_ids
    stream = Stream(server, prompt, "mig-1", **params)
    stream.wait_tokens(20)
    with Client(server) as c:
        there = c.migrate("mig-1")
        assert there.committed, there.reason
        assert there.source != there.destination and there.destination.startswith("decode")
        mid = len(stream.tokens)
        stream.wait_tokens(mid + 20)
        hits = {i.name: i.prefix_cache_hits for i in c.status().instances}[there.source]
        back = c.migrate("mig-1", there.source)
        assert back.committed, back.reason
        assert (back.source, back.destination) == (there.destination, there.source)
        # the request's prompt blocks stayed cached where it started: the way back sends only the rest
        assert {i.name: i.prefix_cache_hits for i in c.status().instances}[there.source] - hits == 144
        assert c.status().migrations_committed >= 2
    assert stream.join() == want
    assert stream.final.usage["completion_tokens"] == len(want)
    assert_all_free(server)


def test_seeded_sampling_is_unchanged_by_migration(server):
    prompt = prompts_of([80], seed=22)[0]
    params = dict(max_tokens=120, ignore_eos=True, temperature=0.9, top_p=0.95, seed=5)
    alone = Stream(server, prompt, "seeded-alone", **params).join()
    stream = Stream(server, prompt, "seeded-moved", **params)
    stream.wait_tokens(15)
    with Client(server) as c:
        assert c.migrate("seeded-moved").committed
    assert stream.join() == alone


def test_drain_empties_a_busy_instance_without_failing_a_request(server, reference):
    prompts = prompts_of([60, 90, 120, 40], seed=23)
    params = dict(max_tokens=150, ignore_eos=True)
    want = [c.token_ids for c in reference.generate(prompts, SamplingParams(**params))]
    streams = [Stream(server, p, f"drain-{i}", **params) for i, p in enumerate(prompts)]
    for s in streams:
        s.wait_tokens(5)
    # the CLI, as an operator runs it: every request on decode-0 moves to decode-1
    assert cli_main(["drain", "decode-0", "--address", server]) == 0
    with Client(server) as c:
        status = {i.name: i for i in c.status().instances}
        assert status["decode-0"].running == 0
        # drained: a new request is placed on decode-1 only (decode-0 stays out of placement)
        extra = Stream(server, prompts[0], "after-drain", **params)
        extra.wait_tokens(3)
        status = {i.name: i for i in c.status().instances}
        assert status["decode-0"].running == 0 and status["decode-0"].queue_length == 0
        assert extra.join() == want[0]
        assert [s.join() for s in streams] == want
        undo = c.drain("decode-0", undo=True)
        assert undo.instance == "decode-0" and not undo.drained
    assert_all_free(server)


@pytest.mark.parametrize("request_id, destination, code, field", [
    ("", "", grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    ("nobody", "", grpc.StatusCode.NOT_FOUND, "request_id"),
])
def test_bad_migrate_calls_name_the_field(server, request_id, destination, code, field):
    with Client(server) as c, pytest.raises(grpc.RpcError) as err:
        c.migrate(request_id, destination)
    assert err.value.code() == code and err.value.details().startswith(field)


def test_bad_destination_and_instance_name_the_field(server):
    stream = Stream(server, prompts_of([40], seed=24)[0], "bad-dest", max_tokens=200, ignore_eos=True)
    stream.wait_tokens(3)
    with Client(server) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.migrate("bad-dest", "decode-9")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("destination: no decode instance 'decode-9'")
        with pytest.raises(grpc.RpcError) as err:
            c.drain("prefill-0")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("instance")
    stream.join()


def test_a_migration_aborted_mid_rounds_leaves_the_request_on_its_source(server, reference):
    """A migration not committed in time is aborted (here: a deadline shorter than any copy): the source
    goes on, the destination frees what it had received, nothing is lost or repeated."""
    prompt = prompts_of([500], seed=26)[0]
    params = dict(max_tokens=120, ignore_eos=True)
    want = reference.generate([prompt], SamplingParams(**params))[0].token_ids
    stream = Stream(server, prompt, "aborted", **params)
    stream.wait_tokens(10)
    with Client(server) as c:
        before = c.status().migrations_aborted
        res = c.migrate("aborted", timeout_s=0.001)
        assert not res.committed and "not committed within" in res.reason
        assert c.status().migrations_aborted == before + 1
        with pytest.raises(grpc.RpcError) as err:
            c.migrate("aborted", timeout_s=-1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("timeout_s")
    assert stream.join() == want
    assert_all_free(server)


def test_source_dying_after_the_commit_does_not_touch_the_request(server, reference):
    """After the commit the request belongs to its destination: killing the source's process right then
    fails nothing, and the stream completes with the reference's tokens while the source restarts."""
    import ray


    prompt = prompts_of([120], seed=27)[0]
    params = dict(max_tokens=150, ignore_eos=True)
    want = reference.generate([prompt], SamplingParams(**params))[0].token_ids
    stream = Stream(server, prompt, "orphaned-source", **params)
    stream.wait_tokens(10)
    with Client(server) as c:
        res = c.migrate("orphaned-source")
    assert res.committed, res.reason
    ray.kill(ray.get_actor(f"magicserve-{res.source}", namespace="magicserve"), no_restart=False)
    assert stream.join() == want
    assert wait_all_alive(server)


def _actor(name: str):
    """The live actor of instance ``name`` (rank 0), whichever generation it is in."""
    import ray

    names = [n for n in ray.util.list_named_actors() if n == f"magicserve-{name}" or
             re.fullmatch(rf"magicserve-{name}-g\d+", n)]
    assert names, f"no live actor for {name}"
    return ray.get_actor(max(names, key=lambda n: int(n.rpartition("-g")[2]) if "-g" in n else 0),
                         namespace="magicserve")


def _until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_faults_under_load_lose_no_request(server, reference):
    """24 greedy streams, 12 in flight at a time, through three faults: the prefill instance killed (what it
    was prefilling runs again, and what arrives while it restarts is prefilled on a decode instance), a decode
    instance killed (its requests resume on the other one from what they streamed), and a drain (its requests
    migrate). Every stream ends with the reference's tokens."""
    import ray

    prompts = prompts_of([30 + 7 * (i % 9) for i in range(24)], seed=51)
    params = dict(max_tokens=48, ignore_eos=True)
    want = [c.token_ids for c in reference.generate(prompts, SamplingParams(**params))]
    done: list[int] = []

    def call(i):
        try:
            return stream_ids(server, prompts[i], request_id=f"fault-{i}", **params)[0]
        except grpc.RpcError as err:
            return f"{err.code().name}: {err.details()}"
        finally:
            done.append(i)

    with Client(server) as c, concurrent.futures.ThreadPoolExecutor(12) as pool:
        decode = [i.name for i in c.status().instances if i.role == "decode"]
        futures = [pool.submit(call, i) for i in range(24)]
        prefill = _actor("prefill-0")

        def prefilling() -> bool:
            st = ray.get(prefill.status.remote())
            return st["queue_length"] + st["running"] > 0

        def running() -> dict[str, int]:
            return {i.name: i.running for i in c.status().instances if i.role == "decode"}

        _until(lambda: prefilling() or bool(done), "no stream started")
        ray.kill(prefill, no_restart=False)  # killed while it prefills the first arrivals

        _until(lambda: len(done) >= 2 and max(running().values()) >= 3 or all(f.done() for f in futures),
               "no stream ended after the prefill instance died")
        ray.kill(_actor(max(decode, key=running().get)), no_restart=False)
        assert wait_all_alive(server)
        _until(lambda: len(done) >= 14 or all(f.done() for f in futures), "streams stalled", 120)
        drained = c.drain(max(decode, key=running().get))
        assert drained.drained
        c.drain(drained.instance, undo=True)
        outcomes = [f.result(timeout=240) for f in futures]
    assert outcomes == want
    assert_all_free(server)


def test_a_pool_grows_and_shrinks_while_requests_stream(server, reference):
    """``magicserve scale``: a third decode instance is placed in a placement group of its own, connected,
    and takes requests; scaling back removes the instance holding the fewest requests by live migration
    while requests stream there; every request ends with the reference's tokens; the removed instance's
    resources go back to Ray; the prefill pool grows and shrinks the same way; sizes outside the bounds are
    refused naming the field."""
    import ray

    prompts = prompts_of([40, 60, 80, 100, 50, 70], seed=41)
    params = dict(max_tokens=200, ignore_eos=True)
    want = [c.token_ids for c in reference.generate(prompts, SamplingParams(**params))]
    with Client(server) as c:
        first = [Stream(server, p, f"grow-{i}", **params) for i, p in enumerate(prompts[:3])]
        first[0].wait_tokens(5)
        grown = c.scale("decode", 3)
        assert not grown.error and len(grown.added) == 1 and grown.current == 3, grown
        new = grown.added[0]
        pools = {p.pool: p for p in c.status().pools}
        assert (pools["decode"].current, pools["decode"].desired, pools["decode"].held) == (3, 3, True)
        later = [Stream(server, p, f"grow-{i + 3}", **params) for i, p in enumerate(prompts[3:])]
        for s in later:
            s.wait_tokens(30)
        on_new = {i.name: i for i in c.status().instances}[new]
        assert on_new.tokens_generated > 0 and on_new.running > 0  # it took requests, and holds some now
        shrunk = c.scale("decode", 2)
        assert not shrunk.error and len(shrunk.removed) == 1 and shrunk.current == 2, shrunk
        assert [s.join() for s in first + later] == want
        assert shrunk.removed[0] not in {i.name for i in c.status().instances}
        groups = ray.util.placement_group_table()
        gone = [g for g in groups.values() if g["name"] == f"magicserve-{shrunk.removed[0]}"]
        assert gone and all(g["state"] == "REMOVED" for g in gone)
        assert cli_main(["scale", "prefill", "2", "--address", server]) == 0  # as an operator runs it
        assert Stream(server, prompts[0], "after-grow", **params).join() == want[0]
        assert cli_main(["scale", "prefill", "1", "--release", "--address", server]) == 0
        assert {p.pool: p.current for p in c.status().pools} == {"prefill": 1, "decode": 2}
        with pytest.raises(grpc.RpcError) as err:
            c.scale("decode", 0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "autoscale.decode" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            c.scale("draft", 2)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("pool")
        c.scale("decode", 2, hold=False)
    assert_all_free(server)
