"""Prompts computed ahead while they wait for room on a decode instance, on a production trace whose decode pool is
too small for its load: magicserve with ``prefix_caching.prefill_ahead`` on and off, and vLLM's CPU build with the
same KV memory, each replayed by vLLM's benchmark client (``vllm bench serve --dataset-name timed_trace``), over a
range of decode pool sizes, same weights, same cores, one run.

The trace is Mooncake's conversation trace, sampled, scaled and compressed as ``benchmarks/kv_tiers.py`` does
(its flags are this benchmark's). magicserve runs with its default KV tiers. With a decode pool that holds few
requests, a prompt waits for room there before its prefill starts; with prefill ahead, the idle prefill instance
computes it meanwhile, and once room frees only its last block is left to compute. Per pool size and system: TTFT
p50/p99, TPOT p50, goodput at ``--ttft-slo-ms`` / ``--tpot-slo-ms`` as ``vllm bench serve`` reports it, the share
of prompt tokens found cached, and the passes computed ahead (``magicserve:prefill_ahead_passes_total``).

    python benchmarks/prefill_ahead.py --trace PATH/conversation_trace.jsonl

Writes ``<out>.json``, ``<out>.md`` and ``<out>.png`` (default ``benchmarks/results/prefill_ahead``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402
from benchmarks._slo_launch import free_port, local_magicserve, vllm_server  # noqa: E402
from benchmarks.kv_tiers import add_trace_args, bench, chosen_systems, hit_rate, replay_trace, scrape  # noqa: E402
from planner.profiler import cpu_model_name  # noqa: E402

SYSTEMS = ("magicserve-ahead", "magicserve-no-ahead", "vllm")
COLORS = {"magicserve-ahead": "tab:blue", "magicserve-no-ahead": "tab:gray", "vllm": "tab:orange"}


def server_for(system: str, args, decode_kv: int, workdir: str):
    if system == "vllm":
        port = free_port()  # the same KV tokens: its space is whole GiB, so the block count is set instead
        blocks = ["--block-size", "32", "--num-gpu-blocks-override", str((args.prefill_kv + decode_kv) // 32),
                  "--served-model-name", os.path.basename(os.path.abspath(args.model))]
        return vllm_server(args.model, port, args.max_prompt + 1024, 1, args.launch_timeout_s, blocks,
                           prefix_caching=True), f"http://127.0.0.1:{port}"
    sections = {"prefill": {"kv_cache_tokens": args.prefill_kv}, "decode": {"kv_cache_tokens": decode_kv},
                "kv_tiers": {"disk_dir": tempfile.mkdtemp(dir=workdir)},
                "prefix_caching": {"prefill_ahead": system == "magicserve-ahead"}}
    return local_magicserve(f"{system}-{decode_kv}", args.model, sections, workdir, args.launch_timeout_s)


def run_system(system: str, args, decode_kv: int, trace_path: str, n: int, workdir: str) -> dict:
    server, url = server_for(system, args, decode_kv, workdir)
    with server:
        before = scrape(url)
        t0 = time.monotonic()
        out = bench(args, url, trace_path, n, f"{system}-{decode_kv}", workdir)
        out["wall_s"] = time.monotonic() - t0
        after = scrape(url)
    out["hit_rate"] = hit_rate(system, before, after)
    if system != "vllm":
        name = "magicserve:prefill_ahead_passes_total"
        out["ahead_passes"] = after.get(name, 0.0) - before.get(name, 0.0)
    print(f"[{system} decode {decode_kv}] {json.dumps({k: v for k, v in out.items() if k != 'command'})}",
          file=sys.stderr, flush=True)
    return out


def write_md(result: dict, path: str) -> None:
    a = result["args"]
    lines = ["# Prefill ahead: prompts computed while they wait for decode room", "", f"Command: `{result['command']}`",
             "", f"Machine: {result['machine']}. Mooncake's conversation trace, {result['requests']} requests of the "
             f"conversations sampled 1 in {a['sample']}, each 512-token block as {a['chunk']} tokens (prompts up to "
             f"{a['max_prompt']}, mean {result['mean_prompt']:.0f}), {a['speedup']:g}x faster ({result['span_s']:.0f} "
             f"s). Prefill pool {a['prefill_kv']} KV tokens, decode pool as listed (vLLM: their sum); magicserve with "
             f"its default KV tiers. SLOs for goodput: TTFT {a['ttft_slo_ms']:g} ms, TPOT {a['tpot_slo_ms']:g} ms.", "",
             "| decode KV tokens | system | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) | goodput (req/s) "
             "| prompt tokens found cached | passes ahead | completed / failed |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for decode_kv, systems in result["runs"].items():
        for name, r in systems.items():
            found = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
            passes = "-" if "ahead_passes" not in r else f"{r['ahead_passes']:.0f}"
            lines.append(f"| {decode_kv} | {name} | {r['median_ttft_ms'] / 1000:.2f} | {r['p99_ttft_ms'] / 1000:.2f} | "
                         f"{r['median_tpot_ms']:.1f} | {r['request_goodput']:.3f} | {found} | {passes} | "
                         f"{r['completed']} / {r['failed']} |")
    ratios = []
    for decode_kv, systems in result["runs"].items():
        on, off = systems.get("magicserve-ahead"), systems.get("magicserve-no-ahead")
        if on and off:
            ratios.append(f"decode {decode_kv}: TTFT p50 {on['median_ttft_ms'] / off['median_ttft_ms']:.2f}x, "
                          f"goodput {on['request_goodput'] / max(off['request_goodput'], 1e-9):.2f}x")
    if ratios:
        lines += ["", "With prefill ahead / without: " + "; ".join(ratios) + "."]
    lines += ["", "Prompt tokens found cached: each server's `prompt_tokens_cached_total` over `prompt_tokens_total` "
              "(what was computed ahead for a request is not counted as found). Each run's `vllm bench serve` "
              "command is in the JSON.", "", f"![prefill ahead]({os.path.basename(path[:-3])}.png)"]
    write_lines(path, lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [int(k) for k in result["runs"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (key, label, scale) in zip(axes, (("median_ttft_ms", "TTFT p50 (s)", 1e-3),
                                              ("p99_ttft_ms", "TTFT p99 (s)", 1e-3),
                                              ("request_goodput", "goodput (req/s)", 1.0))):
        for system in SYSTEMS:
            pts = [(size, result["runs"][str(size)][system][key] * scale) for size in sizes
                   if system in result["runs"][str(size)]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=system, color=COLORS[system])
        ax.set_xlabel("decode pool (KV tokens)")
        ax.set_title(label, fontsize=10)
        if key != "request_goodput":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="Mooncake's conversation_trace.jsonl")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "prefill_ahead"))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--decode-kvs", default="3584,4096,6144", help="decode pool sizes (KV tokens), comma-separated")
    add_trace_args(ap, chunk=32, max_prompt=3072, speedup=40.0, prefill_kv=4096, decode_kv=0)
    ap.add_argument("--scratch", default=os.path.join(ROOT, "runs", "prefill_ahead"))
    args = ap.parse_args()
    systems = chosen_systems(ap, args.systems, SYSTEMS)
    try:
        sizes = [int(v) for v in args.decode_kvs.split(",") if v]
    except ValueError:
        ap.error(f"--decode-kvs: comma-separated integers, got {args.decode_kvs!r}")
    if not sizes or min(sizes) < args.max_prompt + 64:
        ap.error(f"--decode-kvs: each must hold the longest prompt and some output (>= {args.max_prompt + 64})")
    rows, trace_path = replay_trace(args)
    result = {"command": "python benchmarks/prefill_ahead.py " + " ".join(
                  shlex.quote(os.path.relpath(a, ROOT) if os.path.isabs(a) else a) for a in sys.argv[1:]),
              "machine": f"{cpu_model_name()}, {os.cpu_count()} cores",
              "args": {k: v for k, v in vars(args).items() if k not in ("vllm", "scratch", "decode_kv")},
              "requests": len(rows), "span_s": rows[-1]["timestamp"],
              "mean_prompt": sum(r["input_length"] for r in rows) / len(rows), "runs": {}}
    for size in sizes:
        for system in systems:
            result["runs"].setdefault(str(size), {})[system] = run_system(system, args, size, trace_path, len(rows),
                                                                         args.scratch)
    record(result, args.out, write_md)
    plot(result, args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
