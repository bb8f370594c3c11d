"""Simulated plans for a GPU node: magicserve's search space (disaggregation + speculation settings)
against DistServe's (disaggregation, no speculation) and the best colocated configuration, on the same
simulator and profile.

    python benchmarks/plan_compare.py --profile benchmarks/results/profile_h100_llama31_8b.json \\
        --devices 8 --out benchmarks/results/plan_8xh100_llama31_8b

For each workload: the planner's chosen configuration in both search spaces with its simulated goodput
per GPU, and attainment-vs-rate curves of the chosen configurations (simulated). Writes OUT.md,
OUT.json and OUT.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._slo_plots import _pyplot  # noqa: E402
from planner.profile import Profile  # noqa: E402
from planner.search import (Candidate, Planner, SearchSpace, SLOTarget, Workload,  # noqa: E402
                                       speculation_space)
from planner.simulator import simulate  # noqa: E402
from planner.slo import attainment  # noqa: E402
from planner.workload import workload_shape  # noqa: E402

# SLOs per workload for a Llama-3.1-8B-class model on current GPUs (chat: interactive; long_doc:
# summarisation, a looser TTFT for multi-thousand-token prompts); override with --slo.
DEFAULT_SLOS = {"chat": (250.0, 25.0), "long_doc": (1000.0, 25.0)}


def curve(profile: Profile, cand: Candidate, workload: Workload, slo: SLOTarget, rates: list[float]) -> list[float]:
    out = []
    for r in rates:
        res = simulate(profile, cand.config, workload.at_rate(r), seed=workload.seed, time_limit_s=600)
        out.append(attainment(res.outcomes(), slo.ttft_s, slo.tpot_s).both)
    return out


def run_workload(profile: Profile, name: str, slo: SLOTarget, devices: int, args) -> dict:
    workload = Workload(shape=workload_shape(name), num_requests=args.num_requests, seed=args.seed)
    common = dict(devices=devices, tensor_parallel=tuple(args.tp))
    spaces = {
        "magicserve (disaggregation + speculation)": SearchSpace(
            speculation=speculation_space(profile, fixed_ks=tuple(args.fixed_k)), **common),
        "DistServe space (disaggregation, no speculation)": SearchSpace(include_colocated=False, **common),
    }
    results = {label: Planner(profile, slo, workload, space, verify_top=args.verify_top).run()
               for label, space in spaces.items()}
    colocated = [c for c in results["magicserve (disaggregation + speculation)"].candidates
                 if c.config.mode == "colocated" and not math.isnan(c.goodput)]
    chosen = {label: r.best for label, r in results.items()}
    disagg_spec = [c for c in results["magicserve (disaggregation + speculation)"].candidates
                   if c.config.mode == "disaggregated" and not math.isnan(c.goodput)]
    if disagg_spec:  # what speculation adds to disaggregation, whichever mode the planner chose
        chosen["best disaggregated (magicserve space)"] = max(disagg_spec, key=lambda c: c.per_device)
    if colocated:
        chosen["best colocated"] = max(colocated, key=lambda c: c.per_device)
    top = max(c.goodput for c in chosen.values())
    rates = [top * f for f in (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5)]
    return {
        "workload": name, "slo": {"ttft_ms": slo.ttft_s * 1e3, "tpot_ms": slo.tpot_s * 1e3, "attainment": slo.attainment},
        "chosen": {label: {"describe": c.describe(), "goodput_rps": c.goodput, "per_gpu_rps": c.per_device,
                           "devices": c.devices} for label, c in chosen.items()},
        "curves": {"rates": rates, **{label: curve(profile, c, workload, slo, rates) for label, c in chosen.items()}},
        "candidates_compared": {label: len(r.candidates) for label, r in results.items()},
    }


def write_outputs(report: dict, prefix: str) -> None:
    with open(prefix + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    lines = [f"# Simulated plans: {report['devices']} x {report['device_type']}, {report['model']}", "",
             f"`{report['command']}`", "", f"Profile: {report['hardware']} ({report['source']}). {report['notes']}", "",
             "| workload | SLO TTFT / TPOT (ms) | search space | chosen configuration | goodput (req/s) | per GPU |",
             "|---|---|---|---|---:|---:|"]
    for w in report["workloads"]:
        for label, c in w["chosen"].items():
            lines.append(f"| {w['workload']} | {w['slo']['ttft_ms']:g} / {w['slo']['tpot_ms']:g} | {label} | {c['describe']} "
                         f"| {c['goodput_rps']:.2f} | {c['per_gpu_rps']:.3f} |")
        theirs = w["chosen"]["DistServe space (disaggregation, no speculation)"]["per_gpu_rps"]
        for label, what in (("magicserve (disaggregation + speculation)", "magicserve's plan vs DistServe's"),
                            ("best disaggregated (magicserve space)", "best disaggregated plan with speculation settings vs DistServe's")):
            if label in w["chosen"] and theirs > 0:
                ours = w["chosen"][label]["per_gpu_rps"]
                lines.append(f"| {w['workload']} | | **ratio** | {what} | | **{ours / theirs:.2f}x** |")
    lines += ["", "Goodput: highest Poisson rate with >= 90 % of requests meeting both SLOs (simulated).", ""]
    with open(prefix + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(report["workloads"]), figsize=(6 * len(report["workloads"]), 4.2), squeeze=False)
    for ax, w in zip(axes[0], report["workloads"]):
        rates = w["curves"]["rates"]
        for label in w["chosen"]:
            ax.plot(rates, w["curves"][label], "o-", label=f"{label}: {w['chosen'][label]['describe']}")
        ax.axhline(0.9, color="grey", ls=":", lw=0.8)
        ax.set_title(f"{w['workload']}: TTFT {w['slo']['ttft_ms']:g} ms, TPOT {w['slo']['tpot_ms']:g} ms")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (simulated)")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(prefix + ".png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=os.path.join(ROOT, "benchmarks/results/profile_h100_llama31_8b.json"))
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--workloads", nargs="+", default=["chat", "long_doc"], choices=sorted(DEFAULT_SLOS))
    ap.add_argument("--slo", action="append", default=[], metavar="WORKLOAD:TTFT_MS:TPOT_MS")
    ap.add_argument("--fixed-k", type=int, nargs="*", default=[2],
                    help="fixed speculation lengths searched beside adaptive k (per measured budget)")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--verify-top", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="output prefix")
    args = ap.parse_args(argv)
    slos = dict(DEFAULT_SLOS)
    for item in args.slo:
        try:
            name, ttft, tpot = item.split(":")
            slos[name] = (float(ttft), float(tpot))
        except ValueError:
            ap.error(f"--slo: expected WORKLOAD:TTFT_MS:TPOT_MS, got {item!r}")
    profile = Profile.load(args.profile)
    report = {"command": "python benchmarks/plan_compare.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
              "devices": args.devices, "device_type": profile.device_type, "model": profile.model,
              "hardware": profile.hardware, "source": profile.source, "notes": profile.notes,
              "workloads": [run_workload(profile, w, SLOTarget(slos[w][0] / 1e3, slos[w][1] / 1e3), args.devices, args)
                            for w in args.workloads]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_outputs(report, args.out)
    print(open(args.out + ".md", encoding="utf-8").read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
