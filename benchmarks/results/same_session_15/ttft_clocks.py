"""TTFT p50 on the client's clock and on the server's (its usage report, from arrival at the router), chat at
2-4 req/s: where the time below capacity is spent. Run from the repository root:
python benchmarks/results/same_session_15/ttft_clocks.py"""
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
for name in ("slo_chat_colocated_1", "slo_chat_disagg_spec_1"):
    with open(os.path.join(HERE, name + ".json")) as f:
        sweep = json.load(f)
    for row in sweep["rates"][:3]:
        ok = [r for r in row["records"] if r["ttft_s"] is not None]
        print(f"{name} {row['rate']:g} req/s: TTFT p50 client {1e3 * statistics.median(r['ttft_s'] for r in ok):.0f} ms, "
              f"server {1e3 * statistics.median(r['server_ttft_s'] for r in ok):.0f} ms")
