"""Autoregressive decode-step latency against its roofline.

For batch x context cells, times one decode step (one new token per sequence) of a ~30M-parameter
Llama over a paged KV cache (``--dtype``, default ``auto``: bfloat16 on GPUs and on CPUs that compute it
natively, float32 on the other CPUs, where bf16 matrix products are emulated), and compares it with the step's roofline, the larger of
    (weight bytes + KV bytes read per step) / read bandwidth      (memory bound)
    step FLOPs / matmul rate                                      (compute bound)
where the read bandwidth (a reduction over a large tensor) and the matmul rate (a large GEMM in the dtype) are
measured in the same run, on the same device and threads. Step FLOPs: 2 per weight per sequence for the
matrices, plus 4 x heads x head_dim per cached position per layer per sequence for attention (scores
and the weighted sum). The KV content is random: step cost depends on sizes, not values.

Where an eager step's time goes is measured too, in separate steps with timers around the parts: the
attention kernel (the backend's forward; its reads are the KV bytes), the linear layers (every
``nn.Linear``, lm_head included; their reads are the weight bytes), and the rest (norms, rotary, residuals,
the cache write, metadata, launches and module calls). Each part's achieved read rate says which one stands
between a step and its roofline.

    python benchmarks/decode_step.py                       # full grid, results to benchmarks/results/
    python benchmarks/decode_step.py --batches 8 --contexts 16384 --backends torch
    python benchmarks/decode_step.py --device cuda --block-size 256 --backends torch flash --out runs/gpu/decode_step
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modeling.attention import make_backend
from modeling.block_pool import BlockPool, BlockTable
from modeling.compiled_step import CompiledSteps
from modeling.config import ModelConfig
from modeling.cpu_linear import unroute, use_skinny_linear
from modeling.dtype_choice import choose_dtype
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.model import CausalLM
from modeling.runner import ModelRunner, StepInput
from modeling.step_graphs import GraphSteps

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

BENCH_CONFIG = {
    "model_type": "llama", "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "rope_theta": 500000.0, "max_position_embeddings": 32768, "tie_word_embeddings": True,
}


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on a CUDA device (a no-op on CPU), so wall-clock timings cover them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 7, device: torch.device = torch.device("cpu")) -> float:
    """Bytes per second a reduction reads from a large float32 tensor on ``device`` (read only)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        t = time.perf_counter()
        src.sum()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times[1:])


