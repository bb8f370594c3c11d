#!/usr/bin/env python3
"""Context gain of the default model on a larger unseen set: the Python sources of an installed package.

    PYTHONPATH=. python scripts/eval_context_gain.py --package torch --contexts 2048 3072 4096

``scripts/eval_default_model.py`` measures the context gain (the same target segments scored with C tokens
of context before them, for each C) on the held-out stdlib files: 29 of them are long enough, and the spread
between files then decides the width of the 95 % intervals. This script runs the same measurement
(``eval_default_model.context_gain``, bootstrap over files) on the ``*.py`` files of an installed package,
which the model never saw (the training corpus is the standard library without ``site-packages``; see
``scripts/_corpus.py``). The default package, torch, is pinned by ``requirements-cpu.txt``, so the set is
the same on every machine that installs the project. Files are taken in path order (the corpus loader's
selection rules), those with at least ``max(contexts) + segment + 1`` tokens;
``--segments-per-file`` evenly spaced segments of each (more files, fewer segments per file: the spread is
between files). Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _corpus import load_documents  # noqa: E402
from eval_default_model import DEFAULT_MODEL, RESULTS, ContextGain, context_gain, falls_to  # noqa: E402

from modeling.checkpoint import load_model  # noqa: E402
from modeling.model import CausalLM  # noqa: E402
from modeling.tokenizer import TextTokenizer  # noqa: E402


def package_dir(name: str) -> str:
    """The source directory of an importable package (its ``__init__.py``'s folder)."""
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise SystemExit(f"--package: cannot import {name!r} ({exc}); name an installed package") from exc
    if not getattr(module, "__file__", None) or os.path.basename(module.__file__) != "__init__.py":
        raise SystemExit(f"--package: {name!r} is not a package directory (module file {module.__file__!r})")
    return os.path.dirname(module.__file__)


def gain_markdown(report: dict, heading: str = "#") -> str:
    """The report as a Markdown table of loss per context and drops with their intervals, under a title
    of ``heading`` level."""
    g = report["context_gain"]
    lines = [
        f"{heading} Context gain of `{report['model']}` on the sources of {report['package']} {report['package_version']}",
        "",
        f"`{report['command']}` ({report['eval_seconds']:.0f} s). {g['segments']} segments of {g['segment']} tokens "
        f"from {g['files']} of the package's {report['package_files']} `*.py` files (those with at least "
        f"{report['min_tokens']} tokens; never trained on); each segment scored with exactly C tokens of context "
        "before it. Drop = loss at the previous C minus loss at this C; 95 % interval by resampling files.",
        "",
        "| context C | loss (nats/token) | drop from previous C | 95 % interval | files where it drops |",
        "|---:|---:|---:|---|---:|",
    ]
    table = np.array(g["per_file"])
    for i, (c, loss) in enumerate(zip(g["contexts"], g["loss"])):
        if i == 0:
            lines.append(f"| {c} | {loss:.4f} |  |  |  |")
            continue
        lo, hi = g["drop_ci95"][i - 1]
        dropping = int((table[:, i - 1] > table[:, i]).sum())
        lines.append(f"| {c} | {loss:.4f} | {g['drop'][i - 1]:+.4f} | [{lo:+.4f}, {hi:+.4f}] | {dropping} of {g['files']} |")
    limit = max(g["contexts"])
    lines += ["", f"Every step up to C = {limit} a drop above zero at 95 %: **{report['falls_to_longest']}**", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="HF model directory")
    ap.add_argument("--package", default="torch", help="installed package whose *.py files are the set")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 3072, 4096], help="context lengths C")
    ap.add_argument("--segment", type=int, default=256, help="tokens per scored segment")
    ap.add_argument("--segments-per-file", type=int, default=1, help="evenly spaced segments per file")
    ap.add_argument("--max-files", type=int, default=0, help="evenly spaced subset of the long files (0: all)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--out", default=None, help="output prefix (default benchmarks/results/default_model_context_gain_PACKAGE)")
    args = ap.parse_args(argv)
    if len(set(args.contexts)) < 2 or min(args.contexts) < 1:
        ap.error(f"--contexts: at least two distinct positive lengths, got {args.contexts}")
    for name in ("segment", "segments_per_file", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.max_files < 0:
        ap.error(f"--max-files: must be >= 0 (0 = all), got {args.max_files}")
    return args


def package_gain(model: CausalLM, tok: TextTokenizer, package: str, contexts: list[int], segment: int,
                 segments_per_file: int, max_files: int = 0) -> dict:
    """The context gain on the ``*.py`` files of an installed ``package`` (those long enough), as a report
    (the fields ``gain_markdown`` reads, less ``command`` and ``eval_seconds``)."""
    contexts = sorted(set(contexts))
    min_tokens = max(contexts) + segment + 1
    docs = load_documents(package_dir(package))
    encoded = [(d.path, np.asarray(tok.encode(d.text), dtype=np.int32)) for d in docs]
    long_files = [(p, ids) for p, ids in encoded if ids.size >= min_tokens]
    if max_files and len(long_files) > max_files:
        long_files = [long_files[i * len(long_files) // max_files] for i in range(max_files)]
    if len(long_files) < 2:
        raise SystemExit(f"--package {package}: only {len(long_files)} files with >= {min_tokens} tokens")
    print(f"{package}: {len(docs)} files, {len(long_files)} with >= {min_tokens} tokens", flush=True)
    gain: ContextGain = context_gain(model, [ids for _, ids in long_files], contexts, segment, segments_per_file)
    return {
        "package": package,
        "package_version": importlib.metadata.version(package),
        "package_files": len(docs),
        "min_tokens": min_tokens,
        "files": [p for p, _ in long_files],
        "context_gain": asdict(gain),
        "falls_to_longest": falls_to(gain, max(contexts)),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    tok = TextTokenizer(args.model)
    loaded = load_model(args.model, dtype="float32")
    gain = package_gain(loaded.model, tok, args.package, args.contexts, args.segment, args.segments_per_file,
                        args.max_files)
    out = args.out or os.path.join(RESULTS, f"default_model_context_gain_{args.package}")
    report = {
        "command": "python scripts/eval_context_gain.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": os.path.relpath(os.path.abspath(args.model), REPO),
        **gain,
        "eval_seconds": time.time() - t0,
        "torch": torch.__version__,
    }
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write(gain_markdown(report))
    print(gain_markdown(report))


if __name__ == "__main__":
    main()
