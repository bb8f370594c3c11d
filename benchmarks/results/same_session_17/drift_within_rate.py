"""The machine's speed inside one rate: the prefill role's measured / profiled pass time per 20 s of the pass
log (prefill passes of the disaggregated sweep, mixed passes of the colocated one), session 16's long_doc sweeps
against session 14's profile. Run from the repository root: python benchmarks/results/same_session_17/drift_within_rate.py"""
import gzip
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
from controller.planner.interference import pass_row, predicted_s  # noqa: E402
from controller.planner.profile import Profile  # noqa: E402

WINDOW_S = 20.0
profile = Profile.load(os.path.join(ROOT, "benchmarks/results/same_session_14/profile_local_cpu.json"))
for name in ("slo_long_doc_disagg_spec", "slo_long_doc_colocated"):
    with gzip.open(os.path.join(ROOT, "benchmarks/results/same_session_16", name + ".passes.json.gz"), "rt") as f:
        rates = json.load(f)
    print(f"{name}: measured / profiled time of the passes, per {WINDOW_S:g} s window")
    for rate in rates:
        rows = [pass_row(r) for i in rate["instances"] for r in i["records"] if r["kind"] in ("prefill", "mixed")]
        t0 = min(r["end_s"] - r["seconds"] for r in rows)
        windows: dict[int, list[float]] = {}
        for r in rows:
            w = windows.setdefault(int((r["end_s"] - r["seconds"] - t0) // WINDOW_S), [0.0, 0.0])
            w[0] += r["seconds"]
            w[1] += predicted_s(profile, r)
        ratios = [m / p for _, (m, p) in sorted(windows.items())]
        mean = sum(m for m, _ in windows.values()) / sum(p for _, p in windows.values())
        print(f"  {rate['rate']:>4g} req/s: mean {mean:.2f}; windows " + " ".join(f"{v:.2f}" for v in ratios)
              + f"  (range {min(ratios) / mean:.2f}-{max(ratios) / mean:.2f} of the mean)")
