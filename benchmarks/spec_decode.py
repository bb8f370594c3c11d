"""MagicDec's table on the bundled model: speculative vs autoregressive decoding on one decode worker.

For each batch x prefix cell the prompts (held-out standard-library source, never trained on) are
prefilled once; every configuration then decodes from the same state (``planner.replay.rewind``):
k = 0 (autoregressive), fixed k = 1..5 for each draft budget, and the adaptive policy, in interleaved rounds. Reported per
configuration: throughput, per-token latency, acceptance rate, mean accepted length, draft/target and
verify/target time ratios, and the speedup over k = 0 on the same worker and prompts.

    python benchmarks/spec_decode.py                  # full grid -> benchmarks/results/spec_decode.*
    python benchmarks/spec_decode.py --batches 4 --prefixes 1024 --ks 0 2 --budgets 256 --steps 8
    python benchmarks/spec_decode.py --device cuda --attention-backend torch --out runs/gpu/spec_decode
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from controller.defaults import DEFAULT_MODEL_DIR  # noqa: E402
from decode_worker.config import DecodeWorkerConfig, SpeculationConfig  # noqa: E402
from planner.replay import rewind  # noqa: E402
from decode_worker.worker import DecodeWorker  # noqa: E402
from modeling.sampling import SamplingParams  # noqa: E402
from modeling.tokenizer import TextTokenizer  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SINK_TOKENS = 16


def heldout_tokens(tokenizer: TextTokenizer, need: int) -> list[int]:
    """Token ids of held-out corpus files (the default model never trained on them), concatenated."""
    from scripts._corpus import EOS_TOKEN, load_documents, split_documents
    from scripts.train_default_model import TrainConfig

    _, heldout = split_documents(load_documents(), TrainConfig().holdout_permille)
    ids: list[int] = []
    for doc in heldout:
        ids.extend(tokenizer.encode(doc.text + EOS_TOKEN))
        if len(ids) >= need:
            break
    return ids


def make_prompts(corpus: list[int], batch: int, prefix: int) -> list[list[int]]:
    """``batch`` windows of ``prefix`` tokens spread evenly over the corpus (overlapping if short)."""
    stride = max(1, (len(corpus) - prefix) // max(1, batch))
    return [corpus[i * stride : i * stride + prefix] for i in range(batch)]


def decode_run(worker: DecodeWorker, ids: list[str], start_len: int, steps: int, k: int | None) -> dict:
    """Rewind every sequence to ``start_len`` tokens, run ``steps`` decode steps, measure."""
    for rid in ids:
        rewind(worker, rid, start_len)
    m0 = dict(draft=worker.metrics.draft_tokens, acc=worker.metrics.accepted_tokens,
              seq_steps=worker.metrics.seq_spec_steps, dt=worker.metrics.draft_time_s, vt=worker.metrics.verify_time_s)
    tokens, ks = 0, []
    t0 = time.perf_counter()
    for _ in range(steps):
        before = worker.metrics.k_counts.copy()
        deltas = worker.step(k)
        tokens += sum(len(d.token_ids) for d in deltas)
        ks.extend(kk for kk, c in worker.metrics.k_counts.items() if c != before.get(kk, 0))
    elapsed = time.perf_counter() - t0
    m = worker.metrics
    draft, acc = m.draft_tokens - m0["draft"], m.accepted_tokens - m0["acc"]
    seq_steps = m.seq_spec_steps - m0["seq_steps"]
    return {
        "tokens_per_s": tokens / elapsed, "step_ms": 1e3 * elapsed / steps, "tokens": tokens,
        "acceptance_rate": acc / draft if draft else 0.0,
        "mean_accepted_length": acc / seq_steps if seq_steps else 0.0,
        "draft_time_s": m.draft_time_s - m0["dt"], "verify_time_s": m.verify_time_s - m0["vt"],
        "elapsed_s": elapsed, "mean_k": statistics.mean(ks) if ks else 0.0,
    }


Config = tuple[str, "int | None", "int | None"]  # (policy, k, budget); k None = adaptive


def cell_configs(args) -> list[Config]:
    """Every configuration of a cell, autoregressive first."""
    configs: list[Config] = [("autoregressive", 0, None)]
    for budget in args.budgets:
        configs += [("fixed", k, budget) for k in args.ks if k > 0] + [("adaptive", None, budget)]
    return configs


def speculation_of(config: Config, args) -> SpeculationConfig:
    policy, k, budget = config
    return SpeculationConfig(drafter="self_sparse", budget=budget or args.budgets[0], sink_tokens=SINK_TOKENS,
                             k_policy="adaptive" if policy == "adaptive" else "fixed", k=k or 0, max_k=max(args.ks))


def run_cell(worker: DecodeWorker, prompts, args) -> list[dict]:
    """All configurations for one batch x prefix cell, in interleaved rounds.

    Each round runs every configuration once, in turn, so a slow spell of the machine hits all of them
    alike; each configuration reports its median round. Before the rounds, the adaptive policy decodes
    ``--adaptive-warmup`` steps per budget on this cell, as a serving worker's policy would have (its cost
    models, step-time correction and acceptance estimate are warm)."""
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    ids = [f"p{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        worker.add_local(rid, p, params)
    start_len = len(prompts[0]) + 1
    batch = len(prompts)
    configs = cell_configs(args)
    # short steps (small batch and context) get more of them, so that a run lasts --min-run-ms: a
    # 16-step run of 4 ms steps is at the mercy of the scheduler
    probe = decode_run(worker, ids, start_len, args.steps, 0)
    steps = min(8 * args.steps, max(args.steps, math.ceil(args.min_run_ms / probe["step_ms"])))
    for config in configs:
        if config[0] == "adaptive" and args.adaptive_warmup > 0:
            worker.set_speculation(speculation_of(config, args))
            decode_run(worker, ids, start_len, max(args.adaptive_warmup, steps), None)
    runs: dict[Config, list[dict]] = {c: [] for c in configs}
    for _ in range(args.repeats):
        for config in configs:
            worker.set_speculation(speculation_of(config, args))
            runs[config].append(decode_run(worker, ids, start_len, steps, config[1]))
    medians = {c: sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2] for c, rs in runs.items()}
    ar = medians[configs[0]]
    ar_step = ar["step_ms"] / 1e3
    rows = []
    for (policy, k, budget), r in medians.items():
        row = {"batch": batch, "prefix": len(prompts[0]), "budget": budget, "policy": policy, "k": k,
               "steps": steps, **r, "speedup": r["tokens_per_s"] / ar["tokens_per_s"],
               "rounds_tokens_per_s": [x["tokens_per_s"] for x in runs[(policy, k, budget)]]}
        if k:
            # per pass: draft step vs plain target step; verify pass vs plain target step
            row["draft_over_target"] = r["draft_time_s"] / (steps * k) / ar_step
            row["verify_over_target"] = r["verify_time_s"] / steps / ar_step
            row["draft_over_target_bound"] = draft_bound(worker, batch, len(prompts[0]), budget)
        rows.append(row)
    for rid in ids:
        worker.abort(rid)
    return rows


def draft_bound(worker: DecodeWorker, batch: int, prefix: int, budget: int) -> float:
    """The least a draft pass can cost relative to a target pass when both read their bytes at the same rate:
    (weights + the sparse view's KV) / (weights + the whole KV), per step of ``batch`` sequences. The
    self-sparse draft reads every weight the target reads; only its KV is smaller."""
    weights = sum(p.numel() * p.element_size() for p in worker.runner.model.parameters())
    per_token = worker.cache.spec.bytes_per_token
    view = min(prefix, SINK_TOKENS + budget)
    return (weights + batch * view * per_token) / (weights + batch * prefix * per_token)


def rope_measurement(worker: DecodeWorker, prompts, steps: int) -> dict:
    """Acceptance with original vs re-indexed draft query positions (same cell, k = 3, budget 256)."""
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    ids = [f"rope{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        worker.add_local(rid, p, params)
    out = {}
    for mode in ("original", "reindexed"):
        worker.set_speculation(SpeculationConfig(drafter="self_sparse", budget=256, sink_tokens=SINK_TOKENS,
                                                 k_policy="fixed", k=3, draft_positions=mode))
        out[mode] = decode_run(worker, ids, len(prompts[0]) + 1, steps, 3)["acceptance_rate"]
    for rid in ids:
        worker.abort(rid)
    return out


def adaptive_summary(rows: list[dict]) -> dict:
    """The adaptive policy against the best fixed k (or plain decoding, when that is faster) per
    prefix x batch x budget cell, and the timing noise of this run: the spread of a configuration's
    rounds, |round / median - 1|, over every round of every configuration.

    The best of six configurations is biased upwards by that noise (the largest of six noisy medians),
    while the adaptive row is one median: a cell is reported as a miss only beyond 5 %, but a miss
    smaller than the noise says little."""
    by_cell: dict[tuple, list[dict]] = {}
    ar: dict[tuple, dict] = {}
    deviations = []
    for r in rows:
        for x in r.get("rounds_tokens_per_s", []):
            deviations.append(abs(x / r["tokens_per_s"] - 1.0))
        if r["policy"] == "autoregressive":
            ar[(r["prefix"], r["batch"])] = r
        else:
            by_cell.setdefault((r["prefix"], r["batch"], r["budget"]), []).append(r)
    cells = []
    for (prefix, batch, budget), rs in sorted(by_cell.items()):
        adaptive = [r for r in rs if r["policy"] == "adaptive"]
        fixed = [r for r in rs if r["policy"] == "fixed"]
        if not adaptive or not fixed:
            continue
        best_fixed = max(fixed, key=lambda r: r["tokens_per_s"])
        best = max(best_fixed, ar[(prefix, batch)], key=lambda r: r["tokens_per_s"])
        cells.append({"prefix": prefix, "batch": batch, "budget": budget, "best_k": best["k"],
                      "adaptive_over_best": adaptive[0]["tokens_per_s"] / best["tokens_per_s"],
                      "adaptive_over_best_fixed": adaptive[0]["tokens_per_s"] / best_fixed["tokens_per_s"],
                      "adaptive_speedup": adaptive[0]["speedup"], "adaptive_mean_k": adaptive[0]["mean_k"]})
    deviations.sort()
    return {
        "cells": cells,
        "within_5pct": sum(c["adaptive_over_best"] >= 0.95 for c in cells),
        "within_5pct_of_best_fixed": sum(c["adaptive_over_best_fixed"] >= 0.95 for c in cells),
        "below_095_autoregressive": sum(c["adaptive_speedup"] < 0.95 for c in cells),
        "round_spread_median": deviations[len(deviations) // 2] if deviations else float("nan"),
        "round_spread_p90": deviations[int(0.9 * (len(deviations) - 1))] if deviations else float("nan"),
    }


def write_outputs(rows: list[dict], meta: dict, rope: dict | None, out: str) -> None:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    summary = adaptive_summary(rows)
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "rope_positions": rope, "adaptive": summary}, f, indent=2)
    with open(out + ".md", "w") as f:
        f.write(f"# Speculative decoding on the bundled model\n\n`{meta['command']}`  \n"
                f"{meta['model']} ({meta['dtype']}), {meta['threads']} threads on {meta['machine']}; "
                f"{meta['steps']} decode steps per run (more where {meta.get('min_run_ms', 0):.0f} ms needs more), median of {meta['repeats']} interleaved rounds "
                f"(adaptive warmed up {meta.get('adaptive_warmup', 0)} steps per cell); greedy; "
                f"sink {SINK_TOKENS} tokens.\n\n"
                "draft/target: a draft pass's time over a plain target pass's; bound: the same ratio of the bytes each "
                "reads (weights + KV), the least it can be.\n\n"
                "| batch | prefix | budget | policy | k | tok/s | ms/token | accept | mean acc. len | draft/target | bound | verify/target | speedup |\n"
                "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in rows:
            per_tok = r["step_ms"] / max(1e-9, r["tokens"] / (r["batch"] * r.get("steps", meta["steps"])))
            f.write(f"| {r['batch']} | {r['prefix']} | {r['budget'] or '-'} | {r['policy']} | "
                    f"{r['k'] if r['k'] is not None else 'auto %.1f' % r['mean_k']} | {r['tokens_per_s']:.1f} | "
                    f"{per_tok:.2f} | {r['acceptance_rate']:.2f} | {r['mean_accepted_length']:.2f} | "
                    f"{r.get('draft_over_target', float('nan')):.3f} | {r.get('draft_over_target_bound', float('nan')):.3f} | "
                    f"{r.get('verify_over_target', float('nan')):.2f} | "
                    f"{r['speedup']:.2f} |\n")
        if summary["cells"]:
            f.write(f"\nAdaptive policy against the best fixed k (or plain decoding where faster), per prefix x batch "
                    f"x budget: within 5 % in {summary['within_5pct']} of {len(summary['cells'])} cells (of the best fixed k alone: "
                    f"{summary['within_5pct_of_best_fixed']}); below 0.95x "
                    f"autoregressive in {summary['below_095_autoregressive']}. Timing noise of this run: a round "
                    f"differs from its configuration's median by {100 * summary['round_spread_median']:.1f} % "
                    f"(median; 90th percentile {100 * summary['round_spread_p90']:.1f} %).\n\n"
                    "| prefix | batch | budget | best k | adaptive / best | adaptive speedup | adaptive mean k |\n"
                    "|---:|---:|---:|---:|---:|---:|---:|\n")
            for c in summary["cells"]:
                mark = "" if c["adaptive_over_best"] >= 0.95 else " (miss)"
                f.write(f"| {c['prefix']} | {c['batch']} | {c['budget']} | {c['best_k']} | "
                        f"{c['adaptive_over_best']:.3f}{mark} | {c['adaptive_speedup']:.2f} | {c['adaptive_mean_k']:.1f} |\n")
        if rope:
            f.write(f"\nDraft RoPE positions (batch {rope['batch']}, prefix {rope['prefix']}, k 3, budget 256): "
                    f"acceptance {rope['original']:.2f} with original positions vs {rope['reindexed']:.2f} re-indexed.\n")


def plot(rows: list[dict], out: str, where: str = "CPU") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    prefixes = sorted({r["prefix"] for r in rows})
    for prefix in prefixes:
        cells = sorted({r["batch"] for r in rows if r["prefix"] == prefix})
        best = [max(r["speedup"] for r in rows if r["prefix"] == prefix and r["batch"] == b) for b in cells]
        adaptive = [max((r["speedup"] for r in rows if r["prefix"] == prefix and r["batch"] == b and r["policy"] == "adaptive"), default=float("nan")) for b in cells]
        line, = ax.plot(cells, best, marker="o", label=f"prefix {prefix}: best fixed k")
        ax.plot(cells, adaptive, marker="x", linestyle="--", color=line.get_color(), label=f"prefix {prefix}: adaptive")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over autoregressive decoding")
    ax.set_title(f"Self-speculation with a sparse-KV draft (bundled model, {where})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--min-run-ms", type=float, default=250.0,
                    help="cells with short steps run more steps per run (up to 8x --steps) to last this long")
    # a policy decision lasts CHOICE_REUSE_STEPS (4, decode_worker/policy.py) steps, and a new cell first tries each
    # k whose cost it has not measured there (up to max_k decisions): 64 steps cover that
    ap.add_argument("--adaptive-warmup", type=int, default=64,
                    help="steps the adaptive policy decodes on a cell before it is measured")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument("--block-size", type=int, default=16, help="KV block size (flash-attn needs a multiple of 256)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "spec_decode"))
    ap.add_argument("--corpus-tokens", type=int, default=None,
                    help="held-out tokens to spread the prompts over (default: largest batch x largest prefix; "
                         "give the extended run's value with --extend)")
    ap.add_argument("--no-rope", action="store_true",
                    help="leave out the draft RoPE-position measurement (original vs re-indexed acceptance)")
    ap.add_argument("--extend", metavar="STEM",
                    help="add this run's cells to the rows of STEM.json (an earlier run; a cell measured again "
                         "replaces its earlier rows) and write them all to --out")
    args = ap.parse_args()
    if args.corpus_tokens is not None and args.corpus_tokens < max(args.prefixes):
        ap.error(f"--corpus-tokens: must be >= the largest prefix ({max(args.prefixes)}), got {args.corpus_tokens}")
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device: CUDA requested but no CUDA device is available")

    max_tokens = max(args.batches) * (max(args.prefixes) + 64 * (max(args.ks) + 1) * args.steps)
    # beyond the cells' own tokens, room for the start-up profile's synthetic passes (they take at most half
    # the free pool): up to 4096 tokens, fewer for a tiny run, whose profile then stays at tiny shapes
    worker = DecodeWorker(args.model, DecodeWorkerConfig(
        dtype=args.dtype, device=args.device, block_size=args.block_size,
        kv_cache_tokens=max_tokens + min(4096, max_tokens), max_num_seqs=max(args.batches) + 8,
        attention_backend=args.attention_backend, prefill_chunk=2048,
        speculation=SpeculationConfig(drafter="self_sparse", sink_tokens=SINK_TOKENS, k_policy="fixed", k=0)))
    # the prompts of a cell are spread over the corpus, so a cell re-run alone (--extend) must load as
    # many tokens as the run it extends: --corpus-tokens
    corpus = heldout_tokens(worker.tokenizer, args.corpus_tokens or max(args.batches) * max(args.prefixes))
    print(f"model {args.model}; backend {worker.runner.backend.name}; held-out corpus {len(corpus)} tokens")
    rows: list[dict] = []
    cells = [(b, p) for p in args.prefixes for b in args.batches]
    for batch, prefix in tqdm(cells, desc="cells"):
        cell_rows = run_cell(worker, make_prompts(corpus, batch, prefix), args)
        rows.extend(cell_rows)
        best = max(cell_rows, key=lambda r: r["speedup"])
        tqdm.write(f"batch {batch:>3} prefix {prefix:>6}: AR {cell_rows[0]['tokens_per_s']:.1f} tok/s, best "
                   f"{best['policy']} k={best['k']} budget={best['budget']} speedup {best['speedup']:.2f}")
    command = "python benchmarks/spec_decode.py " + " ".join(sys.argv[1:])
    if args.extend:
        with open(args.extend + ".json") as f:
            earlier = json.load(f)
        redone = {(r["batch"], r["prefix"]) for r in rows}  # cells measured again replace the earlier ones
        rows = [r for r in earlier["rows"] if (r["batch"], r["prefix"]) not in redone] + rows
        rows.sort(key=lambda r: (r["prefix"], r["batch"]))  # stable: a cell's own row order is kept
        rope = earlier["rope_positions"]
        command = earlier["meta"]["command"] + "` then `" + command
    elif args.no_rope:
        rope = None
    else:
        rope_cell = (min(4, max(args.batches)), min(4096, max(args.prefixes)))
        rope = rope_measurement(worker, make_prompts(corpus, *rope_cell), args.steps)
        rope.update(batch=rope_cell[0], prefix=rope_cell[1])
    on_cuda = worker.cache.device.type == "cuda"
    machine = torch.cuda.get_device_name(worker.cache.device) if on_cuda else f"{platform.machine()} {os.cpu_count()} cpus"
    meta = {"model": os.path.basename(os.path.normpath(args.model)), "dtype": args.dtype, "threads": args.threads,
            "machine": machine, "device": str(worker.cache.device), "block_size": args.block_size,
            "torch": torch.__version__,
            "backend": worker.runner.backend.name, "steps": args.steps, "repeats": args.repeats,
            "adaptive_warmup": args.adaptive_warmup, "min_run_ms": args.min_run_ms, "corpus_tokens": len(corpus),
            "command": command}
    write_outputs(rows, meta, rope, args.out)
    plot(rows, args.out, machine if on_cuda else "CPU")
    print(f"wrote {args.out}.json/.md/.png")


if __name__ == "__main__":
    main()
