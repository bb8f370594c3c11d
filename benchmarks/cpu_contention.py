"""How much two single-thread model instances on this machine slow each other down (hardware only).

    python benchmarks/cpu_contention.py --out benchmarks/results/cpu_contention

The simulator's calibration fits one contention factor per mode on a burst through the real cluster
(``controller/planner/calibrate.py``). This benchmark separates the part of it that is the hardware:
two plain processes (no Ray, no gRPC, no KV transfer), each a reference engine with one torch thread
on the bundled model, like the cluster's workers (``controller/planner/core_sharing.py``'s processes, which
measure the same for instances whose threads outnumber the cores). A *victim* process repeats one kind of
work and times it while an *aggressor* process does another:

* ``prefill``: one 2048-token prompt, first token only (compute-bound);
* ``decode``: one decode step of 16 sequences at about 1024 tokens of context (weights and KV reads);
* ``idle``: nothing (the baseline; measured before and after, their mean is the reference).

Reported per victim and aggressor: the median time of the victim's unit of work and its ratio to the
idle baseline. Processes are not pinned to cores (the cluster's Ray workers are not). Writes OUT.json
and OUT.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402
from controller.planner.core_sharing import DECODE_CONTEXT, DECODE_SEQS, PREFILL_TOKENS, Worker, time_pair  # noqa: E402

MODEL = os.path.join(ROOT, "models", "stdlib-llama-15m")
KINDS = ("prefill", "decode")


def measure_pair(victim: str, aggressor: str, seconds: float, model: str) -> list[float]:
    """The victim's unit times while the aggressor runs, one torch thread each."""
    return time_pair(Worker(victim, 1, model), Worker(aggressor, 1, model), seconds)


def run(seconds: float, model: str) -> list[dict]:
    from tqdm import tqdm

    plan = [(v, a) for v in KINDS for a in ("idle", "prefill", "decode", "idle")]
    measured: dict[tuple[str, str], list[list[float]]] = {}
    for victim, aggressor in tqdm(plan, desc="victim x aggressor"):
        measured.setdefault((victim, aggressor), []).append(measure_pair(victim, aggressor, seconds, model))
    rows = []
    for victim in KINDS:
        base = statistics.fmean(statistics.median(t) for t in measured[(victim, "idle")])
        for aggressor in ("prefill", "decode"):
            (times,) = measured[(victim, aggressor)]
            med = statistics.median(times)
            rows.append({"victim": victim, "aggressor": aggressor, "units": len(times), "median_s": med,
                         "idle_median_s": base, "slowdown": med / base,
                         "idle_runs_median_s": [statistics.median(t) for t in measured[(victim, "idle")]]})
    return rows


def write_markdown(result: dict, path: str) -> None:
    lines = ["# Hardware contention between two single-thread model instances", "", f"`{result['command']}`", "",
             f"{result['machine']}; bundled model (bfloat16), one torch thread per process, processes not pinned; "
             f"{result['seconds']:g} s per pair. Prefill unit: a {PREFILL_TOKENS}-token prompt to its first token. "
             f"Decode unit: one step of {DECODE_SEQS} sequences at about {DECODE_CONTEXT} tokens of context.", "",
             "| victim | aggressor | units timed | median ms | idle median ms (before / after) | slowdown |",
             "|---|---|---:|---:|---|---:|"]
    for r in result["rows"]:
        before, after = r["idle_runs_median_s"]
        lines.append(f"| {r['victim']} | {r['aggressor']} | {r['units']} | {1e3 * r['median_s']:.1f} "
                     f"| {1e3 * before:.1f} / {1e3 * after:.1f} | {r['slowdown']:.3f}x |")
    worst = max(r["slowdown"] for r in result["rows"])
    lines += ["", f"Largest slowdown: **{worst:.2f}x**. Compare the contention factors the calibration fits on a "
                  "burst through the whole cluster (`benchmarks/results/profile_local_cpu.json`, "
                  "`calibrations[].contention_scale`): what exceeds this is the serving path (router, gRPC, Ray, "
                  "KV transfer threads, the OS scheduling them beside the workers), not the two workers' shared "
                  "caches and memory bandwidth."]
    write_lines(path, lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=12.0, help="victim timing window per pair (s)")
    ap.add_argument("--model", default=MODEL, help="HF checkpoint directory")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cpu_contention"),
                    help="output path without extension")
    args = ap.parse_args(argv)
    if args.seconds <= 0:
        ap.error(f"--seconds: must be > 0, got {args.seconds}")
    rows = run(args.seconds, args.model)
    result = {"command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
              "seconds": args.seconds, "rows": rows}
    record(result, args.out, write_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
