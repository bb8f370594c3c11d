"""How repeatable the core-sharing measurement is: ``core_sharing.measure`` run several times per
(prefill threads, decode threads) pair, each run's factors and alone times recorded.

    python benchmarks/core_sharing_repeats.py --pairs 2:1 --repeats 3 \
        --out benchmarks/results/same_session_18/core_sharing_repeats

``magicserve profile --add-threads`` stores one measurement per pair; the planner's choice between sharing
cores and not can turn on its factors, so their spread is worth knowing. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402
from controller.planner.core_sharing import measure  # noqa: E402

MODEL = os.path.join(ROOT, "models", "stdlib-llama-15m")


def _pair(text: str) -> tuple[int, int]:
    try:
        p, d = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pairs: expected PREFILL_THREADS:DECODE_THREADS, got {text!r}") from None
    if p < 1 or d < 1:
        raise argparse.ArgumentTypeError(f"--pairs: thread counts must be >= 1, got {text!r}")
    return p, d


def write_markdown(result: dict, path: str) -> None:
    lines = ["# Core sharing, repeated", "", f"`{result['command']}`", "",
             f"{result['machine']}; {result['seconds']:g} s per timed window (6 windows per run: each role alone, "
             "each against the other, each alone again); model `stdlib-llama-15m`.", "",
             "| prefill + decode threads | run | prefill alone ms | prefill factor | decode alone ms | decode factor |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in result["runs"]:
        lines.append(f"| {r['prefill_threads']} + {r['decode_threads']} | {r['run']} | {1e3 * r['prefill_alone_s']:.0f} "
                     f"| {r['prefill_factor']:.2f}x | {1e3 * r['decode_alone_s']:.1f} | {r['decode_factor']:.2f}x |")
    lines += ["", "| pair | prefill factor median (min-max) | decode factor median (min-max) |", "|---|---|---|"]
    for pair, s in result["summary"].items():
        lines.append(f"| {pair} | {s['prefill'][1]:.2f}x ({s['prefill'][0]:.2f}-{s['prefill'][2]:.2f}) "
                     f"| {s['decode'][1]:.2f}x ({s['decode'][0]:.2f}-{s['decode'][2]:.2f}) |")
    write_lines(path, lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=_pair, nargs="+", default=[(2, 1)], help="PREFILL:DECODE thread counts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=12.0, help="timed window per role and state")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--out", required=True, help="output path without extension")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.seconds <= 0:
        ap.error("--repeats must be >= 1 and --seconds > 0")
    runs, summary = [], {}
    for p, d in args.pairs:
        mine = []
        for i in range(args.repeats):
            c = measure(args.model, p, d, args.seconds)
            mine.append({"run": i + 1, **dataclasses.asdict(c)})
            print(f"P{p}+D{d} run {i + 1}: prefill {c.prefill_factor:.2f}x, decode {c.decode_factor:.2f}x", flush=True)
        runs += mine
        summary[f"{p}+{d}"] = {role: (min(v), statistics.median(v), max(v)) for role in ("prefill", "decode")
                               for v in [[r[f"{role}_factor"] for r in mine]]}
    result = {"command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
              "seconds": args.seconds, "runs": runs, "summary": summary}
    record(result, args.out, write_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
