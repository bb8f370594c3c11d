"""Structured output on the bundled model, on one decode worker: does constrained output validate, what does
the grammar cost, and what do grammar-aware drafts buy speculation.

* Validity: every schema (nested objects, enums, arrays, numbers with ranges, arrays of records) after
  every prompt (held-out standard-library source ending where a JSON literal would start), greedy and
  sampled (temperature 1): the output must parse and validate (``jsonschema``). The same prompts without
  the constraint show what the model writes otherwise.
* Speed: one batch of constrained requests (greedy) decoded with speculation off, with drafts under the
  grammar (``grammar_drafts``), and with the grammar on the verification only; and the same batch
  unconstrained (``ignore_eos``, the same number of tokens per request). Tokens/s and the acceptance rate
  per configuration, in interleaved rounds (median), and the grammar's share of the step time.
* Beside free requests: half the batch constrained, half not; the median step time against the all-free
  batch, and the mask time per step.

    python benchmarks/structured_output.py                 # -> benchmarks/results/structured_output.*
    python benchmarks/structured_output.py --rounds 1 --batch 4 --out runs/structured_output
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._record import record, write_lines  # noqa: E402
from benchmarks.spec_decode import heldout_tokens  # noqa: E402
from controller.defaults import DEFAULT_MODEL_DIR  # noqa: E402
from decode_worker.config import DecodeWorkerConfig, SpeculationConfig  # noqa: E402
from decode_worker.worker import DecodeWorker  # noqa: E402
from modeling import grammar  # noqa: E402
from modeling.sampling import SamplingParams  # noqa: E402
from modeling.structured_output import StructuredOutput  # noqa: E402
from modeling.tokenizer import TextTokenizer  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "owner": {"type": "object", "properties": {"user": {"type": "string", "maxLength": 12},
                                                    "uid": {"type": "integer", "minimum": 0, "maximum": 65535}},
                  "required": ["user", "uid"], "additionalProperties": False}},
        "required": ["name", "owner"], "additionalProperties": False},
    "enum_and_array": {"type": "object", "properties": {
        "level": {"enum": ["DEBUG", "INFO", "WARNING", "ERROR"]},
        "handlers": {"type": "array", "items": {"enum": ["console", "file", "syslog"]}, "minItems": 1,
                     "maxItems": 3}},
        "required": ["level", "handlers"], "additionalProperties": False},
    "number_ranges": {"type": "object", "properties": {
        "timeout": {"type": "number", "minimum": 0.5, "maximum": 60},
        "retries": {"type": "integer", "minimum": 0, "maximum": 10},
        "verbose": {"type": "boolean"}},
        "required": ["timeout", "retries", "verbose"], "additionalProperties": False},
    "array_of_records": {"type": "object", "properties": {
        "files": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
            "path": {"type": "string", "maxLength": 20}, "size": {"type": "integer", "minimum": 0}},
            "required": ["path", "size"], "additionalProperties": False}}},
        "required": ["files"], "additionalProperties": False},
}
SUFFIX = "\n\n# the settings above, as JSON\nSETTINGS = "


def worker_for(spec: SpeculationConfig, batch: int, dtype: str) -> DecodeWorker:
    cfg = DecodeWorkerConfig(dtype=dtype, kv_cache_tokens=65536, max_num_seqs=max(batch, 8), profile_on_start=False,
                             prefix_caching=False, speculation=spec)
    return DecodeWorker(DEFAULT_MODEL_DIR, cfg)


def run(worker: DecodeWorker, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Admit every request, decode to the end; tokens, finish reasons and timings of the decode steps."""
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}

    def take(deltas):
        for d in deltas:
            outs.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished:
                reasons[d.request_id] = d.finish_reason

    for i, (p, sp) in enumerate(zip(prompts, params)):
        take(worker.add_local(f"r{i}", p, sp))
    m = worker.metrics
    steps0, draft0, acc0, mask0 = m.steps, m.draft_tokens, m.accepted_tokens, grammar.mask_seconds()
    step_times = []
    t0 = time.perf_counter()
    while worker.has_work():
        s = time.perf_counter()
        take(worker.step())
        step_times.append(time.perf_counter() - s)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(v) for v in outs.values()) - len(prompts)  # the first tokens came with admission
    return {"outputs": [outs[f"r{i}"] for i in range(len(prompts))],
            "reasons": [reasons.get(f"r{i}") for i in range(len(prompts))],
            "tokens": tokens, "seconds": elapsed, "steps": m.steps - steps0,
            "median_step_ms": 1e3 * statistics.median(step_times) if step_times else 0.0,
            "draft_tokens": m.draft_tokens - draft0, "accepted_tokens": m.accepted_tokens - acc0,
            "mask_seconds": grammar.mask_seconds() - mask0}


