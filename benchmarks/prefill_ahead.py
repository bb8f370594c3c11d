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

``--part simulated``: the whole hour of the trace, as recorded, through the simulator (``planner/simulator.py``) on
Llama-3.1-8B over H100s (the analytical profile), where each instance has a GPU of its own: a fixed shape with the
decode instances' KV cut to a range of sizes so that their room binds, prefill ahead on and off; attainment of the
SLOs, TTFT p50/p99, goodput per GPU-hour, passes. Writes ``benchmarks/results/prefill_ahead_simulated.*``.

    python benchmarks/prefill_ahead.py --trace PATH/conversation_trace.jsonl --part simulated
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402
from benchmarks._slo_launch import free_port, fresh_kv_dir, local_magicserve, vllm_server  # noqa: E402
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
                "kv_tiers": {"disk_dir": fresh_kv_dir(workdir)},
                "prefix_caching": {"prefill_ahead": system == "magicserve-ahead"}}
    return local_magicserve(f"{system}-{decode_kv}", args.model, sections, workdir, args.launch_timeout_s,
                            slo_ms=(args.ttft_slo_ms, args.tpot_slo_ms))


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


SUMMARY_KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "request_goodput", "hit_rate", "ahead_passes")


def summary(repeats: list[dict]) -> dict:
    """The median over a system's repeats of each figure, and the goodput's range."""
    out = {}
    for key in SUMMARY_KEYS:
        values = sorted(r[key] for r in repeats if r.get(key) is not None)
        out[key] = statistics.median(values) if values else None
    goodputs = [r["request_goodput"] for r in repeats]
    out["goodput_min"], out["goodput_max"] = min(goodputs), max(goodputs)
    out["completed"], out["failed"] = sum(r["completed"] for r in repeats), sum(r["failed"] for r in repeats)
    return out


