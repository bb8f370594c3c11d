"""Tensor parallelism on this machine: TP 2 (two 1-thread rank processes over gloo) against TP 1 (one
process on 2 threads, and on 1 thread), and the time to move a prompt's KV between prefill TP p and
decode TP d.

1. Compute, bundled model (float32, random-content KV: cost depends on sizes, not values):
   * prefill of a 4K-token prompt in 512-token chunks (as ``cluster_configs/local.yaml`` serves it):
     tokens/s;
   * a decode step at batch 16 x 4K context: plain (one token per sequence) and speculative (k = 3 draft
     passes over the sink + window view, then one verification pass of k + 1 tokens);
   * a decode step of one sequence at a 128-token context (fixed costs and all-reduce latency);
   * the all-reduce share: time inside the model's all-reduces on rank 0 over the pass time.
2. KV move: a 4K and a 16K-token prompt's KV (bfloat16) from p prefill ranks to d decode ranks, each
   receiver rank getting exactly its heads from the sender rank holding them (``modeling/heads.py``),
   for p == d and p != d: begin to every leg's DONE (slowest sender), medians of repeats.

    python benchmarks/tp_scaling.py                      # -> benchmarks/results/tp_scaling.{json,md,png}
    python benchmarks/tp_scaling.py --repeats 2 --kv-sizes 4096
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from kv_transfer import KVFingerprint, KVReceiver, KVSender, PoolReserver, Rendezvous, TransferConfig  # noqa: E402
from kv_transfer.sender import leg_targets  # noqa: E402
from modeling.block_pool import BlockPool  # noqa: E402
from modeling.checkpoint import load_config  # noqa: E402
from modeling.heads import legs_from, legs_to, plan_transfer, rank_peer_id, shard_heads  # noqa: E402
from modeling.kv_cache import KVCacheSpec, PagedKVCache  # noqa: E402
from modeling.runner import StepInput  # noqa: E402
from modeling.tp import TPShard  # noqa: E402

RESULTS = os.path.join(_HERE, "results")
MODEL = os.path.join(os.path.dirname(_HERE), "models", "stdlib-llama-15m")
BLOCK = 16
SMALL_CONTEXT = 128


# -- processes ----------------------------------------------------------------------------------------

def _entry(target, name, kwargs, threads, results):
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    try:
        results.put((name, "ok", target(**kwargs)))
    except BaseException:  # noqa: BLE001 - report to the parent
        import traceback
        results.put((name, "error", traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(0)


def run_procs(specs: dict[str, tuple], timeout_s: float = 1800) -> dict:
    """name -> (target, kwargs, threads); returns name -> result (raises on any error)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, name, kw, th, results), daemon=True)
             for name, (fn, kw, th) in specs.items()]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in procs:
            name, status, value = results.get(timeout=timeout_s)
            if status != "ok":
                raise RuntimeError(f"{name} failed:\n{value}")
            out[name] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return out


# -- 1. compute ---------------------------------------------------------------------------------------

def _timed(fn, repeats: int, group) -> tuple[float, float]:
    """Median seconds of ``fn`` and the median share of it spent in all-reduces (rank 0)."""
    fn()  # warm-up
    times, shares = [], []
    for _ in range(repeats):
        if group is not None:
            group.collectives.reset()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(dt)
        shares.append(group.collectives.seconds / dt if group is not None else 0.0)
    return statistics.median(times), statistics.median(shares)


