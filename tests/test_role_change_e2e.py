"""Instances that change role, on a real local Ray cluster (``magicserve scale POOL N --from OTHER``): the
prefill instance becomes a second decode instance while requests stream (it finishes the prompt it has begun and
hands back those still waiting, which the decode instances prefill instead), the decode instances then prefill
every prompt themselves (one drained by ``magicserve drain`` hands back the prompts it has not begun); a decode
instance becomes the prefill instance again (its running requests move away by live migration mid-stream). Every request ends with the reference engine's
tokens (none lost, none repeated), and the pools' shapes, the instances' roles and the decisions show it; the same
with instances of two tensor-parallel ranks."""

from __future__ import annotations

import time

import grpc
import pytest

from frontend.cli import main as cli_main
from frontend.client import Client
from modeling.sampling import SamplingParams
from tests.serving import Stream, e2e_config, prompts_of, running_server


def roles(c) -> dict[str, str]:
    return {i.name: i.role for i in c.status().instances}


def wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.01)


@pytest.mark.parametrize("tp", [1, 2])
def test_instances_change_role_while_requests_stream(llama_dir, reference, tp):
    """With ``tp`` 2, every rank of the instance changes role with its rank 0, over the same group. The prefill
    instance computes one prompt at a time in 4-token steps, so that prompts wait in its queue when it switches."""
    cfg = e2e_config(
        llama_dir,
        prefill={"tensor_parallel": tp, "kv_cache_tokens": 4096, "attention_backend": "torch", "token_budget": 4,
                 "max_num_seqs": 1},
        decode={"tensor_parallel": tp, "kv_cache_tokens": 4096, "attention_backend": "torch", "prefill_chunk": 16,
                "speculation": {"k_policy": "fixed", "k": 3, "budget": 32, "sink_tokens": 4}},
        autoscale={"prefill": {"min_instances": 0, "max_instances": 2}, "decode": {"max_instances": 2}},
    )
    prompts = prompts_of([500, 400, 550, 400, 420, 380, 450, 80], seed=61)
    params = dict(max_tokens=160, ignore_eos=True)
    want = [c.token_ids for c in reference.generate(prompts, SamplingParams(**params))]
    with running_server(cfg) as address, Client(address) as c:
        first = [Stream(address, p, f"role-{i}", **params) for i, p in enumerate(prompts[:3])]
        wait_for(lambda: {i.name: i.queue_length for i in c.status().instances}["prefill-0"] >= 1)
        became = c.scale("decode", 2, switch_from="prefill")  # the prefill instance decodes from now on
        assert not became.error and list(became.switched) == ["prefill-0"] and became.current == 2, became
        assert became.handed_back >= 1, became  # a prompt still waiting: a decode instance prefilled it
        assert roles(c) == {"prefill-0": "decode", "decode-0": "decode"}
        assert {p.pool: (p.current, p.desired) for p in c.status().pools} == {"prefill": (0, 0), "decode": (2, 2)}
        # no prefill instance: the decode instances prefill the prompts themselves, 16 tokens a step; drained, one
        # with two or more queued hands back those it has not begun
        queued = {}

        def two_queued() -> bool:
            queued.update({i.name: i.local_prefills for i in c.status().instances})
            return max(queued.values()) >= 2

        middle = [Stream(address, p, f"role-{i + 3}", **params) for i, p in enumerate(prompts[3:7])]
        wait_for(two_queued)
        busier = max(queued, key=queued.get)
        drained = c.drain(busier)
        assert drained.drained and drained.handed_back >= 1, drained
        c.drain(busier, undo=True)
        for s in middle:
            s.wait_tokens(20)
        # back: a decode instance holding requests becomes the prefill instance, its requests moved away
        back = c.scale("prefill", 1, switch_from="decode")
        assert not back.error and len(back.switched) == 1 and back.current == 1, back
        assert sorted(roles(c).values()) == ["decode", "prefill"]
        prefill = next(n for n, r in roles(c).items() if r == "prefill")
        before = {i.name: i.prefix_cache_queries for i in c.status().instances}[prefill]
        last = Stream(address, prompts[7], "role-7", **params)
        assert [s.join() for s in first + middle + [last]] == want
        after = {i.name: i.prefix_cache_queries for i in c.status().instances}[prefill]
        assert after - before == len(prompts[7])  # the new prefill instance computed the last prompt
        assert cli_main(["status", "--address", address]) == 0
        with pytest.raises(grpc.RpcError) as err:  # the decode pool keeps an instance
            c.scale("prefill", 2, switch_from="decode")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "switch_from" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            c.scale("decode", 2, switch_from="draft")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "switch_from" in err.value.details()
        if tp == 1:  # min_instances 0: the last prefill instance retires too, and the decode instance prefills
            gone = c.scale("prefill", 0)
            assert not gone.error and list(gone.removed) == [prefill] and gone.current == 0, gone
            assert Stream(address, prompts[0], "role-8", **params).join() == want[0]


def test_pools_of_different_tensor_parallel_degrees_do_not_exchange_instances(llama_dir):
    from controller.cluster import Cluster

    same = e2e_config(llama_dir, prefill={"tensor_parallel": 2}, decode={"tensor_parallel": 2})
    assert Cluster(same).switch_problem() is None
    mixed = e2e_config(llama_dir, prefill={"tensor_parallel": 2}, decode={"tensor_parallel": 1})
    problem = Cluster(mixed).switch_problem()
    assert problem is not None and "tensor-parallel ranks" in problem, problem