def validity(tokenizer: TextTokenizer, prompts: list[list[int]], spec: SpeculationConfig, dtype: str,
             seeds: int) -> dict:
    import jsonschema

    worker = worker_for(spec, 16, dtype)
    rows = {}
    for name, schema in tqdm(SCHEMAS.items(), desc="validity", leave=False):
        structured = StructuredOutput.json_schema(schema)
        cases = [SamplingParams(max_tokens=200, structured=structured)] + [
            SamplingParams(max_tokens=200, temperature=1.0, seed=s, structured=structured) for s in range(seeds)]
        reqs = [(p, sp) for p in prompts for sp in cases]
        res = run(worker, [r[0] for r in reqs], [r[1] for r in reqs])
        free = run(worker, prompts, [SamplingParams(max_tokens=200)] * len(prompts))
        rows[name] = {"requests": len(reqs), "valid": sum(_valid(tokenizer.decode(o), schema, jsonschema)
                                                          for o in res["outputs"]),
                      "stopped": sum(r == "stop" for r in res["reasons"]),
                      "free_valid": sum(_valid(tokenizer.decode(o), schema, jsonschema) for o in free["outputs"]),
                      "free_requests": len(prompts),
                      "example": tokenizer.decode(res["outputs"][0]),
                      "free_example": tokenizer.decode(free["outputs"][0])[:80]}
    return rows


def _valid(text: str, schema: dict, jsonschema) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def speed(prompts: list[list[int]], args) -> dict:
    budget = SpeculationConfig(drafter="self_sparse", k_policy="fixed", k=args.k, budget=args.budget, sink_tokens=8)
    configs = {  # the first one's outputs set the free requests' lengths
        "constrained, no speculation": (SpeculationConfig(drafter="none"), True),
        "free, no speculation": (SpeculationConfig(drafter="none"), False),
        "free, speculation": (budget, False),
        "constrained, speculation, drafts under the grammar": (budget, True),
        "constrained, speculation, grammar on verification only": (
            SpeculationConfig(**{**budget.__dict__, "grammar_drafts": False}), True),
    }
    names = list(SCHEMAS)
    constrained = [SamplingParams(max_tokens=args.max_tokens, structured=StructuredOutput.json_schema(
        SCHEMAS[names[i % len(names)]])) for i in range(len(prompts))]
    workers = {name: worker_for(spec, len(prompts), args.dtype) for name, (spec, _) in configs.items()}
    samples: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in tqdm(range(args.rounds), desc="speed rounds", leave=False):
        for name, (_, is_constrained) in configs.items():
            params = constrained
            if not is_constrained:  # as many tokens as the constrained requests came to (greedy: every round)
                lengths = [len(o) for o in samples["constrained, no speculation"][0]["outputs"]]
                params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
            samples[name].append(run(workers[name], prompts, params))
    out = {}
    for name, runs in samples.items():
        tps = [r["tokens"] / r["seconds"] for r in runs]
        draft = sum(r["draft_tokens"] for r in runs)
        out[name] = {"tokens_per_s": statistics.median(tps), "tokens_per_s_all": tps,
                     "tokens": runs[0]["tokens"], "median_step_ms": statistics.median(r["median_step_ms"] for r in runs),
                     "acceptance": sum(r["accepted_tokens"] for r in runs) / draft if draft else None,
                     "mask_ms_per_step": 1e3 * sum(r["mask_seconds"] for r in runs) / max(1, sum(r["steps"] for r in runs)),
                     "grammar_share": sum(r["mask_seconds"] for r in runs) / sum(r["seconds"] for r in runs)}
    base = samples["constrained, no speculation"][0]["outputs"]
    for name in ("constrained, speculation, drafts under the grammar",
                 "constrained, speculation, grammar on verification only"):
        out[name]["identical_to_no_speculation"] = all(r["outputs"] == base for r in samples[name])
    return out


