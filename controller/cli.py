"""The ``magicserve`` command line.

Subcommands:
  run    generate locally with the single-process reference engine (no server), streaming to stdout
  demo   run a few prompts on the bundled default model and print TTFT / TPOT
"""

from __future__ import annotations

import argparse
import sys
import time

from controller.defaults import DEFAULT_MODEL_DIR, DEMO_PROMPTS
from modeling.errors import MagicServeError


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL_DIR, help="local HF checkpoint directory")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="magicserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate locally with the reference engine")
    _add_engine_args(run)
    _add_sampling_args(run)
    run.add_argument("--prompt", required=True)
    demo = sub.add_parser("demo", help="stream a few prompts on the bundled model")
    _add_engine_args(demo)
    demo.add_argument("--max-tokens", type=int, default=48)
    return parser


def _engine(args):
    import torch

    from modeling.engine import EngineConfig, ReferenceEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    return ReferenceEngine(args.model, EngineConfig(dtype=args.dtype, device=args.device, kv_cache_tokens=32768))


def cmd_run(args) -> int:
    from modeling.sampling import SamplingParams

    engine = _engine(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop))
    engine.add_request(args.prompt, params)
    sys.stdout.write(args.prompt)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_demo(args) -> int:
    from modeling.sampling import SamplingParams

    print(f"magicserve demo: reference engine, model {args.model}, {args.dtype} on {args.device}")
    start = time.perf_counter()
    engine = _engine(args)
    print(f"loaded in {time.perf_counter() - start:.1f}s\n")
    params = SamplingParams(max_tokens=args.max_tokens)
    results = engine.generate(list(DEMO_PROMPTS), params)
    for prompt, out in zip(DEMO_PROMPTS, results):
        print(f"--- prompt ({len(out.prompt_ids)} tokens) ---\n{prompt}\033[1m{out.text}\033[0m")
        print(f"    [{len(out.token_ids)} tokens, finish={out.finish_reason.value}, "
              f"TTFT {out.ttft_s * 1000:.0f} ms, TPOT {out.tpot_s * 1000:.1f} ms]\n")
    n = sum(len(r.token_ids) for r in results)
    elapsed = time.perf_counter() - start
    print(f"{len(results)} requests, {n} tokens in {elapsed:.1f}s (batched: all prompts ran concurrently)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"run": cmd_run, "demo": cmd_demo}[args.command](args)
    except (MagicServeError, ValueError) as err:
        print(f"magicserve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
