"""What ``magicserve plan --objective cost`` writes: the cheapest servable plan as a cluster YAML (each pool
bound to its GPU type through Ray's ``accelerator_type`` resource, validated by the loader ``magicserve
serve`` uses), and a report of every option screened and every plan compared, with cost, attainment and the
binding SLO."""

from __future__ import annotations

import math
import os

from controller.config import load_config, parse_config, to_dict
from planner.cost_search import CostPlan, CostPlanResult, CostSpace, PoolChoice
from planner.plan_output import write_plan_files
from planner.search import SLOTarget, Workload, spec_to_dict

PLAN_LABELS = {"heterogeneous": "heterogeneous (a GPU type per pool)", "single_type": "best single type",
               "colocated": "best single type, colocated", "mixed": "mixed within pools (estimate)"}


def _pool_fields(pool: PoolChoice) -> dict:
    return {"instances": pool.instances, "tensor_parallel": pool.tp, "devices_per_instance": pool.tp,
            "kv_cache_tokens": pool.kv_tokens, "accelerator_type": pool.gpu.ray_accelerator_type}


def cost_plan_config(plan: CostPlan, space: CostSpace, base_config_path: str, out_path: str,
                     slo: SLOTarget) -> dict:
    """The base config with the plan's pools, GPU types, speculation and SLOs. The model path is re-based
    so the file works from ``out_path``'s directory; ``space.model`` replaces it when it is a checkpoint
    directory. Validated (raises ConfigError) before it is returned."""
    base = load_config(base_config_path)
    raw = to_dict(base)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if os.path.isdir(space.model):
        raw["model"]["path"] = os.path.relpath(os.path.abspath(space.model), out_dir)
    elif not os.path.isabs(base.model.path):
        raw["model"]["path"] = os.path.relpath(base.model_path, out_dir)
    raw["mode"] = plan.mode
    if plan.mode == "colocated":
        c = plan.pools["colocated"]
        raw["colocated"].update(_pool_fields(c), token_budget=space.prefill_token_budget,
                                max_num_seqs=space.decode_max_num_seqs)
    else:
        p, d = plan.pools["prefill"], plan.pools["decode"]
        raw["prefill"].update(_pool_fields(p), token_budget=space.prefill_token_budget,
                              max_num_seqs=space.prefill_max_prompts)
        raw["decode"].update(_pool_fields(d), max_num_seqs=space.decode_max_num_seqs)
        if d.spec is not None:
            raw["decode"]["speculation"] = spec_to_dict(d.spec)
    raw["slo"] = {"ttft_ms": slo.ttft_s * 1e3, "tpot_ms": slo.tpot_s * 1e3, "attainment": slo.attainment}
    raw["limits"]["max_concurrent_requests"] = space.max_concurrent
    if raw["ray"].get("num_gpus") is None and not raw["ray"].get("address"):
        raw["ray"]["num_gpus"] = plan.gpus
    parse_config(raw)  # the same validation `magicserve serve` applies
    return raw


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def savings(result: CostPlanResult) -> dict:
    """$/h of the verified plans that meet the SLO, and the heterogeneous plan's saving over each baseline."""
    cost = {p.name: p.cost_per_hour for p in result.plans if p.meets_slo}
    out = {"cost_per_hour": cost}
    if "heterogeneous" in cost:
        for base in ("single_type", "colocated"):
            if base in cost and cost[base] > 0:
                out[f"vs_{base}"] = 1 - cost["heterogeneous"] / cost[base]
    return out


