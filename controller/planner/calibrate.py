"""Calibration of a measured profile against the real serving path.

The profile times forward passes in isolation. A request through the running cluster also pays for
what those timings cannot see: Ray calls and polling between router and workers, the worker loops
around each pass (scheduling, sampling, KV hand-off), gRPC delivery, and the two workers sharing the
machine's memory bandwidth and caches. ``magicserve profile --calibrate`` measures that once per mode:
it serves the config for real (Ray + gRPC on localhost), sends isolated requests one at a time
(no queueing, speculation off so the decode steps are countable), and fits

    TTFT                      = ttft_overhead_s + prefill_scale * (predicted prefill steps)
    first -> last token time  = decode_start_s  + decode_scale  * (predicted decode steps) + (KV tail)

by non-negative least squares of the relative error. The simulator applies the fitted terms.

The workers also hand over the passes they timed meanwhile (``modeling/pass_log.py``): the prefill
worker's own passes give ``prefill_pass_scale``, the share of the TTFT scale that holds the worker (the rest
is latency of the request path); and when the config speculates, a few isolated requests served with its
speculation give the in-place speed of verify and draft passes relative to plain decode passes
(``verify_pass_scale``, ``draft_pass_scale``), the costs the real policy learns online.

Isolated requests leave the rest of the machine idle. When several instances share one machine (the
CPU cluster: workers, router, gRPC server and clients on the same cores), a step runs slower while the
other instances are busy. A second phase measures that: a burst of overlapping requests (Poisson
arrivals at the rate the simulator, with the isolated terms, says keeps the instances busy about
``BURST_UTILISATION`` of the time) is served for real, then a second burst of short prompts with long
outputs arriving together, which fills the decode batch. The simulator's three contention terms
(``sim_instances._Instance._contention``): ``contention_scale``, a factor on a step while the other
instances are busy, and ``contention_step_s``, the seconds each busy instance loses per worker step
completed while no core is idle (many short plain decode steps would then slow the prefill worker more
than fewer, longer speculative ones), and ``contention_output_s``, the same per sequence output (a decode
step over many sequences streams many), are fitted, non-negative, to the workers' passes during the bursts:
each pass's slowdown against the other workers' busy share and the steps and outputs completed meanwhile
(``interference.py``; colocated instances log their mixed prefill + decode steps, and contend with each
other). Where no passes were logged (profiles measured before colocated instances logged theirs) the
burst is instead replayed through the simulator for a grid of per-step costs, keeping the one whose simulated TTFT
and decode-time distributions match the measured ones best (least squares of the log ratio of sorted
values).

The calibration never uses the SLO sweeps it is validated against (``benchmarks/sim_validate.py``):
its prompts, lengths and arrivals are its own.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import threading
import time

from tqdm import tqdm

from controller.planner.interference import activities, fit_contention_terms, pass_row, predicted_s, reference_ratios
from controller.planner.profile import Calibration, Profile, instance_tps, prefill_features, transfer_features
from controller.planner.workload import RequestSpec
from decode_worker.policy import PassShape, fit_nonnegative_relative


def config_threads(config) -> int:
    """Torch threads per instance of a config the calibration serves (prefill and decode alike)."""
    if config.mode == "colocated":
        return config.colocated.threads
    if config.prefill.threads != config.decode.threads:
        from controller.planner.profile import ProfileError

        raise ProfileError(f"prefill.threads / decode.threads: the calibration serves instances of one thread count, "
                           f"got {config.prefill.threads} and {config.decode.threads} (a pair sharing the cores is "
                           "calibrated by its core-sharing burst: calibrate_sharing.py)")
    return config.prefill.threads


def predicted_prefill_s(profile: Profile, prompt: int, chunk: int, threads: int = 1) -> float:
    model = profile.prefill_model(threads)
    return sum(model.predict(prefill_features([(s, min(chunk, prompt - s))])) for s in range(0, prompt, chunk))


def predicted_decode_s(profile: Profile, prompt: int, tokens: int, threads: int = 1) -> float:
    """Plain decode steps of one sequence producing ``tokens`` tokens after the first."""
    model = profile.target_model(threads)
    return sum(model.predict_pass(PassShape(1, prompt + j + 1, 1)) for j in range(tokens))


def kv_tail_s(profile: Profile, prompt: int, chunk: int) -> float:
    """KV transfer left after the last prefill chunk (the simulator models it; not part of the fit)."""
    last = prompt - (prompt - 1) // chunk * chunk
    return profile.kv_transfer.predict(transfer_features(last))


def calibration_lengths(max_prompt: int, count: int, seed: int) -> list[int]:
    """Prompt lengths spread log-uniformly over [64, max_prompt], shuffled."""
    rng = random.Random(seed)
    lo, hi = 64, max(65, max_prompt)
    lengths = [int(lo * (hi / lo) ** (i / max(1, count - 1))) for i in range(count)]
    rng.shuffle(lengths)
    return lengths


def timed_stream(client, prompt: list[int], max_tokens: int) -> dict:
    """Stream one request to the end: prompt length, tokens received, TTFT and first -> last token time."""
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    for chunk in client.generate_stream(prompt, max_tokens=max_tokens, ignore_eos=True):
        if chunk.token_ids:
            now = time.perf_counter()
            first = first or now
            last = now
            tokens += len(chunk.token_ids)
    return {"prompt": len(prompt), "tokens": tokens, "ttft_s": first - t0, "decode_s": last - first}


def time_isolated(client, prompts: list[list[int]], output_tokens: tuple[int, ...]) -> list[dict]:
    """Send ``prompts`` one at a time (no overlap); output lengths cycle through ``output_tokens``."""
    return [timed_stream(client, p, output_tokens[i % len(output_tokens)]) for i, p in enumerate(prompts)]


def random_prompts(config, lengths: list[int], rng: random.Random) -> list[list[int]]:
    """Prompts of random token ids of the served model's vocabulary, of the given lengths."""
    from modeling.checkpoint import load_config as load_model_config

    vocab = load_model_config(config.model_path).vocab_size
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def drain_passes(config) -> list[dict]:
    """The passes the workers of the cluster serving ``config`` timed since the last drain
    (``modeling/pass_log.py``), as ``interference.pass_row`` rows whose ``worker`` is the worker's index."""
    import ray

    names = [f"{role}-{i}" for role, pool in config.pools.items() for i in range(pool.instances)]
    actors = [ray.get_actor(f"magicserve-{n}", namespace=config.ray.namespace) for n in names]
    logs = ray.get([a.pass_log.remote() for a in actors])
    return [pass_row(r, worker) for worker, log in enumerate(logs) for r in log]


