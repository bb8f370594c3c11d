"""DistServe-style SLO sweep: replay one arrival trace at several request rates against a server and
measure the share of requests meeting the TTFT and TPOT SLOs (attainment) and the goodput (highest rate
with attainment >= the target).

    # against a running magicserve server (gRPC) or one this script starts and stops
    python benchmarks/slo_sweep.py --target grpc --address 127.0.0.1:50051 --workload chat --rates 0.2,0.5,1
    python benchmarks/slo_sweep.py --target grpc --launch cluster_configs/local.yaml --rates 0.2,0.5
    # against an OpenAI-compatible server: vLLM's CPU build from .peers/vllm, or magicserve's own HTTP front
    # (the same client path for both), started and stopped here
    python benchmarks/slo_sweep.py --target openai --launch-vllm models/stdlib-llama-15m --rates 0.2,0.5
    python benchmarks/slo_sweep.py --target openai --launch cluster_configs/local.yaml --rates 0.2,0.5
    # several sweeps on one figure, goodput per core: benchmarks/slo_compare.py

The trace (``planner.workload``): ``--num-requests`` requests of the workload's length
distributions with Poisson arrivals (gamma with ``--cv``), or ``--trace FILE`` rescaled to each rate.
The same lengths are replayed at every rate; prompts are exact-length slices of held-out standard-library
source (the bundled model never trained on them) tokenized with the model's tokenizer, EOS removed,
sent as token ids, at seeded offsets that differ per rate (no prefix-cache hits across rates).
Requests go out at their arrival times whatever is still running (open loop), greedy by default, with
``ignore_eos`` and ``max_tokens`` = the trace's output length. A few warm-up requests run first and are
not recorded; between rates the sweep waits for the server to drain. Each rate has a time limit; requests
not finished by then are cancelled and recorded as unfinished, and never attain. Errors are recorded, not
raised.

Times are taken on the client: TTFT at the first streamed token, TPOT = (last token time - first token
time) / (tokens - 1), end to end at the final message; magicserve also reports its own TTFT / TPOT (from
the request's arrival at its router), kept beside them. Attainment and goodput are
``planner.slo``'s (shared with the simulator, ``benchmarks/sim_validate.py``).

Writes PREFIX.json (settings, per rate: per-request records, attainment, latency percentiles; goodput;
attainment against an SLO scale), PREFIX.md and two figures: PREFIX_rate.png (attainment vs rate: both
SLOs, TTFT only, TPOT only, target line) and PREFIX_scale.png (attainment vs a common scale of both SLOs
at ``--scale-rate``, recomputed from the records: no extra runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import platform
import random
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass

from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# the targets and the servers a sweep launches (ChunkedDecoder, SSEParser and ManagedServer re-exported: this
# script is the public entry point of its helper modules)
from benchmarks._slo_launch import (LaunchError, ManagedServer, free_port, magicserve_server,  # noqa: E402, F401
                                    vllm_server)
from benchmarks._slo_targets import (ChunkedDecoder, GrpcTarget, OpenAITarget, RequestRecord,  # noqa: E402, F401
                                     SSEParser, TargetError, finished_normally, parse_http_url)
from controller.defaults import DEFAULT_MODEL_DIR  # noqa: E402
from planner.slo import RequestOutcome, attainment, goodput  # noqa: E402
from planner.workload import (WORKLOADS, RequestSpec, WorkloadError, load_trace, make_trace,  # noqa: E402
                                         scale_trace, workload_shape)

RESULTS = os.path.join(ROOT, "benchmarks", "results")
DEFAULT_RATES = "0.1,0.2,0.4,0.6,0.8,1.0"
DEFAULT_SCALES = "0.25,0.5,0.75,1,1.25,1.5,2,2.5,3"
DEFAULT_TTFT_SLO_MS, DEFAULT_TPOT_SLO_MS = 2000.0, 200.0  # controller.config.SLOSection's defaults
CORPUS_MIN_TOKENS = 131072  # enough text that prompts at random offsets rarely overlap
WARMUP_MAX_TOKENS = 16
CLIENT_LAG_WARN_S = 0.25  # a client stall this long is worth a warning next to the results
ATTAINMENT_KEYS = ("both", "ttft_only", "tpot_only")


# --------------------------------------------------------------------------------------------------
# prompts


def model_eos_ids(model_dir: str) -> set[int]:
    """EOS ids of a checkpoint (config.json and generation_config.json); {0} when neither names one."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids or {0}


