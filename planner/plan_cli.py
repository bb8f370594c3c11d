"""``magicserve plan``: arguments, validation and the run (the search itself is ``search.Planner``)."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys

from controller.config import CONFIG_DIR, LOCAL_CONFIG
from planner.analytical import acceptance_from_profile
from planner.cost_output import cost_plan_config, write_cost_plan
from planner.cost_search import CostPlanner, CostSpace
from planner.gpu_catalog import CatalogError, load_catalog
from planner.plan_output import plan_config, write_plan
from planner.profile import Profile, ProfileError, describe_shape
from planner.search import (NO_SPECULATION, Planner, PlanError, SearchSpace, SLOTarget, Workload, describe_spec,
                            speculation_settings, speculation_space)
from planner.reuse_workload import REUSE_WORKLOADS
from planner.workload import WORKLOADS, load_trace, workload_shape


def _int_list(flag: str):
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: expected comma-separated integers, got {text!r}") from None
        if not values or any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(f"{flag}: values must be >= 1, got {text!r}")
        return values
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--objective", choices=("goodput", "cost"), default="goodput",
                   help="goodput: the most goodput per device of one profile's hardware (needs --profile); cost: the "
                        "cheapest GPU types, counts and settings per pool serving --rate (needs --rate and --model)")
    p.add_argument("--profile", help="profile JSON from `magicserve profile` (measured or --analytical); "
                                     "--objective goodput")
    cost = p.add_argument_group("--objective cost")
    cost.add_argument("--rate", type=float, help="target request rate (req/s) the plan must serve within the SLOs")
    cost.add_argument("--model", help="model shape: llama-3.1-8b, llama-3.1-70b or an HF checkpoint dir")
    cost.add_argument("--gpu-catalog", help="GPU catalogue YAML overriding the default one field by field "
                                            "(planner/gpu_catalog.yaml)")
    cost.add_argument("--gpu-types", help="GPU types to consider, NAME[:PRICE_PER_GPU_HOUR[:MAX_GPUS]] comma-separated, "
                                          "e.g. H100:4.0,A100:1.8:16,L4 (default: every catalogue type at its price)")
    cost.add_argument("--acceptance-from", help="measured profile whose acceptance rates let the search try "
                                                "speculative decoding (default: no speculation)")
    cost.add_argument("--slices", default="2x2", help="request-size slices, PROMPTxOUTPUT buckets (default 2x2)")
    cost.add_argument("--workers", type=int, default=2, help="processes screening options in parallel")
    p.add_argument("--nodes", type=int, default=1, help="nodes in the cluster")
    p.add_argument("--devices-per-node", type=int, default=None,
                   help="GPUs per node (CPU profile: worker cores); default: the profile's devices_per_node")
    p.add_argument("--ttft-ms", type=float, required=True, help="TTFT SLO")
    p.add_argument("--tpot-ms", type=float, required=True, help="TPOT SLO (mean per output token after the first)")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both SLOs")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", default="long_doc", choices=sorted(WORKLOADS) + sorted(REUSE_WORKLOADS),
                     help="synthetic workload shape (multi_turn, shared_docs: prompts that repeat earlier ones, "
                          "planned with prefix caching on)")
    src.add_argument("--trace", default=None, help="JSON-lines trace (arrival_s, prompt_tokens, output_tokens)")
    p.add_argument("--num-requests", type=int, default=200, help="requests per simulation (synthetic workloads)")
    p.add_argument("--min-duration-s", type=float, default=Workload.min_duration_s,
                   help="arrivals of a synthetic workload span at least this long at every simulated rate (more "
                        "requests than --num-requests at high rates): longer measures sustained rates, shorter "
                        "plans faster")
    p.add_argument("--cv", type=float, default=1.0, help="arrival-gap coefficient of variation (1 = Poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel", type=_int_list("--tensor-parallel"), default=(1, 2, 4, 8),
                   help="TP degrees to search, e.g. 1,2,4,8 (GPU: those the profile lacks are an error; CPU: the "
                        "profile's measured instance shapes of these degrees)")
    p.add_argument("--no-speculation", action="store_true",
                   help="search without speculative decoding (DistServe's search space)")
    p.add_argument("--no-colocated", action="store_true", help="do not compare against colocated baselines")
    p.add_argument("--max-concurrent", type=int, default=256, help="router admission limit in the plan")
    p.add_argument("--verify-top", type=int, default=4, help="best estimates verified by full simulation")
    p.add_argument("--base-config", default=None,
                   help="cluster YAML the plan is applied to (model, server, limits); default: local.yaml for a "
                        "CPU profile, gpu-8xa100-llama3.1-8b.yaml for a GPU one")
    p.add_argument("--out", required=True, help="where to write the planned cluster YAML")
    p.add_argument("--report", default=None, help="markdown report (default: OUT with .md); a .json sits beside it")


def run(args: argparse.Namespace) -> int:
    if args.objective == "cost":
        return run_cost(args)
    if not args.profile:
        raise SystemExit("magicserve plan: --profile is required with --objective goodput")
    profile = Profile.load(args.profile)
    devices = args.nodes * (args.devices_per_node or profile.devices_per_node)
    for flag, value, lo in (("--nodes", args.nodes, 1), ("--num-requests", args.num_requests, 10),
                            ("--verify-top", args.verify_top, 1), ("--max-concurrent", args.max_concurrent, 1)):
        if value < lo:
            raise SystemExit(f"magicserve plan: {flag} must be >= {lo}, got {value}")
    slo = SLOTarget(args.ttft_ms / 1e3, args.tpot_ms / 1e3, args.attainment)
    workload = _workload(args)
    specs = speculation_space(profile) if not args.no_speculation else speculation_space(profile)[:1]
    shapes: tuple = ()
    if profile.device_type == "cpu":  # the instance shapes the profile measured (ranks x threads per rank)
        measured = sorted(c.shape for c in profile.instances)
        shapes = tuple(s for s in measured if s[0] in args.tensor_parallel and math.prod(s) <= devices)
        if not shapes:
            raise SystemExit(f"magicserve plan: --tensor-parallel {','.join(map(str, args.tensor_parallel))}: the "
                             f"profile measured CPU instances of (tp, threads) {measured} (add others with "
                             f"`magicserve profile --add-threads` or `--add-tensor-parallel`)")
    space = SearchSpace(devices=devices, tensor_parallel=args.tensor_parallel, shapes=shapes, speculation=specs,
                        include_colocated=not args.no_colocated, max_concurrent=args.max_concurrent)
    described = [describe_shape(*s) for s in shapes] or [f"tp{t}" for t in args.tensor_parallel]
    print(f"planning for {devices} devices ({profile.hardware}); instances of {', '.join(described)}"
          + f"; {len(specs)} speculation settings: "
          + "; ".join(describe_spec(s) for s in specs), file=sys.stderr)
    result = Planner(profile, slo, workload, space, verify_top=args.verify_top).run()
    base = args.base_config or (LOCAL_CONFIG if profile.device_type == "cpu"
                                else os.path.join(CONFIG_DIR, "gpu-8xa100-llama3.1-8b.yaml"))
    raw = plan_config(result.best, base, args.out, profile, slo)
    report = args.report or os.path.splitext(args.out)[0] + ".md"
    command = "magicserve plan " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    write_plan(result, raw, args.out, report, profile, slo, workload, command)
    print(f"plan: {result.best.describe()}: {result.best.goodput:.3f} req/s ({result.best.per_device:.3f} per device)")
    print(f"wrote {args.out} and {report}")
    return 0


def _workload(args):
    for flag, value in (("--cv", args.cv), ("--min-duration-s", args.min_duration_s)):
        if not value > 0:
            raise SystemExit(f"magicserve plan: {flag} must be > 0, got {value}")
    if args.trace:
        return Workload(trace=tuple(load_trace(args.trace)), cv=args.cv, seed=args.seed)
    if args.workload in REUSE_WORKLOADS:
        return Workload(reuse=args.workload, num_requests=args.num_requests, seed=args.seed,
                        min_duration_s=args.min_duration_s)
    return Workload(shape=workload_shape(args.workload), num_requests=args.num_requests, cv=args.cv, seed=args.seed,
                    min_duration_s=args.min_duration_s)


def run_cost(args: argparse.Namespace) -> int:
    """``--objective cost``: the cheapest plan for ``--rate`` (``planner/cost_search.py``)."""
    def fail(msg: str) -> SystemExit:
        return SystemExit(f"magicserve plan: {msg}")

    if args.rate is None or not (args.rate > 0 and math.isfinite(args.rate)):
        raise fail(f"--rate: required with --objective cost, must be > 0 req/s, got {args.rate}")
    if not args.trace and args.workload in REUSE_WORKLOADS:
        raise fail(f"--workload {args.workload}: --objective cost plans request sizes by slices, which a workload "
                   f"with reuse does not split into; plan it with --objective goodput")
    if not args.model:
        raise fail("--model: required with --objective cost (llama-3.1-8b, llama-3.1-70b or an HF checkpoint dir)")
    try:
        p_buckets, o_buckets = (int(x) for x in args.slices.lower().split("x"))
    except ValueError:
        raise fail(f"--slices: expected PROMPTxOUTPUT bucket counts such as 2x2, got {args.slices!r}") from None
    try:
        catalog = load_catalog(args.gpu_catalog)
        if args.gpu_types:
            catalog = catalog.select(args.gpu_types)
        acceptance, note = acceptance_from_profile(args.acceptance_from) if args.acceptance_from else ((), "")
        specs = speculation_settings(acceptance, max_ks=(4,), fixed_ks=()) if acceptance else (NO_SPECULATION,)
        space = CostSpace(catalog, args.model, tensor_parallel=args.tensor_parallel, speculation=specs,
                          acceptance=acceptance, acceptance_note=note, include_colocated=not args.no_colocated,
                          prompt_buckets=p_buckets, output_buckets=o_buckets, max_concurrent=args.max_concurrent,
                          workers=args.workers)
        slo = SLOTarget(args.ttft_ms / 1e3, args.tpot_ms / 1e3, args.attainment)
        workload = _workload(args)
        print(f"planning the cheapest cluster for {args.rate:g} req/s of {workload.describe()}: GPU types "
              + ", ".join(f"{t.name} ${t.price_per_gpu_hour:g}/h" for t in catalog.types)
              + f"; decode speculation: {'; '.join(describe_spec(s) for s in space.speculation)}", file=sys.stderr)
        result = CostPlanner(space, slo, workload).plan(args.rate)
        base = args.base_config or os.path.join(CONFIG_DIR, "gpu-8xa100-llama3.1-8b.yaml")
        raw = cost_plan_config(result.best, space, base, args.out, slo)
    except (CatalogError, ProfileError, PlanError) as err:
        raise fail(str(err)) from None
    report = args.report or os.path.splitext(args.out)[0] + ".md"
    command = "magicserve plan " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    write_cost_plan(result, raw, args.out, report, space, slo, workload, command)
    best = result.best
    print(f"plan: {best.describe()}: ${best.cost_per_hour:.2f}/h on {best.gpus} GPUs "
          f"(simulated attainment {best.attainment:.1%} at {args.rate:g} req/s)")
    print(f"wrote {args.out} and {report}")
    return 0
