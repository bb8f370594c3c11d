"""How much the colocated instances slowed each other in this morning's long_doc sweeps, against what each
calibration's contention terms charge for the same passes (README section 1).

For every rate of each colocated sweep: the contention terms fitted to the sweep's own passes
(``interference.fit_contention_terms``, as a calibration fits its burst's), and the time-weighted mean slowdown
of the passes over the rate's alone passes, measured and as the generic-burst (session 19) and long_doc-burst
(this session) calibrations price it.

Then the passes split by what a step mostly computed (its prefill chunks' share of the step's priced time) and
by whether the other instance was busy, for the generic burst and the sweeps' loaded rates; and a fit with one
busy term per part of a step (prefill share x busy share, decode share x busy share) to the generic burst,
applied to the sweeps: does a per-part term fitted to a decode-heavy burst transfer to a prefill-heavy load?

    PYTHONPATH=. python benchmarks/results/same_session_20/contention_in_sweeps.py
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

from benchmarks import _pass_logs  # noqa: E402
from controller.planner.interference import (activities, contention_variable, fit_contention_terms,  # noqa: E402
                                             output_variable, reference_ratios)
from controller.planner.calibrate import BURST_PASS_KINDS, burst_passes_kind, passes_key  # noqa: E402
from controller.planner.interference import timed_rows  # noqa: E402
from controller.planner.profile import Profile, mixed_pass_seconds  # noqa: E402

HERE = "benchmarks/results/same_session_20"
SWEEPS = ("benchmarks/results/same_session_19/slo_long_doc_colocated.json", f"{HERE}/slo_long_doc_colocated_2.json",
          f"{HERE}/slo_long_doc_colocated_3.json")
PROFILES = {"generic burst (s19)": "benchmarks/results/same_session_19/profile_today.json",
            "long_doc burst (s20)": f"{HERE}/profile_s20.json"}


def priced_slowdown(cal, acts) -> float:
    """Time-weighted mean of the slowdown the calibration's terms charge the passes, given what the other
    instance did during each (``sim_instances._Instance._contention``)."""
    w = np.array([a.seconds for a in acts])
    f = np.array([(cal.contention_scale - 1.0) * a.other_busy_share + cal.contention_step_s * contention_variable(a)
                  + cal.contention_output_s * output_variable(a) for a in acts])
    return float((w * f).sum() / w.sum())


def prefill_share(p: Profile, row: dict) -> float:
    """The share of a mixed step's priced time that its prefill chunks take (0: a decode-only step)."""
    pm, dm = p.prefill_model(1), p.target_model(1)
    seqs, kv = int(row["decode_seqs"]), int(row["decode_kv_tokens"])
    whole = mixed_pass_seconds(pm, dm, row, seqs, kv, 1.0, 1.0)
    decode = mixed_pass_seconds(pm, dm, None, seqs, kv, 1.0, 1.0) if seqs else 0.0
    return max(0.0, 1.0 - decode / whole)


def split_table(p: Profile, name: str, rows: list[dict]) -> str:
    """Time-weighted measured / profiled time of the passes, by dominant part and the other's busy share."""
    acts = activities(p, rows, tps={"colocated": 1})
    timed = [r for _, mine in timed_rows(rows) for r in mine]
    cells: dict = {}
    for a, r in zip(acts, timed):
        s = prefill_share(p, r)
        part = "prefill" if s > 0.8 else "decode" if s < 0.2 else None
        state = "alone" if a.other_busy_share < 0.1 else "busy" if a.other_busy_share > 0.9 else None
        if part and state:
            cells.setdefault((part, state), []).append(a)
    out = []
    for part in ("prefill", "decode"):
        vals = [cells.get((part, st), []) for st in ("alone", "busy")]
        out.append(" -> ".join(f"{sum(a.seconds for a in v) / sum(a.seconds / a.ratio for a in v):.2f}" if v else "-"
                               for v in vals) + f" ({len(vals[0])} / {len(vals[1])})")
    return f"| {name} | " + " | ".join(out) + " |"