def compute_rank(rank: int, size: int, rdv, args) -> dict:
    """Rank 0 measures; other ranks follow its forwards."""
    from modeling.tp_group import TPGroup
    from modeling.tp_runner import TPFollower, build_runner, load_for_rank

    group = TPGroup.form(rdv.connect(), "bench", TPShard(rank, size), "cpu") if size > 1 else None
    loaded = load_for_rank(args.model, "float32", "cpu", group)
    ctx, batch, k = args.context, args.batch, args.k
    per_seq = -(-(ctx + k + 8) // BLOCK)
    runner = build_runner(loaded, batch * per_seq + 8, BLOCK, "auto", group)
    if rank:
        TPFollower(runner, group).serve()
        return {}
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    chunk = args.chunk

    def prefill():
        for start in range(0, ctx, chunk):
            n = min(chunk, ctx - start)
            runner.run([StepInput([7] * n, start, tables[0], num_logits=int(start + n == ctx))])

    def decode():
        runner.run([StepInput([7], ctx, t) for t in tables])

    def decode_small():  # one sequence, short context: the step is mostly fixed costs (and all-reduce latency)
        runner.run([StepInput([7], SMALL_CONTEXT, tables[0])])

    sink, window = 16, 240
    starts = [max(sink, ctx + 1 - window)] * batch

    def speculate():
        for j in range(k):
            runner.run([StepInput([7], ctx + j, t) for t in tables], sink_len=sink, window_starts=starts)
        runner.run([StepInput([7] * (k + 1), ctx, t, num_logits=k + 1) for t in tables])

    out = {}
    for name, fn in (("prefill", prefill), ("decode", decode), ("speculative", speculate),
                     ("decode_small", decode_small)):
        seconds, share = _timed(fn, args.repeats, group)
        out[name] = {"ms": 1e3 * seconds, "all_reduce_share": share}
    out["prefill"]["tokens_per_s"] = ctx / (out["prefill"]["ms"] / 1e3)
    if group is not None:
        runner.stop()
    return out


def measure_compute(args) -> dict:
    rows = {}
    for label, size, threads in (("tp1_2threads", 1, 2), ("tp1_1thread", 1, 1), ("tp2_1thread_each", 2, 1)):
        store, rdv = Rendezvous.host_store()
        specs = {f"r{r}": (compute_rank, dict(rank=r, size=size, rdv=rdv, args=args), threads) for r in range(size)}
        print(f"compute: {label} ...", flush=True)
        rows[label] = run_procs(specs)["r0"]
        del store
    return rows


# -- 2. KV move ---------------------------------------------------------------------------------------

def _shard_cache(config, heads, num_blocks) -> PagedKVCache:
    spec = KVCacheSpec(config.num_hidden_layers, heads.size, config.head_dim, BLOCK, torch.bfloat16)
    return PagedKVCache(spec, num_blocks, "cpu")


def kv_sender(rank, p, d, tokens, repeats, rdv, start_barrier, round_barrier, model) -> list[float]:
    config = load_config(model)
    heads = shard_heads(config.num_key_value_heads, p, rank)
    nblocks = -(-tokens // BLOCK)
    fp = KVFingerprint.of(config, BLOCK, torch.bfloat16)
    sender = KVSender(_shard_cache(config, heads, nblocks), rank_peer_id("p", rank, p), fp, heads,
                      TransferConfig(timeout_s=120))
    for r in sorted({leg.dst_rank for leg in legs_from(plan_transfer(config.num_key_value_heads, p, d), rank)}):
        sender.connect(rank_peer_id("d", r, d), rdv)
    start_barrier.wait(timeout=120)
    times = []
    for i in range(repeats):
        round_barrier.wait(timeout=120)  # receivers reserved round i's blocks
        rid = f"req-{i}"
        t0 = time.perf_counter()
        targets = leg_targets(config, rank, p, "d", d, list(range(i * nblocks, (i + 1) * nblocks)))
        if targets:
            sender.begin(rid, tokens, list(range(nblocks)), targets)
            group = sender.open_group({rid: nblocks})
            for layer in range(config.num_hidden_layers):
                group.send_layer(layer)
            group.close()
            sender.finish_prompt(rid, 1)
            done = False
            while not done:
                ev = sender.poll()
                if ev.failed:
                    raise RuntimeError(ev.failed)
                done = rid in ev.done
                time.sleep(0.0005)
        times.append(time.perf_counter() - t0)
        round_barrier.wait(timeout=120)
    return times


def kv_receiver(rank, p, d, tokens, repeats, rdv, start_barrier, round_barrier, model) -> bool:
    config = load_config(model)
    heads = shard_heads(config.num_key_value_heads, d, rank)
    nblocks = -(-tokens // BLOCK)
    pool = BlockPool(nblocks * repeats, BLOCK)
    fp = KVFingerprint.of(config, BLOCK, torch.bfloat16)
    receiver = KVReceiver(_shard_cache(config, heads, nblocks * repeats), PoolReserver(pool), rank_peer_id("d", rank, d),
                          fp, heads, TransferConfig(timeout_s=120))
    for r in sorted({leg.src_rank for leg in legs_to(plan_transfer(config.num_key_value_heads, p, d), rank)}):
        receiver.connect(rank_peer_id("p", r, p), rdv)
    start_barrier.wait(timeout=120)
    for i in range(repeats):
        blocks = receiver.reserve(f"req-{i}", tokens)
        assert blocks == list(range(i * nblocks, (i + 1) * nblocks)), blocks
        round_barrier.wait(timeout=120)
        done = False
        while not done:
            ev = receiver.poll()
            if ev.failed:
                raise RuntimeError(ev.failed)
            done = any(kv.request_id == f"req-{i}" for kv in ev.completed)
            time.sleep(0.0005)
        round_barrier.wait(timeout=120)
    return True


def measure_kv(args) -> list[dict]:
    config = load_config(args.model)
    rows = []
    for tokens in args.kv_sizes:
        for p, d in ((1, 1), (2, 2), (2, 1), (1, 2)):
            store, rdv = Rendezvous.host_store()
            ctx = mp.get_context("spawn")
            start_barrier, round_barrier = ctx.Barrier(p + d), ctx.Barrier(p + d)
            kw = dict(p=p, d=d, tokens=tokens, repeats=args.repeats, rdv=rdv, start_barrier=start_barrier,
                      round_barrier=round_barrier, model=args.model)
            specs = {f"s{r}": (kv_sender, dict(rank=r, **kw), 1) for r in range(p)}
            specs.update({f"r{r}": (kv_receiver, dict(rank=r, **kw), 1) for r in range(d)})
            print(f"kv: {tokens} tokens, p={p} -> d={d} ...", flush=True)
            out = run_procs(specs)
            per_round = [max(out[f"s{r}"][i] for r in range(p)) for i in range(args.repeats)]
            mbytes = tokens * KVCacheSpec(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                                          BLOCK, torch.bfloat16).bytes_per_token / 1e6
            rows.append({"tokens": tokens, "p": p, "d": d, "mbytes": mbytes, "ms": 1e3 * statistics.median(per_round),
                         "legs": len(plan_transfer(config.num_key_value_heads, p, d))})
            del store
    return rows


# -- output -------------------------------------------------------------------------------------------

def write_markdown(meta: dict, compute: dict, kv: list[dict], path: str) -> None:
    base, tp2, one = compute["tp1_2threads"], compute["tp2_1thread_each"], compute["tp1_1thread"]
    with open(path, "w") as f:
        f.write(f"# Tensor parallelism on {meta['cpus']} CPUs\n\n`{meta['command']}`  \n"
                f"{meta['machine']}, torch {meta['torch']}, bundled model (`{meta['model']}`), float32, "
                f"gloo over loopback TCP; medians of {meta['repeats']} repeats. 1-min load {meta['loadavg_1m']:.1f} "
                "at the end. Absolute times move with the machine's load; the three arrangements run one after "
                "another in one run.\n\n"
                f"## Compute (prefill: {meta['context']}-token prompt in {meta['chunk']}-token chunks; decode: "
                f"batch {meta['batch']} x {meta['context']} context; speculative: k = {meta['k']} draft passes over "
                "a 16 + 240-token view, then a k + 1 verification pass)\n\n"
                "| | TP 1, 2 threads | TP 1, 1 thread | TP 2, 1 thread per rank | TP 2 / TP 1 (2 threads) | "
                "all-reduce share of the TP 2 step |\n|---|---:|---:|---:|---:|---:|\n")
        for name, label in (("prefill", f"prefill {meta['context']} (ms)"), ("decode", "decode step (ms)"),
                            ("speculative", "speculative step (ms)"),
                            ("decode_small", f"decode step, batch 1 x {SMALL_CONTEXT} (ms)")):
            f.write(f"| {label} | {base[name]['ms']:.1f} | {one[name]['ms']:.1f} | {tp2[name]['ms']:.1f} | "
                    f"{tp2[name]['ms'] / base[name]['ms']:.2f}x | {tp2[name]['all_reduce_share']:.0%} |\n")
        f.write(f"| prefill tokens/s | {base['prefill']['tokens_per_s']:.0f} | {one['prefill']['tokens_per_s']:.0f} | "
                f"{tp2['prefill']['tokens_per_s']:.0f} | | |\n\n"
                "Target: TP 2 within 1.3x of TP 1 on 2 threads for the 4K prefill and the batch-16 x 4K decode step.\n\n"
                f"Each TP 2 pass makes {2 * meta['layers']} all-reduces (after o_proj and down_proj in every layer), "
                "each one send/recv exchange between the two ranks over loopback TCP: on the batch-1 step that is "
                f"{tp2['decode_small']['ms'] * tp2['decode_small']['all_reduce_share'] / (2 * meta['layers']):.2f} ms per "
                "all-reduce, mostly latency, so small steps cost more in TP 2 than in one 2-thread process; large "
                "steps (long prompts, big batches) split their compute in two and come out ahead.\n\n"
                "## Moving a prompt's KV (bfloat16) from prefill TP p to decode TP d\n\n"
                "Begin to the last leg's DONE; every decode rank receives exactly its heads from the prefill rank "
                "holding them.\n\n| tokens | MB | p -> d | legs | ms | vs p == d = 1 |\n|---:|---:|---|---:|---:|---:|\n")
        for r in kv:
            same = next(x for x in kv if x["tokens"] == r["tokens"] and x["p"] == x["d"] == 1)
            f.write(f"| {r['tokens']} | {r['mbytes']:.1f} | {r['p']} -> {r['d']} | {r['legs']} | {r['ms']:.1f} | "
                    f"{r['ms'] / same['ms']:.2f}x |\n")


def plot(compute: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["prefill", "decode", "speculative", "decode_small"]
    labels = {"tp1_2threads": "TP 1, 2 threads", "tp1_1thread": "TP 1, 1 thread", "tp2_1thread_each": "TP 2"}
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.27
    for i, (key, label) in enumerate(labels.items()):
        vals = [compute[key][n]["ms"] / compute["tp1_2threads"][n]["ms"] for n in names]
        ax.bar([x + (i - 1) * width for x in range(len(names))], vals, width, label=label)
        if key == "tp2_1thread_each":
            shares = [compute[key][n]["all_reduce_share"] * v for n, v in zip(names, vals)]
            ax.bar([x + (i - 1) * width for x in range(len(names))], shares, width, color="black", alpha=0.35,
                   label="all-reduce part of TP 2")
    ax.axhline(1.3, color="red", linestyle="--", linewidth=1, label="target 1.3x")
    ax.set_xticks(range(len(names)), ["prefill 4K", "decode 16 x 4K", "speculative k=3",
                                      f"decode 1 x {SMALL_CONTEXT}"])
    ax.set_ylabel("time / TP 1 on 2 threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--kv-sizes", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(RESULTS, "tp_scaling"))
    args = ap.parse_args()
    compute = measure_compute(args)
    kv = measure_kv(args)
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "model": os.path.relpath(args.model, os.path.dirname(_HERE)), "context": args.context, "chunk": args.chunk,
            "batch": args.batch, "k": args.k, "repeats": args.repeats,
            "layers": load_config(args.model).num_hidden_layers, "loadavg_1m": os.getloadavg()[0],
            "command": " ".join(["python benchmarks/tp_scaling.py"] + sys.argv[1:])}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "compute": compute, "kv_move": kv}, f, indent=2)
    write_markdown(meta, compute, kv, args.out + ".md")
    plot(compute, args.out + ".png")
    print(f"wrote {args.out}.json, .md and .png")


if __name__ == "__main__":
    main()
