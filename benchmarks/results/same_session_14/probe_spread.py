"""The figures of README.md's "How precise a probe is": over the probe sets of runs 1-3 and the long_doc sweep,
each probe's TTFT over its set's median, by its place in the set. Run from the repository root:

    python benchmarks/results/same_session_14/probe_spread.py > benchmarks/results/same_session_14/probe_spread.txt
"""
import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
paths = sorted(glob.glob(os.path.join(HERE, "slo_chat_*_[123].json")))
paths.append(os.path.join(HERE, "slo_long_doc_disagg_spec_low.json"))
by_place: dict[int, list[float]] = {}
sets = 0
for path in paths:
    sweep = json.load(open(path))
    for probes in [r["speed_probe"] for r in sweep["rates"]] + [sweep["speed_probe_after"]]:
        sets += 1
        median = statistics.median(p["ttft_s"] for p in probes)
        for i, p in enumerate(probes):
            by_place.setdefault(i, []).append(p["ttft_s"] / median)
print(f"{sets} probe sets from {len(paths)} sweeps; TTFT / the set's median, by place in the set:")
for i, v in sorted(by_place.items()):
    print(f"probe {i + 1}: {len(v)} probes, mean {statistics.fmean(v):.3f}, standard deviation {statistics.pstdev(v):.3f}")
