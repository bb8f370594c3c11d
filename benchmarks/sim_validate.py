"""Simulator vs measurement: replay the exact trace of a recorded SLO sweep (every request's arrival,
prompt and output length, per rate) through the cluster simulator with a profile of the same machine,
and compare SLO attainment rate by rate.

    python benchmarks/slo_sweep.py --target grpc --launch cluster_configs/local.yaml --out OUT ...
    python benchmarks/sim_validate.py --sweep OUT.json --profile benchmarks/results/profile_local_cpu.json \\
        --config cluster_configs/local.yaml --out benchmarks/results/sim_validation_local

The criterion (issue: simulator validation) is |simulated - measured| <= 5 percentage points of
attainment at every swept rate, on both SLOs together; TTFT-only and TPOT-only are reported beside it.
Acceptance is random in the simulator, so each rate is simulated with ``--seeds`` seeds and averaged.

``--speed``: a profile describes the machine when it was taken, and a shared machine drifts. Each rate can
be simulated on the profile rescaled by how fast the machine ran then:

* ``load``: from the workers' own timed passes and steps during the rate (``slo_sweep.py`` keeps them in
  PREFIX.passes.json.gz) over what the simulator charges for them, given what the rest of the cluster did
  meanwhile, role by role (``controller/planner/load_speed.py``, ``Profile.at_role_speeds``): the speed
  under that very load;
* ``probe``: from the lone speed-probe requests on the idle server before and after the rate
  (``slo_sweep.py --speed-probes``, ``benchmarks/_speed_probe.py``): the idle machine's speed around it;
* ``none``: the profile as it is.

``auto`` (the default) takes ``load`` where every sweep kept pass logs, else ``probe`` where every sweep has
probes, else ``none``. The factor is reported beside each rate.

``--speed-window S`` (with ``load``): the machine's speed also drifts within a rate, so each rate's load speed
is also read window by window, every S seconds of its pass log, and the simulator scales each step by its
role's factor in the window it starts in (``load_speed.speed_timeline``). The pass log's clock is aligned
with the trace's by the rate's recorded wall-clock start (``wall_start_s``), or, in sweeps recorded before it
was kept, by taking the first pass to start when the first request was sent.

Several ``--sweep`` flags pool sweeps rate by rate: repeats of one trace, or other draws of the same workload
(another ``--seed``: other lengths and arrivals; ``sweep_repeat.check_pool``), whose rates may differ.
Each rate compares the requests of every sweep that ran it with the request-weighted mean of each sweep's own
replay: more requests per rate than one sweep has, so the 5-point criterion is tested where a single
50-request sweep's own sampling error (7 points at 50 %) would not let it be.

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

from benchmarks._slo_plots import _pyplot  # noqa: E402
from benchmarks import _pass_logs  # noqa: E402
from benchmarks._speed_probe import has_probes, probes_around, speed_of  # noqa: E402
from benchmarks.slo_sweep import TIMINGS, attainment_of, has_server_timing, percentile  # noqa: E402
from controller.config import load_config  # noqa: E402
from controller.planner.load_speed import SpeedTimeline, arrangement, load_speed, speed_timeline  # noqa: E402
from controller.planner.profile import Profile  # noqa: E402
from controller.planner.simulator import SimConfig, simulate  # noqa: E402
from controller.planner.slo import attainment  # noqa: E402
from controller.planner.workload import RequestSpec  # noqa: E402

KEYS = ("both", "ttft_only", "tpot_only")
TOLERANCE = 0.05
ROUNDING = 1e-9  # shares are ratios of request counts: 0.625 - 0.675 is 0.05000000000000004 in floating point


def within_tolerance(worst_gap: float) -> bool:
    """The criterion: the largest |simulated - measured| share is at most TOLERANCE (up to float rounding)."""
    return worst_gap <= TOLERANCE + ROUNDING


ARRIVALS = ("sent", "trace")
SPEEDS = ("auto", "load", "probe", "none")


def resolve_speed(speed: str, sweeps: list[dict], timing: str = "client", pass_logs: list | None = None) -> str:
    """"load", "probe" or "none" for ``--speed`` on these sweeps (``pass_logs``: each sweep's per-rate logs,
    or None where it kept none). "auto": load where every sweep kept pass logs, else probe where every
    sweep has probes, else none."""
    if speed not in SPEEDS:
        raise ValueError(f"speed: expected one of {', '.join(SPEEDS)}, got {speed!r}")
    logged = bool(pass_logs) and len(pass_logs) == len(sweeps) and all(logs is not None for logs in pass_logs)
    if speed == "load" and not logged:
        raise ValueError("--speed load: a sweep kept no pass logs of its workers (recorded before slo_sweep.py kept "
                         "them, with --pass-log off, against a server without DrainPassLog, or its "
                         "PREFIX.passes.json.gz is missing); use --speed probe or none")
    probed = all(has_probes(sw, timing) for sw in sweeps)
    if speed == "probe" and not probed:
        raise ValueError("--speed probe: a sweep lacks speed probes around some rate (recorded before "
                         "slo_sweep.py sent them, with --speed-probes 0, or every probe failed); use --speed none")
    if speed == "auto":
        return "load" if logged else "probe" if probed else "none"
    return speed


def arrival_of(rec: dict, arrivals: str) -> float:
    """When the simulated request arrives: when the load generator actually sent it ("sent", the
    default: a starved load generator sends late, and the server saw the late arrival), or when the
    trace asked for it ("trace")."""
    if arrivals == "sent" and rec.get("sent_s") is not None:
        return rec["sent_s"]
    return rec["arrival_s"]


def simulate_rate(profile: Profile, config: SimConfig, row: dict, ttft_s: float, tpot_s: float, seeds: int,
                  arrivals: str = "sent", speed: SpeedTimeline | None = None) -> dict:
    """Mean simulated attainment (and latency percentiles of seed 0) for one recorded rate; ``speed``: the
    machine's speed through it relative to ``profile``."""
    recs = sorted(row["records"], key=lambda r: arrival_of(r, arrivals))
    trace = [RequestSpec(arrival_of(r, arrivals), r["prompt_tokens"], r["output_tokens"]) for r in recs]
    limit = row["time_limit_s"] - trace[-1].arrival_s if row.get("time_limit_s") else None
    shares = {k: [] for k in KEYS}
    first = None
    for seed in range(seeds):
        res = simulate(profile, config, trace, seed=seed, time_limit_s=limit, speed=speed)
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


