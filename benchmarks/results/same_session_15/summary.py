"""Session 15's simulator-vs-measured figures from the saved sim_validate outputs in this folder. Run from the
repository root: python benchmarks/results/same_session_15/summary.py"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SPEEDS = ("none", "probe", "load_v1", "load")
SINGLE = ["chat_colocated_1", "chat_colocated_2", "chat_colocated_3", "chat_disagg_spec_1", "chat_disagg_spec_2",
          "chat_disagg_spec_3", "long_doc_disagg_spec_low"]
POOLED = ["chat_colocated_pooled", "chat_disagg_spec_pooled"]


def load(name, speed):
    with open(os.path.join(HERE, f"sim_validation_{name}_{speed}.json")) as f:
        return json.load(f)


print("worst |simulated - measured| attainment (both SLOs), points:")
print(f"{'sweep':28s}" + "".join(f"{s:>9s}" for s in SPEEDS))
for name in SINGLE + POOLED:
    print(f"{name:28s}" + "".join(f"{100 * load(name, s)['max_abs_diff_both']:9.1f}" for s in SPEEDS))
for s in SPEEDS:
    gaps = [load(n, s)["max_abs_diff_both"] for n in SINGLE]
    rates = [abs(r["diff"]["both"]) for n in SINGLE for r in load(n, s)["rows"]]
    print(f"{s}: mean single-sweep worst gap {100 * sum(gaps) / len(gaps):.1f}; sweeps within 5 points "
          f"{sum(g <= 0.05 + 1e-9 for g in gaps)} of {len(gaps)}; rates within 5 points "
          f"{sum(d <= 0.05 + 1e-9 for d in rates)} of {len(rates)}")
print("\nload (final): per rate measured / simulated (diff), factors by role")
for name in SINGLE:
    print(name)
    for r in load(name, "load")["rows"]:
        (e,) = r["speed"]
        roles = ", ".join(f"{k} {v:.3f}" for k, v in e["by_role"].items())
        print(f"  {r['rate']:g} req/s: {r['measured']['both']:.3f} / {r['simulated']['both']:.3f} "
              f"({100 * r['diff']['both']:+.1f}); TTFT p50 ms {r['measured_latency_ms']['ttft_p50']:.0f} / "
              f"{r['simulated_latency_ms']['ttft_p50']:.0f}; factor {e['factor']:.3f} ({roles})")
