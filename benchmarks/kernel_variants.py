"""A/B timing of CPU attention-kernel builds: source revisions and build switches, in one process.

Each variant is ``REV[:DEFINE=VALUE...]``: ``REV`` is a git revision whose
``modeling/attention/csrc/paged_attention.cpp`` is built (``WORKTREE`` = the file as it is now), and the
defines are passed as ``-D`` flags (e.g. ``WORKTREE:MS_PREFETCH_TILES=2``). All variants are built first
(with the flags of modeling/attention/cpu_kernel.py), then timed in interleaved rounds on the same cells
(bf16 cache, block 16, Hq 8 / Hkv 2, D 64, as benchmarks/attention_kernel.py builds them), so a slow spell of
the machine hits all of them alike. Reports the best time per variant and cell, and each variant's output
difference from the first variant.

    PYTHONPATH=. python benchmarks/kernel_variants.py --threads 2 \\
        --variants f15102d WORKTREE WORKTREE:MS_PREFETCH_TILES=2 WORKTREE:MS_PREFETCH_TILES=8
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.attention_kernel import HEAD_DIM, HQ, make_cell  # noqa: E402
from modeling.attention import cpu_kernel  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
SOURCE = "modeling/attention/csrc/paged_attention.cpp"


def variant_source(rev: str, workdir: str) -> str:
    """Path of the kernel source at ``rev`` (WORKTREE: the checkout's file)."""
    if rev == "WORKTREE":
        return os.path.join(ROOT, SOURCE)
    text = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{SOURCE}"], check=True, capture_output=True,
                          text=True).stdout
    path = os.path.join(workdir, f"paged_attention_{rev.replace('/', '_')}.cpp")
    with open(path, "w") as f:
        f.write(text)
    return path


def build(spec: str, workdir: str):
    """Compile one variant; returns the extension module."""
    from torch.utils import cpp_extension

    rev, *defines = spec.split(":")
    for d in defines:
        if "=" not in d or not d.split("=")[0].isidentifier():
            raise SystemExit(f"--variants: {spec!r}: each define must be NAME=VALUE, got {d!r}")
    src = variant_source(rev, workdir)
    with open(src, "rb") as f:
        digest = hashlib.sha1(f.read() + spec.encode()).hexdigest()[:10]
    return cpp_extension.load(name=f"magicserve_kernel_variant_{digest}", sources=[src],
                              extra_cflags=cpu_kernel._CFLAGS + [f"-D{d}" for d in defines], verbose=False)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", required=True, help="REV[:NAME=VALUE...] (REV may be WORKTREE)")
    ap.add_argument("--cells", nargs="+", default=["4x512x6", "32x8192x1", "32x8192x3", "32x8192x6"],
                    help="BATCHxCONTEXTxQ_LEN (4x512: L2-resident)")
    ap.add_argument("--layout", choices=["contiguous", "fragmented"], default="contiguous")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(RESULTS, "kernel_variants"))
    args = ap.parse_args(argv)
    try:
        cells = [tuple(int(x) for x in c.split("x")) for c in args.cells]
        assert all(len(c) == 3 and min(c) > 0 for c in cells)
    except (ValueError, AssertionError):
        raise SystemExit(f"--cells: each cell is BATCHxCONTEXTxQ_LEN with positive integers, got {args.cells}")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as workdir:
        modules = {spec: build(spec, workdir) for spec in args.variants}
    rows = []
    for batch, context, q_len in cells:
        q, _, _, k_cache, v_cache, meta = make_cell(batch, context, args.layout, q_len=q_len)
        t = meta.tensors(q.device)
        call = (q, k_cache, v_cache, t["block_tables"], t["seq_lens"], t["query_start"], meta.sink_len,
                t["window_starts"], HEAD_DIM ** -0.5)
        outs = {spec: m.paged_attention(*call).float() for spec, m in modules.items()}  # also the warm-up
        first = outs[args.variants[0]]
        times: dict[str, list[float]] = {spec: [] for spec in modules}
        rounds = args.rounds * (6 if batch * context < 10_000 else 1)  # tiny cells: more rounds
        for _ in range(rounds):
            for spec, m in modules.items():
                t0 = time.perf_counter()
                m.paged_attention(*call)
                times[spec].append(time.perf_counter() - t0)
        flops = 4 * batch * context * HQ * q_len * HEAD_DIM
        for spec in modules:
            best = min(times[spec])
            rows.append({"variant": spec, "batch": batch, "context": context, "q_len": q_len,
                         "best_ms": best * 1e3, "gflop_s": flops / best / 1e9,
                         "max_abs_diff_vs_first": float((outs[spec] - first).abs().max())})
            print(f"B{batch} C{context} Q{q_len} {spec}: {best * 1e3:.3f} ms", flush=True)
    meta_info = {"command": "python benchmarks/kernel_variants.py " + " ".join(sys.argv[1:] if argv is None else argv),
                 "threads": args.threads, "layout": args.layout, "rounds": args.rounds,
                 "machine": f"{platform.machine()} {os.cpu_count()} cpus", "torch": torch.__version__}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta_info, "rows": rows}, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(f"# CPU attention kernel variants\n\n`{meta_info['command']}`  \n{meta_info['machine']}, "
                f"{args.threads} threads, {args.layout} block tables, best of {args.rounds} interleaved rounds "
                "(x6 for cells under 10K keys); ratio = time / first variant's time.\n\n"
                "| cell (batch x context x Q) | variant | ms | GFLOP/s | ratio | max abs diff |\n"
                "|---|---|---:|---:|---:|---:|\n")
        for r in rows:
            base = next(x for x in rows if x["variant"] == args.variants[0] and
                        (x["batch"], x["context"], x["q_len"]) == (r["batch"], r["context"], r["q_len"]))
            f.write(f"| {r['batch']} x {r['context']} x {r['q_len']} | `{r['variant']}` | {r['best_ms']:.3f} | "
                    f"{r['gflop_s']:.0f} | {r['best_ms'] / base['best_ms']:.2f} | {r['max_abs_diff_vs_first']:.1e} |\n")
    print(f"wrote {args.out}.json/.md")


if __name__ == "__main__":
    main()
