"""What ``model.dtype: auto`` picks on each kind of x86 CPU, and what bf16 and float32 cost there.

For each CPU kind, a child process (the kind's settings must be in place before torch loads) runs the
bundled model on one thread in bfloat16 and in float32, the two alternated: a prompt of ``--prompt-tokens``
prefilled in one chunk, then ``--decode-tokens`` decode steps at that context, each timed; medians of
``--repeats``. The kinds:

* ``native``: this machine's CPU as it is;
* ``avx512``: AVX-512 without AVX512-BF16 (oneDNN capped at ``AVX512_CORE``, ATen's ``avx512`` kernels, the CPU
  kernel built for ``skylake-avx512``);
* ``avx2``: AVX2 only (``AVX2``, ``avx2``, ``haswell``).

A lesser kind run on a better CPU keeps that CPU's caches and memory, so its figures show what the instruction
set changes, not another machine's speed. The record names the CPU.

    python benchmarks/dtype_choice.py --out benchmarks/results/dtype_choice
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # ahead of this folder, whose kv_transfer.py would shadow the package

MODEL_DIR = os.path.join(REPO, "models", "stdlib-llama-15m")
KINDS = {
    "native": {},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512",
               "MAGICSERVE_CPU_MARCH": "skylake-avx512"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MAGICSERVE_CPU_MARCH": "haswell"},
}
DTYPES = ("bfloat16", "float32")
COLORS = {"bfloat16": "tab:orange", "float32": "tab:blue"}


def measure_kind(prompt_tokens: int, decode_tokens: int, repeats: int) -> dict:
    """In this process (the kind's settings already in its environment): what auto picks, and per dtype the
    median prefill ms and decode ms per token."""
    import torch

    from modeling.dtype_choice import choose_dtype
    from modeling.engine import EngineConfig, ReferenceEngine
    from modeling.sampling import SamplingParams

    torch.set_num_threads(1)
    choice = choose_dtype("auto", "cpu")
    engines = {d: ReferenceEngine(MODEL_DIR, EngineConfig(dtype=d, token_budget=prompt_tokens, max_num_seqs=1,
                                                          kv_cache_tokens=prompt_tokens + decode_tokens + 64,
                                                          prefix_caching=False))
               for d in DTYPES}
    vocab = engines[DTYPES[0]].loaded.config.vocab_size
    samples = {d: {"prefill_ms": [], "decode_ms": []} for d in DTYPES}
    for r in range(repeats + 1):  # the first round warms up (kernel load, allocator) and is dropped
        prompt = [(7919 * (i + 131 * r)) % (vocab - 10) + 5 for i in range(prompt_tokens)]
        for d in DTYPES:
            prefill, decode = _timed_request(engines[d], prompt, SamplingParams(max_tokens=decode_tokens + 1,
                                                                               ignore_eos=True))
            if r:
                samples[d]["prefill_ms"].append(prefill * 1e3)
                samples[d]["decode_ms"].append(decode * 1e3)
    cells = {d: {k: statistics.median(v) for k, v in s.items()} | {f"{k}_runs": v for k, v in s.items()}
             for d, s in samples.items()}

    return {"auto": choice.dtype, "reason": choice.reason, "cells": cells,
            "attention_backend": engines[DTYPES[0]].runner.backend.name,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "env": {k: os.environ.get(k, "") for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MAGICSERVE_CPU_MARCH")}}


def _timed_request(engine, prompt: list[int], params) -> tuple[float, float]:
    """Seconds of the prefill step (the whole prompt in one chunk) and the median decode step after it."""
    engine.add_request(prompt, params)
    steps = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return steps[0], statistics.median(steps[1:])


def run_child(kind: str, args) -> dict:
    env = {**os.environ, **KINDS[kind], "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    for name in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MAGICSERVE_CPU_MARCH"):
        if name not in KINDS[kind]:
            env.pop(name, None)  # the native kind runs as the CPU is
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--prompt-tokens", str(args.prompt_tokens),
           "--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"dtype_choice: the {kind} run failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - t0
    return result


def write_markdown(result: dict, path: str) -> None:
    m = result["meta"]
    lines = [
        "# model.dtype auto: what it picks on each CPU kind, and what bf16 and float32 cost there", "",
        f"`{m['command']}`  ",
        f"{m['cpu']}, 1 thread; the bundled model (stdlib-llama-15m); a {m['prompt_tokens']}-token prompt prefilled "
        f"in one chunk, then {m['decode_tokens']} decode steps at that context; bf16 and float32 alternated, "
        f"median of {m['repeats']}. The lesser kinds run on this CPU with oneDNN, ATen and the CPU kernel held to "
        "their instruction sets (module doc of the script): they show what the instructions change, on this "
        "machine's memory.", "",
        "| CPU kind | auto picks | why | attention | prefill bf16 ms | prefill f32 ms | bf16 / f32 | "
        "decode bf16 ms | decode f32 ms | bf16 / f32 |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, r in result["kinds"].items():
        b, f = r["cells"]["bfloat16"], r["cells"]["float32"]
        lines.append(f"| {kind} | {r['auto']} | {r['reason']} | {r['attention_backend']} | {b['prefill_ms']:.0f} | "
                     f"{f['prefill_ms']:.0f} | {b['prefill_ms'] / f['prefill_ms']:.2f} | {b['decode_ms']:.2f} | "
                     f"{f['decode_ms']:.2f} | {b['decode_ms'] / f['decode_ms']:.2f} |")
    lines.append("")
    for metric, what in (("prefill_ms", "prefill"), ("decode_ms", "decode step")):
        faster = {k: min(DTYPES, key=lambda d: r["cells"][d][metric]) for k, r in result["kinds"].items()}
        agree = [k for k, r in result["kinds"].items() if r["auto"] == faster[k]]
        lines.append(f"- auto's pick has the faster {what} on {len(agree)} of {len(faster)} kinds"
                     + (f" (not on {', '.join(k for k in faster if k not in agree)})" if len(agree) < len(faster)
                        else "") + ".")
    lines += ["- A decode step reads every weight once for a few rows: bf16 reads half the bytes, so it can be "
              "faster even where bf16 is emulated; a prefill multiplies thousands of rows, where the emulation's "
              "conversions dominate. auto keeps one dtype for both pools (their KV must agree) and picks by the "
              "arithmetic, which decides the prefill.",
              "- In `dtype_choice.png` auto's picks are the solid bars."]
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    kinds = list(result["kinds"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, title in ((axes[0], "prefill_ms", f"prefill of {result['meta']['prompt_tokens']} tokens"),
                              (axes[1], "decode_ms", "decode step")):
        for j, dtype in enumerate(DTYPES):
            values = [result["kinds"][k]["cells"][dtype][metric] for k in kinds]
            chosen = [result["kinds"][k]["auto"] == dtype for k in kinds]
            xs = [i + (j - 0.5) * 0.38 for i in range(len(kinds))]
            for x, v, c in zip(xs, values, chosen):
                ax.bar(x, v, 0.36, color=COLORS[dtype], alpha=1.0 if c else 0.35)
        ax.set_xticks(range(len(kinds)), kinds)
        ax.set_ylabel("ms")
        ax.set_title(f"{title} (solid: auto's pick)")
        ax.legend(handles=[Patch(color=COLORS[d], label=d) for d in DTYPES], fontsize=8)
    fig.suptitle(f"{result['meta']['cpu']}, 1 thread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "dtype_choice"))
    ap.add_argument("--child", choices=list(KINDS), help=argparse.SUPPRESS)
    ap.add_argument("--rewrite", action="store_true", help="rewrite OUT.md and OUT.png from OUT.json, measuring nothing")
    args = ap.parse_args()
    if args.rewrite:
        with open(args.out + ".json", encoding="utf-8") as f:
            result = json.load(f)
        write_markdown(result, args.out + ".md")
        plot(result, args.out + ".png")
        return
    for name in ("prompt_tokens", "decode_tokens", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.child:
        print(json.dumps(measure_kind(args.prompt_tokens, args.decode_tokens, args.repeats)))
        return
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        ap.error(f"--kinds: each must be one of {', '.join(KINDS)}, got {args.kinds!r}")
    from tqdm import tqdm

    from planner.profiler import cpu_model_name

    results = {}
    for kind in tqdm(kinds, desc="CPU kinds", unit="kind"):
        results[kind] = run_child(kind, args)
    argv = " ".join(a for a in sys.argv[1:])
    result = {"meta": {"command": f"python benchmarks/dtype_choice.py {argv}".strip(), "cpu": cpu_model_name(),
                       "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                       "repeats": args.repeats},
              "kinds": results}
    from benchmarks._record import record

    record(result, args.out, write_markdown)
    plot(result, args.out + ".png")


if __name__ == "__main__":
    main()