def measure(config, lengths: list[int], output_tokens: tuple[int, ...], seed: int, progress: bool
            ) -> tuple[list[dict], list[dict]]:
    """Serve ``config`` for real and time isolated requests (one at a time) of the given prompt lengths;
    output lengths cycle through ``output_tokens`` so the decode slope is identifiable. Returns the
    requests' rows and the workers' timed passes."""
    from controller.client import Client
    from controller.server import serve_in_thread

    prompts = random_prompts(config, [64, 64] + lengths, random.Random(seed))
    shift = 2 % len(output_tokens)  # the timed requests' outputs continue the warm-ups' cycle
    with serve_in_thread(config) as address, Client(address) as client:
        time_isolated(client, prompts[:2], output_tokens)  # two warm-up requests (not recorded)
        drain_passes(config)
        rows = time_isolated(client, prompts[2:], output_tokens[shift:] + output_tokens[:shift])
        passes = drain_passes(config)
    if progress:
        tqdm.write(f"calibration: {len(rows)} isolated requests timed")
    return rows, passes


BURST_UTILISATION = 0.6  # mean busy share of the instances the burst's rate aims at (simulated)
CONTENTION_STEP_GRID = tuple(round(1e-4 * i, 4) for i in range(101))  # seconds per step: 0 .. 10 ms


