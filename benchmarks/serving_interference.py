"""How much slower the workers' own forward passes run inside the serving cluster than the profile says,
alone and under a burst: the interference the simulator's contention terms stand for, measured in place.

    python benchmarks/serving_interference.py --config cluster_configs/local-no-spec.yaml \\
        --profile benchmarks/results/profile_local_cpu.json --out benchmarks/results/serving_interference

The calibration (``controller/planner/calibrate.py``) fits its contention terms to the same kind of pass
log (``controller/planner/interference.py``). Here the disaggregated cluster is served for real as
the calibration serves it (speculation off; isolated requests, then a burst, with the calibration's
prompt and output lengths and its way of picking the burst's rate; other random token ids), and each
prefill and decode worker hands over the passes it timed (``modeling/pass_log.py``). Each pass
is divided by the profile's prediction for its shape. Reported per pass kind: the median ratio with the
cluster otherwise idle (isolated requests), under the burst while a worker of the other role was running
a pass for most of this one, and under the burst while it was not; and their quotients, the
interference. Then the prefill passes (colocated: the mixed ones) against the decode role's (the other
instances') busy share and step rate (which of the two explains the slowdown), and the calibration's contention fit on all passes. ``--speculation`` serves the
config's speculation (the calibration switches it off); ``--output-burst N`` sends the calibration's second
burst after the first (short prompts, long outputs; its passes count with the burst's). A colocated config's
instances log their mixed prefill + decode steps (kind ``mixed``), and each contends with the other
instances. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shlex
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402
from controller.planner.interference import (  # noqa: E402
    IDLE_SHARE, PassActivity, activities, fit_contention_terms, predicted_s, reference_ratios,
)
from controller.planner.profile import Profile  # noqa: E402

KINDS = ("prefill", "decode", "verify", "draft", "mixed")
OVERLAP = 0.5  # share of a pass that passes of the other workers must cover for it to count as "other busy"
RATE_BINS = (0.0, 25.0, 50.0, 100.0, 150.0, float("inf"))  # other workers' step completions per second


def summarise(profile: Profile, drafter: str | None, isolated: list[dict], burst: list[dict]) -> list[dict]:
    """Per pass kind: median measured / predicted time, isolated and under the burst (other role busy or
    idle during the pass), and the interference (burst median / isolated median)."""
    acts = activities(profile, burst, drafter)
    rows = []
    for kind in KINDS:
        iso = [r["seconds"] / predicted_s(profile, r, drafter) for r in isolated if r["kind"] == kind]
        mine = [a for a in acts if a.kind == kind]
        if not iso and not mine:
            continue
        busy = [a.ratio for a in mine if a.other_busy_share >= OVERLAP]
        idle = [a.ratio for a in mine if a.other_busy_share < OVERLAP]
        med = {name: statistics.median(v) if v else None for name, v in (("isolated", iso), ("busy", busy),
                                                                         ("idle", idle), ("burst", busy + idle))}
        quotient = (lambda x: x / med["isolated"] if x and med["isolated"] else None)  # noqa: E731
        rows.append({"kind": kind, "passes": {"isolated": len(iso), "burst_other_busy": len(busy),
                                              "burst_other_idle": len(idle)},
                     "median_ratio": med, "interference": quotient(med["burst"]),
                     "interference_other_busy": quotient(med["busy"]), "interference_other_idle": quotient(med["idle"])})
    return rows


def _lstsq(columns: list[list[float]], target: list[float]) -> tuple[list[float], float]:
    """Least squares without intercept: (coefficients, RMS residual)."""
    import numpy as np

    a, y = np.array(columns, dtype=float).T, np.array(target, dtype=float)
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    return [float(c) for c in coef], float(np.sqrt(np.mean((a @ coef - y) ** 2)))


def explain(acts: list[PassActivity], kind: str = "prefill") -> dict:
    """For the burst passes of ``kind``: how well the other role's busy share, its step rate, or both explain
    the slowdown over the kind's reference ratio (passes that ran alone; least squares through the origin:
    no other activity, no interference), and medians per step-rate bin."""
    refs = reference_ratios(acts)
    mine = [a for a in acts if a.kind == kind]
    if len(mine) < 3:
        return {}
    y = [a.ratio / refs[kind] - 1.0 for a in mine]
    share, rate = [a.other_busy_share for a in mine], [a.other_step_rate for a in mine]
    fits = {}
    for name, cols in (("busy_share", [share]), ("step_rate", [rate]), ("both", [share, rate])):
        coef, rms = _lstsq(cols, y)
        fits[name] = {"coefficients": coef, "rms": rms}
    fits["none"] = {"coefficients": [], "rms": float(statistics.fmean(v * v for v in y) ** 0.5)}
    bins = []
    for lo, hi in zip(RATE_BINS, RATE_BINS[1:]):
        sel = [(a, v) for a, v in zip(mine, y) if lo <= a.other_step_rate < hi]
        if sel:
            bins.append({"step_rate": [lo, None if math.isinf(hi) else hi], "passes": len(sel),
                         "interference": 1.0 + statistics.median(v for _, v in sel),
                         "busy_share": statistics.median(a.other_busy_share for a, _ in sel)})
    return {"kind": kind, "reference_ratio": refs[kind], "fits": fits, "bins": bins}


def measure(config, profile: Profile, requests: int, burst_requests: int, seed: int, output_requests: int = 0
            ) -> tuple[list[dict], list[dict]]:
    """Serve ``config`` as the calibration does; the passes of all workers (``interference.pass_row`` rows),
    isolated phase and burst."""
    from controller.client import Client
    from controller.planner import calibrate as cal
    from controller.planner.simulator import SimConfig
    from controller.server import serve_in_thread

    max_prompt = cal.max_calibration_prompt(config)
    lengths = cal.calibration_lengths(max_prompt, requests, seed)
    outputs = cal.OUTPUT_TOKENS
    # the burst's rate as the calibration picks it: the isolated terms, no contention
    isolated_terms = profile.with_calibration(profile.calibration(config.mode).without_contention())
    trace = cal.burst_trace(isolated_terms, SimConfig.from_cluster_config(config),
                            cal.calibration_lengths(max_prompt, burst_requests, seed + 1), outputs, seed)
    with serve_in_thread(config) as address, Client(address) as client:
        cal.time_isolated(client, cal.random_prompts(config, [64, 64], random.Random(seed)), outputs)  # warm-up
        cal.drain_passes(config)
        cal.time_isolated(client, cal.random_prompts(config, lengths, random.Random(seed + 2)), outputs)
        isolated = cal.drain_passes(config)
        cal.send_burst(client, trace, cal.random_prompts(config, [r.prompt_tokens for r in trace], random.Random(seed + 3)))
        burst = cal.drain_passes(config)
        if output_requests:
            out_trace = cal.output_burst_trace(config, output_requests, seed)
            cal.send_burst(client, out_trace,
                           cal.random_prompts(config, [r.prompt_tokens for r in out_trace], random.Random(seed + 4)))
            burst += cal.drain_passes(config)
    return isolated, burst


def write_markdown(result: dict, path: str) -> None:
    fmt = (lambda x: "-" if x is None else f"{x:.2f}")  # noqa: E731
    lines = ["# Interference inside the serving cluster: the workers' own passes against the profile", "",
             f"`{result['command']}`", "",
             f"Config `{result['config']}` served as the calibration serves it "
             f"(speculation {'as configured' if result.get('speculation') else 'off'}): {result['requests']} "
             f"isolated requests, then a {result['burst_requests']}-request burst and a {result.get('output_burst', 0)}-request "
             "output burst (short prompts, long outputs); burst figures cover both; "
             f"profile `{result['profile']}`. "
             "Ratio = measured pass time / the profile's prediction for its shape (median). 'Other busy': the other "
             f"workers (disaggregated: of the other role) ran passes over at least {OVERLAP:.0%} of this pass.", "",
             "| pass | passes (isolated / burst, other busy / other idle) | isolated | burst | burst, other busy "
             "| burst, other idle | interference (burst / isolated) | other busy | other idle |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        n, m = r["passes"], r["median_ratio"]
        lines.append(f"| {r['kind']} | {n['isolated']} / {n['burst_other_busy']} / {n['burst_other_idle']} "
                     f"| {fmt(m['isolated'])} | {fmt(m['burst'])} | {fmt(m['busy'])} | {fmt(m['idle'])} "
                     f"| **{fmt(r['interference'])}** | {fmt(r['interference_other_busy'])} "
                     f"| {fmt(r['interference_other_idle'])} |")
    fit = result.get("contention_fit")
    if fit:
        lines += ["", f"The calibration's fit on these burst passes (`interference.fit_contention_terms`, every pass of "
                      f"every worker, weighted by duration, non-negative): busy-share factor **{fit['busy_scale']:.2f}x**, "
                      f"**{1e3 * fit['step_s']:.2f} ms per step**, **{1e3 * fit.get('output_s', 0.0):.3f} ms per "
                      f"sequence output** (RMS of the slowdowns about it {fit['rms']:.2f}, {fit['passes']} passes). "
                      "Compare the profile's `calibrations[].contention_scale`, `contention_step_s` and "
                      "`contention_output_s`."]
    act = result.get("prefill_vs_other_activity") or {}
    if act:
        kind = act["kind"]
        other = "the decode role" if kind == "prefill" else "the other instances"
        lines += ["", f"## {kind.capitalize()} passes against what {other} did meanwhile", "",
                  f"Interference of each burst {kind} pass (its ratio over the median ratio of the burst's {kind} "
                  f"passes that ran alone, others busy < {IDLE_SHARE:.0%}: {act['reference_ratio']:.2f}) against "
                  f"the share of it {other} spent in passes and the steps they completed per second "
                  "meanwhile.", "",
                  "| other steps / s | passes | median interference | median busy share |", "|---|---:|---:|---:|"]
        for b in act["bins"]:
            lo, hi = b["step_rate"]
            lines.append(f"| {lo:.0f}-{'' if hi is None else f'{hi:.0f}'} | {b['passes']} "
                         f"| {b['interference']:.2f} | {b['busy_share']:.2f} |")
        lines += ["", "Least squares of interference - 1 through the origin:", "",
                  "| predictors | coefficients | RMS residual |", "|---|---|---:|"]
        for name, fit in act["fits"].items():
            lines.append(f"| {name} | {', '.join(f'{c:.4g}' for c in fit['coefficients']) or '-'} | {fit['rms']:.3f} |")
    write_lines(path, lines)


def main(argv: list[str] | None = None) -> int:
    from controller.config import load_config
    from controller.planner.calibrate import calibration_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "cluster_configs", "local-no-spec.yaml"))
    ap.add_argument("--profile", default=os.path.join(ROOT, "benchmarks", "results", "profile_local_cpu.json"))
    ap.add_argument("--requests", type=int, default=16, help="isolated requests (as the calibration)")
    ap.add_argument("--burst-requests", type=int, default=40, help="burst requests (as the calibration)")
    ap.add_argument("--output-burst", type=int, default=32,
                    help="requests of the calibration's second burst (short prompts, long outputs; 0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculation", action="store_true",
                    help="serve with the config's speculation (the calibration switches it off)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "serving_interference"))
    args = ap.parse_args(argv)
    for name in ("requests", "burst_requests"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    profile = Profile.load(args.profile)
    config = calibration_config(load_config(args.config), keep_speculation=args.speculation)
    if args.output_burst < 0:
        ap.error(f"--output-burst: must be >= 0, got {args.output_burst}")
    isolated, burst = measure(config, profile, args.requests, args.burst_requests, args.seed, args.output_burst)
    spec = config.decode.speculation if config.mode == "disaggregated" else None
    drafter = spec.drafter if args.speculation and spec is not None and spec.enabled else None
    acts = activities(profile, burst, drafter)
    fitted = fit_contention_terms(acts)
    result = {"command": "python benchmarks/serving_interference.py "
                         + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
              "config": os.path.relpath(args.config, ROOT), "profile": os.path.relpath(args.profile, ROOT),
              "requests": args.requests, "burst_requests": args.burst_requests, "output_burst": args.output_burst,
              "seed": args.seed,
              "speculation": args.speculation, "rows": summarise(profile, drafter, isolated, burst),
              "prefill_vs_other_activity": explain(acts, "mixed" if config.mode == "colocated" else "prefill"),
              "contention_fit": {"busy_scale": fitted.busy_scale, "step_s": fitted.step_s, "output_s": fitted.output_s,
                                 "rms": fitted.rms, "passes": fitted.passes},
              "isolated_passes": isolated, "burst_passes": burst}
    record(result, args.out, write_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
