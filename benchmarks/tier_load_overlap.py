"""TTFT of a prompt whose document only the host tier holds: loaded layer by layer beside the pass, or before it.

A prefill instance serves a document followed by a question, the document's KV computed earlier and evicted
from the pool to the host tier (``kv_tiers.host_memory_mb``; no disk tier, so nothing but the copy into the
cache is left to the load). Per document length, the same instance and inputs, medians of ``--repeats`` with
the two ways of loading alternating:

* **cold**: document and question computed whole;
* **pool hit**: the document's blocks still in the pool, only the question computed: the floor, nothing to load;
* **tier hit, at once** (``kv_tiers.layered_loads: false``): the document's blocks copied into the cache, then
  the question's pass;
* **tier hit, layer by layer** (the default): the copy of layer *i* beside the pass's work on the layers before it.

``load cost`` is a tier hit's TTFT over the pool hit's, minus one: what loading adds over the floor, which the
overlap exists to close; ``copy`` is the document's copy into the cache timed alone (the load's own cost).

    python benchmarks/tier_load_overlap.py                      # bundled model, this CPU
    python benchmarks/tier_load_overlap.py --device cuda --model llama-3.1-8b --docs 2048 8192 32768
    python benchmarks/tier_load_overlap.py --docs 1024 --repeats 2 --out runs/tier_load_overlap   # a quick look

``--model llama-3.1-8b`` runs random weights in Llama-3.1-8B's shapes (built on the device: cost depends on sizes,
not values); the default is the bundled checkpoint.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from benchmarks._record import record, write_lines  # noqa: E402
from modeling.checkpoint import LoadedModel, load_model  # noqa: E402
from modeling.config import ModelConfig  # noqa: E402
from modeling.dtype_choice import choose_dtype  # noqa: E402
from modeling.instance_config import KVTiersConfig  # noqa: E402
from modeling.model import CausalLM  # noqa: E402
from modeling.rope import RotaryEmbedding  # noqa: E402
from modeling.sampling import SamplingParams  # noqa: E402
from prefill_worker.config import PrefillWorkerConfig  # noqa: E402
from prefill_worker.messages import PrefillRequest  # noqa: E402
from prefill_worker.worker import PrefillWorker  # noqa: E402

REPO = os.path.dirname(_HERE)
RESULTS = os.path.join(_HERE, "results")
BUNDLED = os.path.join(REPO, "models", "stdlib-llama-15m")
LLAMA_31_8B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
}
BLOCK = 16
MODES = ("at once", "layer by layer")
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)  # greedy: random weights need not give a distribution


def build_model(name: str, device: str, dtype: str) -> LoadedModel:
    """The bundled checkpoint, or random weights in Llama-3.1-8B's shapes built on ``device``."""
    if name == "bundled":
        return load_model(BUNDLED, dtype, device)
    return random_model(LLAMA_31_8B, device, dtype)


def random_model(hf_config: dict, device: str, dtype: str) -> LoadedModel:
    """Random weights in ``hf_config``'s shapes, made on ``device`` in ``dtype`` (no float32 copy of an 8B model
    on the host): norms at one, the rest normal with a std of 0.02, the rotary table computed as the loader does."""
    config = ModelConfig.from_hf_dict(hf_config)
    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = CausalLM(config).to(torch_dtype)
    model = model.to_empty(device=device).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    model.model.rotary = RotaryEmbedding(config).to(device)  # a buffer to_empty left unset
    return LoadedModel("", config, model, torch_dtype, torch.device(device), ())