def burst_trace(profile: Profile, sim_config, lengths: list[int], output_tokens: tuple[int, ...],
                seed: int) -> list[RequestSpec]:
    """Poisson arrivals of the given prompt lengths at the lowest rate of a geometric grid whose simulated
    mean instance utilisation (isolated terms, no contention) reaches BURST_UTILISATION; if no rate does,
    the rate of the highest utilisation."""
    from controller.planner.simulator import simulate

    rng = random.Random(seed)
    gaps = [rng.expovariate(1.0) for _ in lengths]  # unit-rate gaps, scaled per candidate rate
    outputs = [output_tokens[i % len(output_tokens)] for i in range(len(lengths))]

    def trace_at(rate: float) -> list[RequestSpec]:
        t, out = 0.0, []
        for gap, n, o in zip(gaps, lengths, outputs):
            out.append(RequestSpec(t, n, o))
            t += gap / rate
        return out

    rate, best = 0.05, (0.0, None)
    while rate < 1e3:
        trace = trace_at(rate)
        util = simulate(profile, sim_config, trace, seed=0).instance_utilisation
        mean = sum(util.values()) / max(1, len(util))
        if mean >= BURST_UTILISATION:
            return trace
        best = max(best, (mean, trace), key=lambda b: b[0])
        rate *= 1.25
    # A short burst of small requests can fall short of the target at any rate (all arrive at once and
    # one role idles while the other works through them): the busiest rate overlaps them the most.
    if best[1] is None or best[0] <= 0.0:
        raise RuntimeError("calibration burst: no request rate keeps the simulated instances busy")
    return best[1]


def send_burst(client, trace: list[RequestSpec], prompts: list[list[int]]) -> list[dict]:
    """Send ``trace`` (one thread per request, started at its arrival); every request must succeed."""
    rows: list[dict | None] = [None] * len(trace)
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def send(i: int) -> None:
        try:
            time.sleep(max(0.0, t0 + trace[i].arrival_s - time.perf_counter()))
            rows[i] = timed_stream(client, prompts[i], trace[i].output_tokens)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after every thread ends
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(trace))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"calibration burst: {len(errors)} of {len(trace)} requests failed: {errors[0]!r}")
    return rows


OUTPUT_BURST_REQUESTS = 32  # the second burst: short prompts, long outputs, arriving together
OUTPUT_BURST_RATE = 16.0  # requests per second
OUTPUT_BURST_TOKENS = 129


def burst_lengths(config, requests: int, seed: int, workload: str | None) -> tuple[list[int], tuple[int, ...]]:
    """(prompt lengths, output lengths) of a calibration burst: drawn from ``workload``'s shape
    (``workload.WORKLOADS``), capped at the config's limits, or, without one, prompts log-uniform up to 4096
    tokens with the calibration's short outputs."""
    from controller.planner.workload import workload_shape

    if workload is None:
        return calibration_lengths(max_calibration_prompt(config), requests, seed + 1), OUTPUT_TOKENS
    shape, rng = workload_shape(workload), random.Random(seed + 1)
    prompts = [min(shape.prompt.sample(rng), config.limits.max_prompt_tokens) for _ in range(requests)]
    outputs = tuple(max(2, min(shape.output.sample(rng), config.limits.max_tokens)) for _ in range(requests))
    return prompts, outputs


def output_burst_trace(config, requests: int, seed: int) -> list[RequestSpec]:
    """A burst that fills the decode batch: ``requests`` prompts of 64-512 tokens, each generating
    ``OUTPUT_BURST_TOKENS`` (at most the config's limit), Poisson arrivals at ``OUTPUT_BURST_RATE``. Decode steps
    then carry many sequences, so the contention fit can tell a cost per sequence output from one per step
    (the first burst's decode batches are mostly one or two sequences)."""
    rng = random.Random(seed + 11)
    lengths = calibration_lengths(min(512, max_calibration_prompt(config)), requests, seed + 11)
    tokens = min(OUTPUT_BURST_TOKENS, config.limits.max_tokens)
    t, trace = 0.0, []
    for n in lengths:
        trace.append(RequestSpec(t, n, tokens))
        t += rng.expovariate(OUTPUT_BURST_RATE)
    return trace