def pass_log_origin(row: dict, rows: list[dict], arrivals: str) -> tuple[float, str]:
    """(simulated time of the first logged pass's start, how it was aligned) for a rate's records ``row``
    and its pass rows: by the rate's wall-clock start where the sweep recorded it, else by taking the first
    pass to start when the first request arrived (within the server's dispatch latency, tens of ms)."""
    first_pass = min(r["end_s"] - r["seconds"] for r in rows)
    if row.get("wall_start_s") is not None:
        return first_pass - row["wall_start_s"], "wall clock"
    return min(arrival_of(r, arrivals) for r in row["records"]), "first request"


def rescaled(speed: str, profile: Profile, config: SimConfig, sweeps: list[dict], pass_logs: list | None,
             indices: list[int], timing: str, window_s: float | None = None, arrivals: str = "sent"
             ) -> list[tuple[dict, Profile, SpeedTimeline | None]]:
    """Per sweep, the speed of the machine at its rate ``indices[k]`` (``speed``: "load" or "probe"; nothing for
    "none") as a record for the report, ``profile`` rescaled to it, and (``window_s``, load only) its speed
    window by window through the rate relative to that."""
    if speed == "load":
        drafter = config.speculation.drafter if config.mode == "disaggregated" and config.speculation.enabled else None
        tps, sharing = arrangement(profile, config)
        out = []
        for sw, logs, index in zip(sweeps, pass_logs, indices):
            instances = logs[index]["instances"]
            rows = _pass_logs.rows_of(instances)
            est = load_speed(profile, config.mode, rows, drafter, tps, sharing)
            record = {"source": "load", "factor": est.factor, "by_role": est.by_role, "passes": est.passes,
                      "busy_s": est.busy_s, "complete": _pass_logs.complete(instances)}
            timeline = None
            if window_s is not None:
                origin, aligned = pass_log_origin(sw["rates"][index], rows, arrivals)
                timeline = speed_timeline(profile, config.mode, rows, window_s, origin, drafter, est, tps, sharing)
                record["timeline"] = {"window_s": window_s, "aligned_by": aligned, "starts_s": list(timeline.starts_s),
                                      "factors": list(timeline.factors)}
            out.append((record, est.apply(profile), timeline))
        return out
    if speed == "probe":
        out = []
        for sw, index in zip(sweeps, indices):
            e = speed_of(profile, config, probes_around(sw, index), timing)
            out.append(({"source": "probe", "factor": e.factor, "ttft_ratios": list(e.ttft_ratios),
                         "tpot_ratio": e.tpot_ratio}, profile.at_speed(e.factor), None))
        return out
    return []