def write_md(result: dict, path: str) -> None:
    a = result["args"]
    lines = ["# Prefill ahead: prompts computed while they wait for decode room", "", f"Command: `{result['command']}`",
             "", f"Machine: {result['machine']}. Mooncake's conversation trace, {result['requests']} requests of the "
             f"conversations sampled 1 in {a['sample']}, each 512-token block as {a['chunk']} tokens (prompts up to "
             f"{a['max_prompt']}, mean {result['mean_prompt']:.0f}), {a['speedup']:g}x faster ({result['span_s']:.0f} "
             f"s). Prefill pool {a['prefill_kv']} KV tokens, decode pool as listed (vLLM: their sum); magicserve with "
             f"its default KV tiers. SLOs for goodput: TTFT {a['ttft_slo_ms']:g} ms, TPOT {a['tpot_slo_ms']:g} ms. "
             f"Each magicserve system ran {a['repeats']} time(s) per pool size, the systems' order alternating; the "
             "figures are medians, goodput with its range.", "",
             "| decode KV tokens | system | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) | goodput (req/s) "
             "| prompt tokens found cached | passes ahead | completed / failed |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    summaries = {size: {name: summary(reps) for name, reps in systems.items()}
                 for size, systems in result["runs"].items()}
    for decode_kv, systems in summaries.items():
        for name, r in systems.items():
            found = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
            passes = "-" if r["ahead_passes"] is None else f"{r['ahead_passes']:.0f}"
            spread = "" if r["goodput_min"] == r["goodput_max"] else \
                f" ({r['goodput_min']:.2f}-{r['goodput_max']:.2f})"
            lines.append(f"| {decode_kv} | {name} | {r['median_ttft_ms'] / 1000:.2f} | {r['p99_ttft_ms'] / 1000:.2f} | "
                         f"{r['median_tpot_ms']:.1f} | {r['request_goodput']:.2f}{spread} | {found} | {passes} | "
                         f"{r['completed']} / {r['failed']} |")
    ratios = []
    for decode_kv, systems in summaries.items():
        on, off = systems.get("magicserve-ahead"), systems.get("magicserve-no-ahead")
        if on and off:
            ratios.append(f"decode {decode_kv}: TTFT p50 {on['median_ttft_ms'] / off['median_ttft_ms']:.2f}x, "
                          f"TPOT p50 {on['median_tpot_ms'] / off['median_tpot_ms']:.2f}x, "
                          f"goodput {on['request_goodput'] / max(off['request_goodput'], 1e-9):.2f}x")
    if ratios:
        lines += ["", "With prefill ahead / without (medians): " + "; ".join(ratios) + "."]
    lines += ["", "Prompt tokens found cached: each server's `prompt_tokens_cached_total` over `prompt_tokens_total` "
              "(what was computed ahead for a request is not counted as found). Each run's `vllm bench serve` "
              "command is in the JSON.", "", f"![prefill ahead]({os.path.basename(path[:-3])}.png)"]
    write_lines(path, lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [int(k) for k in result["runs"]]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (key, label, scale) in zip(axes, (("median_ttft_ms", "TTFT p50 (s)", 1e-3),
                                              ("p99_ttft_ms", "TTFT p99 (s)", 1e-3),
                                              ("median_tpot_ms", "TPOT p50 (ms)", 1.0),
                                              ("request_goodput", "goodput (req/s)", 1.0))):
        for system in SYSTEMS:
            reps = [(size, result["runs"][str(size)][system]) for size in sizes if system in result["runs"][str(size)]]
            if not reps:
                continue
            xs = [size for size, _ in reps]
            mids = [summary(r)[key] * scale for _, r in reps]
            lows = [m - min(x[key] for x in r) * scale for m, (_, r) in zip(mids, reps)]
            highs = [max(x[key] for x in r) * scale - m for m, (_, r) in zip(mids, reps)]
            ax.errorbar(xs, mids, yerr=[lows, highs], marker="o", capsize=3, label=system, color=COLORS[system])
        ax.set_xlabel("decode pool (KV tokens)")
        ax.set_title(label, fontsize=10)
        if key in ("median_ttft_ms", "p99_ttft_ms"):
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def simulate_one(profile, rows: list[dict], shape: tuple[int, int], decode_kv: int, ahead: bool, args) -> dict:
    """One simulation of the whole trace with the decode instances' KV cut to ``decode_kv`` tokens."""
    from benchmarks.kv_tiers_simulated import percentile, sim_requests
    from controller.kv_index import PrefixRouting
    from decode_worker.config import SpeculationConfig
    from planner.simulator import PoolPlan, SimConfig, Simulation
    from planner.slo import attainment

    t0 = time.perf_counter()
    costs = profile.costs(1, 1)
    cfg = SimConfig(prefill=PoolPlan(shape[0], 1, costs.prefill_kv_capacity_tokens, args.sim_token_budget, 256),
                    decode=PoolPlan(shape[1], 1, decode_kv, 1, 256), speculation=SpeculationConfig(drafter="none"),
                    max_concurrent=1_000_000, block_size=64, prefix_caching=PrefixRouting(prefill_ahead=ahead))
    sim = Simulation(profile, cfg)
    requests = sim_requests(rows)
    result = sim.run(requests, time_limit_s=args.time_limit_s)
    records = result.records
    both = attainment([r.outcome() for r in records], args.sim_ttft_ms / 1e3, args.sim_tpot_ms / 1e3).both
    ttft = [r.ttft_s for r in records if r.finished]
    out = {"ahead": ahead, "decode_kv": decode_kv, "attainment": both, "ttft_p50_s": percentile(ttft, 0.5),
           "ttft_p99_s": percentile(ttft, 0.99), "finished": sum(1 for r in records if r.finished),
           "requests": len(records), "passes": sum(1 for r in requests if r.ahead_on),
           "goodput_per_gpu_hour": both * len(records) / (result.device_seconds / 3600),
           "wall_s": time.perf_counter() - t0}
    print(f"[simulated decode {decode_kv} ahead {ahead}] {json.dumps(out)}", file=sys.stderr, flush=True)
    return out


def simulated(args) -> dict:
    import multiprocessing

    from benchmarks.kv_tiers_simulated import load_trace
    from planner.analytical import analytical_profile

    profile = analytical_profile(args.sim_gpu, args.sim_model)
    rows = load_trace(args.trace, args.sim_limit)
    shape = tuple(int(v) for v in args.sim_shape.split("+"))
    sizes = [int(v) for v in args.sim_decode_kvs.split(",") if v]
    longest = max(min(r["input_length"], len(r["hash_ids"]) * 512) for r in rows)
    if not sizes or min(sizes) <= longest:
        raise SystemExit(f"--sim-decode-kvs: each must hold the trace's longest prompt ({longest} tokens) and its "
                         f"first output token, got {args.sim_decode_kvs!r}")
    cells = [(profile, rows, shape, size, ahead, args) for size in sizes for ahead in (True, False)]
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        runs = pool.starmap(simulate_one, cells)
    return {"command": "python benchmarks/prefill_ahead.py " + " ".join(
                shlex.quote(os.path.relpath(a, ROOT) if os.path.isabs(a) else a) for a in sys.argv[1:]),
            "gpu": args.sim_gpu, "model": profile.model, "shape": list(shape),
            "prefill_kv_tokens": profile.costs(1, 1).prefill_kv_capacity_tokens,
            "full_decode_kv_tokens": profile.costs(1, 1).kv_capacity_tokens,
            "trace": {"requests": len(rows), "duration_s": rows[-1]["arrival_s"]},
            "slo": {"ttft_ms": args.sim_ttft_ms, "tpot_ms": args.sim_tpot_ms}, "runs": runs}


def write_simulated_md(result: dict, path: str) -> None:
    p, d = result["shape"]
    lines = ["# Prefill ahead at GPU scale, simulated", "", f"Command: `{result['command']}`", "",
             f"Mooncake's conversation trace, the whole hour as recorded ({result['trace']['requests']} requests), "
             f"through the simulator on {result['model']} over {result['gpu']} GPUs (analytical profile), every "
             f"instance on a GPU of its own: {p} prefill + {d} decode instances, each prefill instance's KV as its "
             f"memory allows ({result['prefill_kv_tokens']} tokens), the decode instances' cut to the sizes listed "
             f"(their memory allows {result['full_decode_kv_tokens']}) so that their room binds; prefix caching on, "
             f"no tiers. SLOs: TTFT {result['slo']['ttft_ms']:g} ms, TPOT {result['slo']['tpot_ms']:g} ms.", "",
             "| decode KV tokens per instance | prefill ahead | attainment | TTFT p50 (s) | TTFT p99 (s) "
             "| goodput per GPU-hour | passes |", "|---:|---|---:|---:|---:|---:|---:|"]
    for r in result["runs"]:
        lines.append(f"| {r['decode_kv']} | {'on' if r['ahead'] else 'off'} | {r['attainment']:.3f} | "
                     f"{r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['goodput_per_gpu_hour']:.0f} | "
                     f"{r['passes']} |")
    pairs = {}
    for r in result["runs"]:
        pairs.setdefault(r["decode_kv"], {})[r["ahead"]] = r
    ratios = [f"{kv}: TTFT p50 {on['ttft_p50_s'] / off['ttft_p50_s']:.2f}x, goodput per GPU-hour "
              f"{on['goodput_per_gpu_hour'] / max(off['goodput_per_gpu_hour'], 1e-9):.2f}x"
              for kv, both in pairs.items() if (on := both.get(True)) and (off := both.get(False))]
    lines += ["", "With prefill ahead / without, per decode KV size: " + "; ".join(ratios) + ".", "",
              f"![prefill ahead simulated]({os.path.basename(path[:-3])}.png)"]
    write_lines(path, lines)


def plot_simulated(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key, label) in zip(axes, (("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p99_s", "TTFT p99 (s)"),
                                       ("goodput_per_gpu_hour", "goodput per GPU-hour"))):
        for ahead, color in ((True, COLORS["magicserve-ahead"]), (False, COLORS["magicserve-no-ahead"])):
            pts = sorted((r["decode_kv"], r[key]) for r in result["runs"] if r["ahead"] is ahead)
            ax.plot(*zip(*pts), marker="o", color=color, label=f"prefill ahead {'on' if ahead else 'off'}")
        ax.set_xlabel("decode KV tokens per instance")
        ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="Mooncake's conversation_trace.jsonl")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "prefill_ahead"))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--decode-kvs", default="3584,6144", help="decode pool sizes (KV tokens), comma-separated")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each magicserve system per pool size (vLLM: one)")
    add_trace_args(ap, chunk=32, max_prompt=3072, speedup=40.0, prefill_kv=4096, decode_kv=0)
    ap.add_argument("--scratch", default=os.path.join(ROOT, "runs", "prefill_ahead"))
    ap.add_argument("--part", choices=("live", "simulated"), default="live")
    ap.add_argument("--sim-gpu", default="H100-80GB-SXM")
    ap.add_argument("--sim-model", default="llama-3.1-8b")
    ap.add_argument("--sim-shape", default="4+2", help="simulated: prefill + decode instances")
    ap.add_argument("--sim-decode-kvs", default="196608,262144,393216",
                    help="simulated: decode KV tokens per instance, comma-separated")
    ap.add_argument("--sim-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--sim-tpot-ms", type=float, default=50.0)
    ap.add_argument("--sim-token-budget", type=int, default=8192, help="simulated: prefill tokens per step")
    ap.add_argument("--sim-limit", type=int, default=None, help="simulated: only the first N requests")
    ap.add_argument("--jobs", type=int, default=2, help="simulated: simulations run at once (processes)")
    args = ap.parse_args()
    if args.part == "simulated":
        out = args.out if args.out != ap.get_default("out") else args.out + "_simulated"
        result = simulated(args)
        record(result, out, write_simulated_md)
        plot_simulated(result, out + ".png")
        return 0
    systems = chosen_systems(ap, args.systems, SYSTEMS)
    try:
        sizes = [int(v) for v in args.decode_kvs.split(",") if v]
    except ValueError:
        ap.error(f"--decode-kvs: comma-separated integers, got {args.decode_kvs!r}")
    if not sizes or min(sizes) < args.max_prompt + 64:
        ap.error(f"--decode-kvs: each must hold the longest prompt and some output (>= {args.max_prompt + 64})")
    if args.repeats < 1:
        ap.error(f"--repeats: must be >= 1, got {args.repeats}")
    rows, trace_path = replay_trace(args)
    result = {"command": "python benchmarks/prefill_ahead.py " + " ".join(
                  shlex.quote(os.path.relpath(a, ROOT) if os.path.isabs(a) else a) for a in sys.argv[1:]),
              "machine": f"{cpu_model_name()}, {os.cpu_count()} cores",
              "args": {k: v for k, v in vars(args).items() if k not in ("vllm", "scratch", "decode_kv")},
              "requests": len(rows), "span_s": rows[-1]["timestamp"],
              "mean_prompt": sum(r["input_length"] for r in rows) / len(rows), "runs": {}}
    ours = [s for s in systems if s != "vllm"]
    for size in sizes:
        runs = result["runs"].setdefault(str(size), {})
        for repeat in range(args.repeats):  # alternating the order: neither system always runs first
            for system in ours if repeat % 2 == 0 else ours[::-1]:
                runs.setdefault(system, []).append(run_system(system, args, size, trace_path, len(rows),
                                                              args.scratch))
        if "vllm" in systems:
            runs["vllm"] = [run_system("vllm", args, size, trace_path, len(rows), args.scratch)]
    record(result, args.out, write_md)
    plot(result, args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
