"""Elastic pools at GPU scale, simulated: the online planner resizing prefill and decode pools of up to 64 GPUs
while a trace's load steps up, shifts from chat to long documents and falls back, against fixed shapes on
the same trace (the planner's own simulator, the analytical H100 profile).

    python benchmarks/elastic_simulated.py
    python benchmarks/elastic_simulated.py --phases chat:15:600,long_doc:20:600 --startup-s 60

Systems:

* best fixed: the fixed shape with the fewest GPUs whose attainment over the whole trace reaches the target
  (every shape within the bounds tried, fewest GPUs first): what an offline plan for this trace buys;
* fixed max: every pool at its bound;
* elastic: starting from the bounds' minimums, ``planner/sim_elastic.py`` (the served planner's window,
  decisions and policy) resizes the pools; a new instance holds its GPUs from the resize and serves
  ``--startup-s`` later (placement, weights, warm-up), once per value given;
* with ``--load-aware``, load-aware disaggregation (``controller/load_aware.py``: a prompt the prefill pool
  would serve past the TTFT target is prefilled on a decode instance within its TPOT slack, both at 0.8 of the
  SLOs, as the served default): the best fixed plan found again, and the elastic run at the first start-up
  time, without and with role changes (an instance switching pools in place, serving in the other
  ``--switch-s`` after it drained).

Figures per system: SLO attainment (whole trace and per phase), GPU-hours held, goodput per GPU-hour
(requests that met both SLOs per GPU-hour) and its ratio to the best fixed plan's; the elastic runs' resizes.
Writes ``<out>.json``, ``<out>.md``, ``<out>.png``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402
from benchmarks._slo_plots import _pyplot  # noqa: E402
from controller.config import AutoscaleSection, PoolBounds  # noqa: E402
from decode_worker.config import SpeculationConfig  # noqa: E402
from controller.load_aware import LoadAwarePolicy  # noqa: E402
from planner.analytical import analytical_profile  # noqa: E402
from planner.search import SLOTarget  # noqa: E402
from planner.sim_elastic import simulate_elastic  # noqa: E402
from planner.simulator import PoolPlan, SimConfig, simulate  # noqa: E402
from planner.slo import AttainmentWatch, attainment  # noqa: E402
from planner.workload import RequestSpec, make_trace, workload_shape  # noqa: E402

BUCKET_S = 60.0  # the timeline's resolution


def parse_phases(text: str) -> list[tuple[str, float, float]]:
    """``WORKLOAD:RATE:SECONDS,...`` -> [(workload, req/s, seconds)]."""
    phases = []
    for part in text.split(","):
        try:
            name, rate, seconds = part.split(":")
            phases.append((workload_shape(name).name, float(rate), float(seconds)))
        except ValueError as err:
            raise SystemExit(f"--phases: {part!r}: expected WORKLOAD:RATE:SECONDS ({err})") from None
    return phases


def phased_trace(phases, seed: int) -> list[RequestSpec]:
    """Poisson arrivals per phase, one after the other."""
    trace, start = [], 0.0
    for i, (name, rate, seconds) in enumerate(phases):
        n = int(rate * seconds * 1.5) + 10
        for r in make_trace(workload_shape(name), rate, n, seed=seed + i):
            if r.arrival_s < seconds:
                trace.append(RequestSpec(start + r.arrival_s, r.prompt_tokens, r.output_tokens))
        start += seconds
    return trace


SLO_MARGIN = 0.8  # load-aware decisions aim at this fraction of each SLO (load_aware.slo_margin's default)


def config_for(profile, tp: int, prefill: int, decode: int, load_aware: SLOTarget | None = None) -> SimConfig:
    """``prefill`` + ``decode`` instances of ``tp`` GPUs; with ``load_aware`` (the SLOs), load-aware
    disaggregation on."""
    costs = profile.costs(tp, 1)
    aware = {} if load_aware is None else {
        "load_aware": LoadAwarePolicy(True, load_aware.ttft_s * SLO_MARGIN, load_aware.ttft_s),
        "decode_prefill_tpot_s": load_aware.tpot_s * SLO_MARGIN}
    return SimConfig(prefill=PoolPlan(prefill, tp, costs.prefill_kv_capacity_tokens, 8192, 256),
                     decode=PoolPlan(decode, tp, costs.kv_capacity_tokens, 1, 256),
                     speculation=SpeculationConfig(drafter="none"), max_concurrent=1_000_000, **aware)


def summarise(records, slo: SLOTarget, phases, device_seconds: float) -> dict:
    both = attainment([r.outcome() for r in records], slo.ttft_s, slo.tpot_s).both
    per_phase, start = [], 0.0
    for _, _, seconds in phases:
        recs = [r for r in records if start <= r.arrival_s < start + seconds]
        per_phase.append(attainment([r.outcome() for r in recs], slo.ttft_s, slo.tpot_s).both if recs else math.nan)
        start += seconds
    timeline = []
    end = start
    for lo in range(0, int(math.ceil(end / BUCKET_S))):
        recs = [r for r in records if lo * BUCKET_S <= r.arrival_s < (lo + 1) * BUCKET_S]
        timeline.append(attainment([r.outcome() for r in recs], slo.ttft_s, slo.tpot_s).both if recs else math.nan)
    gpu_hours = device_seconds / 3600
    good = both * len(records)
    return {"attainment": both, "per_phase": per_phase, "gpu_hours": gpu_hours, "good_requests": good,
            "goodput_per_gpu_hour": good / gpu_hours, "attainment_per_minute": timeline}


def best_fixed(profile, tp: int, bounds: tuple[int, int], trace, slo: SLOTarget, load_aware: bool = False):
    """The fixed (prefill, decode) with the fewest GPUs that meets the target on the whole trace."""
    shapes = sorted(itertools.product(range(bounds[0], bounds[1] + 1), repeat=2), key=lambda s: (sum(s), s[1]))
    for p, d in shapes:
        watch = AttainmentWatch(len(trace), slo.ttft_s, slo.tpot_s, slo.attainment)
        if simulate(profile, config_for(profile, tp, p, d, slo if load_aware else None), trace, watch=watch).verdict:
            return p, d
    return None


def run(args) -> dict:
    profile = analytical_profile(args.gpu, args.model)
    slo = SLOTarget(args.ttft_ms / 1e3, args.tpot_ms / 1e3, args.attainment)
    phases = parse_phases(args.phases)
    trace = phased_trace(phases, args.seed)
    lo, hi = 1, args.max_instances
    systems = {}

    def fixed(label: str, p: int, d: int, load_aware: bool = False) -> None:
        t0 = time.perf_counter()
        res = simulate(profile, config_for(profile, args.tp, p, d, slo if load_aware else None), trace)
        systems[label] = {"shape": f"{p} P + {d} D (tp{args.tp})", "gpus": [(0.0, (p + d) * args.tp)],
                          **summarise(res.records, slo, phases, res.device_seconds)}
        if res.load_aware is not None:
            systems[label]["load_aware"] = {f"{w}/{r}": n for (w, r), n in sorted(res.load_aware.items())}
        print(f"{label}: {systems[label]['attainment']:.3f}, {systems[label]['gpu_hours']:.2f} GPU-h "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)

    best = best_fixed(profile, args.tp, (lo, hi), trace, slo)
    if best is not None:
        fixed("best fixed", *best)
    fixed("fixed max", hi, hi)
    autoscale = AutoscaleSection(prefill=PoolBounds(lo, hi), decode=PoolBounds(lo, hi), interval_s=args.interval_s,
                                 window_s=args.window_s, cooldown_s=args.cooldown_s, headroom=args.headroom,
                                 decision_time_limit_s=args.decision_time_limit_s)
    runs = [(f"elastic (start-up {startup:g} s)", startup, False, None) for startup in args.startup_s]
    if args.load_aware:
        best_aware = best_fixed(profile, args.tp, (lo, hi), trace, slo, load_aware=True)
        if best_aware is not None:
            fixed("best fixed, load-aware", *best_aware, load_aware=True)
        first = args.startup_s[0]
        runs += [(f"elastic (start-up {first:g} s), load-aware", first, True, None),
                 (f"elastic (start-up {first:g} s), load-aware, role changes ({args.switch_s:g} s)", first, True,
                  args.switch_s)]
    for label, startup, aware, switch_s in runs:
        t0 = time.perf_counter()
        er = simulate_elastic(profile, config_for(profile, args.tp, lo, lo, slo if aware else None), trace, slo,
                              autoscale, startup, switch_s=switch_s)
        end = er.result.duration_s
        steps = sorted({0.0, *(i.allocated_s for i in er.instances),
                        *(i.stopped_s for i in er.instances if not math.isnan(i.stopped_s))})
        systems[label] = {
            "shape": f"{lo}-{hi} P + {lo}-{hi} D (tp{args.tp}), planner", "startup_s": startup,
            "gpus": [(t, er.devices_at(t)) for t in steps if t <= end],
            "resizes": [{"at_s": t, "pool": pool, "instances": n} for t, pool, n in er.resizes()],
            "decision_seconds_max": max((t.decision.seconds for t in er.ticks), default=0.0),
            "decisions": len(er.ticks),
            "role_changes": sum(1 for t in er.ticks if len(t.resizes) == 2 and sum(t.resizes.values()) ==
                                sum(t.current.values())) if switch_s is not None else 0,
            **summarise(er.result.records, slo, phases, er.result.device_seconds)}
        if er.result.load_aware is not None:
            systems[label]["load_aware"] = {f"{w}/{r}": n for (w, r), n in sorted(er.result.load_aware.items())}
        print(f"{label}: {systems[label]['attainment']:.3f}, {systems[label]['gpu_hours']:.2f} GPU-h, "
              f"{len(systems[label]['resizes'])} resizes ({time.perf_counter() - t0:.0f} s)", flush=True)
    base = systems.get("best fixed")
    for s in systems.values():
        s["vs_best_fixed"] = s["goodput_per_gpu_hour"] / base["goodput_per_gpu_hour"] if base else math.nan
    rate_per_minute = [sum(1 for r in trace if m * BUCKET_S <= r.arrival_s < (m + 1) * BUCKET_S) / BUCKET_S
                       for m in range(len(next(iter(systems.values()))["attainment_per_minute"]))]
    return {"command": " ".join(["python benchmarks/elastic_simulated.py", shlex.join(sys.argv[1:])]).strip(),
            "profile": profile.hardware, "model": profile.model, "tensor_parallel": args.tp,
            "slo": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms, "attainment": args.attainment},
            "phases": [{"workload": n, "rate": r, "seconds": s} for n, r, s in phases], "requests": len(trace),
            "bounds": {"min_instances": lo, "max_instances": hi},
            "autoscale": {"interval_s": args.interval_s, "window_s": args.window_s, "cooldown_s": args.cooldown_s,
                          "headroom": args.headroom, "scale_down_after": autoscale.scale_down_after},
            "rate_per_minute": rate_per_minute, "systems": systems}


def write_markdown(result: dict, path: str) -> None:
    slo, phases = result["slo"], result["phases"]
    phase_cols = " | ".join(f"{p['workload']} {p['rate']:g}/s" for p in phases)
    lines = ["# Elastic pools at GPU scale (simulated)", "", f"`{result['command']}`", "",
             f"{result['model']} on {result['profile']}; every instance tensor_parallel {result['tensor_parallel']}; "
             f"pools {result['bounds']['min_instances']}-{result['bounds']['max_instances']} instances each "
             f"(up to {2 * result['bounds']['max_instances'] * result['tensor_parallel']} GPUs); SLOs "
             f"{slo['ttft_ms']:g} ms TTFT / {slo['tpot_ms']:g} ms TPOT for {slo['attainment']:.0%} of requests. "
             f"Trace: {result['requests']} requests, Poisson arrivals in phases of "
             + ", then ".join(f"{p['workload']} at {p['rate']:g} req/s for {p['seconds']:g} s" for p in phases)
             + f". Planner: every {result['autoscale']['interval_s']:g} s on a {result['autoscale']['window_s']:g} s "
             f"window, headroom {result['autoscale']['headroom']:g}, cooldown {result['autoscale']['cooldown_s']:g} s, "
             f"shrinking after {result['autoscale']['scale_down_after']} decisions in a row.", "",
             f"| system | shape | attainment | {phase_cols} | GPU-hours | goodput per GPU-hour | vs best fixed |",
             "|---|---|---:|" + "---:|" * len(phases) + "---:|---:|---:|"]
    for label, s in result["systems"].items():
        per = " | ".join(f"{a:.0%}" for a in s["per_phase"])
        lines.append(f"| {label} | {s['shape']} | {s['attainment']:.1%} | {per} | {s['gpu_hours']:.2f} | "
                     f"{s['goodput_per_gpu_hour']:.0f} | {s['vs_best_fixed']:.2f}x |")
    lines += ["", "Goodput per GPU-hour: requests that met both SLOs per GPU-hour held (an instance holds its "
              "GPUs from the resize that adds it to the end of its drain).", ""]
    for label, s in result["systems"].items():
        if "resizes" not in s:
            continue
        moves = ", ".join(f"{r['at_s']:.0f} s {r['pool']} -> {r['instances']}" for r in s["resizes"])
        switched = f", {s['role_changes']} of them role changes" if s.get("role_changes") else ""
        lines.append(f"- {label}: {len(s['resizes'])} resizes{switched} over {s['decisions']} decisions (slowest "
                     f"decision {s['decision_seconds_max']:.1f} s of wall time): {moves}")
    for label, s in result["systems"].items():
        if "load_aware" in s:
            total = sum(s["load_aware"].values())
            local = sum(n for k, n in s["load_aware"].items() if k.startswith("decode/"))
            lines.append(f"- {label}: {local} of {total} prompts prefilled on a decode instance "
                         f"({local / max(total, 1):.1%})")
    best = result["systems"].get("best fixed")
    if best is not None:
        lines += ["", "Reading:", ""]
        for label, s in result["systems"].items():
            if "resizes" not in s:
                continue
            low = [m for m, a in enumerate(s["attainment_per_minute"]) if a < slo["attainment"]]
            lines.append(
                f"- {label}: {s['gpu_hours'] / best['gpu_hours']:.2f}x the best fixed plan's GPU-hours at "
                f"{s['attainment']:.1%} attainment against its {best['attainment']:.1%}, so "
                f"{s['vs_best_fixed']:.2f}x its goodput per GPU-hour; {len(low)} of "
                f"{len(s['attainment_per_minute'])} minutes below the target"
                + (f" (minutes {', '.join(str(m) for m in low)}: after a step in load, while the instances it "
                   f"asked for start and the backlog drains)" if low else "") + ".")
    lines += ["", "The planner plans for the load of its window as if the cluster started empty; after a step up "
              "in load, the requests that queued while new instances started are drained at the new shape's "
              "surplus, which is where the minutes below target come from (the longer the start-up, the more).",
              "", "![GPUs and attainment over time](" + os.path.basename(path[:-3]) + ".png)"]
    write_lines(path, lines)


def plot(result: dict, path: str) -> None:
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    end = len(result["rate_per_minute"]) * BUCKET_S
    for label, s in result["systems"].items():
        ts = [t for t, _ in s["gpus"]] + [end]
        gs = [g for _, g in s["gpus"]]
        top.step([t / 60 for t in ts], gs + gs[-1:], where="post", label=label)
        minutes = [(m + 0.5) * BUCKET_S / 60 for m in range(len(s["attainment_per_minute"]))]
        bottom.plot(minutes, [100 * a for a in s["attainment_per_minute"]], marker=".", label=label)
    top.set_ylabel("GPUs held")
    rate = top.twinx()
    rate.plot([(m + 0.5) for m in range(len(result["rate_per_minute"]))], result["rate_per_minute"], color="grey",
              linestyle=":", label="arrival rate")
    rate.set_ylabel("arrival rate (req/s, dotted)")
    bottom.legend(loc="center right", fontsize=8)
    start = 0.0
    for p in result["phases"]:
        for ax in (top, bottom):
            ax.axvline(start / 60, color="lightgrey", linewidth=0.8)
        top.text(start / 60 + 0.3, top.get_ylim()[1] * 0.92, f"{p['workload']} {p['rate']:g}/s", fontsize=8)
        start += p["seconds"]
    bottom.axhline(100 * result["slo"]["attainment"], color="black", linestyle="--", linewidth=0.8)
    bottom.set_ylabel("SLO attainment per minute (%)")
    bottom.set_xlabel("minutes")
    bottom.set_ylim(-5, 105)
    fig.suptitle(f"Elastic pools, simulated: {result['model']}, tp{result['tensor_parallel']} instances")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="H100-80GB-SXM")
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--tp", type=int, default=4, help="tensor_parallel of every instance")
    ap.add_argument("--max-instances", type=int, default=8, help="each pool's bound")
    ap.add_argument("--phases", default="chat:15:600,chat:45:600,long_doc:20:600,chat:15:600",
                    help="WORKLOAD:RATE:SECONDS,... (workloads: planner/workload.py)")
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--tpot-ms", type=float, default=25.0)
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--startup-s", type=lambda v: [float(x) for x in v.split(",")], default=[30.0, 60.0, 120.0],
                    help="seconds from a resize to the new instance serving (comma-separated: one run each)")
    ap.add_argument("--interval-s", type=float, default=15.0)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--cooldown-s", type=float, default=30.0)
    ap.add_argument("--headroom", type=float, default=1.2)
    ap.add_argument("--decision-time-limit-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-aware", action="store_true",
                    help="add the systems with load-aware disaggregation and role changes")
    ap.add_argument("--switch-s", type=float, default=10.0,
                    help="seconds from a drained instance's role change to it serving in the other pool")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "elastic_pools_simulated"))
    args = ap.parse_args()
    result = run(args)
    record(result, args.out, write_markdown)
    plot(result, args.out + ".png")


if __name__ == "__main__":
    main()
