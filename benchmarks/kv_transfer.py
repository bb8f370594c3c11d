"""KV transfer bandwidth against a raw torch.distributed send, and TTFT with layer-wise overlap.

Two processes (prefill side, decode side) over gloo on this machine, ~30M-param Llama config in
bfloat16 (``decode_step.BENCH_CONFIG``, random weights: cost depends on sizes, not values).

1. Bandwidth: for prompts of 1K / 4K / 16K tokens, the time from ``KVSender.begin`` to the receiver's
   DONE (handshake, per-layer K/V slabs, acknowledgement) against a raw ``send`` of the same number of
   bytes in one tensor plus a one-element acknowledgement, on the same kind of pair group, interleaved
   in the same run. Ratio = raw time / transfer time (1.0 = as fast as raw).
2. TTFT: a PrefillWorker prefills a prompt (chunked) and hands the KV off; KV-ready time (arrival to
   DONE) with layer-wise streaming vs. prefill-then-send, against the prefill alone (same worker and
   chunks, no hand-off). Overhead = KV-ready / prefill-alone - 1.

    python benchmarks/kv_transfer.py         # results to benchmarks/results/kv_transfer.{json,md}
    python benchmarks/kv_transfer.py --sizes 1024 --ttft-sizes 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

# Run as a script, this file's folder heads sys.path and its name would shadow the kv_transfer
# package: put the repository root there instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from benchmarks.decode_step import BENCH_CONFIG  # noqa: E402
from kv_transfer import (  # noqa: E402
    HeadRange, KVFingerprint, KVReceiver, KVSender, LegTarget, PairChannel, PeerHello, PoolReserver, Rendezvous,
    TransferConfig)
from kv_transfer.channel import DECODE_RANK, PREFILL_RANK  # noqa: E402
from modeling.block_pool import BlockPool  # noqa: E402
from modeling.checkpoint import LoadedModel  # noqa: E402
from modeling.config import ModelConfig  # noqa: E402
from modeling.kv_cache import KVCacheSpec, PagedKVCache  # noqa: E402
from modeling.model import CausalLM  # noqa: E402
from modeling.sampling import SamplingParams  # noqa: E402
from prefill_worker.config import PrefillWorkerConfig  # noqa: E402
from prefill_worker.worker import PrefillWorker  # noqa: E402
from prefill_worker.messages import KVDestination, PrefillRequest  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BLOCK = 16
DTYPE = torch.bfloat16
CONFIG = TransferConfig(timeout_s=120.0)


def _spec(config: ModelConfig) -> KVCacheSpec:
    return KVCacheSpec(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, BLOCK, DTYPE)


def _model(config: ModelConfig) -> LoadedModel:
    torch.manual_seed(0)
    model = CausalLM(config).to(DTYPE).eval().requires_grad_(False)
    return LoadedModel("", config, model, DTYPE, torch.device("cpu"), ())


def _apply_replies(sender: KVSender):
    """poll() without its flush: apply replies only, so the data phase is timed on its own."""
    flush, sender.flush = sender.flush, lambda: None
    try:
        return sender.poll()
    finally:
        sender.flush = flush


def decode_side(rdv: Rendezvous, cmds, replies, max_tokens: int, threads: int) -> None:
    """Serves the raw channel and a KVReceiver, driven by commands from the prefill side."""
    torch.set_num_threads(threads)
    config = ModelConfig.from_hf_dict(BENCH_CONFIG)
    blocks = 2 * (max_tokens // BLOCK + 1)
    pool = BlockPool(blocks, BLOCK)
    reserver = PoolReserver(pool)
    fp = KVFingerprint.of(config, BLOCK, DTYPE)
    heads = HeadRange(0, config.num_key_value_heads)
    receiver = KVReceiver(PagedKVCache(_spec(config), blocks), reserver, "decode", fp, heads, CONFIG)
    raw = PairChannel.open(rdv.connect(), "raw", "decode", DECODE_RANK, PeerHello("decode", "decode", fp, heads),
                           torch.device("cpu"), CONFIG)
    receiver.connect("kvsender", rdv)
    receiver.connect("prefill", rdv)
    while True:
        cmd = cmds.get()
        if cmd[0] == "raw":
            buf = torch.empty(cmd[1], dtype=torch.uint8)
            raw.recv_data(buf)
            raw.send_data(torch.ones(1, dtype=torch.uint8)).wait()
        elif cmd[0] == "reserve":
            replies.put(receiver.reserve(cmd[1], cmd[2]))
        elif cmd[0] == "serve":  # poll until `count` transfers completed, freeing their blocks
            done = 0
            while done < cmd[1]:
                ev = receiver.poll()
                if ev.failed:
                    raise RuntimeError(ev.failed)
                for kv in ev.completed:
                    reserver.take(kv.request_id).release(pool)
                    done += 1
                time.sleep(0.002)  # a decode worker polls once per step; DONE does not wait for it
            replies.put("served")
        else:
            replies.put("bye")
            os._exit(0)


def prefill_side(rdv: Rendezvous, cmds, replies, args) -> dict:
    torch.set_num_threads(args.threads)
    config = ModelConfig.from_hf_dict(BENCH_CONFIG)
    fp = KVFingerprint.of(config, BLOCK, DTYPE)
    heads = HeadRange(0, config.num_key_value_heads)
    raw = PairChannel.open(rdv.connect(), "raw", "decode", PREFILL_RANK, PeerHello("raw", "prefill", fp, heads),
                           torch.device("cpu"), CONFIG)
    max_tokens = max(args.sizes + args.ttft_sizes)
    cache = PagedKVCache(_spec(config), max_tokens // BLOCK + 1)
    cache.kv.normal_()
    sender = KVSender(cache, "kvsender", fp, heads, CONFIG)
    sender.connect("decode", rdv)
    loaded = _model(config)
    worker = PrefillWorker(loaded, PrefillWorkerConfig(
        dtype="bfloat16", block_size=BLOCK, kv_cache_tokens=max_tokens + BLOCK, token_budget=args.token_budget,
        attention_backend="torch", transfer=CONFIG), "prefill")
    worker.connect("decode", rdv)
    ids = iter(range(10**9))

    def reserve(n: int) -> tuple[str, list[int]]:
        rid = f"r{next(ids)}"
        cmds.put(("reserve", rid, n))
        return rid, replies.get()

    def transfer_once(rid: str, dst: list[int], n: int) -> tuple[float, float]:
        """(handshake seconds, data seconds): begin -> ACCEPT, then first send -> DONE."""
        nblocks = -(-n // BLOCK)
        t0 = time.perf_counter()
        sender.begin(rid, n, list(range(nblocks)), [LegTarget("decode", heads, reserved=True)])
        leg = sender._transfers[rid].legs[0]
        while leg.state != "accepted":
            out = _apply_replies(sender)
            if out.failed:
                raise RuntimeError(out.failed)
            time.sleep(0.0002)
        t_accept = t1 = time.perf_counter()
        group = sender.open_group({rid: nblocks})
        for layer in range(config.num_hidden_layers):
            group.send_layer(layer)
        group.close()
        sender.finish_prompt(rid, None)
        while True:
            ev = sender.poll()
            if ev.failed:
                raise RuntimeError(ev.failed)
            if ev.done:
                return t_accept - t0, time.perf_counter() - t1
            time.sleep(0.0002)

    def raw_once(nbytes: int) -> float:
        cmds.put(("raw", nbytes))
        src = torch.ones(nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        raw.send_data(src).wait()
        raw.recv_data(torch.empty(1, dtype=torch.uint8))
        return time.perf_counter() - t0

    bandwidth = []
    for n in args.sizes:
        nbytes = -(-n // BLOCK) * BLOCK * _spec(config).bytes_per_token
        t_raw, t_kv, t_hs = [], [], []
        for i in range(args.repeats + 1):  # first round is warm-up
            r = raw_once(nbytes)
            rid, dst = reserve(n)
            cmds.put(("serve", 1))
            hs, k = transfer_once(rid, dst, n)
            assert replies.get() == "served"
            if i:
                t_raw.append(r)
                t_kv.append(k)
                t_hs.append(hs)
        raw_s, kv_s, hs_s = statistics.median(t_raw), statistics.median(t_kv), statistics.median(t_hs)
        row = {"tokens": n, "mbytes": nbytes / 1e6, "raw_ms": raw_s * 1e3, "transfer_ms": kv_s * 1e3,
               "handshake_ms": hs_s * 1e3, "raw_gbps": nbytes / raw_s / 1e9, "transfer_gbps": nbytes / kv_s / 1e9,
               "ratio": raw_s / kv_s, "ratio_with_handshake": raw_s / (kv_s + hs_s)}
        bandwidth.append(row)
        print(f"bandwidth {n:>6} tokens {nbytes / 1e6:6.1f} MB: raw {row['raw_ms']:8.1f} ms, "
              f"transfer {row['transfer_ms']:8.1f} ms (+ handshake {row['handshake_ms']:.1f} ms), "
              f"ratio {row['ratio']:.2f} ({row['ratio_with_handshake']:.2f} with handshake)", flush=True)

    def prefill_alone(n: int) -> float:
        """The same worker, chunks and code path, with no KV hand-off (destination None)."""
        rid = f"r{next(ids)}"
        prompt = tuple(torch.randint(0, config.vocab_size, (n,)).tolist())
        t0 = time.perf_counter()
        worker.add_request(PrefillRequest(rid, prompt, SamplingParams(max_tokens=2), None, arrival_time=t0))
        while worker.has_work():
            worker.step()
        return time.perf_counter() - t0

    def with_transfer(mode: str, n: int) -> tuple[float, float]:
        w = worker
        w.config = dataclasses.replace(w.config, layerwise_streaming=(mode == "layerwise"))
        rid, dst = reserve(n)
        prompt = tuple(torch.randint(0, config.vocab_size, (n,)).tolist())
        cmds.put(("serve", 1))
        t0 = time.perf_counter()
        w.add_request(PrefillRequest(rid, prompt, SamplingParams(max_tokens=2), KVDestination("decode", reserved=True),
                                     arrival_time=t0))
        ttft = None
        while True:
            out = w.step()
            if out.failed:
                raise RuntimeError(out.failed)
            for ft in out.first_tokens:
                ttft = ft.ttft_s
            if rid in out.transferred:
                ready = time.perf_counter() - t0
                break
        assert replies.get() == "served"
        return ttft, ready

    ttft_rows = []
    m = statistics.median
    for n in args.ttft_sizes:
        runs: dict[str, list] = {"alone": [], "layerwise": [], "after": []}
        for i in range(args.ttft_repeats + 1):  # round 0 is warm-up; the order rotates every round
            order = ["alone", "layerwise", "after"]
            order = order[i % 3:] + order[: i % 3]
            got = {mode: (prefill_alone(n), None) if mode == "alone" else with_transfer(mode, n) for mode in order}
            if i:
                for mode, value in got.items():
                    runs[mode].append(value)
        alone = [a for a, _ in runs["alone"]]
        row = {"tokens": n, "prefill_alone_ms": m(alone) * 1e3}
        for mode in ("layerwise", "after"):
            firsts = [f for f, _ in runs[mode]]
            ready = [r for _, r in runs[mode]]
            row[f"{mode}_first_token_ms"] = m(firsts) * 1e3
            row[f"{mode}_kv_ready_ms"] = m(ready) * 1e3
            # exposed transfer: KV ready at the decode side minus the first token (prefill end)
            row[f"{mode}_tail_ms"] = m([r - f for f, r in runs[mode]]) * 1e3
            # paired with the prefill-alone run of the same round (less exposed to machine noise)
            row[f"{mode}_overhead"] = m([r / a - 1 for (_, r), a in zip(runs[mode], alone)])
        ttft_rows.append(row)
        print(f"ttft {n:>6} tokens: prefill {row['prefill_alone_ms']:8.1f} ms; KV ready layer-wise "
              f"{row['layerwise_kv_ready_ms']:8.1f} ms (overhead {row['layerwise_overhead']:+.1%}, tail "
              f"{row['layerwise_tail_ms']:.1f} ms), after prefill {row['after_kv_ready_ms']:8.1f} ms (overhead "
              f"{row['after_overhead']:+.1%}, tail {row['after_tail_ms']:.1f} ms)", flush=True)
    cmds.put(("stop",))
    return {"bandwidth": bandwidth, "ttft": ttft_rows}


def _prefill_entry(rdv, cmds, replies, args, results):
    try:
        results.put(("ok", prefill_side(rdv, cmds, replies, args)))
    except BaseException as err:  # noqa: BLE001
        import traceback
        results.put(("error", traceback.format_exc()))
        raise err
    results.close()
    results.join_thread()
    os._exit(0)


def write_markdown(meta: dict, value: dict, path: str) -> None:
    """The short human-readable table next to the JSON."""
    with open(path, "w") as f:
        f.write(f"# KV transfer\n\n`{meta['command'].strip()}`  \n{meta['params_m']:.1f}M-param Llama config, bf16, "
                f"block {meta['block_size']}, {meta['backend']}, {meta['cpus']} CPUs ({meta['machine']}), "
                f"1-min load {meta['loadavg_1m_at_end']:.1f} at the end, "
                f"{meta['threads']} torch thread(s) per process. Absolute times are noisy; ratios are measured "
                "interleaved in one run.\n\n"
                f"## Bandwidth (median of {meta['repeats']}; target: ratio >= 0.8 from 4K)\n\n"
                "Transfer = first K/V send to the receiver's DONE (16 per-layer K/V slabs, written into the "
                "receiver's paged cache); raw = one `send` of the same bytes plus a one-element acknowledgement, "
                "same kind of pair group. Handshake = descriptor to ACCEPT (in the prefill worker it overlaps "
                "the first chunk's compute).\n\n"
                "| tokens | MB | raw ms | transfer ms | handshake ms | raw GB/s | transfer GB/s | raw / transfer "
                "| raw / (transfer + handshake) |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in value["bandwidth"]:
            f.write(f"| {r['tokens']} | {r['mbytes']:.1f} | {r['raw_ms']:.1f} | {r['transfer_ms']:.1f} | "
                    f"{r['handshake_ms']:.1f} | {r['raw_gbps']:.2f} | {r['transfer_gbps']:.2f} | {r['ratio']:.2f} | "
                    f"{r['ratio_with_handshake']:.2f} |\n")
        f.write(f"\n## Time to KV-ready at the decode side (median of {meta['ttft_repeats']} rounds; token budget "
                f"{meta['token_budget']}; target: layer-wise adds <= 15% at 4K)\n\n"
                "Overhead = KV ready / prefill alone - 1, paired per round (median); tail = KV ready - first token, "
                "the part of the transfer not hidden behind compute. Prefill alone = the same worker and chunks "
                "with no hand-off.\n\n"
                "| tokens | prefill alone ms | layer-wise: first token / KV ready ms | overhead | tail ms | "
                "prefill-then-send: first token / KV ready ms | overhead | tail ms |\n"
                "|---:|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in value["ttft"]:
            f.write(f"| {r['tokens']} | {r['prefill_alone_ms']:.1f} | {r['layerwise_first_token_ms']:.1f} / "
                    f"{r['layerwise_kv_ready_ms']:.1f} | {r['layerwise_overhead']:+.1%} | "
                    f"{r['layerwise_tail_ms']:.1f} | "
                    f"{r['after_first_token_ms']:.1f} / {r['after_kv_ready_ms']:.1f} | {r['after_overhead']:+.1%} | "
                    f"{r['after_tail_ms']:.1f} |\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--ttft-sizes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ttft-repeats", type=int, default=5)
    ap.add_argument("--token-budget", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--out", default=os.path.join(RESULTS, "kv_transfer"))
    args = ap.parse_args()
    store, rdv = Rendezvous.host_store()
    ctx = mp.get_context("spawn")
    cmds, replies, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    dec = ctx.Process(target=decode_side, args=(rdv, cmds, replies, max(args.sizes + args.ttft_sizes), args.threads),
                      daemon=True)
    pre = ctx.Process(target=_prefill_entry, args=(rdv, cmds, replies, args, results), daemon=True)
    dec.start()
    pre.start()
    status, value = results.get(timeout=3600)
    for p in (pre, dec):
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if status != "ok":
        raise SystemExit(value)
    load = os.getloadavg()
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": args.threads,
            "torch": torch.__version__, "dtype": "bfloat16", "block_size": BLOCK, "backend": "gloo (loopback TCP)",
            "params_m": ModelConfig.from_hf_dict(BENCH_CONFIG).num_parameters() / 1e6,
            "token_budget": args.token_budget, "repeats": args.repeats, "ttft_repeats": args.ttft_repeats,
            "loadavg_1m_at_end": load[0],
            "note": "absolute times move with the machine's load; ratios are measured interleaved in one run",
            "command": " ".join(["python benchmarks/kv_transfer.py"] + sys.argv[1:])}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, **value}, f, indent=2)
    write_markdown(meta, value, args.out + ".md")
    print(f"wrote {args.out}.json and .md")
    del store


if __name__ == "__main__":
    main()