def matmul_rate(n: int = 2048, repeats: int = 5, device: torch.device = torch.device("cpu"),
                dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of an n x n x n GEMM in ``dtype`` on ``device`` (2 n^3 FLOPs)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        t = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(times[1:])


def flops_per_step(model: CausalLM, batch: int, context: int) -> float:
    """FLOPs of one decode step: every matrix (embeddings only as the tied lm_head) once per sequence, and
    attention over ``context + 1`` positions per layer per sequence."""
    c = model.config
    matrices = sum(p.numel() for name, p in model.named_parameters()
                   if p.dim() == 2 and (c.tie_word_embeddings or not name.endswith("embed_tokens.weight")))
    attention = 4 * c.num_attention_heads * c.head_dim * (context + 1) * c.num_hidden_layers
    return batch * (2.0 * matrices + attention)


def device_label(device: torch.device) -> str:
    """What the step runs on: the GPU's name for CUDA, the processor otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def weight_bytes_per_step(model: CausalLM, batch: int) -> int:
    """Bytes of weights a decode step reads: every matrix once, embeddings only for ``batch`` rows
    (the tied lm_head reads the whole table)."""
    total = 0
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight") and not model.config.tie_word_embeddings:
            total += batch * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


PARTS = ("attention", "linear")


class PartTimer:
    """Seconds spent in the attention backend's forward and in every ``nn.Linear`` of the steps run while it is
    installed (``with PartTimer(runner) as parts``). Each timed call synchronizes the device before and after
    it, so a CUDA step's parts are device time too; the timers' own cost lands in the step's rest."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.calls = dict.fromkeys(PARTS, 0)
        self._handles: list = []
        self._started: dict[int, float] = {}

    def _start(self) -> float:
        synchronize(self.runner.device)
        return time.perf_counter()

    def _add(self, part: str, t0: float) -> None:
        synchronize(self.runner.device)
        self.seconds[part] += time.perf_counter() - t0
        self.calls[part] += 1

    def __enter__(self) -> "PartTimer":
        backend = self.runner.backend
        plain_forward = backend.forward

        def timed_forward(*args, **kwargs):
            t0 = self._start()
            out = plain_forward(*args, **kwargs)
            self._add("attention", t0)
            return out

        backend.forward = timed_forward  # an instance attribute: deleted on exit, the class's method shows again
        for module in self.runner.model.modules():
            if isinstance(module, torch.nn.Linear):
                self._handles.append(module.register_forward_pre_hook(
                    lambda m, _args: self._started.__setitem__(id(m), self._start())))
                self._handles.append(module.register_forward_hook(
                    lambda m, _args, _out: self._add("linear", self._started.pop(id(m)))))
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.backend.forward
        for handle in self._handles:
            handle.remove()


@contextlib.contextmanager
def served_linears(runner: ModelRunner):
    """The model's linear layers as serving routes them for ``runner`` (modeling.tp_runner.build_runner):
    through the skinny-linear kernel when the backend is the cpu kernel, torch's otherwise."""
    unroute(runner.model)
    if runner.backend.name == "cpu":
        use_skinny_linear(runner.model)
    try:
        yield
    finally:
        unroute(runner.model)


def time_cell(runners: list[ModelRunner], pool: BlockPool, batch: int, context: int,
              repeats: int) -> tuple[list[float], list[dict | None]]:
    """For each runner: the median seconds of one decode step of ``batch`` sequences at ``context`` cached
    tokens, and for eager runners the medians of a step with ``PartTimer`` installed and of its parts (None for
    compiled or captured steps, whose parts run fused). Each round runs one plain step per runner and one timed
    step per eager runner, in alternation, so that the machine's drift falls on all alike."""
    tables = []
    for _ in range(batch):
        t = BlockTable(pool.block_size)
        t.ensure_capacity(pool, context + 1)
        tables.append(t)
    inputs = [StepInput([1], context, t.blocks) for t in tables]
    times: list[list[float]] = [[] for _ in runners]
    parts: list[list[dict]] = [[] for _ in runners]
    for i in range(repeats + 2):
        for runner, out, out_parts in zip(runners, times, parts):
            with served_linears(runner):
                step = timed_step(runner, inputs)
                split = None if runner.compiled is not None else timed_parts(runner, inputs)
            if i >= 2:  # two warm-up rounds
                out.append(step)
                if split is not None:
                    out_parts.append(split)
    for t in tables:
        t.release(pool)
    return [statistics.median(t) for t in times], [median_parts(samples) if samples else None for samples in parts]


def median_parts(samples: list[dict]) -> dict:
    """The median timed step and median parts, the rest being what they leave of the step (so that the three
    add up to the step, as no three separate medians would)."""
    med = {key: statistics.median(s[key] for s in samples) for key in ("step", *PARTS)}
    return {**med, "rest": med["step"] - sum(med[part] for part in PARTS)}


def timed_step(runner: ModelRunner, inputs: list[StepInput]) -> float:
    """Seconds of one step, the device synchronized before and after."""
    synchronize(runner.device)
    t0 = time.perf_counter()
    runner.run(inputs)
    synchronize(runner.device)
    return time.perf_counter() - t0


def timed_parts(runner: ModelRunner, inputs: list[StepInput]) -> dict:
    """One step with ``PartTimer`` installed: its seconds (``step``, the timers' own cost included) and its
    attention's and its linear layers' seconds."""
    with PartTimer(runner) as timer:
        step = timed_step(runner, inputs)
    return {**timer.seconds, "step": step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--backends", nargs="+", default=["auto", "torch"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--compile", action="store_true",
                    help="also time compile_steps: CUDA graphs of Triton steps on CUDA, torch.compile of cpu-backend "
                         "steps on CPU")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i] (flash needs cuda and a block size of 256)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                    help="auto: as model.dtype auto chooses on the device (modeling/dtype_choice.py)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "decode_step"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device: CUDA requested but no CUDA device is available")

    choice = choose_dtype(args.dtype, device.type)
    args.dtype, dtype = choice.dtype, getattr(torch, choice.dtype)
    print(f"dtype {choice.describe()}")
    config = ModelConfig.from_hf_dict(BENCH_CONFIG)
    model = CausalLM(config).to(device=device, dtype=dtype).eval().requires_grad_(False)
    spec = KVCacheSpec(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, args.block_size, dtype)
    max_tokens = max(args.batches) * (max(args.contexts) + args.block_size)
    num_blocks = -(-max_tokens // args.block_size)
    print(f"model {config.num_parameters() / 1e6:.1f}M params {args.dtype}; KV cache {num_blocks * spec.bytes_per_block / 2**30:.2f} GiB")
    cache = PagedKVCache(spec, num_blocks, device, scratch_blocks=1)  # the scratch block: --compile on CUDA
    cache.kv.normal_()
    pool = BlockPool(num_blocks, args.block_size)
    bandwidth = read_bandwidth(device=device)
    rate = matmul_rate(device=device, dtype=dtype)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, {args.dtype} matmul {rate / 1e9:.1f} GFLOP/s on {device_label(device)}, "
          f"threads {args.threads}")

    rows = []
    runners = []
    max_len = max(args.contexts) + 1
    for backend_name in args.backends:
        runners.append((backend_name, ModelRunner(model, cache, make_backend(backend_name, device, args.block_size,
                                                                             cache.spec.dtype, max_len))))
    if args.compile:  # compile_steps: true, as build_runner sets it up
        if device.type == "cuda":  # CUDA graphs of Triton steps, one per batch bucket
            backend = make_backend("triton", device, args.block_size, cache.spec.dtype, max_len)
            runner = ModelRunner(model, cache, backend)
            runner.compiled = GraphSteps(model, cache, max_len, split_keys=backend.split_keys)
            runners.append(("triton", runner))
        else:  # torch.compile; one compilation (dynamic shapes) serves every cell
            runner = ModelRunner(model, cache, make_backend("cpu", device, args.block_size, cache.spec.dtype))
            runner.compiled = CompiledSteps(model, cache)
            runners.append(("cpu", runner))
    cells = [(b, c) for b in args.batches for c in args.contexts]
    timed = []
    for batch, context in tqdm(cells, desc="cells"):
        steps, parts = time_cell([r for _, r in runners], pool, batch, context, args.repeats)
        timed += [(name, runner, batch, context, step, part) for (name, runner), step, part in zip(runners, steps, parts)]
    # the machine's limits, measured again after the cells: a shared host's bandwidth drifts, and the roofline
    # takes the best each reached
    bandwidths, rates = [bandwidth, read_bandwidth(device=device)], [rate, matmul_rate(device=device, dtype=dtype)]
    bandwidth, rate = max(bandwidths), max(rates)
    print(f"read bandwidth {' / '.join(f'{b / 1e9:.1f}' for b in bandwidths)} GB/s, matmul "
          f"{' / '.join(f'{r / 1e9:.1f}' for r in rates)} GFLOP/s (before / after the cells)")
    for name, runner, batch, context, step, parts in timed:
        add_row(rows, model, spec, name, runner, batch, context, step, bandwidth, rate, parts)
    rows.sort(key=lambda r: (r["resolved_backend"], r["batch"], r["context"]))
    write_outputs(args, model, config, device, bandwidths, rates, rows)


