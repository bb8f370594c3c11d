"""Worst |simulated - measured| attainment (both SLOs) per sweep and speed window, from runs/s17/sims.sh's outputs."""
import glob, json, os, re, sys

here = os.path.dirname(os.path.abspath(__file__))
rows = {}
for path in sorted(glob.glob(os.path.join(here, "sim_validation_*_w*.json"))):
    name, window = re.match(r"sim_validation_(.+)_w(\w+)\.json", os.path.basename(path)).groups()
    d = json.load(open(path))
    rows.setdefault(name, {})[window] = (100 * d["max_abs_diff_both"], sum(abs(r["diff"]["both"]) <= 0.05 + 1e-9 for r in d["rows"]), len(d["rows"]))
windows = sorted({w for r in rows.values() for w in r}, key=lambda w: (w != "rate", float(w) if w != "rate" else 0))
print("| sweep | " + " | ".join("per rate" if w == "rate" else f"{w} s windows" for w in windows) + " |")
print("|---|" + "---:|" * len(windows))
for name, r in rows.items():
    print(f"| {name} | " + " | ".join(f"{r[w][0]:.1f} ({r[w][1]}/{r[w][2]})" if w in r else "-" for w in windows) + " |")
for w in windows:
    vals = [r[w] for r in rows.values() if w in r]
    print(f"{'per rate' if w == 'rate' else w + ' s'}: sweeps within 5 points at every rate {sum(v[0] <= 5 + 1e-7 for v in vals)}/{len(vals)}, "
          f"rates within 5 {sum(v[1] for v in vals)}/{sum(v[2] for v in vals)}, mean worst gap {sum(v[0] for v in vals) / len(vals):.1f}")