def heldout_corpus(model_dir: str, need_tokens: int) -> list[int]:
    """Held-out standard-library files (scripts/_corpus.py's split, as in scripts/eval_default_model.py),
    tokenized with the model's tokenizer and concatenated, without EOS (or per-file BOS) ids."""
    from modeling.tokenizer import TextTokenizer
    from scripts._corpus import load_documents, split_documents
    from scripts.train_default_model import TrainConfig

    tokenizer = TextTokenizer(model_dir)
    drop = model_eos_ids(model_dir)
    _, heldout = split_documents(load_documents(), TrainConfig().holdout_permille)
    ids: list[int] = []
    for doc in heldout:
        doc_ids = tokenizer.encode(doc.text)[1 if tokenizer.add_bos else 0 :]
        ids.extend(t for t in doc_ids if t not in drop)
        if len(ids) >= need_tokens:
            break
    return ids


def make_prompts(corpus: list[int], lengths: list[int], seed: int) -> list[tuple[int, list[int]]]:
    """(offset, ids) per length: ``corpus[offset : offset + length]`` at seeded uniform offsets."""
    if not lengths:
        return []
    if max(lengths) > len(corpus):
        raise ValueError(f"corpus has {len(corpus)} tokens, fewer than the longest prompt ({max(lengths)})")
    rng = random.Random(seed)
    out = []
    for n in lengths:
        off = rng.randrange(len(corpus) - n + 1)
        out.append((off, corpus[off : off + n]))
    return out


# --------------------------------------------------------------------------------------------------
# the load generator


@dataclass
class RatePlan:
    """What one rate sends: the trace at that rate and its prompts."""

    rate: float
    trace: list[RequestSpec]
    prompts: list[tuple[int, list[int]]]
    time_limit_s: float


def plan_rates(args, base_trace: list[RequestSpec] | None, corpus: list[int]) -> list[RatePlan]:
    plans = []
    for i, rate in enumerate(args.rates):
        if base_trace is None:
            trace = make_trace(workload_shape(args.workload), rate, args.num_requests, seed=args.seed, cv=args.cv)
        else:
            trace = scale_trace(base_trace, rate)
        prompts = make_prompts(corpus, [r.prompt_tokens for r in trace], seed=args.seed * 1000 + i + 1)
        limit = args.time_limit_s if args.time_limit_s is not None else trace[-1].arrival_s + 60.0
        plans.append(RatePlan(rate, trace, prompts, limit))
    return plans


def sampling_for(args, index: int) -> dict:
    """Greedy by default; with --temperature > 0 each request gets its own seed."""
    if args.temperature <= 0:
        return {"temperature": 0.0}
    return {"temperature": args.temperature, "seed": args.seed + index}


@dataclass
class RateRun:
    """What one rate measured: the records, how long it took, and the largest delay of the client's
    event loop (a starved load generator sends late and reads late: results would be unreliable)."""

    records: list[RequestRecord]
    duration_s: float
    loop_lag_max_s: float


async def _watch_loop_lag(lags: list[float], period_s: float = 0.02) -> None:
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(period_s)
        lags[0] = max(lags[0], loop.time() - t - period_s)


