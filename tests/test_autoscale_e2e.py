"""The online planner on a real multi-node Ray cluster (``ray.cluster_utils.Cluster``: a head node with room
for one prefill and one decode instance): load makes it add a decode instance, whose placement group waits,
pending, for room; no node joins within ``autoscale.placement_timeout_s``, so the resize fails and is undone
(the group removed); a node then joins (what a Ray autoscaler does on that demand; here the test adds it),
the planner tries again after its back-off and the instance runs on that node; a lighter load then makes it
remove one by drain while requests stream; every request ends with the reference engine's tokens. The hardware profile is the measured CPU profile with a decode step whose cost is set by hand
(4 ms + 12 ms per sequence), so the planner's arithmetic is plain: at a 50 ms TPOT target one decode
instance serves three sequences at once, not six."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from frontend.client import Client
from modeling.sampling import SamplingParams
from tests.serving import Stream, e2e_config, prompts_of, running_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plain_profile(path: str) -> str:
    with open(os.path.join(REPO, "benchmarks", "results", "profile_local_cpu.json"), encoding="utf-8") as f:
        profile = json.load(f)
    for inst in profile["instances"]:
        target = inst["target_pass"]
        target["coefficients"] = [0.004, 0.012] + [0.0] * (len(target["features"]) - 2)
    profile["calibrations"] = {}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile, f)
    return path


@pytest.fixture(scope="module")
def ray_nodes():
    import ray
    from ray.cluster_utils import Cluster as RayNodes

    nodes = RayNodes(initialize_head=True, head_node_args={"num_cpus": 2})  # 1 CPU per instance: 1 P + 1 D
    yield nodes
    ray.shutdown()
    nodes.shutdown()


def group_state(name: str) -> str:
    import ray

    return next((g["state"] for g in ray.util.placement_group_table().values() if g["name"] == name), "")


def add_node_for(nodes, group: str, timeout_s: float, after_s: float) -> tuple[list[str], str]:
    """What a slow Ray autoscaler does for a placement group it cannot place: waits for ``group`` to be
    pending, then ``after_s`` more, then adds a node of one CPU. Returns the group's states seen (when it
    asked, and before the node came) and the new node's id. (On the main thread: starting a Ray node sets
    signal handlers.)"""
    import ray

    wait_for(lambda: group_state(group) == "PENDING", timeout_s, f"{group} asking for room")
    states = [group_state(group)]
    time.sleep(after_s)
    states.append(group_state(group))
    before = {n["NodeID"] for n in ray.nodes()}
    nodes.add_node(num_cpus=1)
    return states, next(n["NodeID"] for n in ray.nodes() if n["NodeID"] not in before)


# How long the server took to come up here: the resizes' deadlines scale with it, since a slower machine
# starts the added instance (and everything else) more slowly.
STARTUP_S: list[float] = []


def deadline_s(floor_s: float) -> float:
    """``floor_s``, or ten server start-ups of this machine where that is longer."""
    return max(floor_s, 10 * STARTUP_S[-1]) if STARTUP_S else floor_s


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory, ray_nodes):
    profile = plain_profile(str(tmp_path_factory.mktemp("profile") / "profile.json"))
    cfg = e2e_config(
        llama_dir,
        ray={"address": ray_nodes.address},
        prefill={"kv_cache_tokens": 4096, "attention_backend": "torch", "token_budget": 256},
        decode={"kv_cache_tokens": 8192, "attention_backend": "torch", "speculation": {"drafter": "none"}},
        slo={"ttft_ms": 5000, "tpot_ms": 50, "attainment": 0.9},
        autoscale={"enabled": True, "profile": profile, "interval_s": 0.5, "window_s": 6, "headroom": 1.0,
                   "placement_timeout_s": 2,
                   "cooldown_s": 1, "scale_down_after": 2, "min_window_requests": 3,
                   "prefill": {"max_instances": 1}, "decode": {"max_instances": 2}},
    )
    t0 = time.monotonic()
    with running_server(cfg) as address:
        STARTUP_S.append(time.monotonic() - t0)
        yield address


def pools(client) -> dict:
    return {p.pool: (p.current, p.desired) for p in client.status().pools}


def wait_for(predicate, timeout_s: float, what: str, explain=None):
    """Poll ``predicate``; past ``timeout_s`` fail naming ``what`` and, from ``explain()``, the state that kept it."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s" + (f": {explain()}" if explain else ""))
        time.sleep(0.1)