def compare(sweeps: dict | list[dict], profile: Profile, config: SimConfig, seeds: int, timing: str = "client",
            arrivals: str = "sent", speed: str = "none", pass_logs: list | None = None,
            speed_window_s: float | None = None) -> dict:
    """Simulated vs measured attainment rate by rate. ``sweeps``: one recorded sweep, or several the caller
    checked may be pooled (``sweep_repeat.check_pool``): repeats of one trace, or other draws of the same
    workload at any rates. Each swept rate pools the sweeps that ran it: the measured attainment is that of
    all their requests, the simulated one the request-weighted mean of each sweep's own replay (its own send
    times, lengths and speed), and each sweep's own measured attainment is kept beside
    (``measured_per_repeat_both``). ``timing``: whose clock the measured
    TTFT / TPOT are read on, "client" (the load generator's) or "server" (the server's usage report); the
    other clock's measured attainment is reported beside it where the sweeps have both. ``speed``: "load"
    simulates each repeat's rate on the profile rescaled by the workers' pass logs during it (``pass_logs``:
    per sweep, ``_pass_logs.load``), "probe" by the speed probes around it (``resolve_speed``);
    ``speed_window_s`` (load only) also window by window through the rate (``load_speed.speed_timeline``)."""
    sweeps = [sweeps] if isinstance(sweeps, dict) else list(sweeps)
    speed = resolve_speed(speed, sweeps, timing, pass_logs)
    if speed_window_s is not None and speed != "load":
        raise ValueError(f"--speed-window: needs --speed load (the pass logs), not {speed!r}")
    s = sweeps[0]["settings"]
    ttft_s, tpot_s = s["ttft_slo_ms"] / 1e3, s["tpot_slo_ms"] / 1e3
    other = "server" if timing == "client" else "client"
    ttft_key = "ttft_s" if timing == "client" else "server_ttft_s"
    rows = []
    for rate in sorted({row["rate"] for sw in sweeps for row in sw["rates"]}):
        # (sweep, index of this rate in it) for every sweep that ran the rate
        members = [(k, i) for k, sw in enumerate(sweeps) for i, row in enumerate(sw["rates"]) if row["rate"] == rate]
        repeats = [sweeps[k]["rates"][i] for k, i in members]
        first = repeats[0]
        if timing == "server" and not all(has_server_timing(row["records"]) for row in repeats):
            raise ValueError(f"--timing server: the sweep's records at {rate:g} req/s carry no server timings "
                             "(recorded before they were, or an OpenAI-compatible target); use --timing client")
        scaled = rescaled(speed, profile, config, [sweeps[k] for k, _ in members],
                          [pass_logs[k] for k, _ in members] if pass_logs is not None else None,
                          [i for _, i in members], timing, speed_window_s, arrivals)
        speeds = [record for record, _, _ in scaled]
        profiles = [p for _, p, _ in scaled] or [profile] * len(repeats)
        timelines = [t for _, _, t in scaled] or [None] * len(repeats)
        sims = [simulate_rate(p, config, row, ttft_s, tpot_s, seeds, arrivals, t)
                for p, row, t in zip(profiles, repeats, timelines)]
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
                     "prefill_tokens_per_s": {"measured": throughput, "simulated": sims[0]["prefill_tokens_per_s"]},
                     "speed": speeds})
    worst = max(abs(r["diff"]["both"]) for r in rows)
    return {"slo": {"ttft_ms": s["ttft_slo_ms"], "tpot_ms": s["tpot_slo_ms"]}, "rows": rows,
            "timing": timing, "arrivals": arrivals, "repeats": len(sweeps), "speed": speed,
            # the seeds pooled (a recorded trace is one draw whatever the seed)
            "draws": [] if s.get("trace") else sorted({sw["settings"].get("seed") for sw in sweeps}, key=str),
            "speed_window_s": speed_window_s,
            "max_abs_diff_both": worst, "within_tolerance": within_tolerance(worst), "tolerance": TOLERANCE,
            "inside_ci95_both": sum(r["inside_ci95_both"] for r in rows)}


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}"