def measure_burst(config, trace: list[RequestSpec], seed: int, progress: bool,
                  output_trace: list[RequestSpec] | None = None) -> tuple[list[dict], list[dict]]:
    """Serve ``config`` for real and send ``trace`` (one thread per request, started at its arrival), then
    ``output_trace`` if given. Returns the first trace's rows and the workers' timed passes during both."""
    from controller.client import Client
    from controller.server import serve_in_thread

    prompts = random_prompts(config, [r.prompt_tokens for r in trace], random.Random(seed + 1))
    with serve_in_thread(config) as address, Client(address) as client:
        for _ in client.generate_stream(prompts[0][:64], max_tokens=4, ignore_eos=True):
            pass  # warm-up
        drain_passes(config)
        rows = send_burst(client, trace, prompts)
        passes = drain_passes(config)
        if output_trace:
            send_burst(client, output_trace,
                       random_prompts(config, [r.prompt_tokens for r in output_trace], random.Random(seed + 12)))
            passes += drain_passes(config)
    if progress:
        tqdm.write(f"calibration burst: {len(trace)} overlapping requests over {trace[-1].arrival_s:.1f} s timed")
    return rows, passes


def fit_contention(profile: Profile, sim_config, trace: list[RequestSpec], rows: list[dict],
                   seeds: int = 3) -> tuple[float, float]:
    """(contention_step_s, RMS of log(simulated / measured)) over the burst's TTFTs and decode times;
    ``profile`` carries the isolated terms of the mode (its contention terms are replaced).

    The distributions are compared, not request by request (the i-th shortest simulated TTFT against
    the i-th shortest measured one, and so on): which instance a request lands on when two have equally
    many requests is a tie the simulator and the real router may break differently, and one such flip
    swaps a short and a long wait between two requests without changing the distribution that SLO
    attainment depends on."""
    from controller.planner.simulator import simulate

    def quantile_sq(simulated: list[float], measured: list[float]) -> float:
        return sum(math.log(max(a, 1e-6) / max(b, 1e-6)) ** 2 for a, b in zip(sorted(simulated), sorted(measured)))

    base = profile.calibration(sim_config.mode, sim_config.calibration_threads())
    decoding = [i for i, row in enumerate(rows) if row["tokens"] > 1]
    best = (math.inf, 0.0)
    for per_step in CONTENTION_STEP_GRID:
        trial = profile.with_calibration(dataclasses.replace(base.without_contention(), contention_step_s=per_step))
        sq, n = 0.0, 0
        for seed in range(seeds):
            recs = simulate(trial, sim_config, trace, seed=seed).records
            if not all(r.finished for r in recs):
                sq, n = math.inf, 1
                break
            sq += quantile_sq([r.ttft_s for r in recs], [row["ttft_s"] for row in rows])
            sq += quantile_sq([recs[i].finish_s - recs[i].first_token_s for i in decoding],
                              [rows[i]["decode_s"] for i in decoding])
            n += len(recs) + len(decoding)
        best = min(best, (sq / max(1, n), per_step))
    return best[1], math.sqrt(best[0])


SPECULATIVE_REQUESTS = 8  # isolated requests served with speculation for the pass scales
SPECULATIVE_OUTPUT_TOKENS = 65
MIN_REFERENCE_PASSES = 10  # plain decode passes of the speculating run needed to serve as the reference


