"""How far two real runs of the same trace land apart: the measurement's own floor for sim validation.

    python benchmarks/sweep_repeat.py FIRST.json SECOND.json [MORE.json ...] --out benchmarks/results/sweep_repeat

``benchmarks/sim_validate.py`` asks the simulator to land within 5 points of a measured sweep at every
rate. Its Wilson interval covers the luck of which requests were drawn, but the simulator replays the
very same requests (arrivals, prompt and output lengths), so that luck is shared. What it cannot share
is the real cluster's run-to-run timing: near a saturation cliff a request's TTFT sits close to the SLO,
and a few per cent of machine speed flip it. This script measures that directly: sweeps of one trace
(same workload, seed, request count and rates; checked request by request), served more than once,
compared rate by rate against the first. Pass runs of the same configuration for the pure floor; runs of
configurations the simulator treats alike (e.g. with and without speculation on a prefill-bound
workload) are labelled by their own settings. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402
from benchmarks.sim_validate import KEYS, wilson_interval  # noqa: E402
from benchmarks.slo_sweep import attainment_of  # noqa: E402

TRACE_FIELDS = ("arrival_s", "prompt_tokens", "output_tokens")


class SweepMismatch(ValueError):
    pass


def trace_of(row: dict) -> list[tuple]:
    return sorted(tuple(r[f] for f in TRACE_FIELDS) for r in row["records"])


# what every sweep pooled rate by rate must share with the first: the same workload, arrival process and SLOs
SAME_DRAW_SETTINGS = ("workload", "trace", "cv", "ttft_slo_ms", "tpot_slo_ms", "cores")
# what a sweep must share with an earlier one of its draw (the same requests) to extend it
SAME_TRACE_SETTINGS = ("workload", "trace", "seed", "num_requests", "cv", "ttft_slo_ms", "tpot_slo_ms")


def check_same_trace(first: dict, other: dict, name: str) -> None:
    """Raise SweepMismatch naming the field when ``other`` did not replay ``first``'s trace."""
    _check_same_requests(first, other, name, SAME_TRACE_SETTINGS + ("rates",))


def check_pool(sweeps: list[dict], names: list[str]) -> list[bool]:
    """Check that ``sweeps`` may be pooled rate by rate, raising SweepMismatch naming the sweep and the field
    otherwise. Every sweep must draw the first's workload (``SAME_DRAW_SETTINGS``). A sweep with an earlier
    sweep's seed (or of the same recorded trace) sends that sweep's requests: a trace's lengths depend on the
    seed alone, its arrivals on the seed and the rate (``workload.make_trace``), so at the rates both ran they
    must match request by request (a repeat), and its other rates extend that draw. A sweep with a seed not
    seen before adds another draw (other lengths and arrivals), at any rates. Per sweep: True where it
    extends or repeats an earlier sweep's draw, False where it starts one."""
    first = sweeps[0].get("settings", {})
    out = [False]
    for k in range(1, len(sweeps)):
        mine = sweeps[k].get("settings", {})
        for field in SAME_DRAW_SETTINGS:
            if mine.get(field) != first.get(field):
                raise SweepMismatch(f"{names[k]}: settings.{field} is {mine.get(field)!r}, the first sweep's is "
                                    f"{first.get(field)!r} (pooled sweeps must draw the same workload)")
        same = next((j for j in range(k) if first.get("trace")
                     or sweeps[j].get("settings", {}).get("seed") == mine.get("seed")), None)
        if same is not None:
            _check_same_requests(sweeps[same], sweeps[k], names[k], SAME_TRACE_SETTINGS,
                                 f"the first sweep's with seed {sweeps[same]['settings'].get('seed')}",
                                 " (a sweep with an earlier sweep's seed must repeat its trace)")
        out.append(same is not None)
    return out


def _check_same_requests(earlier: dict, other: dict, name: str, fields: tuple[str, ...],
                         whose: str = "the first sweep's", why: str = "") -> None:
    """Raise SweepMismatch naming the field, or the rate, where ``other`` does not send ``earlier``'s requests:
    ``fields`` of the settings differ, or the requests at a rate both ran do. ``whose`` names ``earlier``,
    ``why`` ends the message."""
    a, b = earlier["settings"], other["settings"]
    for field in fields:
        if a.get(field) != b.get(field):
            raise SweepMismatch(f"{name}: settings.{field} is {b.get(field)!r}, {whose} is {a.get(field)!r}{why}")
    rows = {row["rate"]: row for row in earlier["rates"]}
    for row in other["rates"]:
        if row["rate"] in rows and trace_of(rows[row["rate"]]) != trace_of(row):
            raise SweepMismatch(f"{name}: the requests at rate {row['rate']} differ from {whose}{why}")