async def run_rate(target, plan: RatePlan, args, tag: str) -> RateRun:
    """Send ``plan``'s requests at their arrival times (open loop), whatever is still running.
    Requests still running at the time limit are cancelled and marked unfinished."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    def clock() -> float:
        return loop.time() - t0

    records = [RequestRecord(i, s.arrival_s, s.prompt_tokens, s.output_tokens, prompt_offset=off)
               for i, (s, (off, _)) in enumerate(zip(plan.trace, plan.prompts))]
    bar = tqdm(total=len(records), desc=f"rate {plan.rate:g} req/s", unit="req", file=sys.stderr, dynamic_ncols=True)
    tasks: list[asyncio.Task] = []

    async def one(i: int) -> None:
        rec = records[i]
        try:
            await target.generate(plan.prompts[i][1], rec.output_tokens, sampling_for(args, i), rec, clock,
                                  request_id=f"{tag}-{i}")
        except TargetError as err:
            rec.error = str(err)
        except Exception as err:  # any failure of one request is data, not a reason to stop the sweep
            rec.error = f"{type(err).__name__}: {err}"
        bar.update(1)
        if rec.error:
            bar.set_postfix(errors=sum(r.error is not None for r in records))

    async def dispatch() -> None:
        for i, rec in enumerate(records):
            delay = rec.arrival_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))

    lags = [0.0]
    watcher = asyncio.create_task(_watch_loop_lag(lags))
    dispatcher = asyncio.create_task(dispatch())
    await asyncio.wait([dispatcher], timeout=plan.time_limit_s)
    left = plan.time_limit_s - clock()
    if left > 0 and tasks:
        await asyncio.wait(tasks, timeout=left)
    duration = clock()
    for t in (watcher, dispatcher, *tasks):
        t.cancel()
    await asyncio.gather(watcher, dispatcher, *tasks, return_exceptions=True)
    bar.close()
    for rec in records:
        if rec.finish_reason is None and rec.error is None:
            rec.finish_reason = "unfinished"
    return RateRun(records, duration, lags[0])


async def warm_up(target, prompts: list[tuple[int, list[int]]], trace: list[RequestSpec], args, tag: str) -> None:
    """Requests before measuring, one after another, not recorded. All failing aborts the sweep."""
    errors = []
    for i, ((_, ids), spec) in enumerate(zip(prompts, trace)):
        rec = RequestRecord(i, 0.0, len(ids), spec.output_tokens)
        try:
            await target.generate(ids, min(spec.output_tokens, WARMUP_MAX_TOKENS), sampling_for(args, i), rec,
                                  time.perf_counter, request_id=f"{tag}-warm-{i}")
        except Exception as err:
            errors.append(f"{type(err).__name__}: {err}")
    if errors and len(errors) == len(prompts):
        raise TargetError(f"every warm-up request failed, e.g. {errors[0]}")
    for e in errors:
        print(f"warm-up request failed: {e}", file=sys.stderr)


async def sweep(target, plans: list[RatePlan], warm: list[tuple[int, list[int]]], args, on_rate) -> dict:
    """Warm up, then every rate in turn, each once the server is idle (the previous rate drained);
    ``on_rate(plan, run)`` after each. Returns what the server says about itself."""
    tag = f"slo{random.randrange(16 ** 6):06x}"
    try:
        server = await target.start()
        await warm_up(target, warm, plans[0].trace, args, tag)
        for i, plan in enumerate(plans):
            if not await target.wait_idle(60.0):
                print("server still busy 60 s after the previous rate; going on", file=sys.stderr)
            on_rate(plan, await run_rate(target, plan, args, f"{tag}-r{i}"))
        return server
    finally:
        await target.close()


# --------------------------------------------------------------------------------------------------
# analysis (on JSON records, so saved sweeps can be re-analysed)


TIMINGS = ("client", "server")


def outcome_of(rec: dict, timing: str = "client") -> RequestOutcome:
    """A recorded request as the shared SLO definition sees it (unfinished / failed: never attains).
    ``timing``: "client" (the load generator's clock, what a user sees) or "server" (the server's own
    TTFT / TPOT from its usage report, free of the load generator's lateness)."""
    if timing not in TIMINGS:
        raise ValueError(f"timing: expected one of {', '.join(TIMINGS)}, got {timing!r}")
    prefix = "" if timing == "client" else "server_"
    ok = finished_normally(rec)
    ttft = rec[prefix + "ttft_s"] if rec.get(prefix + "ttft_s") is not None else math.inf
    tpot = rec[prefix + "tpot_s"] if rec.get(prefix + "tpot_s") is not None else math.inf
    return RequestOutcome(ok and ttft < math.inf and tpot < math.inf, ttft, tpot)


def has_server_timing(records: list[dict]) -> bool:
    """Whether the target reported its own timings (every finished request carries them)."""
    done = [r for r in records if finished_normally(r)]
    return bool(done) and all(r.get("server_ttft_s") is not None for r in done)


def attainment_of(records: list[dict], ttft_slo_s: float, tpot_slo_s: float, timing: str = "client") -> dict:
    a = attainment([outcome_of(r, timing) for r in records], ttft_slo_s, tpot_slo_s)
    return {"both": a.both, "ttft_only": a.ttft_only, "tpot_only": a.tpot_only, "requests": a.requests}


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize_rate(rate: float, records: list[dict], duration_s: float, time_limit_s: float,
                   ttft_slo_s: float, tpot_slo_s: float, loop_lag_max_s: float = 0.0) -> dict:
    finished = [r for r in records if outcome_of(r).ok]
    send_lag = [r["sent_s"] - r["arrival_s"] for r in records if r["sent_s"] is not None]
    draft = sum(r["draft_tokens"] or 0 for r in finished)
    accepted = sum(r["accepted_tokens"] or 0 for r in finished)
    ttft = [r["ttft_s"] for r in finished]
    tpot = [r["tpot_s"] for r in finished]
    return {
        "rate": rate, "duration_s": duration_s, "time_limit_s": time_limit_s, "requests": len(records),
        "finished": len(finished), "errors": sum(r["error"] is not None for r in records),
        "unfinished": sum(r["finish_reason"] == "unfinished" for r in records),
        "attainment": attainment_of(records, ttft_slo_s, tpot_slo_s),
        "latency_ms": {f"{name}_p{q}": (None if percentile(vals, q) is None else 1e3 * percentile(vals, q))
                       for name, vals in (("ttft", ttft), ("tpot", tpot)) for q in (50, 90, 99)},
        "output_tokens_per_s": sum(r["completion_tokens"] for r in finished) / duration_s if duration_s > 0 else 0.0,
        "acceptance_rate": accepted / draft if draft else None,
        "client": {"send_lag_max_s": max(send_lag, default=0.0), "loop_lag_max_s": loop_lag_max_s},
        **server_view(records, ttft_slo_s, tpot_slo_s),
        "records": records,
    }


def server_view(records: list[dict], ttft_slo_s: float, tpot_slo_s: float) -> dict:
    """Attainment and latency percentiles on the server's own timings (empty where it reports none)."""
    if not has_server_timing(records):
        return {}
    finished = [r for r in records if outcome_of(r).ok]
    return {"server_attainment": attainment_of(records, ttft_slo_s, tpot_slo_s, "server"),
            "server_latency_ms": {f"{name}_p{q}": 1e3 * percentile([r[f"server_{name}_s"] for r in finished], q)
                                  for name in ("ttft", "tpot") for q in (50, 90)}}


def analyse(result: dict) -> dict:
    """Goodput per attainment kind and the SLO-scale curve, from the per-rate records (in place)."""
    s = result["settings"]
    rows = result["rates"]
    rates = [r["rate"] for r in rows]
    target = s["attainment_target"]
    result["goodput"] = {k: goodput(rates, [r["attainment"][k] for r in rows], target) for k in ATTAINMENT_KEYS}
    result["goodput_per_core"] = {k: v / s["cores"] for k, v in result["goodput"].items()}
    scale_rate = s.get("scale_rate")
    if scale_rate is None:
        passing = [r["rate"] for r in rows if r["attainment"]["both"] >= target]
        scale_rate = passing[-1] if passing else rates[0]
    row = next(r for r in rows if r["rate"] == scale_rate)
    curve = {k: [] for k in ATTAINMENT_KEYS}
    for f in s["slo_scales"]:
        a = attainment_of(row["records"], f * s["ttft_slo_ms"] / 1e3, f * s["tpot_slo_ms"] / 1e3)
        for k in ATTAINMENT_KEYS:
            curve[k].append(a[k])
    result["slo_scale"] = {"rate": scale_rate, "scales": list(s["slo_scales"]), **curve}
    return result


# --------------------------------------------------------------------------------------------------
# output


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def write_markdown(result: dict, path: str) -> None:
    s = result["settings"]
    arrivals = "Poisson" if s["cv"] == 1.0 else f"gamma (CV {s['cv']:g})"
    lines = [
        f"# SLO sweep: {s['label']} ({s['target']}), workload {s['workload']}", "",
        f"`{result['command']}`", "",
        f"{s['num_requests']} requests per rate, {arrivals} arrivals, seed {s['seed']}, "
        f"{'greedy' if s['temperature'] <= 0 else 'temperature %g' % s['temperature']}, EOS ignored; "
        f"SLOs: TTFT {s['ttft_slo_ms']:g} ms, TPOT {s['tpot_slo_ms']:g} ms, target {s['attainment_target']:.0%}; "
        f"server model `{result.get('server', {}).get('model', '?')}`, {s['cores']:g} core(s); "
        f"machine: {result['hardware']['cpus']} CPUs, {result['hardware']['platform']}.", "",
        "| rate (req/s) | requests | finished | errors | unfinished | both SLOs | TTFT only | TPOT only "
        "| TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | output tok/s | draft acceptance | client stall max (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rates"]:
        a, lat = r["attainment"], r["latency_ms"]
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        lines.append(f"| {r['rate']:g} | {r['requests']} | {r['finished']} | {r['errors']} | {r['unfinished']} "
                     f"| {a['both']:.0%} | {a['ttft_only']:.0%} | {a['tpot_only']:.0%} "
                     f"| {_fmt_ms(lat['ttft_p50'])} / {_fmt_ms(lat['ttft_p90'])} "
                     f"| {_fmt_ms(lat['tpot_p50'])} / {_fmt_ms(lat['tpot_p90'])} | {r['output_tokens_per_s']:.1f} | {acc} "
                     f"| {1e3 * r['client']['loop_lag_max_s']:.0f} |")
    g, gc = result["goodput"], result["goodput_per_core"]
    lines += ["", f"Goodput at {s['attainment_target']:.0%} attainment (interpolated between swept rates): "
              f"**{g['both']:.3g} req/s** ({gc['both']:.3g} req/s per core); TTFT SLO alone {g['ttft_only']:.3g}, "
              f"TPOT SLO alone {g['tpot_only']:.3g} req/s."]
    if result["rates"][-1]["attainment"]["both"] >= s["attainment_target"]:
        lines.append("The highest swept rate still met the target: the goodput is a lower bound (sweep higher rates).")
    lagging = [r for r in result["rates"] if r["client"]["loop_lag_max_s"] > CLIENT_LAG_WARN_S]
    if lagging:
        worst = max(lagging, key=lambda r: r["client"]["loop_lag_max_s"])
        lines += ["", f"**The load generator was starved**: its event loop stalled up to "
                  f"{1e3 * worst['client']['loop_lag_max_s']:.0f} ms (at {worst['rate']:g} req/s; sends up to "
                  f"{1e3 * worst['client']['send_lag_max_s']:.0f} ms late). Requests went out late and tokens were "
                  "read late: treat these figures with care (CPU shared with the server?)."]
    served = [r for r in result["rates"] if "server_attainment" in r]
    if served:
        lines += ["", "The same requests on the server's own clock (its usage report: from arrival at the router, "
                  "without the load generator's lateness):", "",
                  "| rate (req/s) | both SLOs | TTFT only | TPOT only | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for r in served:
            a, lat = r["server_attainment"], r["server_latency_ms"]
            lines.append(f"| {r['rate']:g} | {a['both']:.0%} | {a['ttft_only']:.0%} | {a['tpot_only']:.0%} "
                         f"| {_fmt_ms(lat['ttft_p50'])} / {_fmt_ms(lat['ttft_p90'])} "
                         f"| {_fmt_ms(lat['tpot_p50'])} / {_fmt_ms(lat['tpot_p90'])} |")
    errors = sorted({rec["error"] for r in result["rates"] for rec in r["records"] if rec["error"]})
    if errors:
        lines += ["", "Errors seen: " + "; ".join(f"`{e[:120]}`" for e in errors[:5])]
    sc = result["slo_scale"]
    lines += ["", f"Attainment at {sc['rate']:g} req/s with both SLOs scaled:", "",
              "| SLO scale | " + " | ".join(f"{f:g}" for f in sc["scales"]) + " |",
              "|---|" + "---:|" * len(sc["scales"])]
    for k, name in (("both", "both SLOs"), ("ttft_only", "TTFT only"), ("tpot_only", "TPOT only")):
        lines.append(f"| {name} | " + " | ".join(f"{a:.0%}" for a in sc[k]) + " |")
    files = result["files"]
    lines += ["", f"![attainment vs rate]({os.path.basename(files['rate_png'])}) "
              f"![attainment vs SLO scale]({os.path.basename(files['scale_png'])})", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def write_outputs(result: dict, prefix: str) -> dict:
    """PREFIX.json, PREFIX.md, PREFIX_rate.png, PREFIX_scale.png; returns the paths."""
    from benchmarks._slo_plots import plot_attainment_vs_rate, plot_attainment_vs_scale

    files = {"json": prefix + ".json", "md": prefix + ".md", "rate_png": prefix + "_rate.png",
             "scale_png": prefix + "_scale.png"}
    result["files"] = files
    s = result["settings"]
    rows = result["rates"]
    slo = f"TTFT {s['ttft_slo_ms']:g} ms, TPOT {s['tpot_slo_ms']:g} ms"
    plot_attainment_vs_rate(files["rate_png"], [r["rate"] for r in rows],
                            {k: [r["attainment"][k] for r in rows] for k in ATTAINMENT_KEYS},
                            s["attainment_target"], f"{s['label']}, {s['workload']}: {slo}")
    sc = result["slo_scale"]
    plot_attainment_vs_scale(files["scale_png"], sc["scales"], sc, s["attainment_target"],
                             f"{s['label']}, {s['workload']} at {sc['rate']:g} req/s (scale 1: {slo})")
    with open(files["json"], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    write_markdown(result, files["md"])
    return files


# --------------------------------------------------------------------------------------------------
# command line


def _number_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"need comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("need at least one number")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = ap.add_argument_group("target")
    t.add_argument("--target", choices=["grpc", "openai"], default="grpc",
                   help="grpc: magicserve's Generate stream; openai: an OpenAI-compatible /v1/completions server")
    t.add_argument("--address", default=None, help="grpc: host:port of a running magicserve server")
    t.add_argument("--url", default=None, help="openai: http://host:port of a running server (e.g. vllm serve)")
    t.add_argument("--served-model", default=None, help="openai: model name to request (default: the first served)")
    t.add_argument("--launch", metavar="CONFIG", default=None,
                   help="start `magicserve serve --config CONFIG` for the sweep and stop it afterwards "
                        "(grpc: its gRPC port; openai: its OpenAI-compatible HTTP front)")
    t.add_argument("--launch-vllm", metavar="MODEL_DIR", default=None,
                   help="openai: start vLLM's OpenAI server on MODEL_DIR for the sweep and stop it afterwards")
    t.add_argument("--vllm-python", default=os.path.join(ROOT, ".peers", "vllm", "bin", "python"))
    t.add_argument("--max-model-len", type=int, default=8192, help="--launch-vllm: context length")
    t.add_argument("--vllm-kv-space-gib", type=float, default=4.0, help="--launch-vllm: VLLM_CPU_KVCACHE_SPACE")
    t.add_argument("--vllm-args", default="", help="--launch-vllm: extra server arguments (one shell-quoted string)")
    t.add_argument("--launch-timeout-s", type=float, default=600.0, help="how long a launched server may take to start")
    w = ap.add_argument_group("workload")
    w.add_argument("--workload", default="chat", choices=sorted(WORKLOADS))
    w.add_argument("--trace", default=None, help="JSON-lines trace (arrival_s, prompt_tokens, output_tokens) "
                                                 "instead of --workload; rescaled to each rate")
    w.add_argument("--num-requests", type=int, default=None, help="requests per rate (default 100; a --trace: all)")
    w.add_argument("--rates", type=_number_list, default=_number_list(DEFAULT_RATES),
                   help=f"comma-separated request rates (req/s), ascending (default {DEFAULT_RATES})")
    w.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of arrival gaps (1 = Poisson)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    w.add_argument("--model", default=None, help="checkpoint directory whose tokenizer builds the prompts "
                                                 "(default: the launched model, else the bundled one)")
    w.add_argument("--warmup", type=int, default=2, help="warm-up requests (not recorded)")
    w.add_argument("--time-limit-s", type=float, default=None,
                   help="per rate, from its start (default: the last arrival + 60 s)")
    s = ap.add_argument_group("SLOs and output")
    s.add_argument("--ttft-slo-ms", type=float, default=None,
                   help=f"default: the launched config's slo.ttft_ms, else {DEFAULT_TTFT_SLO_MS:g}")
    s.add_argument("--tpot-slo-ms", type=float, default=None,
                   help=f"default: the launched config's slo.tpot_ms, else {DEFAULT_TPOT_SLO_MS:g}")
    s.add_argument("--attainment-target", type=float, default=0.9)
    s.add_argument("--slo-scales", type=_number_list, default=_number_list(DEFAULT_SCALES),
                   help=f"SLO scale factors of the scale figure (default {DEFAULT_SCALES})")
    s.add_argument("--scale-rate", type=float, default=None,
                   help="rate of the scale figure, one of --rates (default: the highest meeting the target)")
    s.add_argument("--label", default=None, help="system name in figures and comparisons "
                                                 "(default: magicserve for grpc, vllm for openai)")
    s.add_argument("--cores", type=float, default=None, help="CPU cores the system used, for per-core goodput "
                                                              "(default: this machine's)")
    s.add_argument("--out", default=None, help="output prefix (default benchmarks/results/slo_sweep_WORKLOAD_LABEL)")
    return ap


def validate(ap: argparse.ArgumentParser, args) -> None:
    """Cross-flag checks; every error names the flag and what it accepts."""
    def ascending_positive(flag: str, values: list[float]) -> None:
        if any(v <= 0 for v in values) or any(b <= a for a, b in zip(values, values[1:])):
            ap.error(f"{flag}: need positive, strictly ascending values, got {','.join(f'{v:g}' for v in values)}")

    ascending_positive("--rates", args.rates)
    ascending_positive("--slo-scales", args.slo_scales)
    if args.launch and not os.path.isfile(args.launch):
        ap.error(f"--launch: config file {args.launch!r} not found")
    if args.target == "grpc":
        if args.url or args.launch_vllm:
            ap.error("--url / --launch-vllm: only with --target openai")
        if bool(args.address) == bool(args.launch):
            ap.error("--target grpc: give exactly one of --address HOST:PORT or --launch CONFIG")
        if args.address and (":" not in args.address or not args.address.rsplit(":", 1)[1].isdigit()):
            ap.error(f"--address: need host:port, got {args.address!r}")
    else:
        if args.address:
            ap.error("--address: only with --target grpc (give --url http://HOST:PORT)")
        if sum(bool(x) for x in (args.url, args.launch_vllm, args.launch)) != 1:
            ap.error("--target openai: give exactly one of --url http://HOST:PORT, --launch-vllm MODEL_DIR "
                     "or --launch CONFIG")
        if args.url:
            try:
                parse_http_url(args.url)
            except ValueError as err:
                ap.error(str(err))
        if args.launch_vllm and not os.path.isfile(os.path.join(args.launch_vllm, "config.json")):
            ap.error(f"--launch-vllm: {args.launch_vllm!r} is not a checkpoint directory (no config.json)")
        if args.launch_vllm and not os.path.isfile(args.vllm_python):
            ap.error(f"--vllm-python: {args.vllm_python} not found (vLLM's own environment: ../shared/PEERS.md)")
    for flag, value in (("--cv", args.cv), ("--ttft-slo-ms", args.ttft_slo_ms), ("--tpot-slo-ms", args.tpot_slo_ms),
                        ("--time-limit-s", args.time_limit_s), ("--cores", args.cores),
                        ("--max-model-len", args.max_model_len), ("--vllm-kv-space-gib", args.vllm_kv_space_gib),
                        ("--launch-timeout-s", args.launch_timeout_s)):
        if value is not None and value <= 0:
            ap.error(f"{flag}: must be > 0, got {value:g}")
    if args.num_requests is not None and args.num_requests < 1:
        ap.error(f"--num-requests: must be >= 1, got {args.num_requests}")
    if args.warmup < 0:
        ap.error(f"--warmup: must be >= 0, got {args.warmup}")
    if args.temperature < 0:
        ap.error(f"--temperature: must be >= 0 (0 = greedy), got {args.temperature:g}")
    if not 0 < args.attainment_target <= 1:
        ap.error(f"--attainment-target: must be in (0, 1], got {args.attainment_target:g}")
    if args.scale_rate is not None and args.scale_rate not in args.rates:
        ap.error(f"--scale-rate: must be one of --rates ({','.join(f'{r:g}' for r in args.rates)}), got {args.scale_rate:g}")
    if args.trace is not None and not os.path.isfile(args.trace):
        ap.error(f"--trace: file {args.trace!r} not found")
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "tokenizer.json")):
        ap.error(f"--model: {args.model!r} has no tokenizer.json")


def resolve(ap: argparse.ArgumentParser, args) -> list[RequestSpec] | None:
    """Fill the defaults that depend on other flags; returns the --trace file's requests, if any."""
    launched = None
    if args.launch:
        from controller.config import load_config

        try:
            launched = load_config(args.launch)
        except ValueError as err:
            ap.error(f"--launch: {err}")
    args.model = args.model or (launched.model_path if launched else args.launch_vllm or DEFAULT_MODEL_DIR)
    args.ttft_slo_ms = args.ttft_slo_ms or (launched.slo.ttft_ms if launched else DEFAULT_TTFT_SLO_MS)
    args.tpot_slo_ms = args.tpot_slo_ms or (launched.slo.tpot_ms if launched else DEFAULT_TPOT_SLO_MS)
    if launched is not None:
        host = launched.server.host if launched.server.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        args.address = f"{host}:{free_port()}"
        if args.target == "openai":  # the launched server's HTTP front
            args.url = f"http://{host}:{free_port()}"
    args.label = args.label or ("magicserve" if args.target == "grpc" or args.launch else "vllm")
    args.cores = args.cores or float(os.cpu_count() or 1)
    args.out = args.out or os.path.join(RESULTS, f"slo_sweep_{args.workload if not args.trace else 'trace'}_{args.label}")
    base = None
    try:
        if args.trace:
            base = load_trace(args.trace)
            base = base[: args.num_requests] if args.num_requests else base
            args.workload = f"trace {os.path.basename(args.trace)}"
        args.num_requests = len(base) if base else (args.num_requests or 100)
        if base is None:  # check the workload parameters now, not after a server started
            make_trace(workload_shape(args.workload), args.rates[0], 1, seed=args.seed, cv=args.cv)
    except WorkloadError as err:
        ap.error(str(err))
    if args.launch_vllm:
        longest = max(r.prompt_tokens + r.output_tokens for r in reference_trace(args, base))
        if longest > args.max_model_len:
            ap.error(f"--max-model-len: {args.max_model_len} is shorter than the longest request ({longest} tokens)")
    return base


def reference_trace(args, base: list[RequestSpec] | None) -> list[RequestSpec]:
    """The requests of every rate (only the arrival times change with the rate)."""
    return base or make_trace(workload_shape(args.workload), args.rates[0], args.num_requests, args.seed, args.cv)


def settings_of(args) -> dict:
    keys = ("target", "address", "url", "served_model", "launch", "launch_vllm", "max_model_len", "vllm_kv_space_gib",
            "vllm_args", "workload", "trace", "num_requests", "rates", "cv", "seed", "temperature", "model", "warmup",
            "time_limit_s", "ttft_slo_ms", "tpot_slo_ms", "attainment_target", "slo_scales", "scale_rate", "label",
            "cores")
    return {k: getattr(args, k) for k in keys}


@contextlib.contextmanager
def launched_server(args):
    """The server the flags ask to start (None for an external one); stopped on the way out."""
    if args.launch:
        host, port = args.address.rsplit(":", 1)
        http_port = parse_http_url(args.url)[1] if args.target == "openai" else None
        server = magicserve_server(args.launch, host, int(port), args.launch_timeout_s, http_port)
    elif args.launch_vllm:
        port = free_port()
        args.url = f"http://127.0.0.1:{port}"
        server = vllm_server(args.launch_vllm, port, args.max_model_len, args.vllm_kv_space_gib,
                             args.launch_timeout_s, shlex.split(args.vllm_args), args.vllm_python)
    else:
        yield None
        return
    with server:
        yield server


@contextlib.contextmanager
def sigterm_unwinds():
    """SIGTERM raises SystemExit, so that ``with`` blocks (launched servers) clean up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class Prepared:
    """Everything a sweep sends, built before any server starts (no tokenizing while measuring; a bad
    --model fails early): every rate's requests and prompts, and the warm-up prompts."""

    plans: list[RatePlan]
    warm: list[tuple[int, list[int]]]


def prepare(args, base_trace: list[RequestSpec] | None) -> Prepared:
    longest = max(r.prompt_tokens for r in reference_trace(args, base_trace))
    corpus = heldout_corpus(args.model, max(CORPUS_MIN_TOKENS, 4 * longest))
    plans = plan_rates(args, base_trace, corpus)
    warm = make_prompts(corpus, [r.prompt_tokens for r in plans[0].trace[: args.warmup]], seed=args.seed * 1000)
    return Prepared(plans, warm)


def new_result(args, argv: list[str] | None) -> dict:
    words = sys.argv[1:] if argv is None else argv
    return {"benchmark": "slo_sweep", "command": "python benchmarks/slo_sweep.py " + shlex.join(words),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "hardware": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            "settings": None, "rates": []}


def record_rate(args, result: dict, plan: RatePlan, run: RateRun) -> None:
    """Summarise one rate into ``result``, report it, and save what there is so far (PREFIX.partial.json)."""
    row = summarize_rate(plan.rate, [r.to_json() for r in run.records], run.duration_s, plan.time_limit_s,
                         args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3, run.loop_lag_max_s)
    result["rates"].append(row)
    a = row["attainment"]
    print(f"rate {plan.rate:g} req/s: attainment both {a['both']:.0%}, TTFT {a['ttft_only']:.0%}, "
          f"TPOT {a['tpot_only']:.0%}; {row['finished']} finished, {row['errors']} errors, "
          f"{row['unfinished']} unfinished", file=sys.stderr, flush=True)
    with open(args.out + ".partial.json", "w", encoding="utf-8") as f:  # survives a failure later on
        json.dump(result, f)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    validate(ap, args)
    base_trace = resolve(ap, args)
    prepared = prepare(args, base_trace)
    result = new_result(args, argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    try:
        with sigterm_unwinds(), launched_server(args) as server:
            result["settings"] = settings_of(args)
            target = GrpcTarget(args.address) if args.target == "grpc" else OpenAITarget(args.url, args.served_model)
            on_rate = functools.partial(record_rate, args, result)
            result["server"] = asyncio.run(sweep(target, prepared.plans, prepared.warm, args, on_rate))
            if server is not None:
                result["server"].update(startup_s=server.startup_s, log=server.log_path)
    except (TargetError, LaunchError) as err:
        print(f"slo_sweep: error: {err}", file=sys.stderr)
        return 1
    files = write_outputs(analyse(result), args.out)
    with contextlib.suppress(OSError):
        os.remove(args.out + ".partial.json")
    with open(files["md"], encoding="utf-8") as f:
        print(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
