"""Decode attention over the paged KV cache: C++ cpu kernel vs torch backend vs dense reference.

For batch x context cells, one decode step (q_len 1 per sequence) of one layer in bfloat16 with
Hkv=2, Hq=8, D=64, block size 16, all backends on the same inputs. Reports time and the effective KV
read rate (K + V bytes of the visible context / time), next to the copy bandwidth measured in the same
run (a copy of N bytes moves 2N: read + write) and the kernel's fraction of the bandwidth floor
(KV bytes / copy bandwidth) / time. Blocks are laid out as the BlockPool hands them out (each
sequence's blocks contiguous); ``--layout fragmented`` shuffles all blocks instead (worst case).

Timings are best-of / median-of interleaved rounds (kernel, torch, dense in turn), so a busy machine
affects all backends alike; compare ratios within one run.

    PYTHONPATH=. python benchmarks/attention_kernel.py                 # full grid, 1 thread
    PYTHONPATH=. python benchmarks/attention_kernel.py --threads 2 --batches 8 --contexts 16384
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time

import torch

# ahead of this folder, whose kv_transfer.py would shadow the package when run as a script
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modeling.attention.cpu_kernel import CpuPagedAttentionBackend, cpu_kernel_build_seconds, load_cpu_kernel  # noqa: E402
from modeling.attention.metadata import AttentionMetadata  # noqa: E402
from modeling.attention.torch_backend import TorchAttentionBackend, dense_reference_attention  # noqa: E402
from planner.profiler import cpu_model_name  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
HKV, HQ, HEAD_DIM, BLOCK = 2, 8, 64, 16
DTYPE = torch.bfloat16


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 7) -> tuple[float, float]:
    """Bytes per second of a large tensor copy, counting read + write (best of ``repeats``): per wall
    second, and per CPU second of the process."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best, best_cpu = math.inf, math.inf
    for _ in range(repeats + 1):
        t, c = time.perf_counter(), time.process_time()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
        best_cpu = min(best_cpu, time.process_time() - c)
    return 2 * nbytes / best, 2 * nbytes / max(best_cpu, 1e-9)