def add_row(rows: list[dict], model: CausalLM, spec: KVCacheSpec, backend_name: str, runner: ModelRunner, batch: int,
            context: int, step: float, bandwidth: float, rate: float, parts: dict | None) -> None:
    """One cell's figures against its roofline, and where its eager step's time goes (``parts``)."""
    label = runner.backend.name
    if runner.compiled is not None:
        label += " graphs" if isinstance(runner.compiled, GraphSteps) else " compiled"
    w_bytes = weight_bytes_per_step(model, batch)
    kv_bytes = batch * (context + 1) * spec.bytes_per_token
    flops = flops_per_step(model, batch, context)
    memory_s, compute_s = (w_bytes + kv_bytes) / bandwidth, flops / rate
    roofline = max(memory_s, compute_s)
    rows.append({
        "backend": backend_name, "resolved_backend": label, "batch": batch, "context": context,
        "step_ms": step * 1e3, "tokens_per_s": batch / step, "roofline_ms": roofline * 1e3,
        "memory_ms": memory_s * 1e3, "compute_ms": compute_s * 1e3,
        "bound": "memory" if memory_s >= compute_s else "compute", "fraction_of_roofline": roofline / step,
        "weight_mb": w_bytes / 1e6, "kv_mb": kv_bytes / 1e6, "gflops": flops / 1e9,
        "parts": None if parts is None else {
            **{f"{k}_ms": v * 1e3 for k, v in parts.items()},  # attention, linear, rest, step (timed)
            # what each part reads: the cached KV, and the weights (every matrix is a linear layer's)
            "attention_gbps": kv_bytes / parts["attention"] / 1e9,
            "linear_gbps": w_bytes / parts["linear"] / 1e9,
        },
    })
    tqdm.write(f"{label:>12} batch {batch:>3} ctx {context:>6}: {step * 1e3:8.2f} ms/step {batch / step:9.1f} tok/s  "
               f"roofline {roofline * 1e3:7.2f} ms ({rows[-1]['bound']})  ratio {roofline / step:.2f}")