def measure_speculative_passes(config, lengths: list[int], seed: int, progress: bool) -> list[dict]:
    """Serve ``config`` with its speculation for real, isolated requests of the given prompt lengths
    (``SPECULATIVE_OUTPUT_TOKENS`` each); the workers' timed passes (``drain_passes``)."""
    from controller.client import Client
    from controller.server import serve_in_thread

    prompts = random_prompts(config, [64] + lengths, random.Random(seed + 5))
    with serve_in_thread(config) as address, Client(address) as client:
        time_isolated(client, prompts[:1], (8,))  # warm-up
        drain_passes(config)
        time_isolated(client, prompts[1:], (SPECULATIVE_OUTPUT_TOKENS,))
        passes = drain_passes(config)
    if progress:
        tqdm.write(f"calibration: {len(lengths)} isolated requests with speculation, "
                   f"{sum(p['kind'] == 'verify' for p in passes)} verify passes timed")
    return passes


def _median_ratio(profile: Profile, kind: str, passes: list[dict], drafter: str | None = None,
                  tps: dict[str, int] | None = None) -> float | None:
    """Median measured / profiled time of stored pass rows of ``kind`` (None: no rows)."""
    ratios = [p["seconds"] / predicted_s(profile, {"kind": kind, **p}, drafter, tps) for p in passes]
    return statistics.median(ratios) if ratios else None


def fit_prefill_pass_scale(profile: Profile, prefill_passes: list[dict], threads: int = 1) -> float:
    """Median measured / profiled time of the prefill worker's own passes in place (0.0: none logged)."""
    return _median_ratio(profile, "prefill", prefill_passes, tps={"prefill": threads}) or 0.0


def fit_pass_scales(profile: Profile, drafter: str, decode_passes: list[dict], verify_passes: list[dict],
                    draft_passes: list[dict], threads: int = 1) -> tuple[float, float, int]:
    """(verify_pass_scale, draft_pass_scale, verify passes used): the median measured / profiled time of
    verify and of draft passes over that of plain decode passes (one device per instance, as the local
    cluster runs). (1.0, 1.0, 0) when a kind is missing (e.g. the policy never speculated).

    Served, a speculating worker's k = 1 step costs less relative to its k = 0 step than the profile says
    (``benchmarks/serving_interference.py --speculation``), which is why the real policy, learning its costs
    in place, speculates where the profile's costs alone would not."""
    tps = {"decode": threads}
    plain = _median_ratio(profile, "decode", decode_passes, tps=tps)
    verify = _median_ratio(profile, "verify", verify_passes, tps=tps)
    draft = _median_ratio(profile, "draft", draft_passes, drafter, tps)
    if not plain or not verify or not draft:
        return 1.0, 1.0, 0
    return verify / plain, draft / plain, len(verify_passes)


def _fit_offset_and_scale(predicted: list[float], measured: list[float]) -> tuple[float, float, float]:
    """measured = offset + scale * predicted (both >= 0, relative error). A zero scale would tell the
    simulator that the work is free, so when the data cannot separate the two terms (e.g. too little
    spread in the predictions) the scale is fitted alone."""
    (offset, scale), err = fit_nonnegative_relative([[1.0, p] for p in predicted], measured)
    if scale <= 0:
        (scale,), err = fit_nonnegative_relative([[p] for p in predicted], measured)
        offset = 0.0
    return offset, scale, err