def make_cell(batch: int, context: int, layout: str, seed: int = 0, q_len: int = 1):
    """Random bf16 cache holding ``batch`` sequences of ``context`` tokens, the last ``q_len`` of each new
    (q_len 1: a decode step; k + 1: a verification step)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK)
    ids = list(range(batch * per_seq))
    if layout == "fragmented":
        random.Random(seed).shuffle(ids)
    tables = [ids[b * per_seq : (b + 1) * per_seq] for b in range(batch)]
    k_cache = torch.randn(len(ids), BLOCK, HKV, HEAD_DIM, generator=gen).to(DTYPE)
    v_cache = torch.randn(len(ids), BLOCK, HKV, HEAD_DIM, generator=gen).to(DTYPE)
    q = torch.randn(batch * q_len, HQ, HEAD_DIM, generator=gen).to(DTYPE)
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK for t in tables for p in range(context - q_len, context)]
    meta = AttentionMetadata(
        query_start=[b * q_len for b in range(batch + 1)], seq_lens=[context] * batch, block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_size=BLOCK,
    )
    k_new = k_cache.view(-1, HKV, HEAD_DIM)[meta.slot_mapping]
    v_new = v_cache.view(-1, HKV, HEAD_DIM)[meta.slot_mapping]
    return q, k_new, v_new, k_cache, v_cache, meta


def time_cell(batch: int, context: int, args, kernel, torch_backend) -> dict:
    q, k_new, v_new, k_cache, v_cache, meta = make_cell(batch, context, args.layout)
    kv_bytes = 2 * batch * context * HKV * HEAD_DIM * k_cache.element_size()
    fns = {
        "cpu": lambda: kernel.forward(q, k_new, v_new, k_cache, v_cache, meta),
        "torch": lambda: torch_backend.forward(q, k_new, v_new, k_cache, v_cache, meta),
    }
    if not args.no_dense and batch * context <= args.dense_max_tokens:
        fns["dense"] = lambda: dense_reference_attention(q, k_cache, v_cache, meta)
    outs = {name: fn() for name, fn in fns.items()}  # warm-up, and outputs for the sanity check
    times: dict[str, list[float]] = {name: [] for name in fns}
    cpu_times: dict[str, list[float]] = {name: [] for name in fns}
    slow_rounds = max(1, args.repeats // 5)
    for r in range(args.repeats):
        for name, fn in fns.items():
            if name != "cpu" and r >= slow_rounds and (name == "dense" or context * batch >= 65536):
                continue  # the slow backends get fewer rounds on big cells
            t, c = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - t)
            cpu_times[name].append(time.process_time() - c)
    cell = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
    for name, ts in times.items():
        cell[name] = {
            "best_ms": min(ts) * 1e3, "median_ms": statistics.median(ts) * 1e3, "rounds": len(ts),
            "kv_gb_s": kv_bytes / min(ts) / 1e9,
            # CPU seconds of the process (all threads) per call: robust to the process being preempted
            "best_cpu_ms": min(cpu_times[name]) * 1e3,
            "kv_gb_per_cpu_s": kv_bytes / max(min(cpu_times[name]), 1e-9) / 1e9,
        }
    cell["max_abs_err_vs_torch"] = (outs["cpu"].float() - outs["torch"].float()).abs().max().item()
    cell["speedup_vs_torch"] = cell["torch"]["best_ms"] / cell["cpu"]["best_ms"]
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--threads", type=int, default=1, help="torch / kernel threads (set explicitly)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--layout", choices=("contiguous", "fragmented"), default="contiguous")
    parser.add_argument("--no-dense", action="store_true")
    parser.add_argument("--dense-max-tokens", type=int, default=8 * 16384, help="skip dense above batch*context")
    parser.add_argument("--out", default=os.path.join(RESULTS, "attention_kernel"), help="path stem for .json/.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    info = load_cpu_kernel().build_info()
    load_s = time.perf_counter() - t0
    kernel, torch_backend = CpuPagedAttentionBackend(), TorchAttentionBackend()

    bw_before, bw_cpu_before = copy_bandwidth()
    cells = []
    for batch in [int(x) for x in args.batches.split(",")]:
        for context in [int(x) for x in args.contexts.split(",")]:
            cell = time_cell(batch, context, args, kernel, torch_backend)
            cells.append(cell)
            print(f"B={batch:3d} ctx={context:6d}: cpu {cell['cpu']['best_ms']:8.3f} ms "
                  f"{cell['cpu']['kv_gb_s']:6.1f} GB/s ({cell['cpu']['kv_gb_per_cpu_s']:.1f} per CPU s) | torch {cell['torch']['best_ms']:9.2f} ms "
                  f"{cell['torch']['kv_gb_s']:5.2f} GB/s | x{cell['speedup_vs_torch']:.1f}"
                  + (f" | dense {cell['dense']['best_ms']:9.2f} ms" if "dense" in cell else ""), flush=True)
    bw_after, bw_cpu_after = copy_bandwidth()
    bw = max(bw_before, bw_after)
    for cell in cells:
        cell["cpu_fraction_of_floor"] = (cell["kv_bytes"] / bw) / (cell["cpu"]["best_ms"] / 1e3)

    result = {
        "benchmark": "attention_kernel",
        "command": "PYTHONPATH=. python benchmarks/attention_kernel.py " + " ".join(sys.argv[1:]),
        "dtype": "bfloat16", "hkv": HKV, "hq": HQ, "head_dim": HEAD_DIM,
        "block_size": BLOCK, "layout": args.layout, "threads": args.threads, "repeats": args.repeats,
        "kernel_build": info, "kernel_load_s": load_s, "kernel_build_or_load_s": cpu_kernel_build_seconds(),
        "copy_bandwidth_gb_s": {"before": bw_before / 1e9, "after": bw_after / 1e9,
                                "per_cpu_s_before": bw_cpu_before / 1e9, "per_cpu_s_after": bw_cpu_after / 1e9},
        "machine": {"cpu": cpu_model_name(), "arch": platform.machine(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "load_avg": os.getloadavg()},
        "cells": cells,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(_markdown(result))
    print(f"copy bandwidth {bw_before / 1e9:.1f} / {bw_after / 1e9:.1f} GB/s (before / after; per CPU s "
          f"{bw_cpu_before / 1e9:.1f} / {bw_cpu_after / 1e9:.1f}); wrote {args.out}.json/.md")


def _markdown(r: dict) -> str:
    lines = [
        "# Decode attention: cpu kernel vs torch backend vs dense reference",
        "",
        f"`{r['command'].strip()}`",
        "",
        f"bf16, Hkv={r['hkv']}, Hq={r['hq']}, D={r['head_dim']}, block {r['block_size']}, {r['layout']} blocks, "
        f"q_len 1, one layer; threads={r['threads']}; {r['repeats']} repeats; "
        f"{r['machine']['cores']} CPUs ({r['machine']['cpu']}, {r['machine'].get('arch', '')}), torch {r['machine']['torch']}; kernel build: {r['kernel_build']}; "
        f"load average at the end {', '.join(f'{x:.1f}' for x in r['machine']['load_avg'])}.",
        f"Copy bandwidth (r+w) in this run: {r['copy_bandwidth_gb_s']['before']:.1f} GB/s before, "
        f"{r['copy_bandwidth_gb_s']['after']:.1f} GB/s after (per CPU second of this process: "
        f"{r['copy_bandwidth_gb_s']['per_cpu_s_before']:.1f} / {r['copy_bandwidth_gb_s']['per_cpu_s_after']:.1f}). "
        "Times are best of interleaved rounds; 'GB/s per CPU s' divides by the process's CPU time instead of "
        "wall time (robust to preemption by other processes, not to their memory traffic).",
        "",
        "| batch | context | KV MB | cpu ms | cpu KV GB/s | cpu KV GB/s per CPU s | fraction of floor | torch ms | torch KV GB/s | speedup | dense ms | max abs err |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in r["cells"]:
        dense = f"{c['dense']['best_ms']:.2f}" if "dense" in c else "-"
        lines.append(
            f"| {c['batch']} | {c['context']} | {c['kv_bytes'] / 1e6:.1f} | {c['cpu']['best_ms']:.3f} | "
            f"{c['cpu']['kv_gb_s']:.1f} | {c['cpu']['kv_gb_per_cpu_s']:.1f} | {c['cpu_fraction_of_floor']:.2f} | {c['torch']['best_ms']:.2f} | "
            f"{c['torch']['kv_gb_s']:.2f} | {c['speedup_vs_torch']:.1f}x | {dense} | {c['max_abs_err_vs_torch']:.1e} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
