"""A production conversation trace whose reused prompts do not fit the KV pools: magicserve with its KV tiers,
without them, and vLLM's CPU build with the same KV memory, each replayed by vLLM's benchmark client
(``vllm bench serve --dataset-name timed_trace``), same weights, same cores, one run.

The trace is Mooncake's (FAST'25 release, Kimi's production conversations: ``FAST25-release/traces/
conversation_trace.jsonl`` in github.com/kvcache-ai/Mooncake; each request lists the hashes of its prompt's
512-token blocks). It is made to fit the bundled model and 2 cores:

* conversations are sampled whole (a request is kept when its first block after the shared system prompt
  hashes into 1 of ``--sample`` buckets), so the reuse between a conversation's turns stays as it was;
* each 512-token block becomes ``--chunk`` tokens (vLLM's ``timed_trace`` expands each hash into that many
  random tokens, the same ones wherever the hash recurs), prompts are cut at ``--max-prompt`` tokens and
  outputs scaled by the same factor (at least 4 tokens);
* time is compressed ``--speedup`` times.

The pools are sized so the working set does not fit them (``--prefill-kv`` and ``--decode-kv`` tokens; vLLM
gets their sum): without tiers a returning turn finds its history evicted. With tiers (host memory and the
disk tier under a fresh directory) it is loaded back. Per system: the share of prompt tokens found cached
(``prompt_tokens_cached_total`` over ``prompt_tokens_total``, both servers' counters: magicserve's counts what
the instance that computed each prompt found, prefill or decode), TTFT p50/p99, TPOT p50 and goodput at
``--ttft-slo-ms`` / ``--tpot-slo-ms`` as ``vllm bench serve`` reports it; beside them the hit rate of an
unbounded cache on the same requests, and magicserve's prefill pool's own hit rate.

A goodput at one load is capped by the load: where a system already serves most requests within the SLOs, no
other can serve many more. ``--sweep`` replays the trace at more time compressions (``--sweep-systems``, each on
a fresh server) and adds each system's goodput as the project defines it (``planner.slo.goodput``,
DistServe's): the highest offered rate at which ``--attainment-target`` of the requests meet both SLOs.

    python benchmarks/kv_tiers.py --trace PATH/conversation_trace.jsonl [--sweep 15,20,30,60,80]

Writes ``<out>.json``, ``<out>.md`` and ``<out>.png`` (default ``benchmarks/results/kv_tiers``), and
``<out>_sweep.png`` with a sweep.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record  # noqa: E402
from benchmarks._slo_launch import free_port, fresh_kv_dir, local_magicserve, vllm_server  # noqa: E402
from controller.defaults import DEFAULT_MODEL_DIR  # noqa: E402
from planner.profiler import cpu_model_name  # noqa: E402

SYSTEMS = ("magicserve-tiers", "magicserve-no-tiers", "vllm")
COLORS = {"magicserve-tiers": "tab:blue", "magicserve-no-tiers": "tab:gray", "vllm": "tab:orange"}
TRACE_BLOCK = 512  # tokens per hash in Mooncake's traces
VLLM = os.path.join(ROOT, ".peers", "vllm", "bin", "vllm")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "0"}


def sampled_trace(path: str, sample: int, chunk: int, max_prompt: int, speedup: float) -> list[dict]:
    """The trace's requests of the sampled conversations, scaled to ``chunk`` tokens per block and compressed
    in time (timestamps in seconds from the first)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            hashes = r["hash_ids"]
            key = hashes[1] if len(hashes) > 1 else hashes[0]
            if int(hashlib.sha256(f"0:{key}".encode()).hexdigest(), 16) % sample:
                continue
            blocks = min(len(hashes), max_prompt // chunk)
            prompt = min(-(-r["input_length"] * chunk // TRACE_BLOCK), blocks * chunk)
            rows.append({"timestamp": r["timestamp"] / 1000.0, "input_length": prompt,
                         "output_length": max(4, round(r["output_length"] * chunk / TRACE_BLOCK)),
                         "hash_ids": hashes[:blocks]})
    t0 = rows[0]["timestamp"]
    for r in rows:
        r["timestamp"] = (r["timestamp"] - t0) / speedup
    return rows


def unbounded_cached(rows: list[dict], chunk: int) -> list[int]:
    """Each request's prompt tokens an unbounded cache of every earlier prompt's full blocks holds (its prefix
    run; at least one token is left to compute)."""
    seen: set[int] = set()
    cached = []
    for r in rows:
        run = 0
        for h in r["hash_ids"]:
            if h not in seen or (run + 1) * chunk > r["input_length"] - 1:
                break
            run += 1
        cached.append(run * chunk)
        seen.update(r["hash_ids"][:r["input_length"] // chunk])
    return cached


def unbounded_hit_rate(rows: list[dict], chunk: int) -> float:
    """Prompt tokens an unbounded cache of every earlier prompt's full blocks finds."""
    return sum(unbounded_cached(rows, chunk)) / sum(r["input_length"] for r in rows)


def scrape(url: str, by_labels: dict[str, tuple[str, ...]] | None = None) -> dict[str, float]:
    """Counter totals of ``/metrics`` by name, summed over labels, plus magicserve's prefill-pool prefix counts;
    ``by_labels``: counters also kept per value of the labels named (``NAME/VALUE1/VALUE2``)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            if s.labels.get("role") == "prefill":
                out[f"prefill/{s.name}"] = out.get(f"prefill/{s.name}", 0.0) + s.value
            labels = (by_labels or {}).get(s.name)
            if labels:
                key = "/".join([s.name, *(s.labels.get(label, "") for label in labels)])
                out[key] = out.get(key, 0.0) + s.value
    return out


def add_trace_args(ap, chunk: int, max_prompt: int, speedup: float, prefill_kv: int, decode_kv: int) -> None:
    """The flags of a replay of Mooncake's trace through ``vllm bench serve`` (sampling, scaling, pools, SLOs,
    the client), with this benchmark's defaults where they differ."""
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--sample", type=int, default=40, help="keep 1 conversation in this many")
    ap.add_argument("--chunk", type=int, default=chunk, help="tokens per 512-token block of the trace")
    ap.add_argument("--max-prompt", type=int, default=max_prompt)
    ap.add_argument("--speedup", type=float, default=speedup, help="time compression of the trace")
    ap.add_argument("--prefill-kv", type=int, default=prefill_kv)
    ap.add_argument("--decode-kv", type=int, default=decode_kv)
    ap.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=50.0)
    ap.add_argument("--vllm", default=VLLM)
    ap.add_argument("--launch-timeout-s", type=float, default=600.0)
    ap.add_argument("--time-limit-s", type=float, default=1800.0)


def chosen_systems(ap, value: str, allowed: tuple[str, ...]) -> list[str]:
    """The ``--systems`` list, each checked against ``allowed`` (an argparse error names a wrong one)."""
    systems = [s for s in value.split(",") if s]
    for s in systems:
        if s not in allowed:
            ap.error(f"--systems: {s!r} is not one of {', '.join(allowed)}")
    return systems


def replay_trace(args, speedup: float | None = None, folder: str | None = None) -> tuple[list[dict], str]:
    """The sampled, scaled and compressed trace (``sampled_trace`` with the flags; ``speedup``: another time
    compression than ``--speedup``), and the path of its copy in ``folder`` (default: the scratch folder) that
    ``vllm bench serve`` reads."""
    folder = folder or args.scratch
    os.makedirs(folder, exist_ok=True)
    rows = sampled_trace(args.trace, args.sample, args.chunk, args.max_prompt,
                         args.speedup if speedup is None else speedup)
    trace_path = os.path.join(folder, "trace.jsonl")
    with open(trace_path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows, trace_path


def _ratio(names: tuple[str, str], before: dict, after: dict) -> float | None:
    part, whole = (after.get(n, 0.0) - before.get(n, 0.0) for n in names)
    return part / whole if whole else None


def hit_rate(system: str, before: dict, after: dict) -> float | None:
    """The share of every finished request's prompt tokens found cached rather than computed."""
    prefix = "vllm:" if system == "vllm" else "magicserve:"
    return _ratio((prefix + "prompt_tokens_cached_total", prefix + "prompt_tokens_total"), before, after)


def prefill_pool_hit_rate(before: dict, after: dict) -> float | None:
    """magicserve's prefill pool's prefix-cache hits over its lookups (the prompts prefill instances computed)."""
    return _ratio(("prefill/magicserve:prefix_cache_hits_total", "prefill/magicserve:prefix_cache_queries_total"),
                  before, after)


def server_for(system: str, args, workdir: str):
    if system == "vllm":
        port = free_port()  # the same KV tokens: its space is whole GiB, so the block count is set instead
        blocks = ["--block-size", "32", "--num-gpu-blocks-override", str((args.prefill_kv + args.decode_kv) // 32),
                  "--served-model-name", os.path.basename(os.path.abspath(args.model))]
        return vllm_server(args.model, port, args.max_prompt + 1024, 1, args.launch_timeout_s, blocks,
                           prefix_caching=True), f"http://127.0.0.1:{port}"
    sections = {"prefill": {"kv_cache_tokens": args.prefill_kv}, "decode": {"kv_cache_tokens": args.decode_kv},
                "kv_tiers": {"enabled": system == "magicserve-tiers", "disk_dir": fresh_kv_dir(workdir)}}
    return local_magicserve(system, args.model, sections, workdir, args.launch_timeout_s,
                            slo_ms=(args.ttft_slo_ms, args.tpot_slo_ms))


def bench(args, url: str, trace_path: str, n: int, name: str, workdir: str) -> dict:
    """``vllm bench serve`` over the trace against ``url``; its saved result (each request's latencies too, in the
    scratch copy) and the command."""
    cmd = [args.vllm, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", os.path.abspath(args.model), "--tokenizer", os.path.abspath(args.model),
           "--served-model-name", os.path.basename(os.path.abspath(args.model)),
           "--dataset-name", "timed_trace", "--dataset-path", trace_path,
           "--timed-trace-chunk-hash-size", str(args.chunk), "--num-prompts", str(n), "--ignore-eos",
           "--temperature", "0", "--seed", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--goodput", f"ttft:{args.ttft_slo_ms:g}", f"tpot:{args.tpot_slo_ms:g}",
           "--save-result", "--save-detailed", "--result-dir", workdir, "--result-filename", f"{name}.json"]
    with open(os.path.join(workdir, f"{name}.bench.log"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE},
                              timeout=args.time_limit_s)
    if proc.returncode:
        raise RuntimeError(f"vllm bench serve failed for {name} (log: {log.name})")
    with open(os.path.join(workdir, f"{name}.json"), encoding="utf-8") as f:
        res = json.load(f)
    keep = ("completed", "failed", "duration", "request_throughput", "request_goodput", "median_ttft_ms",
            "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "total_input_tokens", "total_output_tokens")
    return {**{k: res.get(k) for k in keep}, "command": " ".join(shlex.quote(c) for c in cmd)}


# every instance's and tier's loads together: blocks loaded, of them read ahead while their prompt waited, and the
# seconds the workers spent loading on their steps against those the read-ahead spent off them
TIER_LOAD_COUNTERS = {"tier_blocks_loaded": "magicserve:kv_tier_hits_total",
                      "tier_blocks_read_ahead": "magicserve:kv_tier_read_ahead_total",
                      "tier_load_s_on_step": "magicserve:kv_tier_load_seconds_total",
                      "tier_read_ahead_s": "magicserve:kv_tier_read_ahead_seconds_total"}


def run_system(system: str, args, trace_path: str, n: int, workdir: str) -> dict:
    server, url = server_for(system, args, workdir)
    with server:
        before = scrape(url)
        t0 = time.monotonic()
        out = bench(args, url, trace_path, n, system, workdir)
        out["wall_s"] = time.monotonic() - t0
        after = scrape(url)
    out["hit_rate"] = hit_rate(system, before, after)
    if system.startswith("magicserve"):
        out["prefill_pool_hit_rate"] = prefill_pool_hit_rate(before, after)
        out["tier_hit_tokens"] = after.get("magicserve:prefix_cache_tier_hits_total", 0.0) - \
            before.get("magicserve:prefix_cache_tier_hits_total", 0.0)
        for key, metric in TIER_LOAD_COUNTERS.items():
            out[key] = after.get(metric, 0.0) - before.get(metric, 0.0)
    print(f"[{system}] {json.dumps({k: v for k, v in out.items() if k != 'command'})}", file=sys.stderr, flush=True)
    return out


def sweep_point(run: dict, rows: list[dict], speedup: float) -> dict:
    """One system's run at one time compression as a point of the load sweep: the offered rate (requests over
    the replay's span) and the share of requests within both SLOs (``vllm bench serve``'s goodput times its
    duration: the requests it counted good)."""
    good = round((run["request_goodput"] or 0.0) * run["duration"])
    return {"speedup": speedup, "offered_rate": len(rows) / rows[-1]["timestamp"], "attainment": good / len(rows),
            **{k: run[k] for k in ("request_goodput", "median_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "hit_rate",
                                   "completed", "failed")}}


def load_sweep(args, systems: list[str], main_runs: dict[str, dict], main_rows: list[dict]) -> dict:
    """Each of ``systems`` replayed at every ``--sweep`` time compression (a fresh server each, so no run
    starts with another's cache; the main run stands for ``--speedup``), and each system's goodput at
    ``--attainment-target`` as the project defines it (:func:`planner.slo.goodput`, DistServe's: the highest
    offered rate still meeting the target, interpolated between swept rates)."""
    from planner.slo import goodput

    speedups = sorted(set(args.sweep) | {args.speedup})
    points: dict[str, list[dict]] = {s: [] for s in systems}
    for speedup in speedups:
        if speedup == args.speedup:
            rows = main_rows
        else:
            folder = os.path.join(args.scratch, f"x{speedup:g}")
            rows, trace_path = replay_trace(args, speedup, folder)
            print(f"sweep: {speedup:g}x, {len(rows) / rows[-1]['timestamp']:.2f} req/s offered", file=sys.stderr,
                  flush=True)
        for system in systems:
            run = main_runs[system] if speedup == args.speedup else \
                run_system(system, args, trace_path, len(rows), folder)
            points[system].append(sweep_point(run, rows, speedup))
    return {"speedups": speedups, "target": args.attainment_target, "points": points,
            "goodput_at_target": {s: goodput([p["offered_rate"] for p in pts], [p["attainment"] for p in pts],
                                             args.attainment_target) for s, pts in points.items()}}


def sweep_lines(sweep: dict) -> list[str]:
    """The load sweep's section of the record: attainment and goodput by offered rate, and the goodput at the
    target attainment per system."""
    names = list(sweep["points"])
    target = sweep["target"]
    lines = ["", "## Load sweep", "",
             f"The same replay compressed {', '.join(f'{x:g}x' for x in sweep['speedups'])}, each system on a fresh "
             f"server at each: the share of the requests within both SLOs, and `vllm bench serve`'s goodput "
             f"(requests within both SLOs per second of the run).", "",
             "| compression | offered (req/s) | " + " | ".join(f"{n}: within SLOs / goodput (req/s) / TTFT p99 (s)"
                                                          for n in names) + " |",
             "|---:|---:|" + "---:|" * len(names)]
    for i, speedup in enumerate(sweep["speedups"]):
        cells = []
        for n in names:
            p = sweep["points"][n][i]
            cells.append(f"{p['attainment']:.0%} / {p['request_goodput']:.3f} / {p['p99_ttft_ms'] / 1000:.2f}")
        offered = sweep["points"][names[0]][i]["offered_rate"]
        lines.append(f"| {speedup:g}x | {offered:.2f} | " + " | ".join(cells) + " |")
    at = sweep["goodput_at_target"]
    lines += ["", f"Goodput at {target:.0%} attainment (`planner.slo.goodput`, DistServe's: the highest offered rate "
                  f"at which {target:.0%} of the requests meet both SLOs, interpolated between swept rates; 0 where "
                  f"the lowest rate misses): " + ", ".join(f"{n} {at[n]:.2f} req/s" for n in names) + "."]
    if at.get("magicserve-tiers") and at.get("magicserve-no-tiers"):
        lines[-1] += f" With tiers / without: {at['magicserve-tiers'] / at['magicserve-no-tiers']:.2f}x."
    return lines


def plot_sweep(sweep: dict, path: str) -> None:
    from benchmarks._slo_plots import plot_compare

    plot_compare(path, [{"label": n, "x": [p["offered_rate"] for p in pts], "both": [p["attainment"] for p in pts],
                         "color": COLORS[n]} for n, pts in sweep["points"].items()], sweep["target"],
                 "KV tiers: Mooncake's trace at rising compression", "offered rate (req/s)")


def write_md(result: dict, path: str) -> None:
    a = result["args"]
    lines = ["# KV tiers on a production conversation trace", "", f"Command: `{result['command']}`", "",
             f"Machine: {result['machine']}. Mooncake's conversation trace, {result['requests']} requests of the "
             f"conversations sampled 1 in {a['sample']} over its hour, each 512-token block as {a['chunk']} tokens "
             f"(prompts up to {a['max_prompt']}, mean {result['mean_prompt']:.0f}), {a['speedup']:g}x faster "
             f"({result['span_s']:.0f} s). Pools: prefill {a['prefill_kv']} + decode {a['decode_kv']} KV tokens "
             f"(vLLM: their sum); the working set of the replay is {result['unique_tokens']} distinct prompt tokens. "
             f"SLOs for goodput: TTFT {a['ttft_slo_ms']:g} ms, TPOT {a['tpot_slo_ms']:g} ms.", "",
             f"An unbounded cache finds {result['unbounded_hit_rate']:.1%} of the prompt tokens.", "",
             "| system | prompt tokens found cached | of the unbounded cache's | prefill pool's hit rate | TTFT p50 (s) "
             "| TTFT p99 (s) | TPOT p50 (ms) | goodput (req/s) | completed / failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    for name, r in result["systems"].items():
        of_unbounded = "-" if r["hit_rate"] is None else f"{r['hit_rate'] / result['unbounded_hit_rate']:.2f}"
        lines.append(f"| {name} | {share(r['hit_rate'])} | {of_unbounded} | {share(r.get('prefill_pool_hit_rate'))} | "
                     f"{r['median_ttft_ms'] / 1000:.2f} | {r['p99_ttft_ms'] / 1000:.2f} | "
                     f"{r['median_tpot_ms']:.1f} | {r['request_goodput']:.3f} | {r['completed']} / {r['failed']} |")
    s = result["systems"]
    if "magicserve-tiers" in s and "magicserve-no-tiers" in s:
        t, n = s["magicserve-tiers"], s["magicserve-no-tiers"]
        lines += ["", f"With tiers / without: goodput {t['request_goodput'] / max(n['request_goodput'], 1e-9):.2f}x, "
                      f"TTFT p50 {t['median_ttft_ms'] / n['median_ttft_ms']:.2f}x; the tiers supplied "
                      f"{t['tier_hit_tokens']:.0f} prompt tokens."]
        if t.get("tier_blocks_loaded"):
            lines += ["", f"Tier loads: {t['tier_blocks_loaded']:.0f} blocks, {t['tier_blocks_read_ahead']:.0f} of them "
                          f"read ahead while their prompt waited ({t['tier_read_ahead_s']:.2f} s of reads off the "
                          f"workers' steps); the workers spent {t['tier_load_s_on_step']:.2f} s loading on their "
                          f"steps (host-tier copies, waits, and the reads not done ahead)."]
    lines += ["", "Prompt tokens found cached: each server's `prompt_tokens_cached_total` over `prompt_tokens_total`, "
              "over every finished request (magicserve's counts what the instance that computed the prompt found "
              "in its pool or its tiers, a prefill instance or, for a turn prefilled where it decodes, a decode "
              "instance). The prefill pool's hit rate counts only the prompts prefill instances computed.", "",
              "Each system's `vllm bench serve` command is in the JSON.", "", f"![kv tiers]({os.path.basename(path[:-3])}.png)"]
    if result.get("sweep"):
        lines += sweep_lines(result["sweep"]) + ["", f"![load sweep]({os.path.basename(path[:-3])}_sweep.png)"]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["systems"])
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key, label, scale) in zip(axes, (("hit_rate", "prompt tokens found cached", 1.0),
                                              ("median_ttft_ms", "TTFT p50 (s)", 1e-3),
                                              ("request_goodput", "goodput (req/s)", 1.0))):
        vals = [(result["systems"][n][key] or 0.0) * scale for n in names]
        ax.bar(names, vals, color=[COLORS[n] for n in names])
        if key == "hit_rate":
            ax.axhline(result["unbounded_hit_rate"], color="k", ls="--", lw=1, label="unbounded cache")
            ax.legend(fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="Mooncake's conversation_trace.jsonl")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "kv_tiers"))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    add_trace_args(ap, chunk=32, max_prompt=3072, speedup=40.0, prefill_kv=4096, decode_kv=8192)
    ap.add_argument("--scratch", default=os.path.join(ROOT, "runs", "kv_tiers"))
    ap.add_argument("--sweep", default="", help="more time compressions (comma-separated, e.g. 15,20,30,60) at "
                    "which --sweep-systems are replayed too, for goodput at --attainment-target")
    ap.add_argument("--sweep-systems", default="magicserve-tiers,magicserve-no-tiers")
    ap.add_argument("--attainment-target", type=float, default=0.9)
    args = ap.parse_args()
    systems = chosen_systems(ap, args.systems, SYSTEMS)
    try:
        args.sweep = [float(x) for x in args.sweep.split(",") if x]
    except ValueError:
        ap.error(f"--sweep: {args.sweep!r} is not a comma-separated list of numbers")
    if any(x <= 0 for x in args.sweep):
        ap.error("--sweep: every time compression must be above 0")
    if not 0 < args.attainment_target <= 1:
        ap.error(f"--attainment-target: {args.attainment_target} is not in (0, 1]")
    sweep_systems = chosen_systems(ap, args.sweep_systems, SYSTEMS) if args.sweep else []
    missing = [s for s in sweep_systems if s not in systems]
    if missing:
        ap.error(f"--sweep-systems: {', '.join(missing)} not in --systems")
    rows, trace_path = replay_trace(args)
    result = {"command": "python benchmarks/kv_tiers.py " + " ".join(
                  shlex.quote(os.path.relpath(a, ROOT) if os.path.isabs(a) else a) for a in sys.argv[1:]),
              "machine": f"{cpu_model_name()}, {os.cpu_count()} cores", "args": {k: v for k, v in vars(args).items()
                                                                                 if k not in ("vllm", "scratch")},
              "requests": len(rows), "span_s": rows[-1]["timestamp"],
              "mean_prompt": sum(r["input_length"] for r in rows) / len(rows),
              "unique_tokens": len({h for r in rows for h in r["hash_ids"]}) * args.chunk,
              "unbounded_hit_rate": unbounded_hit_rate(rows, args.chunk), "systems": {}}
    print(f"{len(rows)} requests over {result['span_s']:.0f} s; unbounded hit rate "
          f"{result['unbounded_hit_rate']:.1%}", file=sys.stderr, flush=True)
    for system in systems:
        result["systems"][system] = run_system(system, args, trace_path, len(rows), args.scratch)
    if sweep_systems:
        result["sweep"] = load_sweep(args, sweep_systems, result["systems"], rows)
    record(result, args.out, write_md)
    plot(result, args.out + ".png")
    if sweep_systems:
        plot_sweep(result["sweep"], args.out + "_sweep.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