def per_part_fit(p: Profile, rows: list[dict]):
    """(x, y, w): per pass, [prefill share x busy, decode share x busy] and its slowdown over the alone
    reference, weighted by time (``fit_contention_terms``'s y and w)."""
    acts = activities(p, rows, tps={"colocated": 1})
    timed = [r for _, mine in timed_rows(rows) for r in mine]
    ref = reference_ratios(acts)["mixed"]
    s = np.array([prefill_share(p, r) for r in timed])
    b = np.array([a.other_busy_share for a in acts])
    x = np.stack([b * s, b * (1.0 - s)], 1)
    y = np.clip(np.array([a.ratio / ref - 1.0 for a in acts]), -0.5, 2.0)
    return x, y, np.array([a.seconds for a in acts])


def main() -> int:
    os.chdir(ROOT)
    profiles = {name: Profile.load(path) for name, path in PROFILES.items()}
    for name, p in profiles.items():
        c = p.calibration("colocated")
        print(f"{name}: contention {c.contention_summary()} (fit RMS {c.contention_fit_error:.2f}, "
              f"{c.contention_requests}-request {c.contention_workload or 'generic'} burst)")
    base = next(iter(profiles.values()))
    print("\n| sweep | rate | passes | other busy | own fit | measured slowdown | " +
          " | ".join(f"priced: {n}" for n in profiles) + " |")
    print("|---|---:|---:|---:|---|---:|" + "---:|" * len(profiles))
    for path in SWEEPS:
        logs = _pass_logs.load(path, json.load(open(path)))
        for rate in logs:
            acts = activities(base, _pass_logs.rows_of(rate["instances"]), tps={"colocated": 1})
            ref = reference_ratios(acts)["mixed"]
            w = np.array([a.seconds for a in acts])
            measured = float((w * (np.array([a.ratio for a in acts]) / ref - 1.0)).sum() / w.sum())
            fit = fit_contention_terms(acts)
            own = f"{fit.busy_scale:.2f}x + {1e3 * fit.step_s:.1f} ms/step + {1e3 * fit.output_s:.2f} ms/output"
            busy = float(np.mean([a.other_busy_share for a in acts]))
            priced = " | ".join(f"{priced_slowdown(p.calibration('colocated'), acts):.3f}" for p in profiles.values())
            print(f"| {os.path.basename(path).replace('slo_long_doc_', '').replace('.json', '')} | {rate['rate']} | "
                  f"{len(acts)} | {busy:.2f} | {own} | {measured:.3f} | {priced} |")

    generic = profiles["generic burst (s19)"]
    burst = [{"kind": k, **row} for k in BURST_PASS_KINDS
             for row in generic.samples.get(passes_key("colocated", burst_passes_kind(k), 1), [])]
    print("\nmeasured / profiled time, alone -> other instance busy (passes alone / busy):\n")
    print("| passes of | mostly prefill (> 80 %) | mostly decode (< 20 %) |\n|---|---|---|")
    print(split_table(generic, "generic burst (s19 calibration)", burst))
    loaded = []
    for path in SWEEPS:
        logs = _pass_logs.load(path, json.load(open(path)))
        for rate in logs:
            if rate["rate"] >= 0.6:
                rows = _pass_logs.rows_of(rate["instances"])
                loaded.append((f"{os.path.basename(path).replace('slo_long_doc_', '').replace('.json', '')} "
                               f"{rate['rate']}", rows))
                print(split_table(generic, loaded[-1][0], rows))

    x, y, w = per_part_fit(generic, burst)
    coef = np.linalg.lstsq(x * np.sqrt(w)[:, None], y * np.sqrt(w), rcond=None)[0]
    print(f"\nper-part busy terms fitted to the generic burst: prefill {1 + coef[0]:.2f}x, decode {1 + coef[1]:.2f}x")
    print("\n| sweep rate | measured mean slowdown | priced by the per-part terms |\n|---|---:|---:|")
    for name, rows in loaded:
        x, y, w = per_part_fit(generic, rows)
        print(f"| {name} | {(w * y).sum() / w.sum():.3f} | {(w * (x @ coef)).sum() / w.sum():.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
