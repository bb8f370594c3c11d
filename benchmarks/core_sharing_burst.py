"""How repeatable the served core-sharing calibration is (``magicserve profile --calibrate-only`` with a
shared config, ``controller/planner/calibrate_sharing.py``): the burst run several times, each run's factors
recorded beside the profile's other entries of the pair (two processes; an SLO sweep's, if stored).

    python benchmarks/core_sharing_burst.py --profile PROFILE.json --config cluster_configs/local-prefill2.yaml \
        --repeats 3 --out benchmarks/results/same_session_19/core_sharing_burst [--update-profile]

Each run serves the config afresh (Ray + gRPC on localhost) and sends its own burst (seed = run index).
``--update-profile`` stores the last run's entry, with its samples, in PROFILE.json. Writes OUT.json and
OUT.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402
from controller.config import load_config  # noqa: E402
from controller.planner.calibrate_sharing import (SHARING_BURST_REQUESTS, calibrate_sharing, shared_pair,  # noqa: E402
                                                  with_sharing)
from controller.planner.profile import Profile  # noqa: E402
from controller.planner.workload import WORKLOADS  # noqa: E402

FIELDS = ("prefill_factor", "decode_factor", "prefill_scale")


def write_markdown(result: dict, path: str) -> None:
    p, d = result["pair"]
    lines = ["# Core sharing calibrated by a served burst, repeated", "", f"`{result['command']}`", "",
             f"{result['machine']}; prefill {p} + decode {d} threads on {result['cores']} cores; "
             f"{result['burst_requests']} requests a burst, lengths "
             f"{'of workload ' + result['burst_workload'] if result.get('burst_workload') else 'of the calibration (prompts log-uniform up to 4096 tokens, outputs 17/33/65)'}.", "",
             "| run | prefill factor | decode factor | prefill scale (decode idle) | prefill / decode passes overlapping the other role | seconds |",
             "|---|---:|---:|---:|---|---:|"]
    for r in result["runs"]:
        lines.append(f"| {r['run']} | {r['prefill_factor']:.2f}x | {r['decode_factor']:.2f}x | {r['prefill_scale']:.2f}x "
                     f"| {r['prefill_units']} / {r['decode_units']} | {r['seconds']:.0f} |")
    s = result["summary"]
    lines.append("| median (min-max) | " + " | ".join(f"{s[f][1]:.2f}x ({s[f][0]:.2f}-{s[f][2]:.2f})" for f in FIELDS)
                 + " | | |")
    for c in result["other_entries"]:
        lines.append(f"| profile: {c['source']} | {c['prefill_factor']:.2f}x | {c['decode_factor']:.2f}x "
                     f"| {c['prefill_scale']:.2f}x | {c['prefill_units']} / {c['decode_units']} | |")
    write_lines(path, lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="a profile with --add-threads and the mode's calibration")
    ap.add_argument("--config", required=True, help="a config whose prefill and decode threads outnumber the cores")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--burst-requests", type=int, default=SHARING_BURST_REQUESTS)
    ap.add_argument("--burst-workload", choices=sorted(WORKLOADS), default=None,
                    help="draw the burst's lengths from this workload's shape (default: the generic calibration lengths)")
    ap.add_argument("--update-profile", action="store_true", help="store the last run's entry in --profile")
    ap.add_argument("--out", required=True, help="output path without extension")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats: must be >= 1, got {args.repeats}")
    config, profile = load_config(args.config), Profile.load(args.profile)
    pair = shared_pair(config, profile.devices_per_node)
    if pair is None:
        ap.error(f"--config: its instances have a core per thread on the profile's {profile.devices_per_node} cores")
    runs, last = [], None
    for run in range(1, args.repeats + 1):
        t0 = time.perf_counter()
        entry, samples = calibrate_sharing(config, profile, args.burst_requests, seed=run - 1,
                                           workload=args.burst_workload)
        runs.append({"run": run, "seconds": time.perf_counter() - t0, **entry.__dict__})
        last = (entry, samples)
    summary = {f: [min(r[f] for r in runs), statistics.median(r[f] for r in runs), max(r[f] for r in runs)]
               for f in FIELDS}
    others = [c.__dict__ for c in profile.core_sharing if (c.prefill_threads, c.decode_threads) == pair]
    result = {"command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "pair": list(pair), "cores": profile.devices_per_node, "burst_requests": args.burst_requests,
              "burst_workload": args.burst_workload,
              "runs": runs, "summary": summary, "other_entries": others}
    record(result, args.out, write_markdown)
    if args.update_profile:
        with_sharing(profile, *last).save(args.profile)
        print(f"stored run {len(runs)}'s burst core sharing of P{pair[0]} + D{pair[1]} in {args.profile}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