def fit(profile: Profile, mode: str, rows: list[dict], chunk: int, prefill_passes: list[dict] | None = None,
        threads: int = 1) -> Calibration:
    """The isolated terms of ``mode`` from isolated requests' rows (prompt, tokens, ttft_s, decode_s), and
    the prefill worker's in-place pass scale from its timed passes during them (``prefill_passes``: rows of
    ``prefill_features`` and ``seconds``; none: the simulator charges the whole TTFT scale to the worker)."""
    rows = [{**r, "prompt": int(r["prompt"]), "tokens": int(r["tokens"])} for r in rows]  # stored as floats
    overhead, pscale, ttft_err = _fit_offset_and_scale(
        [predicted_prefill_s(profile, r["prompt"], chunk, threads) for r in rows], [r["ttft_s"] for r in rows])
    tail = [kv_tail_s(profile, r["prompt"], chunk) if mode == "disaggregated" else 0.0 for r in rows]
    start, dscale, dec_err = _fit_offset_and_scale(
        [predicted_decode_s(profile, r["prompt"], r["tokens"] - 1, threads) for r in rows],
        [max(1e-6, r["decode_s"] - t) for r, t in zip(rows, tail)])
    pass_scale = fit_prefill_pass_scale(profile, prefill_passes or [], threads)
    return Calibration(mode, overhead, pscale, start, dscale, len(rows), ttft_err, dec_err,
                       prefill_pass_scale=min(pass_scale, pscale), threads=threads)


OUTPUT_TOKENS = (17, 33, 65)  # output lengths the calibration's requests cycle through


def max_calibration_prompt(config) -> int:
    """The longest prompt the calibration sends: the config's limit, at most 4096 tokens."""
    return min(config.limits.max_prompt_tokens, 4096)


def calibration_config(config, keep_speculation: bool = False):
    """``config`` as calibration serves it: a free port, speculation off (decode steps countable) unless
    ``keep_speculation``."""
    from controller.config import parse_config, to_dict

    raw = to_dict(config)
    raw["model"]["path"] = config.model_path
    raw["server"]["port"] = 0
    if not keep_speculation:
        raw["decode"]["speculation"] = {"drafter": "none"}
    return dataclasses.replace(parse_config(raw), source=config.source)


@dataclasses.dataclass(frozen=True)
class CalibrationRun:
    """A calibration and the measurements it was fitted to (kept in the profile, so a changed fit can be
    re-applied to the same measurements: ``refit``).

    isolated: one row per isolated request: prompt, tokens (received), ttft_s, decode_s (first -> last token);
    burst: the same per burst request, plus arrival_s and output_tokens (the trace replayed by the fit)."""

    calibration: Calibration
    isolated: list[dict[str, float]]
    burst: list[dict[str, float]]
    passes: dict[str, list[dict[str, float]]] = dataclasses.field(default_factory=dict)  # kind -> drain_passes rows

    def samples(self) -> dict[str, list[dict[str, float]]]:
        """The measurements under the profile's ``samples`` keys of this mode and thread count."""
        mode, t = self.calibration.mode, self.calibration.threads
        return {isolated_key(mode, t): self.isolated, burst_key(mode, t): self.burst,
                **{passes_key(mode, kind, t): rows for kind, rows in self.passes.items()}}


def samples_prefix(mode: str, threads: int = 1) -> str:
    """Where a calibration's measurements sit in a profile's ``samples`` (1 thread: the keys of before)."""
    return f"calibration/{mode}/" if threads == 1 else f"calibration/{mode}@{threads}t/"


def isolated_key(mode: str, threads: int = 1) -> str:
    return samples_prefix(mode, threads) + "isolated"


PASS_SAMPLE_KINDS = ("decode", "verify", "draft")  # the speculative pass scales' inputs (``with_pass_scales``)
BURST_PASS_KINDS = ("prefill", "decode", "step", "mixed")  # the burst's log (speculation off), for the contention fit


def burst_passes_kind(kind: str) -> str:
    return f"burst_{kind}"


def passes_key(mode: str, kind: str, threads: int = 1) -> str:
    return samples_prefix(mode, threads) + f"passes/{kind}"


def pass_rows(passes: list[dict], kind: str) -> list[dict[str, float]]:
    """The ``drain_passes`` rows of ``kind`` as stored in a profile's samples (floats, without the kind)."""
    return [{f: float(v) for f, v in p.items() if f != "kind"} for p in passes if p["kind"] == kind]


