"""The prefill's lone passes (decode idle all through the pass) in place, measured / profiled, by predicted
pass time: a calibration burst's stored passes against an SLO sweep's (README section 1).

    PYTHONPATH=. python benchmarks/results/same_session_19/before_fixes/pass_sizes.py \
        benchmarks/results/same_session_19/before_fixes/generic_burst_samples.json \
        benchmarks/results/same_session_19/slo_long_doc_disagg_spec_prefill2_run3.json \
        > benchmarks/results/same_session_19/before_fixes/pass_sizes.txt

generic_burst_samples.json: the core-sharing samples of the generic burst (core_sharing_burst.md, run 3) as
profile_today.json held them before the long_doc burst replaced them.
"""

import bisect
import json
import statistics
import sys

from benchmarks.core_sharing_in_place import sweep_rows
from controller.planner.interference import intervals, predicted_s
from controller.planner.profile import Profile

PROFILE = "benchmarks/results/same_session_19/profile_today.json"  # its 2-thread cost models price the passes
TPS = {"prefill": 2, "decode": 1}


def lone_ratios(profile: Profile, rows: list[dict]) -> dict[int, list[float]]:
    """Measured / profiled time of prefill passes no decode step overlaps, by predicted time (50 ms bins)."""
    steps = intervals([r for r in rows if r["kind"] == "step"])
    ends = [b for _, b in steps]
    out: dict[int, list[float]] = {}
    for r in rows:
        if r["kind"] != "prefill":
            continue
        start, end = r["end_s"] - r["seconds"], r["end_s"]
        i = bisect.bisect_right(ends, start)
        if i < len(steps) and steps[i][0] < end:
            continue  # a decode step overlaps it
        pred = predicted_s(profile, r, None, TPS)
        out.setdefault(min(4, int(pred / 0.05)), []).append(r["seconds"] / pred)
    return out


def main() -> None:
    profile = Profile.load(PROFILE)
    samples = json.load(open(sys.argv[1]))
    burst = [{"kind": k, **r} for k in ("prefill", "step") for r in samples[f"core_sharing/P2+D1/passes/{k}"]]
    print("predicted ms | burst: passes, median ratio | sweep: passes, median ratio")
    b, s = lone_ratios(profile, burst), lone_ratios(profile, sweep_rows(sys.argv[2]))
    for k in sorted(set(b) | set(s)):
        cell = lambda d: f"{len(d.get(k, []))}, {statistics.median(d[k]):.2f}" if d.get(k) else "0, -"  # noqa: E731
        print(f"{50 * k}{'+' if k == 4 else f'-{50 * k + 50}'} | {cell(b)} | {cell(s)}")


if __name__ == "__main__":
    main()
