"""Autoregressive decode-step latency against the memory-bandwidth floor.

For batch x context cells, times one decode step (one new token per sequence) of a ~30M-parameter
Llama in bfloat16 over a paged KV cache, and compares it with the floor
    (weight bytes + KV bytes read per step) / copy bandwidth,
where the copy bandwidth is measured in the same run (a copy of N bytes moves 2N: read + write).
The KV content is random: step cost depends on sizes, not values.

    python benchmarks/decode_step.py                       # full grid, results to benchmarks/results/
    python benchmarks/decode_step.py --batches 8 --contexts 16384 --backends torch
    python benchmarks/decode_step.py --device cuda --block-size 256 --backends torch flash --out runs/gpu/decode_step
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
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modeling.attention import make_backend
from modeling.block_pool import BlockPool, BlockTable
from modeling.config import ModelConfig
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.model import CausalLM
from modeling.runner import ModelRunner, StepInput

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

BENCH_CONFIG = {
    "model_type": "llama", "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "rope_theta": 500000.0, "max_position_embeddings": 32768, "tie_word_embeddings": True,
}


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on a CUDA device (a no-op on CPU), so wall-clock timings cover them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 7, device: torch.device = torch.device("cpu")) -> float:
    """Bytes per second of a large tensor copy on ``device``, counting read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times[1:])


def device_label(device: torch.device) -> str:
    """What the step runs on: the GPU's name for CUDA, the processor otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def weight_bytes_per_step(model: CausalLM, batch: int) -> int:
    """Bytes of weights a decode step reads: every matrix once, embeddings only for ``batch`` rows
    (the tied lm_head reads the whole table)."""
    total = 0
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight") and not model.config.tie_word_embeddings:
            total += batch * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def time_cell(runner: ModelRunner, pool: BlockPool, batch: int, context: int, repeats: int) -> float:
    """Median seconds of one decode step of ``batch`` sequences at ``context`` cached tokens."""
    tables = []
    for _ in range(batch):
        t = BlockTable(pool.block_size)
        t.ensure_capacity(pool, context + 1)
        tables.append(t)
    inputs = [StepInput([1], context, t.blocks) for t in tables]
    times = []
    for i in range(repeats + 2):
        synchronize(runner.device)
        t0 = time.perf_counter()
        runner.run(inputs)
        synchronize(runner.device)
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t0)
    for t in tables:
        t.release(pool)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--backends", nargs="+", default=["auto", "torch"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i] (flash needs cuda and a block size of 256)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "decode_step"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device: CUDA requested but no CUDA device is available")

    config = ModelConfig.from_hf_dict(BENCH_CONFIG)
    model = CausalLM(config).to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False)
    spec = KVCacheSpec(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                       args.block_size, torch.bfloat16)
    max_tokens = max(args.batches) * (max(args.contexts) + args.block_size)
    num_blocks = -(-max_tokens // args.block_size)
    print(f"model {config.num_parameters() / 1e6:.1f}M params bf16; KV cache {num_blocks * spec.bytes_per_block / 2**30:.2f} GiB")
    cache = PagedKVCache(spec, num_blocks, device)
    cache.kv.normal_()
    pool = BlockPool(num_blocks, args.block_size)
    bandwidth = copy_bandwidth(device=device)
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write) on {device_label(device)}, threads {args.threads}")

    rows = []
    cells = [(be, b, c) for be in args.backends for b in args.batches for c in args.contexts]
    for backend_name, batch, context in tqdm(cells, desc="cells"):
        backend = make_backend(backend_name, device, args.block_size, cache.spec.dtype)
        runner = ModelRunner(model, cache, backend)
        step = time_cell(runner, pool, batch, context, args.repeats)
        w_bytes = weight_bytes_per_step(model, batch)
        kv_bytes = batch * (context + 1) * spec.bytes_per_token
        floor = (w_bytes + kv_bytes) / bandwidth
        rows.append({
            "backend": backend_name, "resolved_backend": backend.name, "batch": batch, "context": context,
            "step_ms": step * 1e3, "tokens_per_s": batch / step, "floor_ms": floor * 1e3,
            "fraction_of_floor": floor / step, "weight_mb": w_bytes / 1e6, "kv_mb": kv_bytes / 1e6,
        })
        tqdm.write(f"{backend.name:>6} batch {batch:>3} ctx {context:>6}: {step * 1e3:8.2f} ms/step "
                   f"{batch / step:9.1f} tok/s  floor {floor * 1e3:7.2f} ms  ratio {floor / step:.2f}")

    meta = {
        "machine": device_label(device), "device": str(device), "cpus": os.cpu_count(), "threads": args.threads,
        "torch": torch.__version__, "copy_bandwidth_gbps": bandwidth / 1e9, "dtype": "bfloat16",
        "params_m": config.num_parameters() / 1e6, "block_size": args.block_size, "repeats": args.repeats,
        "command": "python benchmarks/decode_step.py " + " ".join(sys.argv[1:]),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    where = f"{args.threads} threads" if device.type == "cpu" else f"{meta['machine']} ({device})"
    with open(args.out + ".md", "w") as f:
        f.write(f"# Decode step vs memory-bandwidth floor\n\n`{meta['command']}`  \n"
                f"{meta['params_m']:.1f}M-param Llama, bf16, {where}, copy bandwidth "
                f"{meta['copy_bandwidth_gbps']:.1f} GB/s (read + write), median of {args.repeats}.\n\n"
                "| backend | batch | context | ms/step | tokens/s | floor ms | floor / measured |\n"
                "|---|---:|---:|---:|---:|---:|---:|\n")
        for r in rows:
            f.write(f"| {r['resolved_backend']} | {r['batch']} | {r['context']} | {r['step_ms']:.2f} | "
                    f"{r['tokens_per_s']:.1f} | {r['floor_ms']:.2f} | {r['fraction_of_floor']:.2f} |\n")
    print(f"wrote {args.out}.json and .md")


if __name__ == "__main__":
    main()
