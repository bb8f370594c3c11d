"""How long a control call waits for a worker's step loop: a plain lock against ``controller/step_gate.py``.

A loop thread runs steps of ``--step-ms`` of torch matmuls (they release the GIL, as a forward pass does)
under the lock, back to back, as a busy worker does; another thread makes a control call after a random gap
(uniform, mean ``--call-every-ms``) and times how long it waits for the lock. With a fair handoff the wait is
the rest of the step in progress: at most one step, half a step on average. ``--busy N`` processes spin on the
cores meanwhile, as the other workers and the server do on the 2-core cluster; ``--niceness N`` runs the loop
and the caller N steps below them, as Ray runs the actors (worker niceness 15) beside a server at 0.

    python benchmarks/step_gate_bench.py --out benchmarks/results/step_gate_bench

Writes OUT.json and OUT.md (wait percentiles per lock kind).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from controller.step_gate import StepGate  # noqa: E402


class PlainLock:
    """What the actors used before the gate: one RLock for the loop's steps and the calls."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def step(self):
        return self._lock

    def call(self):
        return self._lock


def spin(stop) -> None:
    """A busy core: another worker or the server, in its own process."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    while not stop.is_set():
        a @ a


def measure(gate, step_s: float, every_s: float, calls: int, seed: int = 0) -> list[float]:
    """Seconds each of ``calls`` control calls waited for ``gate`` while a loop thread ran steps."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            with gate.step():
                t = time.perf_counter()
                while time.perf_counter() - t < step_s:
                    a @ a
            time.sleep(0)  # what the actor's loop does between steps: emit outputs (Python, GIL held)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    waits = []
    rng = random.Random(seed)
    try:
        for _ in range(calls):
            time.sleep(rng.uniform(0.0, 2 * every_s))
            t = time.perf_counter()
            with gate.call():
                waits.append(time.perf_counter() - t)
    finally:
        stop.set()
        thread.join()
    return waits


def summary(waits: list[float]) -> dict:
    q = statistics.quantiles(waits, n=100, method="inclusive")
    return {"calls": len(waits), "median_ms": 1e3 * statistics.median(waits), "p90_ms": 1e3 * q[89],
            "p99_ms": 1e3 * q[98], "max_ms": 1e3 * max(waits), "mean_ms": 1e3 * statistics.fmean(waits)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-ms", type=float, default=30.0, help="length of one loop step (a decode step)")
    ap.add_argument("--call-every-ms", type=float, default=37.0, help="gap between control calls")
    ap.add_argument("--calls", type=int, default=200, help="control calls per lock kind")
    ap.add_argument("--busy", type=int, default=2, help="processes spinning on the cores meanwhile")
    ap.add_argument("--niceness", type=int, default=0, help="niceness of the loop and the caller above the spinners")
    ap.add_argument("--out", required=True, help="output prefix (writes .json, .md)")
    args = ap.parse_args(argv)
    for name in ("step_ms", "call_every_ms"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')}: must be > 0")
    if args.calls < 2:
        ap.error("--calls: must be >= 2")
    if args.busy < 0:
        ap.error("--busy: must be >= 0")
    if not 0 <= args.niceness <= 19:
        ap.error("--niceness: must be in 0..19")
    results = {}
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    os.nice(args.niceness)  # after the spinners started: they keep this process's niceness of before
    try:
        for label, gate in (("plain lock", PlainLock()), ("StepGate", StepGate())):
            results[label] = summary(measure(gate, args.step_ms / 1e3, args.call_every_ms / 1e3, args.calls))
            print(f"{label}: " + ", ".join(f"{k} {v:.1f}" for k, v in results[label].items()), flush=True)
    finally:
        stop.set()
        for p in spinners:
            p.join(5)
    record = {"step_ms": args.step_ms, "call_every_ms": args.call_every_ms, "busy": args.busy,
              "niceness": args.niceness, "cpus": os.cpu_count(),
              "command": "python benchmarks/step_gate_bench.py " + " ".join(sys.argv[1:]), "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    lines = [f"# Control-call wait for a busy step loop ({args.step_ms:g} ms steps, a call every "
             f"{args.call_every_ms:g} ms on average, {args.busy} other busy processes, loop and caller at niceness "
             f"+{args.niceness}, {os.cpu_count()} CPUs)", "", f"`{record['command']}`", "",
             "| lock | calls | median ms | mean ms | p90 ms | p99 ms | max ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, r in results.items():
        lines.append(f"| {label} | {r['calls']} | {r['median_ms']:.1f} | {r['mean_ms']:.1f} | {r['p90_ms']:.1f} | "
                     f"{r['p99_ms']:.1f} | {r['max_ms']:.1f} |")
    lines += ["", f"With the cores to itself, a fair handoff waits for the rest of the step in progress: at most "
                  f"{args.step_ms:g} ms, {args.step_ms / 2:g} ms on average. Beyond that the wait is the OS "
                  "scheduler's (the caller is not running), whatever the lock."]
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