def report_markdown(result: CostPlanResult, space: CostSpace, slo: SLOTarget, workload: Workload,
                    command: str) -> str:
    best = result.best
    lines = [
        "# magicserve plan --objective cost", "",
        f"`{command}`", "",
        f"- model: {space.model}; workload: {workload.describe()} at **{result.rate:g} req/s**",
        f"- SLOs: TTFT <= {slo.ttft_s * 1e3:.0f} ms, TPOT <= {slo.tpot_s * 1e3:.0f} ms, attainment target "
        f"{slo.attainment:.0%}",
        f"- **chosen: {best.describe()}**, ${best.cost_per_hour:.2f}/h on {best.gpus} GPUs "
        f"({PLAN_LABELS[best.name]}; simulated attainment {best.attainment:.1%})", "",
        "## GPU types", "",
        "| type | $/GPU-h | max GPUs | Ray accelerator_type | price source |", "|---|---:|---:|---|---|",
    ]
    for t in space.catalog.types:
        src = t.price_sources[0] if t.price_sources else "-"
        lines.append(f"| {t.name} | {t.price_per_gpu_hour:.2f} | {t.max_gpus or 'any'} | {t.ray_accelerator_type} | "
                     f"{src} |")
    for name, why in result.skipped.items():
        lines.append(f"\n{name} left out: {why}")
    lines += ["", "## Plans", "",
              "Cost from the integer program, then the whole plan simulated at the rate; while it missed the target, "
              "an instance was added where it raised attainment most (decode for a TPOT miss; prefill or decode for a TTFT "
              "miss). Goodput: the highest rate the plan serves "
              "within the target (simulated, up to 2x the rate); binding SLO: the one that fails first above it.", "",
              "| plan | pools | GPUs | $/h | program's $/h | attainment at the rate | goodput (req/s) | binding SLO "
              "| note |",
              "|---|---|---:|---:|---:|---:|---:|---|---|"]
    def att(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.1%}"

    for p in result.plans:
        lines.append(f"| {PLAN_LABELS[p.name]} | {p.describe() if p.pools else '-'} | {p.gpus} | "
                     f"{_fmt(p.cost_per_hour)} | {_fmt(p.milp_cost_per_hour)} | {att(p.attainment)} | "
                     f"{'>= ' if p.goodput_capped else ''}{_fmt(p.goodput)} | {p.binding} | {p.note} |")
    s = savings(result)
    for base in ("single_type", "colocated"):
        if f"vs_{base}" in s:
            lines.append(f"\nHeterogeneous plan vs {PLAN_LABELS[base]}: {s[f'vs_{base}']:+.1%} cost saved.")
    lines += ["", "## Request slices", "", "| slice | prompt tokens | output tokens | share | req/s |",
              "|---|---|---|---:|---:|"]
    for sl in result.slices:
        lines.append(f"| {sl.name} | {sl.prompt_range[0]}-{sl.prompt_range[1]} | {sl.output_range[0]}-"
                     f"{sl.output_range[1]} | {sl.share:.1%} | {sl.share * result.rate:.2f} |")
    lines += ["", "## Options screened", "",
              "Capacity: the highest rate one instance sustains for the slice within the SLO target (simulated; "
              "prefill on TTFT with decode non-binding, decode and colocated on both SLOs).", "",
              "| option | GPUs | $/h | " + " | ".join(f"{sl.name} (req/s)" for sl in result.slices) + " |",
              "|---|---:|---:|" + "---:|" * len(result.slices)]
    for o in result.options:
        lines.append(f"| {o.key} | {o.gpus} | {o.price_per_hour:.2f} | " +
                     " | ".join(f"{c:.2f}" for c in o.capacity) + " |")
    return "\n".join(lines) + "\n"


def report_json(result: CostPlanResult, slo: SLOTarget, workload: Workload, command: str) -> dict:
    def plan(p: CostPlan) -> dict:
        return {"name": p.name, "describe": p.describe() if p.pools else None, "mode": p.mode, "gpus": p.gpus,
                "cost_per_hour": p.cost_per_hour if p.pools else None,
                "program_cost_per_hour": None if math.isnan(p.milp_cost_per_hour) else p.milp_cost_per_hour,
                "meets_slo": p.meets_slo, "verified": p.name != "mixed" and bool(p.pools),
                "attainment": None if math.isnan(p.attainment) else p.attainment,
                "ttft_attainment": None if math.isnan(p.ttft_attainment) else p.ttft_attainment,
                "tpot_attainment": None if math.isnan(p.tpot_attainment) else p.tpot_attainment,
                "goodput_rps": None if math.isnan(p.goodput) else p.goodput, "goodput_capped": p.goodput_capped,
                "binding_slo": p.binding,
                "added_instances": p.added, "note": p.note,
                "pools": {k: {"option": v.option, "gpu": v.gpu.name, "tp": v.tp, "instances": v.instances}
                          for k, v in p.pools.items()}}

    return {"command": command, "rate": result.rate,
            "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment},
            "workload": workload.describe(), "best": result.best.name, "savings": savings(result),
            "plans": [plan(p) for p in result.plans],
            "slices": [{"name": s.name, "prompt": s.prompt_range, "output": s.output_range, "share": s.share}
                       for s in result.slices],
            "options": [{"key": o.key, "gpus": o.gpus, "price_per_hour": o.price_per_hour,
                         "capacity_rps": list(o.capacity)} for o in result.options],
            "skipped": result.skipped}


def write_cost_plan(result: CostPlanResult, raw_config: dict, out_path: str, report_path: str, space: CostSpace,
                    slo: SLOTarget, workload: Workload, command: str) -> None:
    best = result.best
    header = (f"# Generated by `{command}`\n"
              f"# Plan: {best.describe()}; ${best.cost_per_hour:.2f}/h on {best.gpus} GPUs for {result.rate:g} req/s "
              f"at {slo.attainment:.0%} attainment of\n"
              f"# TTFT <= {slo.ttft_s * 1e3:.0f} ms and TPOT <= {slo.tpot_s * 1e3:.0f} ms, workload "
              f"{workload.describe()}.\n"
              f"# Each pool runs on its GPU type (accelerator_type: Ray's accelerator_type:<name> node resource). "
              f"Report: {os.path.basename(report_path)}\n")
    write_plan_files(out_path, header, raw_config, report_path, report_markdown(result, space, slo, workload, command),
                     report_json(result, slo, workload, command))
