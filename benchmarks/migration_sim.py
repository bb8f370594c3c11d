"""The ``simulated`` part of ``benchmarks/migration.py``: the global rescheduling policy at a scale this
machine cannot run, in the planner's simulator (``planner/sim_migration.py`` runs the real
policy, ``controller/migration_policy.py``).

A Llama-3.1-8B-shaped model on H100-80GB-SXM instances (the analytical profile of
``planner/analytical.py``, no speculation so every difference comes from placement), a skewed
long-output Poisson trace (a quarter of the requests generate 1K-4K tokens, the rest 32-128, their lengths
unknown at placement), over a grid of decode instances, KV tokens per instance (small enough that long
requests crowd an instance) and arrival rates; each point run with the policy off and on over the same
traces, medians over seeds of the P99 TPOT ratio (without / with migration).
"""

from __future__ import annotations

import itertools
import os
import random
import statistics

GPU, MODEL_SHAPE = "H100-80GB-SXM", "llama-3.1-8b"
PROMPT, SHORT_OUT, LONG_OUT, LONG_SHARE = (256, 2048), (32, 128), (1024, 4096), 0.25


def _trace(num: int, rate: float, seed: int):
    from planner.workload import RequestSpec

    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate)
        n_out = rng.randint(*LONG_OUT) if rng.random() < LONG_SHARE else rng.randint(*SHORT_OUT)
        out.append(RequestSpec(t, rng.randint(*PROMPT), n_out))
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def _one(profile, instances: int, kv_tokens: int, rate: float, migration: bool, num: int, seed: int) -> dict:
    from planner.sim_migration import SimMigration
    from planner.simulator import PoolPlan, SimConfig, simulate
    from decode_worker.config import SpeculationConfig

    cfg = SimConfig(prefill=PoolPlan(instances=max(1, instances // 4), kv_cache_tokens=262144, token_budget=4096),
                    decode=PoolPlan(instances=instances, kv_cache_tokens=kv_tokens, max_num_seqs=128),
                    speculation=SpeculationConfig(drafter="none"), max_concurrent=1 << 20,
                    migration=SimMigration() if migration else None)
    res = simulate(profile, cfg, _trace(num, rate, seed), seed=seed)
    tpot = [r.tpot_s for r in res.records if r.completion_tokens > 1]
    return {"tpot_p50_ms": 1e3 * _pct(tpot, 50), "tpot_p99_ms": 1e3 * _pct(tpot, 99),
            "preemptions": sum(r.preemptions for r in res.records),
            "migrations": res.migrations.committed if res.migrations else 0}


def run_simulated(instances: list[int], kv_tokens: list[int], rates_per_instance: list[float], num: int,
                  seeds: int) -> list[dict]:
    """One row per grid point: medians over ``seeds`` traces with the policy off and on."""
    from tqdm import tqdm

    from planner.analytical import AnalyticalOptions, analytical_profile

    profile = analytical_profile(GPU, MODEL_SHAPE, AnalyticalOptions(tensor_parallel=(1,)))
    grid = list(itertools.product(instances, kv_tokens, rates_per_instance))
    rows = []
    for n, kv, per in tqdm(grid, desc="simulated grid", unit="point"):
        runs = [(_one(profile, n, kv, per * n, False, num, s), _one(profile, n, kv, per * n, True, num, s))
                for s in range(seeds)]
        row = {"instances": n, "kv_tokens": kv, "rate_per_instance": per}
        for key, idx in (("without", 0), ("with", 1)):
            row[key] = {k: statistics.median(r[idx][k] for r in runs) for k in runs[0][idx]}
        row["p99_ratio"] = statistics.median(a["tpot_p99_ms"] / b["tpot_p99_ms"] for a, b in runs)
        rows.append(row)
    return rows


def write_simulated_md(result: dict, path: str) -> None:
    from benchmarks._record import write_lines

    rows = result["rows"]
    best = max(rows, key=lambda r: r["p99_ratio"])
    lines = [
        "# Live migration at scale, simulated: P99 TPOT with and without the rescheduling policy",
        "",
        f"Command: `{result['command']}`",
        "",
        f"The planner's simulator with the real policy (`planner/sim_migration.py`), a {MODEL_SHAPE}-shaped "
        f"model on {GPU} decode instances (analytical profile, no speculation). Trace: {result['num_requests']} Poisson "
        f"arrivals, prompts of {PROMPT[0]}-{PROMPT[1]} tokens, {LONG_SHARE:.0%} of requests generating "
        f"{LONG_OUT[0]}-{LONG_OUT[1]} tokens and the rest {SHORT_OUT[0]}-{SHORT_OUT[1]}; each point with the policy "
        f"off and on over the same {result['seeds']} traces (medians; default thresholds).",
        "",
        "| decode instances | KV tokens each | req/s per instance | P99 TPOT without (ms) | P99 TPOT with (ms) "
        "| ratio | preemptions without | with | migrations |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        a, b = r["without"], r["with"]
        lines.append(f"| {r['instances']} | {r['kv_tokens']} | {r['rate_per_instance']:g} | {a['tpot_p99_ms']:.1f} | "
                     f"{b['tpot_p99_ms']:.1f} | {r['p99_ratio']:.2f}x | {a['preemptions']:g} | {b['preemptions']:g} | "
                     f"{b['migrations']:g} |")
    lines += ["", f"Best point: {best['instances']} instances, {best['kv_tokens']} KV tokens, "
              f"{best['rate_per_instance']:g} req/s per instance: **{best['p99_ratio']:.2f}x** "
              f"(target: at least {result['target']:g}x)."]
    lines += ["", "![ratio](" + os.path.basename(path[:-3]) + ".png)"]
    write_lines(path, lines)


def plot_simulated(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    keys = sorted({(r["instances"], r["kv_tokens"]) for r in result["rows"]})
    for i, (n, kv) in enumerate(keys):
        pts = sorted((r["rate_per_instance"], r["p99_ratio"]) for r in result["rows"]
                     if (r["instances"], r["kv_tokens"]) == (n, kv))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{n} instances, {kv // 1024}K KV each")
    ax.axhline(result["target"], color="grey", linestyle="--", linewidth=1, label="target")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("arrival rate per decode instance (req/s)")
    ax.set_ylabel("P99 TPOT without / with migration")
    ax.set_title("Rescheduling policy, simulated (H100, Llama-3.1-8B shape)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
