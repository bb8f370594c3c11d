"""Cost of the adaptive speculation policy's own bookkeeping: plain decoding (fixed k = 0) against the
adaptive policy on the same worker and sequences, in alternating runs.

Where the policy chooses k = 0, its steps do the same forward pass as plain decoding plus its decisions
(one per CHOICE_REUSE_STEPS steps) and step-time feedback; the difference of the two step times is that
overhead (plus any exploratory k > 0 steps, counted in the output).

    python benchmarks/policy_overhead.py --batch 1 --prefix 1024
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.spec_decode import RESULTS, SINK_TOKENS, heldout_tokens, make_prompts  # noqa: E402
from controller.defaults import DEFAULT_MODEL_DIR  # noqa: E402
from decode_worker.config import DecodeWorkerConfig, SpeculationConfig  # noqa: E402
from decode_worker.worker import DecodeWorker  # noqa: E402
from modeling.sampling import SamplingParams  # noqa: E402


def timed_run(worker: DecodeWorker, spec: SpeculationConfig, ids: list[str], start_len: int, steps: int,
              k: int | None) -> tuple[float, dict[int, int]]:
    """Mean ms per step of ``steps`` steps from ``start_len`` tokens, and the k of each step (counts)."""
    worker.set_speculation(spec)
    for rid in ids:
        worker.rewind(rid, start_len)
    before = dict(worker.metrics.k_counts)
    t0 = time.perf_counter()
    for _ in range(steps):
        worker.step(k)
    ms = (time.perf_counter() - t0) / steps * 1e3
    return ms, {kk: c - before.get(kk, 0) for kk, c in worker.metrics.k_counts.items() if c != before.get(kk, 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(RESULTS, "policy_overhead"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    worker = DecodeWorker(args.model, DecodeWorkerConfig(
        dtype="bfloat16", kv_cache_tokens=args.batch * (args.prefix + 4096) + 4096, max_num_seqs=args.batch + 8,
        prefill_chunk=2048, speculation=SpeculationConfig(drafter="self_sparse", sink_tokens=SINK_TOKENS)))
    prompts = make_prompts(heldout_tokens(worker.tokenizer, args.batch * args.prefix), args.batch, args.prefix)
    ids = [f"p{i}" for i in range(args.batch)]
    for rid, p in zip(ids, prompts):
        worker.add_local(rid, p, SamplingParams(max_tokens=10**6, ignore_eos=True))
    start_len = args.prefix + 1
    common = dict(drafter="self_sparse", sink_tokens=SINK_TOKENS, budget=args.budget, max_k=5)
    plain = SpeculationConfig(k_policy="fixed", k=0, **common)
    adaptive = SpeculationConfig(k_policy="adaptive", **common)
    timed_run(worker, adaptive, ids, start_len, args.steps, None)  # warm the policy on this cell
    plain_ms, adaptive_ms, adaptive_ks = [], [], {}
    for _ in range(args.rounds):
        plain_ms.append(timed_run(worker, plain, ids, start_len, args.steps, 0)[0])
        ms, ks = timed_run(worker, adaptive, ids, start_len, args.steps, None)
        adaptive_ms.append(ms)
        for kk, c in ks.items():
            adaptive_ks[kk] = adaptive_ks.get(kk, 0) + c
    result = {
        "command": "python benchmarks/policy_overhead.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "threads": args.threads, "torch": torch.__version__,
        "batch": args.batch, "prefix": args.prefix, "budget": args.budget, "steps": args.steps, "rounds": args.rounds,
        "plain_ms": plain_ms, "adaptive_ms": adaptive_ms, "adaptive_k_counts": dict(sorted(adaptive_ks.items())),
        "plain_median_ms": statistics.median(plain_ms), "adaptive_median_ms": statistics.median(adaptive_ms),
    }
    result["overhead"] = result["adaptive_median_ms"] / result["plain_median_ms"] - 1.0
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(f"# Adaptive policy overhead\n\n`{result['command']}`  \n{result['machine']}, {args.threads} threads; "
                f"batch {args.batch} x prefix {args.prefix}, budget {args.budget}; {args.rounds} alternating rounds of "
                f"{args.steps} steps, medians.\n\n"
                "| plain decoding ms/step | adaptive ms/step | overhead | adaptive steps by k |\n|---:|---:|---:|---|\n"
                f"| {result['plain_median_ms']:.2f} | {result['adaptive_median_ms']:.2f} | "
                f"{100 * result['overhead']:+.1f} % | {result['adaptive_k_counts']} |\n")
    print(open(args.out + ".md").read())


if __name__ == "__main__":
    main()
