# Run from the repository root: PYTHONPATH=. python benchmarks/results/same_session_18/yield_passes.py SWEEP.json ...
"""Prefill passes of a sweep: measured / profiled at 1 and 2 threads, by whether decode was busy at the pass's start."""
import statistics, sys
from benchmarks import _pass_logs
from controller.planner.interference import pass_row, intervals
from controller.planner.profile import Profile, prefill_features
import json, bisect

prof = Profile.load("benchmarks/results/same_session_18/profile_local_cpu_threads.json")
for path in sys.argv[1:]:
    sweep = json.load(open(path))
    logs = _pass_logs.load(path, sweep)
    print("==", path)
    for idx, lg in enumerate(logs):
        rows = _pass_logs.rows_of(lg["instances"])
        dec = intervals([r for r in rows if r["kind"] in ("step",)])
        starts = [a for a, b in dec]
        out = {True: [], False: []}
        for r in rows:
            if r["kind"] != "prefill":
                continue
            s = r["end_s"] - r["seconds"]
            i = bisect.bisect_right(starts, s) - 1
            busy = i >= 0 and dec[i][1] > s
            out[busy].append((r["seconds"] / prof.prefill_model(2).predict(r), r["seconds"] / prof.prefill_model(1).predict(r)))
        txt = []
        for busy in (False, True):
            v = out[busy]
            if v:
                txt.append(f"decode {'busy' if busy else 'idle'}: n={len(v)} meas/tp2 {statistics.median(a for a,_ in v):.2f} meas/tp1 {statistics.median(b for _,b in v):.2f}")
        print(sweep["rates"][idx]["rate"], "; ".join(txt))
