"""Simulator vs measurement: replay the exact trace of a recorded SLO sweep (every request's arrival,
prompt and output length, per rate) through the cluster simulator with a profile of the same machine,
and compare SLO attainment rate by rate.

    python benchmarks/slo_sweep.py --target grpc --launch cluster_configs/local.yaml --out OUT ...
    python benchmarks/sim_validate.py --sweep OUT.json --profile PROFILE.json \\
        --config cluster_configs/local.yaml --out OUT_sim_validation

The criterion (issue: simulator validation) is |simulated - measured| <= 5 percentage points of
attainment at every swept rate, on both SLOs together; TTFT-only and TPOT-only are reported beside it,
with the measured attainment's 95 % Wilson interval (its own sampling error with that many requests).
Acceptance is random in the simulator, so each rate is simulated with ``--seeds`` seeds and averaged.
Each simulated request arrives when the load generator sent it (``--arrivals sent``, the default) or when
the trace asked for it (``trace``); measured TTFT / TPOT are read on the load generator's clock or, where
the server reported them, on its own (``--timing``).

``--host-contention FILE`` (default: off): a sweep served on one small machine whose instances share its
cores is simulated with the host-contention plug-in measured there (``benchmarks/host_contention.py``,
passed to every ``simulate`` call); the report names the file and its terms.

Several ``--sweep`` flags pool sweeps rate by rate: repeats of one trace, or other draws of the same workload
(another ``--seed``: other lengths and arrivals), whose rates may differ; ``benchmarks/_sweeps.py`` checks
that they may be pooled (the same workload, arrival process, SLOs and cores; the same requests wherever two
sweeps share a seed). Each rate compares the requests of every sweep that ran it with the request-weighted
mean of each sweep's own replay: more requests per rate than one sweep has, so the 5-point criterion is
tested where a single 50-request sweep's own sampling error (7 points at 50 %) would not let it be.

Writes OUT.json, OUT.md and OUT.png (measured and simulated attainment vs rate).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402
from benchmarks._slo_plots import _pyplot  # noqa: E402
from benchmarks._sweeps import SweepMismatch, check_pool  # noqa: E402, F401 (SweepMismatch: re-exported)
from benchmarks.host_contention import HostContention  # noqa: E402
from benchmarks.slo_sweep import TIMINGS, attainment_of, has_server_timing, percentile  # noqa: E402
from controller.config import load_config  # noqa: E402
from planner.profile import Profile  # noqa: E402
from planner.simulator import SimConfig, simulate  # noqa: E402
from planner.slo import attainment  # noqa: E402
from planner.workload import RequestSpec  # noqa: E402

KEYS = ("both", "ttft_only", "tpot_only")
TOLERANCE = 0.05
ROUNDING = 1e-9  # shares are ratios of request counts: 0.625 - 0.675 is 0.05000000000000004 in floating point


def within_tolerance(worst_gap: float) -> bool:
    """The criterion: the largest |simulated - measured| share is at most TOLERANCE (up to float rounding)."""
    return worst_gap <= TOLERANCE + ROUNDING


ARRIVALS = ("sent", "trace")


def arrival_of(rec: dict, arrivals: str) -> float:
    """When the simulated request arrives: when the load generator actually sent it ("sent", the
    default: a starved load generator sends late, and the server saw the late arrival), or when the
    trace asked for it ("trace")."""
    if arrivals == "sent" and rec.get("sent_s") is not None:
        return rec["sent_s"]
    return rec["arrival_s"]


def simulate_rate(profile: Profile, config: SimConfig, row: dict, ttft_s: float, tpot_s: float, seeds: int,
                  arrivals: str = "sent", host_contention: HostContention | None = None) -> dict:
    """Mean simulated attainment (and latency percentiles of seed 0) for one recorded rate; ``host_contention``:
    the optional simulator plug-in (``benchmarks/host_contention.py``)."""
    recs = sorted(row["records"], key=lambda r: arrival_of(r, arrivals))
    trace = [RequestSpec(arrival_of(r, arrivals), r["prompt_tokens"], r["output_tokens"]) for r in recs]
    limit = row["time_limit_s"] - trace[-1].arrival_s if row.get("time_limit_s") else None
    shares = {k: [] for k in KEYS}
    first = None
    for seed in range(seeds):
        res = simulate(profile, config, trace, seed=seed, time_limit_s=limit, host_contention=host_contention)
        a = attainment(res.outcomes(), ttft_s, tpot_s)
        for k in KEYS:
            shares[k].append(getattr(a, k))
        first = first or res
    done = [r for r in first.records if r.finished]
    throughput = prefill_throughput([r.arrival_s for r in first.records], [r.ttft_s for r in first.records],
                                    [r.prompt_tokens for r in first.records])
    return {
        "attainment": {k: statistics.fmean(v) for k, v in shares.items()},
        "latency_ms": {f"{name}_p{q}": 1e3 * percentile(vals, q) if vals else None
                       for name, vals in (("ttft", [r.ttft_s for r in done]), ("tpot", [r.tpot_s for r in done]))
                       for q in (50, 90)},
        "utilisation": first.instance_utilisation,
        "k_counts": first.k_counts,
        "prefill_tokens_per_s": throughput,
    }


def prefill_throughput(arrivals: list[float], ttfts: list[float | None], prompt_tokens: list[int]) -> float | None:
    """Prompt tokens per second over the span of first tokens (first to last): at a rate the prefill
    pool cannot keep up with, its throughput under load, the figure attainment turns on near capacity."""
    done = [(a + t, n) for a, t, n in zip(arrivals, ttfts, prompt_tokens) if t is not None and math.isfinite(t)]
    firsts = [f for f, _ in done]
    if len(firsts) < 2 or max(firsts) <= min(firsts):
        return None
    return sum(n for _, n in done) / (max(firsts) - min(firsts))


def wilson_interval(share: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a measured share of ``n`` requests: how far the measured attainment
    itself may sit from the rate's true attainment by the luck of which requests were drawn."""
    if n == 0:
        return 0.0, 1.0
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((share * (1 - share) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _weighted_mean_of(dicts: list[dict], weights: list[int]) -> dict:
    total = sum(weights)
    return {k: sum(d[k] * w for d, w in zip(dicts, weights)) / total for k in dicts[0]}


def compare(sweeps: dict | list[dict], profile: Profile, config: SimConfig, seeds: int, timing: str = "client",
            arrivals: str = "sent", host_contention: HostContention | None = None) -> dict:
    """Simulated vs measured attainment rate by rate. ``sweeps``: one recorded sweep, or several the caller
    checked may be pooled (``check_pool``): repeats of one trace, or other draws of the same workload at any
    rates. Each swept rate pools the sweeps that ran it: the measured attainment is that of all their
    requests, the simulated one the request-weighted mean of each sweep's own replay (its own send times and
    lengths), and each sweep's own measured attainment is kept beside (``measured_per_repeat_both``).
    ``timing``: whose clock the measured TTFT / TPOT are read on, "client" (the load generator's) or "server"
    (the server's usage report); the other clock's measured attainment is reported beside it where the sweeps
    have both. ``host_contention``: the optional simulator plug-in, applied to every replay."""
    sweeps = [sweeps] if isinstance(sweeps, dict) else list(sweeps)
    s = sweeps[0]["settings"]
    ttft_s, tpot_s = s["ttft_slo_ms"] / 1e3, s["tpot_slo_ms"] / 1e3
    other = "server" if timing == "client" else "client"
    ttft_key = "ttft_s" if timing == "client" else "server_ttft_s"
    rows = []
    for rate in sorted({row["rate"] for sw in sweeps for row in sw["rates"]}):
        repeats = [row for sw in sweeps for row in sw["rates"] if row["rate"] == rate]  # the sweeps that ran it
        first = repeats[0]
        if timing == "server" and not all(has_server_timing(row["records"]) for row in repeats):
            raise ValueError(f"--timing server: the sweep's records at {rate:g} req/s carry no server timings "
                             "(an OpenAI-compatible target reports none); use --timing client")
        sims = [simulate_rate(profile, config, row, ttft_s, tpot_s, seeds, arrivals, host_contention)
                for row in repeats]
        pooled = [r for row in repeats for r in row["records"]]
        simulated = _weighted_mean_of([sim["attainment"] for sim in sims], [len(row["records"]) for row in repeats])
        measured = attainment_of(pooled, ttft_s, tpot_s, timing)
        other_both = (attainment_of(pooled, ttft_s, tpot_s, other)["both"]
                      if other == "client" or all(has_server_timing(row["records"]) for row in repeats) else None)
        lo, hi = wilson_interval(measured["both"], len(pooled))
        # first tokens at send + TTFT (the TTFTs are measured from the sends); the first sweep's
        throughput = prefill_throughput([arrival_of(r, "sent") for r in first["records"]],
                                        [r.get(ttft_key) for r in first["records"]],
                                        [r["prompt_tokens"] for r in first["records"]])
        rows.append({"rate": first["rate"], "requests": len(pooled),
                     f"measured_{other}_clock_both": other_both,
                     "measured_per_repeat_both": [attainment_of(row["records"], ttft_s, tpot_s, timing)["both"]
                                                  for row in repeats],
                     "measured": {k: measured[k] for k in KEYS}, "simulated": simulated,
                     "measured_ci95_both": [lo, hi], "inside_ci95_both": lo <= simulated["both"] <= hi,
                     "diff": {k: simulated[k] - measured[k] for k in KEYS},
                     "measured_latency_ms": first.get("latency_ms" if timing == "client" else "server_latency_ms", {}),
                     "simulated_latency_ms": sims[0]["latency_ms"],
                     "simulated_utilisation": sims[0]["utilisation"], "simulated_k_counts": sims[0]["k_counts"],
                     "prefill_tokens_per_s": {"measured": throughput, "simulated": sims[0]["prefill_tokens_per_s"]}})
    worst = max(abs(r["diff"]["both"]) for r in rows)
    return {"slo": {"ttft_ms": s["ttft_slo_ms"], "tpot_ms": s["tpot_slo_ms"]}, "rows": rows,
            "timing": timing, "arrivals": arrivals, "repeats": len(sweeps),
            # the seeds pooled (a recorded trace is one draw whatever the seed)
            "draws": [] if s.get("trace") else sorted({sw["settings"].get("seed") for sw in sweeps}, key=str),
            "max_abs_diff_both": worst, "within_tolerance": within_tolerance(worst), "tolerance": TOLERANCE,
            "inside_ci95_both": sum(r["inside_ci95_both"] for r in rows)}


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def _pooling_note(result: dict) -> str:
    draws = result.get("draws") or []
    what = ("repeats of the trace" if len(draws) <= 1 else
            f"sweeps of {len(draws)} draws of the workload (seeds {', '.join(map(str, draws))}), pooled rate by rate")
    return (f" {result['repeats']} {what}: measured = the requests of the sweeps that ran the rate, simulated = the "
            "request-weighted mean of each sweep's own replay; each sweep's own measured attainment in the 'each "
            "sweep' column.")


def write_markdown(result: dict, path: str) -> None:
    slo = result["slo"]
    repeats = result.get("repeats", 1) > 1
    contention = result.get("host_contention")
    lines = [f"# Simulator vs measured: {result['label']}", "", f"`{result['command']}`", "",
             f"Sweep `{result['sweep']}` ({result['workload']}), profile `{result['profile']}` ({result['hardware']}), "
             f"SLOs TTFT {slo['ttft_ms']:g} ms / TPOT {slo['tpot_ms']:g} ms; simulated attainment is the mean of "
             f"{result['seeds']} seeds. Measured TTFT / TPOT on the {result['timing']}'s clock"
             + (" (the load generator's: what a user sees)" if result["timing"] == "client" else
                " (its usage report, from arrival at the router: without the load generator's lateness)")
             + "; simulated arrivals " + ("when the load generator sent each request" if result["arrivals"] == "sent"
                                          else "when the trace asked for them") + "."
             + (_pooling_note(result) if repeats else ""), "",
             (f"Host contention: `{contention['file']}` ({contention['mode']}, {contention['threads']} thread(s)): "
              f"{contention['summary']} while other instances are busy, applied to every simulated step."
              if contention else "Host contention: none (every simulated step at the profile's calibrated time)."), "",
             "| rate | requests | both: measured (95 % interval) | simulated | diff (pts) | TTFT only: meas. / sim. "
             "| TPOT only: meas. / sim. | TTFT p50 ms meas. / sim. | TPOT p50 ms meas. / sim. "
             "| prefill tok/s over the first tokens: meas. / sim. |" + (" each sweep: meas. |" if repeats else ""),
             "|---:|---:|---:|---:|---:|---|---|---|---|---|" + ("---|" if repeats else "")]
    for r in result["rows"]:
        m, s, ml, sl = r["measured"], r["simulated"], r["measured_latency_ms"], r["simulated_latency_ms"]
        lo, hi = r["measured_ci95_both"]
        lines.append(f"| {r['rate']:g} | {r['requests']} | {m['both']:.1%} ({lo:.0%}-{hi:.0%}) | {s['both']:.1%} "
                     f"| {100 * r['diff']['both']:+.1f} "
                     f"| {m['ttft_only']:.0%} / {s['ttft_only']:.0%} | {m['tpot_only']:.0%} / {s['tpot_only']:.0%} "
                     f"| {_ms(ml.get('ttft_p50'))} / {_ms(sl.get('ttft_p50'))} | {_ms(ml.get('tpot_p50'))} / {_ms(sl.get('tpot_p50'))} "
                     f"| {_ms(r['prefill_tokens_per_s']['measured'])} / {_ms(r['prefill_tokens_per_s']['simulated'])} |"
                     + (" " + " / ".join(f"{b:.1%}" for b in r["measured_per_repeat_both"]) + " |" if repeats else ""))
    other = "server" if result["timing"] == "client" else "client"
    beside = [r.get(f"measured_{other}_clock_both") for r in result["rows"]]
    if all(b is not None for b in beside):
        lines += ["", f"Measured on the {other}'s clock instead (both SLOs): "
                  + ", ".join(f"{r['rate']:g} req/s {b:.1%} (diff {100 * (r['simulated']['both'] - b):+.1f})"
                              for r, b in zip(result["rows"], beside)) + "."]
    verdict = "within" if result["within_tolerance"] else "NOT within"
    lines += ["", f"Largest difference on both SLOs: **{100 * result['max_abs_diff_both']:.1f} points**, "
                  f"{verdict} the {100 * result['tolerance']:.0f}-point criterion at every rate. The simulated "
                  f"attainment lies inside the measured one's 95 % interval (Wilson; the measurement's own sampling "
                  f"error with this many requests) at {result['inside_ci95_both']} of {len(result['rows'])} rates.",
              "", "Prefill tok/s: prompt tokens over the span of first tokens. Where the rate exceeds what the "
                  "prefill pool sustains, this is its throughput under load; near that capacity a few per cent of "
                  "it move attainment by tens of points."]
    write_lines(path, lines)


def plot(result: dict, path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rates = [r["rate"] for r in result["rows"]]
    for key, color in zip(KEYS, ("C0", "C1", "C2")):
        ax.plot(rates, [r["measured"][key] for r in result["rows"]], "o-", color=color, label=f"{key} measured")
        ax.plot(rates, [r["simulated"][key] for r in result["rows"]], "x--", color=color, label=f"{key} simulated")
    ax.axhline(0.9, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"simulator vs measured: {result['label']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", required=True, action="append",
                    help="a sweep JSON written by benchmarks/slo_sweep.py; repeat the flag to pool sweeps rate by "
                         "rate: repeats of one trace or other draws of the same workload (another --seed, at any "
                         "rates)")
    ap.add_argument("--profile", required=True, help="profile JSON of the machine the sweep ran on")
    ap.add_argument("--config", required=True, help="the cluster YAML the sweep's server ran")
    ap.add_argument("--seeds", type=int, default=5, help="simulations per rate (acceptance is random)")
    ap.add_argument("--timing", default="client", choices=TIMINGS,
                    help="whose clock the measured TTFT / TPOT are read on: the load generator's (client, what a "
                         "user sees) or the server's usage report (server, without the load generator's lateness)")
    ap.add_argument("--arrivals", default="sent", choices=ARRIVALS,
                    help="simulated arrivals: when each request was sent (sent) or when the trace asked (trace)")
    ap.add_argument("--host-contention", default=None, metavar="FILE",
                    help="simulate with this host-contention plug-in (benchmarks/host_contention.py's JSON, measured "
                         "on the machine the sweep ran on, for the config's mode); default: none")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", required=True, help="output prefix (writes .json, .md, .png)")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds: must be >= 1")
    sweeps = []
    for path in args.sweep:
        try:
            with open(path, encoding="utf-8") as f:
                sweeps.append(json.load(f))
        except (OSError, ValueError) as err:
            ap.error(f"--sweep {path}: cannot read a sweep JSON ({err})")
    try:
        profile = Profile.load(args.profile)
        config = SimConfig.from_cluster_config(load_config(args.config))
        contention = HostContention.load(args.host_contention) if args.host_contention else None
        if contention is not None and contention.mode != config.mode:
            raise ValueError(f"--host-contention {args.host_contention}: measured for {contention.mode} mode, but "
                             f"--config {args.config} runs {config.mode}")
        check_pool(sweeps, [f"--sweep {path}" for path in args.sweep])
        result = compare(sweeps, profile, config, args.seeds, args.timing, args.arrivals, contention)
    except ValueError as err:  # ProfileError, ConfigError and SweepMismatch are ValueErrors
        ap.error(str(err))
    sweep = sweeps[0]
    result.update(label=args.label or sweep["settings"].get("label", os.path.basename(args.config)),
                  sweep=", ".join(os.path.relpath(p, ROOT) for p in args.sweep), profile=os.path.relpath(args.profile, ROOT),
                  hardware=profile.hardware, workload=sweep["settings"]["workload"], seeds=args.seeds,
                  host_contention=None if contention is None else {
                      "file": os.path.relpath(args.host_contention, ROOT), "summary": contention.summary(),
                      "mode": contention.mode, "threads": contention.threads},
                  command="python benchmarks/sim_validate.py "
                          + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)))
    record(result, args.out, write_markdown)
    plot(result, args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