class Instance:
    """A prefill worker over a pool that holds one document and its question, above a host tier."""

    def __init__(self, loaded: LoadedModel, doc_tokens: int, layered: bool, device: str, dtype: str, name: str,
                 token_budget: int = 0):
        tokens = (doc_tokens // BLOCK + 8) * BLOCK
        block_bytes = 2 * loaded.config.num_hidden_layers * BLOCK * loaded.config.num_key_value_heads * \
            loaded.config.head_dim * loaded.dtype.itemsize
        host_mb = -(-2 * tokens // BLOCK * block_bytes // (1 << 20))  # this round's documents, and the last's
        tiers = KVTiersConfig(host_memory_mb=host_mb, disk_mb=0, layered_loads=layered)
        self.worker = PrefillWorker(loaded, PrefillWorkerConfig(
            block_size=BLOCK, kv_cache_tokens=tokens, token_budget=min(tokens, token_budget or tokens), kv_tiers=tiers,
            device=device,
            dtype=dtype), name)
        self.device = torch.device(device)
        self._n = 0

    def ttft(self, prompt: list[int]) -> tuple[float, int]:
        """(seconds from the request's arrival to its first token, tokens loaded from the tiers)."""
        self._n += 1
        self._sync()
        t0 = time.perf_counter()
        self.worker.add_request(PrefillRequest(f"r{self._n}", tuple(prompt), ONE_TOKEN, None))
        firsts = []
        while not firsts:
            firsts = self.worker.step().first_tokens
        self._sync()
        seconds = time.perf_counter() - t0
        while self.worker.has_work():
            self.worker.step()
        return seconds, firsts[0].cached.from_tiers

    def evict_pool(self) -> None:
        """Allocating every free block evicts the pool's cached ones (they stay in the host tier)."""
        pool = self.worker.pool
        pool.free(pool.allocate(pool.num_free))

    def copy_s(self, doc_tokens: int) -> float:
        """The document's blocks copied from host memory into the cache, alone."""
        cache = self.worker.cache
        n = doc_tokens // BLOCK
        host = torch.empty((n,) + tuple(cache.kv.shape[:2]) + tuple(cache.kv.shape[3:]), dtype=cache.kv.dtype,
                           pin_memory=self.device.type == "cuda")
        self._sync()
        t0 = time.perf_counter()
        cache.write_blocks(list(range(n)), host)
        self._sync()
        return time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.worker.close()


def measure(loaded: LoadedModel, doc_tokens: int, question: int, repeats: int, device: str, dtype: str,
            seed: int, token_budget: int = 0) -> dict:
    rng = random.Random(seed)
    vocab = loaded.config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    instances = {mode: Instance(loaded, doc_tokens, mode == "layer by layer", device, dtype, f"prefill-{i}",
                                token_budget) for i, mode in enumerate(MODES)}
    kv_bytes = doc_tokens // BLOCK * instances["at once"].worker.cache.spec.bytes_per_block
    runs: dict[str, list[float]] = {"cold": [], "pool hit": [], **{f"tier hit, {m}": [] for m in MODES}}
    try:
        for r in range(repeats + 1):  # the first round warms up and is not kept
            doc = tokens(doc_tokens)
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                inst = instances[mode]
                cold, _ = inst.ttft(doc + tokens(question))
                hit, _ = inst.ttft(doc + tokens(question))
                inst.evict_pool()
                tier, loaded_tokens = inst.ttft(doc + tokens(question))
                if loaded_tokens != doc_tokens // BLOCK * BLOCK:
                    raise RuntimeError(f"the tier hit loaded {loaded_tokens} tokens, not the document's "
                                       f"{doc_tokens // BLOCK * BLOCK}")
                if r:
                    runs["cold"].append(cold)
                    runs["pool hit"].append(hit)
                    runs[f"tier hit, {mode}"].append(tier)
        copy = [instances["at once"].copy_s(doc_tokens) for _ in range(repeats)]
    finally:
        for inst in instances.values():
            inst.close()
    med = {name: statistics.median(v) for name, v in runs.items()}
    return {
        "doc_tokens": doc_tokens, "question_tokens": question, "runs_s": runs, "median_s": med,
        "copy_s": statistics.median(copy), "kv_bytes": kv_bytes,
        "load_cost": {m: med[f"tier hit, {m}"] / med["pool hit"] - 1 for m in MODES},
        "layered_vs_at_once": med["tier hit, layer by layer"] / med["tier hit, at once"],
    }


def write_markdown(result: dict, path: str) -> None:
    lines = [
        "# Tier hits: loaded layer by layer beside the pass, or before it",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Model: {result['model']} ({result['dtype']}), device: {result['device']}; question of "
        f"{result['question_tokens']} tokens; medians of {result['repeats']} repeats, the two ways of loading "
        "alternating in one run. A tier hit's document is in the host tier only (no disk tier): what is left "
        "to the load is its copy into the cache.",
        "",
        "| torch threads | document | KV | cold | pool hit | tier hit, at once | tier hit, layer by layer "
        "| layer by layer / at once | load cost, at once | load cost, layer by layer | copy alone |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        m = row["median_s"]
        lines.append(
            f"| {row['threads']} | {row['doc_tokens']} | {row['kv_bytes'] / 2**20:.1f} MiB | "
            f"{m['cold'] * 1e3:.1f} ms | "
            f"{m['pool hit'] * 1e3:.1f} ms | {m['tier hit, at once'] * 1e3:.1f} ms | "
            f"{m['tier hit, layer by layer'] * 1e3:.1f} ms | {row['layered_vs_at_once']:.2f}x | "
            f"{row['load_cost']['at once'] * 100:+.0f} % | {row['load_cost']['layer by layer'] * 100:+.0f} % | "
            f"{row['copy_s'] * 1e3:.1f} ms |")
    lines += [
        "",
        "TTFT from the request's arrival at the prefill instance to its first token. *Load cost*: a tier hit's "
        "TTFT over the pool hit's, minus one (the pool hit is the floor: nothing to load). *Copy alone*: the "
        "document's blocks written from host memory into the cache with nothing else running.",
        "",
        *summary(result),
        "",
        "![TTFT by document length](tier_load_overlap.png)",
    ]
    write_lines(path, lines)


def summary(result: dict) -> list[str]:
    """Per thread count: the range of layer by layer / at once, what the copy is worth against a pool hit, and
    how far a pool hit's own repeats spread (the noise any difference sits in)."""
    out = []
    for t in sorted({row["threads"] for row in result["rows"]}):
        rows = [row for row in result["rows"] if row["threads"] == t]
        ratios = [row["layered_vs_at_once"] for row in rows]
        copy = [row["copy_s"] / row["median_s"]["pool hit"] for row in rows]
        spread = max((max(r["runs_s"]["pool hit"]) - min(r["runs_s"]["pool hit"])) / r["median_s"]["pool hit"]
                     for r in rows)
        out.append(f"- {t} torch thread{'s' if t > 1 else ''}: layer by layer took {min(ratios):.2f}x to "
                   f"{max(ratios):.2f}x the TTFT of loading at once; the copy alone is {min(copy):.0%} to "
                   f"{max(copy):.0%} of a pool hit's TTFT; a pool hit's repeats spread by up to {spread:.0%} of "
                   "their median.")
    return out


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:  # a GPU machine without it: the table and JSON are the record
        print(f"matplotlib not installed: no {path}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = sorted({row["threads"] for row in result["rows"]})
    fig, axes = plt.subplots(1, len(threads), figsize=(6 * len(threads), 4), squeeze=False)
    for ax, t in zip(axes[0], threads):
        rows = [row for row in result["rows"] if row["threads"] == t]
        docs = [row["doc_tokens"] for row in rows]
        for name, style in (("pool hit", "--"), ("tier hit, at once", "-"), ("tier hit, layer by layer", "-")):
            ax.plot(docs, [row["median_s"][name] * 1e3 for row in rows], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("document tokens (evicted to the host tier)")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{result['model']}, {result['device']}, {t} torch thread{'s' if t > 1 else ''}")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bundled", choices=["bundled", "llama-3.1-8b"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="auto (as magicserve serve chooses), bfloat16, float32, ...")
    ap.add_argument("--docs", type=int, nargs="+", default=[1024, 4096, 12288], help="document lengths, tokens")
    ap.add_argument("--question", type=int, default=64, help="question length, tokens")
    ap.add_argument("--token-budget", type=int, default=0,
                    help="prompt tokens per pass (0: a whole document in one; a cold prompt is chunked by it)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="torch threads, each a run of every document length (on CPU; ignored on a GPU)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "tier_load_overlap"))
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    dtype = choose_dtype(args.dtype, "cuda" if cuda else "cpu").dtype
    loaded = build_model(args.model, args.device, dtype)
    device_name = torch.cuda.get_device_name(torch.device(args.device)) if cuda else \
        f"{platform.machine()}, {os.cpu_count()} cores"
    rows = []
    for threads in [torch.get_num_threads()] if cuda else args.threads:
        torch.set_num_threads(threads)
        for i, doc in enumerate(args.docs):
            rows.append({"threads": threads, **measure(loaded, doc, args.question, args.repeats, args.device, dtype,
                                                       seed=i, token_budget=args.token_budget)})
            print(f"{threads} threads, {doc} tokens: " +
                  ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in rows[-1]["median_s"].items()), flush=True)
    result = {"command": "python " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:]),
              "model": args.model, "dtype": dtype, "device": device_name, "question_tokens": args.question,
              "repeats": args.repeats, "rows": rows}
    record(result, args.out, write_markdown)
    plot(result, args.out + ".png")


if __name__ == "__main__":
    main()
