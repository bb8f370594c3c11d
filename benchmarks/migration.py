"""Live migration between decode instances: the pause a migrated request sees against its length, and tail
latency on a skewed long-output workload with and without the global rescheduling policy.

    python benchmarks/migration.py --part downtime --out benchmarks/results/migration_downtime
    python benchmarks/migration.py --part skewed --out benchmarks/results/migration_skewed
    python benchmarks/migration.py --part simulated --out benchmarks/results/migration_simulated

Both parts start ``magicserve serve`` (a separate process, as a user runs it) on a generated config: the
bundled model in float32, 1 prefill + 2 decode instances of one thread each.

``downtime``: for each prompt length (1K to 16K tokens), greedy requests run alone; once a request has
streamed ``--migrate-after`` tokens, ``MigrateRequest`` moves it to the other decode instance. The pause is
the longest gap between two consecutive stream messages from the call to shortly after the decision (the
stop-and-copy and the hand-over), against the request's median gap before the call (one decode step).
Also recorded: the migration's total time (call to commit: it grows with the KV copied in rounds while the
request keeps decoding).

``skewed``: a Poisson trace where a quarter of the requests generate 8-16x more tokens than the rest (their
lengths unknown at placement, as in Llumnix's evaluation), on decode instances with little KV room, run
twice on the same trace: ``migration.enabled`` false, then true. Per run: TTFT and TPOT P50/P99,
preemptions, migrations, goodput at the SLOs.

``simulated``: the policy at a scale this machine cannot run, in the planner's simulator (see
``benchmarks/migration_sim.py``): P99 TPOT with and without it over a grid of decode instances, KV per
instance and arrival rates.

Writes OUT.json, OUT.md and OUT.png.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402
from benchmarks._slo_launch import free_port, magicserve_server  # noqa: E402
from benchmarks.migration_sim import plot_simulated, run_simulated, write_simulated_md  # noqa: E402
from benchmarks.slo_sweep import heldout_corpus  # noqa: E402

MODEL = os.path.join(ROOT, "models", "stdlib-llama-15m")
PAUSE_TARGET_STEPS = 2.0  # the pause may be at most this many decode steps
TAIL_TARGET = 2.0  # P99 TPOT without migration / with migration, at least


def cluster_config(decode_kv_tokens: int, max_prompt: int, migration: bool, max_num_seqs: int = 64,
                   speculation: dict | None = None) -> dict:
    return {
        "model": {"path": MODEL, "dtype": "float32"},
        "ray": {"num_cpus": 4},
        "prefill": {"instances": 1, "threads": 1, "token_budget": 1024, "kv_cache_tokens": max(16384, max_prompt + 1024)},
        "decode": {"instances": 2, "threads": 1, "kv_cache_tokens": decode_kv_tokens, "max_num_seqs": max_num_seqs,
                   "speculation": {"drafter": "self_sparse", "budget": 256, "sink_tokens": 16,
                                   "k_policy": "adaptive", "max_k": 5, **(speculation or {})}},
        "kv_transfer": {"timeout_s": 60},
        "server": {"host": "127.0.0.1", "port": 0, "http_port": None},
        "limits": {"max_prompt_tokens": max_prompt, "max_tokens": 2048, "max_concurrent_requests": 64,
                   "max_queue_length": 1024, "request_timeout_s": 1800},
        "migration": {"enabled": migration, "interval_s": 0.25},
    }


def launch(config: dict, startup_timeout_s: float = 300.0):
    path = tempfile.mkstemp(prefix="migration_bench_", suffix=".yaml")[1]
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f)
    port = free_port()
    return magicserve_server(path, "127.0.0.1", port, startup_timeout_s), f"127.0.0.1:{port}"


# -- downtime ---------------------------------------------------------------------------------------

async def one_migration(address: str, prompt: list[int], max_tokens: int, migrate_after: int, rid: str) -> dict:
    from frontend.client import AsyncClient

    arrivals: list[tuple[float, int]] = []  # (time, tokens so far) per stream message
    call = {}

    async def migrate_when_ready(client):
        while sum(n for _, n in arrivals[-1:]) < migrate_after:
            await asyncio.sleep(0.002)
        call["t0"] = time.perf_counter()
        call["tokens"] = arrivals[-1][1]
        res = await client.migrate(rid)
        call["t1"] = time.perf_counter()
        call["result"] = res

    async with AsyncClient(address) as client:
        mover = None
        count = 0
        async for chunk in client.generate_stream(prompt, max_tokens=max_tokens, ignore_eos=True, request_id=rid):
            if chunk.token_ids:
                count += len(chunk.token_ids)
                arrivals.append((time.perf_counter(), count))
            if mover is None:
                mover = asyncio.create_task(migrate_when_ready(client))
        await mover
    res = call["result"]
    # the hand-over: the first message carrying a token past those the source generated comes from the
    # destination; the gap before it is the pause (stop-and-copy, commit, the destination's first step)
    first_dst = next(i for i, (_, n) in enumerate(arrivals) if n > res.source_tokens)
    times = [t for t, _ in arrivals]
    gaps = [times[i + 1] - times[i] for i in range(len(times) - 1)]
    start = next(i for i, t in enumerate(times) if t >= call["t0"])  # first message after the call
    before = gaps[3:max(4, start - 1)]  # the source's steps before the call (past the first few)
    rounds = gaps[start - 1:first_dst - 1]  # the source's steps while the rounds copy the KV
    after = gaps[first_dst:first_dst + 10]  # the destination's first steps
    pause = gaps[first_dst - 1]
    step = max(statistics.median(before), statistics.median(after))
    return {"prompt_tokens": len(prompt), "committed": res.committed, "reason": res.reason,
            "source": res.source, "destination": res.destination, "migration_s": res.seconds,
            "source_tokens": res.source_tokens, "step_before_ms": 1e3 * statistics.median(before),
            "step_after_ms": 1e3 * statistics.median(after), "slowest_round_step_ms": 1e3 * max(rounds, default=0.0),
            "pause_ms": 1e3 * pause, "pause_steps": pause / step, "tokens": count}


async def run_downtime(address: str, corpus: list[int], lengths: list[int], repeats: int, max_tokens: int,
                       migrate_after: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for n in lengths:
        for r in range(repeats):
            off = rng.randrange(len(corpus) - n + 1)
            row = await one_migration(address, corpus[off:off + n], max_tokens, migrate_after, f"dt-{n}-{r}")
            row["repeat"] = r
            print(f"  {n:>6} tokens: pause {row['pause_ms']:7.1f} ms = {row['pause_steps']:.2f} steps "
                  f"(step {row['step_before_ms']:.1f} ms), migration {row['migration_s'] * 1e3:.0f} ms, "
                  f"committed {row['committed']}", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def summarise_downtime(rows: list[dict]) -> list[dict]:
    out = []
    for n in sorted({r["prompt_tokens"] for r in rows}):
        rs = [r for r in rows if r["prompt_tokens"] == n]
        out.append({"prompt_tokens": n, "committed": sum(r["committed"] for r in rs), "runs": len(rs),
                    "pause_ms": statistics.median(r["pause_ms"] for r in rs),
                    "pause_steps": statistics.median(r["pause_steps"] for r in rs),
                    "pause_steps_max": max(r["pause_steps"] for r in rs),
                    "step_ms": statistics.median(r["step_before_ms"] for r in rs),
                    "step_after_ms": statistics.median(r["step_after_ms"] for r in rs),
                    "slowest_round_step_ms": statistics.median(r["slowest_round_step_ms"] for r in rs),
                    "stall_ms": statistics.median(r["pause_ms"] - r["step_after_ms"] for r in rs),
                    "migration_ms": statistics.median(1e3 * r["migration_s"] for r in rs)})
    return out


# -- skewed workload --------------------------------------------------------------------------------

def skewed_trace(corpus: list[int], num: int, rate: float, seed: int, long_share: float,
                 short_out: tuple[int, int], long_out: tuple[int, int], prompt: tuple[int, int]) -> list[dict]:
    rng = random.Random(seed)
    t, trace = 0.0, []
    for i in range(num):
        t += rng.expovariate(rate)
        n = rng.randint(*prompt)
        off = rng.randrange(len(corpus) - n + 1)
        out = rng.randint(*long_out) if rng.random() < long_share else rng.randint(*short_out)
        trace.append({"index": i, "arrival_s": t, "prompt": corpus[off:off + n], "output_tokens": out})
    return trace


async def run_trace(address: str, trace: list[dict]) -> list[dict]:
    from frontend.client import AsyncClient

    t0 = time.perf_counter()

    async def one(item, client) -> dict:
        await asyncio.sleep(max(0.0, item["arrival_s"] - (time.perf_counter() - t0)))
        sent = time.perf_counter()
        first = last = None
        n = 0
        async for chunk in client.generate_stream(item["prompt"], max_tokens=item["output_tokens"], ignore_eos=True):
            if chunk.token_ids:
                now = time.perf_counter()
                first = first or now
                last = now
                n += len(chunk.token_ids)
        return {"index": item["index"], "prompt_tokens": len(item["prompt"]), "output_tokens": n,
                "ttft_s": first - sent, "tpot_s": (last - first) / (n - 1) if n > 1 else 0.0, "e2e_s": last - sent}

    async with AsyncClient(address) as client:
        return list(await asyncio.gather(*(one(item, client) for item in trace)))


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def summarise_run(rows: list[dict], status, duration_s: float, ttft_slo: float, tpot_slo: float) -> dict:
    ttft = [r["ttft_s"] for r in rows]
    tpot = [r["tpot_s"] for r in rows if r["output_tokens"] > 1]
    ok = sum(r["ttft_s"] <= ttft_slo and r["tpot_s"] <= tpot_slo for r in rows)
    return {"requests": len(rows), "duration_s": duration_s,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "tpot_p50_ms": 1e3 * pct(tpot, 50), "tpot_p99_ms": 1e3 * pct(tpot, 99),
            "slo_attainment": ok / len(rows), "goodput_rps": ok / duration_s,
            "preemptions": sum(i.preemptions for i in status.instances if i.role == "decode"),
            "migrations_committed": status.migrations_committed, "migrations_aborted": status.migrations_aborted}


def simulate_trace(profile_path: str, config: dict, trace: list[dict], ttft_slo: float, tpot_slo: float,
                   seeds: int) -> dict:
    """The same trace through the planner's simulator (``planner/sim_migration.py`` models the
    migrations): medians over ``seeds`` acceptance draws."""
    from controller.config import parse_config
    from planner.profile import Profile
    from planner.simulator import SimConfig, simulate
    from planner.workload import RequestSpec

    profile = Profile.load(profile_path)
    sim_config = SimConfig.from_cluster_config(parse_config(config))
    specs = [RequestSpec(t["arrival_s"], len(t["prompt"]), t["output_tokens"]) for t in trace]
    runs = []
    for seed in range(seeds):
        res = simulate(profile, sim_config, specs, seed=seed)
        rows = [{"ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "output_tokens": r.completion_tokens} for r in res.records]
        ttft = [r["ttft_s"] for r in rows]
        tpot = [r["tpot_s"] for r in rows if r["output_tokens"] > 1]
        ok = sum(r["ttft_s"] <= ttft_slo and r["tpot_s"] <= tpot_slo for r in rows)
        runs.append({"tpot_p50_ms": 1e3 * pct(tpot, 50), "tpot_p99_ms": 1e3 * pct(tpot, 99),
                     "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
                     "preemptions": sum(r.preemptions for r in res.records),
                     "migrations_committed": res.migrations.committed if res.migrations else 0,
                     "slo_attainment": ok / len(rows)})
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


async def skewed_once(address: str, trace: list[dict], ttft_slo: float, tpot_slo: float) -> dict:
    from frontend.client import AsyncClient

    start = time.perf_counter()
    rows = await run_trace(address, trace)
    duration = time.perf_counter() - start
    async with AsyncClient(address) as client:
        status = await client.status()
    return {"summary": summarise_run(rows, status, duration, ttft_slo, tpot_slo), "requests": rows}


# -- records ----------------------------------------------------------------------------------------

def write_downtime_md(result: dict, path: str) -> None:
    lines = [
        "# Live migration: the pause against the sequence length",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {result['machine']}. Model: the bundled {result['model']} in float32; 1 prefill + 2 decode "
        f"instances of one thread each (self-speculation, fixed k = {result['k']}); one request at a time, "
        f"migrated once it had streamed {result['migrate_after']} tokens; {result['repeats']} requests per length "
        "(medians).",
        "",
        "The pause is the gap between the last stream message the source sent and the first from the "
        "destination (stop-and-copy of the last blocks and the state, the router's commit, the destination's "
        "first step), in milliseconds and in decode steps (the larger of the request's median gap on the source "
        "before the call and on the destination after the move). The migration time runs from the call to "
        "the commit: the rounds copy the KV while the request keeps decoding, so it grows with the length while "
        "the pause does not. On this machine the copy competes with decoding for the two cores: the slowest "
        "source step during the rounds shows that cost (GPUs copy over NCCL without the cores).",
        "",
        "| prompt tokens | pause ms | pause / step | worst of the repeats | pause beyond one step ms "
        "| step before ms | step after ms | slowest step during the rounds ms | migration ms | committed |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["summary"]:
        lines.append(f"| {r['prompt_tokens']} | {r['pause_ms']:.1f} | {r['pause_steps']:.2f} | {r['pause_steps_max']:.2f} "
                     f"| {r['stall_ms']:.1f} | {r['step_ms']:.1f} | {r['step_after_ms']:.1f} "
                     f"| {r['slowest_round_step_ms']:.1f} | {r['migration_ms']:.0f} | {r['committed']}/{r['runs']} |")
    v = result["verdict"]
    lines += ["", f"Target: a pause of at most {PAUSE_TARGET_STEPS:g} decode steps at every length, not growing "
              f"from 1K to 16K tokens. Median pause {v['min_steps']:.2f}-{v['max_steps']:.2f} steps at every "
              f"length: {'met' if v['met'] else 'NOT met'}. In milliseconds the pause is about one step of the "
              "destination (which itself grows with the context, as every decode step does) plus the stall "
              "beyond it, the stop-and-copy and the commit; the KV copied grew "
              f"{v['kv_growth']:.0f}x from the shortest to the longest prompt.", "", "![pause](" +
              os.path.basename(path[:-3]) + ".png)"]
    write_lines(path, lines)


def plot_downtime(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    xs = [r["prompt_tokens"] for r in s]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(xs, [r["pause_ms"] for r in s], "o-", label="pause (stop-and-copy + hand-over)")
    ax.plot(xs, [r["step_ms"] for r in s], "s--", label="decode step before the migration")
    ax.plot(xs, [r["slowest_round_step_ms"] for r in s], "v-.", label="slowest source step during the rounds")
    ax.plot(xs, [r["migration_ms"] for r in s], "^:", label="whole migration (rounds while decoding)")
    for row in result["rows"]:
        ax.plot(row["prompt_tokens"], row["pause_ms"], ".", color="C0", alpha=0.4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length at migration (prompt tokens)")
    ax.set_ylabel("milliseconds")
    ax.set_title("Live migration: the pause stays about one decode step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SKEWED_ROWS = [("tpot_p50_ms", "TPOT P50 (ms)", "{:.1f}"), ("tpot_p99_ms", "TPOT P99 (ms)", "{:.1f}"),
               ("ttft_p50_ms", "TTFT P50 (ms)", "{:.0f}"), ("ttft_p99_ms", "TTFT P99 (ms)", "{:.0f}"),
               ("preemptions", "preemptions", "{:.0f}"), ("migrations_committed", "migrations", "{:.0f}"),
               ("migrations_aborted", "migrations aborted", "{:.0f}"), ("slo_attainment", "SLO attainment", "{:.0%}"),
               ("goodput_rps", "goodput (req/s)", "{:.3f}"), ("duration_s", "trace duration (s)", "{:.0f}")]


def skewed_medians(result: dict, key: str) -> dict:
    runs = [pair[key]["summary"] for pair in result["pairs"]]
    return {k: statistics.median(r[k] for r in runs) for k, _, _ in SKEWED_ROWS}


def write_skewed_md(result: dict, path: str) -> None:
    off, on = skewed_medians(result, "without"), skewed_medians(result, "with")
    n = len(result["pairs"])
    lines = [
        "# Live migration on a skewed long-output workload",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {result['machine']}. Model: the bundled {result['model']} in float32; 1 prefill + 2 decode "
        f"instances of one thread each, {result['decode_kv_tokens']} KV tokens per decode instance. Trace: "
        f"{result['num_requests']} Poisson arrivals at {result['rate']} req/s, prompts of "
        f"{result['prompt_tokens'][0]}-{result['prompt_tokens'][1]} tokens, "
        f"{result['long_share']:.0%} of requests generating {result['long_out'][0]}-{result['long_out'][1]} tokens "
        f"and the rest {result['short_out'][0]}-{result['short_out'][1]}; the same trace {2 * n} times, alternately "
        f"with the global rescheduling policy off and on (default thresholds), each on a fresh server; medians of "
        f"the {n} runs of each. SLOs for goodput: TTFT {result['ttft_slo_s']:g} s, "
        f"TPOT {1e3 * result['tpot_slo_s']:g} ms.",
        "",
        "| | without migration | with migration |",
        "|---|---:|---:|",
    ]
    for key, label, fmt in SKEWED_ROWS:
        lines.append(f"| {label} | {fmt.format(off[key])} | {fmt.format(on[key])} |")
    ratios = [p["without"]["summary"]["tpot_p99_ms"] / p["with"]["summary"]["tpot_p99_ms"] for p in result["pairs"]]
    ratio = statistics.median(ratios)
    lines += ["", f"P99 TPOT without / with migration, run by run: {', '.join(f'{r:.2f}x' for r in ratios)}; "
              f"median **{ratio:.2f}x** (target: at least {TAIL_TARGET:g}x): {'met' if ratio >= TAIL_TARGET else 'NOT met'}."]
    sim = result.get("simulated")
    if sim:
        so, sw = sim["without"], sim["with"]
        lines += ["", "## The simulator on the same trace", "",
                  f"`planner/sim_migration.py` replays the trace with the profile "
                  f"`{os.path.relpath(result['profile'], ROOT)}` (this machine, float32; no serving-path "
                  f"calibration), medians of {result['sim_seeds']} acceptance draws, beside the measurement:", "",
                  "| | measured without | simulated without | measured with | simulated with |",
                  "|---|---:|---:|---:|---:|"]
        for key, label, fmt in SKEWED_ROWS[:-2]:
            if key in so:
                lines.append(f"| {label} | {fmt.format(off[key])} | {fmt.format(so[key])} | {fmt.format(on[key])} "
                             f"| {fmt.format(sw[key])} |")
        lines += ["", f"Simulated P99 TPOT without / with migration: {so['tpot_p99_ms'] / sw['tpot_p99_ms']:.2f}x "
                  f"(measured {ratio:.2f}x)."]
    lines += ["", "![tpot](" + os.path.basename(path[:-3]) + ".png)"]
    write_lines(path, lines)


def plot_skewed(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, pair in enumerate(result["pairs"]):
        for key, label, color in (("without", "without migration", "C0"), ("with", "with migration", "C1")):
            tpot = sorted(1e3 * r["tpot_s"] for r in pair[key]["requests"] if r["output_tokens"] > 1)
            ax.plot(tpot, [100 * (j + 1) / len(tpot) for j in range(len(tpot))], color=color,
                    linestyle=("-", "--", ":", "-.")[i % 4], label=f"{label}, run {i + 1}")
    ax.axvline(1e3 * result["tpot_slo_s"], color="grey", linestyle="-.", linewidth=1, label="TPOT SLO")
    ax.set_xscale("log")
    ax.set_xlabel("request TPOT (ms)")
    ax.set_ylabel("requests (%)")
    ax.set_title("Skewed long-output workload: TPOT distribution")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, no GPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["downtime", "skewed", "simulated"], help="what to measure (required unless --render)")
    ap.add_argument("--out", required=True, help="output path without extension")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,15872", help="downtime: prompt lengths")
    ap.add_argument("--repeats", type=int, default=3, help="downtime: requests per length; skewed: runs of each")
    ap.add_argument("--migrate-after", type=int, default=24, help="downtime: tokens streamed before the move")
    ap.add_argument("--max-tokens", type=int, default=120, help="downtime: tokens per request")
    ap.add_argument("--k", type=int, default=3, help="downtime: fixed speculation length (steps comparable "
                                                     "before and after the move)")
    ap.add_argument("--num-requests", type=int, default=40, help="skewed: requests in the trace")
    ap.add_argument("--rate", type=float, default=0.5, help="skewed: arrivals per second")
    ap.add_argument("--decode-kv-tokens", type=int, default=4096, help="skewed: KV tokens per decode instance")
    ap.add_argument("--long-share", type=float, default=0.25)
    ap.add_argument("--ttft-slo", type=float, default=10.0, help="skewed: TTFT SLO (s)")
    ap.add_argument("--tpot-slo", type=float, default=0.1, help="skewed: TPOT SLO (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=os.path.join(ROOT, "benchmarks", "results", "profile_local_cpu_f32_shapes.json"),
                    help="skewed: replay the trace through the simulator with this profile ('' : skip)")
    ap.add_argument("--sim-seeds", type=int, default=5)
    ap.add_argument("--sim-instances", default="4,8", help="simulated: decode instances")
    ap.add_argument("--sim-kv-tokens", default="16384,24576", help="simulated: KV tokens per decode instance")
    ap.add_argument("--sim-rates", default="1,1.5,2,3", help="simulated: arrivals per second per decode instance")
    ap.add_argument("--sim-requests", type=int, default=400, help="simulated: requests per trace")
    ap.add_argument("--render", action="store_true", help="rewrite OUT.md and OUT.png from OUT.json (no run)")
    args = ap.parse_args()
    if args.render:
        import json

        with open(args.out + ".json", encoding="utf-8") as f:
            result = json.load(f)
        if result["part"] == "downtime":
            result["summary"] = summarise_downtime(result["rows"])
            record(result, args.out, write_downtime_md)
            plot_downtime(result, args.out + ".png")
        elif result["part"] == "simulated":
            record(result, args.out, write_simulated_md)
            plot_simulated(result, args.out + ".png")
        else:
            record(result, args.out, write_skewed_md)
            plot_skewed(result, args.out + ".png")
        return 0
    if args.part is None:
        ap.error("--part: required (downtime, skewed or simulated)")
    command = "python benchmarks/migration.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.part == "simulated":
        result = {"command": command, "part": "simulated", "num_requests": args.sim_requests, "seeds": args.sim_seeds,
                  "target": TAIL_TARGET,
                  "rows": run_simulated([int(x) for x in args.sim_instances.split(",")],
                                        [int(x) for x in args.sim_kv_tokens.split(",")],
                                        [float(x) for x in args.sim_rates.split(",")], args.sim_requests,
                                        args.sim_seeds)}
        record(result, args.out, write_simulated_md)
        plot_simulated(result, args.out + ".png")
        return 0
    lengths = [int(x) for x in args.lengths.split(",")]
    corpus = heldout_corpus(MODEL, max(lengths) + 4096)
    base = {"command": command, "machine": machine(), "model": os.path.basename(MODEL)}
    if args.part == "downtime":
        server, address = launch(cluster_config(65536, max(lengths), migration=False,
                                                speculation={"k_policy": "fixed", "k": args.k}))
        with server:
            rows = asyncio.run(run_downtime(address, corpus, lengths, args.repeats, args.max_tokens,
                                            args.migrate_after, args.seed))
        summary = summarise_downtime(rows)
        steps = [r["pause_steps"] for r in summary]
        verdict = {"min_steps": min(steps), "max_steps": max(steps),
                   "pause_growth": summary[-1]["pause_ms"] / summary[0]["pause_ms"],
                   "kv_growth": summary[-1]["prompt_tokens"] / summary[0]["prompt_tokens"],
                   "met": max(steps) <= PAUSE_TARGET_STEPS and all(r["committed"] == r["runs"] for r in summary)}
        result = {**base, "part": "downtime", "migrate_after": args.migrate_after, "repeats": args.repeats, "k": args.k,
                  "summary": summary, "verdict": verdict, "rows": rows}
        record(result, args.out, write_downtime_md)
        plot_downtime(result, args.out + ".png")
        return 0
    short_out, long_out, prompt = (16, 64), (512, 1024), (256, 768)
    trace = skewed_trace(corpus, args.num_requests, args.rate, args.seed, args.long_share, short_out, long_out, prompt)
    result = {**base, "part": "skewed", "num_requests": args.num_requests, "rate": args.rate,
              "decode_kv_tokens": args.decode_kv_tokens, "long_share": args.long_share, "short_out": short_out,
              "long_out": long_out, "prompt_tokens": prompt, "ttft_slo_s": args.ttft_slo, "tpot_slo_s": args.tpot_slo}
    result["pairs"] = []
    for run in range(args.repeats):
        pair = {}
        for key, enabled in (("without", False), ("with", True)):
            server, address = launch(cluster_config(args.decode_kv_tokens, prompt[1], migration=enabled))
            with server:
                pair[key] = asyncio.run(skewed_once(address, trace, args.ttft_slo, args.tpot_slo))
            print(f"[run {run + 1}, {key} migration] {pair[key]['summary']}", file=sys.stderr, flush=True)
        result["pairs"].append(pair)
    if args.profile:
        result["simulated"] = {key: simulate_trace(args.profile, cluster_config(args.decode_kv_tokens, prompt[1], enabled),
                                                   trace, args.ttft_slo, args.tpot_slo, args.sim_seeds)
                               for key, enabled in (("without", False), ("with", True))}
    result["sim_seeds"] = args.sim_seeds
    result["profile"] = args.profile
    record(result, args.out, write_skewed_md)
    plot_skewed(result, args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