def with_pass_scales(profile: Profile, cal: Calibration, spec, passes: dict[str, list[dict]]) -> Calibration:
    """``cal`` with the speculative pass scales fitted to ``passes`` (kind -> rows), for drafter ``spec``."""
    if not spec.enabled or not all(passes.get(k) for k in PASS_SAMPLE_KINDS):
        return cal
    verify, draft, n = fit_pass_scales(profile, spec.drafter, passes["decode"], passes["verify"], passes["draft"],
                                       cal.threads)
    return dataclasses.replace(cal, verify_pass_scale=verify, draft_pass_scale=draft, speculative_passes=n)


def burst_key(mode: str, threads: int = 1) -> str:
    return samples_prefix(mode, threads) + "burst"


def _chunk_of(run_config) -> int:
    return run_config.colocated.chunk_tokens if run_config.mode == "colocated" else run_config.prefill.chunk_tokens


def burst_rows(trace: list[RequestSpec], rows: list[dict]) -> list[dict[str, float]]:
    """A burst's requests as stored in a profile's samples: each row with its arrival and output length."""
    return [{"arrival_s": float(t.arrival_s), "output_tokens": float(t.output_tokens),
             **{k: float(v) for k, v in r.items()}} for t, r in zip(trace, rows)]


def calibrate(config, profile: Profile, requests: int = 16, output_tokens: tuple[int, ...] = OUTPUT_TOKENS, seed: int = 0,
              progress: bool = True, burst_requests: int = 40, workload: str | None = None) -> CalibrationRun:
    """Fit the serving-path terms of ``config``'s mode (speculation is switched off for the run): the
    isolated terms, then (``burst_requests`` > 0) the contention terms on a burst. ``workload``: draw the
    burst's prompt and output lengths from that workload's shape (``burst_lengths``) and send no output burst:
    how much a step slows beside a busy instance depends on what both run (on the 2-core VM, colocated steps
    of long_doc's long prompts slowed about 60 % as much as the generic burst's terms charge), so a
    burst shaped like the workload to be planned measures the contention that workload meets."""
    run_config = calibration_config(config)
    mode, threads = run_config.mode, config_threads(run_config)
    chunk = _chunk_of(run_config)
    max_prompt = max_calibration_prompt(run_config)
    rows, plain_passes = measure(run_config, calibration_lengths(max_prompt, requests, seed), output_tokens, seed,
                                 progress)
    passes: dict[str, list[dict[str, float]]] = {"prefill": pass_rows(plain_passes, "prefill")} if plain_passes else {}
    cal = fit(profile, mode, rows, chunk, passes.get("prefill", []), threads)
    spec = config.decode.speculation if mode == "disaggregated" else None
    if spec is not None and spec.enabled:
        spec_passes = measure_speculative_passes(calibration_config(config, keep_speculation=True),
                                                 calibration_lengths(max_prompt, SPECULATIVE_REQUESTS, seed + 7),
                                                 seed, progress)
        # the reference: plain decode passes of the speculating worker itself (its k = 0 steps), the costs
        # its policy weighs against each other; the speculation-off run's when it hardly ever took k = 0
        reference = pass_rows(spec_passes, "decode")
        passes.update({"decode": reference if len(reference) >= MIN_REFERENCE_PASSES else pass_rows(plain_passes, "decode"),
                       **{k: pass_rows(spec_passes, k) for k in ("verify", "draft")}})
        cal = with_pass_scales(profile, cal, spec, passes)
    if burst_requests <= 0:
        return CalibrationRun(cal, rows, [], passes)
    from controller.planner.simulator import SimConfig

    isolated = profile.with_calibration(cal)
    sim_config = SimConfig.from_cluster_config(run_config)
    lengths, outputs = burst_lengths(run_config, burst_requests, seed, workload)
    output_trace = None
    if workload is None:  # the generic burst: the isolated requests' output lengths, then the output burst
        outputs, output_trace = output_tokens, output_burst_trace(run_config, OUTPUT_BURST_REQUESTS, seed)
    trace = burst_trace(isolated, sim_config, lengths, outputs, seed)
    burst, burst_passes = measure_burst(run_config, trace, seed, progress, output_trace)
    passes.update({burst_passes_kind(k): pass_rows(burst_passes, k) for k in BURST_PASS_KINDS})
    cal = dataclasses.replace(cal, contention_workload=workload or "")
    return CalibrationRun(with_contention(profile, cal, sim_config, trace, burst, burst_passes), rows,
                          burst_rows(trace, burst), {k: v for k, v in passes.items() if v})


