#!/usr/bin/env python3
"""Evaluate the bundled default model on the held-out stdlib files.

    PYTHONPATH=. python scripts/eval_default_model.py [--model models/stdlib-llama-15m]

Two held-out sets, both from the deterministic split of ``scripts/_corpus.py`` (files never trained on):

* **stream**: all held-out files concatenated (each followed by ``<|endoftext|>``), first
  ``--stream-tokens`` tokens. For each context L the same tokens are cut into non-overlapping windows of L,
  so the perplexities at 512 / 2K / 4K / 8K score exactly the same tokens.
* **long files**: held-out files with at least 8192 tokens, first 8192 tokens of each, again cut into
  non-overlapping windows of L for the perplexity. The loss-by-position curves (PNG) average over
  overlapping windows starting every L/4 tokens (``--curve-overlap``), so that each stretch of text is
  seen at several positions and the curve measures the effect of position, not of file layout.

* **context gain** (the check that the model uses long context): the raw loss-by-position curve mixes
  the effect of position with *which* text sits at each position (there are few long files), so it is
  noisy at the 0.01-nat level. Here the scored tokens are held fixed and only the context changes: for
  every held-out file with at least ``max(--gain-contexts) + --gain-segment + 1`` tokens, up to
  ``--gain-segments-per-file`` evenly spaced segments of ``--gain-segment`` tokens (all past position
  ``max(--gain-contexts)``) are scored with exactly C tokens of context before them, for each C. The loss
  falls with position up to 4K when every step of this curve up to C = 4096 is a drop whose 95 %
  bootstrap interval (resampling files) lies above zero.

The model runs through the project's own loader (``modeling.checkpoint.load_model``) under bf16 autocast,
as in training. Writes ``benchmarks/results/default_model_eval.{json,md}`` and
``default_model_loss_by_position.png``, plus greedy samples, and two sections that check the weights beyond
the held-out split:

* **context gain on an installed package** (``--gain-package``, default torch, pinned by
  ``requirements-cpu.txt``): the same measurement on a larger unseen set (``eval_context_gain.py``, which
  runs it alone);
* **the weights in vLLM** (``--vllm-python``, default the peer environment ``.peers/vllm``): vLLM's CPU build
  loads the directory and continues the greedy samples' prompts (``check_vllm_loads.py``, run by that
  environment's Python). Without the environment the section says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _corpus import EOS_TOKEN, load_documents, split_documents  # noqa: E402

from modeling.checkpoint import load_model  # noqa: E402
from modeling.model import CausalLM  # noqa: E402
from modeling.tokenizer import TextTokenizer  # noqa: E402

DEFAULT_MODEL = os.path.join(REPO, "models", "stdlib-llama-15m")
RESULTS = os.path.join(REPO, "benchmarks", "results")
CONTEXTS = (512, 2048, 4096, 8192)
HOLDOUT_PERMILLE = 40  # must match TrainConfig.holdout_permille
BUCKET_EDGES = (0, 16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192)
# Prompts end before the newline: byte-level BPE merges a newline with the next line's indentation
# ("\n   " is one token), so a prompt ending in a bare "\n" would force a split never seen in training.
PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main(argv):",
    'class Stack:\n    """A simple LIFO stack."""\n\n    def __init__(self):',
    'def read_config(path):\n    """Read a configuration file and return a dict."""',
)


@dataclass
class ContextResult:
    """Figures of one context length on one set."""

    context: int
    windows: int
    tokens: int
    loss: float
    perplexity: float
    bucket_loss: list[float | None]  # mean loss per BUCKET_EDGES bucket (None past the context)


def token_losses(model: CausalLM, ids: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """Per-token next-token loss [S-1] of one window ids [S] (cross-entropy in chunks)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model.forward_dense(ids[None, :-1])[0]
    targets = ids[1:]
    parts = [F.cross_entropy(logits[i : i + chunk].float(), targets[i : i + chunk], reduction="none")
             for i in range(0, targets.numel(), chunk)]
    return torch.cat(parts)


