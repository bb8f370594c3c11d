"""Why speculation pays less on a CPU: the roofline of the verification pass.

A decode step of the bundled model reads every cached K/V row once and does 4 * D FLOPs per row and query
row (QK^T + P @ V); with G = Hq / Hkv query heads per KV head and Q query tokens per sequence the
attention's arithmetic intensity is R = G * Q FLOPs per KV byte (bf16). A decode step has Q = 1
(R = 4 here), a verification of k drafts has Q = k + 1 (R = 8 .. 24). MagicDec's premise is that R stays
below the hardware's ridge point (peak FLOP/s over memory bandwidth), so a verification costs about one
decode step. This script measures, on this machine:

* the cpu attention kernel (one layer, ``--batch`` x ``--context``) for Q = 1 .. 6: time, KV GB/s and
  GFLOP/s, against the memory floor (copy bandwidth) and the kernel's compute ceiling (the same kernel on
  an L2-resident cache, Q = 6);
* the rest of the model (projections, MLP, norms, LM head) for B * Q tokens;
* the sparse draft step (sink + budget keys);

and combines them into the predicted verify/decode time ratio and the speedup ceiling for each k at a
given acceptance rate, next to the same ceiling with a memory-bound verification (attention cost
independent of Q, as on a GPU whose ridge point is far above R). Compare with
``benchmarks/results/spec_decode*.md``, which measures the whole worker.

    PYTHONPATH=. python benchmarks/verify_roofline.py --batch 32 --context 8192 --threads 2
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

from benchmarks.attention_kernel import BLOCK, HEAD_DIM, HKV, HQ, copy_bandwidth, make_cell  # noqa: E402
from controller.defaults import DEFAULT_MODEL_DIR  # noqa: E402
from decode_worker.policy import expected_tokens  # noqa: E402
from modeling.attention.cpu_kernel import CpuPagedAttentionBackend, load_cpu_kernel  # noqa: E402
from modeling.checkpoint import load_model  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
GROUP = HQ // HKV


def _time(fn, repeats: int) -> tuple[float, float]:
    """(best, median) seconds of ``fn`` over ``repeats`` calls after one warm-up call."""
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts), statistics.median(ts)


def attention_cell(kernel, batch: int, context: int, q_len: int, repeats: int) -> dict:
    """One layer of the cpu kernel: time, KV bytes read, FLOPs."""
    q, k_new, v_new, k_cache, v_cache, meta = make_cell(batch, context, "contiguous", q_len=q_len)
    best, median = _time(lambda: kernel.forward(q, k_new, v_new, k_cache, v_cache, meta), repeats)
    kv_bytes = 2 * batch * context * HKV * HEAD_DIM * k_cache.element_size()
    flops = 4 * batch * context * HQ * q_len * HEAD_DIM  # QK^T and P @ V, 2 FLOPs per multiply-add
    return {"batch": batch, "context": context, "q_len": q_len, "rows_per_kv_head": GROUP * q_len,
            "flop_per_byte": flops / kv_bytes, "best_ms": best * 1e3, "median_ms": median * 1e3,
            "kv_gb_s": kv_bytes / best / 1e9, "gflop_s": flops / best / 1e9}


def dense_part_seconds(model, tokens: int, repeats: int) -> float:
    """Best time of everything but cached attention for ``tokens`` tokens: each token is its own
    one-token sequence, so attention is trivial and projections, MLP, norms and LM head remain."""
    ids = torch.randint(1, model.config.vocab_size, (tokens, 1))

    def run():
        with torch.no_grad():
            model.forward_dense(ids)

    return _time(run, repeats)[0]


def predict(args, attn: dict[int, float], attn_draft: float, dense: dict[int, float], layers: int) -> list[dict]:
    """Verify/decode ratio and speedup ceiling per k from the measured parts (seconds)."""
    decode = dense[1] + layers * attn[1]
    draft = dense[1] + layers * attn_draft
    rows = []
    for k in range(1, args.max_k + 1):
        verify = dense[k + 1] + layers * attn[k + 1]
        verify_mem_bound = dense[k + 1] + layers * attn[1]  # attention cost independent of Q
        tokens = expected_tokens(args.acceptance, k)
        rows.append({
            "k": k, "expected_tokens": tokens,
            "verify_over_decode": verify / decode, "draft_over_decode": draft / decode,
            "speedup_ceiling": tokens * decode / (verify + k * draft),
            "verify_over_decode_memory_bound": verify_mem_bound / decode,
            "speedup_ceiling_memory_bound": tokens * decode / (verify_mem_bound + k * draft),
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--max-k", type=int, default=5)
    ap.add_argument("--budget", type=int, default=256, help="draft window tokens (plus 16 sink tokens)")
    ap.add_argument("--acceptance", type=float, default=0.8, help="per-token acceptance rate for the ceiling")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--out", default=os.path.join(RESULTS, "verify_roofline"))
    args = ap.parse_args(argv)
    for name in ("batch", "context", "max_k", "budget", "threads", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0.0 <= args.acceptance < 1.0:
        ap.error("--acceptance must be in [0, 1)")
    torch.set_num_threads(args.threads)
    kernel = CpuPagedAttentionBackend()

    bandwidth = copy_bandwidth()[0] / 2  # bytes read per second (a copy reads and writes each byte)
    # compute ceiling: the kernel at the highest intensity on a cache that stays in L2 (4 x 512 tokens,
    # 1 MB), so memory never limits it
    ceiling = attention_cell(kernel, 4, 512, args.max_k + 1, args.repeats * 20)
    cells = []
    for q_len in range(1, args.max_k + 2):
        cell = attention_cell(kernel, args.batch, args.context, q_len, args.repeats)
        cell["memory_floor_ms"] = 2 * args.batch * args.context * HKV * HEAD_DIM * 2 / bandwidth * 1e3
        cell["compute_floor_ms"] = cell["gflop_s"] * cell["best_ms"] / ceiling["gflop_s"]
        cells.append(cell)
        print(f"Q={q_len} R={cell['rows_per_kv_head']:2d}: {cell['best_ms']:7.2f} ms, {cell['kv_gb_s']:5.1f} GB/s, "
              f"{cell['gflop_s']:6.1f} GFLOP/s (memory floor {cell['memory_floor_ms']:.2f} ms, "
              f"compute floor {cell['compute_floor_ms']:.2f} ms)", flush=True)
    draft_cell = attention_cell(kernel, args.batch, args.budget + 16, 1, args.repeats)

    loaded = load_model(args.model, dtype="bfloat16")
    layers = loaded.config.num_hidden_layers
    dense = {q: dense_part_seconds(loaded.model, args.batch * q, args.repeats) for q in range(1, args.max_k + 2)}
    attn = {c["q_len"]: c["best_ms"] / 1e3 for c in cells}
    rows = predict(args, attn, draft_cell["best_ms"] / 1e3, dense, layers)
    result = {
        "benchmark": "verify_roofline", "command": "python benchmarks/verify_roofline.py " + " ".join(sys.argv[1:]),
        "model": os.path.basename(os.path.normpath(args.model)), "layers": layers,
        "batch": args.batch, "context": args.context, "budget": args.budget, "acceptance": args.acceptance,
        "threads": args.threads, "kernel_build": load_cpu_kernel().build_info(),
        "read_bandwidth_gb_s": bandwidth / 1e9, "kernel_compute_ceiling": ceiling,
        "ridge_flop_per_byte": ceiling["gflop_s"] * 1e9 / bandwidth,
        "attention": cells, "draft_attention": draft_cell,
        "dense_part_ms": {str(q): s * 1e3 for q, s in dense.items()}, "prediction": rows,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "load_avg": os.getloadavg()},
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(result))
    print(f"ridge point {result['ridge_flop_per_byte']:.1f} FLOP/B; wrote {args.out}.json/.md")


def markdown(r: dict) -> str:
    c = r["kernel_compute_ceiling"]
    lines = [
        "# Verification roofline on this CPU",
        "",
        f"`{r['command']}`  ",
        f"{r['model']} ({r['layers']} layers, Hq={HQ}, Hkv={HKV}, D={HEAD_DIM}, bf16 KV, block {BLOCK}); batch "
        f"{r['batch']} x context {r['context']}; {r['threads']} thread(s); kernel build {r['kernel_build']}; "
        f"load average {', '.join(f'{x:.1f}' for x in r['machine']['load_avg'])}.",
        "",
        f"- Memory: read bandwidth {r['read_bandwidth_gb_s']:.1f} GB/s (half of a large copy's read + write rate).",
        f"- Compute: the kernel reaches {c['gflop_s']:.0f} GFLOP/s on an L2-resident cache at R = {c['rows_per_kv_head']}"
        f" ({c['best_ms']:.3f} ms for {c['batch']} x {c['context']} keys).",
        f"- Ridge point: **{r['ridge_flop_per_byte']:.1f} FLOP per KV byte**. Attention's intensity is R = G x Q "
        f"= {GROUP} x (k + 1) FLOP/B, so every verification (R >= {2 * GROUP}) is compute-bound here; an H100 "
        "(~990 TFLOP/s bf16, 3.35 TB/s) has its ridge near 300 FLOP/B, where R <= 24 is memory-bound.",
        "",
        "## Attention, one layer",
        "",
        "| Q | R (FLOP/B) | ms | KV GB/s | GFLOP/s | memory floor ms | compute floor ms | vs Q=1 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = r["attention"][0]["best_ms"]
    for a in r["attention"]:
        lines.append(f"| {a['q_len']} | {a['rows_per_kv_head']} | {a['best_ms']:.2f} | {a['kv_gb_s']:.1f} | "
                     f"{a['gflop_s']:.0f} | {a['memory_floor_ms']:.2f} | {a['compute_floor_ms']:.2f} | "
                     f"{a['best_ms'] / base:.2f}x |")
    d = r["draft_attention"]
    lines += [
        "",
        f"Draft attention (sink 16 + budget {r['budget']} keys, Q=1): {d['best_ms']:.3f} ms per layer. "
        "Rest of the model (projections, MLP, norms, LM head) for batch x Q tokens: "
        + ", ".join(f"Q={q}: {ms:.1f} ms" for q, ms in r["dense_part_ms"].items()) + ".",
        "",
        f"## Predicted step ratios and speedup ceiling (acceptance {r['acceptance']:.2f} per token)",
        "",
        "speedup = expected tokens per step x decode time / (verify time + k x draft time); 'memory-bound' "
        "replaces the verification's attention by the decode step's (what a GPU would see).",
        "",
        "| k | expected tokens | verify/decode | draft/decode | speedup ceiling | verify/decode (memory-bound) | speedup ceiling (memory-bound) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in r["prediction"]:
        lines.append(f"| {p['k']} | {p['expected_tokens']:.2f} | {p['verify_over_decode']:.2f} | "
                     f"{p['draft_over_decode']:.3f} | {p['speedup_ceiling']:.2f} | "
                     f"{p['verify_over_decode_memory_bound']:.2f} | {p['speedup_ceiling_memory_bound']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