def with_contention(profile: Profile, cal: Calibration, sim_config, trace: list[RequestSpec],
                    burst: list[dict], burst_passes: list[dict] | None = None) -> Calibration:
    """``cal`` (isolated terms) completed by the contention term of the burst ``trace`` measured as ``burst``:
    fitted to the workers' own passes during it when they were logged (both terms,
    ``interference.fit_contention_terms``; ``contention_fit_error`` is then the RMS of the passes' slowdowns
    about the fit, and ``step_noise`` their spread about it), else to the requests' latency distributions (the per-step term, ``fit_contention``; RMS
    of log(simulated / measured))."""
    if burst_passes:
        acts = activities(profile, burst_passes, tps=instance_tps(cal.mode, cal.threads))
        fitted = fit_contention_terms(acts)
        # the contention term is a slowdown over the burst's own passes that ran alone: the prefill worker's
        # busy scale is theirs too (the isolated phase ran in another cluster start, a few per cent apart)
        alone = reference_ratios(acts).get("prefill")
        if alone:
            cal = dataclasses.replace(cal, prefill_pass_scale=min(alone, cal.prefill_scale))
        scale, per_step, per_output, err = fitted.busy_scale, fitted.step_s, fitted.output_s, fitted.rms
        noise = fitted.noise
    else:
        scale, per_output, noise = 1.0, 0.0, {}
        per_step, err = fit_contention(profile.with_calibration(cal), sim_config, trace, burst)
    return dataclasses.replace(cal, contention_scale=scale, contention_step_s=per_step, contention_output_s=per_output,
                               contention_requests=len(burst), contention_fit_error=err, step_noise=noise)


def refit(config, profile: Profile) -> Calibration:
    """The calibration of ``config``'s mode fitted afresh, by this module's current fit, to the
    measurements stored in ``profile`` (by ``calibrate``; a profile without them is an error)."""
    from controller.planner.profile import ProfileError
    from controller.planner.simulator import SimConfig

    run_config = calibration_config(config)
    mode, t = run_config.mode, config_threads(run_config)
    rows = profile.samples.get(isolated_key(mode, t))
    if not rows:
        raise ProfileError(f"profile has no stored calibration measurements for mode {mode!r} at {t} thread(s) "
                           f"(samples[{isolated_key(mode, t)!r}]); run `magicserve profile --calibrate-only` first")
    cal = fit(profile, mode, rows, _chunk_of(run_config), profile.samples.get(passes_key(mode, "prefill", t), []), t)
    if mode == "disaggregated":
        passes = {k: profile.samples.get(passes_key(mode, k, t), []) for k in PASS_SAMPLE_KINDS}
        cal = with_pass_scales(profile, cal, config.decode.speculation, passes)
    burst = profile.samples.get(burst_key(mode, t), [])
    if not burst:
        return cal
    # the burst's shape is not in its rows: the calibration fitted to them before says it
    before = next((c for c in profile.calibrations if c.mode == mode and c.threads == t), None)
    cal = dataclasses.replace(cal, contention_workload=before.contention_workload if before else "")
    trace = [RequestSpec(r["arrival_s"], int(r["prompt"]), int(r["output_tokens"])) for r in burst]
    burst_passes = [{"kind": kind, **row} for kind in BURST_PASS_KINDS
                    for row in profile.samples.get(passes_key(mode, burst_passes_kind(kind), t), [])]
    return with_contention(profile, cal, SimConfig.from_cluster_config(run_config), trace, burst, burst_passes)