def evaluate_windows(model: CausalLM, sequences: list[np.ndarray], context: int, stride: int | None = None) -> ContextResult:
    """Score windows of ``context`` tokens cut from each sequence.

    Perplexity uses the non-overlapping windows (starts at multiples of ``context``), so every context length
    scores the same tokens. The loss-by-position buckets use all windows, starting every ``stride`` tokens
    (default: ``context``): overlapping windows put each piece of text at several positions, so the curve
    shows the effect of position rather than of what happens to sit at the top of the files.
    A window of L tokens scores L-1 predictions; position p in the buckets is the index of the predicted
    token, i.e. it had p tokens of context.
    """
    stride = stride or context
    sums = np.zeros(len(BUCKET_EDGES) - 1)
    counts = np.zeros(len(BUCKET_EDGES) - 1)
    positions = np.arange(1, context)
    bucket = np.searchsorted(BUCKET_EDGES, positions, side="right") - 1
    total, n, windows = 0.0, 0, 0
    for seq in tqdm(sequences, desc=f"context {context}", unit="seq", leave=False):
        for start in range(0, len(seq) - context + 1, stride):
            ids = torch.from_numpy(seq[start : start + context].astype(np.int64))
            losses = token_losses(model, ids).numpy().astype(np.float64)
            np.add.at(sums, bucket, losses)
            np.add.at(counts, bucket, 1)
            if start % context == 0:
                total += losses.sum()
                n += losses.size
                windows += 1
    loss = total / n
    buckets = [float(s / c) if c else None for s, c in zip(sums, counts)]
    return ContextResult(context, windows, n, loss, math.exp(loss), buckets)


