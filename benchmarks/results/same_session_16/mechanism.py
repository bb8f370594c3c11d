"""Why the long_doc goodputs of session 16 differ: at the lowest swept rate (0.1 req/s, little queueing), which
requests miss the 3 s TTFT and the 50 ms TPOT SLO, by prompt length, per system; and how fast the prefill passes
ran with 1 and 2 threads. Run from the repository root:
python benchmarks/results/same_session_16/mechanism.py > benchmarks/results/same_session_16/mechanism.txt"""
import gzip
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ["colocated", "colocated_1x2", "vllm", "disagg_spec", "disagg_spec_prefill2", "disagg_prefill2"]
LONG = 3900  # prompt tokens; the workload clips at 4096


def sweep(name):
    with open(os.path.join(HERE, f"slo_long_doc_{name}.json")) as f:
        return json.load(f)


first = sweep(SYSTEMS[0])["rates"][0]["records"]
n_long = sum(r["prompt_tokens"] >= LONG for r in first)
print(f"trace: {len(first)} requests a rate; {n_long} with prompts >= {LONG} tokens "
      f"({sum(r['prompt_tokens'] == 4096 for r in first)} clipped at 4096)\n")
print(f"at 0.1 req/s: requests missing TTFT 3 s (all / of the {n_long} long ones), TTFT of the long ones (s), "
      "requests missing TPOT 50 ms, TPOT p90 (ms)")
for name in SYSTEMS:
    s = sweep(name)
    recs = s["rates"][0]["records"]
    long_ttft = sorted(round(r["ttft_s"], 2) for r in recs if r["prompt_tokens"] >= LONG)
    miss = [r for r in recs if r["ttft_s"] > 3.0]
    tpot = sorted(r["tpot_s"] for r in recs)
    print(f"  {s['settings']['label']:50s} {len(miss):2d} / {sum(r['prompt_tokens'] >= LONG for r in miss)}  "
          f"{long_ttft}  {sum(t > 0.05 for t in tpot):2d}  {1e3 * tpot[int(0.9 * (len(tpot) - 1))]:.1f}")

print("\nprefill passes at 0.1 req/s: median ms of a 512-token chunk by its start position (K tokens), "
      "from the workers' pass logs")
for name in ("disagg_spec", "disagg_spec_prefill2"):
    with gzip.open(os.path.join(HERE, f"slo_long_doc_{name}.passes.json.gz")) as f:
        rate = json.load(f)[0]
    by = {}
    for inst in rate["instances"]:
        for rec in inst["records"]:
            if rec["kind"] == "prefill":
                for start, length in rec["shape"]["chunks"]:
                    if length == 512 and len(rec["shape"]["chunks"]) == 1:
                        by.setdefault(start // 512, []).append(rec["seconds"])
    row = "  ".join(f"{k / 2:g}K: {1e3 * statistics.median(v):.0f}" for k, v in sorted(by.items()))
    print(f"  {sweep(name)['settings']['label']:50s} {row}")
