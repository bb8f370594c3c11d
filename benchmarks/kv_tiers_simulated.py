"""KV tiers at GPU scale, simulated: Mooncake's conversation trace, the whole hour, on Llama-3.1-8B over H100s.

The trace (FAST'25 release, ``FAST25-release/traces/conversation_trace.jsonl`` in github.com/kvcache-ai/Mooncake:
12,031 requests of Kimi's production conversations, each listing the hashes of its prompt's 512-token blocks)
runs unchanged in time and length through the simulator (``planner/simulator.py``) with the analytical H100
profile: each hash becomes 512 token ids, the same wherever it recurs, so the simulated instances' real prefix
caches (and the router's tier-aware choices, ``controller/kv_index.py``) find exactly the reuse the trace has.

Systems, each over a grid of disaggregated shapes (prefill + decode instances of one GPU each):

* **no tiers**: prefix caching in each instance's pool only;
* **host tier**: ``--host-gb`` of host memory below each instance's pool, loaded back at ``--host-gb-per-s``;
* **cluster store**: one store of ``--store-tb`` shared by every instance (Mooncake Store's role), loaded at
  ``--store-gb-per-s``.

Per system and shape: attainment of ``--ttft-ms`` / ``--tpot-ms``, the prompt tokens found cached, and goodput
per GPU-hour (requests meeting both SLOs per GPU-hour held); per system the fewest GPUs meeting
``--attainment``. Beside them, an LRU cache of the trace's blocks, cluster-wide, at a range of sizes: the
hit rate each finds against an unbounded one's, and the smallest that finds 90 % of it.

    python benchmarks/kv_tiers_simulated.py --trace PATH/conversation_trace.jsonl

Writes ``<out>.json``, ``<out>.md`` and ``<out>.png`` (default ``benchmarks/results/kv_tiers_simulated``).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shlex
import sys
import time
from collections import OrderedDict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._record import record, write_lines  # noqa: E402
from benchmarks._slo_plots import _pyplot  # noqa: E402
from controller.kv_index import PrefixRouting  # noqa: E402
from decode_worker.config import SpeculationConfig  # noqa: E402
from planner.analytical import analytical_profile  # noqa: E402
from planner.sim_instances import SimRequest  # noqa: E402
from planner.sim_tiers import SimTierConfig  # noqa: E402
from planner.simulator import PoolPlan, SimConfig, Simulation  # noqa: E402
from planner.slo import attainment  # noqa: E402

TRACE_BLOCK = 512  # tokens per hash in Mooncake's traces
SYSTEMS = ("no tiers", "host tier", "cluster store")
LRU_SIZES_M = (0.45, 1, 2, 4, 8, 16, 32, 64)  # cluster-wide LRU sizes, millions of tokens


class HashedTokens:
    """The first ``length`` token ids of the blocks ``hash_ids`` (block ``h``: ids ``h * 512 + 1`` to
    ``h * 512 + 512``, the same wherever ``h`` recurs), made only when read."""

    def __init__(self, hash_ids: list[int], length: int):
        self.hash_ids = hash_ids
        self.length = length

    def __len__(self) -> int:
        return self.length

    def _id(self, i: int) -> int:
        return self.hash_ids[i // TRACE_BLOCK] * TRACE_BLOCK + i % TRACE_BLOCK + 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._id(i) for i in range(self.length)[index]]
        return self._id(range(self.length)[index])

    def __iter__(self):
        left = self.length
        for h in self.hash_ids:
            n = min(TRACE_BLOCK, left)
            yield from range(h * TRACE_BLOCK + 1, h * TRACE_BLOCK + 1 + n)
            left -= n
            if not left:
                return


def load_trace(path: str, limit: int | None = None) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            rows.append({"arrival_s": r["timestamp"] / 1000.0, "input_length": r["input_length"],
                         "output_length": max(1, r["output_length"]), "hash_ids": r["hash_ids"]})
            if limit is not None and len(rows) >= limit:
                break
    t0 = rows[0]["arrival_s"]
    for r in rows:
        r["arrival_s"] -= t0
    return rows


def sim_requests(rows: list[dict]) -> list[SimRequest]:
    """The trace as simulated requests with their token ids (outputs: ids no prompt uses)."""
    fresh = (max(h for r in rows for h in r["hash_ids"]) + 1) * TRACE_BLOCK + 1
    out = []
    for i, r in enumerate(rows):
        n = min(r["input_length"], len(r["hash_ids"]) * TRACE_BLOCK)
        out.append(SimRequest(i, r["arrival_s"], n, r["output_length"], prompt_ids=HashedTokens(r["hash_ids"], n),
                              output_ids=range(fresh, fresh + r["output_length"])))
        fresh += r["output_length"]
    return out


def lru_hit_rates(rows: list[dict], sizes_tokens: list[int]) -> tuple[float, list[float]]:
    """Prompt tokens found by an unbounded cache of every earlier prompt's full 512-token blocks (the leading
    run of a prompt's blocks it holds, never the last token), and by an LRU cache of each size."""
    def run(capacity: int | None) -> float:
        held: OrderedDict[int, None] = OrderedDict()
        blocks = None if capacity is None else capacity // TRACE_BLOCK
        found = total = 0
        for r in rows:
            full = r["hash_ids"][:r["input_length"] // TRACE_BLOCK]
            hit = 0
            for h in full:
                if h not in held or (hit + 1) * TRACE_BLOCK > r["input_length"] - 1:
                    break
                hit += 1
            found += hit * TRACE_BLOCK
            total += r["input_length"]
            for h in full:
                held[h] = None
                held.move_to_end(h)
            while blocks is not None and len(held) > blocks:
                held.popitem(last=False)
        return found / total

    return run(None), [run(c) for c in sizes_tokens]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        try:
            p, d = (int(x) for x in part.split("+"))
        except ValueError:
            raise SystemExit(f"--shapes: {part!r}: expected PREFILL+DECODE, e.g. 2+1") from None
        if p < 1 or d < 1:
            raise SystemExit(f"--shapes: {part!r}: each pool needs at least 1 instance")
        shapes.append((p, d))
    return shapes


def sim_config(profile, system: str, prefill: int, decode: int, args) -> SimConfig:
    costs = profile.costs(1, 1)
    kv = profile.kv_bytes_per_token
    tiers = None
    layered = not args.loads_at_once
    if system == "host tier":
        tiers = SimTierConfig(int(args.host_gb * 1e9 // kv), args.host_gb_per_s, kv, layered=layered)
    elif system == "cluster store":
        tiers = SimTierConfig(int(args.store_tb * 1e12 // kv), args.store_gb_per_s, kv, shared=True, layered=layered)
    return SimConfig(prefill=PoolPlan(prefill, 1, costs.prefill_kv_capacity_tokens, args.token_budget, 256),
                     decode=PoolPlan(decode, 1, costs.kv_capacity_tokens, 1, 256),
                     speculation=SpeculationConfig(drafter="none"), max_concurrent=1_000_000,
                     block_size=args.block_size, prefix_caching=PrefixRouting(), tiers=tiers)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))] if values else math.nan


def run_one(profile, system: str, shape: tuple[int, int], rows: list[dict], args) -> dict:
    """One simulation of the whole trace: attainment, TTFT, what the caches found, goodput per GPU-hour."""
    t0 = time.perf_counter()
    sim = Simulation(profile, sim_config(profile, system, *shape, args))
    result = sim.run(sim_requests(rows), time_limit_s=args.time_limit_s)
    records = result.records
    both = attainment([r.outcome() for r in records], args.ttft_ms / 1e3, args.tpot_ms / 1e3).both
    caches = [i.prefix_cache for i in sim.prefill + sim.decode if i.prefix_cache is not None]
    prefill_caches = [i.prefix_cache for i in sim.prefill if i.prefix_cache is not None]
    prompt_tokens = sum(r.prompt_tokens for r in records)
    gpu_hours = result.device_seconds / 3600
    ttft = [r.ttft_s for r in records if r.finished]
    out = {"system": system, "prefill": shape[0], "decode": shape[1], "gpus": sum(shape), "attainment": both,
           "finished": sum(1 for r in records if r.finished), "requests": len(records),
           "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
           # prompt tokens the prefill pool did not compute (its pool or tiers), and loaded from tiers
           "prefill_found": sum(c.stats.hits for c in prefill_caches) / prompt_tokens,
           "tier_loaded": sum(c.stats.tier_hits for c in caches) / prompt_tokens,
           "gpu_hours": gpu_hours, "goodput_per_gpu_hour": both * len(records) / gpu_hours,
           "wall_s": time.perf_counter() - t0}
    print(f"{system:>13} {shape[0]}P+{shape[1]}D: attainment {both:.3f}, TTFT p50 {out['ttft_p50_s']:.2f} s "
          f"p99 {out['ttft_p99_s']:.2f} s, prefill found {out['prefill_found']:.3f}, "
          f"goodput/GPU-h {out['goodput_per_gpu_hour']:.0f} ({out['wall_s']:.0f} s)", flush=True)
    return out


def figure_args(argv: list[str]) -> list[str]:
    """``argv`` without the options that change how the figures are reached, not the figures (``--jobs``,
    ``--reuse``): the command a record names."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--jobs", "--reuse"):
            skip = True
        elif not a.startswith(("--jobs=", "--reuse=")):
            out.append(a)
    return out


def settings(profile, args) -> dict:
    """Everything besides the shape and the system that a simulation's figures depend on."""
    return {"block_size": args.block_size, "token_budget": args.token_budget, "host_gb": args.host_gb,
            "host_gb_per_s": args.host_gb_per_s, "store_tb": args.store_tb, "store_gb_per_s": args.store_gb_per_s,
            "ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms, "time_limit_s": args.time_limit_s,
            "layered_loads": not args.loads_at_once, "pool_tokens": {"prefill": profile.costs(1, 1).prefill_kv_capacity_tokens,
                            "decode": profile.costs(1, 1).kv_capacity_tokens}}


def reused_runs(path: str, want: dict, requests: int) -> dict:
    """The runs of an earlier record at ``path`` made with the same settings over the same requests, by (system,
    prefill, decode); none when anything differs."""
    with open(path, encoding="utf-8") as f:
        old = json.load(f)
    if old.get("settings") != want or old.get("trace", {}).get("requests") != requests:
        print(f"--reuse {path}: made with other settings; simulating every cell", flush=True)
        return {}
    return {(r["system"], r["prefill"], r["decode"]): r for r in old["runs"]}


def run(args) -> dict:
    profile = analytical_profile(args.gpu, args.model)
    rows = load_trace(args.trace, args.limit)
    shapes = parse_shapes(args.shapes)
    t0 = time.perf_counter()
    sizes = [int(m * 1e6) for m in LRU_SIZES_M]
    unbounded, lru = lru_hit_rates(rows, sizes)
    target = next((size for size, rate in zip(sizes, lru) if rate >= 0.9 * unbounded), None)
    print(f"LRU over the trace's blocks: unbounded {unbounded:.3f}; "
          + ", ".join(f"{m:g}M {r:.3f}" for m, r in zip(LRU_SIZES_M, lru)) + f" ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    cells = [(system, shape) for system in args.systems for shape in shapes]
    done = reused_runs(args.reuse, settings(profile, args), len(rows)) if args.reuse else {}
    todo = [(profile, system, shape, rows, args) for system, shape in cells if (system, *shape) not in done]
    if args.jobs > 1:
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            fresh = pool.starmap(run_one, todo)
    else:
        fresh = [run_one(*cell) for cell in todo]
    done.update({(r["system"], r["prefill"], r["decode"]): r for r in fresh})
    runs = [done[(system, *shape)] for system, shape in cells]
    best = {}
    for system in args.systems:
        meeting = [r for r in runs if r["system"] == system and r["attainment"] >= args.attainment]
        best[system] = min(meeting, key=lambda r: (r["gpus"], -r["goodput_per_gpu_hour"])) if meeting else None
    kv = profile.kv_bytes_per_token
    return {"command": " ".join(["python benchmarks/kv_tiers_simulated.py", shlex.join(figure_args(sys.argv[1:]))]).strip(),
            "profile": profile.hardware, "model": profile.model, "kv_bytes_per_token": kv,
            "trace": {"requests": len(rows), "prompt_tokens": sum(r["input_length"] for r in rows),
                      "duration_s": rows[-1]["arrival_s"]},
            "slo": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms, "attainment": args.attainment},
            "settings": settings(profile, args),
            "lru": {"unbounded": unbounded, "sizes_tokens": sizes, "hit_rates": lru,
                    "smallest_at_90pct_tokens": target,
                    "smallest_at_90pct_tb": None if target is None else target * kv / 1e12},
            "runs": runs, "best": best}


def write_markdown(result: dict, path: str) -> None:
    s, t, lru = result["settings"], result["trace"], result["lru"]
    slo = result["slo"]
    lines = ["# KV tiers at GPU scale (simulated)", "", f"`{result['command']}`", "",
             f"{result['model']} on {result['profile']}; every instance one GPU. Trace: Mooncake's conversation "
             f"trace, {t['requests']} requests over {t['duration_s'] / 60:.0f} minutes, {t['prompt_tokens'] / 1e6:.0f}M "
             f"prompt tokens, as recorded (no compression, no scaling). Pools: {s['pool_tokens']['prefill']:,} "
             f"tokens per prefill instance, {s['pool_tokens']['decode']:,} per decode instance (the profile's KV "
             f"capacity); blocks of {s['block_size']} tokens; no speculation. Host tier: {s['host_gb']:g} GB per "
             f"instance at {s['host_gb_per_s']:g} GB/s. Cluster store: {s['store_tb']:g} TB shared at "
             f"{s['store_gb_per_s']:g} GB/s. "
             + ("A prefill instance writes what it loads layer by layer beside its pass (`kv_tiers.layered_loads`, "
                "on on GPUs): a step pays only what its pass does not hide; a prompt a decode instance prefills "
                "itself loads beside its steps. " if s.get("layered_loads") else
                "A prefill instance loads before its pass (`--loads-at-once`). ")
             + f"SLOs: TTFT {slo['ttft_ms']:g} ms, TPOT {slo['tpot_ms']:g} ms, "
             f"target {slo['attainment']:.0%} of requests.", "",
             "| system | shape | attainment | TTFT p50 (s) | TTFT p99 (s) | prompt found by prefill | loaded from tiers, both pools "
             "| GPU-hours | goodput per GPU-hour | vs no tiers, same shape |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    plain = {(r["prefill"], r["decode"]): r for r in result["runs"] if r["system"] == "no tiers"}
    for r in result["runs"]:
        base = plain.get((r["prefill"], r["decode"]))
        vs = f"{r['goodput_per_gpu_hour'] / base['goodput_per_gpu_hour']:.2f}x" if base else "-"
        lines.append(f"| {r['system']} | {r['prefill']} P + {r['decode']} D | {r['attainment']:.2%} | "
                     f"{r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['prefill_found']:.1%} | "
                     f"{r['tier_loaded']:.1%} | {r['gpu_hours']:.2f} | {r['goodput_per_gpu_hour']:.0f} | {vs} |")
    lines += ["", "Goodput per GPU-hour: requests meeting both SLOs per GPU-hour held (every instance holds its GPU "
              "from the start to the end of the run). Prompt found by prefill: prompt tokens the prefill pool's "
              "instances did not compute (their pools' hits and their tier loads), of all prompt tokens; loaded from tiers, "
              "both pools: prompt tokens the prefill and decode instances loaded from their tiers (a decode instance "
              "loads what it can instead of receiving it), of all prompt tokens."]
    lines += ["", "Fewest GPUs meeting the target, per system:", ""]
    base = result["best"].get("no tiers")
    for system, b in result["best"].items():
        if b is None:
            lines.append(f"- {system}: no shape of the grid meets it")
            continue
        vs = f", {b['goodput_per_gpu_hour'] / base['goodput_per_gpu_hour']:.2f}x no tiers' goodput per GPU-hour"             if base else ""
        lines.append(f"- {system}: {b['prefill']} P + {b['decode']} D ({b['gpus']} GPUs), "
                     f"{b['goodput_per_gpu_hour']:.0f} good requests per GPU-hour{vs}")
    kv = result["kv_bytes_per_token"]
    lines += ["", f"Cluster-wide LRU cache of the trace's 512-token blocks (prompt tokens found; unbounded: "
              f"{lru['unbounded']:.1%}):", "", "| size (tokens) | size (TB of KV) | found | of unbounded |",
              "|---:|---:|---:|---:|"]
    for size, rate in zip(lru["sizes_tokens"], lru["hit_rates"]):
        lines.append(f"| {size / 1e6:g}M | {size * kv / 1e12:.2f} | {rate:.1%} | {rate / lru['unbounded']:.2f} |")
    target = lru["smallest_at_90pct_tokens"]
    lines += ["", "Smallest cache finding 90 % of what an unbounded one finds: " +
              ("none of these sizes" if target is None else
               f"{target / 1e6:g}M tokens ({lru['smallest_at_90pct_tb']:.1f} TB of KV)") + ".", "",
              "![goodput per GPU-hour by shape](kv_tiers_simulated.png)"]
    write_lines(path, lines)


def plot(result: dict, path: str) -> None:
    plt = _pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for system in result["best"]:
        runs = [r for r in result["runs"] if r["system"] == system]
        ax.plot([f"{r['prefill']}P+{r['decode']}D" for r in runs], [r["goodput_per_gpu_hour"] for r in runs],
                marker="o", label=system)
    ax.set_ylabel("good requests per GPU-hour")
    ax.set_title(f"goodput per GPU-hour (SLO {result['slo']['ttft_ms']:g} ms / {result['slo']['tpot_ms']:g} ms)")
    ax.legend()
    lru = result["lru"]
    bx.semilogx([s / 1e6 for s in lru["sizes_tokens"]], [r * 100 for r in lru["hit_rates"]], marker="o",
                label="LRU, cluster-wide")
    bx.axhline(lru["unbounded"] * 100, color="gray", linestyle="--", label="unbounded")
    bx.axhline(lru["unbounded"] * 90, color="gray", linestyle=":", label="90 % of unbounded")
    bx.set_xlabel("cache size (M tokens)")
    bx.set_ylabel("prompt tokens found (%)")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="Mooncake's conversation_trace.jsonl")
    ap.add_argument("--limit", type=int, default=None, help="only the first N requests (a quick look)")
    ap.add_argument("--gpu", default="H100-80GB-SXM")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--shapes", default="3+2,4+2,5+2,4+3,5+3,6+3",
                    help="prefill+decode instance counts to simulate, comma-separated")
    ap.add_argument("--ttft-ms", type=float, default=2000.0)
    ap.add_argument("--tpot-ms", type=float, default=50.0)
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=8192, help="prefill tokens per step")
    ap.add_argument("--host-gb", type=float, default=200.0, help="host tier per instance")
    ap.add_argument("--host-gb-per-s", type=float, default=25.0, help="host tier load bandwidth (PCIe)")
    ap.add_argument("--store-tb", type=float, default=8.0, help="the cluster store's capacity")
    ap.add_argument("--store-gb-per-s", type=float, default=12.5, help="store load bandwidth (RDMA)")
    ap.add_argument("--loads-at-once", action="store_true",
                    help="prefill instances load from the tiers before their pass (kv_tiers.layered_loads: false)")
    ap.add_argument("--time-limit-s", type=float, default=600.0,
                    help="requests unfinished this long after the last arrival count as missed")
    ap.add_argument("--jobs", type=int, default=1, help="simulations run at once (processes)")
    ap.add_argument("--reuse", default=None, help="an earlier record's JSON: its cells simulated with the same "
                    "settings are taken from it instead of simulated again")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "kv_tiers_simulated"))
    args = ap.parse_args()
    result = run(args)
    record(result, args.out, write_markdown)
    plot(result, args.out + ".png")


if __name__ == "__main__":
    main()
