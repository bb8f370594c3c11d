"""Cost-aware heterogeneous planning, evaluated (Mélange's question): what does serving a workload at a rate
within SLOs cost with a GPU type chosen per pool, against the best single GPU type (DistServe-like
disaggregation on one type) and the best single type colocated (vLLM-like)?

    python benchmarks/cost_plan.py --out benchmarks/results/cost_heterogeneous

For Llama-3.1-8B- and 70B-shaped models (analytical profiles of every GPU type of the default catalogue,
``planner/gpu_catalog.yaml``, at its on-demand prices), on the ``chat``, ``long_doc``, ``mixed`` and
``long_gen`` workloads (``planner/workload.py``), at three rates each and two SLO tightnesses,
``CostPlanner`` (the search behind ``magicserve plan --objective cost``) screens every option once per
(model, workload, SLO) and plans each rate; every plan is verified by simulating the whole cluster at the
rate. On ``long_gen`` the decode pool may also use sparse-KV self-speculation (budget 512, adaptive k) at an
assumed acceptance rate (``--long-gen-acceptance``): analytical profiles cannot derive one.

Writes OUT.json, OUT.md and OUT.png (cost against rate per model and workload, one line per plan kind).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402

MODELS = {"llama-3.1-8b": {"tp": (1, 2), "rate_scale": 1.0}, "llama-3.1-70b": {"tp": (2, 4, 8), "rate_scale": 0.25}}
RATES = {"chat": (4.0, 16.0, 64.0), "long_doc": (2.0, 8.0, 32.0), "mixed": (2.0, 8.0, 32.0), "long_gen": (0.25, 1.0, 4.0)}
# (TTFT s, TPOT s) per workload: loose and tight
SLOS = {"chat": {"loose": (2.0, 0.1), "tight": (0.5, 0.04)}, "long_doc": {"loose": (4.0, 0.1), "tight": (1.0, 0.04)},
        "mixed": {"loose": (4.0, 0.1), "tight": (1.0, 0.04)}, "long_gen": {"loose": (15.0, 0.1), "tight": (5.0, 0.04)}}
KINDS = ("heterogeneous", "single_type", "colocated", "mixed")
LABELS = {"heterogeneous": "GPU type per pool", "single_type": "best single type (disaggregated)",
          "colocated": "best single type, colocated", "mixed": "mixed within pools (estimate)"}


def run_point(planner, rate: float) -> dict:
    t0 = time.perf_counter()
    res = planner.plan(rate)
    row = {"rate": rate, "plan_s": time.perf_counter() - t0, "plans": {}}
    for p in res.plans:
        row["plans"][p.name] = {"describe": p.describe() if p.pools else None,
                                "cost_per_hour": p.cost_per_hour if p.pools else None,
                                "program_cost_per_hour": None if math.isnan(p.milp_cost_per_hour) else p.milp_cost_per_hour,
                                "meets_slo": p.meets_slo, "gpus": p.gpus, "binding": p.binding,
                                "goodput": None if math.isnan(p.goodput) else p.goodput,
                                "goodput_capped": p.goodput_capped, "note": p.note}
    return row


def cost_of(row: dict, kind: str) -> float | None:
    p = row["plans"].get(kind)
    if p is None or p["cost_per_hour"] is None:
        return None
    if kind == "mixed":
        return p["cost_per_hour"]
    return p["cost_per_hour"] if p["meets_slo"] else None


def write_md(result: dict, path: str) -> None:
    lines = [
        "# Cost-aware heterogeneous plans against single-type plans",
        "",
        f"Command: `{result['command']}`",
        "",
        "The search of `magicserve plan --objective cost` (`planner/cost_search.py`) on analytical "
        "profiles of every GPU type of the default catalogue at its on-demand price "
        f"({', '.join(f'{k} ${v:g}/GPU-h' for k, v in result['prices'].items())}; sources in "
        "`planner/gpu_catalog.yaml`). Per point: the cheapest plan with a GPU type per pool (what "
        "`magicserve serve` runs), the best single type disaggregated, the best single type colocated, each "
        "verified by simulating the whole cluster at the rate (an instance added to the pool of the missed SLO "
        "until the 90% attainment target is met), and the integer program's optimum when any mix of types "
        "within a pool is allowed (an estimate: not verified, the router does not weigh instances by capacity). "
        f"Slices: {result['slices']} request-size buckets. `long_gen` may use self-speculation at an assumed "
        f"acceptance rate of {result['long_gen_acceptance']:g} (budget 512).",
        "",
        "| model | workload | SLO (TTFT / TPOT) | req/s | GPU type per pool | $/h | single type | $/h | colocated | $/h "
        "| saved vs single | saved vs colocated | mixed estimate $/h |",
        "|---|---|---|---:|---|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    saved_single, saved_col = [], []
    for g in result["groups"]:
        ttft, tpot = g["slo"]
        for row in g["rows"]:
            h, s, c, m = (cost_of(row, k) for k in KINDS)
            d = {k: (row["plans"].get(k) or {}).get("describe") or "-" for k in KINDS}
            vs_s = f"{1 - h / s:+.0%}" if h and s else "-"
            vs_c = f"{1 - h / c:+.0%}" if h and c else "-"
            if h and s:
                saved_single.append((1 - h / s, g, row))
            if h and c:
                saved_col.append((1 - h / c, g, row))
            fmt = (lambda x: f"{x:.2f}" if x else "not met")
            lines.append(f"| {g['model']} | {g['workload']} | {g['tightness']} ({ttft:g} s / {tpot * 1e3:g} ms) | "
                         f"{row['rate']:g} | {d['heterogeneous']} | {fmt(h)} | {d['single_type']} | {fmt(s)} | "
                         f"{d['colocated']} | {fmt(c)} | {vs_s} | {vs_c} | {fmt(m)} |")
    lines += ["", "## Where a GPU type per pool wins, and where it does not", ""]
    if saved_single:
        wins = [x for x in saved_single if x[0] > 0.005]
        best = max(saved_single, key=lambda x: x[0])
        lines.append(f"- Against the best single type (disaggregated): cheaper at {len(wins)} of {len(saved_single)} "
                     f"points, by up to {best[0]:.0%} ({best[1]['model']}, {best[1]['workload']}, {best[1]['tightness']}, "
                     f"{best[2]['rate']:g} req/s: {best[2]['plans']['heterogeneous']['describe']}); elsewhere the same "
                     "type wins both pools and the plans coincide.")
    if saved_col:
        best = max(saved_col, key=lambda x: x[0])
        worst = min(saved_col, key=lambda x: x[0])
        lines.append(f"- Against the best single type colocated: from {worst[0]:+.0%} to {best[0]:+.0%} "
                     f"(median {sorted(x[0] for x in saved_col)[len(saved_col) // 2]:+.0%}).")
    cheapest = {"heterogeneous": 0, "colocated": 0, "tie": 0}
    low_col = high_het = 0
    for g in result["groups"]:
        for i, row in enumerate(g["rows"]):
            h, c = cost_of(row, "heterogeneous"), cost_of(row, "colocated")
            if h and c:
                key = "tie" if abs(h - c) < 0.01 else ("heterogeneous" if h < c else "colocated")
                cheapest[key] += 1
                low_col += i == 0 and key == "colocated"
                high_het += i == len(g["rows"]) - 1 and key == "heterogeneous"
    lines.append(f"- Disaggregated (a GPU type per pool) vs colocated, per point: disaggregated cheaper at "
                 f"{cheapest['heterogeneous']}, colocated cheaper at {cheapest['colocated']}, equal at {cheapest['tie']}. "
                 f"Colocated wins the lowest rate of {low_col} of {len(result['groups'])} (model, workload, SLO) groups: "
                 "a disaggregated plan rents at least one instance per pool, which a light load does not fill; "
                 f"disaggregation wins the highest rate of {high_het} of them.")
    lines += ["", "## Search time", "",
              "| model | workload | SLO | options screened | screening (s) | first plan (s) | total for one rate (s) |",
              "|---|---|---|---:|---:|---:|---:|"]
    for g in result["groups"]:
        first = g["rows"][0]["plan_s"]
        lines.append(f"| {g['model']} | {g['workload']} | {g['tightness']} | {g['options']} | {g['screen_s']:.0f} | "
                     f"{first:.0f} | {g['screen_s'] + first:.0f} |")
    slowest = max(g["screen_s"] + g["rows"][0]["plan_s"] for g in result["groups"])
    loads = sorted(g["load_avg_1min"] for g in result["groups"] if "load_avg_1min" in g)
    load = (f"; the 1-minute load average after each group: median {loads[len(loads) // 2]:.1f}, max {loads[-1]:.1f} "
            f"(on {os.cpu_count()} cores; the search's own processes count in it)") if loads else ""
    lines += ["", f"Slowest single search (`magicserve plan --objective cost` for one rate): {slowest:.0f} s "
              f"(target: under 120 s) on {result['machine']}{load}.", "",
              f"![cost](" + os.path.basename(path[:-3]) + ".png)"]
    write_lines(path, lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    models = list(dict.fromkeys(g["model"] for g in result["groups"]))
    workloads = list(dict.fromkeys(g["workload"] for g in result["groups"]))
    fig, axes = plt.subplots(len(models), len(workloads), figsize=(3.3 * len(workloads), 3.0 * len(models)),
                             squeeze=False)
    styles = {"heterogeneous": ("C0", "-", "o"), "single_type": ("C1", "--", "s"), "colocated": ("C2", ":", "^"),
              "mixed": ("C3", "-.", "x")}
    for g in result["groups"]:
        ax = axes[models.index(g["model"])][workloads.index(g["workload"])]
        for kind in KINDS:
            pts = [(row["rate"], cost_of(row, kind)) for row in g["rows"]]
            pts = [(r, c) for r, c in pts if c]
            if not pts:
                continue
            color, ls, marker = styles[kind]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, linestyle=ls, marker=marker,
                    alpha=1.0 if g["tightness"] == "tight" else 0.45,
                    label=f"{LABELS[kind]}" if g["tightness"] == "tight" else None)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([row["rate"] for row in g["rows"]])
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            axis.set_minor_formatter(ticker.NullFormatter())
        ax.set_title(f"{g['model']}, {g['workload']}", fontsize=8)
        ax.set_xlabel("req/s", fontsize=7)
        ax.set_ylabel("$/h", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.grid(True, alpha=0.3, which="both")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    fig.suptitle("Cost to serve within SLOs (bold: tight SLO, faint: loose)", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    import platform

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output path without extension")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--workloads", default=",".join(RATES))
    ap.add_argument("--tightness", default="loose,tight")
    ap.add_argument("--long-gen-acceptance", type=float, default=0.8)
    ap.add_argument("--slices", default="2x2")
    ap.add_argument("--render", action="store_true", help="rewrite OUT.md and OUT.png from OUT.json (no run)")
    args = ap.parse_args()
    if args.render:
        import json

        with open(args.out + ".json", encoding="utf-8") as f:
            result = json.load(f)
        record(result, args.out, write_md)
        plot(result, args.out + ".png")
        return 0

    from planner.analytical import parse_acceptance
    from planner.cost_search import CostPlanner, CostSpace
    from planner.gpu_catalog import default_catalog
    from planner.search import NO_SPECULATION, SLOTarget, Workload, speculation_settings
    from planner.workload import workload_shape

    catalog = default_catalog()
    p_buckets, o_buckets = (int(x) for x in args.slices.split("x"))
    acceptance, note = parse_acceptance([f"self_sparse:512:{args.long_gen_acceptance}"])
    result = {"command": "python benchmarks/cost_plan.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "slices": args.slices,
              "long_gen_acceptance": args.long_gen_acceptance,
              "prices": {t.name: t.price_per_gpu_hour for t in catalog.types}, "groups": []}
    for model in args.models.split(","):
        for wl in args.workloads.split(","):
            for tightness in args.tightness.split(","):
                ttft, tpot = SLOS[wl][tightness]
                long_gen = wl == "long_gen"
                space = CostSpace(catalog, model, tensor_parallel=MODELS[model]["tp"],
                                  speculation=speculation_settings(acceptance, fixed_ks=()) if long_gen
                                  else (NO_SPECULATION,),
                                  acceptance=acceptance if long_gen else (), acceptance_note=note if long_gen else "",
                                  prompt_buckets=p_buckets, output_buckets=o_buckets)
                planner = CostPlanner(space, SLOTarget(ttft, tpot, 0.9), Workload(shape=workload_shape(wl),
                                                                                  num_requests=300, seed=0))
                print(f"== {model} {wl} {tightness}", file=sys.stderr, flush=True)
                t0 = time.perf_counter()
                options, _ = planner.screen()
                group = {"model": model, "workload": wl, "tightness": tightness, "slo": [ttft, tpot],
                         "screen_s": time.perf_counter() - t0, "options": len(options), "skipped": planner.skipped,
                         "rows": []}
                for rate in RATES[wl]:
                    group["rows"].append(run_point(planner, rate * MODELS[model]["rate_scale"]))
                group["load_avg_1min"] = os.getloadavg()[0]  # other work on the cores slows the searches
                result["groups"].append(group)
    record(result, args.out, write_md)
    plot(result, args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