def compare(sweeps: list[tuple[str, dict]]) -> dict:
    (_, first), others = sweeps[0], sweeps[1:]
    for name, sweep in others:
        check_same_trace(first, sweep, name)
    s = first["settings"]
    ttft_s, tpot_s = s["ttft_slo_ms"] / 1e3, s["tpot_slo_ms"] / 1e3
    runs = []
    for name, sweep in sweeps:
        per_rate = []
        for row in sweep["rates"]:
            a = attainment_of(row["records"], ttft_s, tpot_s)
            lo, hi = wilson_interval(a["both"], len(row["records"]))
            per_rate.append({"rate": row["rate"], "requests": len(row["records"]), **{k: a[k] for k in KEYS},
                             "ci95_both": [lo, hi]})
        runs.append({"sweep": name, "label": sweep["settings"].get("label"), "started": sweep.get("started"),
                     "rates": per_rate})
    base = runs[0]["rates"]
    for run in runs[1:]:
        for r, b in zip(run["rates"], base):
            r["diff_both"] = r["both"] - b["both"]
        run["max_abs_diff_both"] = max(abs(r["diff_both"]) for r in run["rates"])
    return {"workload": s["workload"], "slo": {"ttft_ms": s["ttft_slo_ms"], "tpot_ms": s["tpot_slo_ms"]},
            "runs": runs, "max_abs_diff_both": max(r["max_abs_diff_both"] for r in runs[1:])}


def write_markdown(result: dict, path: str) -> None:
    runs = result["runs"]
    slo = result["slo"]
    lines = ["# Run-to-run spread of real SLO sweeps on one trace", "", f"`{result['command']}`", "",
             f"Workload {result['workload']}, SLOs TTFT {slo['ttft_ms']:g} ms / TPOT {slo['tpot_ms']:g} ms; every "
             "sweep served the same requests (arrivals, prompt and output lengths checked). Attainment on both SLOs, "
             "with the 95 % Wilson interval of each; the difference is against the first sweep.", "",
             "| run | sweep | label | started | largest difference from run 1 (pts) |", "|---:|---|---|---|---:|"]
    lines += [f"| {i + 1} | `{r['sweep']}` | {r['label']} | {r['started']} | "
              + ("-" if i == 0 else f"{100 * r['max_abs_diff_both']:.1f}") + " |" for i, r in enumerate(runs)]
    header = "| rate | requests | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " | " + \
             " | ".join(f"run {i + 1} - run 1 (pts)" for i in range(1, len(runs))) + " |"
    lines += ["", header, "|" + "---:|" * (2 + 2 * len(runs) - 1)]
    for i, b in enumerate(runs[0]["rates"]):
        cells = [f"{r['rates'][i]['both']:.1%} ({r['rates'][i]['ci95_both'][0]:.0%}-{r['rates'][i]['ci95_both'][1]:.0%})"
                 for r in runs]
        diffs = [f"{100 * r['rates'][i]['diff_both']:+.1f}" for r in runs[1:]]
        lines.append(f"| {b['rate']:g} | {b['requests']} | " + " | ".join(cells) + " | " + " | ".join(diffs) + " |")
    lines += ["", f"Largest difference from run 1: **{100 * result['max_abs_diff_both']:.1f} points** (per run in the "
                  "first table). Between runs of one configuration this is the floor under any simulator check: a "
                  "simulator cannot be held closer to a measured sweep than two measured sweeps agree."]
    write_lines(path, lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweeps", nargs="+", help="sweep JSONs written by benchmarks/slo_sweep.py (at least two)")
    ap.add_argument("--out", required=True, help="output prefix (writes .json and .md)")
    args = ap.parse_args(argv)
    if len(args.sweeps) < 2:
        ap.error("sweeps: give at least two sweep JSONs of the same trace")
    loaded = []
    for path in args.sweeps:
        with open(path, encoding="utf-8") as f:
            loaded.append((os.path.relpath(path, ROOT), json.load(f)))
    try:
        result = compare(loaded)
    except SweepMismatch as err:
        ap.error(str(err))
    result["command"] = "python benchmarks/sweep_repeat.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    record(result, args.out, write_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
