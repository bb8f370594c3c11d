"""Cost-aware planning end to end on a catalogue of two made-up GPU types where splitting the pools pays:
one computes fast and cheaply but reads memory slowly (good at prefill), the other reads memory fast (good at
decode). The search screens every option in the simulator, solves the packing program, verifies the plans by
simulation, and ``magicserve plan --objective cost`` writes a plan whose pools differ in GPU type; the config
loader accepts it and a real two-node Ray cluster places each pool on the nodes of its type (logical
resources)."""

from __future__ import annotations

import math

import pytest
import yaml

from controller.config import load_config
from frontend.cli import main as cli_main
from planner.cost_search import (CostPlanner, CostSpace, geometric_bisection, make_slices, steady_span_s)
from planner.gpu_catalog import load_catalog
from planner.search import SLOTarget, Workload
from planner.workload import workload_shape

COMPUTE = {"memory_mib": 49152, "hbm_bandwidth_gb_s": 800, "bf16_tflops": 1000, "link_bandwidth_gb_s": 32,
           "link": "PCIe", "collective_latency_us": 25, "spec_source": "made up for a test",
           "ray_accelerator_type": "C1", "price_per_gpu_hour": 1.5}
MEMORY = {"memory_mib": 143360, "hbm_bandwidth_gb_s": 4000, "bf16_tflops": 200, "link_bandwidth_gb_s": 400,
          "link": "NVLink", "collective_latency_us": 10, "spec_source": "made up for a test",
          "ray_accelerator_type": "M1", "price_per_gpu_hour": 3.0}
SLO = SLOTarget(ttft_s=2.0, tpot_s=0.03, attainment=0.9)
RATE = 6.0


@pytest.fixture(scope="module")
def catalog_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("catalog") / "two_types.yaml"
    path.write_text(yaml.safe_dump({"gpus": {"Compute1": COMPUTE, "Memory1": MEMORY}}))
    return str(path)


def test_slices_cut_at_quantiles_and_bisection_finds_the_threshold():
    lengths = [(p, o) for p in (100, 200, 3000, 4000) for o in (10, 20, 500, 600)]
    slices = make_slices(lengths, 2, 2)
    assert [s.name for s in slices] == ["p0o0", "p0o1", "p1o0", "p1o1"]
    assert slices[0].prompt_range == (100, 200) and slices[3].output_range == (500, 600)
    assert math.isclose(sum(s.share for s in slices), 1.0)
    x = geometric_bisection(lambda r: r <= 7.3, 100.0, 10)
    assert 7.0 < x <= 7.3
    assert geometric_bisection(lambda r: True, 5.0, 3) == 5.0 and geometric_bisection(lambda r: False, 5.0, 3) == 0.0
    # a guess below the threshold is no cap: the bracket grows upwards, in factors of the span
    x = geometric_bisection(lambda r: r <= 37.0, 5.0, 8, span=4.0, grow=4)
    assert 36.0 < x <= 37.0
    assert geometric_bisection(lambda r: True, 5.0, 8, span=4.0, grow=2) == 80.0  # grown twice, then capped
    # arrivals span two lifetimes of a request that just meets the SLOs: TTFT + (mean output - 1) x TPOT
    assert steady_span_s(SLOTarget(15.0, 0.1, 0.9), 513) == pytest.approx(2 * (15.0 + 51.2))


def test_search_splits_pools_across_types_and_verifies_every_plan(catalog_file):
    catalog = load_catalog(catalog_file).select("Compute1,Memory1")
    space = CostSpace(catalog, "llama-3.1-8b", tensor_parallel=(1,), workers=2)
    workload = Workload(shape=workload_shape("long_doc"), num_requests=200, seed=0)
    planner = CostPlanner(space, SLO, workload, progress=False)
    result = planner.plan(RATE)
    plans = {p.name: p for p in result.plans}
    hetero, single, mixed = plans["heterogeneous"], plans["single_type"], plans["mixed"]
    # prefill on the compute type, decode on the bandwidth type: cheaper than either type alone
    assert hetero.pools["prefill"].gpu.name == "Compute1" and hetero.pools["decode"].gpu.name == "Memory1"
    assert hetero.meets_slo and hetero.attainment >= SLO.attainment and hetero.goodput >= RATE
    assert hetero.binding in ("TTFT", "TPOT") or (hetero.goodput_capped and hetero.goodput == 2 * RATE)
    assert mixed.milp_cost_per_hour <= hetero.milp_cost_per_hour <= single.milp_cost_per_hour
    assert result.best is hetero and hetero.cost_per_hour < single.cost_per_hour
    # the verification is a simulation of the whole plan, and it fails when the plan is too small
    assert planner.simulate_plan(hetero, RATE).both >= SLO.attainment
    assert planner.simulate_plan(hetero, rate=RATE * 8).both < SLO.attainment
    # every option was screened by simulation, per slice: each type is the better one at its own phase
    caps = {o.key: o.capacity for o in result.options}
    for i in range(len(result.slices)):
        assert caps["prefill Compute1 tp1"][i] > 2 * caps["prefill Memory1 tp1"][i] > 0
        assert caps["decode Memory1 tp1 no speculation"][i] > 2 * caps["decode Compute1 tp1 no speculation"][i]


