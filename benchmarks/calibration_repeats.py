"""How much the simulator's agreement with the recorded SLO sweeps depends on one calibration run.

    python benchmarks/calibration_repeats.py --repeats 3 --out benchmarks/results/calibration_repeats

Each repeat calibrates both modes afresh through the real cluster (``controller/planner/calibrate.py``:
isolated requests, then a burst of overlapping ones for the contention factor), starting from the same
measured profile, and replays every recorded sweep through the simulator (``benchmarks/sim_validate.py``)
twice: with the fitted contention factor, and with it set to 1 (the same isolated terms, no contention
term). Reported per repeat and sweep: the largest |simulated - measured| attainment over the swept
rates, and at how many rates the simulated attainment lies inside the measured one's 95 % interval.
Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record  # noqa: E402
from benchmarks.sim_validate import compare  # noqa: E402
from controller.config import load_config  # noqa: E402
from controller.planner.calibrate import calibrate  # noqa: E402
from controller.planner.profile import Calibration, Profile  # noqa: E402
from controller.planner.simulator import SimConfig  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
# the recorded sweeps and the cluster configs they ran (sim_validation_*.md name the same pairs)
SWEEPS = (("slo_chat_colocated", "local-colocated"), ("slo_chat_disagg_spec", "local"),
          ("slo_long_doc_colocated", "local-colocated"), ("slo_long_doc_disagg", "local-no-spec"),
          ("slo_long_doc_disagg_spec", "local"))


def validate(profile: Profile, seeds: int) -> dict[str, dict]:
    """Largest attainment gap (points) and rates inside the measured 95 % interval, per recorded sweep."""
    out = {}
    for sweep, config in SWEEPS:
        with open(os.path.join(RESULTS, sweep + ".json"), encoding="utf-8") as f:
            recorded = json.load(f)
        sim_config = SimConfig.from_cluster_config(load_config(os.path.join(ROOT, "cluster_configs", config + ".yaml")))
        r = compare(recorded, profile, sim_config, seeds)
        out[sweep] = {"max_gap_pts": 100 * r["max_abs_diff_both"], "inside_ci95": r["inside_ci95_both"],
                      "rates": len(r["rows"]), "gaps_pts": [100 * row["diff"]["both"] for row in r["rows"]]}
    return out


def write_markdown(result: dict, path: str) -> None:
    lines = ["# Simulator agreement across calibration runs", "", f"`{result['command']}`", "",
             f"Base profile `{result['profile']}`; each repeat calibrates both modes afresh ({result['calibration_requests']} "
             f"isolated requests, a {result['burst_requests']}-request burst) and replays the recorded sweeps "
             f"({result['seeds']} simulator seeds per rate). Cells: largest |simulated - measured| attainment "
             f"on both SLOs over the swept rates (points), and in brackets the rates where the simulation lies "
             f"inside the measured attainment's 95 % interval.", "",
             "| repeat | disaggregated: prefill / decode scale, contention | colocated: prefill / decode scale, contention | contention term | "
             + " | ".join(s for s, _ in SWEEPS) + " |",
             "|---:|---|---|---|" + "---:|" * len(SWEEPS)]
    for rep in result["repeats"]:
        cal = {c["mode"]: c for c in rep["calibrations"]}
        terms = [f"{cal[m]['prefill_scale']:.2f} / {cal[m]['decode_scale']:.2f}, {Calibration(**cal[m]).contention_summary()}"
                 if m in cal else "-" for m in ("disaggregated", "colocated")]
        for key, label in (("with_contention", "fitted"), ("without_contention", "1 (off)")):
            cells = [f"{v['max_gap_pts']:.1f} ({v['inside_ci95']}/{v['rates']})" for v in rep[key].values()]
            lines.append(f"| {rep['repeat']} | {terms[0]} | {terms[1]} | {label} | " + " | ".join(cells) + " |")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=os.path.join(RESULTS, "profile_local_cpu.json"),
                    help="measured profile whose calibrations are redone (the file is not modified)")
    ap.add_argument("--configs", nargs="+", default=["cluster_configs/local.yaml", "cluster_configs/local-colocated.yaml"],
                    help="one cluster config per mode to calibrate")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calibration-requests", type=int, default=16)
    ap.add_argument("--burst-requests", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=5, help="simulations per swept rate")
    ap.add_argument("--out", required=True, help="output prefix (.json, .md)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats: must be >= 1")
    base = Profile.load(args.profile)
    repeats = []
    for i in range(args.repeats):
        t0 = time.time()
        profile = base
        for path in args.configs:
            cal = calibrate(load_config(os.path.join(ROOT, path)), base, requests=args.calibration_requests,
                            burst_requests=args.burst_requests, seed=i).calibration
            profile = profile.with_calibration(cal)
        repeats.append({"repeat": i + 1, "calibrations": [dataclasses.asdict(c) for c in profile.calibrations],
                        "with_contention": validate(profile, args.seeds),
                        "without_contention": validate(profile.without_contention(), args.seeds),
                        "seconds": time.time() - t0})
        print(f"repeat {i + 1}: " + ", ".join(f"{s} {v['max_gap_pts']:.1f}"
                                              for s, v in repeats[-1]["with_contention"].items()), flush=True)
    result = {"command": "python benchmarks/calibration_repeats.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "profile": os.path.relpath(args.profile, ROOT), "calibration_requests": args.calibration_requests,
              "burst_requests": args.burst_requests, "seeds": args.seeds, "repeats": repeats}
    record(result, args.out, write_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