def write_outputs(args, model: CausalLM, config: ModelConfig, device: torch.device, bandwidths: list[float],
                  rates: list[float], rows: list[dict]) -> None:
    """OUT.json and OUT.md."""
    bandwidth, rate = max(bandwidths), max(rates)
    meta = {
        "machine": device_label(device), "device": str(device), "cpus": os.cpu_count(), "threads": args.threads,
        "torch": torch.__version__, "read_bandwidth_gbps": bandwidth / 1e9, "matmul_gflops": rate / 1e9,
        "read_bandwidth_runs_gbps": [b / 1e9 for b in bandwidths], "matmul_runs_gflops": [r / 1e9 for r in rates],
        "dtype": args.dtype,
        "params_m": config.num_parameters() / 1e6, "block_size": args.block_size, "repeats": args.repeats,
        "command": "python benchmarks/decode_step.py " + " ".join(sys.argv[1:]),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    where = f"{args.threads} threads" if device.type == "cpu" else f"{meta['machine']} ({device})"
    with open(args.out + ".md", "w") as f:
        f.write(f"# Decode step vs its roofline\n\n`{meta['command']}`  \n"
                f"{meta['params_m']:.1f}M-param Llama, {meta['dtype']}, {where}, measured in this run before and after the "
                f"cells, the better of each taken: read bandwidth {' / '.join(f'{b:.1f}' for b in meta['read_bandwidth_runs_gbps'])} "
                f"GB/s, {meta['dtype']} matmul {' / '.join(f'{r:.1f}' for r in meta['matmul_runs_gflops'])} GFLOP/s; median of "
                f"{args.repeats}, the backends of a cell timed in alternation. Roofline: the larger of (weight + KV "
                "bytes) / read bandwidth and step FLOPs / matmul rate.\n\n"
                "| backend | batch | context | ms/step | tokens/s | memory ms | compute ms | roofline / measured |\n"
                "|---|---:|---:|---:|---:|---:|---:|---:|\n")
        for r in rows:
            f.write(f"| {r['resolved_backend']} | {r['batch']} | {r['context']} | {r['step_ms']:.2f} | "
                    f"{r['tokens_per_s']:.1f} | {r['memory_ms']:.2f} | {r['compute_ms']:.2f} | "
                    f"{r['fraction_of_roofline']:.2f} |\n")
        f.write(parts_markdown(rows, bandwidth, args.repeats))
    written = "json and .md" + (" and .png" if plot_parts(rows, args.out + ".png") else "")
    print(f"wrote {args.out}.{written}")


def parts_markdown(rows: list[dict], bandwidth: float, repeats: int) -> str:
    """The table of where eager steps' time goes, each part with the read rate it achieved."""
    eager = [r for r in rows if r["parts"] is not None]
    if not eager:
        return ""
    out = ("\n## Where the step goes\n\n"
           "Eager steps with timers around the attention backend and every linear layer, run in alternation with "
           f"the plain steps above: the median of {repeats} timed steps (their timers' cost included) and of each "
           "part, and the rest, what the two parts leave of the timed step. "
           "GB/s: the part's reads (the KV for attention, the weights for the linear layers) over its time, "
           f"against the read bandwidth of {bandwidth / 1e9:.1f} GB/s. Rest: norms, rotary, residuals, the cache "
           "write, step metadata, launches and module calls.\n\n"
           "| backend | batch | context | plain step ms | timed step ms | attention ms | attention GB/s | linear ms | "
           "linear GB/s | rest ms |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    for r in eager:
        p = r["parts"]
        out += (f"| {r['resolved_backend']} | {r['batch']} | {r['context']} | {r['step_ms']:.2f} | {p['step_ms']:.2f} | "
                f"{p['attention_ms']:.2f} | {p['attention_gbps']:.1f} | {p['linear_ms']:.2f} | "
                f"{p['linear_gbps']:.1f} | {p['rest_ms']:.2f} |\n")
    return out


def plot_parts(rows: list[dict], path: str) -> bool:
    """Each eager backend's step per cell as shares of attention, linear layers and the rest, with the step's
    time and its roofline written above the bar; False if there is nothing to plot."""
    eager = [r for r in rows if r["parts"] is not None]
    if not eager:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = list(dict.fromkeys(r["resolved_backend"] for r in eager))
    fig, axes = plt.subplots(1, len(backends), figsize=(6.5 * len(backends), 4.8), squeeze=False)
    for ax, backend in zip(axes[0], backends):
        cells = [r for r in eager if r["resolved_backend"] == backend]
        x = list(range(len(cells)))
        bottom = [0.0] * len(cells)
        for part, color in (("attention", "tab:blue"), ("linear", "tab:orange"), ("rest", "tab:gray")):
            shares = [100 * max(0.0, r["parts"][f"{part}_ms"]) / r["parts"]["step_ms"] for r in cells]
            ax.bar(x, shares, bottom=bottom, color=color, label=part)
            bottom = [b + h for b, h in zip(bottom, shares)]
        for i, r in enumerate(cells):
            ax.text(i, 101, f"{r['parts']['step_ms']:.3g} ms\n(roof {r['roofline_ms']:.2g})", ha="center",
                    va="bottom", fontsize=7)
        ax.set_xticks(x, [f"b{r['batch']}\n{r['context'] // 1024}K" for r in cells])
        ax.set_ylim(0, 118)
        ax.set_ylabel("% of the step")
        ax.set_title(f"{backend}: where a decode step goes")
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    main()
