#!/usr/bin/env python3
"""Check that a model directory loads unchanged in vLLM's CPU build and decodes greedily as magicserve does.

Run it with the Python of the vLLM environment (``../shared/PEERS.md``), from the repository root::

    VLLM_CPU_KVCACHE_SPACE=2 .peers/vllm/bin/python scripts/check_vllm_loads.py --model models/stdlib-llama-15m \\
        --expect benchmarks/results/default_model_eval.json --out benchmarks/results/default_model_vllm_check.json

``--expect`` is the report of ``scripts/eval_default_model.py`` on the same directory: its greedy samples
(magicserve's model code, bf16 autocast) are the reference. vLLM generates ``--max-tokens`` tokens greedily
(temperature 0, bf16) from each sample's prompt; the check passes when the prompt plus vLLM's text is a
prefix of magicserve's sample (or the other way round, when the sample stopped at EOS first). Writes the
load time, vLLM's version and each continuation to ``--out``; exit status 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF-format model directory")
    ap.add_argument("--expect", required=True, help="eval_default_model.py's JSON report (its greedy samples)")
    ap.add_argument("--max-tokens", type=int, default=48, help="greedy tokens vLLM generates per prompt")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--memory-utilization", type=float, default=0.5,
                    help="vLLM's gpu_memory_utilization, on CPU the share of the NUMA node's memory it reserves")
    ap.add_argument("--out", default=None, help="JSON record of the check")
    args = ap.parse_args(argv)
    if args.max_tokens < 1:
        ap.error(f"--max-tokens: must be >= 1, got {args.max_tokens}")
    with open(args.expect, encoding="utf-8") as f:
        samples = json.load(f)["samples"]
    if not 0 < args.memory_utilization <= 1:
        ap.error(f"--memory-utilization: must be in (0, 1], got {args.memory_utilization}")
    if not samples:
        ap.error(f"--expect: {args.expect} has no greedy samples")

    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=args.max_model_len, enforce_eager=True,
              gpu_memory_utilization=args.memory_utilization)
    load_s = time.time() - t0
    outputs = llm.generate([s["prompt"] for s in samples], SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    results = []
    for sample, out in zip(samples, outputs):
        text = sample["prompt"] + out.outputs[0].text
        ours = sample["output"]
        agrees = ours.startswith(text) or text.startswith(ours)
        results.append({"prompt": sample["prompt"], "vllm": text, "magicserve": ours, "agrees": agrees})
        print(f"{'AGREES' if agrees else 'DIFFERS'}: {text!r}", flush=True)
    record = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "model": args.model,
              "vllm_version": vllm.__version__, "load_seconds": round(load_s, 1), "max_tokens": args.max_tokens,
              "all_agree": all(r["agrees"] for r in results), "samples": results}
    print(f"vLLM {vllm.__version__}: loaded {args.model} in {load_s:.0f} s; "
          f"{sum(r['agrees'] for r in results)} of {len(results)} greedy continuations agree with magicserve's")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    return 0 if record["all_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
