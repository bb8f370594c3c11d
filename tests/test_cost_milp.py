"""The cost-minimising packing (Mélange's integer program) on small instances whose optimum is known by hand."""

from __future__ import annotations

import pytest

from planner.cost_milp import InstanceOption, PackingError, PackingProblem, Slice, solve_packing

SLICES = (Slice("short", 10.0), Slice("long", 10.0))
# A: cheap, fast on short requests, slow on long ones; B: dear, the reverse
A = InstanceOption("A", "decode", "gpuA", 1, 1.0, (10.0, 1.0))
B = InstanceOption("B", "decode", "gpuB", 1, 3.0, (2.0, 10.0))


def test_mixing_types_by_request_size_beats_any_single_type():
    # A alone: 10/10 + 10/1 = 11 instances ($11); B alone: 10/2 + 10/10 = 6 ($18); A for short and B for long:
    # one of each ($4)
    mixed = solve_packing(PackingProblem(SLICES, (A, B), ("decode",), mixing="mixed"))
    assert mixed.counts == {"A": 1, "B": 1} and mixed.cost_per_hour == pytest.approx(4.0)
    assert mixed.shares[("A", "short")] == pytest.approx(1.0) and mixed.shares[("B", "long")] == pytest.approx(1.0)
    assert mixed.load(PackingProblem(SLICES, (A, B), ("decode",)), "A") <= 1.0 + 1e-9
    for rule in ("one_per_pool", "one_type"):
        single = solve_packing(PackingProblem(SLICES, (A, B), ("decode",), mixing=rule))
        assert single.counts == {"A": 11} and single.cost_per_hour == pytest.approx(11.0)


def test_fractional_slices_fill_instances_before_renting_more():
    # short 15 req/s: A serves 10 per instance; with 2 A instances there is half an instance spare, which takes
    # 0.5 req/s of long (cap 1) rather than renting B for it
    slices = (Slice("short", 15.0), Slice("long", 0.5))
    p = solve_packing(PackingProblem(slices, (A, B), ("decode",)))
    assert p.counts == {"A": 2} and p.cost_per_hour == pytest.approx(2.0)


def test_gpu_limits_bind():
    limited = PackingProblem(SLICES, (A, B), ("decode",), gpu_limits={"gpuA": 5}, mixing="one_per_pool")
    p = solve_packing(limited)
    assert p.counts == {"B": 6} and p.cost_per_hour == pytest.approx(18.0)
    assert solve_packing(PackingProblem(SLICES, (A, B), ("decode",), gpu_limits={"gpuA": 5, "gpuB": 5},
                                        mixing="one_per_pool")) is None


def test_pools_may_differ_in_type_unless_one_type_is_required():
    slices = (Slice("all", 8.0),)
    options = (InstanceOption("P-x", "prefill", "x", 1, 1.0, (8.0,)),   # x: cheap prefill, 1 instance
               InstanceOption("P-y", "prefill", "y", 1, 2.0, (4.0,)),   # y: 2 instances, $4
               InstanceOption("D-x", "decode", "x", 2, 4.0, (2.0,)),    # x: 4 instances of 2 GPUs, $16
               InstanceOption("D-y", "decode", "y", 1, 2.0, (4.0,)))    # y: 2 instances, $4
    per_pool = solve_packing(PackingProblem(slices, options, ("prefill", "decode"), mixing="one_per_pool"))
    assert per_pool.counts == {"P-x": 1, "D-y": 2} and per_pool.cost_per_hour == pytest.approx(5.0)
    one = solve_packing(PackingProblem(slices, options, ("prefill", "decode"), mixing="one_type"))
    assert one.counts == {"P-y": 2, "D-y": 2} and one.cost_per_hour == pytest.approx(8.0)


def test_unservable_slice_is_infeasible_and_bad_fields_are_named():
    never = InstanceOption("C", "decode", "gpuC", 1, 1.0, (5.0, 0.0))
    assert solve_packing(PackingProblem(SLICES, (never,), ("decode",))) is None
    with pytest.raises(PackingError, match=r"^mixing: must be one of"):
        PackingProblem(SLICES, (A,), ("decode",), mixing="any")
    with pytest.raises(PackingError, match=r"^options.A.capacity"):
        PackingProblem(SLICES, (InstanceOption("A", "decode", "g", 1, 1.0, (1.0,)),), ("decode",))
    with pytest.raises(PackingError, match=r"^options.A.pool"):
        PackingProblem(SLICES, (A,), ("prefill",))
