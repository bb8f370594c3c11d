"""Core sharing in place: how much a prefill and a decode instance sharing the cores slow each other while
served, from recorded SLO sweeps' pass logs (``controller/planner/core_sharing.in_place``), beside the two-
process measurement the profile holds.

    python benchmarks/core_sharing_in_place.py --sweep SWEEP.json [SWEEP2.json ...] \
        --profile PROFILE.json --config cluster_configs/local-prefill2.yaml --out OUT [--update-profile]

Per sweep and pooled over the sweeps: each role's factor (how much slower its passes progress while the other
role is busy, fitted to each pass's overlap with the other role's work) and the prefill's in-place scale. ``--update-profile`` stores the pooled
entry in PROFILE.json as the pair's ``served`` core sharing, which the simulator then prefers
(``Profile.sharing``). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import _pass_logs  # noqa: E402
from benchmarks._record import record, write_lines  # noqa: E402
from controller.config import load_config  # noqa: E402
from controller.planner.core_sharing import in_place  # noqa: E402
from controller.planner.profile import Profile  # noqa: E402


def sweep_rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        sweep = json.load(f)
    logs = _pass_logs.load(path, sweep)
    if not logs:
        raise SystemExit(f"--sweep {path}: no pass logs beside it (sweeps record them since session 15)")
    return [r for rate in logs for r in _pass_logs.rows_of(rate["instances"])]  # in_place reads kinds and times


def write_markdown(result: dict, path: str) -> None:
    pm = result["processes"]
    lines = ["# Core sharing in place", "", f"`{result['command']}`", "",
             f"Prefill {result['prefill_threads']} + decode {result['decode_threads']} threads on {result['cores']} "
             f"cores. Between two plain processes (the profile): prefill {pm['prefill_factor']:.2f}x, decode "
             f"{pm['decode_factor']:.2f}x slower while the other role is busy.", "",
             "| sweep | prefill factor | decode factor | prefill scale (decode idle) | prefill / decode passes overlapping the other role |",
             "|---|---:|---:|---:|---|"]
    for name, c in result["served"].items():
        lines.append(f"| {name} | {c['prefill_factor']:.2f}x | {c['decode_factor']:.2f}x | {c['prefill_scale']:.2f}x "
                     f"| {c['prefill_units']} / {c['decode_units']} |")
    write_lines(path, lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", nargs="+", required=True, help="SLO sweep JSONs with pass logs, of one config")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--config", required=True, help="the cluster config the sweeps served")
    ap.add_argument("--out", required=True, help="output path without extension")
    ap.add_argument("--update-profile", action="store_true", help="store the pooled entry in --profile")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    profile = Profile.load(args.profile)
    p, d, cores = cfg.prefill.threads, cfg.decode.threads, profile.devices_per_node
    if (cfg.prefill.instances, cfg.decode.instances) != (1, 1) or p + d <= cores:
        ap.error(f"--config: one prefill and one decode instance whose threads outnumber the profile's {cores} cores")
    drafter = cfg.decode.speculation.drafter if cfg.decode.speculation.enabled else None
    served, pooled = {}, []
    for path in args.sweep:
        rows = sweep_rows(path)
        pooled += rows
        served[os.path.relpath(path, ROOT)] = in_place(profile, rows, p, d, cores, drafter).__dict__
    entry = in_place(profile, pooled, p, d, cores, drafter)
    if len(args.sweep) > 1:
        served["pooled"] = entry.__dict__
    processes = next((c for c in profile.core_sharing if (c.prefill_threads, c.decode_threads) == (p, d)
                      and c.source == "processes"), None)
    result = {"command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
              "prefill_threads": p, "decode_threads": d, "cores": cores, "served": served,
              "processes": processes.__dict__ if processes else {"prefill_factor": float("nan"), "decode_factor": float("nan")}}
    record(result, args.out, write_markdown)
    if args.update_profile:
        kept = tuple(c for c in profile.core_sharing
                     if not ((c.prefill_threads, c.decode_threads) == (p, d) and c.source == "served"))
        dataclasses.replace(profile, core_sharing=kept + (entry,)).save(args.profile)
        print(f"stored the served core sharing of P{p} + D{d} in {args.profile}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
