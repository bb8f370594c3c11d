"""Load-aware disaggregation against static prefill/decode pools, colocated instances and vLLM's CPU build, each
replayed by vLLM's benchmark client (``vllm bench serve --dataset-name timed_trace``) on the same weights and
cores, in one run, on two workloads whose prefill saturates a static split:

* ``trace``: Mooncake's production conversation trace (FAST'25, Kimi), conversations sampled whole, each
  512-token block as ``--chunk`` tokens, prompts cut at ``--max-prompt``, time compressed ``--speedup`` times
  (``benchmarks/kv_tiers.py``'s sampling);
* ``burst``: ``--burst-requests`` distinct long prompts (``--burst-min``..``--burst-max`` tokens) arriving over
  ``--burst-span-s`` seconds;
* ``edge``: the same with ``--edge-*`` flags, by default shorter prompts at a rate past what the prefill
  instance alone serves within the TTFT target but where each prompt alone is well inside it: the load where
  static P/D misses its TTFT p99 and load-aware placement can hold it.

For each workload the record gives the TTFT floor: how long each prompt takes to prefill alone on an idle
prefill instance, every earlier prompt's full blocks cached (``--profile``'s prefill model, chunks of the
prefill pool's token budget). Requests whose floor is past the TTFT target miss it on any system.

Systems: ``static`` (1 prefill + 1 decode instance, every prompt computed in the prefill pool unless its decode
instance holds it cached), ``load-aware`` (the same pools; a prompt the prefill pool would serve past the TTFT
target is prefilled on the decode instance within its TPOT slack: ``controller/load_aware.py``),
``role-changes`` (load-aware, and the online planner deciding every ``--autoscale-interval-s`` on the last
``--autoscale-window-s`` over ``--profile`` between 1 + 1 and 0 + 2 instances, the prefill instance changing role:
``autoscale.role_changes_only``),
``colocated`` (2 instances of the reference engine, chunked prefill beside decode) and ``vllm`` (its CPU build,
the same KV tokens, prefix caching on). magicserve's ``slo:`` section is set to the benchmark's SLOs. Per system:
TTFT and TPOT p50/p99 and goodput at ``--ttft-slo-ms`` / ``--tpot-slo-ms`` as ``vllm bench serve`` reports
them, and for magicserve where the prompts were prefilled (``magicserve:load_aware_placements``).

    python benchmarks/load_aware.py --trace PATH/conversation_trace.jsonl

Writes ``<out>.json``, ``<out>.md`` and ``<out>.png`` (default ``benchmarks/results/load_aware``). ``--repeats N``
runs every system N times, round by round (each round runs every system once, so each pair of runs is side by
side in time); ``--add-runs`` adds this invocation's runs to the record's (more rounds of some systems, say static
and load-aware, to measure the spread of their ratio). Each system's table row is its median run by goodput; the
spread of every run is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402
from benchmarks._slo_launch import free_port, local_magicserve, vllm_server  # noqa: E402
from benchmarks.kv_tiers import add_trace_args, bench, sampled_trace, scrape, unbounded_cached  # noqa: E402
from controller.config import load_config  # noqa: E402
from planner.profile import Profile, prefill_features  # noqa: E402
from planner.profiler import cpu_model_name  # noqa: E402

SYSTEMS = ("static", "load-aware", "role-changes", "colocated", "vllm")
WORKLOADS = ("trace", "burst", "edge")
DISTINCT = {"burst": (30, 2048, 6144, 64, 30.0), "edge": (60, 512, 1536, 64, 28.0)}  # requests, min, max, out, span
PLACEMENTS = "magicserve:load_aware_placements_total"
PROFILE = os.path.join(ROOT, "benchmarks", "results", "profile_local_cpu.json")


def distinct_rows(args, workload: str) -> list[dict]:
    """Distinct prompts (hashes no other prompt shares) of the workload's ``--<workload>-*`` lengths, arriving
    evenly over its span."""
    rng = random.Random(args.seed)
    n, lo, hi, out, span = (getattr(args, f"{workload}_{k}") for k in ("requests", "min", "max", "output", "span_s"))
    rows, next_hash = [], 1 << 30
    for i in range(n):
        blocks = rng.randint(lo // args.chunk, hi // args.chunk)
        rows.append({"timestamp": i * span / n, "input_length": blocks * args.chunk, "output_length": out,
                     "hash_ids": list(range(next_hash, next_hash + blocks))})
        next_hash += blocks
    return rows


def workload_rows(args, workload: str) -> tuple[list[dict], str]:
    """The workload's requests (``vllm bench serve``'s timed-trace rows) and a sentence saying what they are."""
    if workload == "trace":
        rows = sampled_trace(args.trace, args.sample, args.chunk, args.max_prompt, args.speedup)
        return rows, (f"Mooncake's conversation trace: {len(rows)} requests of the conversations sampled 1 in "
                      f"{args.sample}, each 512-token block as {args.chunk} tokens (prompts up to "
                      f"{args.max_prompt}), {args.speedup:g}x faster ({rows[-1]['timestamp']:.0f} s).")
    rows = distinct_rows(args, workload)
    lo, hi, out, span = (getattr(args, f"{workload}_{k}") for k in ("min", "max", "output", "span_s"))
    return rows, (f"{'A burst' if workload == 'burst' else 'Near the prefill instance capacity'}: {len(rows)} "
                  f"distinct prompts of {lo}-{hi} tokens (mean {sum(r['input_length'] for r in rows) / len(rows):.0f}) "
                  f"over {span:g} s ({len(rows) / span:.2f} req/s), {out} output tokens each.")


def ttft_floors(rows: list[dict], chunk: int, profile_path: str, token_budget: int) -> list[float]:
    """Each request's prefill alone on an idle prefill instance (seconds): its prompt past what an unbounded cache
    of every earlier prompt's full blocks holds, in chunks of ``token_budget``, priced by the profile's prefill
    model (tensor parallel 1, one thread, as every magicserve system here runs)."""
    model = Profile.load(profile_path).prefill_model(1, 1)
    floors = []
    for r, start in zip(rows, unbounded_cached(rows, chunk)):
        seconds = 0.0
        while start < r["input_length"]:
            n = min(token_budget, r["input_length"] - start)
            seconds += model.predict(prefill_features([(start, n)]))
            start += n
        floors.append(seconds)
    return floors


def floor_summary(floors: list[float], ttft_slo_ms: float) -> dict:
    ordered = sorted(floors)
    return {"over_slo": sum(f * 1e3 > ttft_slo_ms for f in floors), "requests": len(floors),
            "p50_s": ordered[len(ordered) // 2], "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "max_s": ordered[-1]}


def server_for(system: str, args, workdir: str):
    """The system's server, started on free ports: (server, base URL)."""
    if system == "vllm":
        port = free_port()
        extra = ["--block-size", "32", "--num-gpu-blocks-override", str((args.prefill_kv + args.decode_kv) // 32),
                 "--served-model-name", os.path.basename(os.path.abspath(args.model))]
        longest = max(args.max_prompt, args.burst_max, args.edge_max)
        return vllm_server(args.model, port, longest + 1024, 1, args.launch_timeout_s, extra,
                           prefix_caching=True), f"http://127.0.0.1:{port}"
    sections: dict = {}
    if system == "colocated":
        sections.update(mode="colocated", colocated={"instances": 2, "threads": 1,
                                                     "kv_cache_tokens": (args.prefill_kv + args.decode_kv) // 2})
    else:
        sections.update(prefill={"kv_cache_tokens": args.prefill_kv}, decode={"kv_cache_tokens": args.decode_kv},
                        load_aware={"enabled": system != "static"})
    if system == "role-changes":  # the same two cores, as 1 + 1 or 0 + 2 instances
        sections["autoscale"] = {
            "enabled": True, "profile": os.path.abspath(args.profile), "interval_s": args.autoscale_interval_s,
            "window_s": args.autoscale_window_s, "role_changes_only": True,
            "prefill": {"min_instances": 0, "max_instances": 1}, "decode": {"min_instances": 1, "max_instances": 2}}
    return local_magicserve(system, args.model, sections, workdir, args.launch_timeout_s,
                            slo_ms=(args.ttft_slo_ms, args.tpot_slo_ms))


def resizes(server) -> list[dict]:
    """The pools' resizes during the run, oldest first, as ``magicserve status`` reports them."""
    from frontend.client import Client

    with Client(f"127.0.0.1:{server.argv[server.argv.index('--port') + 1]}") as c:
        st = c.status()
    return [{"pool": r.pool, "desired": r.desired, "current": r.current, "switched": list(r.switched),
             "switch_from": r.switch_from, "added": list(r.added), "removed": list(r.removed), "error": r.error,
             "seconds": round(r.seconds, 2), "handed_back": r.handed_back} for r in st.recent_scaling]


def resize_text(r: dict) -> str:
    """One resize as the record words it: ``decode -> 2 (role change of prefill-0, 4.7 s, 2 prompts handed
    back)``."""
    what = [f"role change of {', '.join(r['switched'])}"] if r["switched"] else []
    what += [f"{r['seconds']:.1f} s"] + ([f"{r['handed_back']} prompts handed back"] if r.get("handed_back") else [])
    return f"{r['pool']} -> {r['desired']} ({', '.join(what)})" + (f", failed: {r['error']}" if r["error"] else "")


def placements(before: dict, after: dict) -> dict[str, float]:
    """The load-aware policy's decisions during the run, by ``prefilled_on/reason``."""
    return {key[len(PLACEMENTS) + 1:]: after[key] - before.get(key, 0.0) for key in after
            if key.startswith(PLACEMENTS + "/") and after[key] - before.get(key, 0.0)}


def run_system(system: str, workload: str, args, trace_path: str, n: int, workdir: str) -> dict:
    server, url = server_for(system, args, workdir)
    name = f"{workload}-{system}"
    with server:
        before = scrape(url, {PLACEMENTS: ("prefilled_on", "reason")}) if system != "vllm" else {}
        t0 = time.monotonic()
        out = bench(args, url, trace_path, n, name, workdir)
        out["wall_s"] = time.monotonic() - t0
        if system != "vllm":
            after = scrape(url, {PLACEMENTS: ("prefilled_on", "reason")})
            out["placements"] = placements(before, after)
            out["decode_local_prefills"] = after.get("magicserve:decode_local_prefills_total", 0.0) - \
                before.get("magicserve:decode_local_prefills_total", 0.0)
        if system == "role-changes":
            out["resizes"] = resizes(server)
    print(f"[{name}] {json.dumps({k: v for k, v in out.items() if k != 'command'})}", file=sys.stderr, flush=True)
    return out


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def median_run(runs: list[dict]) -> dict:
    """The run of median goodput (the upper of the middle two when there is an even number)."""
    return sorted(runs, key=lambda r: r["request_goodput"] or 0.0)[len(runs) // 2]


def spread_line(w: dict) -> str | None:
    """Static and load-aware over several rounds: the goodput ratio of each round and the spread of each figure."""
    runs = w.get("runs", {})
    la, st = runs.get("load-aware", []), runs.get("static", [])
    if max(len(la), len(st)) < 2 or not la or not st:
        return None
    ratios = [a["request_goodput"] / b["request_goodput"] for a, b in zip(la, st) if b["request_goodput"]]
    ratios_text = ", ".join(f"{r:.2f}x" for r in ratios)

    def span(rs, key, scale=1.0, fmt=".3f"):
        values = [r[key] * scale for r in rs if r[key] is not None]
        return f"{min(values):{fmt}}-{max(values):{fmt}}"

    return (f"Over {len(la)} load-aware and {len(st)} static runs (one of each per round, side by side): goodput "
            f"ratio per round {ratios_text} (median {sorted(ratios)[len(ratios) // 2]:.2f}x); goodput load-aware "
            f"{span(la, 'request_goodput')}, static {span(st, 'request_goodput')} req/s; TTFT p99 load-aware "
            f"{span(la, 'p99_ttft_ms', 1e-3, '.2f')}, static {span(st, 'p99_ttft_ms', 1e-3, '.2f')} s; TPOT p99 "
            f"load-aware {span(la, 'p99_tpot_ms', 1.0, '.1f')}, static {span(st, 'p99_tpot_ms', 1.0, '.1f')} ms.")


def write_md(result: dict, path: str) -> None:
    a = result["args"]
    lines = ["# Load-aware disaggregation: prefill on idle decode capacity", "", f"Command: `{result['command']}`", ""]
    lines += [f"More runs: `{c}`" for c in result.get("more_commands", [])] + [""] * bool(result.get("more_commands"))
    lines += [
             f"Machine: {result['machine']}. Every system on the same 2 cores and weights (the bundled model), replayed "
             f"by `vllm bench serve`; goodput counts requests within TTFT {a['ttft_slo_ms']:g} ms and TPOT "
             f"{a['tpot_slo_ms']:g} ms (magicserve's `slo:` section set to them). static and load-aware: 1 prefill + 1 "
             f"decode instance ({a['prefill_kv']} + {a['decode_kv']} KV tokens); colocated: 2 instances of "
             f"{(a['prefill_kv'] + a['decode_kv']) // 2}; vLLM: their sum, prefix caching on. role-changes: load-aware "
             f"on the same 1 + 1, the online planner (`autoscale.role_changes_only`, a decision every "
             f"{a.get('autoscale_interval_s', 5.0):g} s on the last {a.get('autoscale_window_s', 20.0):g} s, simulated "
             f"on `{os.path.basename(a.get('profile', PROFILE))}`) moving the prefill instance to decode and back.", ""]
    for workload, w in result["workloads"].items():
        lines += [f"## {workload}", "", w["description"], "",
                  "| system | goodput (req/s) | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) | TPOT p99 (ms) | "
                  "prefilled on decode | completed / failed |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, r in w["systems"].items():
            local = "-" if "placements" not in r else \
                f"{sum(v for k, v in r['placements'].items() if k.startswith('decode/')):.0f}"
            lines.append(f"| {name} | {r['request_goodput']:.3f} | {r['median_ttft_ms'] / 1e3:.2f} | "
                         f"{r['p99_ttft_ms'] / 1e3:.2f} | {r['median_tpot_ms']:.1f} | {r['p99_tpot_ms']:.1f} | {local} | "
                         f"{r['completed']} / {r['failed']} |")
        s = w["systems"]
        floor = w.get("ttft_floor")
        if floor:
            lines += ["", f"TTFT floor (each prompt's prefill alone on an idle prefill instance, every earlier prompt's "
                          f"blocks cached; `--profile`'s prefill model): p50 {floor['p50_s']:.2f} s, p99 "
                          f"{floor['p99_s']:.2f} s, max {floor['max_s']:.2f} s; {floor['over_slo']} of "
                          f"{floor['requests']} requests past the {a['ttft_slo_ms'] / 1e3:g} s target on any system."]
        if "load-aware" in s and "static" in s:
            la, st = s["load-aware"], s["static"]
            slo_s = a["ttft_slo_ms"] / 1e3
            lines += ["", "TTFT p99 against the target: " + ", ".join(
                f"{name} {s[name]['p99_ttft_ms'] / 1e3:.2f} s "
                f"({'within' if s[name]['p99_ttft_ms'] <= a['ttft_slo_ms'] else 'past'} {slo_s:g} s)" for name in s) + "."]
            lines += ["", f"Load-aware / static: goodput {ratio(la['request_goodput'], st['request_goodput'])}, "
                          f"TTFT p99 {ratio(la['p99_ttft_ms'], st['p99_ttft_ms'])}, TPOT p99 "
                          f"{ratio(la['p99_tpot_ms'], st['p99_tpot_ms'])}. Load-aware decisions: "
                          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(la.get("placements", {}).items())) + "."]
        if "role-changes" in s:
            lines += ["", "role-changes' resizes (the online planner's, in order; the seconds each took, its "
                          "drain included): " + ("; ".join(map(resize_text, s["role-changes"].get("resizes", [])))
                                                 or "none") + "."]
        spread = spread_line(w)
        if spread:
            lines += ["", spread, "", "Each row above is the system's median run by goodput."]
        lines.append("")
    lines += ["Each system's `vllm bench serve` command is in the JSON.", "",
              f"![load aware]({os.path.basename(path[:-3])}.png)"]
    write_lines(path, lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(result["workloads"])
    fig, axes = plt.subplots(len(workloads), 3, figsize=(12, 3.4 * len(workloads)), squeeze=False)
    colors = {"static": "tab:gray", "load-aware": "tab:blue", "role-changes": "tab:purple", "colocated": "tab:green",
              "vllm": "tab:orange"}
    for row, workload in zip(axes, workloads):
        systems = result["workloads"][workload]["systems"]
        names = list(systems)
        for ax, (key, label, scale) in zip(row, (("request_goodput", "goodput (req/s)", 1.0),
                                                 ("p99_ttft_ms", "TTFT p99 (s)", 1e-3),
                                                 ("p99_tpot_ms", "TPOT p99 (ms)", 1.0))):
            values = [(systems[n][key] or 0.0) * scale for n in names]
            ax.bar(names, values, color=[colors[n] for n in names])
            if not any(values):  # e.g. no request met the SLOs: say so rather than draw an empty axis
                ax.set_ylim(0, 1)
                ax.text(0.5, 0.5, "0 for every system", transform=ax.transAxes, ha="center", va="center")
            if key == "p99_ttft_ms":
                ax.axhline(result["args"]["ttft_slo_ms"] / 1e3, color="k", ls="--", lw=1, label="SLO")
                ax.legend(fontsize=8)
            if key == "p99_tpot_ms":
                ax.axhline(result["args"]["tpot_slo_ms"], color="k", ls="--", lw=1, label="SLO")
                ax.legend(fontsize=8)
            ax.set_title(f"{workload}: {label}", fontsize=10)
            ax.tick_params(axis="x", labelsize=8, labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", help="Mooncake's conversation_trace.jsonl (required for the trace workload)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "load_aware"))
    add_trace_args(ap, chunk=64, max_prompt=7808, speedup=24.0, prefill_kv=65536, decode_kv=262144)
    for workload, (n, lo, hi, out, span) in DISTINCT.items():
        ap.add_argument(f"--{workload}-requests", type=int, default=n)
        ap.add_argument(f"--{workload}-min", type=int, default=lo)
        ap.add_argument(f"--{workload}-max", type=int, default=hi)
        ap.add_argument(f"--{workload}-output", type=int, default=out)
        ap.add_argument(f"--{workload}-span-s", type=float, default=span)
    ap.add_argument("--profile", default=PROFILE, help="hardware profile: its prefill model prices the TTFT floor, "
                    "and role-changes' online planner simulates on it")
    ap.add_argument("--autoscale-interval-s", type=float, default=5.0, help="role-changes: seconds between decisions")
    ap.add_argument("--autoscale-window-s", type=float, default=20.0, help="role-changes: the window planned for")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="rounds: each runs every system once")
    ap.add_argument("--add-runs", action="store_true",
                    help="add this invocation's runs to OUT.json's (same workloads' settings) instead of replacing it")
    ap.add_argument("--scratch", default=os.path.join(ROOT, "runs", "load_aware"))
    ap.add_argument("--render", action="store_true", help="redraw OUT.png from OUT.json, running nothing")
    args = ap.parse_args()
    if args.render:
        with open(args.out + ".json", encoding="utf-8") as f:
            plot(json.load(f), args.out + ".png")
        return 0
    systems, workloads = [s for s in args.systems.split(",") if s], [w for w in args.workloads.split(",") if w]
    for flag, values, allowed in (("--systems", systems, SYSTEMS), ("--workloads", workloads, WORKLOADS)):
        for v in values:
            if v not in allowed:
                ap.error(f"{flag}: {v!r} is not one of {', '.join(allowed)}")
    if "trace" in workloads and not args.trace:
        ap.error("--trace: required for the trace workload (or --workloads burst)")
    for workload in DISTINCT:
        lo, hi = getattr(args, f"{workload}_min"), getattr(args, f"{workload}_max")
        if lo % args.chunk or hi % args.chunk or not args.chunk <= lo <= hi:
            ap.error(f"--{workload}-min, --{workload}-max: multiples of --chunk ({args.chunk}) with min <= max")
    if args.repeats < 1:
        ap.error(f"--repeats: must be >= 1, got {args.repeats}")
    os.makedirs(args.scratch, exist_ok=True)
    command = "python benchmarks/load_aware.py " + " ".join(
        shlex.quote(os.path.relpath(a, ROOT) if os.path.isabs(a) else a) for a in sys.argv[1:])
    per_invocation = ("vllm", "scratch", "repeats", "add_runs", "systems", "workloads", "render")
    settings = {k: v for k, v in vars(args).items() if k not in per_invocation}
    if args.add_runs:
        with open(args.out + ".json", encoding="utf-8") as f:
            result = json.load(f)
        by_name = lambda a, b: os.path.basename(str(a)) == os.path.basename(str(b))  # noqa: E731
        same = {"out": lambda a, b: True, "model": by_name, "profile": by_name}
        differ = {k: (result["args"][k], v) for k, v in settings.items()
                  if k in result["args"] and not same.get(k, lambda a, b: a == b)(result["args"][k], v)}
        if differ:
            ap.error(f"--add-runs: these settings differ from the record's ({args.out}.json): {differ}")
        result["args"].update({k: v for k, v in settings.items() if k not in result["args"]})  # flags it lacked
        result.setdefault("more_commands", []).append(command)
    else:
        result = {"command": command, "machine": f"{cpu_model_name()}, {os.cpu_count()} cores",
                  "args": {k: v for k, v in vars(args).items() if k not in ("vllm", "scratch")}, "workloads": {}}
    for workload in workloads:
        rows, description = workload_rows(args, workload)
        path = os.path.join(args.scratch, f"{workload}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(description, file=sys.stderr, flush=True)
        w = result["workloads"].setdefault(workload, {"description": description, "requests": len(rows),
                                                      "systems": {}})
        runs = w.setdefault("runs", {name: [r] for name, r in w["systems"].items()})
        for _ in range(args.repeats):
            for system in systems:
                runs.setdefault(system, []).append(run_system(system, workload, args, path, len(rows), args.scratch))
                w["systems"][system] = median_run(runs[system])
                record(result, args.out, write_md)  # what finished so far survives a later failure
    for workload, w in result["workloads"].items():  # the record's workloads, whichever this invocation ran
        if workload != "trace" or args.trace:
            # every magicserve system keeps the embedded default's prefill token budget
            floors = ttft_floors(workload_rows(args, workload)[0], args.chunk, args.profile,
                                 load_config().prefill.token_budget)
            w["ttft_floor"] = floor_summary(floors, args.ttft_slo_ms)
    record(result, args.out, write_md)
    plot(result, args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