SPEED_NOTES = {
    "probe": " Each rate simulated on the profile rescaled by the machine's speed then (speed factor: measured / "
             "simulated TTFT of the lone speed-probe requests before and after the rate, median; 1.10 = 10 % slower "
             "than profiled; TPOT ratio of the same probes beside it, not applied).",
    "load": " Each rate simulated on the profile rescaled, role by role, by the machine's speed under that load (the "
            "workers' timed passes and steps during the rate over what the simulator charges for them, given what "
            "the other workers did meanwhile; 1.10 = 10 % slower than the profile says; "
            "controller/planner/load_speed.py): the per-role factors are applied, the time-weighted one scales the "
            "per-step contention terms.",
}
SPEED_COLUMNS = {"probe": "speed factor (TPOT ratio)", "load": "load speed factor (per role)"}


def _speed_cell(e: dict) -> str:
    if e.get("source") == "load":
        roles = ", ".join(f"{role} {v:.3f}" for role, v in e["by_role"].items())
        spread = ""
        if e.get("timeline"):
            seen = [v for f in e["timeline"]["factors"] for v in f.values()]
            spread = f"; windows x{min(seen, default=1.0):.2f}-{max(seen, default=1.0):.2f}"
        return f"{e['factor']:.3f} ({roles}{'' if e['complete'] else '; passes dropped'}{spread})"
    return f"{e['factor']:.3f} ({_ratio(e['tpot_ratio'])})"


