"""Prompts that repeat earlier ones, served with and without the KV kept (prefix caching), side by side with
vLLM's CPU build (its prefix caching on), through each server's OpenAI completions endpoint, same weights,
same cores, one run.

Two traces (``planner/reuse_workload.py``), sized for the bundled model on a 2-core machine:

* ``shared_docs``: 4 documents of 3000 tokens, 200-token questions, 64 tokens out, Poisson at 0.5 req/s
  (vLLM's ``prefix_repetition`` shape). A document's first question finds nothing cached (cold); the rest can
  reuse the document's KV (hits).
* ``multi_turn@R``: conversations of 3-6 turns (first message 512-2048 tokens, then 64-384 per turn, answers
  of 64), 1 s think time, started at R conversations/s for a minute (at least 6); each turn's prompt is the
  conversation so far (the previous answers as the server generated them, by token id) plus the new message.

Per system and trace: TTFT p50 / p99, TPOT p50, and goodput as ``vllm bench serve`` reports it (requests that
met both SLOs per second of the run; defaults 3 s TTFT and 50 ms TPOT). ``shared_docs`` also gives TTFT p50
of hits over cold requests. Prompts are held-out corpus text (token ids), outputs greedy with EOS ignored.

    python benchmarks/prefix_reuse.py                       # magicserve with and without caching, and vLLM
    python benchmarks/prefix_reuse.py --systems magicserve  # one system

Writes ``<out>.json``, ``<out>.md`` and ``<out>.png`` (default ``benchmarks/results/prefix_reuse``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._slo_launch import VLLM_DTYPE, free_port, local_magicserve, vllm_server  # noqa: E402
from benchmarks._slo_targets import OpenAITarget, RequestRecord  # noqa: E402
from benchmarks.slo_sweep import heldout_corpus, percentile  # noqa: E402
from controller.config import LOCAL_CONFIG, load_config  # noqa: E402
from controller.defaults import DEFAULT_MODEL_DIR  # noqa: E402
from planner.reuse_workload import (MultiTurnShape, ReuseRequest, SharedDocsShape, multi_turn_trace,  # noqa: E402
                                    prompt_lengths, shared_docs_trace)
from planner.profiler import cpu_model_name  # noqa: E402
from planner.workload import LengthDist  # noqa: E402

SYSTEMS = ("magicserve", "magicserve-nocache", "vllm")
SHARED_DOCS = SharedDocsShape(documents=4, questions=6)
MULTI_TURN = MultiTurnShape(turns=(3, 6), first=LengthDist(1024, 0.4, 512, 2048), message=LengthDist(160, 0.5, 64, 384),
                            output=LengthDist(64, 0.0, 64, 64), think_s=1.0, max_context=4096)


def traces(args) -> dict[str, list[ReuseRequest]]:
    out = {"shared_docs": shared_docs_trace(SHARED_DOCS, args.rate, args.seed)}
    for rate in args.conversation_rates:
        out[f"multi_turn@{rate:g}"] = multi_turn_trace(MULTI_TURN, max(6, round(rate * 60)), rate, args.seed)
    return out


def describe(name: str, trace: list[ReuseRequest], args) -> str:
    if name == "shared_docs":
        return f"{SHARED_DOCS.documents} documents x {SHARED_DOCS.questions} questions, {args.rate} req/s"
    return (f"{len({r.group for r in trace})} conversations, {len(trace)} turns, {name.split('@')[1]} conversations/s, "
            f"prompts up to {max(prompt_lengths(trace))} tokens")


def token_source(corpus: list[int]):
    """Distinct corpus windows by key (a document, a question, a turn's message), the same in every system."""
    cursor = [0]
    taken: dict = {}

    def take(key, n: int) -> list[int]:
        if key not in taken:
            start = cursor[0] % max(1, len(corpus) - n)
            taken[key] = corpus[start:start + n]
            cursor[0] += n + 7
        return taken[key]

    return take


async def replay(target: OpenAITarget, trace: list[ReuseRequest], take, time_limit_s: float) -> list[dict]:
    """Send the trace: open loop by arrival time, a conversation's later turns a think time after the previous
    one's last token, each turn's prompt built from the previous one's prompt and output token ids."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    lengths = prompt_lengths(trace)
    by_group: dict[int, list[int]] = {}
    for i, r in enumerate(trace):
        if r.shared_tokens == 0:
            by_group.setdefault(r.group, []).append(i)
    records = [RequestRecord(i, r.arrival_s, lengths[i], r.output_tokens) for i, r in enumerate(trace)]

    def clock() -> float:
        return loop.time() - t0

    async def send(i: int, prompt: list[int]) -> None:
        try:
            await target.generate(prompt, trace[i].output_tokens, {"temperature": 0.0}, records[i], clock)
        except Exception as err:  # one failed request is data
            records[i].error = f"{type(err).__name__}: {err}"

    async def conversation(turns: list[int]) -> None:
        await asyncio.sleep(max(0.0, trace[turns[0]].arrival_s - clock()))
        history: list[int] = []
        for i in turns:
            r = trace[i]
            if r.turn:
                await asyncio.sleep(r.think_s)
            prompt = history + take(("message", r.group, r.turn), r.new_tokens)
            await send(i, prompt)
            if records[i].error:
                return
            history = prompt + records[i]._output_ids

    async def question(i: int) -> None:
        r = trace[i]
        await asyncio.sleep(max(0.0, r.arrival_s - clock()))
        await send(i, take(("document", r.group), r.shared_tokens) + take(("question", r.group, r.turn), r.new_tokens))

    tasks = [conversation(t) for t in by_group.values()] + \
        [question(i) for i, r in enumerate(trace) if r.shared_tokens]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), time_limit_s)
    except asyncio.TimeoutError:
        pass
    duration = clock()
    out = []
    for rec, r in zip(records, trace):
        d = rec.to_json()
        d.update(group=r.group, turn=r.turn, duration_s=duration)
        out.append(d)
    return out


def summarize(records: list[dict], ttft_slo_s: float, tpot_slo_s: float) -> dict:
    ok = [r for r in records if r["finish_reason"] in ("stop", "length")]
    duration = max((r["duration_s"] for r in records), default=0.0)
    good = [r for r in ok if r["ttft_s"] <= ttft_slo_s and (r["tpot_s"] or 0.0) <= tpot_slo_s]
    ttft = [r["ttft_s"] for r in ok]
    out = {"requests": len(records), "finished": len(ok), "errors": sum(r["error"] is not None for r in records),
           "duration_s": duration, "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
           "tpot_p50_s": percentile([r["tpot_s"] for r in ok if r["tpot_s"]], 50),
           "goodput_rps": len(good) / duration if duration else 0.0, "slo_attainment": len(good) / len(records)}
    return out


def cold_and_hits(records: list[dict]) -> dict:
    """shared_docs: TTFT p50 of each document's first question (nothing to reuse) and of the others."""
    first_sent: dict[int, float] = {}
    for r in records:
        if r["sent_s"] is not None:
            first_sent[r["group"]] = min(first_sent.get(r["group"], r["sent_s"]), r["sent_s"])
    ok = [r for r in records if r["ttft_s"] is not None]
    cold = [r["ttft_s"] for r in ok if r["sent_s"] == first_sent[r["group"]]]
    hits = [r["ttft_s"] for r in ok if r["sent_s"] != first_sent[r["group"]]]
    out = {"cold_ttft_p50_s": statistics.median(cold) if cold else None,
           "hit_ttft_p50_s": statistics.median(hits) if hits else None}
    if cold and hits:
        out["hit_over_cold"] = out["hit_ttft_p50_s"] / out["cold_ttft_p50_s"]
    return out


def server_for(system: str, args, workdir: str):
    if system == "vllm":
        port = free_port()
        return vllm_server(args.model, port, 8192, args.vllm_kv_space_gib, args.launch_timeout_s, [],
                           prefix_caching=True), f"http://127.0.0.1:{port}"
    return local_magicserve(system, args.model, {"prefix_caching": {"enabled": system == "magicserve"}}, workdir,
                            args.launch_timeout_s, slo_ms=(args.ttft_slo_s * 1e3, args.tpot_slo_s * 1e3))


async def run_system(system: str, args, workload: dict, take, workdir: str) -> dict:
    server, url = server_for(system, args, workdir)
    out = {}
    with server:
        target = OpenAITarget(url)
        await target.start()
        warm = take(("warmup",), 64)
        for _ in range(2):
            await target.generate(warm, 8, {"temperature": 0.0}, RequestRecord(0, 0.0, 64, 8), time.monotonic)
        for name, trace in workload.items():
            print(f"[{system}] {name}: {len(trace)} requests", file=sys.stderr, flush=True)
            records = await replay(target, trace, take, args.time_limit_s)
            out[name] = {"summary": summarize(records, args.ttft_slo_s, args.tpot_slo_s), "records": records}
            if name == "shared_docs":
                out[name]["summary"].update(cold_and_hits(records))
            print(f"[{system}] {name}: {json.dumps(out[name]['summary'])}", file=sys.stderr, flush=True)
    return out


def dtypes() -> dict:
    """What each server computes in: magicserve's ``model.dtype`` of ``cluster_configs/local.yaml`` resolved on
    this machine (``auto``: bf16 only where the CPU computes it natively), vLLM's as it is launched."""
    choice = load_config(LOCAL_CONFIG).dtype_choice
    return {"magicserve": choice.dtype, "why": choice.reason, "vllm": VLLM_DTYPE}


def _fmt(v, scale=1000.0, unit="ms") -> str:
    return "-" if v is None else f"{v * scale:.0f} {unit}"


def write_markdown(result: dict, path: str) -> None:
    s = result["settings"]
    lines = ["# Prefix reuse: magicserve with and without prefix caching, and vLLM (CPU build, prefix caching on)",
             "", f"Command: `{result['command']}`", "",
             f"Machine: {result['machine']}. Model: `{s['model']}`; magicserve computes in {result['dtype']['magicserve']}: "
             f"{result['dtype']['why']}; vLLM in {result['dtype']['vllm']}. SLOs: TTFT "
             f"{s['ttft_slo_s']} s, TPOT {s['tpot_slo_s'] * 1000:.0f} ms; goodput = requests meeting both / second "
             "of the run (`vllm bench serve`'s definition).", ""]
    for name in result["workloads"]:
        lines += [f"## {name}", "", result["workloads"][name], "",
                  "| system | finished | TTFT p50 | TTFT p99 | TPOT p50 | SLO attainment | goodput (req/s) |"
                  + (" cold TTFT p50 | hit TTFT p50 | hit / cold |" if name == "shared_docs" else ""),
                  "|---|---|---|---|---|---|---|" + ("---|---|---|" if name == "shared_docs" else "")]
        for system, runs in result["systems"].items():
            m = runs[name]["summary"]
            row = (f"| {system} | {m['finished']}/{m['requests']} | {_fmt(m['ttft_p50_s'])} | {_fmt(m['ttft_p99_s'])} | "
                   f"{_fmt(m['tpot_p50_s'])} | {m['slo_attainment']:.0%} | {m['goodput_rps']:.3f} |")
            if name == "shared_docs":
                ratio = m.get("hit_over_cold")
                row += (f" {_fmt(m.get('cold_ttft_p50_s'))} | {_fmt(m.get('hit_ttft_p50_s'))} | "
                        f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
            lines.append(row)
        lines.append("")
    lines += [f"![TTFT per request]({os.path.basename(path)[:-3]}.png)", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for system, runs in result["systems"].items():
            recs = sorted((r for r in runs[name]["records"] if r["ttft_s"] is not None), key=lambda r: r["sent_s"])
            ax.plot([r["sent_s"] for r in recs], [r["ttft_s"] for r in recs], "o-", ms=3, lw=0.8, label=system)
        ax.axhline(result["settings"]["ttft_slo_s"], color="grey", ls="--", lw=0.8, label="TTFT SLO")
        ax.set_yscale("log")
        ax.set_xlabel("sent at (s)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(name)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--rate", type=float, default=0.5, help="shared_docs: requests/s")
    ap.add_argument("--conversation-rates", type=float, nargs="+", default=[0.1, 0.4],
                    help="multi_turn: conversations started per second, one trace each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-slo-s", type=float, default=3.0)
    ap.add_argument("--tpot-slo-s", type=float, default=0.05)
    ap.add_argument("--time-limit-s", type=float, default=600.0, help="per trace")
    ap.add_argument("--launch-timeout-s", type=float, default=300.0)
    ap.add_argument("--vllm-kv-space-gib", type=float, default=4.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "prefix_reuse"))
    args = ap.parse_args(argv)
    workload = traces(args)
    corpus = heldout_corpus(args.model, 200_000)
    take = token_source(corpus)
    result = {"command": "python benchmarks/prefix_reuse.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": f"{cpu_model_name()}, {os.cpu_count()} cores",
              "dtype": dtypes(),
              "settings": {**{k: v for k, v in vars(args).items() if k != "out"},
                           "model": os.path.relpath(os.path.abspath(args.model), ROOT)},
              "workloads": {name: describe(name, trace, args) for name, trace in workload.items()},
              "systems": {}}
    with tempfile.TemporaryDirectory() as workdir:
        for system in args.systems:
            result["systems"][system] = asyncio.run(run_system(system, args, workload, take, workdir))
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump({**result, "systems": {s: {w: r["summary"] for w, r in runs.items()}
                                         for s, runs in result["systems"].items()}}, f, indent=1)
    write_markdown(result, args.out + ".md")
    plot(result, args.out + ".png")
    print(f"wrote {args.out}.json, .md, .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