def scaling_state(client) -> str:
    """The pools and the recent resizes as the status reports them, for a failure message."""
    status = client.status()
    resizes = [(r.pool, list(r.added), list(r.removed), r.error) for r in status.recent_scaling]
    return f"pools {pools(client)}, resizes (pool, added, removed, error) {resizes}"


def test_load_adds_a_decode_instance_and_a_lighter_load_removes_one_by_drain(server, reference, ray_nodes):
    import ray

    burst = prompts_of([30, 40, 50, 60, 70, 80], seed=61)
    steady = prompts_of([45] * 40, seed=62)
    params = dict(max_tokens=300, ignore_eos=True)
    want = {tuple(p): c.token_ids for p, c in zip(burst + steady, reference.generate(burst + steady,
                                                                                      SamplingParams(**params)))}
    got: list[tuple[list[int], list[int]]] = []
    with Client(server) as c:
        assert pools(c)["decode"] == (1, 1)
        streams = [Stream(server, p, f"burst-{i}", **params) for i, p in enumerate(burst)]
        # six at once: one instance's steps would take 76 ms, two take 40 ms: the planner adds one, whose
        # placement group waits for room; the node joins only after the 2 s placement timeout
        states, node_id = add_node_for(ray_nodes, "magicserve-decode-1", deadline_s(120), after_s=3.0)
        wait_for(lambda: pools(c)["decode"] == (2, 2), deadline_s(120), "scaling decode up to 2",
                 lambda: scaling_state(c))
        got += [(p, s.join()) for p, s in zip(burst, streams)]
        resizes = [r for r in c.status().recent_scaling if r.pool == "decode"]  # oldest first
        failed = [i for i, r in enumerate(resizes) if r.error]
        added = [i for i, r in enumerate(resizes) if r.added]
        # the first try waited, pending, then was undone: its group removed, the pool left at one instance
        assert states == ["PENDING", "REMOVED"]
        assert failed, [r.error for r in resizes]
        first = resizes[failed[0]]
        assert "cannot place" in first.error and "within 2 s" in first.error and not first.added
        # tried again after the back-off (as often as it takes the node to come): placed on the node that joined
        assert added and added[0] > failed[0] and not resizes[added[0]].error
        name = resizes[added[0]].added[0]
        group = next(g for g in ray.util.placement_group_table().values() if g["name"] == f"magicserve-{name}")
        assert set(group["bundles_to_node_id"].values()) == {node_id}
        # then one request at a time, steadily: one instance is enough, and the planner takes one away
        stop = threading.Event()

        def steady_load():
            for i, p in enumerate(steady):
                if stop.is_set():
                    return
                got.append((p, Stream(server, p, f"steady-{i}", **params).join()))

        loader = threading.Thread(target=steady_load, daemon=True)
        loader.start()
        wait_for(lambda: pools(c)["decode"] == (1, 1), deadline_s(180), "scaling decode back to 1",
                 lambda: scaling_state(c))
        stop.set()
        loader.join(120)
        removed = [r for r in c.status().recent_scaling if r.removed]
        assert removed and removed[-1].pool == "decode" and not removed[-1].error
        # the resources of the instance that left are Ray's again (the added node idles if it was that one)
        wait_for(lambda: ray.available_resources().get("CPU", 0) >= 1, 30, "its CPU returning to Ray")
    assert len(got) > len(burst) and all(ids == want[tuple(p)] for p, ids in got)
