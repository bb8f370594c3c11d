"""Elastic pools on a local Ray cluster: a trace whose load steps up and back down (and whose prompts shift from
chat lengths to long documents and back), replayed through the OpenAI completions endpoint on the fixed
smallest shape, the fixed largest, and the online planner resizing between them (``autoscale.enabled``,
planning on the measured CPU profile). Per system: SLO attainment over time, instance-seconds used, failed
requests, and the planner's resizes on the timeline.

Phases (Poisson arrivals; prompts are held-out corpus text, greedy, EOS ignored):

    calm     chat-like prompts (256-768 tokens, 64 out) at ``--low-rate``
    busy     long documents (1000-2000 tokens, 96 out) at ``--high-rate``
    calm     chat-like again

    python benchmarks/elastic_pools.py                       # all three systems
    python benchmarks/elastic_pools.py --systems elastic --phase-s 30

Instances are Ray actors with one torch thread each on logical resources: on a 2-core machine a second
decode instance shares the cores rather than adding any, so the attainment columns compare how each shape
copes with the same cores, and the instance-seconds and the failed-request count are what transfers to a
GPU cluster (where an instance brings its own device). Writes ``<out>.json``, ``<out>.md``, ``<out>.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._slo_launch import free_port, magicserve_server  # noqa: E402
from benchmarks._slo_targets import OpenAITarget, RequestRecord  # noqa: E402
from benchmarks.prefix_reuse import token_source  # noqa: E402
from benchmarks.slo_sweep import heldout_corpus, percentile  # noqa: E402
from controller.config import LOCAL_CONFIG  # noqa: E402
from controller.defaults import DEFAULT_MODEL_DIR  # noqa: E402
from frontend.client import AsyncClient  # noqa: E402

SYSTEMS = ("fixed-min", "fixed-max", "elastic")
PROFILE = os.path.join(ROOT, "benchmarks", "results", "profile_local_cpu.json")


def phased_trace(args) -> list[dict]:
    """The requests: arrival (s), prompt and output lengths, phase."""
    rng = random.Random(args.seed)
    phases = [("calm", args.low_rate, (256, 768), 64), ("busy", args.high_rate, (1000, 2000), 96),
              ("calm", args.low_rate, (256, 768), 64)]
    out, start = [], 0.0
    for name, rate, (lo, hi), output in phases:
        t = start + rng.expovariate(rate)
        while t < start + args.phase_s:
            out.append({"arrival_s": t, "prompt_tokens": rng.randint(lo, hi), "output_tokens": output, "phase": name})
            t += rng.expovariate(rate)
        start += args.phase_s
    return out


def config_for(system: str, args, workdir: str) -> tuple[str, int, int]:
    with open(LOCAL_CONFIG, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    cfg["model"]["path"] = os.path.abspath(args.model)
    cfg["slo"] = {"ttft_ms": args.ttft_slo_s * 1e3, "tpot_ms": args.tpot_slo_s * 1e3, "attainment": 0.9}
    cfg["prefill"]["instances"] = cfg["decode"]["instances"] = 2 if system == "fixed-max" else 1
    cfg["ray"] = {"num_cpus": 6, "num_gpus": 0}  # logical: room for the largest shape
    if system == "elastic":
        cfg["autoscale"] = {"enabled": True, "profile": PROFILE, "interval_s": args.interval_s,
                            "window_s": args.window_s, "headroom": 1.2, "cooldown_s": args.cooldown_s,
                            "scale_down_after": 2, "min_window_requests": 3,
                            "prefill": {"max_instances": 2}, "decode": {"max_instances": 2}}
    http, grpc_port = free_port(), free_port()
    cfg["server"]["http_port"] = http
    path = os.path.join(workdir, f"{system}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f)
    return path, http, grpc_port


async def watch_shape(address: str, t0: float, samples: list, events: dict, stop: asyncio.Event) -> None:
    """Every 0.5 s: the instances in service per pool; and every resize the server reports."""
    async with AsyncClient(address) as client:
        while not stop.is_set():
            try:
                st = await client.status()
                samples.append((time.monotonic() - t0, {p.pool: p.current for p in st.pools}))
                for r in st.recent_scaling:
                    key = (r.pool, r.desired, tuple(r.added), tuple(r.removed))
                    events.setdefault(key, {"t": time.monotonic() - t0, "pool": r.pool, "desired": r.desired,
                                            "added": list(r.added), "removed": list(r.removed), "error": r.error,
                                            "seconds": r.seconds})
            except Exception as err:  # noqa: BLE001 - a missed sample is a gap, not a failure
                print(f"status: {err}", file=sys.stderr)
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass


async def run_system(system: str, args, trace: list[dict], take, workdir: str) -> dict:
    path, http, grpc_port = config_for(system, args, workdir)
    server = magicserve_server(path, "127.0.0.1", grpc_port, args.launch_timeout_s, http)
    with server:
        target = OpenAITarget(f"http://127.0.0.1:{http}")
        await target.start()
        warm = take(("warmup",), 64)
        for _ in range(2):
            await target.generate(warm, 8, {"temperature": 0.0}, RequestRecord(0, 0.0, 64, 8), time.monotonic)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        samples, events, stop = [], {}, asyncio.Event()
        watcher = loop.create_task(watch_shape(f"127.0.0.1:{grpc_port}", time.monotonic(), samples, events, stop))
        records = [RequestRecord(i, r["arrival_s"], r["prompt_tokens"], r["output_tokens"]) for i, r in enumerate(trace)]

        def clock() -> float:
            return loop.time() - t0

        async def send(i: int) -> None:
            await asyncio.sleep(max(0.0, trace[i]["arrival_s"] - clock()))
            try:
                await target.generate(take(("prompt", i), trace[i]["prompt_tokens"]), trace[i]["output_tokens"],
                                      {"temperature": 0.0}, records[i], clock)
            except Exception as err:  # noqa: BLE001 - a failed request is data
                records[i].error = f"{type(err).__name__}: {err}"

        print(f"[{system}] {len(trace)} requests over {3 * args.phase_s:g} s", file=sys.stderr, flush=True)
        try:
            await asyncio.wait_for(asyncio.gather(*(send(i) for i in range(len(trace)))), args.time_limit_s)
        except asyncio.TimeoutError:
            pass
        duration = clock()
        stop.set()
        await watcher
    rows = []
    for rec, r in zip(records, trace):
        d = rec.to_json()
        d.update(phase=r["phase"])
        rows.append(d)
    return {"records": rows, "shape": samples, "events": sorted(events.values(), key=lambda e: e["t"]),
            "duration_s": duration, **summarize(system, rows, samples, duration, args)}


def summarize(system: str, rows: list[dict], samples: list, duration: float, args) -> dict:
    ok = [r for r in rows if r["finish_reason"] in ("stop", "length")]

    def good(r) -> bool:
        return r in ok and r["ttft_s"] <= args.ttft_slo_s and (r["tpot_s"] or 0.0) <= args.tpot_slo_s

    fixed = {"fixed-min": 2, "fixed-max": 4}.get(system)
    if fixed is not None:
        instance_s = fixed * duration
    else:  # the instances in service, integrated over the samples
        instance_s = sum((t1 - t0) * sum(s0.values()) for (t0, s0), (t1, _) in zip(samples, samples[1:]))
        instance_s += (duration - samples[-1][0]) * sum(samples[-1][1].values()) if samples else 0.0
    bins = []
    for b in range(int(3 * args.phase_s // args.bin_s)):
        lo, hi = b * args.bin_s, (b + 1) * args.bin_s
        inside = [r for r in rows if lo <= r["arrival_s"] < hi]
        bins.append({"start_s": lo, "requests": len(inside),
                     "attainment": sum(good(r) for r in inside) / len(inside) if inside else None})
    ttft = [r["ttft_s"] for r in ok]
    return {"requests": len(rows), "finished": len(ok), "failed": sum(r["error"] is not None for r in rows),
            "attainment": sum(good(r) for r in rows) / len(rows) if rows else 0.0,
            "attainment_by_phase": {ph: (sum(good(r) for r in rows if r["phase"] == ph) /
                                         max(1, sum(r["phase"] == ph for r in rows))) for ph in ("calm", "busy")},
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile([r["tpot_s"] for r in ok if r["tpot_s"]], 50),
            "instance_seconds": instance_s, "bins": bins}


def reading(systems: dict) -> str:
    if not {"elastic", "fixed-max"} <= set(systems):
        return ""
    el, mx = systems["elastic"], systems["fixed-max"]
    return (f"Elastic: {100 * el['attainment']:.0f} % attainment with {el['instance_seconds']:.0f} instance-seconds "
            f"against the largest shape's {100 * mx['attainment']:.0f} % with {mx['instance_seconds']:.0f} "
            f"({el['instance_seconds'] / mx['instance_seconds']:.2f}x); {el['failed']} failed requests across "
            f"{len(el['events'])} resizes. The planner acts on a window of finished requests, so it grows the pools "
            "once the busy phase's latencies have been measured (the correction of the simulated ones), and "
            "shrinks them after the load falls. On 2 cores an added instance shares the cores instead of adding "
            "compute, so the three attainments compare how each shape copes with the same cores, within this "
            "shared machine's run-to-run drift; what carries over to GPUs, where "
            "an instance brings its own device, is the shape following the load at fewer instance-seconds and no "
            "request lost in any resize.")


def write_markdown(result: dict, path: str) -> None:
    s = result["settings"]
    lines = ["# Elastic pools: the online planner against fixed shapes", "", f"`{result['command']}`", "",
             f"{result['machine']}; bundled model (`{s['model']}`, bfloat16), `cluster_configs/local.yaml` with "
             f"logical resources (each instance one torch thread); SLOs {s['ttft_slo_s'] * 1e3:.0f} ms TTFT / "
             f"{s['tpot_slo_s'] * 1e3:.0f} ms TPOT. Trace: {result['trace']}.", "",
             "| system | shape | requests | failed | attainment | calm phases | busy phase | TTFT p50 / p99 | "
             "TPOT p50 | instance-seconds |", "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    shapes = {"fixed-min": "1 P + 1 D", "fixed-max": "2 P + 2 D", "elastic": "1-2 P + 1-2 D (planner)"}
    for name, r in result["systems"].items():
        ph = r["attainment_by_phase"]
        lines.append(f"| {name} | {shapes[name]} | {r['requests']} | {r['failed']} | {100 * r['attainment']:.0f} % | "
                     f"{100 * ph['calm']:.0f} % | {100 * ph['busy']:.0f} % | {r['ttft_p50_s'] * 1e3:.0f} / "
                     f"{r['ttft_p99_s'] * 1e3:.0f} ms | {r['tpot_p50_s'] * 1e3:.0f} ms | {r['instance_seconds']:.0f} |")
    el = result["systems"].get("elastic")
    if el is not None:
        lines += ["", "Resizes of the elastic run (seconds from the trace start):", ""]
        for e in el["events"]:
            change = " ".join([f"+{n}" for n in e["added"]] + [f"-{n}" for n in e["removed"]])
            lines.append(f"- {e['t']:.0f} s: {e['pool']} -> {e['desired']} ({change or 'no change'}"
                         f"{', stopped: ' + e['error'] if e['error'] else ''}; {e['seconds']:.1f} s)")
    lines += ["", result["reading"], "", "![attainment and instances over time](elastic_pools.png)"]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    colors = {"fixed-min": "#999", "fixed-max": "#c63", "elastic": "#27a"}
    for name, r in result["systems"].items():
        xs = [b["start_s"] + result["settings"]["bin_s"] / 2 for b in r["bins"] if b["attainment"] is not None]
        ys = [100 * b["attainment"] for b in r["bins"] if b["attainment"] is not None]
        top.plot(xs, ys, marker="o", color=colors[name], label=name)
        if name == "elastic":
            ts = [t for t, _ in r["shape"]]
            bottom.step(ts, [sum(s.values()) for _, s in r["shape"]], where="post", color=colors[name], label=name)
            for e in r["events"]:
                bottom.axvline(e["t"], color=colors[name], alpha=0.3, linestyle="--")
        else:
            bottom.hlines({"fixed-min": 2, "fixed-max": 4}[name], 0, r["duration_s"], color=colors[name], label=name)
    for i, name in enumerate(("calm", "busy", "calm")):
        top.axvspan(i * result["settings"]["phase_s"], (i + 1) * result["settings"]["phase_s"],
                    color="#eee" if name == "busy" else "white", zorder=0)
    top.set_ylabel("SLO attainment (%)\nby arrival time")
    top.legend(fontsize=8)
    bottom.set_ylabel("instances in service")
    bottom.set_xlabel("seconds from the trace start (busy phase shaded above; dashed: resizes)")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--phase-s", type=float, default=60.0)
    ap.add_argument("--low-rate", type=float, default=0.4)
    ap.add_argument("--high-rate", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-slo-s", type=float, default=3.0)
    ap.add_argument("--tpot-slo-s", type=float, default=0.1)
    ap.add_argument("--interval-s", type=float, default=3.0)
    ap.add_argument("--window-s", type=float, default=15.0)
    ap.add_argument("--cooldown-s", type=float, default=10.0)
    ap.add_argument("--bin-s", type=float, default=15.0)
    ap.add_argument("--time-limit-s", type=float, default=600.0)
    ap.add_argument("--launch-timeout-s", type=float, default=300.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "elastic_pools"))
    args = ap.parse_args(argv)
    trace = phased_trace(args)
    take = token_source(heldout_corpus(args.model, 400_000))
    result = {"command": ("python benchmarks/elastic_pools.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip(),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "settings": {**{k: v for k, v in vars(args).items() if k != "out"},
                           "model": os.path.relpath(os.path.abspath(args.model), ROOT)},
              "trace": (f"{len(trace)} requests: calm {args.phase_s:g} s at {args.low_rate} req/s (256-768-token "
                        f"prompts, 64 out), busy {args.phase_s:g} s at {args.high_rate} req/s (1000-2000, 96 out), "
                        f"calm again"),
              "systems": {}}
    with tempfile.TemporaryDirectory() as workdir:
        for system in args.systems:
            result["systems"][system] = asyncio.run(run_system(system, args, trace, take, workdir))
            r = result["systems"][system]
            print(f"[{system}] attainment {r['attainment']:.2f}, failed {r['failed']}, instance-s "
                  f"{r['instance_seconds']:.0f}", file=sys.stderr, flush=True)
    systems = result["systems"]
    result["reading"] = reading(systems)
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump({**result, "systems": {s: {k: v for k, v in r.items() if k != "records"}
                                         for s, r in systems.items()}}, f, indent=1)
    write_markdown(result, args.out + ".md")
    plot(result, args.out + ".png")
    print(f"wrote {args.out}.json, .md, .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
