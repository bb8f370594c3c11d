"""How much slower the workers' own forward passes run inside the serving cluster than the profile says,
alone and under a burst: the interference the simulator's contention factor stands for, measured in place.

    python benchmarks/serving_interference.py --config cluster_configs/local-no-spec.yaml \\
        --profile benchmarks/results/profile_local_cpu.json --out benchmarks/results/serving_interference

The calibration (``controller/planner/calibrate.py``) fits one contention factor on the latency
distributions of a burst, which mixes every cause. Here the disaggregated cluster is served for real as
the calibration serves it (speculation off; isolated requests, then a burst, with the calibration's
prompt and output lengths and its way of picking the burst's rate; other random token ids), and each
prefill and decode worker hands over the passes it timed (``modeling/pass_log.py``). Each pass
is divided by the profile's prediction for its shape. Reported per pass kind: the median ratio with the
cluster otherwise idle (isolated requests), under the burst while a worker of the other role was running
a pass for most of this one, and under the burst while it was not; and their quotients, the
interference. Colocated instances do not log passes (mixed steps). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shlex
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402
from controller.planner.profile import Profile, prefill_features  # noqa: E402
from decode_worker.policy import PassShape  # noqa: E402

ROLE_OF_KIND = {"prefill": "prefill", "decode": "decode", "verify": "decode"}
OVERLAP = 0.5  # share of a pass that passes of the other role must cover for it to count as "other busy"


def predicted_s(profile: Profile, rec: dict) -> float:
    """The profile's time for a logged pass (one device per instance, as on the CPU cluster)."""
    shape = rec["shape"]
    if rec["kind"] == "prefill":
        return profile.prefill_model(1).predict(prefill_features([tuple(c) for c in shape["chunks"]]))
    return profile.target_model(1).predict_pass(PassShape(shape["seqs"], shape["kv_tokens"], shape["new_tokens"]))


def _intervals(records: list[dict]) -> list[tuple[float, float]]:
    return sorted((r["end_s"] - r["seconds"], r["end_s"]) for r in records)


def _covered(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    """Share of [start, end] covered by ``intervals``, summed and capped at 1: exact for the passes of one
    worker (disjoint); with several workers of the other role, overlapping passes count twice."""
    if end <= start:
        return 0.0
    covered = sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals if b > start and a < end)
    return min(1.0, covered / (end - start))


def summarise(profile: Profile, isolated: list[dict], burst: list[dict]) -> list[dict]:
    """Per pass kind: median measured / predicted time, isolated and under the burst (other role busy or
    idle during the pass), and the interference (burst median / isolated median)."""
    rows = []
    for kind in ("prefill", "decode"):
        other = _intervals([r for r in burst if ROLE_OF_KIND[r["kind"]] != ROLE_OF_KIND[kind]])
        iso = [r["seconds"] / predicted_s(profile, r) for r in isolated if r["kind"] == kind]
        busy, idle = [], []
        for r in burst:
            if r["kind"] != kind:
                continue
            ratio = r["seconds"] / predicted_s(profile, r)
            (busy if _covered(r["end_s"] - r["seconds"], r["end_s"], other) >= OVERLAP else idle).append(ratio)
        med = {name: statistics.median(v) if v else None for name, v in (("isolated", iso), ("busy", busy),
                                                                         ("idle", idle), ("burst", busy + idle))}
        quotient = (lambda x: x / med["isolated"] if x and med["isolated"] else None)  # noqa: E731
        rows.append({"kind": kind, "passes": {"isolated": len(iso), "burst_other_busy": len(busy),
                                              "burst_other_idle": len(idle)},
                     "median_ratio": med, "interference": quotient(med["burst"]),
                     "interference_other_busy": quotient(med["busy"]), "interference_other_idle": quotient(med["idle"])})
    return rows