def test_cost_plan_cli_writes_a_heterogeneous_config_that_ray_places_by_gpu_type(catalog_file, tmp_path):
    import ray
    from ray.cluster_utils import Cluster as RayTestCluster

    from controller.cluster import ClusterError, place_pool

    out = tmp_path / "plan.yaml"
    assert cli_main(["plan", "--objective", "cost", "--rate", str(RATE), "--model", "llama-3.1-8b",
                     "--workload", "long_doc", "--num-requests", "200", "--ttft-ms", "2000", "--tpot-ms", "30",
                     "--tensor-parallel", "1", "--gpu-catalog", catalog_file, "--out", str(out)]) == 0
    cfg = load_config(str(out))  # the loader `magicserve serve` uses accepts it
    assert (cfg.prefill.accelerator_type, cfg.decode.accelerator_type) == ("C1", "M1")
    assert cfg.prefill.devices_per_instance == cfg.decode.devices_per_instance == 1
    report = (tmp_path / "plan.md").read_text()
    assert "heterogeneous" in report and "best single type" in report and "binding SLO" in report

    # two nodes, one of each GPU type (logical resources): each pool lands only on its type's node
    nodes = RayTestCluster(initialize_head=True, head_node_args={
        "num_cpus": 64, "num_gpus": 8, "resources": {"accelerator_type:C1": 1}})
    nodes.add_node(num_cpus=64, num_gpus=8, resources={"accelerator_type:M1": 1})
    try:
        ray.init(address=nodes.address, namespace="cost-plan-test")
        node_of = {res: n["NodeID"] for n in ray.nodes() for res in n["Resources"] if res.startswith("accelerator_type:")}
        for role, pool, res in (("prefill", cfg.prefill, "accelerator_type:C1"), ("decode", cfg.decode, "accelerator_type:M1")):
            group = place_pool(role, pool, timeout_s=60)
            placed = set(ray.util.placement_group_table(group)["bundles_to_node_id"].values())
            assert placed == {node_of[res]}, (role, placed)
            ray.util.remove_placement_group(group)
        # a pool asking for a GPU type no node has is refused, naming what it asked for
        missing = cfg.decode.__class__(**{**cfg.decode.__dict__, "accelerator_type": "Z9"})
        with pytest.raises(ClusterError, match="decode: cannot place .*accelerator_type:Z9"):
            place_pool("decode", missing, timeout_s=3)
    finally:
        ray.shutdown()
        nodes.shutdown()


@pytest.mark.parametrize("extra, message", [
    ([], "--rate: required with --objective cost"),
    (["--rate", "-1", "--model", "llama-3.1-8b"], "--rate: required with --objective cost, must be > 0"),
    (["--rate", "1"], "--model: required with --objective cost"),
    (["--rate", "1", "--model", "llama-3.1-8b", "--slices", "2by2"], "--slices: expected PROMPTxOUTPUT"),
    (["--rate", "1", "--model", "llama-3.1-8b", "--gpu-types", "B200"], "--gpu-types: unknown GPU type 'B200'"),
    (["--rate", "1", "--model", "no-such-model"], "no GPU type of the selection holds the model"),
])
def test_cost_plan_cli_errors_name_the_flag(tmp_path, extra, message):
    with pytest.raises(SystemExit) as err:
        cli_main(["plan", "--objective", "cost", "--ttft-ms", "1000", "--tpot-ms", "50",
                  "--out", str(tmp_path / "p.yaml"), *extra])
    assert str(err.value).startswith(f"magicserve plan: {message}"), str(err.value)


def test_verified_costs_are_reconciled_across_plan_kinds():
    from planner.cost_search import CostPlan, PoolChoice, _reconcile
    from planner.gpu_catalog import default_catalog

    a100, l40s = default_catalog().get("A100"), default_catalog().get("L40S")

    def plan(name, p_gpu, d_gpu, n, meets=True):
        return CostPlan(name, "disaggregated", {"prefill": PoolChoice("p", p_gpu, 1, n, 1 << 16, role="prefill"),
                                                "decode": PoolChoice("d", d_gpu, 1, n, 1 << 16)}, 0.0, meets_slo=meets)

    # the per-pool plan ran one type and is cheaper once verified: it is the best single-type plan too
    plans = [plan("heterogeneous", a100, a100, 1), plan("single_type", l40s, l40s, 4)]
    _reconcile(plans)
    assert plans[1].name == "single_type" and plans[1].pools["decode"].gpu is a100
    assert plans[1].pools["decode"] is not plans[0].pools["decode"]  # a copy: growing one does not grow the other
    # the single-type plan is cheaper once verified: it is the best per-pool plan too
    plans = [plan("heterogeneous", l40s, a100, 3), plan("single_type", l40s, l40s, 1)]
    _reconcile(plans)
    assert plans[0].name == "heterogeneous" and plans[0].cost_per_hour == plans[1].cost_per_hour
    # a per-pool plan that mixes types and is cheaper stays as it is
    plans = [plan("heterogeneous", l40s, a100, 1), plan("single_type", a100, a100, 2)]
    _reconcile(plans)
    assert plans[1].pools["prefill"].gpu is a100 and plans[0].pools["prefill"].gpu is l40s