def _alignments(result: dict) -> str:
    ways = sorted({e["timeline"]["aligned_by"] for r in result["rows"] for e in r["speed"] if e.get("timeline")})
    return " and ".join({"wall clock": "the rate's recorded wall-clock start",
                         "first request": "the first pass starting when the first request was sent"}[w] for w in ways)


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
    speed = result.get("speed", "none")
    scaled = speed in ("load", "probe")
    lines = [f"# Simulator vs measured: {result['label']}", "", f"`{result['command']}`", "",
             f"Sweep `{result['sweep']}` ({result['workload']}), profile `{result['profile']}` ({result['hardware']}), "
             f"SLOs TTFT {slo['ttft_ms']:g} ms / TPOT {slo['tpot_ms']:g} ms; simulated attainment is the mean of "
             f"{result['seeds']} seeds. Measured TTFT / TPOT on the {result['timing']}'s clock"
             + (" (the load generator's: what a user sees)" if result["timing"] == "client" else
                " (its usage report, from arrival at the router: without the load generator's lateness)")
             + "; simulated arrivals " + ("when the load generator sent each request" if result["arrivals"] == "sent"
                                          else "when the trace asked for them") + "."
             + (_pooling_note(result) if repeats else "")
             + SPEED_NOTES.get(speed, "")
             + (f" Within each rate, each step also scaled by its role's load speed in the {result['speed_window_s']:g}-s "
                "window of the pass log it starts in, relative to the rate's (range in the last column: "
                "controller/planner/load_speed.py speed_timeline); pass log aligned with the trace by "
                + _alignments(result) + "." if result.get("speed_window_s") else ""), "",
             "| rate | requests | both: measured (95 % interval) | simulated | diff (pts) | TTFT only: meas. / sim. "
             "| TPOT only: meas. / sim. | TTFT p50 ms meas. / sim. | TPOT p50 ms meas. / sim. "
             "| prefill tok/s over the first tokens: meas. / sim. |" + (" each sweep: meas. |" if repeats else "")
             + (f" {SPEED_COLUMNS[speed]} |" if scaled else ""),
             "|---:|---:|---:|---:|---:|---|---|---|---|---|" + ("---|" if repeats else "") + ("---|" if scaled else "")]
    for r in result["rows"]:
        m, s, ml, sl = r["measured"], r["simulated"], r["measured_latency_ms"], r["simulated_latency_ms"]
        lo, hi = r["measured_ci95_both"]
        lines.append(f"| {r['rate']:g} | {r['requests']} | {m['both']:.1%} ({lo:.0%}-{hi:.0%}) | {s['both']:.1%} "
                     f"| {100 * r['diff']['both']:+.1f} "
                     f"| {m['ttft_only']:.0%} / {s['ttft_only']:.0%} | {m['tpot_only']:.0%} / {s['tpot_only']:.0%} "
                     f"| {_ms(ml.get('ttft_p50'))} / {_ms(sl.get('ttft_p50'))} | {_ms(ml.get('tpot_p50'))} / {_ms(sl.get('tpot_p50'))} "
                     f"| {_ms(r['prefill_tokens_per_s']['measured'])} / {_ms(r['prefill_tokens_per_s']['simulated'])} |"
                     + (" " + " / ".join(f"{b:.1%}" for b in r["measured_per_repeat_both"]) + " |" if repeats else "")
                     + (" " + " / ".join(_speed_cell(e) for e in r["speed"]) + " |" if scaled else ""))
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
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


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
                         "rate: repeats of one trace (benchmarks/sweep_repeat.py shows how far they differ) or other "
                         "draws of the same workload (another --seed, at any rates)")
    ap.add_argument("--profile", required=True, help="profile JSON of the machine the sweep ran on")
    ap.add_argument("--config", required=True, help="the cluster YAML the sweep's server ran")
    ap.add_argument("--seeds", type=int, default=5, help="simulations per rate (acceptance is random)")
    ap.add_argument("--timing", default="client", choices=TIMINGS,
                    help="whose clock the measured TTFT / TPOT are read on: the load generator's (client, what a "
                         "user sees) or the server's usage report (server, without the load generator's lateness)")
    ap.add_argument("--arrivals", default="sent", choices=ARRIVALS,
                    help="simulated arrivals: when each request was sent (sent) or when the trace asked (trace)")
    ap.add_argument("--speed", default="auto", choices=SPEEDS,
                    help="load: simulate each rate on the profile rescaled by the workers' timed passes during it (the "
                         "machine's speed under that load); probe: by the sweep's speed probes around it (the idle "
                         "machine's speed then); none: the profile as it is; auto (default): load where every sweep "
                         "kept pass logs, else probe where every sweep has probes, else none")
    ap.add_argument("--speed-window", type=float, default=None, metavar="SECONDS",
                    help="with --speed load: also read the load speed window by window through each rate (every "
                         "SECONDS of its pass log) and scale each simulated step by its window's factor (the "
                         "machine's drift within a rate); default: one factor per rate")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", required=True, help="output prefix (writes .json, .md, .png)")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds: must be >= 1")
    if args.speed_window is not None and not (args.speed_window > 0 and math.isfinite(args.speed_window)):
        ap.error(f"--speed-window: expected a positive number of seconds, got {args.speed_window!r}")
    from benchmarks.sweep_repeat import check_pool  # (sweep_repeat imports this module)

    sweeps = []
    for path in args.sweep:
        with open(path, encoding="utf-8") as f:
            sweeps.append(json.load(f))
    profile = Profile.load(args.profile)
    # a CPU config whose threads outnumber the cores shares them (the profile's core sharing times its steps)
    config = SimConfig.from_cluster_config(load_config(args.config),
                                           cores=profile.devices_per_node if profile.device_type == "cpu" else None)
    try:
        check_pool(sweeps, [f"--sweep {path}" for path in args.sweep])
        pass_logs = [_pass_logs.load(path, sweep) for path, sweep in zip(args.sweep, sweeps)]
        result = compare(sweeps, profile, config, args.seeds, args.timing, args.arrivals, args.speed, pass_logs,
                         args.speed_window)
    except ValueError as err:  # SweepMismatch too
        ap.error(str(err))
    sweep = sweeps[0]
    result.update(label=args.label or sweep["settings"].get("label", os.path.basename(args.config)),
                  sweep=", ".join(os.path.relpath(p, ROOT) for p in args.sweep), profile=os.path.relpath(args.profile, ROOT),
                  hardware=profile.hardware, workload=sweep["settings"]["workload"], seeds=args.seeds,
                  command="python benchmarks/sim_validate.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    write_markdown(result, args.out + ".md")
    plot(result, args.out + ".png")
    print(open(args.out + ".md", encoding="utf-8").read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
