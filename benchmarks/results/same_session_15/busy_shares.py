"""Busy shares of the workers from a sweep's pass logs beside the simulated utilisation (unscaled profile).
Run from the repository root: python benchmarks/results/same_session_15/busy_shares.py"""
import gzip, json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
os.chdir(HERE)
for name in sys.argv[1:] or ['slo_chat_disagg_spec_1', 'slo_chat_colocated_1', 'slo_chat_disagg_spec_3']:
    logs = json.load(gzip.open(f"{name}.passes.json.gz"))
    val = json.load(open(f"sim_validation_{name.replace('slo_','')}_none.json"))
    print(name)
    for rate, row in zip(logs, val["rows"]):
        out = []
        for inst in rate["instances"]:
            recs = inst["records"]
            t0 = min(r["end_s"] - r["seconds"] for r in recs); t1 = max(r["end_s"] for r in recs)
            span = t1 - t0
            passes = sum(r["seconds"] for r in recs if r["kind"] != "step")
            steps = sum(r["seconds"] for r in recs if r["kind"] == "step")
            nsteps = sum(r["kind"] in ("step", "mixed", "prefill") for r in recs)
            out.append(f"{inst['name']}: span {span:.0f}s passes {passes/span:.0%} steps {steps/span:.0%} n {nsteps} ({nsteps/span:.0f}/s)")
        print(f"  {rate['rate']:g}: " + " | ".join(out) + f" | sim util {json.dumps({k: round(v,2) for k,v in row['simulated_utilisation'].items()})}")