def beside(prompts: list[list[int]], args) -> dict:
    spec = SpeculationConfig(drafter="self_sparse", k_policy="fixed", k=args.k, budget=args.budget, sink_tokens=8)
    worker = worker_for(spec, len(prompts), args.dtype)
    names = list(SCHEMAS)
    free = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)] * len(prompts)
    mixed = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True) if i % 2 else SamplingParams(
        max_tokens=args.max_tokens, structured=StructuredOutput.json_schema(SCHEMAS[names[i // 2 % len(names)]]))
        for i in range(len(prompts))]
    rows = {"all free": [], "half constrained": []}
    for _ in tqdm(range(args.rounds), desc="beside", leave=False):
        rows["all free"].append(run(worker, prompts, free))
        rows["half constrained"].append(run(worker, prompts, mixed))
    return {name: {"median_step_ms": statistics.median(r["median_step_ms"] for r in runs),
                   "mask_ms_per_step": 1e3 * sum(r["mask_seconds"] for r in runs) / max(1, sum(r["steps"] for r in runs))}
            for name, runs in rows.items()}


def write_markdown(result: dict, path: str) -> None:
    a = result["args"]
    lines = ["# Structured output: validity, cost, and grammar-aware speculation", "",
             f"`{result['command']}`", "",
             f"{result['machine']}; bundled model `{result['model']}` ({a['dtype']}), one decode worker in process; "
             f"prompts: {a['batch']} windows of {a['prompt_tokens']} held-out standard-library tokens ending in "
             f"`{SUFFIX!r}`; self-sparse drafts, budget {a['budget']} (sink 8), fixed k = {a['k']}.", "",
             "## Validity", "",
             "| schema | constrained requests | valid JSON that validates | stopped by the grammar | "
             "unconstrained: valid | example (greedy) |", "|---|---:|---:|---:|---:|---|"]
    for name, r in result["validity"].items():
        lines.append(f"| {name} | {r['requests']} | {r['valid']} ({100 * r['valid'] / r['requests']:.0f} %) | "
                     f"{r['stopped']} | {r['free_valid']} of {r['free_requests']} | `{r['example']}` |")
    lines += ["", "Requests per schema: each prompt greedy and with seeds 0.. at temperature 1, max_tokens 200. "
              "Without the constraint the model writes Python (first prompt's output begins "
              f"`{next(iter(result['validity'].values()))['free_example'][:40]!r}`).", "",
              "## Speed", "",
              f"A batch of {a['batch']} requests, the four schemas in turn, greedy; free requests decode as many tokens "
              f"(ignore_eos) as the constrained ones came to. Median of {a['rounds']} interleaved rounds.", "",
              "| configuration | tokens/s | all rounds | acceptance | median step (ms) | mask ms / step | "
              "grammar share of time | output = no speculation |", "|---|---:|---|---:|---:|---:|---:|---|"]
    for name, r in result["speed"].items():
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f} %"
        same = {True: "yes", False: "NO"}.get(r.get("identical_to_no_speculation"), "")
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {', '.join(f'{t:.0f}' for t in r['tokens_per_s_all'])} | "
                     f"{acc} | {r['median_step_ms']:.1f} | {r['mask_ms_per_step']:.2f} | "
                     f"{100 * r['grammar_share']:.1f} % | {same} |")
    s = result["speed"]
    lines += ["", f"Speculation under a grammar: {s['constrained, speculation, drafts under the grammar']['tokens_per_s'] / s['constrained, no speculation']['tokens_per_s']:.2f}x "
              "the constrained tokens/s without it; with the grammar on the verification only, "
              f"{s['constrained, speculation, grammar on verification only']['tokens_per_s'] / s['constrained, no speculation']['tokens_per_s']:.2f}x. "
              "Constrained vs free with speculation: "
              f"{s['constrained, speculation, drafts under the grammar']['tokens_per_s'] / s['free, speculation']['tokens_per_s']:.2f}x. "
              "Drafts under the grammar against the grammar on verification only: "
              f"{s['constrained, speculation, drafts under the grammar']['tokens_per_s'] / s['constrained, speculation, grammar on verification only']['tokens_per_s']:.2f}x "
              "the tokens/s. A fixed k is used to measure acceptance; whether speculation pays at all is the cost "
              "model's call (the adaptive policy, `spec_decode` record): on a CPU a verification pass over k + 1 "
              "positions of a batch costs close to k + 1 decode steps, so here fixed-k speculation loses even on "
              "free requests, while on a GPU the pass costs about one step.",
              "", "## Beside free requests", "",
              "Half the batch constrained, half free (ignore_eos), speculation on: the constrained half does not slow "
              "the step the free half shares with it.", "",
              "| batch | median step (ms) | mask ms / step |", "|---|---:|---:|"]
    for name, r in result["beside"].items():
        lines.append(f"| {name} | {r['median_step_ms']:.1f} | {r['mask_ms_per_step']:.2f} |")
    lines += ["", "![tokens/s and acceptance](structured_output.png)" if result.get("plot") else ""]
    write_lines(path, lines)


def plot(result: dict, out: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["speed"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 1.4]})
    tps = [result["speed"][n]["tokens_per_s"] for n in names]
    ax1.barh(range(len(names)), tps, color=["#999", "#bbb", "#4a7", "#27a", "#c63"])
    ax1.set_yticks(range(len(names)), [n.replace(", ", "\n", 1) for n in names], fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlabel("tokens/s (median of rounds)")
    spec = [n for n in names if result["speed"][n]["acceptance"] is not None and "constrained" in n]
    ax2.bar(range(len(spec)), [100 * result["speed"][n]["acceptance"] for n in spec], color=["#27a", "#c63"])
    ax2.set_xticks(range(len(spec)), ["drafts under\nthe grammar", "grammar on\nverification only"], fontsize=8)
    ax2.set_ylabel("draft acceptance (%)")
    fig.suptitle("Structured output on one decode worker (bundled model)")
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=90)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=3, help="sampled requests per prompt and schema (validity)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=os.path.join(RESULTS, "structured_output"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tokenizer = TextTokenizer(DEFAULT_MODEL_DIR)
    corpus = heldout_tokens(tokenizer, args.batch * args.prompt_tokens * 2)
    stride = (len(corpus) - args.prompt_tokens) // args.batch
    suffix = tokenizer.encode(SUFFIX)
    prompts = [corpus[i * stride : i * stride + args.prompt_tokens] + suffix for i in range(args.batch)]
    result = {"command": "python benchmarks/structured_output.py" + "".join(f" {a}" for a in sys.argv[1:]),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "model": os.path.relpath(DEFAULT_MODEL_DIR),
              "args": vars(args) | {"out": None},
              "validity": validity(tokenizer, prompts[:4], SpeculationConfig(
                  drafter="self_sparse", k_policy="fixed", k=args.k, budget=args.budget, sink_tokens=8),
                  args.dtype, args.seeds),
              "speed": speed(prompts, args), "beside": beside(prompts, args)}
    result["plot"] = plot(result, args.out)
    record(result, args.out, write_markdown)


if __name__ == "__main__":
    main()