def measure(config, profile: Profile, requests: int, burst_requests: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Serve ``config`` as the calibration does; the passes of all workers, isolated phase and burst."""
    import ray

    from controller.client import Client
    from controller.planner import calibrate as cal
    from controller.planner.simulator import SimConfig
    from controller.server import serve_in_thread

    if config.mode != "disaggregated":
        raise SystemExit(f"--config: mode must be disaggregated (colocated instances do not log passes), got {config.mode!r}")
    max_prompt = cal.max_calibration_prompt(config)
    lengths = cal.calibration_lengths(max_prompt, requests, seed)
    outputs = cal.OUTPUT_TOKENS
    # the burst's rate as the calibration picks it: the isolated terms, no contention
    isolated_terms = profile.with_calibration(dataclasses.replace(profile.calibration("disaggregated"), contention_scale=1.0))
    trace = cal.burst_trace(isolated_terms, SimConfig.from_cluster_config(config),
                            cal.calibration_lengths(max_prompt, burst_requests, seed + 1), outputs, seed)
    names = [f"prefill-{i}" for i in range(config.prefill.instances)] + \
            [f"decode-{i}" for i in range(config.decode.instances)]
    with serve_in_thread(config) as address, Client(address) as client:
        actors = [ray.get_actor(f"magicserve-{n}", namespace=config.ray.namespace) for n in names]

        def drain() -> list[dict]:
            return [rec for logs in ray.get([a.pass_log.remote() for a in actors]) for rec in logs]

        cal.time_isolated(client, cal.random_prompts(config, [64, 64], random.Random(seed)), outputs)  # warm-up
        drain()
        cal.time_isolated(client, cal.random_prompts(config, lengths, random.Random(seed + 2)), outputs)
        isolated = drain()
        cal.send_burst(client, trace, cal.random_prompts(config, [r.prompt_tokens for r in trace], random.Random(seed + 3)))
        burst = drain()
    return isolated, burst


def write_markdown(result: dict, path: str) -> None:
    fmt = (lambda x: "-" if x is None else f"{x:.2f}")  # noqa: E731
    lines = ["# Interference inside the serving cluster: the workers' own passes against the profile", "",
             f"`{result['command']}`", "",
             f"Config `{result['config']}` served as the calibration serves it (speculation off): {result['requests']} "
             f"isolated requests, then a {result['burst_requests']}-request burst; profile `{result['profile']}`. "
             "Ratio = measured pass time / the profile's prediction for its shape (median). 'Other busy': a worker of "
             f"the other role ran passes over at least {OVERLAP:.0%} of this pass.", "",
             "| pass | passes (isolated / burst, other busy / other idle) | isolated | burst | burst, other busy "
             "| burst, other idle | interference (burst / isolated) | other busy | other idle |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        n, m = r["passes"], r["median_ratio"]
        lines.append(f"| {r['kind']} | {n['isolated']} / {n['burst_other_busy']} / {n['burst_other_idle']} "
                     f"| {fmt(m['isolated'])} | {fmt(m['burst'])} | {fmt(m['busy'])} | {fmt(m['idle'])} "
                     f"| **{fmt(r['interference'])}** | {fmt(r['interference_other_busy'])} "
                     f"| {fmt(r['interference_other_idle'])} |")
    lines += ["", "The simulator applies one calibrated contention factor to every step of an instance while "
                  "another instance is busy; compare it (the profile's `calibrations[].contention_scale`) with the "
                  "interference per kind above."]
    write_lines(path, lines)


def main(argv: list[str] | None = None) -> int:
    from controller.config import load_config
    from controller.planner.calibrate import calibration_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "cluster_configs", "local-no-spec.yaml"))
    ap.add_argument("--profile", default=os.path.join(ROOT, "benchmarks", "results", "profile_local_cpu.json"))
    ap.add_argument("--requests", type=int, default=16, help="isolated requests (as the calibration)")
    ap.add_argument("--burst-requests", type=int, default=40, help="burst requests (as the calibration)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "serving_interference"))
    args = ap.parse_args(argv)
    for name in ("requests", "burst_requests"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    profile = Profile.load(args.profile)
    isolated, burst = measure(calibration_config(load_config(args.config)), profile, args.requests,
                              args.burst_requests, args.seed)
    result = {"command": "python benchmarks/serving_interference.py "
                         + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
              "config": os.path.relpath(args.config, ROOT), "profile": os.path.relpath(args.profile, ROOT),
              "requests": args.requests, "burst_requests": args.burst_requests, "seed": args.seed,
              "rows": summarise(profile, isolated, burst), "isolated_passes": isolated, "burst_passes": burst}
    record(result, args.out, write_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