def build_sets(tok: TextTokenizer, stream_tokens: int, min_long: int
               ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], dict]:
    """(stream, long files cut to min_long, all held-out files whole, description) from the held-out split."""
    _, held = split_documents(load_documents(), HOLDOUT_PERMILLE)
    eos = tok._tok.token_to_id(EOS_TOKEN)
    encoded = [(d.path, np.asarray(tok.encode(d.text), dtype=np.int32)) for d in held]
    stream = np.concatenate([np.append(ids, eos) for _, ids in encoded])
    stream = stream[: (min(stream_tokens, stream.size) // min_long) * min_long]
    long_files = [(p, ids[:min_long]) for p, ids in encoded if ids.size >= min_long]
    info = {
        "heldout_files": len(held),
        "heldout_tokens": int(sum(ids.size + 1 for _, ids in encoded)),
        "stream_tokens": int(stream.size),
        "long_files": [p for p, _ in long_files],
        "long_file_tokens": min_long,
    }
    return [stream], [ids for _, ids in long_files], [ids for _, ids in encoded], info


GAIN_CONTEXTS = (256, 512, 1024, 2048, 3072, 4096)


@dataclass
class ContextGain:
    """Loss of fixed target segments as a function of the context before them (see module docstring)."""

    contexts: list[int]
    segment: int
    files: int
    segments: int
    loss: list[float]  # mean over files of each file's mean segment loss, per context
    drop: list[float]  # loss[i] - loss[i + 1]: what going from contexts[i] to contexts[i + 1] gains
    drop_ci95: list[tuple[float, float]]  # bootstrap over files
    per_file: list[list[float]]  # [files][contexts]


def context_gain(model: CausalLM, files: list[np.ndarray], contexts: list[int], segment: int,
                 per_file: int, seed: int = 0, resamples: int = 2000) -> ContextGain:
    """Score the same segments with each context length; bootstrap the successive drops over files."""
    longest = max(contexts)
    losses = []
    n_segments = 0
    for ids in tqdm(files, desc="context gain", unit="file", leave=False):
        ends = list(range(longest + segment + 1, ids.size + 1, segment))  # segment [end - segment, end)
        if not ends:
            continue
        if len(ends) > per_file:
            ends = [ends[i * len(ends) // per_file] for i in range(per_file)]
        n_segments += len(ends)
        sums = np.zeros(len(contexts))
        for end in ends:
            for j, ctx in enumerate(contexts):
                # ctx + segment + 1 tokens give ctx + segment predictions; the last `segment` predict the
                # segment's tokens, the first of them with exactly ctx tokens before it
                window = torch.from_numpy(ids[end - segment - ctx - 1 : end].astype(np.int64))
                sums[j] += token_losses(model, window)[-segment:].double().sum().item()
        losses.append(sums / (len(ends) * segment))
    table = np.array(losses)  # [files, contexts]
    boot = bootstrap_file_means(table, resamples, seed)
    drops = boot[:, :-1] - boot[:, 1:]
    mean = table.mean(0)
    return ContextGain(
        contexts=list(contexts), segment=segment, files=len(table), segments=n_segments,
        loss=[float(x) for x in mean], drop=[float(a - b) for a, b in zip(mean, mean[1:])],
        drop_ci95=[(float(lo), float(hi)) for lo, hi in zip(np.percentile(drops, 2.5, axis=0),
                                                             np.percentile(drops, 97.5, axis=0))],
        per_file=table.tolist(),
    )


def bootstrap_file_means(table: np.ndarray, resamples: int = 2000, seed: int = 0) -> np.ndarray:
    """[resamples, columns] means of ``table`` [files, columns] over files drawn with replacement."""
    rng = np.random.default_rng(seed)
    return np.array([table[rng.integers(0, len(table), len(table))].mean(0) for _ in range(resamples)])


def falls_to(gain: ContextGain, limit: int) -> bool:
    """Every step of the context-gain curve up to ``limit`` is a drop with a 95 % interval above zero."""
    steps = [ci for ci, c in zip(gain.drop_ci95, gain.contexts[1:]) if c <= limit]
    return bool(steps) and all(lo > 0 for lo, _ in steps)


def greedy(model: CausalLM, tok: TextTokenizer, prompt: str, max_new: int, eos_ids: tuple[int, ...]) -> str:
    """Greedy continuation of ``prompt`` (full recompute each step; short prompts only)."""
    ids = tok.encode(prompt)
    for _ in range(max_new):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            nxt = int(model.forward_dense(torch.tensor([ids]))[0, -1].argmax())
        if nxt in eos_ids:
            break
        ids.append(nxt)
    return tok.decode(ids)


def raw_curve_falls_until(curve: list[float | None], limit: int) -> bool:
    """True when the raw bucket means from position 256 up to ``limit`` never rise by more than 0.01 nat
    (a noisy check: position is confounded with content; see context_gain for the controlled one)."""
    vals = [v for edge, v in zip(BUCKET_EDGES, curve) if v is not None and 256 <= edge < limit]
    return all(b <= a + 0.01 for a, b in zip(vals, vals[1:])) and vals[-1] < vals[0]


def plot(results: dict[str, list[ContextResult]], gain: ContextGain, path: str) -> None:
    """Left: raw loss by position bucket, one line per context (long files). Right: the context gain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mids = [(a + b) / 2 for a, b in zip(BUCKET_EDGES, BUCKET_EDGES[1:])]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    for r in results["long_files"]:
        xs = [m for m, v in zip(mids, r.bucket_loss) if v is not None]
        ys = [v for v in r.bucket_loss if v is not None]
        ax.plot(xs, ys, marker="o", ms=3, label=f"context {r.context} (ppl {r.perplexity:.2f})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in window (tokens of context), bucket midpoint")
    ax.set_ylabel("mean next-token loss (nats)")
    ax.set_title("stdlib-llama: held-out loss by position (held-out files of 8K+ tokens)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    # controlled: the same segments scored with more and more context; error bars = 95 % bootstrap of
    # the loss relative to the longest context
    table = np.array(gain.per_file)
    rel = table - table[:, -1:]
    boot = bootstrap_file_means(rel)
    lo, hi = np.percentile(boot, 2.5, axis=0), np.percentile(boot, 97.5, axis=0)
    mean = rel.mean(0)
    ax2.errorbar(gain.contexts, mean, yerr=[mean - lo, hi - mean], marker="o", capsize=3)
    ax2.axhline(0.0, color="grey", linewidth=0.8)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("tokens of context before the scored segment")
    ax2.set_ylabel(f"loss minus loss at context {gain.contexts[-1]} (nats)")
    ax2.set_title(f"same {gain.segments} segments of {gain.segment} tokens ({gain.files} files), more context")
    ax2.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_markdown(report: dict, path: str) -> None:
    """Human-readable tables of the report."""
    lines = [f"# Default model evaluation: `{report['model']}`", "",
             f"`{report['command']}` (writes `default_model_eval.{{json,md}}` and `default_model_loss_by_position.png`)",
             "",
             f"Held-out split: {report['sets']['heldout_files']} stdlib files "
             f"({report['sets']['heldout_tokens']} tokens), never trained on. bf16 autocast on CPU, "
             f"{report['eval_seconds']:.0f} s.", ""]
    for name, title in (("stream", f"All held-out files as one stream (first {report['sets']['stream_tokens']} tokens)"),
                        ("long_files", f"Held-out files with >= 8192 tokens ({len(report['sets']['long_files'])} files, "
                                       "first 8192 tokens each)")):
        lines += [f"## {title}", "", "| context | windows | tokens scored | loss (nats/token) | perplexity |",
                  "|---:|---:|---:|---:|---:|"]
        for r in report[name]:
            lines.append(f"| {r['context']} | {r['windows']} | {r['tokens']} | {r['loss']:.4f} | {r['perplexity']:.3f} |")
        lines.append("")
    lines += ["## Mean loss by position (long files)", "",
              f"Windows of each context start every context/{report['curve_overlap']} tokens of the long files "
              "(overlapping), one 8192-token window per file for context 8192.", "",
              "| positions | " + " | ".join(f"ctx {r['context']}" for r in report["long_files"]) + " |",
              "|---|" + "---:|" * len(report["long_files"])]
    for i, (a, b) in enumerate(zip(BUCKET_EDGES, BUCKET_EDGES[1:])):
        cells = [r["bucket_loss"][i] for r in report["long_files"]]
        if all(c is None for c in cells):
            continue
        lines.append(f"| {a}-{b - 1} | " + " | ".join("" if c is None else f"{c:.3f}" for c in cells) + " |")
    lines += ["", f"Raw curve (context 4096) never rises by more than 0.01 nat from position 256 to 4K: "
                  f"{report['raw_curve_falls_to_4k']}", ""]
    g = report["context_gain"]
    lines += ["## Context gain: the same tokens, scored with more context", "",
              f"{g['segments']} segments of {g['segment']} tokens from {g['files']} held-out files (each past position "
              f"{max(g['contexts'])}); each segment scored with exactly C tokens of context before it. "
              "Drop = loss at the previous C minus loss at this C; 95 % interval by resampling files.", "",
              "| context C | loss (nats/token) | drop from previous C | 95 % interval |", "|---:|---:|---:|---|"]
    for i, (c, loss) in enumerate(zip(g["contexts"], g["loss"])):
        drop = "" if i == 0 else f"{g['drop'][i - 1]:+.4f}"
        ci = "" if i == 0 else f"[{g['drop_ci95'][i - 1][0]:+.4f}, {g['drop_ci95'][i - 1][1]:+.4f}]"
        lines.append(f"| {c} | {loss:.4f} | {drop} | {ci} |")
    lines += ["", f"Loss keeps falling with position up to 4K (every drop up to C = 4096 above zero at 95 %): "
                  f"**{report['loss_falls_to_4k']}**", "", "![loss by position](default_model_loss_by_position.png)",
              "", "## Greedy samples", ""]
    for s in report["samples"]:
        lines += ["```python", s["output"], "```", ""]
    lines += package_gain_section(report.get("context_gain_package"))
    lines += vllm_section(report.get("vllm_check"))
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def package_gain_section(gain: dict | None) -> list[str]:
    """The context gain on an installed package's sources, or why it is absent."""
    if gain is None:
        return ["## Context gain on an installed package", "", "Not run (`--gain-package none`).", ""]
    from eval_context_gain import gain_markdown

    return [gain_markdown(gain, heading="##"), ""]


def vllm_section(check: dict | None) -> list[str]:
    """vLLM's load-and-continue check of the same weights, or why it did not run."""
    lines = ["## The weights in vLLM", ""]
    if check is None or "skipped" in (check or {}):
        reason = (check or {}).get("skipped", "not run")
        return lines + [f"Not run: {reason}.", ""]
    agree = sum(r["agrees"] for r in check["samples"])
    lines += [f"`{check['command']}`", "",
              f"vLLM {check['vllm_version']} loads `{check['model']}` in {check['load_seconds']} s; its greedy text "
              f"({check['max_tokens']} new tokens) matches magicserve's on {agree} of {len(check['samples'])} "
              f"prompts above (all agree: **{check['all_agree']}**).", ""]
    return lines


def run_vllm_check(vllm_python: str, model: str, report_path: str) -> dict:
    """Run ``check_vllm_loads.py`` with the vLLM environment's Python on the report's greedy samples."""
    if not vllm_python:
        return {"skipped": "no vLLM environment (`--vllm-python`; see ../shared/PEERS.md for `.peers/vllm`)"}
    script = os.path.join(REPO, "scripts", "check_vllm_loads.py")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "check.json")
        argv = [vllm_python, script, "--model", os.path.relpath(model, REPO), "--expect",
                os.path.relpath(report_path, REPO), "--out", out]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        done = subprocess.run(argv, cwd=REPO, env=env)
        if not os.path.exists(out):
            raise SystemExit(f"vLLM check failed (exit {done.returncode}): {shlex.join(argv)}")
        with open(out, encoding="utf-8") as f:
            check = json.load(f)
    check["command"] = shlex.join(["python", "scripts/check_vllm_loads.py", *argv[2:-2]])
    return check


def write_report(report: dict, out_dir: str) -> str:
    """Write the JSON and Markdown records; the JSON's path."""
    path = os.path.join(out_dir, "default_model_eval.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    write_markdown(report, os.path.join(out_dir, "default_model_eval.md"))
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="HF model directory")
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS), help="context lengths")
    parser.add_argument("--stream-tokens", type=int, default=131072, help="tokens of the held-out stream")
    parser.add_argument("--curve-overlap", type=int, default=4,
                        help="long-file windows for the position curve start every context/N tokens")
    parser.add_argument("--gain-contexts", type=int, nargs="+", default=list(GAIN_CONTEXTS),
                        help="context lengths of the context-gain curve")
    parser.add_argument("--gain-segment", type=int, default=256, help="tokens per scored segment")
    # the interval resamples files, so more segments per file only shrink each file's own noise; with 6
    # (149 segments in all) the 3K -> 4K drop of the phase-4 weights was +0.0026, [-0.0005, +0.0058]
    parser.add_argument("--gain-segments-per-file", type=int, default=32,
                        help="segments per file at most (about 3 s each on 2 cores)")
    parser.add_argument("--max-new", type=int, default=96, help="tokens per greedy sample")
    parser.add_argument("--out-dir", default=RESULTS, help="where the json/md/png go")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--gain-package", default="torch",
                        help="installed package whose *.py files get the context-gain measurement too ('none': skip)")
    parser.add_argument("--gain-package-contexts", type=int, nargs="+", default=[2048, 3072, 4096],
                        help="context lengths of the package's context-gain curve")
    peer = os.path.join(REPO, ".peers", "vllm", "bin", "python")
    parser.add_argument("--vllm-python", default=peer if os.path.exists(peer) else "",
                        help="Python of a vLLM environment to check the weights load there (default: .peers/vllm "
                             "when present; '' skips)")
    args = parser.parse_args(argv)
    if len(set(args.gain_package_contexts)) < 2 or min(args.gain_package_contexts) < 1:
        parser.error(f"--gain-package-contexts: at least two distinct positive lengths, got {args.gain_package_contexts}")
    if args.vllm_python and not os.path.exists(args.vllm_python):
        parser.error(f"--vllm-python: {args.vllm_python} does not exist")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    loaded = load_model(args.model, dtype="float32")
    tok = TextTokenizer(args.model)
    longest = max(args.contexts)
    stream, long_files, whole_files, sets = build_sets(tok, args.stream_tokens, longest)
    print(f"sets: {sets['stream_tokens']} stream tokens, {len(long_files)} long files", flush=True)
    results: dict[str, list[ContextResult]] = {"stream": [], "long_files": []}
    for name, seqs in (("long_files", long_files), ("stream", stream)):
        for ctx in args.contexts:
            stride = max(ctx // args.curve_overlap, 1) if name == "long_files" else ctx
            r = evaluate_windows(loaded.model, seqs, ctx, stride)
            results[name].append(r)
            print(f"{name:10s} ctx {ctx:5d}: loss {r.loss:.4f} ppl {r.perplexity:.3f} "
                  f"({r.windows} windows, {time.time() - t0:.0f}s)", flush=True)
    gain = context_gain(loaded.model, whole_files, sorted(args.gain_contexts), args.gain_segment,
                        args.gain_segments_per_file)
    print(f"context gain over {gain.files} files: loss {[round(x, 4) for x in gain.loss]} "
          f"({time.time() - t0:.0f}s)", flush=True)
    samples = [{"prompt": p, "output": greedy(loaded.model, tok, p, args.max_new, loaded.eos_token_ids)}
               for p in PROMPTS]
    curve_4k = next((r.bucket_loss for r in results["long_files"] if r.context == 4096), None)
    report = {
        "command": shlex.join(["PYTHONPATH=.", "python", "scripts/eval_default_model.py",
                               *(argv if argv is not None else sys.argv[1:])]),
        "model": os.path.relpath(os.path.abspath(args.model), REPO),
        "parameters": loaded.config.num_parameters(),
        "sets": sets,
        "bucket_edges": list(BUCKET_EDGES),
        "stream": [asdict(r) for r in results["stream"]],
        "long_files": [asdict(r) for r in results["long_files"]],
        "curve_overlap": args.curve_overlap,
        "raw_curve_falls_to_4k": bool(curve_4k and raw_curve_falls_until(curve_4k, 4096)),
        "context_gain": asdict(gain),
        "loss_falls_to_4k": falls_to(gain, 4096),
        "samples": samples,
        "eval_seconds": time.time() - t0,
        "torch": torch.__version__,
        "dtype": "bf16 autocast (weights bf16 on disk)",
    }
    os.makedirs(args.out_dir, exist_ok=True)
    plot(results, gain, os.path.join(args.out_dir, "default_model_loss_by_position.png"))
    if args.gain_package != "none":
        from eval_context_gain import package_gain

        t1 = time.time()
        report["context_gain_package"] = {
            "command": shlex.join(["python", "scripts/eval_context_gain.py", "--package", args.gain_package,
                                   "--contexts", *map(str, args.gain_package_contexts)]),
            "model": report["model"],
            **package_gain(loaded.model, tok, args.gain_package, args.gain_package_contexts, args.gain_segment, 1),
            "eval_seconds": time.time() - t1,
            "torch": torch.__version__,
        }
    report_path = write_report(report, args.out_dir)  # the vLLM check reads its greedy samples
    report["vllm_check"] = run_vllm_check(args.vllm_python, args.model, report_path)
    write_report(report, args.out_dir)
    for s in samples:
        print("-" * 60 + "\n" + s["output"])
    print(f"done in {report['eval_seconds']:.0f}s; loss falls to 4K: {report['loss_falls_to_4k']}")


if __name__ == "__main__":
    main()
