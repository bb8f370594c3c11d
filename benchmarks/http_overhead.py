"""What the OpenAI-compatible HTTP front costs against gRPC: one server, the same requests through both.

    python benchmarks/http_overhead.py --config cluster_configs/local-float32.yaml --out benchmarks/results/http_overhead

Starts ``magicserve serve --config CONFIG`` with both fronts (a separate process, as a user runs it)
and sends isolated requests (one at a time, so nothing queues) alternately through gRPC's ``Generate``
stream and HTTP ``/v1/completions`` with ``stream: true`` and ``return_token_ids``: the same prompts and
lengths, pairs in alternating order, through the SLO sweep's own clients (``benchmarks/_slo_targets.py``),
so the figures are those a sweep records. Per path: client TTFT and TPOT medians; per pair: the HTTP
minus gRPC differences, whose median is the cost (paired, so the machine's drift cancels).

Writes OUT.json (every request), OUT.md and OUT.png (TTFT and TPOT of both paths, request by request).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402
from benchmarks._slo_launch import free_port, magicserve_server  # noqa: E402
from benchmarks._slo_targets import GrpcTarget, OpenAITarget, RequestRecord  # noqa: E402
from benchmarks.slo_sweep import heldout_corpus, make_prompts  # noqa: E402

TTFT_TARGET_MS = 5.0  # the HTTP front may add at most this much to TTFT p50
TPOT_TARGET = 0.05  # and at most this share to TPOT p50


async def measure(grpc: GrpcTarget, http: OpenAITarget, prompts: list[list[int]], output_tokens: int,
                  warmup: int) -> list[dict]:
    """Pairs of isolated requests (gRPC and HTTP, alternating which goes first); one row per request."""
    await grpc.start()
    await http.start()
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    async def one(target, prompt, index) -> RequestRecord:
        rec = RequestRecord(index, 0.0, len(prompt), output_tokens)
        await target.generate(prompt, output_tokens, {"temperature": 0.0}, rec, clock)
        return rec

    for i in range(warmup):
        for target in (grpc, http):
            await one(target, prompts[i % len(prompts)], -1)
    rows = []
    for i, prompt in enumerate(prompts):
        order = (grpc, http) if i % 2 == 0 else (http, grpc)
        for target in order:
            rec = await one(target, prompt, i)
            rows.append({"pair": i, "path": target.kind, "ttft_ms": rec.ttft_s * 1e3, "tpot_ms": rec.tpot_s * 1e3,
                         "e2e_ms": rec.e2e_s * 1e3, "tokens": rec.completion_tokens,
                         "server_ttft_ms": None if rec.server_ttft_s is None else rec.server_ttft_s * 1e3})
    await grpc.close()
    await http.close()
    return rows


def summarise(rows: list[dict]) -> dict:
    by = {p: [r for r in rows if r["path"] == p] for p in ("grpc", "openai")}
    pairs = sorted({r["pair"] for r in rows})
    get = {(r["pair"], r["path"]): r for r in rows}
    d_ttft = [get[(i, "openai")]["ttft_ms"] - get[(i, "grpc")]["ttft_ms"] for i in pairs]
    r_tpot = [get[(i, "openai")]["tpot_ms"] / get[(i, "grpc")]["tpot_ms"] for i in pairs if get[(i, "grpc")]["tpot_ms"] > 0]

    def quartiles(xs):
        q = statistics.quantiles(xs, n=4)
        return [q[0], q[2]]

    out = {p: {"ttft_p50_ms": statistics.median(r["ttft_ms"] for r in rs),
               "tpot_p50_ms": statistics.median(r["tpot_ms"] for r in rs),
               "e2e_p50_ms": statistics.median(r["e2e_ms"] for r in rs)} for p, rs in by.items()}
    out["paired"] = {"ttft_added_ms_median": statistics.median(d_ttft), "ttft_added_ms_iqr": quartiles(d_ttft),
                     "tpot_ratio_median": statistics.median(r_tpot), "tpot_ratio_iqr": quartiles(r_tpot),
                     "pairs": len(pairs)}
    p = out["paired"]
    out["meets"] = {"ttft": p["ttft_added_ms_median"] <= TTFT_TARGET_MS, "tpot": p["tpot_ratio_median"] <= 1 + TPOT_TARGET}
    return out


def write_markdown(result: dict, path: str) -> None:
    s, a = result["settings"], result["summary"]
    p = a["paired"]
    lines = [
        "# The HTTP front's cost against gRPC", "",
        f"`{result['command']}`", "",
        f"One `magicserve serve` ({s['config']}, {s['describe']}), {p['pairs']} pairs of isolated requests: "
        f"{s['prompt_tokens']}-token prompts (held-out standard-library source), {s['output_tokens']} tokens each, "
        "greedy, EOS ignored; each pair sends the same prompt through gRPC `Generate` and HTTP `/v1/completions` "
        "(streamed, `return_token_ids`), alternating which goes first; the SLO sweep's clients time them. "
        f"Machine: {result['hardware']['cpus']} CPUs, {result['hardware']['platform']}.", "",
        "| path | TTFT p50 (ms) | TPOT p50 (ms) | end to end p50 (ms) |", "|---|---:|---:|---:|",
    ]
    for kind, name in (("grpc", "gRPC `Generate` stream"), ("openai", "HTTP `/v1/completions` (SSE)")):
        lines.append(f"| {name} | {a[kind]['ttft_p50_ms']:.1f} | {a[kind]['tpot_p50_ms']:.2f} | {a[kind]['e2e_p50_ms']:.0f} |")
    lo, hi = p["ttft_added_ms_iqr"]
    rlo, rhi = p["tpot_ratio_iqr"]
    lines += ["", "Paired (HTTP minus gRPC, the same prompt back to back):", "",
              f"- TTFT added: median **{p['ttft_added_ms_median']:+.1f} ms** (interquartile {lo:+.1f} to {hi:+.1f} ms); "
              f"target at most {TTFT_TARGET_MS:g} ms: {'met' if a['meets']['ttft'] else 'not met'}.",
              f"- TPOT ratio: median **{p['tpot_ratio_median']:.3f}x** (interquartile {rlo:.3f} to {rhi:.3f}); "
              f"target at most {1 + TPOT_TARGET:.2f}x: {'met' if a['meets']['tpot'] else 'not met'}.", "",
              "![TTFT and TPOT by path](" + os.path.basename(path)[:-3] + ".png)"]
    write_lines(path, lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["requests"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        for kind, name, marker in (("grpc", "gRPC", "o"), ("openai", "HTTP (OpenAI API)", "x")):
            pts = [(r["pair"], r[key]) for r in rows if r["path"] == kind]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker, label=name, alpha=0.8)
        ax.set_xlabel("pair (same prompt through both paths)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("The same requests through gRPC and the OpenAI-compatible HTTP front")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "cluster_configs", "local-float32.yaml"))
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--launch-timeout-s", type=float, default=300.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "http_overhead"))
    args = ap.parse_args(argv)
    for flag in ("pairs", "prompt_tokens", "output_tokens"):
        if getattr(args, flag) < (4 if flag == "pairs" else 2):
            ap.error(f"--{flag.replace('_', '-')}: too small, got {getattr(args, flag)}")
    from controller.config import load_config

    try:
        config = load_config(args.config)
    except ValueError as err:
        ap.error(f"--config: {err}")
    corpus = heldout_corpus(config.model_path, 4 * args.prompt_tokens + args.pairs * 64)
    prompts = [ids for _, ids in make_prompts(corpus, [args.prompt_tokens] * args.pairs, args.seed)]
    grpc_port, http_port = free_port(), free_port()
    with magicserve_server(args.config, "127.0.0.1", grpc_port, args.launch_timeout_s, http_port):
        rows = asyncio.run(measure(GrpcTarget(f"127.0.0.1:{grpc_port}"), OpenAITarget(f"http://127.0.0.1:{http_port}"),
                                   prompts, args.output_tokens, args.warmup))
    words = sys.argv[1:] if argv is None else argv
    result = {"benchmark": "http_overhead", "command": "python benchmarks/http_overhead.py " + shlex.join(words),
              "hardware": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "settings": {"config": os.path.relpath(os.path.abspath(args.config), ROOT),
                           "describe": config.describe_pools() + f", {config.dtype_choice.dtype}",
                           "pairs": args.pairs, "prompt_tokens": args.prompt_tokens,
                           "output_tokens": args.output_tokens, "seed": args.seed},
              "summary": summarise(rows), "requests": rows}
    plot(result, args.out + ".png")
    record(result, args.out, write_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
